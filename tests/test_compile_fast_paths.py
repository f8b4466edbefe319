"""The compile's shortcuts give what the long way gives (#28: compile time and memory on meta).

- annotate-costs (analytic, and the symbolic fit) counts the FLOPs of structurally identical calls once
  (``call_key``): every node's cost and expressions equal those counted node by node, on a Hugging Face Llama (export), the zoo's GPT and a
  conv net (fx), and on calls that differ only in what :class:`NodeCall` sees (``x * x`` vs ``x * y``,
  a parameter vs an activation, in-place ops, scalars 1 vs 1.0 vs True).
- trace-loss on a meta target traces on meta tensors (no logits in memory): the loss program equals the
  one traced on values on the CPU, and a loss only values or the CPU can trace falls back to that path,
  with the same result or the same error. One known exception, checked: ``F.one_hot`` reads values on
  the CPU but not on meta, so meta traces it with make_fx where the CPU needs torch.fx (same loss).
- the trace pass's "auto" front end lists fx's problems only when it reports them: the graph is the same,
  and the error when both front ends fail still lists both.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pdcompile.api import pdcompile
from pdcompile.errors import UnsupportedModelError
from pdcompile.passes import annotate_costs as ac
from pdcompile.passes.costs import symbolic
from pdcompile.passes.propagate_shapes import propagate_shapes
from pdcompile.passes.trace import trace_any
from pdcompile.passes.trace_loss import loss_program
from pdcompile.zoo import get
from pdcompile.zoo.losses import SequenceCrossEntropy

pytestmark = [pytest.mark.timeout(240)]


def _llama(layers: int = 3, vocab: int = 64) -> nn.Module:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   use_cache=False)
    return transformers.LlamaForCausalLM(cfg)


class Twins(nn.Module):
    """Calls that look alike but differ in what a node's backward sees."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))
        self.register_buffer("b", torch.randn(8, 8))
        self.conv1, self.conv2 = nn.Conv2d(2, 2, 3, padding=1), nn.Conv2d(2, 2, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.w  # a parameter
        z = y @ self.b  # a buffer: no weight gradient
        s = (z * z) + (y * z)  # one input twice vs two inputs
        s = s * 1 + s * 1.0 + s * True  # scalars of three types
        t = torch.relu_(s.clone())  # in place
        i = self.conv1(t.view(-1, 2, 2, 8)) + self.conv2(t.view(-1, 2, 2, 8))  # modules: not keyed
        return torch.mm(i.reshape(4, 8), self.w) + torch.mm(i.reshape(4, 8), y.t() @ y)


def _costs(gm: torch.fx.GraphModule, x: torch.Tensor, cached: bool, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    with monkeypatch.context() as m:
        if not cached:  # every node counted on its own
            m.setattr(ac, "call_key", lambda node, values: None)
            m.setattr(symbolic, "call_key", lambda node, values: None)
        ac.annotate_costs(gm, (x,), mode="analytic", device_spec="h100", symbolic=True, progress=False)
    return [(n.name, dataclasses.asdict(n.meta["pd.cost"])) for n in gm.graph.nodes]


@pytest.mark.parametrize("case", ["llama-export", "gpt-fx", "twins", "llama-meta"])
def test_analytic_costs_with_twins_counted_once_equal_counting_every_node(
        case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if case.startswith("llama"):
        model, x = _llama(), torch.randint(0, 64, (2, 8))
        if case == "llama-meta":
            model, x = model.to("meta"), x.to("meta")
        gm = trace_any(model, (x,), frontend="export")
    elif case == "gpt-fx":
        z = get("gpt", batch_size=2)
        model, x = z.model, z.example_inputs[0]
        gm = trace_any(model, (x,), z.leaf_modules, frontend="fx")
    else:
        model, x = Twins(), torch.randn(4, 8)
        gm = trace_any(model, (x,), frontend="fx")
    propagate_shapes(gm, (x,))
    hits: list[bool] = []
    real_key = ac.call_key
    counted_keys: set[Any] = set()

    def spy(node: torch.fx.Node, values: dict[torch.fx.Node, Any]) -> Any:
        key = real_key(node, values)
        hits.append(key is not None and key in counted_keys)
        if key is not None:
            counted_keys.add(key)
        return key

    monkeypatch.setattr(ac, "call_key", spy)
    fast = _costs(gm, x, True, monkeypatch)
    slow = _costs(gm, x, False, monkeypatch)
    assert fast == slow
    assert any(c["forward_flops"] > 0 for _, c in fast)
    if case.startswith("llama"):  # the second and third decoder layers are their first's twins
        assert sum(hits) > len(hits) / 3


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 10))


class ClippedCE(nn.Module):
    def forward(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(out, target)
        return loss.clamp(max=10.0) if loss > 10 else loss


class Trainable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.scale * F.cross_entropy(out, target)


def _weighted(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return 2.0 * F.cross_entropy(out, target, weight=torch.linspace(0.5, 1.5, 10))  # a CPU tensor of its own


def _hasattr(out: Any, target: torch.Tensor) -> torch.Tensor:
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits.flatten(0, -2), target.flatten())


def _one_hot(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out.softmax(-1), F.one_hot(target, 10).float())


MLP_LOSSES = {
    "ce": nn.CrossEntropyLoss(label_smoothing=0.1), "weighted": _weighted, "probe": _hasattr,
    "mse": lambda o, t: F.mse_loss(o.softmax(-1), o.detach().softmax(-1) * 0 + t.float().unsqueeze(1) / 10),
    "clipped": ClippedCE(), "trainable": Trainable(), "item": lambda o, t: F.cross_entropy(o, t) / o.abs().max().item(),
    "not-scalar": lambda o, t: F.cross_entropy(o, t, reduction="none"), "one-hot": _one_hot,
}
LLAMA_LOSSES = {"sequence-ce": SequenceCrossEntropy(), "probe": _hasattr,
                "logits": lambda o, t: F.cross_entropy(o.logits.flatten(0, 1), t.flatten())}


def _outcome(fn: Any, last: torch.fx.GraphModule, target: torch.Tensor, key: str | None) -> Any:
    try:
        prog = loss_program(fn, last, target, key)
    except Exception as e:  # noqa: BLE001 - the error is the outcome
        return type(e).__name__, str(e)
    state = {k: v.tolist() for k, v in prog.traced.gm.state_dict().items()} if prog.traced is not None else None
    return str(prog), prog.entry, state


@pytest.mark.parametrize("model_name", ["mlp", "llama"])
def test_a_loss_traced_on_meta_equals_the_loss_traced_on_values(model_name: str) -> None:
    if model_name == "mlp":
        model, x, y, losses = _mlp(), torch.randn(4, 16), torch.randint(0, 10, (4,)), MLP_LOSSES
    else:
        model, x, y, losses = _llama(2), torch.randint(0, 64, (4, 8)), torch.randint(0, 64, (4, 8)), LLAMA_LOSSES
    pipe = pdcompile(model, example_inputs=(x,), example_target=y, loss_fn=SequenceCrossEntropy()
                     if model_name == "llama" else nn.CrossEntropyLoss(), stages=2, num_microbatches=2,
                     cost_mode="analytic")
    last, micro = pipe.split.stages[-1].gm, y[:2]
    for name, fn in losses.items():
        on_cpu = _outcome(fn, last, micro, pipe.state.output_key)
        on_meta = _outcome(fn, last, micro.to("meta"), pipe.state.output_key)
        if name != "one-hot":
            assert on_meta == on_cpu, name
            continue
        # F.one_hot reads the target's values on the CPU (tracing falls back to torch.fx there) and takes a
        # value-free path on meta (make_fx traces it): another program, the same loss
        assert "traced by fx" in on_cpu[0] and "traced by make_fx" in on_meta[0]
        out = pipe.split.run(x[:2])
        got = [loss_program(fn, last, t, None).traced.gm(out, micro) for t in (micro, micro.to("meta"))]
        torch.testing.assert_close(got[1], got[0], rtol=0, atol=0)
        torch.testing.assert_close(got[0], fn(out, micro), rtol=0, atol=0)
    errors = [n for n, fn in losses.items() if len(_outcome(fn, last, micro, pipe.state.output_key)) == 2]
    assert (errors == ["trainable", "item", "not-scalar"]) if model_name == "mlp" else not errors


def test_auto_front_end_lists_fx_problems_only_when_both_fail() -> None:
    model, x = _llama(2), torch.randint(0, 64, (2, 8))
    auto, export = trace_any(model, (x,)), trace_any(model, (x,), frontend="export")
    assert auto.code == export.code

    class Neither(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.sum() > 0:  # data-dependent: fx and torch.export both refuse
                return x * 2
            return x

    with pytest.raises(UnsupportedModelError, match=r"neither front end(.|\n)*torch\.fx: (.|\n)*construct"):
        trace_any(Neither(), (torch.randn(2, 3),))
