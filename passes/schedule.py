"""The ``schedule`` pass: the action list every rank runs for one step of the split pipeline.

Built by :func:`pdcompile.runtime.schedules.make_schedule` from the schedule's name, the replicas
per stage (``stage_ranks``), the microbatches per step and whether stages share tied weights.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdcompile.ir import CompileState, need
from pdcompile.runtime.schedules import make_schedule


@dataclass(frozen=True)
class ScheduleOptions:
    schedule: str  # a name in pdcompile.runtime.schedules.SCHEDULES
    num_microbatches: int


def run(state: CompileState, opts: ScheduleOptions) -> CompileState:
    """Reads ``stage_ranks`` and ``stages`` (tied weights); writes ``schedule``."""
    replicas = [len(r) for r in need(state.stage_ranks, "stage_ranks")]
    tied = bool(need(state.stages, "stages").tied)
    return state.replace(schedule=make_schedule(opts.schedule, replicas, opts.num_microbatches, tied=tied))
