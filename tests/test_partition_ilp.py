"""The CP-SAT planner (``passes/partition_ilp.py``) finds the same optimum as the DP, on one- and
two-level clusters, with and without the memory limit, and proves it."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

pytest.importorskip("ortools")

from pdcompile.cluster import flat_cluster  # noqa: E402
from pdcompile.errors import InfeasiblePlanError, UsageError  # noqa: E402
from pdcompile.passes.partition_dp import (blocks_from_ranks, partition_dp, pipeline_time, pool_cluster,  # noqa: E402
                                          stage_memory)
from pdcompile.passes.partition_ilp import partition_ilp  # noqa: E402
from pdcompile.plan import plan  # noqa: E402
from test_partition_dp import _pipedream_chain, chains, make_chain, ref_memory_ok, two_level  # noqa: E402

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _same(dp_time: float, ilp_plan) -> None:
    assert ilp_plan.optimal, ilp_plan.notes
    assert ilp_plan.gap == 0.0
    assert math.isclose(ilp_plan.seconds_per_minibatch, dp_time, rel_tol=1e-6, abs_tol=1e-12)


@SETTINGS
@given(chain=chains(6), workers=st.integers(1, 6), bw=st.sampled_from([1.0, 10.0]),
       model=st.sampled_from(["paper", "default"]))
def test_ilp_equals_dp_one_level(chain, workers, bw, model):
    cluster = flat_cluster(workers, bw)
    d = partition_dp(chain, cluster, cost_model=model, memory_limit=False)
    _same(d.seconds_per_minibatch, partition_ilp(chain, cluster, cost_model=model, memory_limit=False,
                                                  time_limit_s=30))


@SETTINGS
@given(chain=chains(5), m1=st.integers(1, 3), m2=st.integers(1, 3), model=st.sampled_from(["paper", "default"]),
       b2=st.sampled_from([1.0, 5.0]))
@example(chain=make_chain([0.0], [5e-324], [0.0], [0.0], [], name="denormal"), m1=1, m2=1, model="paper", b2=1.0)  # the
# ILP's time unit (upper bound / resolution) underflowed to 0: ZeroDivisionError
def test_ilp_equals_dp_two_levels(chain, m1, m2, model, b2):
    cluster = two_level(m1, m2, 20.0, b2)
    d = partition_dp(chain, cluster, cost_model=model, memory_limit=False)
    p = partition_ilp(chain, cluster, cost_model=model, memory_limit=False, time_limit_s=30)
    _same(d.seconds_per_minibatch, p)
    assert math.isclose(pipeline_time(chain, cluster, p, cost_model=model), p.seconds_per_minibatch, rel_tol=1e-12)


@SETTINGS
@given(chain=chains(5), two=st.booleans(), frac=st.floats(0.1, 1.2),
       schedule=st.sampled_from(["1f1b", "flush", "2bw"]))
def test_ilp_equals_dp_with_memory(chain, two, frac, schedule):
    limit = max(frac * stage_memory(chain, 0, len(chain) - 1, 1, schedule=schedule), 1e-6)
    cluster = two_level(2, 3, 20.0, 2.0, memory=limit) if two else flat_cluster(5, 3.0, memory=limit)
    try:
        d = partition_dp(chain, cluster, schedule=schedule)
    except InfeasiblePlanError:
        with pytest.raises(InfeasiblePlanError):
            partition_ilp(chain, cluster, schedule=schedule, time_limit_s=30)
        return
    p = partition_ilp(chain, cluster, schedule=schedule, time_limit_s=30)
    _same(d.seconds_per_minibatch, p)
    blocks = blocks_from_ranks([(s.first, s.last, s.ranks) for s in p.stages], cluster)
    assert ref_memory_ok(chain, cluster, blocks, limit, schedule)


def test_ilp_hint_from_dp_and_plan_entry_point():
    chain = make_chain([1.0, 2.0, 3.0, 1.0, 2.0], [2.0] * 5, [5.0, 1.0, 1.0, 30.0, 2.0], [3.0] * 5, [4.0] * 4)
    cluster = two_level(2, 2, 10.0, 1.0, memory=1e4)
    d = partition_dp(chain, cluster)
    p = partition_ilp(chain, cluster, hint="dp")
    _same(d.seconds_per_minibatch, p)
    q = plan(chain, cluster, solver="ilp", hint=d)
    assert q.solver == "ilp" and math.isclose(q.seconds_per_minibatch, d.seconds_per_minibatch, rel_tol=1e-6)
    with pytest.raises(UsageError):
        partition_ilp(chain, cluster, hint="greedy")


def test_ilp_rejects_three_levels():
    from pdcompile.cluster import ClusterSpec, Device, Level

    chain = make_chain([1.0] * 3, [1.0] * 3, [1.0] * 3, [1.0] * 3, [1.0] * 2)
    cl = ClusterSpec(Device("d"), (Level("a", 2, 1.0), Level("b", 2, 1.0), Level("c", 2, 1.0)))
    with pytest.raises(UsageError, match="one or two levels"):
        partition_ilp(chain, cl, cost_model="paper")


def test_ilp_infeasible_memory():
    chain = make_chain([1.0] * 3, [1.0] * 3, [100.0] * 3, [1.0] * 3, [1.0] * 2)
    with pytest.raises(InfeasiblePlanError):
        partition_ilp(chain, flat_cluster(3, 1.0, memory=10.0))


def test_vgg16_ilp_is_three_one_and_proven():
    chain = _pipedream_chain("vgg16")
    p = partition_ilp(chain, flat_cluster(4, 1e9), cost_model="paper", time_limit_s=120)
    assert p.optimal and p.configuration == "3-1"


def test_ilp_refuses_pooled_workers_and_recomputation() -> None:
    """What the DP can plan and the ILP does not model is refused, naming the DP (no silent gap)."""
    chain = make_chain([1, 2, 3], [1, 2, 3], [5, 5, 5], [4, 4, 4], [4, 4])
    cluster = two_level(2, 2, 10.0, 1.0)
    with pytest.raises(UsageError, match="pooled workers.*solver='dp'"):
        partition_ilp(chain, cluster, pool=True)
    with pytest.raises(UsageError, match="recomputation.*solver='dp'"):
        partition_ilp(chain, cluster, recompute="auto")
    # one level: the pool is the cluster itself, so pool=True plans the same as the DP
    flat = flat_cluster(3, 10.0)
    _same(partition_dp(chain, flat, cost_model="paper", pool=True).seconds_per_minibatch,
          partition_ilp(chain, flat, cost_model="paper", pool=True))


def _pass_plan(chain, cluster, solver, **kw):  # type: ignore[no-untyped-def]
    """The partition pass's plan by ``solver`` (the path ``pdcompile(..., solver=)`` takes)."""
    from pdcompile.passes.partition import PASS_PLANNING, PartitionOptions, choose

    planning = PASS_PLANNING.with_(dict(recompute="none", shard="none", **kw))
    return choose(chain, PartitionOptions(planning, cluster=cluster, solver=solver))[0]


def _both(chain, cluster, **kw):  # type: ignore[no-untyped-def]
    return [_pass_plan(chain, cluster, s, **kw) for s in ("dp", "ilp")]


def test_ilp_plans_with_the_users_optimizer_state() -> None:
    """Adam's state (2 x the weights) makes data parallelism too big for the limit where momentum
    SGD's (1 x) fits: the ILP, as the partition pass calls it, must plan with the user's factor too."""
    chain = make_chain([0.5, 1.5], [0.5, 1.5], [10.0, 10.0], [1.0, 1.0], [1.0])
    cluster = flat_cluster(2, 100.0, memory=70.0)  # whole model: 20 x (1 + 1 + f) + 2 bytes
    configs = {}
    for f in (1.0, 2.0):
        d, p = _both(chain, cluster, schedule="flush", num_microbatches=2, optimizer_state_factor=f)
        _same(d.seconds_per_minibatch, p)
        blocks = blocks_from_ranks([(s.first, s.last, s.ranks) for s in p.stages], cluster)
        assert ref_memory_ok(chain, cluster, blocks, 70.0, "flush", f=f, M=2)
        configs[f] = (d.configuration, p.configuration)
    assert configs[1.0] == ("2", "2") and configs[2.0] == ("1-1", "1-1"), configs  # the factor changes what fits
    # recomputation: "auto" allows none, which the ILP plans; "full" it refuses rather than drop
    assert _pass_plan(chain, cluster, "ilp", optimizer_state_factor=2.0, num_microbatches=2).configuration == "1-1"
    from pdcompile.passes.partition import PASS_PLANNING, PartitionOptions, choose

    with pytest.raises(UsageError, match="recomputation"):
        choose(chain, PartitionOptions(PASS_PLANNING.with_(dict(recompute="full")), cluster=cluster, solver="ilp"))


def _inner_searches(chain, cluster, **kw):  # type: ignore[no-untyped-def]
    """DP = ILP on each inner search ``plan_step`` runs for a synchronous schedule (``k`` pipeline copies
    of ``M / k`` microbatches on the first ``W / k`` workers, at the step's microbatch size), or on the one
    an asynchronous schedule plans: both infeasible, or the same optimum. Whether every pair of plans is
    the same configuration (ties broken alike: then the pass must rate them alike)."""
    from pdcompile.passes.partition import PASS_PLANNING
    from pdcompile.plan import copy_options, step_objective

    opts = PASS_PLANNING.with_(dict(recompute="none", shard="none", **kw))
    M, W = opts.num_microbatches, cluster.num_workers
    sync = step_objective(opts.schedule)
    alike = True
    for k in (range(1, W + 1) if sync else (1,)):
        part = cluster.first_workers(W // k)
        if W % k or M % k or part is None:
            continue
        o = copy_options(opts, M // k)  # as plan_step plans a copy (one microbatch: no replicas)
        try:
            d = partition_dp(chain, part, o)
        except InfeasiblePlanError:
            with pytest.raises(InfeasiblePlanError):
                partition_ilp(chain, part, o, time_limit_s=30)
            continue
        p = partition_ilp(chain, part, o, time_limit_s=30)
        _same(d.seconds_per_minibatch, p)
        alike &= [(s.first, s.last, s.ranks) for s in d.stages] == [(s.first, s.last, s.ranks) for s in p.stages]
    return alike


# a synchronous schedule's pass rates each inner plan by its simulated step (fill, drain, all-reduce at
# the step's microbatch size), which the planners' objective (the bottleneck) does not see: two plans
# of one bottleneck (2 or 4 replicas of a stage whose time is its weight sync) are both optimal, and
# the DP and the ILP may return either, so the pass's steps agree where the plans do; the optimum
# itself is checked on every inner search
@settings(SETTINGS, database=None)
@given(chain=chains(5), two=st.booleans(), frac=st.floats(0.1, 1.2), f=st.sampled_from([0.0, 1.0, 2.0]),
       M=st.integers(1, 6), schedule=st.sampled_from(["1f1b", "flush", "2bw", "gpipe"]))
@example(chain=make_chain([0.0] * 3, [0.0] * 3, [0.0, 0.0, 1.0], [0.0, 0.0, 1.0], [math.inf, math.inf]),
         two=False, frac=0.75, f=0.0, M=2, schedule="flush")  # flush, M = 2: one stage on 5 replicas holds
# its share (1) whole, so no gradients with it in flight, and fits; the ILP read the memory at one replica
@example(chain=make_chain([0.0] * 5, [0.0, 0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 1.0, 1.0], [0.0] * 5,
                         [math.inf, math.inf, math.inf, 1.0]),
         two=False, frac=0.5, f=0.0, M=1, schedule="flush")  # a tie: l0..l3 on 2 or 4 replicas, both 0.667 s a
# minibatch by the planners' model; simulated, 2.0 s (DP's) and 2.17 s (ILP's)
@example(chain=make_chain([0.0], [1.0], [0.0], [0.0], []), two=False, frac=1.0, f=0.0, M=1,
         schedule="flush")  # one microbatch: the copy is planned without replicas, and the ILP bounded its search
# by data parallelism's time anyway (1 / 5 of the one worker's), so it proved no plan fits
def test_ilp_equals_dp_through_the_partition_pass(chain, two, frac, f, M, schedule):
    """DP = ILP with the options the partition pass passes (the optimizer's state factor, the step's
    microbatches, which cap what a replica holds) on every inner search, the pass's plans alike where
    those are, and the ILP's plan fits by the reference."""
    limit = max(frac * stage_memory(chain, 0, len(chain) - 1, 1, schedule="flush", optimizer_state_factor=f), 1e-6)
    cluster = two_level(2, 3, 20.0, 2.0, memory=limit) if two else flat_cluster(5, 3.0, memory=limit)
    kw = dict(schedule=schedule, num_microbatches=M, optimizer_state_factor=f)
    alike = _inner_searches(chain, cluster, **kw)
    plans = {}
    for solver in ("dp", "ilp"):
        try:
            plans[solver] = _pass_plan(chain, cluster, solver, **kw)
        except InfeasiblePlanError:
            pass
    if alike:
        assert set(plans) in (set(), {"dp", "ilp"}), plans
        if plans:
            _same(plans["dp"].seconds_per_minibatch, plans["ilp"])
    if "ilp" not in plans:
        return
    p = plans["ilp"]
    ranks = [(s.first, s.last, s.ranks) for s in p.stages]
    try:
        blocks = blocks_from_ranks(ranks, cluster)
    except ValueError:  # ranks that do not nest in the levels: the plan was rated on the pool of workers
        cluster = pool_cluster(cluster)
        blocks = blocks_from_ranks(ranks, cluster)
    assert ref_memory_ok(chain, cluster, blocks, limit, schedule, f=f, M=M)

