"""Data for emitted programs: the first stage's source (``--data``, plan.json's factory, or seeded random
minibatches), whether the last stage reads targets itself, and minibatches saved to a file by
``CompiledPipeline.run``."""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from pdcompile.runtime.program import Program, import_object

Batch = tuple[tuple[torch.Tensor, ...], torch.Tensor]


def save_batches(batches: Iterable[Any], steps: int, path: str | Path) -> int:
    """Save the first ``steps`` minibatches of ``batches`` ((inputs, target) pairs; inputs a tensor or a
    tuple of tensors) as one tensor file; returns the minibatch size."""
    tensors: dict[str, torch.Tensor] = {}
    it = iter(batches)
    size = None
    for i in range(steps):
        try:
            inputs, target = next(it)
        except StopIteration:
            raise ValueError(f"the data ran out after {i} minibatches; {steps} steps need {steps}") from None
        inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
        for j, x in enumerate(inputs):
            tensors[f"{i}.input.{j}"] = x.detach().cpu().contiguous()
        tensors[f"{i}.target"] = target.detach().cpu().contiguous()
        if size is None:
            size = int(target.shape[0])
        elif int(target.shape[0]) != size:
            raise ValueError(f"minibatch {i} has {target.shape[0]} samples, the first had {size}: "
                             f"every minibatch must have the same size (drop_last=True)")
    torch.save(tensors, path)
    return int(size or 0)


def from_file(batch_size: int, path: str) -> Iterator[Batch]:
    """Yield the minibatches saved by :func:`save_batches` (``batch_size`` is checked)."""
    tensors = torch.load(path, weights_only=True)
    i = 0
    while f"{i}.target" in tensors:
        n = sum(1 for k in tensors if k.startswith(f"{i}.input."))
        target = tensors[f"{i}.target"]
        if target.shape[0] != batch_size:
            raise ValueError(f"{path}: minibatch {i} has {target.shape[0]} samples, the plan needs {batch_size}")
        yield tuple(tensors[f"{i}.input.{j}"] for j in range(n)), target
        i += 1


def data_source(program: Program, args: argparse.Namespace, batch_size: int) -> Iterator[Any]:
    spec = program.raw.get("data")
    if args.data:
        return iter(import_object(args.data)(batch_size))
    if spec:
        return iter(import_object(spec["factory"])(batch_size, **spec.get("kwargs", {})))
    return random_batches(program, batch_size, args.seed)


DETERMINISTIC_SOURCES = ("pdcompile.runtime.data:from_file", "pdcompile.zoo:batches")  # seeded, same on every rank


def local_targets(program: Program, args: argparse.Namespace) -> bool:
    """Whether the last stage reads targets from the data itself instead of receiving them (see
    ``--targets``): a message per microbatch saved, ~7% of a small GPT's step on this machine."""
    if args.targets != "auto":
        return args.targets == "local"
    spec = program.raw.get("data")
    return not args.data and (not spec or spec.get("factory") in DETERMINISTIC_SOURCES)


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
