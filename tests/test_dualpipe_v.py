"""DualPipeV (V placement, F&B pairs run as F then B): its order against torch's
ScheduleDualPipeV, validation (and what it refuses), transfers under NCCL's rules, the in-flight
bound, and the simulator's makespan against the closed form."""

from __future__ import annotations

from fractions import Fraction

import pytest
from _schedule_edits import move
from pdcompile.torch_orders import torch_order

from pdcompile.errors import ScheduleError, UsageError
from pdcompile.runtime.schedules import Action, Kind, check_transfers, format_grid, layout, make_schedule, validate
from pdcompile.simulate import simulate_schedule


def _make(p: int, m: int, steps: int = 1) -> dict[int, list[Action]]:
    return make_schedule("dualpipe-v", [1] * (2 * p), m, virtual_stages=2, num_steps=steps)


def _torch_notation(acts: list[Action]) -> list[str]:
    """A rank's compute actions as torch writes them: a B whose W follows is ``I``, else ``B``."""
    split = {(a.stage, a.mb) for a in acts if a.kind is Kind.WEIGHT_GRAD}
    return [f"{a.stage}{'I' if (a.stage, a.mb) in split else 'B'}{a.mb}" if a.kind is Kind.BACKWARD else str(a)
            for a in acts if a.kind in (Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT_GRAD)]


def _sequential(cells: list[str]) -> list[str]:
    """torch's overlapped ``(F;B)OVERLAP_F_B`` as its F, then its B (what our runtime runs)."""
    out: list[str] = []
    for c in cells:
        out += c[1:c.index(")")].split(";") if c.startswith("(") else [c]
    return out


def test_golden_grid_2_ranks_4_microbatches() -> None:
    # torch's order for p = 2, m = 4 (DualPipe's figure, cut in half): rank 0 turns the V with a
    # split 3B0 3W0, then F&B pairs (0F3 3B1, 3F2 0B0, ...), the cool-down split again (0B2 0W2)
    assert format_grid(_make(2, 4)) == """\
rank 0: 0F0 0F1 0F2 3F0 3B0 3W0 3F1 0F3 3B1 3F2 0B0 3B2 3F3 0B1 3B3 3ST 0B2 0W2 0B3 0W3 0ST
rank 1: 1F0 2F0 1F1 2F1 1F2 2B0 2F2 1B0 1F3 2B1 2F3 1B1 2B2 1B2 2B3 1B3 2W3 2ST 1W3 1ST"""


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5])
def test_order_is_torchs(p: int) -> None:
    for m in range(2 * p, 2 * p + 8):
        ours = {r: _torch_notation(acts) for r, acts in _make(p, m).items()}
        assert ours == {r: _sequential(c) for r, c in torch_order("dualpipe-v", p, m).items()}, (p, m)


def test_needs_as_many_microbatches_as_stages() -> None:
    with pytest.raises(UsageError, match="at least as many microbatches as stages"):
        _make(3, 5)
    with pytest.raises(UsageError):
        layout("dualpipe-v", [1] * 6, 6, 1, virtual_stages=3)


def test_validates_and_completes_under_nccl_rules() -> None:
    n = 0
    for p in (1, 2, 3, 4):
        for m in range(2 * p, 2 * p + 5):
            for steps in (1, 2):
                sched, reps = _make(p, m, steps), [1] * (2 * p)
                validate(sched, reps, m, "dualpipe-v", num_steps=steps, virtual_stages=2)  # rule 11 included
                pl = layout("dualpipe-v", reps, m, steps, virtual_stages=2).stage_ranks
                for targets in (None, ()):
                    check_transfers(sched, reps, targets=targets, name="dualpipe-v", placement=pl)
                n += 1
    assert n == 40


def test_in_flight_bound_is_tight() -> None:
    """2p + 1 on every rank: the warm-up's 2p, and each pair's F before its B."""
    for p, m in [(2, 4), (3, 6), (3, 9), (4, 8), (5, 13)]:
        lay = layout("dualpipe-v", [1] * (2 * p), m, 1, virtual_stages=2)
        for r, acts in _make(p, m).items():
            n = peak = 0
            for a in acts:
                n += (a.kind is Kind.FORWARD) - (a.kind is Kind.BACKWARD)
                peak = max(peak, n)
            assert peak == lay.rank_in_flight_bound(r) == 2 * p + 1, (p, m, r)




def test_validate_rejects_broken() -> None:
    good = _make(3, 6)
    cases = [
        ("send/recv pairs matched", "local hand-over", {**good, 2: move(good[2], "3RF1", "2SF1")}),
        ("split backward", "must come after", {**good, 0: move(good[0], "0W4", "0B4")}),
        ("split backward", "comes after 5ST", {**good, 0: move(good[0], "5W1", "0B3")}),  # 0B3 is after 5ST
        ("in-flight bound", "8 microbatches in flight", {**good, 1: move(move(move(
            good[1], "1SF5", "1RB0"), "1F5", "1SF5"), "1RF5", "1F5")}),  # 1F5 before 1B0: one more in flight
        ("each forward and backward once", "missing", {**good, 2: move(good[2], "2B3", None)}),
    ]
    for rule, detail, sched in cases:
        with pytest.raises(ScheduleError, match=f"rule '{rule}'") as err:
            validate(sched, [1] * 6, 6, "dualpipe-v", virtual_stages=2)
        assert detail in str(err.value), (rule, str(err.value)[:300])


def test_bubble_closed_form() -> None:
    """Per stage F = f, a split backward's halves B = b and W = w, a full one b + w; an F&B pair run
    as F then the full B, F&B = f + b + w. A step takes 2m (f + b + w) + bubble, the bubble the same
    for every m >= 2p: (p - 1) f at f = b = w (6m + p - 1 units per step, ZB-V's), which is
    DualPipe's (p - 1)(F&B + B - 3W) with p ranks for its PP/2; that formula holds on the cases
    below (f = b = w, or b = w <= f, ...), not in general here: with w = 0 the bubble is
    (p - 1)(f + b), the 1F1B-like fill and drain of an F&B that hides nothing."""
    one = Fraction(1)
    for p in (1, 2, 3, 4, 5):
        for m in range(2 * p, 2 * p + 6):
            def run(f: int, b: int, w: int) -> Fraction:
                res = simulate_schedule("dualpipe-v", [1] * (2 * p), m, virtual_stages=2, forward_s=f * one,
                                        backward_s=(b + w) * one, input_grad_s=b * one, weight_grad_s=w * one)
                return res.makespan_s - 2 * m * (f + b + w)

            assert run(1, 1, 1) == p - 1
            for f, b, w in [(1, 1, 1), (2, 2, 2), (3, 2, 2), (2, 1, 1), (4, 3, 3)]:
                fb = f + b + w
                assert run(f, b, w) == (p - 1) * (fb + b - 3 * w), (p, m, f, b, w)
            assert run(1, 1, 0) == (p - 1) * 2 and run(2, 2, 0) == (p - 1) * 4
