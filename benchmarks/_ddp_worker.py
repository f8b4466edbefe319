"""torchrun worker: train a benchmark model with DistributedDataParallel and record step times.

    torchrun --nproc-per-node=N -m benchmarks._ddp_worker --model vgg --size bench --batch 32 --steps 20 --out F.json

Every rank builds the same model (same seed) and takes its ``1/N`` share of each global minibatch
(``--batch`` samples, the pipeline's minibatch); gradients are averaged by DDP's bucketed
all-reduce, overlapped with backward. With ``PD_BENCH_LINK_BPS`` set, a comm hook adds the
emulated link's delay (:mod:`benchmarks._slow_link`). Rank 0 writes per-rank step times to ``--out``.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from benchmarks import _slow_link
from benchmarks._common import bench_model, finish_worker, sgd


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="vgg")
    p.add_argument("--size", default="bench")
    p.add_argument("--batch", type=int, default=32, help="global minibatch (all ranks together)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", required=True)
    p.add_argument("--watchdog", type=float, default=240)
    args = p.parse_args()
    faulthandler.dump_traceback_later(args.watchdog, exit=True)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    times = train(args)
    # The DDP wrapper (its reducer holds the process group) is gone before the group is destroyed:
    # tearing the group down under a live reducer aborted ~1 run in 8 ("terminate called ...").
    gc.collect()
    finish_worker(times, args.out)


def train(args: argparse.Namespace) -> list[float]:
    """Build the DDP model, run ``args.steps`` steps, return this rank's step times."""
    rank, world = dist.get_rank(), dist.get_world_size()
    b = bench_model(args.model, batch_size=args.batch, size=args.size)
    model = DistributedDataParallel(b.model)
    if _slow_link.bandwidth() > 0:
        model.register_comm_hook(None, _slow_link.ddp_hook)
    opt = sgd(model.parameters())
    share = args.batch // world
    xs = tuple(x[rank * share:(rank + 1) * share] for x in b.inputs)
    y = b.target[rank * share:(rank + 1) * share]
    times: list[float] = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        b.loss_fn(model(*xs), y).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    return times


if __name__ == "__main__":
    main()
