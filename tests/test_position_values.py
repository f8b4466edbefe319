"""Values that depend only on positions are computed again where they are read, not sent (#28 item 4).

An exported Hugging Face Llama makes its causal mask and rotary cos/sin from ``arange`` and a buffer:
split in two, its first stage used to send them with every microbatch. Now the second stage rebuilds
them; only the hidden states cross. The split computes bitwise what the one with the values sent
computes (output and every gradient), which is bitwise what the unsplit model computes.
"""

from __future__ import annotations

import pytest
import torch

from pdcompile.passes.export_frontend import export_trace
from pdcompile.passes.propagate_shapes import propagate_shapes
from pdcompile.passes.split_stages import StageSplit, even_assignment, rebuildable, split_stages

transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.timeout(120)]


def llama() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32))


def _grads(split: StageSplit, model: torch.nn.Module, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = split.run(x)
    (out * w).sum().backward()
    return out.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def test_llama_sends_only_hidden_states_and_computes_bitwise_the_same() -> None:
    model = llama()
    x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    gm = export_trace(model, (x,))
    propagate_shapes(gm, (x,))
    assign = even_assignment(gm, 2)
    sent = split_stages(gm, assign, model, rebuild=False)
    rebuilt = split_stages(gm, assign, model)

    free = {n.name for n in rebuildable(gm)}
    before, after = sent.stages[0], rebuilt.stages[0]
    moved = [n for n in before.outputs if n in free]
    assert len(moved) == 3  # the causal mask, rotary cos and sin
    assert after.outputs == tuple(n for n in before.outputs if n not in free)
    assert all(m.requires_grad for m in after.output_meta)  # what still crosses: hidden states
    assert sum(m.nbytes for m in after.output_meta) < sum(m.nbytes for m in before.output_meta)
    assert rebuilt.stages[1].inputs == after.outputs
    assert not any(n in free for n in rebuilt.stages[1].inputs)
    # the second stage makes them itself: the ops that made them appear in its graph
    made_here = {n.name for n in rebuilt.stages[1].gm.graph.nodes} & set(moved)
    assert made_here == set(moved)

    w = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(2))
    out_sent, grads_sent = _grads(sent, model, x, w)
    out_rebuilt, grads_rebuilt = _grads(rebuilt, model, x, w)
    assert torch.equal(out_sent, out_rebuilt)
    assert grads_sent.keys() == grads_rebuilt.keys() == {n for n, _ in model.named_parameters()}
    for n, g in grads_sent.items():
        assert torch.equal(g, grads_rebuilt[n]), n
    with torch.no_grad():
        assert torch.equal(out_rebuilt, model(x).logits)


def test_values_written_in_place_or_drawn_at_random_are_sent() -> None:
    """A buffer that forward updates, and a random draw, are not rebuilt (they would differ); positions are."""

    class Stateful(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin1, self.lin2 = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
            self.register_buffer("count", torch.zeros(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.count.add_(1)
            c = self.count * 2
            noise = torch.rand(4)
            positions = torch.arange(4.0) * 0.5
            h = self.lin1(x)
            return self.lin2(h) + c + noise + positions

    model = Stateful()
    x = torch.randn(2, 4)
    gm = export_trace(model, (x,))
    free = rebuildable(gm)
    by_op = {n.target._schema.name: n for n in free}  # type: ignore[union-attr]
    assert set(by_op) == {"aten::arange", "aten::mul"} and len(free) == 2, by_op
    assert by_op["aten::mul"].args[0] is by_op["aten::arange"]
