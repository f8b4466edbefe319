"""Data hooks for emitted programs: minibatches saved to a file by ``CompiledPipeline.run``."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

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
