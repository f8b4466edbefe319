"""Which schedule a run executes: the compiled one from plan.json (checked against the actions it
spells out), unless flags change it; and the per-rank choices that follow from it (how a split
backward splits, whether one is split, whether targets may be sent)."""

from __future__ import annotations

import argparse
import logging
import os
from collections import Counter

import torch

from pdcompile.errors import ScheduleError, UsageError
from pdcompile.runtime import devices, schedules
from pdcompile.runtime.program import Program
from pdcompile.runtime.schedules.actions import Kind
from pdcompile.runtime.schedules.spec import ScheduleSpec, agrees, default_split_backward
from pdcompile.runtime.schedules.transfers import check_transfers, several_per_rank

log = logging.getLogger("pdcompile.runtime")


def refuse_sent_targets(spec: ScheduleSpec) -> None:
    """A :class:`UsageError` when the first stage cannot send every target to the last stage in an
    order NCCL pairs with the other transfers between their ranks. The check replays two steps
    under the executor's rule (without torch): with several stages on a rank, a step's targets
    travel as one block at its start (``schedules.transfers.TargetPosts``), which orders every
    built-in placement (interleaved 1F1B, looped BFS, the V shapes, torch's CSVs); it stays for a
    schedule, a CSV say, whose transfers on that pair of ranks cross from one step into the next."""
    if spec.virtual_stages == 1:
        return  # one stage per rank: every schedule passes (validate's rule 11 checks it with targets sent)
    ranks = spec.stage_ranks
    window = schedules.policy(spec.name).accumulation(spec.num_microbatches) if several_per_rank(ranks) else 1
    try:  # the executor's window (StageExecutor.target_window)
        check_transfers(spec.make(2), spec.replicas, targets=None, name=spec.name, placement=ranks,
                        target_step=window)
    except ScheduleError as e:
        raise UsageError(f"--targets send with {spec}: the targets from the first stage's rank to the last stage's "
                         f"cannot be ordered with the other transfers on that pair of ranks as NCCL needs ({e}). "
                         f"Fix: --targets local (the data source must give every rank the same minibatches, e.g. "
                         f"a seeded one)") from None


def weight_pass(flag: str, schedule: ScheduleSpec, rank: int) -> str:
    """``--weight-pass`` for ``rank`` running ``schedule``: ``auto`` is the graph split where most of
    the rank's backwards in a step are split (zb-h1, zb-v, a torch CSV such as its interleaved zero
    bubble: every microbatch gains), the submodules' where a step splits only a few (flush's drain,
    DualPipeV's: the graph's one-time trace and import would take longer than they save but in very
    long runs)."""
    if flag != "auto":
        return flag
    kinds = Counter(a.kind for a in schedule.make(1, ranks=(rank,))[rank])  # one step of this rank alone
    return "graph" if 2 * kinds[Kind.WEIGHT_GRAD] > kinds[Kind.BACKWARD] else "submodules"


def split_backward(flag: bool | None, device: torch.device) -> bool:
    """``--split-backward`` for a plan.json without a compiled schedule (emitted before it had one):
    as given, else :func:`~pdcompile.runtime.schedules.spec.default_split_backward` for the
    processes of this machine."""
    if flag is not None:
        return flag
    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", 1)))
    return default_split_backward(device.type, local, os.cpu_count() or 1)


def compiled_schedule(program: Program) -> ScheduleSpec:
    """The schedule the compiler wrote into plan.json (an older plan.json names only the policy)."""
    raw = program.raw.get("schedule", "flush")
    if isinstance(raw, dict):
        return ScheduleSpec.from_json(raw)
    return ScheduleSpec({"1f1b-rr": "1f1b"}.get(str(raw), str(raw)),
                        tuple(len(st.ranks) for st in program.stages), int(program.raw.get("num_microbatches", 1)),
                        tied=bool(program.raw.get("tied")), vertical_sync=bool(program.raw.get("vertical_sync")),
                        split_backward=True)


def run_schedule(program: Program, args: argparse.Namespace, rank: int, *, say: bool = False) -> ScheduleSpec:
    """The schedule this run executes: the compiled one, unless flags change it (``say``: log that
    once). The compiled one is checked against the action lists plan.json spells out for it: this
    runtime must rebuild exactly what the compiler printed."""
    compiled = compiled_schedule(program)
    raw = program.raw.get("schedule")
    sb = args.split_backward
    if sb is None:
        sb = compiled.split_backward if isinstance(raw, dict) else split_backward(None, devices.rank_device())
    spec = ScheduleSpec(args.schedule, compiled.replicas, args.microbatches, compiled.tied, args.vertical_sync, sb,
                        compiled.virtual_stages, compiled.csv if args.schedule == compiled.name else None)
    if spec.stage_ranks != [list(st.ranks) for st in program.stages]:
        raise UsageError(f"--schedule {spec.name} places the stages on ranks {spec.stage_ranks}, but this program's "
                         f"stages are on {[list(st.ranks) for st in program.stages]}; re-emit the program for "
                         f"{spec.name}")
    if isinstance(raw, dict) and spec == compiled:
        if not agrees(spec, raw, rank):
            raise UsageError(f"plan.json: this runtime builds rank {rank}'s schedule ({spec}) differently from the "
                             f"compiler that wrote it; re-emit the program with this pdcompile")
    elif say and rank == 0 and isinstance(raw, dict):
        log.info("running %s, not the compiled %s (flags)", spec, compiled)
    return spec
