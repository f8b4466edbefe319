"""torchrun worker: train a model with DistributedDataParallel, the baseline a pipeline is measured against.

    torchrun --nproc-per-node=N -m pdcompile.ddp_worker --model MODULE:FUNCTION --model-kwargs '{...}' \\
        --batch 32 --steps 20 --out times.json [--data MODULE:FUNCTION --data-kwargs '{...}']

Every rank builds the model from the same factory and arguments, so all start from the same
weights, and trains its share of each minibatch; DDP averages gradients with its bucketed
all-reduce, overlapped with backward. Rank 0 writes the step times and losses (:func:`train`).
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import itertools
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from pdcompile import slowlink
from pdcompile.runtime.program import import_object


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m pdcompile.ddp_worker", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="MODULE:FUNCTION returning an object with .model and .loss_fn")
    p.add_argument("--model-kwargs", default="{}", help="JSON keyword arguments of --model")
    p.add_argument("--data", default=None, help="MODULE:FUNCTION(batch_size, **kwargs) yielding (inputs, target)")
    p.add_argument("--data-kwargs", default="{}", help="JSON keyword arguments of --data")
    p.add_argument("--batch", type=int, default=32, help="global minibatch (all ranks together)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--optimizer", default=None,
                   help="MODULE:FUNCTION(params) -> torch.optim.Optimizer (default: SGD with --lr)")
    p.add_argument("--lr", type=float, default=0.01, help="SGD learning rate when no --optimizer is given")
    p.add_argument("--out", required=True, help="JSON file rank 0 writes")
    p.add_argument("--watchdog", type=float, default=240, help="seconds before a stuck run dumps its stacks and exits")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    faulthandler.dump_traceback_later(args.watchdog, exit=True)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    times, losses = train(args)
    # The DDP wrapper (its reducer holds the process group) is gone before the group is destroyed:
    # tearing the group down under a live reducer aborted ~1 run in 8 ("terminate called ...").
    gc.collect()
    finish(times, losses, args.out)
    # Everything is written and every rank is past the barrier. Tearing down the group and the
    # interpreter after DDP still aborts now and then ("terminate called without an active
    # exception": a gloo or reducer thread outlives its owner), which would fail a finished run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _minibatches(args: argparse.Namespace, built: Any) -> Iterator[tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
    if args.data:
        source = import_object(args.data)(args.batch, **json.loads(args.data_kwargs))
        for inputs, target in source:
            yield (tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)), target
        return
    inputs = getattr(built, "example_inputs", None) or getattr(built, "inputs")
    yield from itertools.repeat((tuple(inputs), built.target))


def train(args: argparse.Namespace) -> tuple[list[float], list[float]]:
    """Build the DDP model, run ``args.steps`` steps; return this rank's step times and shard losses.

    ``--model`` names a factory whose result has ``.model`` (an ``nn.Module``) and ``.loss_fn``.
    ``--data`` is the emitted programs' data hook, ``f(batch_size, **kwargs) -> iterable of
    (inputs, target)`` of global minibatches (``--batch`` samples, the pipeline's minibatch);
    without it the factory's one batch (``.example_inputs`` or ``.inputs``, and ``.target``) is used
    every step. Each rank takes its ``1/N`` share of each minibatch; ``--optimizer`` (default SGD)
    steps. With ``PDCOMPILE_LINK_BPS`` set, a comm hook adds the emulated link's delay
    (:mod:`pdcompile.slowlink`). :func:`finish` then has rank 0 write ``{"step_times_s": [[rank
    0's], ...], "losses": [...]}`` (the minibatch loss per step: the mean of the ranks' shares)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.batch % world:
        raise SystemExit(f"ddp_worker: --batch {args.batch} does not split into {world} equal shares")
    built = import_object(args.model)(**json.loads(args.model_kwargs))
    model = DistributedDataParallel(built.model)
    if slowlink.bandwidth() > 0:
        model.register_comm_hook(None, slowlink.ddp_hook)
    params = model.parameters()
    opt = import_object(args.optimizer)(params) if args.optimizer else torch.optim.SGD(params, lr=args.lr)
    share = args.batch // world
    times: list[float] = []
    losses: list[float] = []
    for _, (xs, y) in zip(range(args.steps), _minibatches(args, built)):
        mine = tuple(x[rank * share:(rank + 1) * share] for x in xs)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = built.loss_fn(model(*mine), y[rank * share:(rank + 1) * share])
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
        if rank == 0:  # progress for whoever launched it (rank 0's share of the minibatch)
            print(f"ddp step {len(times)} loss {losses[-1]:.6f} ({times[-1]:.3f} s)", flush=True)
    del model, opt
    return times, losses


def finish(times: list[float], losses: list[float], out: str | os.PathLike[str]) -> None:
    """Gather every rank's step times and losses; rank 0 writes them to ``out``; all wait for it."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (list(times), list(losses)))
    if dist.get_rank() == 0:
        per_step = [sum(ls) / len(ls) for ls in zip(*(g[1] for g in gathered))]
        Path(out).write_text(json.dumps({"step_times_s": [g[0] for g in gathered], "losses": per_step}))
    dist.barrier()


if __name__ == "__main__":
    main()
