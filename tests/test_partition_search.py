"""The DP's fast searches (``passes/partition_dp.py``) against the unpruned one, on random instances.

The planner's one-query search by breakpoints (``PlanModel._group_start_one``) and the vectorized
search's single downstream count per step (``d = w - r``) are claimed, in their docstrings, to be
the same search as trying every (replicas, downstream) pair at every step. Here the reference is
that unpruned search (``breakpoint_search`` off, ``exhaustive_pairs`` on): the same time, the same
stages and ranks, on clusters larger than a brute force can enumerate, with and without the memory
limit, every schedule and recomputation choice.
"""

from __future__ import annotations

import contextlib
import math
import sys
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_partition_dp import chains, two_level  # noqa: E402

from pdcompile.cluster import ClusterSpec, Device, Level, paper_cluster  # noqa: E402
from pdcompile.errors import InfeasiblePlanError  # noqa: E402
from pdcompile.ir import Chain  # noqa: E402
from pdcompile.passes.partition_dp import PlanModel, PlanOptions, partition_dp, stage_memory  # noqa: E402
from pdcompile.passes.linearize import linearize  # noqa: E402
from pdcompile.plan import Plan  # noqa: E402
from pdcompile.profile import load  # noqa: E402


@contextlib.contextmanager
def search(breakpoints: bool, exhaustive: bool) -> Iterator[None]:
    saved = PlanModel.breakpoint_search, PlanModel.exhaustive_pairs
    PlanModel.breakpoint_search, PlanModel.exhaustive_pairs = breakpoints, exhaustive
    try:
        yield
    finally:
        PlanModel.breakpoint_search, PlanModel.exhaustive_pairs = saved


def _plan(chain: Chain, cluster: ClusterSpec, **kw: object) -> Plan | None:
    try:
        return partition_dp(chain, cluster, **kw)  # type: ignore[arg-type]
    except InfeasiblePlanError:
        return None


def _same(a: Plan | None, b: Plan | None) -> None:
    assert (a is None) == (b is None)
    if a is None or b is None:
        return
    assert math.isclose(a.seconds_per_minibatch, b.seconds_per_minibatch, rel_tol=1e-12, abs_tol=1e-15)
    assert [(s.first, s.last, s.ranks, s.recompute) for s in a.stages] == \
        [(s.first, s.last, s.ranks, s.recompute) for s in b.stages]
    assert a.optimal and b.optimal


def _compare(chain: Chain, cluster: ClusterSpec, **kw: object) -> None:
    fast = _plan(chain, cluster, **kw)
    with search(breakpoints=False, exhaustive=True):
        ref = _plan(chain, cluster, **kw)
    with search(breakpoints=False, exhaustive=False):
        vec = _plan(chain, cluster, **kw)
    _same(fast, ref)
    _same(vec, ref)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chain=chains(9), workers=st.integers(1, 24), bw=st.sampled_from([1.0, 10.0, 100.0]),
       model=st.sampled_from(["paper", "default"]), frac=st.one_of(st.none(), st.floats(0.05, 1.2)),
       schedule=st.sampled_from(["1f1b", "flush", "2bw", "gpipe"]),
       recompute=st.sampled_from(["none", "full", "auto"]), replicate=st.booleans())
def test_one_level_search_equals_the_unpruned_search(chain: Chain, workers: int, bw: float, model: str,
                                                     frac: float | None, schedule: str, recompute: str,
                                                     replicate: bool) -> None:
    memory = None if frac is None else max(frac * stage_memory(chain, 0, len(chain) - 1, 1, schedule=schedule), 1e-6)
    cluster = ClusterSpec(Device("d", memory=memory), (Level("l", workers, bw),))
    _compare(chain, cluster, cost_model=model, memory_limit=memory is not None, schedule=schedule,
             recompute=recompute, allow_replication=replicate, num_microbatches=4)


# 30 examples up to 4 x 12 workers (was 60 up to 4 x 20): the unpruned search's cost grows with the workers
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chain=chains(7), m1=st.integers(1, 4), m2=st.integers(1, 12),
       b1=st.sampled_from([10.0, 100.0]), b2=st.sampled_from([1.0, 5.0]),
       model=st.sampled_from(["paper", "default"]), frac=st.one_of(st.none(), st.floats(0.05, 1.2)),
       schedule=st.sampled_from(["1f1b", "flush", "gpipe"]), recompute=st.sampled_from(["none", "auto"]),
       pool=st.booleans())
def test_two_level_search_equals_the_unpruned_search(chain: Chain, m1: int, m2: int, b1: float, b2: float,
                                                     model: str, frac: float | None, schedule: str,
                                                     recompute: str, pool: bool) -> None:
    memory = None if frac is None else max(frac * stage_memory(chain, 0, len(chain) - 1, 1, schedule=schedule), 1e-6)
    cluster = two_level(m1, m2, b1, b2, memory=memory)
    _compare(chain, cluster, cost_model=model, memory_limit=memory is not None, schedule=schedule,
             recompute=recompute, pool=pool, num_microbatches=3)


@pytest.mark.parametrize("name", ["vgg16", "gnmt", "resnet50"])
@pytest.mark.parametrize("model", ["paper", "default"])
def test_pipedream_profiles_on_eight_by_thirty_two_equal_the_unpruned_search(name: str, model: str) -> None:
    """Real profiles on 8 x 32 (256 workers), where the unpruned search still runs in seconds."""
    chain = linearize(load(f"pipedream:{name}"))
    _compare(chain, paper_cluster("B", servers=32), cost_model=model)


@settings(max_examples=40, deadline=None)
@given(chain=chains(9), schedule=st.sampled_from(["1f1b", "flush", "2bw", "gpipe"]), frac=st.floats(0.05, 3.0),
       recompute=st.booleans())
def test_memory_rows_are_nondecreasing_in_the_in_flight_count(chain: Chain, schedule: str, frac: float,
                                                               recompute: bool) -> None:
    """What the breakpoint argument rests on: more microbatches in flight never let a stage start
    earlier (every row of the start table is at or after the previous one)."""
    limit = frac * stage_memory(chain, 0, len(chain) - 1, 1, schedule=schedule)
    cluster = ClusterSpec(Device("d", memory=max(limit, 1e-6)), (Level("l", 12, 1.0),))
    model = PlanModel(chain, cluster, PlanOptions("default", schedule, True, num_microbatches=5))
    table = model._mem_rows(recompute)
    assert np.all(np.diff(table, axis=0) >= 0)


@settings(max_examples=400, deadline=None)
@given(chain=chains(9), schedule=st.sampled_from(["1f1b", "flush", "2bw", "gpipe"]), frac=st.floats(0.05, 1.5),
       tfrac=st.floats(0.05, 2.0), paper=st.booleans())
def test_partial_recompute_start_equals_a_scan_of_every_head(chain: Chain, schedule: str, frac: float,
                                                              tfrac: float, paper: bool) -> None:
    """The vectorized partial-recomputation search (closed-form fewest head layers, running minima)
    against the definition: for every end and in-flight count, the smallest start ``i`` with some
    head of ``1..end-i`` layers whose memory (:meth:`PlanModel.memory_at`, scalar) fits and whose
    time, forward run again included, is within the threshold; and no earlier start for more in flight."""
    n = len(chain)
    limit = frac * stage_memory(chain, 0, n - 1, 1, schedule=schedule)
    cluster = ClusterSpec(Device("d", memory=max(limit, 1e-6)), (Level("l", 4, 1.0),))
    model = PlanModel(chain, cluster, PlanOptions("paper" if paper else "default", schedule, True, num_microbatches=3,
                                                  recompute="auto"))
    base = model.PC if paper else model.P1
    budget = model.mem_budget * (1 + 1e-10)
    thr = tfrac * float(base[-1] + model.PF[-1])
    for k in range(1, 5):
        ends = np.arange(n)
        got = model._partial_start(ends, np.full(n, thr), np.full(n, k))
        for j in range(n):
            want = n + 1
            for i in range(j):
                for h in range(1, j - i + 1):
                    t = float(base[j + 1] - base[i]) + model.recompute_s(i, j, "partial", h)
                    if model.memory_at(i, j, k, model.versions(k), "partial", head=h) <= budget and t <= thr * (1 + 1e-10):
                        want = i
                        break
                if want == i:
                    break
            assert (got[j] if got[j] <= j else n + 1) == want, (k, j, got[j], want)
        if k > 1:
            assert np.all(np.minimum(got, n + 1) >= np.minimum(prev, n + 1))
        prev = got


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chain=chains(6), workers=st.integers(1, 4), frac=st.floats(0.05, 1.2),
       schedule=st.sampled_from(["1f1b", "flush", "2bw", "gpipe"]), paper=st.booleans())
def test_dp_with_recomputation_equals_the_best_configuration(chain: Chain, workers: int, frac: float,
                                                              schedule: str, paper: bool) -> None:
    """``recompute="auto"`` (none, partial with the fewest first layers, or full, per stage): the DP's
    time is the best over every configuration of the one-stage-at-a-time evaluation, where each stage
    scans its heads (:meth:`PlanModel.choose_recompute`), and every stage of its plan fits."""
    from test_partition_dp import _FORBIDDEN, configs, flat_cluster  # noqa: PLC0415
    from pdcompile.passes.partition_dp import evaluate  # noqa: PLC0415

    _FORBIDDEN.clear()
    _FORBIDDEN.update(i for i, c in enumerate(chain.cut_bytes) if math.isinf(c))

    model = "paper" if paper else "default"
    limit = max(frac * stage_memory(chain, 0, len(chain) - 1, 1, schedule=schedule), 1e-6)
    cluster = flat_cluster(workers, 10.0).with_memory(limit)
    opts = dict(cost_model=model, schedule=schedule, memory_limit=True, recompute="auto", num_microbatches=3)
    best = math.inf
    for blocks in configs(0, len(chain) - 1, cluster, 1):
        ev = evaluate(chain, cluster, blocks, **opts)
        if ev.peak_memory <= limit * (1 + 1e-9):
            best = min(best, ev.seconds)
    p = _plan(chain, cluster, **opts)
    if math.isinf(best):
        assert p is None
        return
    assert p is not None and math.isclose(p.seconds_per_minibatch, best, rel_tol=1e-9, abs_tol=1e-12)
    assert all(s.memory_bytes <= limit * (1 + 1e-9) for s in p.stages)


def test_partial_rows_built_again_when_their_store_is_full_give_the_same_plans() -> None:
    """The store of partial recomputation's rows, at a size that fills it many times over (rows built
    again as asked), plans as the default size does."""
    chain = linearize(load("pipedream:vgg16"))
    cluster = paper_cluster("A")
    want = partition_dp(chain, cluster, recompute="auto", pool=True)
    saved = PlanModel.partial_store_bytes
    PlanModel.partial_store_bytes = 8 * (len(chain) + 1) * 3  # three rows
    try:
        got = partition_dp(chain, cluster, recompute="auto", pool=True)
    finally:
        PlanModel.partial_store_bytes = saved
    _same(want, got)
    assert any(s.recompute == "partial" for s in got.stages)
