"""The emitted program's entry point: ``torchrun --nproc-per-node=N train.py [flags]``.

Each rank reads plan.json, builds its stage module from ``stage_K.py`` and ``stage_K.pt``, joins
the process groups it belongs to (one default group, one per replicated stage, one per group of
tied parameters), and runs its schedule's actions step by step. Every process group and every
transfer is bounded by ``--timeout``: a dead or stuck peer makes the job fail instead of hang.

Data: the first stage reads minibatches from ``--data MODULE:FUNCTION`` (or plan.json's ``data``),
a callable ``f(batch_size: int, **kwargs) -> Iterable[(inputs_tuple, target)]``; without one it
uses seeded random data of the right shapes. Targets are sent to the last stage.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pdcompile.runtime import schedules
from pdcompile.runtime.executor import ActionError, StageExecutor
from pdcompile.runtime.program import Program, build, import_object

log = logging.getLogger("pdcompile.runtime")

SYNC_SCHEDULES = ("gpipe", "flush")


def parse_args(argv: list[str] | None, program: Program) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="train.py",
        description=f"Train {program.raw.get('model', 'the model')} as a {program.num_stages}-stage pipeline "
                    f"on {program.world_size} processes (launch with torchrun).",
        epilog=f"Example: torchrun --nproc-per-node={program.world_size} train.py --steps 10",
    )
    p.add_argument("--steps", type=int, default=10, help="optimizer steps (minibatches) to train")
    p.add_argument("--schedule", default=program.raw.get("schedule", "flush"),
                   help="gpipe, flush, 1f1b, 2bw (default: plan.json)")
    p.add_argument("--microbatches", type=int, default=program.raw.get("num_microbatches", 1),
                   help="microbatches per minibatch")
    p.add_argument("--data", default=None, help="MODULE:FUNCTION yielding (inputs, target) minibatches")
    p.add_argument("--seed", type=int, default=0, help="seed of the built-in random data")
    p.add_argument("--timeout", type=float, default=float(os.environ.get("PDCOMPILE_TIMEOUT", 120)),
                   help="seconds before a stuck peer fails the job")
    p.add_argument("--save-final", default=None, help="folder for each rank's final weights")
    p.add_argument("--metrics", default=None, help="folder for each rank's metrics JSON")
    p.add_argument("--trace", default=None, help="folder for each rank's action timeline (Chrome trace events)")
    p.add_argument("--log-level", default="INFO")
    return p.parse_args(argv)


def _data_source(program: Program, args: argparse.Namespace, batch_size: int) -> Iterator[Any]:
    spec = program.raw.get("data")
    if args.data:
        return iter(import_object(args.data)(batch_size))
    if spec:
        return iter(import_object(spec["factory"])(batch_size, **spec.get("kwargs", {})))
    return random_batches(program, batch_size, args.seed)


def random_batches(program: Program, batch_size: int, seed: int) -> Iterator[Any]:
    """Seeded random minibatches shaped like the plan's inputs and target."""
    g = torch.Generator().manual_seed(seed)
    b = program.raw["microbatch_size"]

    def draw(spec: Any) -> torch.Tensor:
        shape = (batch_size,) + tuple(spec.shape[1:]) if spec.shape and spec.shape[0] == b else spec.shape
        if spec.dtype.is_floating_point:
            return torch.randn(shape, generator=g, dtype=spec.dtype)
        hi = int(program.raw.get("data_high", 2))
        return torch.randint(0, hi, shape, generator=g, dtype=spec.dtype)

    while True:
        yield tuple(draw(s) for s in program.stages[0].inputs), draw(program.target)


def accumulation(schedule: str, num_microbatches: int) -> int:
    """Backward passes whose gradients one optimizer step sums (the loss is scaled by 1/this)."""
    return 1 if schedule.startswith("1f1b") else num_microbatches


def run_actions(schedule: str, replicas: list[int], num_microbatches: int, steps: int, tied: bool,
                rank: int) -> list[schedules.Action]:
    """This rank's actions for the whole run (global microbatch indices)."""
    if schedule in SYNC_SCHEDULES:
        acts: list[schedules.Action] = []
        if hasattr(schedules, "make_schedule"):
            one = schedules.make_schedule(schedule, replicas, num_microbatches, tied=tied)[rank]
        else:  # pragma: no cover - until the schedule library lands
            one = getattr(schedules, schedule)(len(replicas), num_microbatches, tied=tied)[rank]
        for step in range(steps):
            off = step * num_microbatches
            acts += [a if a.microbatch is None else schedules.Action(a.stage, a.kind, a.microbatch + off) for a in one]
        return acts
    total = num_microbatches * steps if schedule != "1f1b" else steps
    return schedules.make_schedule(schedule, replicas, total, tied=tied)[rank]


def main(folder: Path, argv: list[str] | None = None) -> None:
    program = Program.load(folder)
    args = parse_args(argv, program)
    logging.basicConfig(level=args.log_level, format="%(asctime)s rank%(rank)s %(levelname)s %(message)s")
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    logging.LoggerAdapter(log, {"rank": rank})
    old_factory = logging.getLogRecordFactory()

    def factory(*a: Any, **k: Any) -> logging.LogRecord:
        rec = old_factory(*a, **k)
        rec.rank = rank
        return rec

    logging.setLogRecordFactory(factory)
    if world != program.world_size:
        sys.exit(f"train.py: plan.json needs {program.world_size} processes, torchrun started {world}: "
                 f"use --nproc-per-node={program.world_size}")
    backend = "nccl" if torch.cuda.is_available() and os.environ.get("PDCOMPILE_BACKEND") != "gloo" else "gloo"
    timeout = datetime.timedelta(seconds=args.timeout)
    dist.init_process_group(backend, timeout=timeout)
    try:
        code = _train(program, args, rank, timeout)
    finally:
        dist.destroy_process_group()
    sys.exit(code)


def _train(program: Program, args: argparse.Namespace, rank: int, timeout: datetime.timedelta) -> int:
    spec = program.stage_of_rank(rank)
    torch.manual_seed(args.seed)
    module = program.build_stage(spec.index)
    module.train()
    # Groups: every rank creates every group, in the same order.
    replica_group = None
    for st in program.stages:
        if len(st.ranks) > 1:
            g = dist.new_group(list(st.ranks), timeout=timeout)
            if rank in st.ranks:
                replica_group = g
    tied_groups = []
    for group in program.raw.get("tied", []):
        stages = sorted({s for s, _ in group})
        if any(len(program.stages[s].ranks) > 1 for s in stages):
            raise SystemExit("train.py: parameters tied across replicated stages are not supported yet")
        ranks = [program.stages[s].ranks[0] for s in stages]
        g = dist.new_group(ranks, timeout=timeout)
        mine = [n for s, n in group if s == spec.index]
        if mine:
            tied_groups.append((g, mine))
    optimizer = build(program.raw["optimizer"], module.parameters())
    sched_spec = program.raw.get("lr_scheduler")
    lr_scheduler = build(sched_spec, optimizer) if sched_spec else None
    loss_fn = build(program.raw["loss"]) if spec.index == program.num_stages - 1 else None
    M = args.microbatches
    b = program.raw["microbatch_size"]
    data_iter = _data_source(program, args, b * M) if spec.index == 0 else None
    current: dict[str, Any] = {"index": -1, "micro": None}

    def data(k: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        idx = k // M
        while current["index"] < idx:
            inputs, target = next(data_iter)  # type: ignore[arg-type]
            current["index"] += 1
            current["micro"] = ([x.split(b) for x in inputs], target.split(b))
        ins, tgt = current["micro"]
        j = k % M
        return tuple(x[j] for x in ins), tgt[j]

    events: list[tuple[str, float, float]] = []
    executor = StageExecutor(
        program, rank, module, optimizer, loss_fn, accumulation=accumulation(args.schedule, M),
        data=data, replica_group=replica_group, tied_groups=tied_groups, lr_scheduler=lr_scheduler,
        weight_store=_weight_store(args.schedule, module, program),
        recorder=(lambda n, s, e: events.append((n, s, e))) if args.trace else None,
    )
    replicas = [len(st.ranks) for st in program.stages]
    actions = run_actions(args.schedule, replicas, M, args.steps, bool(program.raw.get("tied")), rank)
    step_times: list[float] = []
    per_step = _split_at_steps(actions)
    t_run = time.perf_counter()
    try:
        for i, chunk in enumerate(per_step):
            t0 = time.perf_counter()
            executor.run(chunk)
            step_times.append(time.perf_counter() - t0)
            if executor.losses and spec.index == program.num_stages - 1 and rank == spec.ranks[0]:
                log.info("step %d/%d loss %.6f (%.3f s)", i + 1, len(per_step), executor.losses[-1], step_times[-1])
        executor.wait_sends()
    except ActionError as e:
        log.error("%s", e)
        raise
    dist.barrier()
    wall = time.perf_counter() - t_run
    if args.save_final:
        out = Path(args.save_final)
        out.mkdir(parents=True, exist_ok=True)
        tensors = {n: t.detach().cpu() for n, t in module.named_parameters()}
        tensors.update({n: t.detach().cpu() for n, t in module.named_buffers()})
        torch.save(tensors, out / f"stage_{spec.index}.rank_{rank}.pt")
    if args.metrics:
        out = Path(args.metrics)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"rank_{rank}.json").write_text(json.dumps({
            "rank": rank, "stage": spec.index, "schedule": args.schedule, "steps": args.steps,
            "losses": executor.losses, "step_times_s": step_times, "wall_s": wall,
            "weight_versions": executor.weights.live_versions(),
        }, indent=1))
    if args.trace:
        out = Path(args.trace)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"rank_{rank}.events.json").write_text(json.dumps(
            [{"rank": rank, "name": n, "start_s": s - t_run, "end_s": e - t_run} for n, s, e in events]))
    return 0


def _split_at_steps(actions: list[schedules.Action]) -> list[list[schedules.Action]]:
    """Cut the run's actions after each optimizer step (for per-step timing and logging)."""
    chunks: list[list[schedules.Action]] = [[]]
    for a in actions:
        chunks[-1].append(a)
        if a.kind == schedules.Kind.STEP:
            chunks.append([])
    return [c for c in chunks if c]


def _weight_store(schedule: str, module: torch.nn.Module, program: Program) -> Any:
    try:
        from pdcompile.runtime import weights
    except ImportError:
        return None
    return weights.store_for(schedule, module, program)
