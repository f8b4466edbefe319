"""PipeDream's planning problem as an integer program (OR-Tools CP-SAT), the ``partition`` pass's
other solver: the same objective and constraints as ``partition_dp`` (contiguous stages, replicas,
the hierarchy, memory) solved independently, with a time limit, reporting whether the optimum was
proven (else the gap).

The design in full: :func:`partition_ilp`.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import replace
from typing import Any

import numpy as np

from pdcompile.cluster import ClusterSpec, Level
from pdcompile.errors import InfeasiblePlanError, UsageError
from pdcompile.ir import Chain
from pdcompile.passes.partition_dp import blocks_from_ranks, build_plan, partition_dp
from pdcompile.passes.planner.blocks import Block
from pdcompile.passes.planner.memory import EPS
from pdcompile.passes.planner.options import PlanOptions, plan_options
from pdcompile.passes.planner.search import PlanModel
from pdcompile.plan_data import Plan

__all__ = ["partition_ilp"]

_RESOLUTION = 10_000_000
_COVER_CUTS_MAX = 60_000  # stage candidates up to which the per-layer covering bounds are added


def _two_level(cluster: ClusterSpec) -> ClusterSpec:
    if len(cluster.levels) == 2:
        return cluster
    if len(cluster.levels) == 1:
        return ClusterSpec(cluster.device, (cluster.levels[0], Level("(one)", 1, cluster.levels[0].bandwidth)))
    raise UsageError(
        f"the ILP solver handles clusters of one or two levels (this one has {len(cluster.levels)}); "
        "use --solver dp"
    )


def _simple_plans(model: PlanModel, allow_replication: bool = True) -> tuple[float, tuple[Block, ...] | None]:
    """The better of two trivial plans that fit (everything on one worker; data parallelism, where
    replication is allowed): its time bounds the optimum and it warm-starts the search. (inf, None) when
    neither fits."""
    n = model.N - 1
    m1, m2 = model.counts[0], model.counts[-1]
    best: tuple[float, tuple[Block, ...] | None] = (math.inf, None)
    trivial = [(Block(0, n, 1, (Block(0, n, 1),)),)]
    if allow_replication:  # else a bound no allowed plan can meet (the search would prove it infeasible)
        trivial.append((Block(0, n, m2, (Block(0, n, m1),)),))
    for blocks in trivial:
        ev = model.evaluate(blocks)
        if model.memory_ok(ev) and ev.seconds < best[0]:
            best = (ev.seconds, blocks)
    return best


def partition_ilp(
    chain: Chain,
    cluster: ClusterSpec,
    options: PlanOptions | None = None,
    *,
    time_limit_s: float = 30.0,
    hint: Plan | str | None = None,
    workers: int | None = None,
    **overrides: Any,
) -> Plan:
    """The optimal plan by CP-SAT within ``time_limit_s`` (``Plan.optimal``; else ``Plan.gap``,
    the relative distance to the proven lower bound). ``options`` (and keyword overrides) as for
    ``partition_dp``; refused: the ``pipedream`` cost model, ``pool`` on two levels, recomputation. It plans
    unsharded (``shard`` is read as ``none``: ``passes.partition.with_shard`` sets a mode on its plan).

    ``hint``: a plan for the same problem, or ``"dp"`` (plan with ``partition_dp`` first), warm-
    starts the search and bounds it (sound: the optimum is at most a feasible plan's time);
    without one, the better of "one worker" and "data parallelism" (when it fits) is used.

    The design, in full (moved from the module docstring):

    Formulation (clusters of one or two levels; one level is two with a single outer unit)::

        x[i,j,R]    outer block i..j on R units of the outer level (servers)
        y[i,j,r,R]  worker-level stage i..j on r workers of each of the R units of its block

    - the blocks form a path 0 -> N-1 (flow conservation at every position), and so do the
      stages; per R, stages open where a block of R opens and close where it closes;
    - an outer cut after ``c`` implies an inner cut after ``c`` (stages don't cross blocks);
    - sum R x <= outer count; per block, the stages' workers sum to <= inner count (an accumulator
      that resets at outer cuts);
    - objective ``T`` (integer, time scaled to about 1e7 steps) >= every stage's time ``t(i,j,r)/R``,
      every block's weight sync, every boundary (``2a/(R B1)`` inside a block, ``2a/B2`` between);
    - memory (when on): for a chosen stage, ``R (r + rem) + m1 * G <= K R r`` where ``rem`` is the
      block's workers downstream of the stage, ``G`` the outer units of later blocks and ``K`` the
      most in-flight minibatches whose memory fits (``partition_dp``'s module doc).

    Candidates whose time exceeds an upper bound (a feasible plan's time: one worker, or data
    parallelism, or a given ``hint``) are left out; that is sound since the optimum is below it.
    """
    from ortools.sat.python import cp_model

    opts = replace(plan_options(options, overrides), shard="none")
    cost_model, pool, recompute, allow_replication = opts.cost_model, opts.pool, opts.recompute, opts.allow_replication
    if cost_model == "pipedream":
        raise UsageError("the ILP solver does not model the pipedream cost model (the released optimizer's sums "
                         "and exact worker counts); use solver='dp' (--solver dp) for it")
    if pool and len(cluster.levels) > 1:
        raise UsageError("the ILP solver models stages that nest in the cluster's levels only, not pooled workers "
                         "(pool=True, stages that span servers); use solver='dp' (--solver dp) for it")
    if recompute != "none":
        raise UsageError(f"the ILP solver does not model activation recomputation (recompute={recompute!r}); "
                         "use solver='dp' (--solver dp) for it")
    t0 = time.perf_counter()
    orig_levels = len(cluster.levels)
    cl2 = _two_level(cluster)
    model = PlanModel(chain, cl2, opts)
    N = model.N
    m1, m2 = model.counts
    B1, B2 = model.B
    rmax = m1 if allow_replication else 1
    Rmax = m2 if allow_replication else 1

    ub, simple = _simple_plans(model, allow_replication)
    if isinstance(hint, str):
        if hint != "dp":
            raise UsageError(f"hint must be a Plan, 'dp' or None (got {hint!r})")
        hint = partition_dp(chain, cluster, opts)
    if hint is not None:
        ub = min(ub, hint.seconds_per_minibatch)
    # candidate terms, to size the time unit
    I, J = np.triu_indices(N)
    C = model.PC[J + 1] - model.PC[I]
    W = model.PW[J + 1] - model.PW[I]
    if not math.isfinite(ub):
        ub = float(C.max()) + 2.0 * float(W.max()) * (m1 + m2) / min(B1, B2) + 2.0 * float(
            np.nanmax(np.where(np.isfinite(model.cut), model.cut, 0.0), initial=0.0)) / min(B1, B2)
    ub *= 1 + 1e-6
    unit = ub / _RESOLUTION
    if not unit > 0:  # nothing costs anything (or so little that the unit underflows, e.g. ub = 5e-324)
        unit = 1.0

    def q(t: float) -> int:
        return int(math.ceil(t / unit - 1e-6))

    cp = cp_model.CpModel()
    T = cp.new_int_var(0, _RESOLUTION + 1, "T")
    allowed_end = np.ones(N, dtype=bool)
    allowed_end[:-1] = np.isfinite(model.cut)

    # -- candidates ----------------------------------------------------------------------------
    K = np.zeros(len(I), dtype=np.int64)
    held: list[int] | None = None  # per r, what a replica holds where that does not depend on the depth
    if model.memory_on:
        for n_, (i, j) in enumerate(zip(I.tolist(), J.tolist())):
            K[n_] = model.max_in_flight(i, j)
        if model.policy.holds_step:
            held = [0] + [model.in_flight(1, r) for r in range(1, rmax + 1)]
    xs: dict[tuple[int, int, int], Any] = {}
    ys: dict[tuple[int, int, int, int], Any] = {}
    y_time: dict[tuple[int, int, int, int], int] = {}
    whole: dict[tuple[int, int], int] = {}  # in_flight_max's, where it reads the memory at the share
    budget = model.mem_budget * (1 + EPS)

    def in_flight_max(n_: int, i: int, j: int, r: int) -> int:
        """The most in flight a replica of stage ``i..j`` on ``r`` replicas holds within memory (``K``). Where a
        stage's bytes depend on its replicas (``MemoryModel.by_replicas``: flush, ZB-H1 with a known step), a
        replica holding its whole share ceil(M / r) has no gradients with all of it in flight (``whole_step``),
        which can fit where one in flight short of it, or the count at one replica, does not: as the DP's
        tables per replica count read it."""
        k1 = int(K[n_])
        if not model.mem.by_replicas or k1 >= -(-model.M // r):
            return k1
        if (n_, r) not in whole:
            share = -(-model.M // r)  # below it the moments are those of one replica (nondecreasing in k)
            whole[(n_, r)] = share if model.mem.memory(i, j, share, replicas=r) <= budget else k1
        return whole[(n_, r)]

    for n_, (i, j) in enumerate(zip(I.tolist(), J.tolist())):
        if not allowed_end[j]:
            continue
        for R in range(1, Rmax + 1):
            oc = model.outer_comm(i, j, R, 2)
            if oc <= ub:
                xs[(i, j, R)] = cp.new_bool_var(f"x_{i}_{j}_{R}")
                if R > 1:
                    cp.add(T >= q(oc)).only_enforce_if(xs[(i, j, R)])
            for r in range(1, rmax + 1):
                if model.memory_on and in_flight_max(n_, i, j, r) < 1:
                    continue  # not even one microbatch fits
                if held is not None and model.memory(i, j, held[r]) > model.mem_budget * (1 + EPS):
                    continue  # a schedule that holds the step keeps M / r in flight, whatever the depth
                t = model.level1_stage(i, j, r)[0] / R
                if t > ub:
                    continue
                v = cp.new_bool_var(f"y_{i}_{j}_{r}_{R}")
                ys[(i, j, r, R)] = v
                y_time[(i, j, r, R)] = q(t)
                cp.add(T >= q(t)).only_enforce_if(v)

    # -- paths ---------------------------------------------------------------------------------
    x_start: dict[int, list] = {p: [] for p in range(N)}
    x_end: dict[int, list] = {p: [] for p in range(N)}
    for (i, j, R), v in xs.items():
        x_start[i].append((R, v))
        x_end[j].append((R, v))
    y_start: dict[int, list] = {p: [] for p in range(N)}
    y_end: dict[int, list] = {p: [] for p in range(N)}
    for (i, j, r, R), v in ys.items():
        y_start[i].append((r, R, v))
        y_end[j].append((r, R, v))
    cp.add(sum(v for _, v in x_start[0]) == 1)
    cp.add(sum(v for _, v in x_end[N - 1]) == 1)
    for p in range(1, N):
        cp.add(sum(v for _, v in x_start[p]) == sum(v for _, v in x_end[p - 1]))
    for R in range(1, Rmax + 1):
        for p in range(N):
            opened = sum(v for RR, v in x_start[p] if RR == R)
            closed = sum(v for RR, v in x_end[p - 1] if RR == R) if p > 0 else 0
            ends = sum(v for _, RR, v in y_end[p - 1] if RR == R) if p > 0 else 0
            cp.add(sum(v for _, RR, v in y_start[p] if RR == R) == ends - closed + opened)
        cp.add(sum(v for _, RR, v in y_end[N - 1] if RR == R) == sum(v for RR, v in x_end[N - 1] if RR == R))
    co = [sum(v for _, v in x_end[c]) for c in range(N)]  # outer cut after c (c < N-1)
    ci = [sum(v for _, _, v in y_end[c]) for c in range(N)]
    for c in range(N - 1):
        cp.add(co[c] <= ci[c])

    # -- units -----------------------------------------------------------------------------------
    cp.add(sum(R * v for (_, _, R), v in xs.items()) <= m2)
    acc = [cp.new_int_var(0, m1, f"acc_{c}") for c in range(N)]
    for c in range(N):
        er = sum(r * v for r, _, v in y_end[c])
        cp.add(acc[c] >= er)
        if c > 0:
            cp.add(acc[c] >= acc[c - 1] + er - m1 * co[c - 1])

    # -- boundaries ------------------------------------------------------------------------------
    for c in range(N - 1):
        a = float(model.cut[c])
        if not math.isfinite(a):
            continue
        if m2 > 1 or orig_levels == 2:
            t_out = 2.0 * a / B2
            if t_out > ub:
                cp.add(co[c] == 0)
            elif t_out > 0:
                cp.add(T >= q(t_out) * co[c])
        for R in range(1, Rmax + 1):
            t_in = 2.0 * a / (R * B1)
            if t_in <= 0:
                continue
            ciR = sum(v for _, RR, v in y_end[c] if RR == R)
            if t_in > ub:
                cp.add(ciR - co[c] <= 0)
            else:
                cp.add(T >= q(t_in) * (ciR - co[c]))

    # -- memory ----------------------------------------------------------------------------------
    rem: list[Any] = []
    G: list[Any] = []
    if model.memory_on:
        rem = [cp.new_int_var(0, m1, f"rem_{c}") for c in range(N)]
        G = [cp.new_int_var(0, m2, f"G_{c}") for c in range(N)]
        cp.add(rem[N - 1] == 0)
        cp.add(G[N - 1] == 0)
        for c in range(N - 1):
            sr = sum(r * v for r, _, v in y_start[c + 1])
            cp.add(rem[c] >= rem[c + 1] + sr - m1 * co[c])
            cp.add(G[c] == G[c + 1] + sum(R * v for R, v in x_start[c + 1]))
        kidx = {(i, j): n_ for n_, (i, j) in enumerate(zip(I.tolist(), J.tolist()))}
        for (i, j, r, R), v in ys.items():
            k = in_flight_max(kidx[(i, j)], i, j, r)
            if k >= m1 * m2 + 1 or held is not None or (model.mem.cap and -(-model.M // r) <= k):
                continue  # fits whatever is downstream (capped: a replica holds at most its M / r of a step)
            cp.add(R * rem[j] + m1 * G[j] <= (k - 1) * R * r).only_enforce_if(v)

    # -- bounds that tighten the relaxation ------------------------------------------------------
    # every plan takes at least the total compute over the workers
    cp.add(T >= q(float(model.PC[-1]) / cluster.num_workers * (1 - 1e-12)))
    # the stage (and block) covering a layer bounds T: T >= sum of their times over the layer
    if len(ys) <= _COVER_CUTS_MAX:
        cover: list[list[tuple[int, Any]]] = [[] for _ in range(N)]
        for (i, j, r, R), v in ys.items():
            for l in range(i, j + 1):
                cover[l].append((y_time[(i, j, r, R)], v))
        for l in range(N):
            cp.add(T >= sum(t * v for t, v in cover[l] if t > 0))

    cp.minimize(T)

    start = _hint_blocks(hint, cl2, orig_levels) if hint is not None else simple
    if start is not None:
        start_time = model.evaluate(start).seconds
        _add_hint(cp, start, xs, ys, aux=dict(T=T, t=min(q(start_time) + 1, _RESOLUTION + 1), acc=acc, rem=rem,
                                               G=G, N=N))

    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = float(time_limit_s)
    solver.parameters.num_search_workers = workers or max(1, min(8, os.cpu_count() or 1))
    solver.parameters.cp_model_probing_level = 0  # probing costs more than it saves here
    if os.environ.get("PDCOMPILE_ILP_LOG"):  # CP-SAT's own progress log, for debugging
        solver.parameters.log_search_progress = True
    status = solver.solve(cp)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE) and status != cp_model.INFEASIBLE and hint is not None:
        # out of time before even taking the warm start: return it, unproven
        blocks = _hint_blocks(hint, cl2, orig_levels) or ()
        model_orig = PlanModel(chain, cluster, opts)
        flat = blocks[0].inner if orig_levels == 1 else blocks
        return build_plan(model_orig, flat, model_orig.evaluate(flat), solver="ilp",
                           planning_seconds=time.perf_counter() - t0, optimal=False, gap=math.nan,
                           notes=[f"CP-SAT {solver.status_name(status)} within {time_limit_s:g} s: the warm start "
                                  "is returned, not proven optimal"])
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        if status == cp_model.INFEASIBLE:
            raise InfeasiblePlanError(
                f"no plan of {chain.name} fits in memory on {cluster.num_workers} workers (ILP proved it); "
                "partition_dp reports the smallest per-worker memory that would fit"
            )
        raise InfeasiblePlanError(
            f"the ILP found no plan within {time_limit_s:g} s (status {solver.status_name(status)}); "
            "raise time_limit_s or use the DP solver"
        )

    outer = sorted((i, j, R) for (i, j, R), v in xs.items() if solver.value(v))
    inner = sorted((i, j, r, R) for (i, j, r, R), v in ys.items() if solver.value(v))
    blocks2 = tuple(
        Block(i, j, R, tuple(Block(a, b, r) for a, b, r, _ in inner if i <= a and b <= j))
        for i, j, R in outer
    )
    blocks = blocks2[0].inner if orig_levels == 1 else blocks2
    model_orig = PlanModel(chain, cluster, opts)
    ev = model_orig.evaluate(blocks)
    obj, bound = solver.objective_value, solver.best_objective_bound
    gap = max(0.0, (obj - bound) / obj) if obj > 0 else 0.0
    # proven optimal, or within the time resolution (a few of the ~1e7 time steps)
    optimal = status == cp_model.OPTIMAL or obj - bound <= 2
    if optimal:
        gap = 0.0
    notes = [f"CP-SAT {solver.status_name(status)} in {solver.wall_time:.2f} s "
             f"({len(xs)} block and {len(ys)} stage candidates)"]
    return build_plan(model_orig, blocks, ev, solver="ilp", planning_seconds=time.perf_counter() - t0,
                       optimal=optimal, gap=gap, notes=notes)


def _hint_blocks(hint: Plan, cl2: ClusterSpec, orig_levels: int) -> tuple[Block, ...] | None:
    try:
        if orig_levels == 1:
            flat = tuple(Block(s.first, s.last, len(s.ranks)) for s in hint.stages)
            return (Block(0, hint.stages[-1].last, 1, flat),)
        return blocks_from_ranks([(s.first, s.last, s.ranks) for s in hint.stages], cl2)
    except ValueError:
        return None


def _add_hint(cp: Any, blocks: tuple[Block, ...], xs: dict, ys: dict, aux: dict[str, Any]) -> None:
    """Warm start from a two-level block tree: every variable hinted (candidates it doesn't use
    are 0; the accumulators follow from the blocks), so CP-SAT can take it as it is."""
    chosen_x = {(b.first, b.last, b.units) for b in blocks}
    chosen_y = {(s.first, s.last, s.units, b.units) for b in blocks for s in b.inner}
    if not chosen_x <= set(xs) or not chosen_y <= set(ys):
        return  # the warm start uses a pruned candidate: let the solver search alone
    for k, v in xs.items():
        cp.add_hint(v, int(k in chosen_x))
    for k, v in ys.items():
        cp.add_hint(v, int(k in chosen_y))
    cp.add_hint(aux["T"], aux["t"])
    N = aux["N"]
    acc, rem, G = [0] * N, [0] * N, [0] * N
    for n_, b in enumerate(blocks):
        later = sum(x.units for x in blocks[n_ + 1:])
        used = 0
        total = sum(s.units for s in b.inner)
        for s in b.inner:
            for c in range(s.first, s.last + 1):
                acc[c] = used + (s.units if c == s.last else 0)
                rem[c] = total - used - s.units  # workers of the block's stages that start after c
                G[c] = later
            used += s.units
    for c in range(N):
        cp.add_hint(aux["acc"][c], acc[c])
        if aux["rem"]:
            cp.add_hint(aux["rem"][c], rem[c])
            cp.add_hint(aux["G"][c], G[c])
