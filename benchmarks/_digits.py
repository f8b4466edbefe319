"""scikit-learn's 8x8 digits for the time-to-accuracy benchmark: data hook, model, accuracy, DDP worker.

The split is fixed (seeded, 80/20, features standardised with the training set's mean and std).
:func:`train_batches` is the data factory every system reads (``f(batch_size, **kw) -> iterator of
(inputs, target)``): epoch ``e`` is a permutation seeded with ``seed + e``, cut into
``len(train) // batch_size`` full minibatches (the rest dropped), so every system sees the same
minibatches in the same order. ``python -m benchmarks._digits ddp ...`` under torchrun is the DDP
side (each rank takes its share of every minibatch; test accuracy after every epoch).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from pdcompile.zoo import mlp

Batch = tuple[tuple[torch.Tensor, ...], torch.Tensor]


@functools.lru_cache(maxsize=1)
def split(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_train, y_train, x_test, y_test): 1437 / 360 samples of 64 standardised features."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32)
    y = torch.tensor(d.target, dtype=torch.int64)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_train = int(0.8 * len(y))
    tr, te = perm[:n_train], perm[n_train:]
    mean, std = x[tr].mean(0), x[tr].std(0).clamp_min(1e-3)
    return (x[tr] - mean) / std, y[tr], (x[te] - mean) / std, y[te]


def steps_per_epoch(batch_size: int) -> int:
    return len(split()[1]) // batch_size


def train_batches(batch_size: int, seed: int = 0) -> Iterator[Batch]:
    """Endless training minibatches, epoch after epoch (the data hook: plan.json ``data``)."""
    x, y, _, _ = split()
    epoch = 0
    while True:
        perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed + epoch))
        for i in range(len(y) // batch_size):
            idx = perm[i * batch_size:(i + 1) * batch_size]
            yield (x[idx],), y[idx]
        epoch += 1


def build_model(hidden: tuple[int, ...] = (128, 128, 128), seed: int = 0) -> nn.Module:
    """The zoo's MLP, 64 -> hidden -> 10, initialised from ``seed``."""
    torch.manual_seed(seed)
    return mlp.MLP(mlp.MLPConfig(in_features=64, hidden=hidden, num_classes=10))


@torch.no_grad()
def accuracy(model: nn.Module) -> float:
    """Test-set accuracy of ``model``."""
    _, _, x, y = split()
    model.eval()
    acc = float((model(x).argmax(1) == y).float().mean())
    model.train()
    return acc


def ddp_main(argv: list[str] | None = None) -> None:
    """DDP training for ``--epochs`` epochs; rank 0 writes per-epoch accuracy and cumulative step time."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = DistributedDataParallel(build_model())
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    loss_fn = nn.CrossEntropyLoss()
    share = args.batch // world
    data = train_batches(args.batch)
    spe = steps_per_epoch(args.batch)
    trained, curve = 0.0, []
    for _ in range(args.epochs):
        for _ in range(spe):
            (x,), y = next(data)
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss_fn(model(x[rank * share:(rank + 1) * share]), y[rank * share:(rank + 1) * share]).backward()
            opt.step()
            trained += time.perf_counter() - t0
        t = torch.tensor([trained])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        curve.append({"accuracy": accuracy(model.module), "train_s": float(t)})
    if rank == 0:
        Path(args.out).write_text(json.dumps(curve))
    del model, opt  # the DDP reducer holds the group: free it before the group (see pdcompile/ddp_worker.py)
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["ddp"]:
        ddp_main(sys.argv[2:])
    else:
        sys.exit("usage: torchrun ... -m benchmarks._digits ddp --epochs N --out FILE")
