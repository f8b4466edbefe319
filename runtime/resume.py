"""Checkpoints and resume in a training run (formats and checks: runtime/checkpoint.py): the
segments a run is cut into (a checkpoint falls on a flush point), saving a rank's part after one,
and loading it back under ``--resume``."""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path
from typing import Any

import torch

from pdcompile.errors import CheckpointError
from pdcompile.runtime import checkpoint, devices, faults
from pdcompile.runtime.executor import StageExecutor
from pdcompile.runtime.program import Program

log = logging.getLogger("pdcompile.runtime")


def segments(start: int, steps: int, every: int) -> list[tuple[int, int]]:
    """[first, end) minibatch ranges run as one schedule each; a checkpoint may follow each one."""
    cuts = {start, steps} | ({s for s in range(every, steps, every) if s > start} if every > 0 else set())
    bounds = sorted(c for c in cuts if c >= start)
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


def stage_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    tensors = {n: t.detach() for n, t in module.named_parameters()}
    tensors.update({n: t.detach() for n, t in module.named_buffers()})
    return tensors


def resume(program: Program, args: argparse.Namespace, rank: int, executor: StageExecutor,
            lr_scheduler: Any) -> checkpoint.RankState | None:
    """--resume: verify and load this rank's part of a checkpoint into the module, optimizer, LR
    scheduler, weight store and RNG; every rank must resume the same step, or all refuse."""
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
            weights, state = checkpoint.load_rank(folder, program.raw, executor.stage, rank)
            checkpoint.restore_module(executor.module, weights, str(folder))
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
    executor.optimizer.load_state_dict(state.optimizer)
    if lr_scheduler is not None and state.lr_scheduler is not None:
        lr_scheduler.load_state_dict(state.lr_scheduler)
    checkpoint.set_rng_state(state.rng)
    log.info("resumed from %s: step %d, %d minibatches consumed", folder, state.step, state.data_consumed)
    return state


def maybe_checkpoint(program: Program, args: argparse.Namespace, rank: int, executor: StageExecutor,
                      lr_scheduler: Any, step: int, data_consumed: int) -> None:
    """Checkpoint after ``step`` minibatches if it is a multiple of --checkpoint-every (a flush point)."""
    if not args.checkpoint_every or step % args.checkpoint_every:
        return
    state = checkpoint.RankState(
        step=step, next_microbatch=step * args.microbatches, data_consumed=data_consumed,
        optimizer=executor.optimizer.state_dict(),
        lr_scheduler=lr_scheduler.state_dict() if lr_scheduler is not None else None,
        weight_store=None,  # at a flush point every weight version but the live one is gone (checkpoint.py)
        rng=checkpoint.rng_state())
    hook = None
    if args.fail_while_checkpointing and args.fail_at_step == step and rank == args.fail_rank:
        def hook() -> None:
            faults.inject_fault(args, rank, f"while writing the checkpoint of step {step}")
    t0 = time.perf_counter()
    folder = checkpoint.save(args.checkpoint_dir, program.raw, rank, stage_tensors(executor.module), state,
                             keep=args.keep_checkpoints, device=devices.rank_device(), before_manifest=hook)
    if rank == 0:
        log.info("checkpoint %s (%.3f s)", folder, time.perf_counter() - t0)
