"""ZB-V (zero bubble, V placement, 2 stages per rank): its order against torch's
ScheduleZBVZeroBubble, validation (and what it refuses), local hand-overs, transfers under NCCL's
rules, and the simulator's makespan against the closed form on equal F, B and W."""

from __future__ import annotations

from fractions import Fraction

import pytest
from _schedule_edits import move
from pdcompile.torch_orders import torch_order

from pdcompile.errors import ScheduleError, UsageError
from pdcompile.runtime.schedules import (
    Action,
    Kind,
    check_transfers,
    format_grid,
    layout,
    make_schedule,
    parse_grid,
    transfer_plan,
    validate,
)
from pdcompile.runtime.schedules.transfers import link_order
from pdcompile.simulate import simulate_schedule

V = [[0], [1], [2], [3], [3], [2], [1], [0]]  # p = 4


def _make(p: int, m: int, steps: int = 1) -> dict[int, list[Action]]:
    return make_schedule("zb-v", [1] * (2 * p), m, virtual_stages=2, num_steps=steps)


def _compute(acts: list[Action]) -> list[str]:
    """A rank's compute actions in torch's notation (every backward of ZB-V is split: ``I``)."""
    return [str(a).replace("B", "I") for a in acts if a.kind in (Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT_GRAD)]


def test_placement() -> None:
    assert layout("zb-v", [1] * 8, 8, 1, virtual_stages=2).stage_ranks == V
    for bad in ({"virtual_stages": 3}, {"virtual_stages": 1}):
        with pytest.raises(UsageError):
            layout("zb-v", [1] * 6, 4, 1, **bad)
    with pytest.raises(UsageError, match="one replica per stage"):
        layout("zb-v", [2, 1, 1, 1], 4, 1, virtual_stages=2)


def test_golden_grid_4_ranks_8_microbatches() -> None:
    # the paper's Figure 8 (ZB-V, p = 4): rank r starts its first stage with 2(p-r)-1 forwards; the
    # last rank turns the V at once (3F0 4F0: the hand-over in memory); rank 0 runs the last stage
    # (7F0 7B0 ...) as soon as it arrives; W right after its B in the steady state, held back in the
    # cool-down (rank 3: 3B4 4B5 3B5 ... then the W's)
    assert format_grid(_make(4, 8)) == """\
rank 0: 0F0 0F1 0F2 0F3 0F4 0F5 0F6 7F0 7B0 7W0 7F1 7B1 7W1 7F2 7B2 7W2 7F3 7B3 7W3 0F7 0B0 0W0 7F4 7B4 7W4 0B1 0W1 7F5 7B5 7W5 0B2 0W2 7F6 7B6 7W6 0B3 0W3 7F7 7B7 7W7 7ST 0B4 0W4 0B5 0W5 0B6 0W6 0B7 0W7 0ST
rank 1: 1F0 1F1 1F2 1F3 1F4 6F0 1F5 6F1 6B0 6W0 6F2 6B1 6W1 6F3 6B2 6W2 1F6 1B0 1W0 6F4 6B3 6W3 1F7 1B1 1W1 6F5 6B4 6W4 1B2 1W2 6F6 6B5 6W5 1B3 1W3 6F7 6B6 6W6 1B4 6B7 1B5 1W4 1B6 1W5 1B7 1W6 6W7 6ST 1W7 1ST
rank 2: 2F0 2F1 2F2 5F0 2F3 5F1 2F4 5F2 5B0 5W0 5F3 5B1 5W1 2F5 2B0 2W0 5F4 5B2 5W2 2F6 2B1 2W1 5F5 5B3 5W3 2F7 2B2 2W2 5F6 5B4 5W4 2B3 2W3 5F7 5B5 5W5 2B4 5B6 2B5 5B7 2B6 2W4 2B7 2W5 5W6 5W7 5ST 2W6 2W7 2ST
rank 3: 3F0 4F0 3F1 4F1 3F2 4F2 3F3 4F3 4B0 4W0 3F4 3B0 3W0 4F4 4B1 4W1 3F5 3B1 3W1 4F5 4B2 4W2 3F6 3B2 3W2 4F6 4B3 4W3 3F7 3B3 3W3 4F7 4B4 4W4 3B4 4B5 3B5 4B6 3B6 4B7 3B7 3W4 4W5 4W6 4W7 4ST 3W5 3W6 3W7 3ST"""
    full = format_grid(_make(4, 8), compute_only=False)
    assert parse_grid(full) == _make(4, 8)


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5])
def test_order_is_torchs(p: int) -> None:
    """Our compute order is torch's ScheduleZBVZeroBubble's, rank by rank, for every m (including
    m < 2p - 1, where both drop the microbatches the V was filled with)."""
    for m in range(1, 13):
        ours = {r: _compute(acts) for r, acts in _make(p, m).items()}
        assert ours == torch_order("zb-v", p, m), (p, m)


def test_validates_and_completes_under_nccl_rules() -> None:
    n = 0
    for p in (1, 2, 3, 4):
        for m in range(1, 10):
            for steps in (1, 2):
                sched = _make(p, m, steps)
                reps = [1] * (2 * p)
                validate(sched, reps, m, "zb-v", num_steps=steps, virtual_stages=2)  # rule 11 included
                pl = layout("zb-v", reps, m, steps, virtual_stages=2).stage_ranks
                posts = transfer_plan(sched, reps, pl)
                for targets in (None, (), (0,)):  # the last stage is on the first's rank: all local
                    check_transfers(sched, reps, posts, targets=targets, name="zb-v", placement=pl)
                n += 1
    assert n == 72


def test_local_hand_overs_are_no_messages() -> None:
    """Rank p-1 hands stage p-1's activations to stage p (and stage p's gradients back) in memory:
    those are in no pair's order and posted by no plan, and the last stage's target never leaves
    rank 0."""
    sched = _make(4, 8)
    order = link_order(sched, [1] * 8, V)
    assert all(q != r for q, r in order)  # no pair of a rank with itself
    assert not any(m.stage in (3, 4) and m.kind in "AG" and (m.kind, m.stage) in (("A", 3), ("G", 4))
                   for seq in order.values() for m in seq)
    assert not any(m.kind == "T" for seq in order.values() for m in seq)
    posts = transfer_plan(sched, [1] * 8, V)
    posted = [a for per in posts[3] for a in per]
    assert not any(a.kind is Kind.RECV_ACT and a.stage == 4 for a in posted)
    assert not any(a.kind is Kind.RECV_GRAD and a.stage == 3 for a in posted)
    assert sum(a.kind is Kind.RECV_ACT and a.stage == 3 for a in posted) == 8  # from rank 2: posted


def test_in_flight_and_held_bounds_are_tight() -> None:
    """F done and B (or W) not, over a rank's two stages: at most min(2p, 2m) (1F1B's p on the
    first rank, counted in half-rank stages), reached on every rank once m >= 2p - 1."""
    for p, m in [(4, 8), (4, 7), (3, 4), (2, 1), (5, 12)]:
        lay = layout("zb-v", [1] * (2 * p), m, 1, virtual_stages=2)
        for r, acts in _make(p, m).items():
            n = held = peak_n = peak_held = 0
            for a in acts:
                n += (a.kind is Kind.FORWARD) - (a.kind is Kind.BACKWARD)
                held += (a.kind is Kind.FORWARD) - (a.kind is Kind.WEIGHT_GRAD)
                peak_n, peak_held = max(peak_n, n), max(peak_held, held)
            assert peak_n <= lay.rank_in_flight_bound(r) == min(2 * p, 2 * m)
            assert peak_held <= lay.rank_held_bound(r) == min(2 * p, 2 * m)
            if m >= 2 * p - 1:
                assert peak_n == peak_held == 2 * p




def _broken() -> list[tuple[str, str, dict[int, list[Action]]]]:
    good = _make(4, 8)
    out = []
    # the local hand-over received before it is sent (rank 3 runs stages 3 and 4)
    out.append(("send/recv pairs matched", "local hand-over", {**good, 3: move(good[3], "4RF2", "3SF2")}))
    out.append(("send/recv pairs matched", "local hand-over", {**good, 3: move(good[3], "3RB5", "4SB5")}))
    # a W dropped, a W after its stage's update, a W before its B
    out.append(("split backward", "6W3 is missing", {**good, 1: move(good[1], "6W3", None)}))
    out.append(("split backward", "comes after 0ST", {**good, 0: move(good[0], "0W7", None) + [Action(0, Kind.WEIGHT_GRAD, 7)]}))
    out.append(("split backward", "must come after", {**good, 2: move(good[2], "5W1", "5B1")}))
    # another stage's update in between is fine, but all W's held to the end is more than 2p held
    late = [a for a in good[0] if a.kind is not Kind.WEIGHT_GRAD]
    late = late[:-1] + [Action(0, Kind.WEIGHT_GRAD, k) for k in range(8)] + late[-1:]
    late = late[:late.index(Action(7, Kind.STEP))] + [Action(7, Kind.WEIGHT_GRAD, k) for k in range(8)] \
        + late[late.index(Action(7, Kind.STEP)):]
    out.append(("in-flight bound", "held", {**good, 0: late}))
    # a duplicated forward, a forward on the wrong rank, two forwards swapped
    dup = list(good[2])
    dup.insert(dup.index(Action(5, Kind.FORWARD, 3)) + 1, Action(5, Kind.FORWARD, 3))
    out.append(("each forward and backward once", "appears twice", {**good, 2: dup}))
    wrong = [Action(6, Kind.FORWARD, 0) if a == Action(7, Kind.FORWARD, 0) else a for a in good[0]]
    out.append(("ranks", "stage 6", {**good, 0: wrong}))
    sw = list(good[3])
    i, j = sw.index(Action(4, Kind.FORWARD, 1)), sw.index(Action(4, Kind.FORWARD, 2))
    sw[i - 1:i + 2], sw[j - 1:j + 2] = sw[j - 1:j + 2], sw[i - 1:i + 2]  # the RF F SF blocks
    out.append(("forward order", "increasing", {**good, 3: sw}))
    return out


@pytest.mark.parametrize("rule,detail,sched", _broken(), ids=lambda x: x if isinstance(x, str) else "")
def test_validate_rejects_broken(rule: str, detail: str, sched: dict[int, list[Action]]) -> None:
    with pytest.raises(ScheduleError, match=f"rule '{rule}'") as err:
        validate(sched, [1] * 8, 8, "zb-v", virtual_stages=2)
    assert detail in str(err.value)


def test_another_stages_update_between_b_and_w_is_fine() -> None:
    """Rank 1's 1W7 follows 6ST (stage 6's update): a W waits only for its own stage's update."""
    sched = _make(4, 8)
    acts = [str(a) for a in sched[1]]
    assert acts.index("1B7") < acts.index("6ST") < acts.index("1W7") < acts.index("1ST")
    validate(sched, [1] * 8, 8, "zb-v", virtual_stages=2)


def test_bubble_closed_form_equal_f_b_w() -> None:
    """F = B = W = 1 per stage (a half rank): a step takes max(6m + p - 1, 4m + 4p - 2) units.

    For m >= 2p - 1 that is 6m + p - 1: each rank computes 6m and idles p - 1 in all (rank r waits
    r forwards before its first and p - 1 - r after its last: the fill and drain of the first
    stage's pass down the V), a bubble of (p - 1) / (6m + p - 1), (p-1)/(6m) over the ideal: near
    zero, against 1F1B's (p - 1) / m on the same ranks (stages twice as large: F = B + W = 2 there).
    Below, the V is not filled: the 2(p - 1) forwards down and the 2(p - 1) B's back up are the
    critical path around each rank's 4m of F and B, 4m + 4p - 2."""
    one = Fraction(1)
    for p in (1, 2, 3, 4, 5, 6):
        for m in range(1, 16):
            res = simulate_schedule("zb-v", [1] * (2 * p), m, virtual_stages=2, forward_s=one, backward_s=2 * one,
                                    input_grad_s=one, weight_grad_s=one)
            assert res.makespan_s == max(6 * m + p - 1, 4 * m + 4 * p - 2), (p, m)
            if m >= 2 * p - 1:
                assert res.bubble_fraction == Fraction(p - 1, 6 * m + p - 1)
                one_f_one_b = simulate_schedule("flush", [1] * p, m, forward_s=2 * one, backward_s=4 * one)
                assert one_f_one_b.makespan_s == (m + p - 1) * 6
