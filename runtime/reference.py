"""Reference semantics: what each schedule computes, in one process, written from the definitions.

Synchronous schedules (GPipe, PipeDream-Flush) are plain synchronous SGD with gradient
accumulation: for each minibatch, split it into ``M`` microbatches, accumulate the gradients of
``loss(microbatch) / M``, then take one optimizer step. The pipeline must reproduce this exactly
(up to floating-point reassociation).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch


def train_sync(model: torch.nn.Module, loss_fn: Callable[..., torch.Tensor],
               optimizer: torch.optim.Optimizer, batches: Iterable[tuple[tuple[torch.Tensor, ...], torch.Tensor]],
               *, steps: int, num_microbatches: int, lr_scheduler: Any = None) -> list[float]:
    """Train ``steps`` minibatches from ``batches``; return each microbatch's loss (unscaled)."""
    losses: list[float] = []
    it: Iterator[Any] = iter(batches)
    model.train()
    for _ in range(steps):
        inputs, target = next(it)
        micro_in = [x.chunk(num_microbatches) for x in inputs]
        micro_t = target.chunk(num_microbatches)
        optimizer.zero_grad(set_to_none=True)
        for j in range(num_microbatches):
            loss = loss_fn(model(*(x[j] for x in micro_in)), micro_t[j])
            losses.append(float(loss.detach()))
            (loss / num_microbatches).backward()
        optimizer.step()
        if lr_scheduler is not None:
            lr_scheduler.step()
    return losses
