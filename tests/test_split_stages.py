"""split-stages: the stages composed in order are the model (outputs and gradients)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pdcompile.errors import UnsupportedModelError
from pdcompile.passes.propagate_shapes import propagate_shapes
from pdcompile.passes.split_stages import even_assignment, legal_cuts, split_stages
from pdcompile.passes.trace import trace
from pdcompile.zoo import get, names

pytestmark = pytest.mark.timeout(120)


def _traced(name: str, batch: int = 4):  # noqa: ANN202
    z = get(name, batch_size=batch, seed=0)
    gm = trace(z.model, z.leaf_modules)
    propagate_shapes(gm, z.example_inputs)
    return z, gm


@pytest.mark.parametrize("name", names())
@pytest.mark.parametrize("num_stages", [2, 3, 5])
def test_stages_compose_to_the_model(name: str, num_stages: int) -> None:
    z, gm = _traced(name)
    split = split_stages(gm, even_assignment(gm, num_stages), z.model)
    assert len(split.stages) == num_stages
    want = z.model(*z.example_inputs)
    got = split.run(*z.example_inputs)
    assert torch.equal(got, want)
    # Same gradients: the stage modules share the model's parameters in this process.
    z.model.zero_grad()
    z.loss_fn(want, z.target).backward()
    ref = {n: p.grad.clone() for n, p in z.model.named_parameters()}
    z.model.zero_grad()
    z.loss_fn(split.run(*z.example_inputs), z.target).backward()
    for n, p in z.model.named_parameters():
        torch.testing.assert_close(p.grad, ref[n], rtol=1e-6, atol=1e-7, msg=n)
    # Interfaces chain: each stage's outputs are the next stage's inputs, with the same metadata.
    for a, b in zip(split.stages, split.stages[1:]):
        assert a.outputs == b.inputs and a.output_meta == b.input_meta


def test_skip_connections_pass_through_intermediate_stages() -> None:
    class Skip(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c, self.d = (nn.Linear(4, 4) for _ in range(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            return self.d(self.c(self.b(h)) + h)

    m = Skip()
    x = torch.randn(2, 4)
    gm = trace(m)
    propagate_shapes(gm, (x,))
    split = split_stages(gm, {"a": 0, "b": 1, "c": 2, "add": 3, "d": 3}, m)
    assert split.stages[1].inputs == ("a",) and split.stages[1].outputs == ("a", "b")
    assert split.stages[2].inputs == ("a", "b") and split.stages[2].outputs == ("a", "c")
    assert torch.equal(split.run(x), m(x))


def test_tied_parameters_are_recorded_across_stages() -> None:
    z, gm = _traced("gpt")
    split = split_stages(gm, even_assignment(gm, 3), z.model)
    assert len(split.tied) == 1
    (s0, n0), (s1, n1) = split.tied[0][0], split.tied[0][-1]
    assert s0 == 0 and s1 == 2
    assert split.stages[s0].param_names[n0] == split.stages[s1].param_names[n1] == "wte.weight"


def test_backward_edges_are_rejected() -> None:
    z, gm = _traced("mlp")
    a = even_assignment(gm, 2)
    first = next(iter(a))
    a[first] = 1
    with pytest.raises(UnsupportedModelError, match="contiguous"):
        split_stages(gm, a, z.model)


def test_non_tensor_values_may_not_cross_a_cut() -> None:
    class Sized(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.b(self.a(x))
            return h.reshape(x.size(0), -1)

    m = Sized()
    x = torch.randn(2, 4)
    gm = trace(m)
    propagate_shapes(gm, (x,))
    with pytest.raises(UnsupportedModelError, match="not a single tensor"):
        split_stages(gm, {"a": 0, "b": 0, "size": 0, "reshape": 1}, m)
    # legal cuts: before b (only a tensor is live) and before size; not before reshape (an int is live)
    assert legal_cuts(gm) == {1, 2}
    split = split_stages(gm, even_assignment(gm, 2), m)
    assert torch.equal(split.run(x), m(x))
