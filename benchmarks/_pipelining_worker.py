"""torchrun worker: train an emitted pdcompile program's stages with ``torch.distributed.pipelining``.

    torchrun --nproc-per-node=S -m benchmarks._pipelining_worker --program DIR --schedule gpipe|1f1b \
        --steps N --out FILE.json

Each rank builds exactly the stage module our runtime builds (``stage_K.py`` + ``stage_K.pt`` of the
emitted folder: the same split, the same weights), wraps it in ``PipelineStage`` and steps it with
torch's ``ScheduleGPipe`` or ``Schedule1F1B`` over the plan's number of microbatches. A step's time
includes drawing its random minibatch on the first and last rank, as ours reads it there. Tied parameters
(GPT's embedding and output projection) get their gradients summed across stages before the step,
as our runtime's ``TG`` action does, so both sides do the same work. Rank 0 writes per-rank step
times (optimizer step included) to ``--out``.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from benchmarks._common import finish_worker
from pdcompile.runtime.program import Program, build


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--program", required=True)
    p.add_argument("--schedule", choices=("gpipe", "1f1b"), default="gpipe")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--out", required=True)
    p.add_argument("--watchdog", type=float, default=240, help="dump stacks and exit after this many seconds")
    args = p.parse_args()
    faulthandler.dump_traceback_later(args.watchdog, exit=True)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    prog = Program.load(args.program)
    assert prog.num_stages == world, "one stage per process"
    module = prog.build_stage(rank)
    module.train()
    n_micro = int(prog.raw["num_microbatches"])
    b = int(prog.raw["microbatch_size"])
    # Static shapes from plan.json (shape inference at the first step is skipped).
    ins = tuple(torch.zeros(t.shape, dtype=t.dtype).requires_grad_(t.requires_grad and t.dtype.is_floating_point)
                for t in prog.stages[rank].inputs)
    outs = module(*ins)  # with autograd on: which outputs carry gradients back is read from these
    outs = outs if isinstance(outs, tuple) else (outs,)
    stage = PipelineStage(module, rank, world, torch.device("cpu"), input_args=ins,
                          output_args=tuple(o.detach().requires_grad_(o.requires_grad) for o in outs))
    loss_fn = build(prog.raw["loss"])  # every rank: a schedule without loss_fn runs no backward
    cls = ScheduleGPipe if args.schedule == "gpipe" else Schedule1F1B
    sched = cls(stage, n_micro, loss_fn=loss_fn)
    opt = build(prog.raw["optimizer"], module.parameters())
    tied = []
    for group in prog.raw.get("tied", []):
        ranks = sorted({prog.stages[s].ranks[0] for s, _ in group})
        g = dist.new_group(ranks)
        tied += [(g, dict(module.named_parameters())[n]) for s, n in group if s == rank]
    gen = torch.Generator().manual_seed(0)
    spec0 = prog.stages[0].inputs
    tgt = prog.target

    def draw(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        shape = (b * n_micro,) + tuple(shape[1:])
        if dtype.is_floating_point:
            return torch.randn(shape, generator=gen, dtype=dtype)
        return torch.randint(0, 2, shape, generator=gen, dtype=dtype)

    times: list[float] = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        # a step includes reading its minibatch, as in ours: the first stage reads the inputs and
        # (local targets) the last stage its own copy of the minibatch
        xs = tuple(draw(s.shape, s.dtype) for s in spec0) if rank in (0, world - 1) else ()
        y = draw(tgt.shape, tgt.dtype) if rank in (0, world - 1) else None
        opt.zero_grad(set_to_none=True)
        if rank == 0:
            sched.step(*xs)
        elif rank == world - 1:
            sched.step(target=y, losses=[])
        else:
            sched.step()
        for g, prm in tied:
            if prm.grad is not None:
                dist.all_reduce(prm.grad, group=g)
        opt.step()
        times.append(time.perf_counter() - t0)
        if os.environ.get("PD_BENCH_DEBUG"):
            print(f"rank {rank} step {len(times)} {times[-1]:.4f}", flush=True)
    finish_worker(times, args.out)


if __name__ == "__main__":
    main()
