"""Models as users of other maintained libraries build them (docs/limitations.md lists the survey).

A vision transformer's ``forward(x, attn_mask=None, is_causal=False)`` (timm's ``VisionTransformer``): the
parameters the example inputs do not give keep their defaults in the trace, so the branch taken is the one
``model(x)`` takes and no stage input is left without a value (it crashed ``emit``). Then models as pasted, with
their own losses, optimizers and initialisers, split in 2 stages: equal to the unsplit model, and trained on 2
ranks equal to single-process gradient accumulation.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from pdcompile import api
from pdcompile.errors import UnsupportedModelError
from pdcompile.passes.propagate_shapes import propagate_shapes
from pdcompile.passes.split_stages import even_assignment, split_stages
from pdcompile.passes.trace import trace, trace_any

# one worker for the file (tests/conftest.py): a compile two tests read (_survey_compile) is made once
pytestmark = [pytest.mark.timeout(300), pytest.mark.xdist_group("model_survey")]


class Block(torch.nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm, self.qkv, self.proj = torch.nn.LayerNorm(dim), torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(self.norm(x)).reshape(b, n, 3, 2, c // 2).permute(2, 0, 3, 1, 4).unbind(0)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal)
        return x + self.proj(a.transpose(1, 2).reshape(b, n, c))


class MaskableViT(torch.nn.Module):
    """timm's ``VisionTransformer.forward``: blocks one by one when a mask or causality is asked for."""

    def __init__(self, dim: int = 16, depth: int = 2, classes: int = 3) -> None:
        super().__init__()
        self.patch = torch.nn.Conv2d(3, dim, 8, 8)
        self.pos = torch.nn.Parameter(torch.randn(1, 16, dim) * 0.02)
        self.blocks = torch.nn.Sequential(*(Block(dim) for _ in range(depth)))
        self.head = torch.nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
        x = self.patch(x).flatten(2).transpose(1, 2) + self.pos
        if attn_mask is not None or is_causal:
            for blk in self.blocks:
                x = blk(x, attn_mask=attn_mask, is_causal=is_causal)
        else:
            x = self.blocks(x)
        return self.head(x.mean(1))


def images(seed: int, n: int = 4) -> torch.Tensor:
    return torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


def test_parameters_not_given_keep_their_defaults_in_the_trace(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, x = MaskableViT(), images(0)
    gm = trace_any(model, (x,))  # fx, as pdcompile() traces it
    assert [n.target for n in gm.graph.nodes if n.op == "placeholder"] == ["x"]
    assert not any(n.op == "call_module" and n.target.startswith("blocks.") and len(n.args) + len(n.kwargs) > 1
                   for n in gm.graph.nodes)  # the unmasked branch: blocks(x), not blk(x, attn_mask=...)
    torch.testing.assert_close(gm(images(1)), model(images(1)), rtol=0, atol=0)
    given = trace(model, inputs=2)  # a mask given: it is an input, and the masked branch is traced
    assert [n.target for n in given.graph.nodes if n.op == "placeholder"] == ["x", "attn_mask"]
    mask = torch.zeros(4, 2, 16, 16)
    torch.testing.assert_close(given(images(1), mask), model(images(1), mask), rtol=0, atol=0)

    pipe = _survey_compile("timm_style_vit")  # this model, 2 stages: the compile its training test launches
    prog = pipe.emit(tmp_path / "prog")  # crashed: the stage input attn_mask had no tensor metadata
    plan = json.loads((prog / "plan.json").read_text())
    assert [i["name"] for i in plan["stages"][0]["inputs"]] == ["x"]


def test_an_input_without_a_tensor_value_is_refused_in_one_line() -> None:
    """Traced without the count of inputs, forward's defaults are inputs with no value: named, not a crash."""
    model, x = MaskableViT(), images(0, 2)
    gm = trace(model)
    propagate_shapes(gm, (x,))
    with pytest.raises(UnsupportedModelError, match=r"input 'attn_mask' has no tensor value.*Fix:") as e:
        split_stages(gm, even_assignment(gm, 2), model)
    assert "\n" not in str(e.value)


def test_optimizers_as_written_rebuild_on_the_ranks() -> None:
    """plan.json holds the optimizer's class and settings; the ranks rebuild it from them. torch's AdamW keeps
    ``decoupled_weight_decay`` among its settings but takes no such argument: every rank failed to build it."""
    from pdcompile.passes.codegen import optimizer_spec
    from pdcompile.runtime.program import build

    p = torch.nn.Parameter(torch.zeros(2))
    for make in (lambda q: torch.optim.AdamW(q, lr=8e-4, betas=(0.9, 0.95), weight_decay=0.1),
                 lambda q: torch.optim.Adam(q, lr=1e-3, decoupled_weight_decay=True),
                 lambda q: torch.optim.SGD(q, lr=0.05, momentum=0.9, nesterov=True)):
        want = make([p])
        got = build(json.loads(json.dumps(optimizer_spec(make).to_json())), [p])
        assert type(got) is type(want) and got.defaults == want.defaults
    with pytest.raises(UnsupportedModelError, match=r"differs in lr\. Fix:"):  # a tensor lr is not dropped silently
        optimizer_spec(lambda q: torch.optim.Adam(q, lr=torch.tensor(1e-3)))

    def no_decay_on_vectors(q: Any) -> torch.optim.Optimizer:  # timm's and nanoGPT's habit, by shape
        q = list(q)
        return torch.optim.AdamW([{"params": [t for t in q if t.ndim >= 2]},
                                  {"params": [t for t in q if t.ndim < 2], "weight_decay": 0.0}], weight_decay=0.05)

    with pytest.raises(UnsupportedModelError, match=r"a parameter group sets its own weight_decay.*Fix:"):
        optimizer_spec(no_decay_on_vectors)  # not dropped silently


# -- models as pasted, trained on 2 ranks ------------------------------------------------------------------------

FIXTURES = Path(__file__).resolve().parent / "fixtures"
STEPS, MICRO = 3, 2


def torchtitan_llama() -> Any:
    """torchtitan's ``models/llama/model.py`` as published (tests/fixtures/torchtitan_llama/README.md), its one
    torchtitan import (``build_norm``) resolved to the vendored ``norms.py``."""
    if "torchtitan_llama_model" in sys.modules:
        return sys.modules["torchtitan_llama_model"]
    saved = {k: sys.modules.get(k) for k in ("torchtitan", "torchtitan.models", "torchtitan.models.norms")}
    try:
        for name in ("torchtitan", "torchtitan.models"):
            sys.modules[name] = types.ModuleType(name)
        norms = _load(FIXTURES / "torchtitan_llama" / "norms.py", "torchtitan.models.norms")
        sys.modules["torchtitan.models.norms"] = norms
        return _load(FIXTURES / "torchtitan_llama" / "model.py", "torchtitan_llama_model")
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v


def _load(path: Path, name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def cross_entropy_loss(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Common cross-entropy loss function for Transformer models training."""  # torchtitan's, as published
    return torch.nn.functional.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))


def llama() -> torch.nn.Module:
    tt = torchtitan_llama()
    torch.manual_seed(0)  # the constructor calls init_weights: normal embeddings, depth-scaled truncated normals
    return tt.Transformer(tt.ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=8,
                                       multiple_of=16))


def llama_batches() -> list[tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
    gens = [torch.Generator().manual_seed(100 + i) for i in range(STEPS)]
    return [((torch.randint(0, 64, (4, 8), generator=g),), torch.randint(0, 64, (4, 8), generator=g)) for g in gens]


class BatchNormAct2d(torch.nn.BatchNorm2d):
    """A norm + activation written as timm writes its ``BatchNormAct2d``: BatchNorm's forward spelled out, so it is
    traced through, and its step counter advanced in forward (``num_batches_tracked.add_(1)``)."""

    def __init__(self, channels: int) -> None:
        super().__init__(channels)
        self.act = torch.nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
        x = F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, self.training, factor,
                         self.eps)
        return self.act(x)


class BasicBlock(torch.nn.Module):
    """torchvision's ResNet block, in plain torch: in-place ReLUs, a projection shortcut."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(cout)
        self.relu = torch.nn.ReLU(inplace=True)
        self.conv2 = torch.nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(cout)
        self.downsample = None if stride == 1 and cin == cout else torch.nn.Sequential(
            torch.nn.Conv2d(cin, cout, 1, stride, bias=False), torch.nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class SmallResNet(torch.nn.Module):
    """torchvision's ResNet layout and initialisation (kaiming_normal_ convs, zero-initialised last norms of the
    blocks: ``zero_init_residual``), a timm-style BatchNormAct2d stem, and ``torch.flatten`` before the head."""

    def __init__(self, classes: int = 3) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 8, 3, 1, 1, bias=False)
        self.bn1 = BatchNormAct2d(8)
        self.layer1 = BasicBlock(8, 8, 1)
        self.layer2 = BasicBlock(8, 16, 2)
        self.avgpool = torch.nn.AdaptiveAvgPool2d((1, 1))
        self.fc = torch.nn.Linear(16, classes)
        for m in self.modules():
            if isinstance(m, torch.nn.Conv2d):
                torch.nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, torch.nn.BatchNorm2d):
                torch.nn.init.constant_(m.weight, 1)
                torch.nn.init.constant_(m.bias, 0)
        for m in self.modules():
            if isinstance(m, BasicBlock):
                torch.nn.init.constant_(m.bn2.weight, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer2(self.layer1(self.bn1(self.conv1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet() -> torch.nn.Module:
    torch.manual_seed(0)
    return SmallResNet()


def vit() -> torch.nn.Module:
    torch.manual_seed(0)
    return MaskableViT()


def image_batches() -> list[tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
    gens = [torch.Generator().manual_seed(100 + i) for i in range(STEPS)]
    return [((torch.randn(4, 3, 32, 32, generator=g),), torch.randint(0, 3, (4,), generator=g)) for g in gens]


def _adamw(params: Any) -> torch.optim.Optimizer:  # torchtitan's defaults
    return torch.optim.AdamW(params, lr=8e-4, betas=(0.9, 0.95), weight_decay=0.1)


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


SURVEY: dict[str, tuple[Callable[[], torch.nn.Module], Callable[[], list[Any]], Callable[..., torch.Tensor],
                        Callable[[Any], torch.optim.Optimizer]]] = {
    "torchtitan_llama": (llama, llama_batches, cross_entropy_loss, _adamw),
    "torchvision_resnet": (resnet, image_batches, torch.nn.CrossEntropyLoss(), _sgd),
    # SGD: the keys' bias has no gradient but rounding's, which Adam scales up to a step of lr
    "timm_style_vit": (vit, image_batches, torch.nn.CrossEntropyLoss(label_smoothing=0.1), _sgd),
}


@functools.lru_cache(maxsize=None)
def _survey_compile(name: str) -> api.CompiledPipeline:
    """The survey model ``name`` compiled as pasted: 2 stages, flush, its own loss and optimizer (read, emitted,
    never changed by the tests that share it)."""
    factory, batches, loss_fn, opt = SURVEY[name]
    (x,), target = batches()[0]
    return api.pdcompile(factory(), example_inputs=(x,), example_target=target, loss_fn=loss_fn, optimizer=opt,
                         stages=2, schedule="flush", num_microbatches=MICRO)


@pytest.mark.multiproc
@pytest.mark.parametrize("name", list(SURVEY))
def test_two_ranks_train_as_one_process_does(tmp_path: Path, name: str) -> None:
    """3 steps of 2 microbatches on 2 stages, one rank each: every parameter and buffer (BatchNorm's statistics
    and step counters too) ends as single-process gradient accumulation leaves it, on one thread as the ranks run.
    """
    from _ranks import run_ranks

    from pdcompile.merge import merge_weights
    from pdcompile.reference import train_sync
    from pdcompile.runtime.data import save_batches

    factory, batches, loss_fn, opt = SURVEY[name]
    data = batches()
    pipe = _survey_compile(name)
    assert len(pipe.split.stages) == 2
    save_batches(data, STEPS, tmp_path / "data.pt")
    prog = pipe.emit(tmp_path / "prog", data={"factory": "pdcompile.runtime.data:from_file",
                                              "kwargs": {"path": str(tmp_path / "data.pt")}})
    rc, log = run_ranks(prog, 2, ["--steps", str(STEPS), "--save-final", str(tmp_path / "final"), "--timeout", "90"],
                        timeout=200)
    assert rc == 0, log[-3000:]
    got = merge_weights(prog, tmp_path / "final")

    ref = factory()
    initial = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank runs (OMP_NUM_THREADS=1): BatchNorm nets amplify rounding
    try:
        train_sync(ref, loss_fn, opt(ref.parameters()), data, steps=STEPS, num_microbatches=MICRO)
    finally:
        torch.set_num_threads(threads)
    want = ref.state_dict()
    assert set(got) == set(want), set(got) ^ set(want)
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {k}: {m}")
    moved = [k for k, v in got.items() if not torch.equal(v, initial[k])]
    assert len(moved) > len(want) // 2
    if name == "torchvision_resnet":  # the counter advanced in the traced-through forward, once a microbatch
        assert int(got["bn1.num_batches_tracked"]) == STEPS * MICRO
