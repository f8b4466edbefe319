"""The planner's sharding decision (``shard=``, passes/planner/sharding.py): each mode's memory from
its definition, ``auto`` against a brute force over configurations and per-stage modes (and, with
``recompute="auto"``, recomputation modes and partial's layers) on small chains, and sharding chosen
where a profile needs it to fit and nowhere else.

One rule of the search the brute force takes as it is: a stage fits under full recomputation only
where each shorter suffix of it fits too (``memory.closed_starts``: a group clips its first stage to
where the previous one ends, so the search reads a start as fitting only where every later one does).
Full recomputation keeps a stage's input and output only, so a longer stage, whose input is smaller,
may fit where a shorter does not: the search then misses it (3 of 3000 random instances of this file's
size; none is about sharding)."""

from __future__ import annotations

import itertools
import math
import sys
from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_partition_dp import _FORBIDDEN, chains, configs, in_bytes, ref_time, two_level  # noqa: E402

from pdcompile.cluster import ClusterSpec, flat_cluster  # noqa: E402
from pdcompile.errors import InfeasiblePlanError, UsageError  # noqa: E402
from pdcompile.ir import Chain  # noqa: E402
from pdcompile.passes.partition_dp import PlanOptions, partition_dp, stage_memory_at  # noqa: E402

pytestmark = pytest.mark.timeout(300)

M = 8  # microbatches per step: at least every stage's replicas, so 'full' may run


def ref_need(W: float, X: float, k: int, r: int, mode: str, schedule: str, f: float) -> float:
    """A replica's peak bytes, from the definitions: weights x versions (a stash is a whole copy),
    optimizer state f W, gradients W from the first backward; ZeRO-1 keeps f W / r of the state;
    FSDP keeps W / r of the weights and f W / r of the state and, from the first forward to the last
    backward, the gathered weights W and the unsharded gradients W."""
    versions = {"1f1b": k, "flush": 1, "2bw": 2}[schedule]
    base = {"none": versions + f, "optimizer": versions + f / r, "full": 1 + (1 + f) / r}[mode if r > 1 else "none"]
    if schedule == "1f1b":  # an update after every backward: gradients never alive with all k in flight
        return max(W * base + X * k, W * (base + 1) + X * (k - 1))
    return W * (base + 1) + X * k


def modes_for(r: int, schedule: str) -> tuple[str, ...]:
    """Preferred first: none, full (one weight version only), optimizer."""
    if r == 1:
        return ("none",)
    return ("none", "full", "optimizer") if schedule == "flush" else ("none", "optimizer")


def stage_time(F: float, Bw: float, W: float, units: int, B: float, again: float, mode: str) -> float:
    """The default cost model's level-1 stage time, from what each mode moves (no optimizer-step term:
    these clusters name no memory bandwidth), over the stage's ``units`` replicas, with ``again`` seconds
    of forward run again in the backward. A ring moves ``(r-1)/r W`` per replica for an all-gather, a
    reduce-scatter or ZeRO-1's broadcast of the owners' updates, twice that for an all-reduce:

    - none: the gradients' all-reduce, overlapped with the backward;
    - optimizer: the same, then the updated parameters broadcast after the step, exposed;
    - full: the parameters all-gathered before the first forward, exposed, and the gradients
      reduce-scattered, overlapped with the backward."""
    half = (units - 1) * W / (units * B)  # one ring pass
    overlapped, exposed = {"none": (2 * half, 0.0), "optimizer": (2 * half, half), "full": (half, half)}[mode]
    return (exposed + F + max(Bw + again, overlapped)) / units


def recompute_options(n: int, recompute: str) -> list[tuple[str, int]]:
    """(mode, recomputed layers) a stage of ``n`` layers may take: none; under ``auto`` also its first
    h < n layers (partial) and all of them (full); chains here have no selective costs."""
    if recompute == "none":
        return [("none", 0)]
    return [("none", 0), *(("partial", h) for h in range(1, n)), ("full", n)]


def stage_choices(chain: Chain, cluster: ClusterSpec, blocks, limit: float, schedule: str, f: float, shard: str,
                  recompute: str = "none") -> list[tuple[float, str, str]] | None:
    """Each worker-level stage's (time, shard mode, recompute mode) that the planner should pick: of
    the (shard, recompute) pairs that fit, the least time; ties to the preferred shard mode (none,
    full, optimizer), then the least forward run again. None when some stage fits under none of them.
    Memory: recompute none from the definitions (:func:`ref_need`), else the planner's stage memory
    (``memory_at``, checked against the definitions by tests/test_memory_model.py)."""
    from pdcompile.passes.planner.decisions import stage_decisions

    mem = stage_decisions(chain, PlanOptions(schedule=schedule, optimizer_state_factor=f, num_microbatches=M)).memory
    L = chain.layers
    inb = in_bytes(chain)
    B1 = cluster.levels[0].bandwidth
    chosen: list[tuple[float, str, str]] = []

    def walk(bs, level, e, mult):
        size = cluster.unit_size(level - 1)
        for p, blk in enumerate(bs):
            after = sum(x.units for x in bs[p + 1:])
            if level > 1:
                if not walk(blk.inner, level - 1, (e + after * size) / blk.units, mult * blk.units):
                    return False
                continue
            k = math.ceil(Fraction(blk.units + after) / blk.units + e / blk.units)
            versions = {"1f1b": k, "flush": 1, "2bw": 2}[schedule]
            i, j = blk.first, blk.last
            W = sum(l.param_bytes for l in L[i:j + 1])
            X = sum(l.output_bytes for l in L[i:j + 1]) + inb[i]
            F = sum(l.forward_s for l in L[i:j + 1])
            Bw = sum(l.backward_s for l in L[i:j + 1])
            r = blk.units * mult
            shards = modes_for(r, schedule) if shard == "auto" else ((shard,) if r > 1 else ("none",))
            fits = []
            for pref, sh in enumerate(shards):
                for rec, h in recompute_options(j - i + 1, recompute):
                    need = (ref_need(W, X, k, r, sh, schedule, f) if rec == "none" else
                            mem.memory_at(i, j, k, versions, rec, head=h, shard=sh, replicas=r))
                    if need > limit * (1 + 1e-9):
                        continue
                    if rec == "full" and any(mem.memory_at(i2, j, k, versions, rec, shard=sh, replicas=r)
                                             > limit * (1 + 1e-9) for i2 in range(i + 1, j + 1)):
                        continue  # the search's rule for a start that fits (module doc)
                    again = sum(l.forward_s for l in L[i:i + h])
                    fits.append((stage_time(F, Bw, W, blk.units, B1, again, sh), pref, again, sh, rec))
            if not fits:
                return False
            least = min(t for t, *_ in fits)  # times within rounding of the least are ties
            t, _, _, sh, rec = min((f for f in fits if f[0] <= least * (1 + 1e-9)), key=lambda f: (f[1], f[2]))
            chosen.append((t, sh, rec))
        return True

    return chosen if walk(blocks, len(cluster.levels), Fraction(0), 1) else None


def stage_fits(chain: Chain, cluster: ClusterSpec, blocks, limit: float, schedule: str, f: float,
               shard: str) -> list[str] | None:
    """Each worker-level stage's preferred mode that fits (``shard``: auto, or the one allowed), or
    None when some stage fits under none of them."""
    got = stage_choices(chain, cluster, blocks, limit, schedule, f, shard)
    return None if got is None else [sh for _, sh, _ in got]


def brute(chain: Chain, cluster: ClusterSpec, limit: float, schedule: str, f: float, shard: str,
          recompute: str = "none") -> float:
    """The least time of any configuration whose stages all fit under some (shard, recompute) pair:
    recompute none, ``ref_time`` (every mode the all-reduce's time); else ``ref_time`` with each stage's
    chosen time in place of its own."""
    _FORBIDDEN.clear()
    _FORBIDDEN.update(i for i, c in enumerate(chain.cut_bytes) if math.isinf(c))
    best = math.inf
    for blocks in configs(0, len(chain) - 1, cluster, len(cluster.levels)):
        got = stage_choices(chain, cluster, blocks, limit, schedule, f, shard, recompute)
        if got is not None:
            best = min(best, ref_time_of(chain, cluster, blocks, [t for t, _, _ in got]))
    return best


def ref_time_of(chain: Chain, cluster: ClusterSpec, blocks, times: list[float]) -> float:
    """``ref_time`` (the default model) with the worker-level stages' times given, in order."""
    w = [l.param_bytes for l in chain.layers]
    it = iter(times)

    def pipe(bs, level):
        B = cluster.levels[level - 1].bandwidth
        terms = []
        for p, blk in enumerate(bs):
            r = blk.units
            if level == 1:
                terms.append(next(it))
            else:
                inner = pipe(blk.inner, level - 1)
                terms.append(max(inner, 2 * (r - 1) * sum(w[blk.first:blk.last + 1]) / (r * B)) / r)
            if p + 1 < len(bs):
                terms.append(2 * chain.cut_bytes[blk.last] / B)
        return max(terms)

    return pipe(blocks, len(cluster.levels))


def _check(chain: Chain, cluster: ClusterSpec, limit: float, schedule: str, f: float, shard: str,
           recompute: str = "none") -> None:
    want = brute(chain, cluster, limit, schedule, f, shard, recompute)
    if shard == "none":  # unsharded, test_partition_dp's formulas
        assert want == brute_plain(chain, cluster, limit, schedule, f, shard)
    try:
        p = partition_dp(chain, cluster, schedule=schedule, optimizer_state_factor=f, num_microbatches=M,
                         shard=shard, memory_limit=True, recompute=recompute)
    except InfeasiblePlanError:
        assert math.isinf(want)
        return
    assert math.isclose(p.seconds_per_minibatch, want, rel_tol=1e-9, abs_tol=1e-12)
    # each stage got the pair the reference picks, and the plan's memory is within the limit
    from pdcompile.passes.planner.blocks import blocks_from_ranks

    blocks = blocks_from_ranks([(s.first, s.last, s.ranks) for s in p.stages], cluster)
    got = stage_choices(chain, cluster, blocks, limit, schedule, f, shard, recompute)
    assert got is not None
    assert [s.shard for s in p.stages] == [sh for _, sh, _ in got]
    assert all(s.memory_bytes <= limit * (1 + 1e-9) for s in p.stages)


def brute_plain(chain: Chain, cluster: ClusterSpec, limit: float, schedule: str, f: float, shard: str) -> float:
    _FORBIDDEN.clear()
    _FORBIDDEN.update(i for i, c in enumerate(chain.cut_bytes) if math.isinf(c))
    best = math.inf
    for blocks in configs(0, len(chain) - 1, cluster, len(cluster.levels)):
        if stage_fits(chain, cluster, blocks, limit, schedule, f, shard) is not None:
            best = min(best, ref_time(chain, cluster, blocks, "default"))
    return best


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chain=chains(5), workers=st.integers(1, 4), bw=st.sampled_from([1.0, 100.0]),
       schedule=st.sampled_from(["flush", "1f1b", "2bw"]), f=st.sampled_from([0.0, 1.0, 2.0]),
       frac=st.floats(0.05, 1.0), shard=st.sampled_from(["auto", "auto", "optimizer", "none"]))
def test_auto_equals_brute_force_over_configurations_and_modes(chain, workers, bw, schedule, f, frac, shard):
    whole = sum(l.param_bytes for l in chain.layers) * (3 + f) + sum(l.output_bytes for l in chain.layers) * workers
    cluster = flat_cluster(workers, bw, memory=max(whole * frac, 1.0))
    _check(chain, cluster, float(cluster.device.memory), schedule, f, shard)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chain=chains(4), frac=st.floats(0.05, 1.0), f=st.sampled_from([1.0, 2.0]),
       schedule=st.sampled_from(["flush", "1f1b"]))
def test_auto_equals_brute_force_on_two_levels(chain, frac, f, schedule):
    whole = sum(l.param_bytes for l in chain.layers) * (3 + f) + sum(l.output_bytes for l in chain.layers) * 4
    cluster = two_level(2, 2, 100.0, 10.0, memory=max(whole * frac, 1.0))
    _check(chain, cluster, float(cluster.device.memory), schedule, f, "auto")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chain=chains(4), workers=st.integers(2, 3), bw=st.sampled_from([1.0, 100.0]),
       schedule=st.sampled_from(["flush", "1f1b"]), f=st.sampled_from([1.0, 2.0]), frac=st.floats(0.05, 1.0),
       shard=st.sampled_from(["auto", "auto", "optimizer"]))
def test_auto_equals_brute_force_over_configurations_modes_and_recomputation(chain, workers, bw, schedule, f, frac,
                                                                             shard):
    """recompute="auto" with shard="auto": the brute force ranges over each stage's (shard, recompute,
    recomputed layers) as the planner does, and the plan's time and modes equal its."""
    whole = sum(l.param_bytes for l in chain.layers) * (3 + f) + sum(l.output_bytes for l in chain.layers) * workers
    cluster = flat_cluster(workers, bw, memory=max(whole * frac, 1.0))
    _check(chain, cluster, float(cluster.device.memory), schedule, f, shard, "auto")


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chain=chains(3), frac=st.floats(0.05, 1.0), schedule=st.sampled_from(["flush", "1f1b"]))
def test_auto_equals_brute_force_with_recomputation_on_two_levels(chain, frac, schedule):
    whole = sum(l.param_bytes for l in chain.layers) * 5 + sum(l.output_bytes for l in chain.layers) * 4
    cluster = two_level(2, 2, 100.0, 10.0, memory=max(whole * frac, 1.0))
    _check(chain, cluster, float(cluster.device.memory), schedule, 2.0, "auto", "auto")


def test_a_stage_that_fits_only_sharded_and_partially_recomputed_is_found() -> None:
    """The search's partial recomputation holds the stage's weights as its shard mode does: here the
    best plan's first stage (2 replicas) fits only under ZeRO-1 with its first layer recomputed."""
    from test_partition_dp import make_chain

    chain = make_chain([1.0, 0.0, 2.0, 0.0], [1.0, 3.0, 0.0, 0.0], [0.0, 7.5, 5.0, 0.0], [1.0, 0.0, 2.0, 0.0],
                       [5.0, 5.0, 5.0])
    cluster = flat_cluster(3, 1.0, memory=19.8)
    _check(chain, cluster, 19.8, "flush", 1.0, "optimizer", "auto")
    p = partition_dp(chain, cluster, schedule="flush", optimizer_state_factor=1.0, num_microbatches=M,
                     shard="optimizer", memory_limit=True, recompute="auto")
    assert (p.stages[0].replicas, p.stages[0].shard, p.stages[0].recompute) == (2, "optimizer", "partial")


def test_each_mode_memory_from_its_definition() -> None:
    from test_partition_dp import make_chain

    chain = make_chain([1.0, 1.0], [2.0, 2.0], [100.0, 300.0], [10.0, 20.0], [5.0])
    X = 10.0 + 20.0  # outputs of layers 0..1, nothing received
    for mode, r, sched, k in itertools.product(("none", "optimizer", "full"), (1, 2, 4), ("flush", "1f1b"), (1, 3)):
        if mode == "full" and sched == "1f1b":
            continue
        versions = k if sched == "1f1b" else 1
        got = stage_memory_at(chain, 0, 1, PlanOptions(schedule=sched, optimizer_state_factor=2.0), in_flight=k,
                              weight_versions=versions, shard=mode, replicas=r)
        assert math.isclose(got, ref_need(400.0, X, k, r, mode, sched, 2.0), rel_tol=1e-12)


def test_forced_full_with_stashing_is_refused_before_planning() -> None:
    from test_partition_dp import make_chain

    chain = make_chain([1.0], [2.0], [100.0], [10.0], [])
    with pytest.raises(UsageError, match="stashed weight versions"):
        partition_dp(chain, flat_cluster(2, 1.0), schedule="1f1b", shard="full")


def _profile_plans(name: str, gib: float) -> tuple[object, object, float]:
    from pdcompile.cluster import Device, Level
    from pdcompile.passes.linearize import linearize
    from pdcompile.profile import load

    chain = linearize(load(f"pipedream:{name}"))
    limit = gib * 2**30
    cluster = ClusterSpec(Device("d", memory=limit, peak_flops=1e13, memory_bandwidth=9e11),
                          (Level("gpus", 4, 10e9), Level("servers", 2, 1.25e9)))
    kw = dict(schedule="flush", recompute="none", optimizer_state_factor=2.0, num_microbatches=8)
    return (partition_dp(chain, cluster, shard="none", **kw), partition_dp(chain, cluster, shard="auto", **kw),
            limit)


@pytest.mark.parametrize("name, gib", [("gnmt_large", 1.2), ("gnmt", 0.75), ("alexnet", 1.74)])
def test_auto_shards_where_a_profile_needs_it_and_nowhere_else(name: str, gib: float) -> None:
    """PipeDream's profiles (Adam's state, Flush, 8 workers in 2 servers) where memory binds: auto's plan is
    strictly faster than the best unsharded one, each sharded stage would not fit unsharded (its bytes at
    its own in-flight count and versions, from the memory model the brute force above checks), and each
    replicated stage it leaves unsharded fits so; with ample memory auto's plan is the unsharded plan."""
    none, auto, limit = _profile_plans(name, gib)
    assert auto.seconds_per_minibatch < none.seconds_per_minibatch * (1 - 1e-9)  # type: ignore[attr-defined]
    from pdcompile.passes.linearize import linearize
    from pdcompile.profile import load

    chain = linearize(load(f"pipedream:{name}"))
    planned = PlanOptions(schedule="flush", optimizer_state_factor=2.0, num_microbatches=8)
    sharded = [s for s in auto.stages if s.shard != "none"]  # type: ignore[attr-defined]
    assert sharded
    for s in auto.stages:  # type: ignore[attr-defined]
        unsharded = stage_memory_at(chain, s.first, s.last, planned, in_flight=s.in_flight,
                                    weight_versions=s.weight_versions, replicas=s.replicas)
        assert s.memory_bytes <= limit * (1 + 1e-9)
        assert (unsharded > limit) == (s.shard != "none"), (s.index, s.replicas, s.shard, unsharded, limit)
        if s.shard != "none":
            assert f"stage {s.index} (x{s.replicas}): {s.shard}" in "\n".join(auto.notes)  # type: ignore[attr-defined]
    if name == "gnmt_large":  # a replicated stage that fits unsharded stays so
        assert any(s.replicas > 1 and s.shard == "none" for s in auto.stages)  # type: ignore[attr-defined]
    ample_none, ample_auto, _ = _profile_plans(name, 16.0)
    drop = lambda p: {k: v for k, v in p.to_dict().items() if k != "planning_seconds"}  # noqa: E731
    assert drop(ample_auto) == drop(ample_none)


def test_the_simulator_holds_each_stage_as_its_mode() -> None:
    """simulate_plan's peak memory per stage is the memory model's under the stage's shard mode, at the
    simulated in-flight and version counts (and so below the unsharded bytes at those counts)."""
    from test_partition_dp import make_chain

    from pdcompile.passes.partition_dp import plan_from_assignment
    from pdcompile.simulate import simulate_plan

    chain = make_chain([1.0, 1.0, 1.0], [2.0, 2.0, 2.0], [400.0, 300.0, 200.0], [10.0, 20.0, 5.0], [8.0, 8.0])
    cluster = flat_cluster(3, 100.0, memory=1e6)
    for mode in ("optimizer", "full"):
        plan = plan_from_assignment(chain, cluster, [(0, 1, 2), (2, 2, 1)], schedule="flush", num_microbatches=4,
                                    optimizer_state_factor=2.0, shard=mode)
        assert [s.shard for s in plan.stages] == [mode, "none"]
        res = simulate_plan(plan, chain, cluster, "flush", 4, optimizer_state_factor=2.0)
        for s in plan.stages:
            kw = dict(in_flight=res.peak_in_flight[s.index], weight_versions=res.peak_weight_versions[s.index])
            planned = PlanOptions(schedule="flush", optimizer_state_factor=2.0, num_microbatches=4)
            want = stage_memory_at(chain, s.first, s.last, planned, shard=s.shard, replicas=s.replicas, **kw)
            assert math.isclose(res.peak_memory_bytes[s.index], want, rel_tol=1e-12)
            if s.shard != "none":
                assert want < stage_memory_at(chain, s.first, s.last, planned, **kw)
