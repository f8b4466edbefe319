"""PipeDream's planner as a dynamic program (used by the ``partition`` pass): stages, replicas and ranks
that make the slowest part of the pipeline as fast as possible.

The design in full: :func:`partition_dp`.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import replace
from typing import Any, Callable, Iterable, Sequence

from pdcompile.cluster import ClusterSpec, Level, format_quantity
from pdcompile.errors import InfeasiblePlanError, UsageError
from pdcompile.ir import Chain
from pdcompile.passes.planner.blocks import Block, Evaluation, StageCost, blocks_from_ranks, flatten_blocks
from pdcompile.passes.planner.costs import COST_MODELS
from pdcompile.passes.planner.decisions import MODES, RECOMPUTE, stage_decisions
from pdcompile.passes.planner.memory import EPS
from pdcompile.passes.planner.options import PlanOptions, plan_options
from pdcompile.passes.planner.search import SCHEDULES, PlanModel, refusals_without_memory, solve
from pdcompile.passes.planner import tensor
from pdcompile.passes.planner.sharding import resolve as resolve_shard
from pdcompile.plan_data import Plan, StagePlan

__all__ = [
    "COST_MODELS",
    "MODES",
    "RECOMPUTE",
    "SCHEDULES",
    "Block",
    "Evaluation",
    "PlanModel",
    "PlanOptions",
    "StageCost",
    "partition_dp",
    "plan_tensor_parallel",
    "SlowerPlanError",
    "pipeline_plan",
    "pipeline_time",
    "stage_time",
    "stage_memory",
    "stage_memory_at",
    "pool_cluster",
    "data_parallel_time",
    "evaluate",
    "plan_from_assignment",
    "blocks_from_ranks",
    "flatten_blocks",
]


def build_plan(
    model: PlanModel,
    blocks: Sequence[Block],
    ev: Evaluation,
    *,
    solver: str,
    planning_seconds: float,
    optimal: bool,
    gap: float,
    notes: Iterable[str] = (),
    baseline: PlanModel | None = None,
) -> Plan:
    """The Plan of ``blocks``; ``baseline`` (default ``model``) rates data parallelism and names the cluster."""
    chain = model.chain
    base = baseline or model
    stages = []
    shards, shard_notes = resolve_shard([len(sc.ranks) for sc in ev.stages], model.shard, model.schedule,
                                        model.step_M, [sc.shard for sc in ev.stages])
    for idx, sc in enumerate(ev.stages):
        layers = chain.layers[sc.first:sc.last + 1]
        members = tuple(m for l in layers for m in (l.members or (l.name,)))
        stages.append(StagePlan(
            index=idx, first=sc.first, last=sc.last, layer_names=tuple(l.name for l in layers),
            members=members, replicas=len(sc.ranks), ranks=sc.ranks, compute_s=sc.compute_s,
            comm_s=sc.comm_s, memory_bytes=sc.memory_bytes, time_s=sc.time_s, send_s=sc.send_s,
            in_flight=sc.in_flight, weight_versions=sc.weight_versions,
            recompute=sc.recompute, recompute_layers=sc.recompute_layers, shard=shards[idx],
        ))
    dp = base.data_parallel_time()
    b = chain.batch_size
    notes = [*notes, *shard_notes, *_shard_reasons(model, ev)]
    device_memory = model.cluster.device.memory
    if not model.memory_on and device_memory:
        for idx, sc in enumerate(ev.stages):
            if sc.memory_bytes > device_memory * (1 + 1e-9):
                notes.append(f"warning: stage {idx} needs "
                             f"{format_quantity(sc.memory_bytes, 'memory')} per worker, over the device's "
                             f"{format_quantity(device_memory, 'memory')} (the memory limit is off: "
                             "use memory_limit=True or --memory-limit to plan within it)")
    if model.memory_on and model.N > 0:
        need = model.memory(0, model.N - 1, 1)  # the whole model, its gradients, optimizer state, one minibatch
        if need > model.mem_budget * (1 + EPS):
            notes.append(f"data parallelism does not fit: it needs {format_quantity(need, 'memory')} per worker, over "
                         f"the {format_quantity(model.mem_budget, 'memory')} limit; the speedup compares with "
                         f"what it would do if it did")
    return Plan(
        stages=tuple(stages),
        solver=solver,
        cost_model=model.cost_model,
        schedule=model.schedule,
        microbatch_size=b,
        seconds_per_minibatch=ev.seconds,
        samples_per_second=(b / ev.seconds) if ev.seconds > 0 else math.inf,
        data_parallel_samples_per_second=(b / dp) if dp > 0 else math.inf,
        bottleneck=ev.bottleneck,
        planning_seconds=planning_seconds,
        optimal=optimal,
        gap=gap,
        num_workers=model.cluster.num_workers,
        model=chain.name,
        cluster=str(base.cluster),
        memory_limit_bytes=model.mem_budget if model.memory_on else None,
        notes=tuple(notes),
    )


def _shard_reasons(model: PlanModel, ev: Evaluation) -> list[str]:
    """Why ``shard="auto"`` sharded a stage: what the modes it prefers need, against the limit."""
    out: list[str] = []
    if model.shard != "auto" or not model.memory_on:
        return out
    for idx, sc in enumerate(ev.stages):
        r = len(sc.ranks)
        if sc.shard == "none" or r <= 1:
            continue
        prefer = model.shard_modes(idx, r)
        needs = [(m, model.mem.memory_at(sc.first, sc.last, sc.in_flight, sc.weight_versions, sc.recompute,
                                         head=sc.recompute_layers, shard=m, replicas=r))
                 for m in prefer[:prefer.index(sc.shard)]]
        need = ", ".join(f"{m} needs {format_quantity(b, 'memory')}" for m, b in needs)
        out.append(f"stage {idx} (x{r}): {sc.shard} ({format_quantity(sc.memory_bytes, 'memory')}): {need} of the "
                   f"{format_quantity(model.mem_budget, 'memory')} limit")
    return out


def partition_dp(chain: Chain, cluster: ClusterSpec, options: PlanOptions | None = None, **overrides: Any) -> Plan:
    """The best plan for ``chain`` on ``cluster`` under ``options`` (:class:`PlanOptions`, each field
    also a keyword override, e.g. ``partition_dp(chain, cluster, schedule="flush")``).

    ``pool``: also plan the workers as one pool at the slowest link (:func:`pool_cluster`), where
    stages need not nest in the hierarchy, and keep that plan when it is strictly faster.
    ``num_microbatches``: per minibatch (a schedule that holds them all, GPipe, keeps ``M / r`` in
    flight; one that accumulates, flush, at most ``M / r`` of its warmup depth; None: 1, uncapped).
    ``shard="auto"``: per stage, the cheapest mode that fits (``planner/sharding.py``).
    ``memory_limit`` None: the cost model's default (on for ``default``, off for ``paper`` and
    ``pipedream``, which refuses it).
    Raises :class:`InfeasiblePlanError` (with the smallest per-worker memory that would fit)
    when no plan fits, and :class:`ClusterSpecError` when the limit is on but the device memory
    is unknown.

    The design, in full (moved from the module docstring):

    Paper: Narayanan et al., "PipeDream: Generalized Pipeline Parallelism for DNN Training",
    SOSP'19, section 3.1 (arXiv 1806.03377). Pure functions over numpy arrays; no torch.

    Cost models
    -----------
    ``paper`` is section 3.1 of the SOSP'19 paper as written. For a chain with per-layer compute
    ``c_l = forward + backward``, parameter bytes ``w_l``, bytes ``a_s`` live across cut ``s`` and
    a level of bandwidth ``B``:

    1. a stage of layers ``i..j`` replicated ``r`` times takes
       ``T = (1/r) * max(sum c_l, 2 (r-1) sum w_l / B)``;
    2. a boundary after layer ``s`` costs ``2 a_s / B`` (activations forward, gradients back);
    3. the pipeline's time per minibatch is the maximum over stages and boundaries;
    4. hierarchy (levels innermost first, level ``k`` has ``m_k`` units of level ``k-1``): the best
       time ``A^{k-1}(i..j)`` of a range on one unit of level ``k`` (a whole level-(k-1) group) is
       that range's compute time at level ``k``: ``T^k = (1/r) max(A^{k-1}(i..j), 2 (r-1) W / B_k)``,
       and boundaries between level-k stages cost ``2 a / B_k``. A range may use *up to* its units
       (replicas may use fewer than all workers when that is faster);
    5. data parallelism: one stage of all layers replicated over every unit of every level.

    ``pipedream`` is PipeDream's released optimizer (``optimizer/optimizer_graph_hierarchical.py`` in
    msr-fiddle/pipedream, run with ``--activation_compression_ratio 1`` as its README does), which
    differs from the paper's text; with ``C`` the range's compute at this level (level 1: the sum of
    ``c_l``; above: the level below's best time), ``W`` its weights, ``r`` its replicas:

    1. a stage costs ``(C + 4 (r-1) W / (r B)) / r``: a sum where the paper takes the max, and
       ``4 (r-1)/r W`` bytes (twice a ring all-reduce's) where the paper has ``2 (r-1) W``;
    2. in a level's pipeline, every block after the first also costs ``2 a / (B r)`` for the cut
       before it and, unless it ends the chain, for the cut after it (``r``: that block's replicas;
       without ``--activation_compression_ratio`` the released code charges no boundary at all);
    3. at level ``k >= 2`` the *first* block's weight term is divided by the count of level ``k-1``
       (the released ``num_machines_within_machine``), later blocks' are not;
    4. every range uses exactly all its units (no ``--use_fewer_machines``), no memory limit;
    5. data parallelism: ``t = C``, then per level ``t = (t + 4 (m-1) W / (m B) / n) / m``.

    It is solved by its own DP (``planner/pipedream.py``, :func:`solve_released`), not the bisection below; ties between
    equally fast configurations may break differently (the released code's order varies from run to
    run). The ILP refuses it.

    ``default`` is ours: the same structure (and the same boundaries), plus

    - the **all-reduce** among ``r`` replicas is a ring all-reduce, ``2 (r-1)/r * W / B``, done once
      per round of ``r`` minibatches (each replica processes one) and overlapped with the backward
      pass: a level-1 stage takes ``(F + max(Bw, AR) + OPT) / r`` per minibatch, where ``F``/``Bw``
      are the forward/backward sums; at outer levels ``max(A^{k-1}, AR_k) / r``;
    - the **optimizer step** ``OPT = (3 + 2 f) W / memory_bandwidth`` (read weights, gradients and
      ``f`` x weights of optimizer state; write weights and state) when the device's memory bandwidth
      is known, else 0;
    - the **memory limit** (on by default for this model; off by default for ``paper``).

    Memory (``default`` and ``paper``, when the limit is on)
    -------------------------------------------
    A worker of a stage holds ``W * (versions + 1 + f) + X * k`` bytes: ``W`` the stage's parameter
    bytes, ``versions`` the weight versions the schedule keeps (1F1B with stashing: ``k``; Flush: 1;
    2BW: 2), one gradient buffer, ``f = optimizer_state_factor`` bytes of optimizer state per
    parameter byte, and ``k`` in-flight minibatches of stashed activations ``X`` (the outputs of the
    stage's layers plus the bytes it receives). ``k = ceil(D / n)``, with ``n`` the stage's workers
    and ``D`` the workers at it and downstream: NOAM = ceil(workers / input replicas) at the input
    stage, fewer downstream. In a hierarchy, downstream stages of an *outer* level count with all
    the workers of their groups (a safe upper bound); within a group the count is exact.
    The bytes a stage starting at ``i`` receives are ``cut_bytes[i-1]``, capped to keep them
    monotone (``in[i+1] <= in[i] + output[i]``, which every chain from ``linearize`` satisfies).

    Pooled workers (``pool=True``): see :func:`pool_cluster`. A plan made without the memory limit
    whose stage exceeds the device's memory says so in a note (the stage, its bytes, the device's).

    Algorithm
    ---------
    Bisection on the bottleneck value ``tau`` (in log space, then one exact step on the found
    plan's own time). For a given ``tau`` a backward greedy decides feasibility exactly: ``L[w]`` is
    the smallest start of a suffix of the chain that ``w`` units can cover with every stage and
    boundary within ``tau``; prepending a stage of ``r`` units in front of the suffix covered by
    ``D`` units uses the cut just before that suffix (the first allowed one), and the stage may
    reach back as far as its cost allows (prefix sums + ``searchsorted``). Stage cost and memory are
    monotone in the range, so the furthest-back suffix dominates. Step ``w`` tries ``D = w - r``:
    with the memory limit too this is every ``(r, D)`` pair, as ``L`` is a running minimum and a
    pair does not depend on ``w`` (:meth:`PlanModel._group_start`). At level ``k`` the stage check
    asks the level-``k-1`` greedy (one group, threshold ``r * tau``), vectorized over all
    candidate stages of a step. The top level's one query searches by breakpoints
    (:meth:`PlanModel._group_start_one`): only a ``D`` where ``L`` drops can improve a step, and
    each such ``D``'s stages are asked once, vectorized over ``r``, so a level of ``m`` units costs
    O(breakpoints x m) stage checks, not O(m^2); the result is the same search's. Everything is
    vectorized with numpy; see ``benchmarks/bench_planner.py``.
    """
    t0 = time.perf_counter()
    opts = plan_options(options, overrides)
    if opts.tensor_parallel != 1:
        return plan_tensor_parallel(chain, cluster, opts, lambda c, cl, o, _split, _faster: partition_dp(c, cl, o))
    pool = opts.pool
    if pool and opts.cost_model == "pipedream":
        raise UsageError("the pipedream cost model reproduces PipeDream's released optimizer, whose stages nest in "
                         "the cluster's levels; pool=True goes with cost_model='default' or 'paper'")
    model = PlanModel(chain, cluster, opts)
    baseline = model
    notes = []
    ev: Evaluation | None
    if not (pool and model.L > 1):
        blocks, ev = solve(model)
    else:  # the workers also as one pool at the slowest link: stages need not nest
        pooled = PlanModel(chain, pool_cluster(cluster), opts)
        pooled.mem.share_tables(model.mem)  # the same chain, schedule, workers and budget: one set of tables
        ev, pev, blocks, pblocks = _solve_both(model, pooled)
        if ev is None or (pev is not None and pev.seconds < ev.seconds * (1 - 1e-9)):
            assert pev is not None
            model, blocks, ev = pooled, pblocks, pev
            notes.append(f"pooled: the stages need not nest in {cluster.levels[-1].name}; every stage and link "
                         f"is rated at the slowest link ({format_quantity(pooled.B[0], 'bandwidth')})")
    assert ev is not None
    optimal = True
    return build_plan(model, blocks, ev, solver="dp", planning_seconds=time.perf_counter() - t0,
                       optimal=optimal, gap=0.0 if optimal else math.nan, notes=notes, baseline=baseline)


def _dp_seconds(model: PlanModel) -> float:
    """Data parallelism's time under ``model`` where it fits (else inf): which search to run first."""
    dp: tuple[Block, ...] = ()
    for count in model.counts:
        dp = (Block(0, model.N - 1, count, dp),)
    ev = model.evaluate(dp)
    return ev.seconds if model.memory_ok(ev) else math.inf


def _solve_both(model: PlanModel, pooled: PlanModel) -> tuple[Evaluation | None, Evaluation | None,
                                                              tuple[Block, ...], tuple[Block, ...]]:
    """The hierarchy's and the pool's plans, as far as the choice between them needs: the pool's
    is kept only when strictly faster (``pev < ev (1 - 1e-9)``). One is searched first (the one
    whose data parallelism is faster); the other only where one feasibility test at that bound
    (the bisection's own exact step) says it could change the choice. Raises the hierarchy's
    InfeasiblePlanError when neither fits."""
    ev: Evaluation | None = None
    pev: Evaluation | None = None
    blocks: tuple[Block, ...] = ()
    pblocks: tuple[Block, ...] = ()
    if _dp_seconds(pooled) < _dp_seconds(model):
        try:
            pblocks, pev = solve(pooled)
        except InfeasiblePlanError:
            pass
        if pev is None or pev.seconds <= 0 or model.feasible(pev.seconds / (1 - 1e-9)):
            try:
                blocks, ev = solve(model)
            except InfeasiblePlanError:  # the hierarchy's error (it names the memory that fits) when neither fits
                if pev is None:
                    raise
    else:
        try:
            blocks, ev = solve(model)
        except InfeasiblePlanError:
            pass
        if ev is None or (ev.seconds > 0 and pooled.feasible(ev.seconds * (1 - 1e-9))):
            try:
                pblocks, pev = solve(pooled)
            except InfeasiblePlanError:
                if ev is None:
                    solve(model)  # raises the hierarchy's error (it names the memory that fits)
    return ev, pev, blocks, pblocks


def pool_cluster(cluster: ClusterSpec) -> ClusterSpec:
    """The cluster's workers as one level at its slowest link: a stage may take any ``r`` of them
    (15 of 4 servers x 4), rated by the slowest link it may span.

    In the hierarchy a stage nests (whole units of a level, or a share of one). ``partition_dp(...,
    pool=True)`` also plans on this pool, where every stage, weight sync and boundary is rated at the
    slowest link (exact for a stage that spans servers, an upper bound for one that does not), and
    keeps the pooled plan when strictly faster; its ranks are consecutive and :func:`evaluate` rates
    them with ``pool=True``. The ILP refuses ``pool=True`` on more than one level; the ``pipedream``
    model refuses it (the released optimizer's stages nest)."""
    if len(cluster.levels) == 1:
        return cluster
    return ClusterSpec(cluster.device, (Level("pool", cluster.num_workers, min(cluster.bandwidths)),))


def _model(chain: Chain, cluster: ClusterSpec, options: PlanOptions | None, overrides: dict[str, Any]) -> PlanModel:
    """The model a given configuration is rated under (``pool``: on :func:`pool_cluster`)."""
    opts = plan_options(options, overrides)
    if opts.pool:  # rate the stages on the pool (ranks need not nest)
        cluster = pool_cluster(cluster)
    if opts.memory_limit is None and cluster.device.memory is None:
        opts = replace(opts, memory_limit=False)  # evaluating needs no limit
    return PlanModel(chain, cluster, opts)


def _to_blocks(stages: Any, cluster: ClusterSpec) -> tuple[Block, ...]:
    """Accept a Plan, StagePlans, (first, last, replicas[, ranks]) tuples or Blocks."""
    if isinstance(stages, Plan):
        stages = stages.stages
    stages = list(stages)
    if stages and isinstance(stages[0], Block):
        return tuple(stages)
    flat: list[tuple[int, int, Sequence[int]]] = []
    next_rank = 0
    for s in stages:
        if isinstance(s, StagePlan):
            flat.append((s.first, s.last, s.ranks))
            continue
        if len(s) == 4:
            first, last, reps, ranks = s
            if len(ranks) != reps:
                raise UsageError(f"stage {first}..{last}: {reps} replicas but {len(ranks)} ranks")
        else:
            first, last, reps = s
            ranks = range(next_rank, next_rank + reps)
        flat.append((first, last, tuple(ranks)))
        next_rank = max(next_rank, max(ranks) + 1)
    try:
        return blocks_from_ranks(flat, cluster)
    except ValueError as e:
        raise UsageError(str(e)) from None


def _check_cover(blocks: Sequence[Block], first: int, last: int, cluster: ClusterSpec, level: int) -> None:
    """Blocks must cover ``first..last`` contiguously (recursively) within the level's units."""
    pos = first
    for b in blocks:
        if b.first != pos or b.last < b.first:
            raise UsageError(f"stages must cover the chain contiguously: expected a stage starting at "
                             f"{pos}, got {b.first}..{b.last}")
        if level > 1:
            _check_cover(b.inner, b.first, b.last, cluster, level - 1)
        pos = b.last + 1
    if pos != last + 1:
        raise UsageError(f"stages end at {pos - 1} but must reach {last}")
    if sum(b.units for b in blocks) > cluster.levels[level - 1].count:
        raise UsageError(f"the stages use more units of level {cluster.levels[level - 1].name!r} "
                         f"than it has ({cluster.levels[level - 1].count})")


def evaluate(chain: Chain, cluster: ClusterSpec, stages: Any, options: PlanOptions | None = None,
             **overrides: Any) -> Evaluation:
    """Evaluate a configuration (Plan, StagePlans, ``(first, last, replicas[, ranks])`` tuples, or
    a Block tree) under the cost model: time, bottleneck, per-stage costs and memory
    (``pool=True``: on :func:`pool_cluster`, where the ranks need not nest)."""
    model = _model(chain, cluster, options, overrides)
    blocks = _to_blocks(stages, model.cluster)
    _check_cover(blocks, 0, len(chain) - 1, model.cluster, len(model.cluster.levels))
    return model.evaluate(blocks)


def pipeline_time(chain: Chain, cluster: ClusterSpec, stages: Any, options: PlanOptions | None = None,
                  **overrides: Any) -> float:
    """Seconds per minibatch of a given configuration under the cost model (see :func:`evaluate`)."""
    return evaluate(chain, cluster, stages, options, **overrides).seconds


def stage_time(chain: Chain, cluster: ClusterSpec, first: int, last: int, replicas: int, *,
               cost_model: str = "default") -> float:
    """Time per minibatch of one worker-level stage ``first..last`` replicated ``replicas`` times
    over the innermost level's links."""
    return PlanModel(chain, cluster, PlanOptions(cost_model, memory_limit=False)).level1_stage(first, last, replicas)[0]


def stage_memory(chain: Chain, first: int, last: int, in_flight: int, options: PlanOptions | None = None,
                 **overrides: Any) -> float:
    """Per-worker bytes of stage ``first..last`` with ``in_flight`` minibatches (module doc) under
    ``options`` (their schedule and optimizer state; keyword overrides as for :func:`partition_dp`)."""
    from pdcompile.cluster import Device, Level

    cluster = ClusterSpec(Device("any", memory=1.0), (Level("l", 1, 1.0),))
    opts = replace(plan_options(options, overrides), cost_model="paper", memory_limit=False)
    return PlanModel(chain, cluster, opts).memory(first, last, in_flight)


def stage_memory_at(chain: Chain, first: int, last: int, options: PlanOptions | None = None, *, in_flight: int,
                    weight_versions: int, recompute: bool | str = False, activation_scale: float = 1.0, head: int = 0,
                    shard: str = "none", replicas: int = 1) -> float:
    """Per-worker bytes of stage ``first..last`` at given in-flight and weight-version counts: the
    planner's stage memory (module doc) under ``options`` (their schedule, optimizer state and
    microbatches), for the simulator's counts; the stage's own decisions after them: its ``recompute``
    mode (``head``: partial's layers), activations scaled by ``activation_scale``, its ``replicas``
    holding weights, gradients and optimizer state as ``shard`` (``planner/sharding.py``: the prediction
    ``bench_memory_model`` measures against)."""
    model = stage_decisions(chain, options).memory
    return model.memory_at(first, last, in_flight, weight_versions, recompute, activation_scale, head,
                           shard=shard, replicas=replicas)


def data_parallel_time(chain: Chain, cluster: ClusterSpec, cost_model: str = "default") -> float:
    """Seconds per minibatch of pure data parallelism over all workers under ``cost_model``."""
    return PlanModel(chain, cluster, PlanOptions(cost_model, memory_limit=False)).data_parallel_time()


def plan_from_assignment(chain: Chain, cluster: ClusterSpec, assignment: Any, options: PlanOptions | None = None, *,
                         solver: str = "fixed", **overrides: Any) -> Plan:
    """A Plan for a given configuration (see :func:`evaluate` for the accepted forms)."""
    t0 = time.perf_counter()
    model = _model(chain, cluster, options, overrides)
    blocks = _to_blocks(assignment, model.cluster)
    _check_cover(blocks, 0, len(chain) - 1, model.cluster, len(model.cluster.levels))
    ev = model.evaluate(blocks)
    notes = []
    if not model.memory_ok(ev):
        notes.append(f"exceeds the memory limit: {format_quantity(ev.peak_memory, 'memory')} per worker")
    baseline = _model(chain, cluster, replace(model.options, pool=False), {}) if model.options.pool else model
    return build_plan(model, blocks, ev, solver=solver, planning_seconds=time.perf_counter() - t0,
                       optimal=False, gap=math.nan, notes=notes, baseline=baseline)


def pipeline_plan(chain: Chain, stage_bounds: Sequence[int], cluster: ClusterSpec, options: PlanOptions | None = None,
                  **overrides: Any) -> Plan:
    """A straight pipeline with a fixed split: stage ``k`` runs on rank ``k`` alone.

    ``stage_bounds`` are the first positions of stages 1..S-1 (e.g. ``[3, 7]`` splits a 10-layer
    chain into 0..2, 3..6, 7..9); ``[]`` is one stage. Options as for :func:`partition_dp`.
    """
    bounds = [0, *[int(b) for b in stage_bounds], len(chain)]
    if any(b <= a for a, b in zip(bounds, bounds[1:])):
        raise UsageError(f"stage bounds must increase within 1..{len(chain) - 1} (got {list(stage_bounds)})")
    if len(bounds) - 1 > cluster.num_workers:
        raise UsageError(f"{len(bounds) - 1} stages need {len(bounds) - 1} workers; the cluster has {cluster.num_workers}")
    assignment = [(a, b - 1, 1, (k,)) for k, (a, b) in enumerate(zip(bounds, bounds[1:]))]
    return plan_from_assignment(chain, cluster, assignment, options, solver="fixed", **overrides)


class SlowerPlanError(InfeasiblePlanError):
    """A degree's search cut at another degree's step (``plan_step(faster_than=)``): none of its plans is
    faster."""


#: a plan with a degree per stage rated as its compiled program's ``simulate()``: (over memory, step seconds)
#: (one that cannot beat the given step may answer ``(over, inf)`` without simulating it)
Rate = Callable[[Plan, Chain, ClusterSpec, float], tuple[bool, float]]


def plan_tensor_parallel(chain: Chain, cluster: ClusterSpec, options: PlanOptions,
                         solve: Callable[[Chain, ClusterSpec, PlanOptions, bool | None, float | None], Plan],
                         rate: Rate | None = None) -> Plan:
    """The plan with tensor parallelism (``options.tensor_parallel``: a degree, or ``"auto"``): for each
    degree ``t`` that fits (:func:`tensor.degrees`), ``solve`` plans :func:`tensor.chain_at` (the chain as
    one of ``t`` ranks runs it, all-reduces at the innermost level's bandwidth) on :func:`tensor.cluster_at`
    (groups of ``t`` workers), so stages, replicas and everything else the search decides are searched at
    each ``t``; the fastest plan wins (ties: the smaller ``t``). Every stage has the plan's degree (the
    runtime runs one degree per program); its ranks are the groups' (pipeline ranks), and each stage says
    why in one line. Raises the smallest degree's InfeasiblePlanError when none fits. Each degree's search is
    given the best step of the smaller degrees (``solve``'s last argument: a step search stops where its
    bounds reach it, :class:`SlowerPlanError` where none of its plans is faster; ties go to the smaller
    degree, so the pick is the one of searching every degree in full).

    ``rate`` (``"auto"`` with a synchronous schedule's step search, :func:`pdcompile.plan.plan`): then a degree
    per stage is searched from that plan (:func:`per_stage_degrees`), and kept where its simulated step is
    strictly shorter."""
    t0 = time.perf_counter()
    inner = cluster.levels[0]
    cands = tensor.degrees(options.tensor_parallel, cluster, chain)
    flat = replace(options, tensor_parallel=1)
    found: list[tuple[int, Plan]] = []
    failed: list[tuple[int, InfeasiblePlanError]] = []
    slower: list[tuple[int, float]] = []

    def solve_at(t: int, faster_than: float | None = None) -> Plan:
        # a split stage's replicas shard as ZeRO-1 only: shard="auto" is not offered FSDP2 at t > 1
        return solve(tensor.chain_at(chain, t, inner.bandwidth), tensor.cluster_at(cluster, t),
                     replace(flat, shard_full=t == 1), tensor.split_backward(t), faster_than)

    with refusals_without_memory():  # the step search's refused candidates are discarded: no bisection for them
        for t in cands:  # ascending: a later degree must be strictly faster
            beat = min((p.seconds_per_minibatch for _, p in found), default=None)
            try:
                found.append((t, solve_at(t, beat)))
            except SlowerPlanError:
                assert beat is not None
                slower.append((t, beat))
            except InfeasiblePlanError as e:
                failed.append((t, e))
    if not found:
        solve_at(failed[0][0])  # the smallest degree's refusal in full (naming the memory that would fit)
        raise failed[0][1]  # pragma: no cover - it refused just now
    t, best = min(found, key=lambda c: (c[1].seconds_per_minibatch, c[0]))
    compared = [f"t={d}: {p.seconds_per_minibatch:.4g} s" for d, p in found] + \
               [f"t={d}: over {b:.4g} s" for d, b in slower] + \
               [f"t={d}: does not fit" for d, _ in failed]
    over = [c for c in compared if not c.startswith(f"t={t}:")]
    chain_t = tensor.chain_at(chain, t, inner.bandwidth)
    stages = []
    for st in best.stages:
        whole, part = chain.layers[st.first:st.last + 1], chain_t.layers[st.first:st.last + 1]
        ar = sum(2 * tensor.allreduce_s(l.tp_allreduce_bytes, t, inner.bandwidth, l.tp_allreduces) for l in whole)
        why = "" if options.tensor_parallel != "auto" else tensor.stage_reason(
            t, sum(l.compute_s for l in whole), sum(l.compute_s for l in part), ar,
            sum(l.param_bytes for l in whole), sum(l.param_bytes for l in part), inner,
            [f"{c} per minibatch" for c in over], why_one=tensor.why_not(cluster, chain) if len(cands) == 1 else "")
        stages.append(replace(st, tensor_parallel=t, tensor_why=why))
    note = (f"tensor parallelism: t={t} inside {inner.name}" +
            (f" ({'; '.join(compared)} per minibatch; the fastest)" if len(compared) > 1 else "") +
            (f"; each of the {best.num_workers} pipeline ranks is {t} workers" if t > 1 else ""))
    dp = next((p.data_parallel_samples_per_second for d, p in found if d == 1), best.data_parallel_samples_per_second)
    out = replace(best, stages=tuple(stages), num_workers=cluster.num_workers, cluster=str(cluster),
                  data_parallel_samples_per_second=dp, notes=(*best.notes, note))
    if rate is not None and options.tensor_parallel == "auto" and len(cands) > 1:
        out = per_stage_degrees(chain, cluster, flat, out, cands, rate)
    return replace(out, planning_seconds=time.perf_counter() - t0)


def per_stage_degrees(chain: Chain, cluster: ClusterSpec, options: PlanOptions, best: Plan, degrees: Sequence[int],
                      rate: Rate) -> Plan:
    """A degree per stage, searched from ``best`` (one degree ``t`` for every stage, the fastest such plan), in two
    parts, each candidate rated by ``rate`` (the compiled program's simulated step on :func:`tensor.plan_view`,
    over memory losing; one that cannot beat the best so far cut by its lower bound), the fastest kept where
    strictly faster than ``best``:

    1. **exact over the same stages**: each stage keeps its layers and its processes (``replicas x t``) and may run
       them as ``t'`` of ``degrees`` dividing them, ``replicas x t / t'`` pipeline ranks of ``t'`` processes; every
       such assignment of two degrees or more (one degree for all is the one-degree search's) is rated where there
       are at most :data:`tensor.EXACT_LIMIT` of them;
    2. **a descent** from the best so far: each step rates every stage's other degrees (:func:`tensor.degree_moves`)
       and every cut of a stage in two, its processes shared in whole blocks of its degree, each half at its own
       degree (:func:`tensor.split_moves`, where at most :data:`tensor.SPLIT_LIMIT`), and moves to the fastest,
       until none is faster or :data:`tensor.DESCENT_LIMIT` candidates are rated (the note says which).

    Every candidate: replica counts dividing the microbatches, stages sharing a tied weight at one degree, each block
    of ``t`` processes inside one innermost unit, every stage's ranks (and processes) consecutive, stage by stage
    (:func:`tensor.layout_ok`). Its stages say why each has its ``t``; a note says what was searched."""
    t0 = time.perf_counter()
    mb, m = best.microbatch_size, best.num_microbatches
    inner = cluster.levels[0]
    first_t = best.stages[0].tensor_parallel
    start: tuple[tensor.StageAt, ...] = tuple((st.first, st.last, st.tensor_parallel, st.replicas) for st in best.stages)
    opts = replace(options, num_microbatches=m, choose_microbatches=False, shard="none", tensor_parallel=1)
    rated: dict[tuple[tensor.StageAt, ...], tuple[tuple[bool, float], Plan | None]] = {}

    def rate_one(stages: tuple[tensor.StageAt, ...], beat: float) -> tuple[bool, float]:
        if stages not in rated:
            rated[stages] = _rate_layout(chain, cluster, opts, stages, mb, m, rate, beat)
        return rated[stages][0]

    def better(key: tuple[bool, float], than: float) -> bool:
        return not key[0] and key[1] < than * (1 - 1e-9)

    def allowed(stages: tuple[tensor.StageAt, ...]) -> bool:  # one degree 1 for all: the one-degree search's
        return stages != start and any(t > 1 for _, _, t, _ in stages) and tensor.layout_ok(chain, stages, inner.count)

    top_s, top = best.seconds_per_minibatch, start
    choices = [tensor.stage_choices(t * r, degrees, m) for _, _, t, r in start]
    total = math.prod(len(c) for c in choices)
    exact = total <= tensor.EXACT_LIMIT
    if exact:
        for combo in itertools.product(*choices):
            cand = tuple((a, b, t, r) for (a, b, _, _), (t, r) in zip(start, combo))
            if len({t for t, _ in combo}) > 1 and allowed(cand):
                key = rate_one(cand, top_s)
                if better(key, top_s):
                    top_s, top = key[1], cand
    exact_s, steps, splits, tried, spent = top_s, 0, True, len(rated), False
    while not spent:  # the descent: the fastest move from here, until none is faster (or its budget is spent)
        moves = list(tensor.degree_moves(top, degrees, m))
        cut = list(itertools.islice(tensor.split_moves(top, degrees, m), tensor.SPLIT_LIMIT + 1))
        splits = splits and len(cut) <= tensor.SPLIT_LIMIT
        here = top
        for cand in moves + (cut if len(cut) <= tensor.SPLIT_LIMIT else []):
            if not allowed(cand):
                continue
            if cand not in rated and len(rated) - tried >= tensor.DESCENT_LIMIT:
                spent = True
                break
            key = rate_one(cand, top_s)
            if better(key, top_s):
                top_s, top = key[1], cand
        if top == here:
            break
        steps += 1
    how = (f"{f'every one of the {total} per-stage assignments on the same stages and processes rated (exact over them)' if exact else f'{total} per-stage assignments on the same stages: too many to rate each'}"
           f"; then a descent by each stage's degree{' and cuts of a stage in two' if splits else ''}: "
           f"{f'{steps} step(s) faster' if steps else 'nothing faster'}"
           f"{f', stopped at its budget of {tensor.DESCENT_LIMIT} candidates' if spent else ''}; {len(rated)} candidates tried "
           f"in {time.perf_counter() - t0:.2g} s")
    if top == start:
        return replace(best, notes=(*best.notes, f"a degree per stage: none faster than t={first_t} for every stage ({how})"))
    mixed = rated[top][1]
    assert mixed is not None
    chain_u = tensor.chain_at(chain, first_t, inner.bandwidth).at_batch(mb)
    chain_v = tensor.stages_at(chain, [(a, b, t) for a, b, t, _ in top], inner.bandwidth).at_batch(mb)
    was = {i: st for st in best.stages for i in range(st.first, st.last + 1)}
    stages = []
    for st, (a, b, t, _) in zip(mixed.stages, top):
        mine = slice(a, b + 1)
        old = was[a]
        why = tensor.mixed_reason(t, old.tensor_parallel, st.replicas, sum(l.compute_s for l in chain_v.layers[mine]),
                                  sum(l.compute_s for l in chain_u.layers[mine]), st.memory_bytes, old.memory_bytes,
                                  inner, (old.first, old.last) != (a, b))
        stages.append(replace(st, tensor_why=why))
    note = (f"a degree per stage: {[t for _, _, t, _ in top]} ({sum(r for _, _, _, r in top)} pipeline ranks), "
            f"{top_s:.4g} s per minibatch against {best.seconds_per_minibatch:.4g} s at t={first_t} for every stage "
            f"({how}{f'; the exact part alone: {exact_s:.4g} s' if exact and steps else ''})")
    return replace(best, stages=tuple(stages), seconds_per_minibatch=top_s,
                   samples_per_second=mb * (m or 1) / top_s if top_s > 0 else math.inf,
                   bottleneck=mixed.bottleneck, notes=(*best.notes, note))


def _rate_layout(chain: Chain, cluster: ClusterSpec, opts: PlanOptions, stages: Sequence[tensor.StageAt], mb: int,
                 m: int, rate: Rate, beat: float) -> tuple[tuple[bool, float], Plan | None]:
    """``stages`` (first, last, t, replicas each; ranks consecutive) as a Plan of pipeline ranks with each stage's
    degree, and ``rate``'s key for it (over memory, step). The stages' figures (memory, compute) are the planner's
    model of the processes: the chain at each stage's degree (:func:`tensor.stages_at`) on the cluster, each stage
    on its ranks' first processes (where they do not nest in the levels, on the pool)."""
    inner = cluster.levels[0]
    ranks = tensor.consecutive_ranks(stages)
    degs = [t for _, _, t, _ in stages]
    bases, per_rank = tensor.rank_blocks(ranks, degs)
    chain_v = tensor.stages_at(chain, [(a, b, t) for a, b, t, _ in stages], inner.bandwidth).at_batch(mb)
    assignment = [(a, b, len(rs), tuple(bases[q] for q in rs)) for (a, b, _, _), rs in zip(stages, ranks)]
    proc: Plan | None = None
    for pool in (False, True):
        try:
            proc = plan_from_assignment(chain_v, cluster, assignment, opts, pool=pool)
            break
        except UsageError:
            continue
    if proc is None:
        return (True, math.inf), None
    p = replace(proc, stages=tuple(replace(st, ranks=rs, tensor_parallel=t, shard="none")
                                   for st, rs, t in zip(proc.stages, ranks, degs)),
                num_microbatches=m, microbatch_size=mb)
    return rate(p, chain_v, tensor.RankBlocks(cluster.device, cluster.levels, bases, per_rank), beat), p
