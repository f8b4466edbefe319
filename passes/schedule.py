"""The ``schedule`` pass: the schedule the program will run, as a :class:`ScheduleSpec` (the policy
and every parameter; plan.json carries it and train.py runs it) and its action lists for one step.

It decides the one parameter that depends on the machine: a split backward, which pays only when
every worker has a core of its own (:func:`default_split_backward`) and some stage waits for another's
input gradients (never on one stage: data parallelism).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from pdcompile.errors import UsageError
from pdcompile.ir import CompileState, need
from pdcompile.runtime.schedules import policy
from pdcompile.runtime.schedules import format_grid
from pdcompile.runtime.schedules.spec import CHECK_STEPS, CHECK_TEXT_RANKS, ScheduleSpec, default_split_backward


@dataclass(frozen=True)
class ScheduleOptions:
    schedule: str  # a name in pdcompile.runtime.schedules.SCHEDULES
    num_microbatches: int
    vertical_sync: bool = False
    split_backward: bool | None = None  # None: default_split_backward for the plan's cluster
    virtual_stages: int = 1  # stages per rank (a schedule with a placement)
    csv: str | None = None  # a schedule read from a torch CSV: its text (plan.json carries it)


def run(state: CompileState, opts: ScheduleOptions) -> CompileState:
    """Reads ``stage_ranks``, ``stages`` (tied weights), ``tensor_parallel``, ``plan`` (shard modes) and ``cluster``; writes ``schedule_spec`` and
    ``schedule`` (one step's actions)."""
    replicas = tuple(len(r) for r in need(state.stage_ranks, "stage_ranks"))
    tied = bool(need(state.stages, "stages").tied)
    split = opts.split_backward
    if state.tensor_parallel is not None:  # a split backward of a stage split across ranks is not run yet
        if policy(opts.schedule).splits_every_backward:
            raise UsageError(f"schedule={opts.schedule!r} splits every backward, which tensor parallelism does not "
                             f"run yet; choose flush, gpipe, 1f1b or 2bw, or tensor_parallel=1")
        split = False
        for k, (st, tp) in enumerate(zip(state.plan.stages if state.plan is not None else (), state.tensor_parallel.stages)):
            if tp.degree > 1 and st.shard == "full":  # FSDP2 over a stage split by tensor parallelism (ZeRO-1 runs:
                # runtime/shard.py broadcasts a split parameter's local shard among its tensor index's replicas)
                raise UsageError(f"stage {k} shards its {st.replicas} replicas (shard={st.shard!r}) and is split by "
                                 f"tensor_parallel={tp.degree}, which is not run yet; give shard='optimizer' or 'none' "
                                 f"(or tensor_parallel=1)")
    if split is None and len(replicas) == 1 and opts.virtual_stages == 1:
        split = False  # one stage: no stage before it waits for its input gradients, so a split only adds actions
    if split is None:
        cluster = need(state.cluster, "cluster")
        workers = len({q for rs in need(state.stage_ranks, "stage_ranks") for q in rs})
        split = default_split_backward("cpu" if cluster.device.name == "cpu" else "gpu", workers,
                                       os.cpu_count() or 1)
    spec = ScheduleSpec(opts.schedule, replicas, opts.num_microbatches, tied, opts.vertical_sync, split,
                        opts.virtual_stages, opts.csv)
    return state.replace(schedule_spec=spec, schedule=spec.make(1))


def format_schedule(state: CompileState) -> str:
    """The dump: the spec, the periodic form every rank runs for a run of any length, and the action
    lists of a short run exactly as plan.json spells them out (what train.py checks it rebuilds).
    Like plan.json it shows the first :data:`CHECK_TEXT_RANKS` ranks, each derived alone (its own
    and its peers' lists), so a dump of a thousand-rank plan costs what sixteen ranks' start-ups do."""
    spec = need(state.schedule_spec, "schedule_spec")
    shown = range(min(spec.world_size, CHECK_TEXT_RANKS))
    rest = spec.world_size - len(shown)
    lines = [f"schedule: {spec}", "",
             "periodic form (any number of steps N; a period's later copies shift microbatches and versions):"]
    steps = 64
    for rank in shown:
        run = spec.rank_run(steps, rank)
        if run.repeats:
            lines.append(f"rank {rank}: head {' '.join(map(str, run.head))}")
            lines.append(f"        period (+{run.microbatches} microbatches each) {' '.join(map(str, run.period))}")
            lines.append(f"        tail {' '.join(map(str, run.tail))}")
        else:
            lines.append(f"rank {rank}: laid out whole (no period)")
    if rest:
        lines.append(f"(ranks {len(shown)} .. {spec.world_size - 1} not shown: plan.json checks them by digest)")
    lines += ["", f"the first {CHECK_STEPS} steps, every action (plan.json schedule.check):",
              format_grid(spec.make(CHECK_STEPS, ranks=shown), compute_only=False)]
    return "\n".join(lines)
