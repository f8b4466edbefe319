"""The planner's sharding decision (``shard=``, passes/planner/sharding.py): each mode's memory from
its definition, ``auto`` against a brute force over configurations and per-stage modes on small
chains, and sharding chosen where a profile needs it to fit and nowhere else."""

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
from pdcompile.passes.partition_dp import partition_dp, stage_memory_at  # noqa: E402

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


def stage_fits(chain: Chain, cluster: ClusterSpec, blocks, limit: float, schedule: str, f: float,
               shard: str) -> list[str] | None:
    """Each worker-level stage's preferred mode that fits (``shard``: auto, or the one allowed), or
    None when some stage fits under none of them."""
    L = chain.layers
    inb = in_bytes(chain)
    chosen: list[str] = []

    def walk(bs, level, e, mult):
        size = cluster.unit_size(level - 1)
        for p, blk in enumerate(bs):
            after = sum(x.units for x in bs[p + 1:])
            if level > 1:
                if not walk(blk.inner, level - 1, (e + after * size) / blk.units, mult * blk.units):
                    return False
                continue
            k = math.ceil(Fraction(blk.units + after) / blk.units + e / blk.units)
            W = sum(l.param_bytes for l in L[blk.first:blk.last + 1])
            X = sum(l.output_bytes for l in L[blk.first:blk.last + 1]) + inb[blk.first]
            r = blk.units * mult
            options = modes_for(r, schedule) if shard == "auto" else ((shard,) if r > 1 else ("none",))
            fit = [m for m in options if ref_need(W, X, k, r, m, schedule, f) <= limit * (1 + 1e-9)]
            if not fit:
                return False
            chosen.append(fit[0])
        return True

    return chosen if walk(blocks, len(cluster.levels), Fraction(0), 1) else None


def brute(chain: Chain, cluster: ClusterSpec, limit: float, schedule: str, f: float, shard: str) -> float:
    _FORBIDDEN.clear()
    _FORBIDDEN.update(i for i, c in enumerate(chain.cut_bytes) if math.isinf(c))
    best = math.inf
    for blocks in configs(0, len(chain) - 1, cluster, len(cluster.levels)):
        if stage_fits(chain, cluster, blocks, limit, schedule, f, shard) is not None:
            best = min(best, ref_time(chain, cluster, blocks, "default"))
    return best


def _check(chain: Chain, cluster: ClusterSpec, limit: float, schedule: str, f: float, shard: str) -> None:
    want = brute(chain, cluster, limit, schedule, f, shard)
    try:
        p = partition_dp(chain, cluster, schedule=schedule, optimizer_state_factor=f, num_microbatches=M,
                         shard=shard, memory_limit=True)
    except InfeasiblePlanError:
        assert math.isinf(want)
        return
    assert math.isclose(p.seconds_per_minibatch, want, rel_tol=1e-9, abs_tol=1e-12)
    # each stage got its preferred mode that fits, and the plan's memory is the reference's
    from pdcompile.passes.planner.blocks import blocks_from_ranks

    blocks = blocks_from_ranks([(s.first, s.last, s.ranks) for s in p.stages], cluster)
    assert [s.shard for s in p.stages] == stage_fits(chain, cluster, blocks, limit, schedule, f, shard)
    assert all(s.memory_bytes <= limit * (1 + 1e-9) for s in p.stages)


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


def test_each_mode_memory_from_its_definition() -> None:
    from test_partition_dp import make_chain

    chain = make_chain([1.0, 1.0], [2.0, 2.0], [100.0, 300.0], [10.0, 20.0], [5.0])
    X = 10.0 + 20.0  # outputs of layers 0..1, nothing received
    for mode, r, sched, k in itertools.product(("none", "optimizer", "full"), (1, 2, 4), ("flush", "1f1b"), (1, 3)):
        if mode == "full" and sched == "1f1b":
            continue
        versions = k if sched == "1f1b" else 1
        got = stage_memory_at(chain, 0, 1, in_flight=k, weight_versions=versions, schedule=sched,
                              optimizer_state_factor=2.0, shard=mode, replicas=r)
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


@pytest.mark.parametrize("name, gib", [("gnmt_large", 2.0), ("gnmt", 0.75), ("alexnet", 1.5)])
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
    sharded = [s for s in auto.stages if s.shard != "none"]  # type: ignore[attr-defined]
    assert sharded
    for s in auto.stages:  # type: ignore[attr-defined]
        unsharded = stage_memory_at(chain, s.first, s.last, in_flight=s.in_flight, weight_versions=s.weight_versions,
                                    schedule="flush", optimizer_state_factor=2.0, num_microbatches=8)
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
            kw = dict(in_flight=res.peak_in_flight[s.index], weight_versions=res.peak_weight_versions[s.index],
                      schedule="flush", optimizer_state_factor=2.0, num_microbatches=4)
            want = stage_memory_at(chain, s.first, s.last, shard=s.shard, replicas=s.replicas, **kw)
            assert math.isclose(res.peak_memory_bytes[s.index], want, rel_tol=1e-12)
            if s.shard != "none":
                assert want < stage_memory_at(chain, s.first, s.last, **kw)
