"""The ``partition`` pass: the chain cut into stages, each with its ranks, as a :class:`Plan`.

Without ``stages=`` the planner chooses stages, replicas and ranks on the cluster (PipeDream's DP,
:mod:`.partition_dp`, or the CP-SAT ILP, :mod:`.partition_ilp`, through :func:`pdcompile.plan.plan`).
With ``stages=S`` the chain is cut into ``S`` stages of balanced compute (:func:`balanced_split`,
the one balanced split, which the benchmarks use too), one rank each or ``replicas=`` per stage.
Without a cluster (or one too small for the replicas asked) the plan is for this machine's CPUs.
"""

from __future__ import annotations

import bisect

import dataclasses
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pdcompile.cluster import ClusterSpec, local_cpu_cluster
from pdcompile.errors import PdcompileError, UsageError
from pdcompile.ir import Chain, CompileState, need
from pdcompile.passes.partition_dp import SCHEDULES as DP_SCHEDULES
from pdcompile.passes.partition_dp import pipeline_plan, plan_from_assignment
from pdcompile.passes.planner import tensor
from pdcompile.passes.planner.options import PlanOptions
from pdcompile.passes.planner.sharding import resolve as resolve_shard
from pdcompile.plan import Plan
from pdcompile.plan import plan as choose_plan
from pdcompile.runtime.schedules import POLICIES, policy, stage_ranks


def planner_schedule(schedule: str) -> str:
    """The schedule name the planners' cost and memory model knows ``schedule`` by (its policy's
    ``planner_model``: GPipe and ZB-H1 keep one weight version, like Flush)."""
    return policy(schedule).planner_model or schedule


def planned_schedule(schedule: str) -> str:
    """The schedule the planners plan a run of ``schedule`` for: itself where they model it by name
    (every Policy's schedule the DP knows: GPipe holds all M in flight), else :func:`planner_schedule`
    (a torch CSV's). The partition pass and ``pdcompile simulate PROFILE`` plan so."""
    return schedule if schedule in DP_SCHEDULES else planner_schedule(schedule)


def balanced_split(weights: Sequence[float], num_stages: int, cut_bytes: Sequence[float]) -> list[int]:
    """First positions of stages 1..S-1 of ``weights`` cut into ``num_stages`` contiguous parts that
    minimise the largest part's sum. ``cut_bytes[i]`` is what a cut after item ``i`` sends (``math.inf``:
    no cut there); ties go to the narrowest widest cut, then to the earliest cuts. The DP over
    (parts, prefix) is vectorised over the last cut (numpy), over the cuts whose last part is within the one
    the previous prefix's choice gives (no other can tie the best): 1250 layers in 32 parts in a few
    tenths of a second instead of tens of seconds, Llama-3-70B's 4858 in 128 in seconds."""
    n = len(weights)
    if num_stages > n:
        raise UsageError(f"pdcompile: {num_stages} stages but the model has only {n} layers")
    pre = np.concatenate([[0.0], np.cumsum(np.asarray(weights, dtype=float))])
    monotone = bool(np.all(np.diff(pre) >= 0))  # a part's sum falls as its start moves right
    ok = np.array([True] + [math.isfinite(c) for c in cut_bytes])  # ok[j]: may a stage start at j?
    cut = np.array([0.0] + [float(c) for c in cut_bytes])  # cut[j]: bytes of a cut before item j
    inf = math.inf
    # best[k][i]: (largest part, widest cut) splitting weights[:i] into k parts
    big = np.full((num_stages + 1, n + 1), inf)
    wide = np.full((num_stages + 1, n + 1), inf)
    back = np.zeros((num_stages + 1, n + 1), dtype=int)
    big[0][0], wide[0][0] = 0.0, 0.0
    for k in range(1, num_stages + 1):
        js = np.arange(k - 1, n)
        prev_big, prev_wide = big[k - 1][js], wide[k - 1][js]
        usable = np.isfinite(prev_big) & ok[js]
        cut_j = np.where(js > 0, cut[js], 0.0)
        for i in range(k, n + 1):
            # every last cut j that can tie the best has its part pre[i] - pre[j] within the part that the
            # previous end's cut gives here (an upper bound of the best): only those are compared
            lo, hi = 0, i - (k - 1)
            j0 = int(back[k][i - 1]) - (k - 1) if i > k and monotone else -1
            if 0 <= j0 < hi and usable[j0]:
                top = max(prev_big[j0], pre[i] - pre[js[j0]])
                lo = bisect.bisect_left(range(j0 + 1), True, key=lambda t: bool(pre[i] - pre[js[t]] <= top))
            m = usable[lo:hi]
            if not m.any():
                continue
            jj = js[lo:hi]
            a = np.maximum(prev_big[lo:hi], pre[i] - pre[jj])
            b = np.maximum(prev_wide[lo:hi], cut_j[lo:hi])
            a = np.where(m, a, inf)
            amin = a.min()
            tie = a == amin
            bmin = np.where(tie, b, inf).min()
            t = int(np.flatnonzero(tie & (b == bmin))[0])
            big[k][i], wide[k][i], back[k][i] = amin, bmin, int(jj[t])
    if not math.isfinite(big[num_stages][n]):
        raise UsageError(f"pdcompile: no way to cut the model into {num_stages} stages where only tensors "
                         f"cross the cuts; use fewer stages")
    bounds, i = [], n
    for k in range(num_stages, 0, -1):
        i = int(back[k][i])
        bounds.append(i)
    return sorted(b for b in bounds if b > 0)


def balanced_bounds(chain: Chain, num_stages: int) -> list[int]:
    """:func:`balanced_split` of ``chain`` by compute time (forward + backward) at its allowed cuts."""
    return balanced_split([layer.compute_s for layer in chain.layers], num_stages, chain.cut_bytes)


#: the planning options where the pass's caller gives none (``pdcompile()`` gives all of them)
PASS_PLANNING = PlanOptions(schedule="flush", num_microbatches=1, shard="auto")


@dataclass(frozen=True)
class PartitionOptions:
    """The partition pass's options: ``planning``, what the planners read (the user's schedule name,
    mapped here to the one the planners model; a planning option is added to :class:`PlanOptions`
    alone), and how the pass applies them: a given split (``stages``, ``replicas``), the ``cluster``,
    the ``solver``, the boundaries' ``precision`` and stages per rank."""

    planning: PlanOptions = PASS_PLANNING
    stages: int | None = None  # None: the planner chooses
    replicas: tuple[int, ...] | None = None  # per stage, with stages=; default one each
    cluster: ClusterSpec | None = None
    solver: str = "dp"  # "dp" or "ilp"
    precision: str = "fp32"  # "bf16": boundaries send half the bytes (Chain.on_the_wire)
    virtual_stages: int = 1  # stages per rank, for a schedule with a placement (stages= counts them all)
    loss: Any = None  # trace-loss's options (TraceLossOptions), where known: whether the LM head splits by vocabulary
    degrees: tuple[int, ...] | None = None  # with stages=: each stage's tensor-parallel degree, charged per stage


def choose(chain: Chain, opts: PartitionOptions) -> tuple[Plan, ClusterSpec]:
    """The plan for ``chain`` and the cluster it is for, each stage with its ``shard`` mode."""
    plan, cluster = _choose(chain, opts)
    if opts.stages is None and opts.solver != "dp":  # the ILP plans unsharded: a mode asked is set on its plan
        plan = with_shard(plan, opts.planning)
    return plan, cluster


def with_shard(plan: Plan, options: PlanOptions) -> Plan:
    """``plan`` with each stage's mode under ``options.shard`` for their schedule (planner/sharding.py
    ``resolve``; their microbatch count where it is known: ``full`` needs one per replica)."""
    modes, notes = resolve_shard([st.replicas for st in plan.stages], options.shard, options.schedule,
                                 options.step_microbatches, [st.shard for st in plan.stages])
    if all(m == st.shard for m, st in zip(modes, plan.stages)) and not notes:
        return plan
    stages = tuple(dataclasses.replace(st, shard=m) for st, m in zip(plan.stages, modes))
    return dataclasses.replace(plan, stages=stages, notes=(*plan.notes, *notes))


def _choose(chain: Chain, opts: PartitionOptions) -> tuple[Plan, ClusterSpec]:
    asked = opts.planning
    # both planners' memory models read every schedule's own Policy (GPipe: all M in flight) and know the
    # schedules by name; one they do not (a torch CSV's) is planned as its policy's planner_model
    sched = planned_schedule(asked.schedule)
    # a given split is rated under the default cost model, as it always was
    mem = dataclasses.replace(asked, cost_model="default")
    place = policy(asked.schedule).placement if asked.schedule in POLICIES else None
    if place is not None:
        return _virtual_plan(chain, opts, place, mem)
    if opts.stages is None:
        cluster = opts.cluster if opts.cluster is not None else local_cpu_cluster(2)
        planning = dataclasses.replace(asked, schedule=sched)
        if opts.solver != "dp":  # the ILP plans unsharded (choose sets the mode) and without recomputation,
            # which "auto" allows; "full" or "selective" it refuses
            planning = dataclasses.replace(planning, shard="none",
                                           recompute="none" if asked.recompute == "auto" else asked.recompute)
        return choose_plan(chain, cluster, planning, solver=opts.solver), cluster
    n = opts.stages
    reps: Sequence[int] = opts.replicas if opts.replicas is not None else [1] * n
    cluster = opts.cluster if opts.cluster is not None and opts.cluster.num_workers >= sum(reps) \
        else local_cpu_cluster(sum(reps))
    # a given split: the memory limit of a cluster the user gave (recompute="auto" fits stages in it), else none
    limit = None if opts.cluster is not None and cluster is opts.cluster else False
    cuts = balanced_bounds(chain, n)
    bounds = [0, *cuts, len(chain)]
    # given degrees: each stage's layers charged at its own t (passes/planner/tensor.py), a worker a pipeline rank
    degrees = opts.degrees if opts.degrees is not None else (1,) * n
    charged = tensor.stages_at(chain, [(a, b - 1, t) for (a, b), t in zip(zip(bounds, bounds[1:]), degrees)],
                               cluster.levels[0].bandwidth)
    if opts.replicas is None:
        plan = pipeline_plan(charged, cuts, cluster, mem, schedule=sched, memory_limit=limit)
    else:  # the same balanced split, stage k on ranks stage_ranks(replicas)[k]
        assignment = [(a, b - 1, len(r), tuple(r)) for (a, b), r in zip(zip(bounds, bounds[1:]), stage_ranks(reps))]
        plan = plan_from_assignment(charged, cluster, assignment, mem, schedule=sched, memory_limit=limit)
    if any(t != 1 for t in degrees):
        plan = dataclasses.replace(plan, stages=tuple(dataclasses.replace(st, tensor_parallel=t)
                                                      for st, t in zip(plan.stages, degrees)))
    return plan, cluster


def placement_choices(schedule: str, stages: int) -> dict[int, int]:
    """Stages per rank -> ranks, for every count of stages per rank that ``schedule``'s policy places
    ``stages`` stages with (its ``placement`` accepts it and puts exactly that many on each rank)."""
    place = policy(schedule).placement
    out: dict[int, int] = {}
    if place is None:
        return out
    for v in range(1, stages + 1):
        try:
            ranks = place(stages, v)
        except UsageError:
            continue
        held = [q for rs in ranks for q in rs]
        if all(held.count(q) == v for q in held):
            out[v] = len(set(held))
    return out


def infer_virtual_stages(schedule: str, stages: int | None, workers: int | None) -> int:
    """Stages per rank where the user gave none: the one count ``schedule``'s placement admits for
    ``stages`` stages (a V: 2), else the one that puts them on exactly ``workers`` ranks (interleaved:
    ``stages / workers``). Without ``stages=``, the fewest the placement admits on ``workers`` (this
    machine's 2 without a cluster); without a cluster, the fewest for ``stages``; fewer stages than
    workers, one each. Where several counts fit and none exactly on ``workers``: a UsageError naming
    the choices. 1 for a schedule without a placement, and where nothing fits (the placement's own
    error then says why)."""
    if schedule not in POLICIES or policy(schedule).placement is None or isinstance(stages, bool):
        return 1
    if stages is None:
        p = workers if workers is not None else 2
        return next((v for v in range(1, 9) if placement_choices(schedule, v * p).get(v) == p), 1)  # up to 8 per rank
    if not isinstance(stages, int) or stages < 1:
        return 1
    choices = placement_choices(schedule, stages)
    if len(choices) <= 1 or workers is None:
        return min(choices, default=1)
    exact = [v for v, p in choices.items() if p == workers]
    if len(exact) == 1:
        return exact[0]
    if choices.get(1, workers + 1) <= workers:
        return 1  # fewer stages than workers: one per rank, as any schedule runs them
    fit = ", ".join(f"{v} ({p} rank{'s' if p > 1 else ''})" for v, p in sorted(choices.items()) if p <= workers)
    counts = [v * workers for v in range(1, 4) if placement_choices(schedule, v * workers).get(v) == workers]
    raise UsageError(f"pdcompile: schedule={schedule!r} with stages={stages} on {workers} workers: no count of "
                     f"stages per rank puts them on exactly {workers} ranks; give virtual_stages= "
                     f"{fit or 'explicitly'}, or stages= one of {', '.join(map(str, counts))}")


def _virtual_plan(chain: Chain, opts: PartitionOptions, place: Any, mem: PlanOptions) -> tuple[Plan, ClusterSpec]:
    """Virtual stages: ``stages=`` (default ``v`` per worker of the cluster, or of this machine's 2)."""
    v = opts.virtual_stages
    workers = opts.cluster.num_workers if opts.cluster is not None else 2
    return virtual_plan(chain, opts.cluster, opts.planning.schedule, v, opts.stages if opts.stages is not None else v * workers,
                        mem)


def virtual_plan(chain: Chain, cluster: ClusterSpec | None, schedule: str, v: int, n: int,
                 mem: PlanOptions | None = None) -> tuple[Plan, ClusterSpec]:
    """``n`` stages of balanced compute placed ``v`` per rank as ``schedule``'s policy says, and the
    cluster they run on (this machine's CPUs without one, or one too small)."""
    place = policy(schedule).placement
    assert place is not None, f"{schedule} has no placement"
    ranks = place(n, v)
    p = len({q for rs in ranks for q in rs})
    given = cluster
    cluster = given if given is not None and given.num_workers >= p else local_cpu_cluster(p)
    bounds = [0, *balanced_bounds(chain, n), len(chain)]
    assignment = [(a, b - 1, 1) for a, b in zip(bounds, bounds[1:])]
    # each stage costed as if on a worker of its own (the DP's model has no shared workers; the
    # simulator times the interleaving) of the cluster it runs on (the user's device and links, its
    # outermost level repeated where there are more stages than workers), then placed on the schedule's ranks
    costing = cluster.with_workers(n) if cluster is given else local_cpu_cluster(n)
    plan = plan_from_assignment(chain, costing, assignment, mem, schedule="flush", memory_limit=False)
    stages = tuple(dataclasses.replace(st, ranks=tuple(r)) for st, r in zip(plan.stages, ranks))
    return dataclasses.replace(plan, stages=stages, num_workers=p, cluster=str(cluster),
                               notes=(*plan.notes, f"{v} virtual stages per rank on {p} ranks ({schedule}); "
                                      f"times are per stage on a worker of its own")), cluster


def run(state: CompileState, opts: PartitionOptions) -> CompileState:
    """Reads ``chain``; writes ``plan``, ``assignment`` (fx node -> stage), ``stage_ranks`` and ``cluster`` (and,
    where the planner plans tensor parallelism, ``chain`` with what it splits: ``tensor_parallel.chain_shares``)."""
    chain = need(state.chain, "chain")
    if (opts.planning.tensor_parallel != 1 and opts.stages is None) or \
            (opts.degrees is not None and opts.stages is not None and max(opts.degrees) > 1):  # what Megatron's
        # layout splits, charged (by the planner's degree, or each stage's given one)
        from pdcompile.passes.tensor_parallel import chain_shares

        chain = chain_shares(need(state.gm, "gm"), chain, _model_loss(state, opts))  # kept: simulate() replays it
    plan, cluster = choose(chain.on_the_wire(opts.precision), opts)
    assignment = {name: st.index for st in plan.stages for name in st.members}
    return state.replace(chain=chain, plan=plan, assignment=assignment, cluster=cluster,
                         stage_ranks=tuple(tuple(st.ranks) for st in plan.stages))


def _model_loss(state: CompileState, opts: PartitionOptions) -> Any:
    """The loss traced on the whole model's output (the last stage's, before the stages exist), which says
    whether the LM head will split by vocabulary; None without a target, or where trace-loss will refuse it."""
    if opts.loss is None:
        return None
    from pdcompile.passes.trace_loss import loss_program

    on_meta = any(t.is_meta for t in itertools.chain(state.model.parameters(), state.model.buffers()))
    try:
        return loss_program(opts.loss.loss_fn, need(state.gm, "gm"), opts.loss.target, state.output_key,
                            values=not on_meta)
    except PdcompileError:  # trace-loss says why, after the stages are cut
        return None


def format_partition(state: CompileState) -> str:
    """The plan, then every node's stage (the pass's IR dump)."""
    lines = [str(state.plan), "", "node -> stage:"]
    lines += [f"  {name}: {k}" for name, k in need(state.assignment, "assignment").items()]
    return "\n".join(lines)
