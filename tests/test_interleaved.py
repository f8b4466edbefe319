"""Virtual stages: interleaved 1F1B and looped BFS (schedule layer and simulator)."""

from __future__ import annotations

from fractions import Fraction

import pytest

from pdcompile.errors import ScheduleError, UsageError
from pdcompile.runtime.schedules import (
    Action,
    Kind,
    VIRTUAL_SCHEDULES,
    check_transfers,
    format_grid,
    layout,
    make_schedule,
    parse_grid,
    stage_ranks,
    transfer_plan,
    validate,
)
from pdcompile.simulate import simulate_schedule

INTERLEAVED = ["interleaved-1f1b", "looped-bfs"]  # stage s on rank s % p (the V shapes: test_zero_bubble_v.py)
CONFIGS = [(p, v, m) for p in (1, 2, 3, 4) for v in (1, 2, 3) for m in range(1, 10)]


def _ok(name: str, p: int, v: int, m: int) -> bool:
    rounds = max(1, m // p)
    return name == "looped-bfs" or m % rounds == 0


def test_placement_default_and_interleaved() -> None:
    assert stage_ranks([2, 1]) == [[0, 1], [2]]
    assert stage_ranks([1] * 4, [[0], [1], [0], [1]]) == [[0], [1], [0], [1]]
    with pytest.raises(UsageError):
        stage_ranks([1, 1], [[0], [2]])  # rank 1 unused
    assert layout("interleaved-1f1b", [1] * 6, 3, 1, virtual_stages=2).stage_ranks == [[s % 3] for s in range(6)]
    with pytest.raises(UsageError):
        layout("flush", [1] * 4, 4, 1, virtual_stages=2)
    with pytest.raises(UsageError):
        layout("interleaved-1f1b", [1] * 5, 4, 1, virtual_stages=2)


GOLDEN = {
    "interleaved-1f1b": """\
rank 0: 0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 2ST 0B2 0B3 0ST
rank 1: 1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 3ST 1B2 1B3 1ST""",
    "looped-bfs": """\
rank 0: 0F0 0F1 0F2 0F3 2F0 2F1 2F2 2F3 2B3 2B2 2B1 2B0 2ST 0B3 0B2 0B1 0B0 0ST
rank 1: 1F0 1F1 1F2 1F3 3F0 3F1 3F2 3F3 3B3 3B2 3B1 3B0 3ST 1B3 1B2 1B1 1B0 1ST""",
}


@pytest.mark.parametrize("name", INTERLEAVED)
def test_golden_grid(name: str) -> None:
    sched = make_schedule(name, [1] * 4, 4, virtual_stages=2)
    assert format_grid(sched) == GOLDEN[name]
    full = format_grid(sched, compute_only=False)
    assert parse_grid(full) == sched


@pytest.mark.parametrize("name", INTERLEAVED)
def test_validate_accepts_and_transfers_check(name: str) -> None:
    n = 0
    for p, v, m in CONFIGS:
        if not _ok(name, p, v, m):
            continue
        for steps in (1, 2):
            sched = make_schedule(name, [1] * (p * v), m, virtual_stages=v, num_steps=steps)
            validate(sched, [1] * (p * v), m, name, num_steps=steps, virtual_stages=v)
            pl = stage_ranks([1] * (p * v), [[s % p] for s in range(p * v)])
            check_transfers(sched, [1] * (p * v), transfer_plan(sched, [1] * (p * v), pl), targets=(), placement=pl)
            check_transfers(sched, [1] * (p * v), targets=None, placement=pl)  # the step's targets sent at its first F
            n += 1
    assert n > 100


def _broken(name: str) -> list[tuple[str, dict[int, list[Action]]]]:
    good = make_schedule(name, [1] * 4, 4, virtual_stages=2)
    out = []
    s = {r: list(a) for r, a in good.items()}
    i = next(i for i, a in enumerate(s[0]) if a.kind is Kind.FORWARD and a.stage == 2)
    s[0][i] = Action(3, Kind.FORWARD, s[0][i].mb)  # stage 3 is on rank 1
    out.append(("ranks", s))
    s = {r: list(a) for r, a in good.items()}
    i = next(i for i, a in enumerate(s[1]) if a.kind is Kind.STEP and a.stage == 3)
    del s[1][i]
    out.append(("steps", s))
    s = {r: list(a) for r, a in good.items()}
    i = next(i for i, a in enumerate(s[0]) if a == Action(2, Kind.RECV_ACT, 0))
    j = next(i for i, a in enumerate(s[0]) if a == Action(2, Kind.FORWARD, 0))
    s[0].insert(j + 1, s[0].pop(i))  # receive after the forward that uses it
    out.append(("send/recv pairs matched", s))
    s = {r: list(a) for r, a in good.items()}
    f = [i for i, a in enumerate(s[1]) if a.kind is Kind.FORWARD and a.stage == 1]
    assert f[1] == f[0] + 3  # RF F SF, twice: swap the blocks
    s[1][f[0] - 1:f[1] + 2] = s[1][f[1] - 1:f[1] + 2] + s[1][f[0] - 1:f[0] + 2]
    out.append(("forward order", s))
    s = {r: list(a) for r, a in good.items()}
    s[0] = [a for a in s[0] if a != Action(2, Kind.BACKWARD, 1)]
    out.append(("each forward and backward once", s))
    return out


@pytest.mark.parametrize("name", INTERLEAVED)
def test_validate_rejects_broken(name: str) -> None:
    for rule, sched in _broken(name):
        with pytest.raises(ScheduleError, match=f"rule '{rule}'"):
            validate(sched, [1] * 4, 4, name, virtual_stages=2)


def test_in_flight_bound_is_tight() -> None:
    """Interleaved 1F1B holds more than flush's p on rank 0 but no more than its bound; looped BFS all v*m."""
    sched = make_schedule("interleaved-1f1b", [1] * 8, 8, virtual_stages=2)
    lay = layout("interleaved-1f1b", [1] * 8, 8, 1, virtual_stages=2)
    for r, acts in sched.items():
        n = peak = 0
        for a in acts:
            n += (a.kind is Kind.FORWARD) - (a.kind is Kind.BACKWARD)
            peak = max(peak, n)
        assert peak == lay.rank_in_flight_bound(r) == min(16, (2 - 1) * 4 + 2 * (4 - 1 - r) + 1)


@pytest.mark.parametrize("name", INTERLEAVED)
def test_bubble_closed_form(name: str) -> None:
    """Equal stages, per-chunk F and B: a step takes (v m + p - 1)(F + B), so the bubble over the
    ideal v m (F + B) is (p - 1) / (v m) (Narayanan et al.: (p - 1)(t_f + t_b) / v with whole-rank
    times). Flush on the same p ranks with v-times-larger stages: (m + p - 1) v (F + B)."""
    f, b = Fraction(1), Fraction(2)
    for p, v, m in [(2, 2, 4), (4, 2, 8), (4, 3, 8), (3, 2, 6), (2, 3, 4), (4, 2, 4), (4, 4, 12)]:
        res = simulate_schedule(name, [1] * (p * v), m, virtual_stages=v, forward_s=f, backward_s=b)
        ideal = v * m * (f + b)
        assert res.makespan_s == ideal + (p - 1) * (f + b)
        assert (res.makespan_s - ideal) / ideal == Fraction(p - 1, v * m)
        flush = simulate_schedule("flush", [1] * p, m, forward_s=v * f, backward_s=v * b)
        assert flush.makespan_s == (m + p - 1) * v * (f + b)


def test_simulator_per_stage_costs_and_local_transfers() -> None:
    """p = 1: every transfer is local and free; the makespan is the sum of the stages' costs."""
    fwd, bwd = [1, 2, 3], [4, 5, 6]
    res = simulate_schedule("interleaved-1f1b", [1] * 3, 2, virtual_stages=3, forward_s=fwd, backward_s=bwd,
                            send_s=100)
    assert res.makespan_s == 2 * (sum(fwd) + sum(bwd))
    res2 = simulate_schedule("looped-bfs", [1] * 4, 4, virtual_stages=2, forward_s=[1, 1, 2, 2], backward_s=2)
    assert res2.peak_in_flight == [4, 4, 4, 4]  # per stage: all of the step's microbatches


def test_auto_leaves_virtual_stages_out() -> None:
    from pdcompile import autoschedule

    for split in (False, True):
        assert not set(autoschedule.auto_schedules(split)) & set(VIRTUAL_SCHEDULES)
