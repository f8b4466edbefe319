"""The torch.profiler cross-check: attribution of a whole step's time to the traced graph's nodes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pdcompile.passes.annotate_costs import annotate_costs
from pdcompile.passes.propagate_shapes import propagate_shapes
from pdcompile.passes.trace import trace
from pdcompile.profiler_check import profiler_cross_check, summary

pytestmark = pytest.mark.timeout(120)


class Lopsided(nn.Module):
    """One heavy Linear, one light ReLU, one light Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.big = nn.Linear(512, 512)
        self.small = nn.Linear(512, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.small(torch.relu(self.big(x)))


def test_cross_check_attributes_forward_and_backward_to_nodes() -> None:
    torch.manual_seed(0)
    model, x = Lopsided(), torch.randn(256, 512)
    gm = trace(model)
    propagate_shapes(gm, (x,))
    annotate_costs(gm, (x,), symbolic=False, progress=False, repeats=3)
    check = profiler_cross_check(gm, (x,), loss_fn=lambda out, t: out.pow(2).mean(), steps=2)
    rows = {r.node: r for r in check.rows}
    assert set(rows) == {"big", "relu", "small"}
    # the 512x512 matmul on 256 rows dominates both directions, in the profiler as in our profile
    assert rows["big"].profiler_forward_s > 3 * rows["small"].profiler_forward_s
    assert rows["big"].profiler_backward_s > 3 * rows["small"].profiler_backward_s
    assert rows["big"].measured_s is not None and rows["big"].measured_s > 3 * rows["small"].measured_s
    # parameter gradients accumulate outside any node; the step holds all of it
    assert check.accumulate_grad_s > 0
    assert check.step_s > sum(r.profiler_s for r in check.rows)
    assert [r.node for r in check.heavy(0.5)] == ["big"]
    sm = summary(check)
    assert sm["heavy"] >= 1 and sm["profiler_sum_s"] == pytest.approx(sum(r.profiler_s for r in check.rows))


def test_cross_check_without_a_loss_sums_the_outputs() -> None:
    gm = trace(Lopsided())
    check = profiler_cross_check(gm, (torch.randn(8, 512),), steps=1, warmup=1)
    assert all(r.measured_s is None for r in check.rows)  # no annotate-costs ran
    assert all(r.profiler_backward_s > 0 for r in check.rows if r.node != "relu") and check.step_s > 0
