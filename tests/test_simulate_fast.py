"""pdcompile/simulate_fast.py against simulate()'s own replay: the same step, per-rank seconds and peaks on
random pipelines of every schedule family it covers (flush, gpipe, zb-h1, 1f1b, 2bw), with replicas, split
backwards, weight stashing's copies, tied weights, all-reduces, per-action overheads, both receive models,
blocking sends, several steps and identical lanes (their links alike, or not). Pure: no torch, no launch."""

from __future__ import annotations

import random
from typing import Any

import pytest

from pdcompile.runtime.schedules import make_schedule
from pdcompile.simulate import SimResult, simulate, simulate_schedule
from pdcompile.simulate_fast import lane_factor, lane_of, lane_schedule

FAMILIES = ("flush", "gpipe", "zb-h1", "1f1b", "2bw")


def _same(ref: SimResult, fast: SimResult) -> None:
    """Every figure but the timeline equal, times to 1e-9 relative."""
    tol = 1e-9 * max(1.0, abs(float(ref.makespan_s)))
    assert fast.makespan_s == pytest.approx(ref.makespan_s, rel=1e-9)
    assert fast.step_time_s == pytest.approx(ref.step_time_s, rel=1e-9)
    assert fast.throughput == pytest.approx(ref.throughput, rel=1e-9)
    assert fast.bubble_fraction == pytest.approx(ref.bubble_fraction, rel=1e-9, abs=1e-12)
    for name in ("num_microbatches", "num_steps", "stage_of_rank", "peak_in_flight", "peak_weight_versions",
                 "peak_in_flight_with_grads", "peak_in_flight_at_rebuild", "peak_memory_bytes"):
        assert getattr(fast, name) == getattr(ref, name), name
    assert list(fast.busy) == list(ref.busy)
    for r in ref.busy:
        assert abs(fast.busy[r] - ref.busy[r]) <= tol, r
        assert abs(fast.utilization[r] - ref.utilization[r]) <= 1e-9, r
    assert fast.events == [] and ref.events


def _case(rng: random.Random) -> tuple[str, list[int], int, dict[str, Any], dict[str, Any]]:
    name = rng.choice(FAMILIES)
    S = rng.randint(1, 5)
    g = rng.choice([1, 2, 3])
    reps = [g * rng.randint(1, 3) for _ in range(S)] if rng.random() < 0.7 else [rng.randint(1, 3) for _ in range(S)]
    M = rng.randint(1, 10) * (g if rng.random() < 0.7 else 1)
    tied = S > 1 and rng.random() < 0.3 and not (name == "1f1b" and len(set(reps)) > 1)
    alike = rng.random() < 0.6  # every lane's links cost the same, or each pair of ranks its own
    table: dict[tuple[int, ...], float] = {}

    def send(sa: int, sb: int, ra: int, rb: int) -> float:
        return table.setdefault((sa, sb) if alike else (sa, sb, ra, rb), rng.uniform(0.0, 0.5))

    def per_stage(lo: float, hi: float) -> list[float]:
        return [rng.uniform(lo, hi) for _ in range(S)]

    costs: dict[str, Any] = dict(
        forward_s=per_stage(0.5, 2), backward_s=per_stage(1, 3), input_grad_s=per_stage(0.5, 1.5),
        weight_grad_s=per_stage(0.3, 1), allreduce_s=per_stage(0, 1), step_s=per_stage(0, 0.3),
        version_s=per_stage(0, 0.2) if rng.random() < 0.5 else None, send_s=send,
        overlap_comm=rng.random() < 0.8, recv_progress=rng.choice(["background", "on_wait"]),
        overhead_s=rng.choice([0, 0.01, {"F": 0.02, "SF": 0.01, "RB": 0.004, "AR": 0.03, "TG": 0.01, "WV": 0.005}]),
        tied_s=0.2 if tied else 0, tied_stages=[0, S - 1] if tied else None, microbatch_size=rng.randint(1, 4),
        activation_bytes=[rng.randint(1, 9) for _ in range(S)] if rng.random() < 0.5 else None,
        weight_bytes=[rng.randint(1, 9) for _ in range(S)] if rng.random() < 0.3 else None)
    kw = dict(num_steps=rng.choice([1, 1, 2]), tied=tied, split_backward=rng.random() < 0.5)
    return name, reps, M, kw, costs


def test_fast_replay_equals_simulate_on_random_pipelines() -> None:
    rng = random.Random(35)
    lanes = 0
    for _ in range(60):
        name, reps, M, kw, costs = _case(rng)
        ref = simulate_schedule(name, reps, M, **kw, **costs)
        fast = simulate_schedule(name, reps, M, timeline=False, **kw, **costs)
        _same(ref, fast)
        sched = make_schedule(name, reps, M, **kw)  # a schedule given whole: the replay alone, no lanes
        _same(simulate(sched, replicas=reps, num_steps=kw["num_steps"], **costs),
              simulate(sched, replicas=reps, num_steps=kw["num_steps"], timeline=False, **costs))
        lanes += lane_factor(reps, M, kw["num_steps"], costs["send_s"]) > 1
    assert lanes > 8  # the lane shortcut was taken often


def test_a_lane_is_the_whole_schedule_relabelled() -> None:
    """Lane 0 of g: replica i of its stage s runs what replica g i of the whole pipeline runs, microbatch q
    being g q; the AR of a stage replicated in the whole but not in the lane added before its updates."""
    rng = random.Random(7)
    for _ in range(60):
        name = rng.choice(FAMILIES)
        g = rng.choice([2, 3])
        reps = [g * rng.randint(1, 3) for _ in range(rng.randint(1, 4))]
        M = g * rng.randint(1, 6)
        kw: dict[str, Any] = dict(num_steps=rng.choice([1, 2]), split_backward=rng.random() < 0.5)
        whole = make_schedule(name, reps, M, **kw)
        lane = lane_schedule(name, reps, g, M, **kw)
        red, to_full, of_full = lane_of(reps, g)
        for r, acts in lane.items():
            assert [str(a) for a in acts] == [
                str(a) if a.microbatch is None else f"{a.stage}{a.kind.value}{a.microbatch // g}"
                for a in whole[to_full(r)]], (name, reps, M, r)
        assert all(of_full[to_full(r)] == r for r in lane)


def test_lanes_whose_links_differ_are_not_merged() -> None:
    """Stage 0's two replicas send over links of different cost: no lanes; alike: two."""
    assert lane_factor([2, 2], 4, 1, lambda sa, sb, ra, rb: 1.0 if min(ra, rb) == 0 else 2.0) == 1
    assert lane_factor([2, 2], 4, 1, lambda sa, sb, ra, rb: 1.0) == 2
    assert lane_factor([2, 4], 6, 1, None) == 2 and lane_factor([3, 2], 6, 1, None) == 1


def test_a_deadlock_is_still_named() -> None:
    """A schedule that cannot run: the fast replay hands it back to simulate(), which names it."""
    from pdcompile.errors import ScheduleError
    from pdcompile.runtime.schedules import Action

    sched = {0: [Action.from_str(x) for x in ("0RB0", "0F0", "0SF0")],
             1: [Action.from_str(x) for x in ("1RF0", "1F0", "1B0", "1SB0")]}
    with pytest.raises(ScheduleError):
        simulate(sched, replicas=[1, 1], forward_s=[1.0, 1.0], backward_s=[1.0, 1.0], timeline=False)


def test_plan_steps_rank_bound_reads_each_first_replica_as_make_schedule_lays_it() -> None:
    """plan.py's ``_first_replica`` (kept by what the order reads) against make_schedule's list of each stage's first
    replica: the same kinds, versions and microbatches up to their numbers."""
    from pdcompile.plan import _first_replica
    from pdcompile.runtime.schedules import layout

    def names(acts: list[Any]) -> list[tuple[Any, ...]]:
        seen: dict[int, int] = {}
        return [(a.kind, a.version, None if a.microbatch is None else seen.setdefault(a.microbatch, len(seen)))
                for a in acts]

    rng = random.Random(3)
    for _ in range(150):
        name = rng.choice(["flush", "gpipe", "zb-h1"])
        reps = [rng.randint(1, 4) for _ in range(rng.randint(1, 6))]
        M, split = rng.randint(1, 20), rng.random() < 0.5
        firsts = [sum(reps[:s]) for s in range(len(reps))]
        whole = make_schedule(name, reps, M, split_backward=split, ranks=firsts)
        lay = layout(name, reps, M, 1, False, split)
        for s, rank in enumerate(firsts):
            assert names(_first_replica(lay, s)) == names(whole[rank]), (name, reps, M, s, split)
