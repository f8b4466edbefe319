"""Models as users of other maintained libraries build them (docs/limitations.md lists the survey).

A vision transformer's ``forward(x, attn_mask=None, is_causal=False)`` (timm's ``VisionTransformer``): the
parameters the example inputs do not give keep their defaults in the trace, so the branch taken is the one
``model(x)`` takes and no stage input is left without a value (it crashed ``emit``). Then models as pasted, with
their own losses, optimizers and initialisers, split in 2 stages: equal to the unsplit model, and trained on 2
ranks equal to single-process gradient accumulation.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pdcompile import api
from pdcompile.errors import UnsupportedModelError
from pdcompile.passes.propagate_shapes import propagate_shapes
from pdcompile.passes.split_stages import even_assignment, split_stages
from pdcompile.passes.trace import trace, trace_any

pytestmark = [pytest.mark.timeout(300)]


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

    pipe = api.pdcompile(model, example_inputs=(x,), example_target=torch.randint(0, 3, (4,)),
                         loss_fn=torch.nn.CrossEntropyLoss(), stages=2, schedule="flush", num_microbatches=2)
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
