"""What every model family supplies to the registry, and seeded batch helpers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Generic, Mapping, TypeVar

import torch
from torch import Tensor, nn

Cfg = TypeVar("Cfg")
Batch = tuple[tuple[Tensor, ...], Tensor]


@dataclass(frozen=True)
class Family(Generic[Cfg]):
    """One model family: its configs by size, how to build it, its batches and its loss."""

    configs: Mapping[str, Cfg]
    build: Callable[[Cfg], nn.Module]
    # (config, device, seed, batch_size) -> (inputs, target)
    make_batch: Callable[[Cfg, torch.device, int, int], Batch]
    loss: Callable[[], nn.Module]
    leaf_modules: tuple[type[nn.Module], ...] = ()


def generator(seed: int) -> torch.Generator:
    """A CPU generator seeded with ``seed``: batches are drawn on CPU so every device sees the same data."""
    gen = torch.Generator()
    gen.manual_seed(seed)
    return gen


def randn(gen: torch.Generator, shape: tuple[int, ...], device: torch.device) -> Tensor:
    """Standard-normal floats; on ``meta`` an empty tensor of the same shape (nothing allocated)."""
    if device.type == "meta":
        return torch.empty(shape, device=device)
    return torch.randn(shape, generator=gen).to(device)


def randint(gen: torch.Generator, high: int, shape: tuple[int, ...], device: torch.device) -> Tensor:
    """Integers in ``[0, high)`` (int64); on ``meta`` an empty tensor of the same shape."""
    if device.type == "meta":
        return torch.empty(shape, dtype=torch.long, device=device)
    return torch.randint(high, shape, generator=gen).to(device)
