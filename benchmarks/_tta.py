"""The time-to-accuracy workloads (Fashion-MNIST with a VGG-style CNN, a character GPT on Shakespeare)
and their DDP side, for ``benchmarks/bench_time_to_accuracy.py``.

A :class:`Workload` names everything a run needs by import path, so the emitted program's
``train.py`` (``--data`` through plan.json, ``--eval-data``) and the DDP worker here read the same
minibatches in the same order through the same loader code (``pdcompile/datasets.py``). The data
sets are found where ``pdcompile.datasets`` looks (``PDCOMPILE_FASHION_MNIST``,
``PDCOMPILE_SHAKESPEARE``), so the quick mode and the tests point them at generated files.

``python -m benchmarks._tta ddp --workload NAME --epochs N --metrics DIR`` under torchrun is the
DDP baseline: every rank builds the same model from the same seed, takes its share of every global
minibatch, and all-reduces gradients in DDP's buckets (through :func:`pdcompile.slowlink.ddp_hook`
when ``PDCOMPILE_LINK_BPS`` is set). After every ``eval_every`` steps the ranks evaluate the same
validation minibatches the pipelines do (rank ``r`` takes every ``world``-th one) and rank 0 appends an
``eval`` record to ``DIR/metrics.jsonl`` as train.py does, with ``train_s``: wall-clock seconds since
the start with the evaluations' own time taken out.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import functools
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pdcompile import datasets
from pdcompile.zoo import gpt, vgg
from pdcompile.zoo.losses import SequenceCrossEntropy

BLOCK = 64  # characters per Shakespeare sample (the GPT's context)


@dataclass(frozen=True)
class Workload:
    """One training task: model, loss, optimizer, data, validation and the target, by name."""

    name: str
    title: str  # for tables and the figure
    model: dict[str, Any]  # build_model's keyword arguments
    batch: int  # the global minibatch (divisible by 3: DDP's shares; by microbatches)
    microbatches: int  # flush and 2BW (1F1B runs one microbatch of the whole minibatch per update)
    optimizer: str  # MODULE:FUNCTION(params)
    data: dict[str, Any]  # plan.json's data hook: {"factory": MODULE:FUNCTION, "kwargs": {...}}
    eval_data: str  # MODULE:FUNCTION(batch_size)
    eval_every: int  # steps between evaluations
    eval_steps: int  # validation minibatches per evaluation
    metric: str  # "accuracy" (higher is better) or "loss" (nats per sample / character, lower is better)
    target: float
    epochs: int  # the most any run trains (runs stop at the target or their time budget)
    loss: str = "cross_entropy"
    kwargs: dict[str, Any] = field(default_factory=dict)
    lr: float | None = None  # the optimizer's learning rate instead of its own (--lr: each system at its better rate)
    schedule: dict[str, Any] = field(default_factory=dict)  # lr_schedule's keywords (--warmup, --boost): {} none

    @property
    def higher_is_better(self) -> bool:
        return self.metric != "loss"

    def reached(self, value: float) -> bool:
        return value >= self.target if self.higher_is_better else value <= self.target


def sgd_momentum(params: Any, lr: float | None = None) -> torch.optim.Optimizer:
    """Fashion-MNIST's optimizer: SGD lr 0.02, momentum 0.9."""
    return torch.optim.SGD(params, lr=lr or 0.02, momentum=0.9)


def adam(params: Any, lr: float | None = None) -> torch.optim.Optimizer:
    """The character GPT's optimizer: Adam lr 3e-3."""
    return torch.optim.Adam(params, lr=lr or 3e-3)


def optimizer_of(w: Workload) -> Any:
    """The workload's optimizer factory ``params -> Optimizer``, at ``w.lr`` where given."""
    make = import_object(w.optimizer)
    return functools.partial(make, lr=w.lr) if w.lr else make


def lr_factor(step: int, *, warmup: int = 0, boost_at: int = 0, boost: float = 1.0) -> float:
    """The rate's multiplier at scheduler ``step`` (0: the first update): a linear warm-up ``(step + 1) /
    warmup`` over the first ``warmup`` updates, then 1; times ``boost`` from update ``boost_at`` on."""
    ramp = min(1.0, (step + 1) / warmup) if warmup > 0 else 1.0
    return ramp * (boost if boost_at and step >= boost_at else 1.0)


def lr_schedule(optimizer: torch.optim.Optimizer, warmup: int = 0, boost_at: int = 0,
                boost: float = 1.0) -> torch.optim.lr_scheduler.LRScheduler:
    """The runs' optional rate schedule (``--warmup``, ``--boost``): :func:`lr_factor` as a ``LambdaLR``,
    stepped after every update (DDP: every minibatch; a pipeline's stage: each of its updates, the
    ``lr_scheduler=`` option). Module-level, so the emitted program's ranks import it by name."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, functools.partial(lr_factor, warmup=warmup, boost_at=boost_at, boost=boost))


def scheduler_of(w: Workload) -> Any:
    """The workload's ``lr_scheduler=`` (``optimizer -> scheduler``), or None without a schedule."""
    return functools.partial(lr_schedule, **w.schedule) if w.schedule else None


def schedule_args(schedule: dict[str, Any]) -> list[str]:
    """The DDP worker's flags for ``schedule`` (:func:`lr_schedule`'s keywords)."""
    return [a for k, v in sorted(schedule.items()) for a in (f"--{k.replace('_', '-')}", str(v))]


def fashion_eval(batch_size: int) -> Any:
    """Validation hook: Fashion-MNIST's test images in file order (``--eval-steps`` takes the first ones)."""
    return datasets.fashion_mnist_test(batch_size)


def shakespeare_eval(batch_size: int) -> Any:
    """Validation hook: the Shakespeare ``val`` split (the last 10% of the text) in order, BLOCK characters."""
    return datasets.shakespeare_val(batch_size, block=BLOCK)


def _workloads(quick: bool) -> dict[str, Workload]:
    M = vgg.M
    fashion = Workload(
        name="fashion", title="Fashion-MNIST, VGG-style CNN",
        # VGG's shape: small convolutions, then a classifier holding almost every parameter (1.07M of 1.08M)
        model={"kind": "vgg", "layers": (16, M, 32, M), "hidden": 512},
        batch=48, microbatches=4, optimizer="benchmarks._tta:sgd_momentum",
        data={"factory": "pdcompile.datasets:fashion_mnist", "kwargs": {}},
        eval_data="benchmarks._tta:fashion_eval", eval_every=100, eval_steps=42,  # 2016 test images
        metric="accuracy", target=0.88, epochs=3)
    shakes = Workload(
        name="shakespeare", title="Shakespeare, character GPT",
        model={"kind": "gpt", "d_model": 128, "n_layers": 4, "n_heads": 4},
        batch=6, microbatches=3, optimizer="benchmarks._tta:adam",
        data={"factory": "pdcompile.datasets:shakespeare", "kwargs": {"block": BLOCK}},
        eval_data="benchmarks._tta:shakespeare_eval", eval_every=100, eval_steps=32,  # 12,288 characters
        metric="loss", target=2.6, epochs=1, loss="sequence_cross_entropy")
    if quick:  # tiny models on generated data, every piece run once: targets met at the first evaluation
        fashion = dataclasses.replace(fashion, model={"kind": "vgg", "layers": (4, M, 8, M), "hidden": 32},
                                      batch=12, eval_every=5, eval_steps=3, target=0.0, epochs=1)
        shakes = dataclasses.replace(shakes, model={"kind": "gpt", "d_model": 16, "n_layers": 3, "n_heads": 2},
                                     batch=12, eval_every=5, eval_steps=2, target=1e3, epochs=1)
    return {fashion.name: fashion, shakes.name: shakes}


def workload(name: str, quick: bool = False) -> Workload:
    return _workloads(quick)[name]


def build_model(spec: dict[str, Any], seed: int = 0) -> nn.Module:
    """The workload's model, initialised from ``seed`` (every system starts from the same weights)."""
    torch.manual_seed(seed)
    if spec["kind"] == "vgg":
        return vgg.VGG(vgg.VGGConfig(layers=tuple(spec["layers"]), image_size=28, hidden=spec["hidden"],
                                     num_classes=10, in_channels=1))
    vocab = datasets.shakespeare_vocab_size()
    return gpt.GPT(gpt.GPTConfig(vocab_size=vocab, seq_len=BLOCK, d_model=spec["d_model"], n_heads=spec["n_heads"],
                                 n_layers=spec["n_layers"]))


def loss_fn(w: Workload) -> nn.Module:
    return SequenceCrossEntropy() if w.loss == "sequence_cross_entropy" else nn.CrossEntropyLoss()


def import_object(path: str) -> Any:
    from pdcompile.runtime.program import import_object as imp

    return imp(path)


def first_batch(w: Workload) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """One training minibatch (the example the pipelines are compiled from)."""
    data = import_object(w.data["factory"])(w.batch, **w.data["kwargs"])
    inputs, target = next(iter(data))
    return tuple(inputs), target


def steps_per_epoch(w: Workload) -> int:
    return len(import_object(w.data["factory"])(w.batch, **w.data["kwargs"]))


def param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


# --- the DDP side ----------------------------------------------------------------------------------

def _evaluate(model: nn.Module, w: Workload, lf: nn.Module, rank: int, world: int) -> dict[str, float]:
    """Loss (and accuracy) over the workload's first ``eval_steps`` validation minibatches, shared out."""
    import torch.distributed as dist
    from pdcompile.runtime.evaluate import accuracy

    sums = torch.zeros(3, dtype=torch.float64)
    model.eval()
    with torch.no_grad():
        for i, (inputs, target) in zip(range(w.eval_steps), import_object(w.eval_data)(w.batch)):
            if i % world != rank:
                continue
            out = model(*inputs)
            sums += torch.tensor([float(lf(out, target)), float(accuracy(out, target)), 1.0], dtype=torch.float64)
    model.train()
    dist.all_reduce(sums)
    n = max(1.0, float(sums[2]))
    got = {"loss": float(sums[0]) / n}
    if w.metric == "accuracy":
        got["accuracy"] = float(sums[1]) / n
    return got


def ddp_main(argv: list[str] | None = None) -> None:
    """DDP training of ``--workload`` for ``--epochs``, evaluated every ``eval_every`` steps."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from pdcompile import slowlink

    p = argparse.ArgumentParser(prog="python -m benchmarks._tta ddp")
    p.add_argument("--workload", required=True)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--epochs", type=int, default=None)
    p.add_argument("--metrics", required=True)
    p.add_argument("--watchdog", type=float, default=1800)
    p.add_argument("--lr", type=float, default=None, help="the optimizer's learning rate instead of the workload's")
    p.add_argument("--eval-every", type=int, default=None, help="minibatches between evaluations instead of the workload's")
    p.add_argument("--warmup", type=int, default=0, help="lr_schedule's linear warm-up, in updates")
    p.add_argument("--boost-at", type=int, default=0, help="lr_schedule: the update from which the rate is x --boost")
    p.add_argument("--boost", type=float, default=1.0)
    args = p.parse_args(argv)
    faulthandler.dump_traceback_later(args.watchdog, exit=True)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    w = dataclasses.replace(workload(args.workload, args.quick), lr=args.lr)
    w = dataclasses.replace(w, eval_every=args.eval_every) if args.eval_every else w
    sched = {k: v for k, v in (("warmup", args.warmup), ("boost_at", args.boost_at), ("boost", args.boost))
             if v != (1.0 if k == "boost" else 0)}
    w = dataclasses.replace(w, schedule=sched)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if w.batch % world:
        raise SystemExit(f"minibatch {w.batch} does not split into {world} equal shares")
    model = DistributedDataParallel(build_model(w.model))
    if slowlink.bandwidth() > 0:
        model.register_comm_hook(None, slowlink.ddp_hook)
    opt = optimizer_of(w)(model.parameters())
    make_sched = scheduler_of(w)
    scheduler = make_sched(opt) if make_sched is not None else None
    lf = loss_fn(w)
    share = w.batch // world
    data = import_object(w.data["factory"])(w.batch, **w.data["kwargs"])
    per_epoch = len(data)
    out = Path(args.metrics)
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / "metrics.jsonl", "a") if rank == 0 else None
    step, evals_s = 0, 0.0
    dist.barrier()
    t0 = time.monotonic()
    for _ in range(args.epochs or w.epochs):
        for inputs, target in data:  # a fresh pass: the seeded DataLoader reshuffles as the pipelines' does
            mine = tuple(x[rank * share:(rank + 1) * share] for x in inputs)
            opt.zero_grad(set_to_none=True)
            lf(model(*mine), target[rank * share:(rank + 1) * share]).backward()
            opt.step()
            if scheduler is not None:
                scheduler.step()
            step += 1
            if step % w.eval_every == 0:
                t_eval = time.monotonic()
                got = _evaluate(model.module, w, lf, rank, world)
                now = time.monotonic()
                evals_s += now - t_eval
                if log is not None:
                    rec = {"type": "eval", "step": step, "epoch": step / per_epoch, "time_s": now - t0,
                           "train_s": now - t0 - evals_s, **got}
                    log.write(json.dumps(rec) + "\n")
                    log.flush()
    dist.barrier()
    if log is not None:
        log.close()
    sys.stdout.flush()
    os._exit(0)  # tearing down gloo under DDP's reducer aborts now and then (pdcompile/ddp_worker.py)


if __name__ == "__main__":
    if sys.argv[1:2] == ["ddp"]:
        ddp_main(sys.argv[2:])
    else:
        sys.exit("usage: torchrun ... -m benchmarks._tta ddp --workload NAME --metrics DIR [--epochs N]")
