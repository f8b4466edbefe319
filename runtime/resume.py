"""Checkpoints and resume in a training run (formats and checks: runtime/checkpoint.py): the
segments a run is cut into (a checkpoint falls on a flush point), saving a rank's part after one,
and loading it back under ``--resume``, under this plan or any other plan of the same model."""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Sequence
from pathlib import Path

from pdcompile.errors import CheckpointError
from pdcompile.runtime import checkpoint, devices, faults, tensor_parallel
from pdcompile.runtime.executor import StageExecutor
from pdcompile.runtime.program import Program

log = logging.getLogger("pdcompile.runtime")


def segments(start: int, steps: int, every: int) -> list[tuple[int, int]]:
    """[first, end) minibatch ranges run as one schedule each; a checkpoint may follow each one."""
    cuts = {start, steps} | ({s for s in range(every, steps, every) if s > start} if every > 0 else set())
    bounds = sorted(c for c in cuts if c >= start)
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


def parts(program: Program, executors: Sequence[StageExecutor]) -> list[checkpoint.StagePart]:
    """The rank's stages as a checkpoint sees them: module, optimizer, LR scheduler, original names, and
    with tensor parallelism each split parameter's layout (saved and read under the model's names)."""
    split = tensor_parallel.degree(program.raw) > 1
    return [checkpoint.StagePart(ex.module, ex.optimizer, program.stages[ex.stage].param_names, ex.lr_scheduler,
                                 ex.stage, tensor_parallel.layouts(ex.module, tensor_parallel.stage_entry(
                                     program.raw, ex.stage)) if split else {}) for ex in executors]


def process_rank(rank: int) -> int:
    """The process a checkpoint's files are named by: ``rank`` (a pipeline rank), or this process's number
    where tensor parallelism makes each pipeline rank several processes."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else rank


def resume(program: Program, args: argparse.Namespace, rank: int,
           executors: Sequence[StageExecutor]) -> checkpoint.RankState | None:
    """--resume: verify and load this rank's part of a checkpoint (its stages' tensors, found by the
    model's names, so any plan of the model may have written it) into the modules, optimizers, LR
    schedulers and RNG; every rank must resume the same step, or all refuse."""
    if args.checkpoint_every and not args.checkpoint_dir:
        raise CheckpointError("--checkpoint-every needs --checkpoint-dir DIR (a folder every rank can see)")
    if args.resume is None:
        if args.checkpoint_dir and checkpoint.latest(args.checkpoint_dir) is not None:
            raise CheckpointError(f"{args.checkpoint_dir} already holds checkpoints of a run. Fix: pass --resume "
                                  f"to continue it, or use an empty --checkpoint-dir")
        return None
    if args.resume == "auto":
        if not args.checkpoint_dir:
            raise CheckpointError("--resume needs --checkpoint-dir DIR (or --resume STEP_DIR)")
        folder = checkpoint.latest(args.checkpoint_dir)
    else:
        folder = Path(args.resume)
    step = -1
    error: CheckpointError | None = None
    try:
        step = int(checkpoint.read_manifest(folder)["step"]) if folder is not None else -1
    except CheckpointError as e:
        error = e
    lo, hi = checkpoint.agree(step, devices.rank_device())
    if error is None and lo != hi:
        error = CheckpointError(f"ranks see different newest checkpoints (steps {lo} to {hi}) in "
                                f"{args.checkpoint_dir}. Fix: put --checkpoint-dir on a filesystem every rank shares")
    state = None
    if error is None and folder is not None:
        try:
            state = checkpoint.load_rank(folder, program.raw, process_rank(rank), parts(program, executors))
        except CheckpointError as e:
            error = e
    _, failed = checkpoint.agree(int(error is not None), devices.rank_device())
    if error is not None:
        raise error
    if failed:
        raise CheckpointError(f"{folder}: another rank refused this checkpoint (its log says why)")
    if state is None:
        log.info("no checkpoint in %s yet: starting afresh", args.checkpoint_dir)
        return None
    if state.rng:
        checkpoint.set_rng_state(state.rng)
    else:  # the writing job had fewer ranks: this rank's random numbers start from --seed
        log.info("the checkpoint has no RNG state of rank %d (written by fewer ranks): seeded afresh", process_rank(rank))
    log.info("resumed from %s: step %d, %d minibatches consumed", folder, state.step, state.data_consumed)
    return state


def maybe_checkpoint(program: Program, args: argparse.Namespace, rank: int, executors: Sequence[StageExecutor],
                     step: int, data_consumed: int) -> None:
    """Checkpoint after ``step`` minibatches if it is a multiple of --checkpoint-every (a flush point)."""
    if not args.checkpoint_every or step % args.checkpoint_every:
        return
    mine = parts(program, executors)
    state = checkpoint.rank_state(mine, step, data_consumed)
    hook = None
    if args.fail_while_checkpointing and args.fail_at_step == step and rank == args.fail_rank:
        def hook() -> None:
            faults.inject_fault(args, rank, f"while writing the checkpoint of step {step}")
    t0 = time.perf_counter()
    folder = checkpoint.save(args.checkpoint_dir, program.raw, process_rank(rank), mine, state,
                             keep=args.keep_checkpoints, before_manifest=hook)
    if rank == 0:
        log.info("checkpoint %s (%.3f s)", folder, time.perf_counter() - t0)
