"""Point-to-point transfers between stage ranks and the process groups of a pipeline.

Shapes and dtypes of every boundary tensor are known from plan.json, so receivers allocate buffers
up front and no handshake is needed. Transfers are asynchronous (``isend``/``irecv``); the
executor waits on a receive only when the computation needs it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

ACT, GRAD, TARGET = 0, 1, 2


def tag(microbatch: int, channel: int) -> int:
    """Message tag: distinct per microbatch and channel (activations, gradients, targets)."""
    return (microbatch % (1 << 26)) * 4 + channel


@dataclass
class Pending:
    """Receives posted for one message; ``wait()`` returns the tensors."""

    tensors: list[torch.Tensor]
    works: list[Any] = field(default_factory=list)

    def wait(self) -> list[torch.Tensor]:
        for w in self.works:
            w.wait()
        self.works = []
        return self.tensors


def _groups(tensors: Sequence[torch.Tensor]) -> list[list[int]]:
    """Indices of ``tensors`` by dtype, in order of first appearance: one message per group."""
    by: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        by.setdefault(t.dtype, []).append(i)
    return list(by.values())


def post_recv(buffers: Sequence[torch.Tensor], src: int, microbatch: int, channel: int) -> Pending:
    """Post the receives of one message: the tensors of each dtype arrive packed in one flat buffer
    (as :func:`post_send` packs them) and are handed out as views of it, shaped like ``buffers``."""
    t = tag(microbatch, channel)
    out: list[torch.Tensor] = list(buffers)
    works = []
    for group in _groups(buffers):
        if len(group) == 1:
            works.append(dist.irecv(out[group[0]], src=src, tag=t))
            continue
        flat = torch.empty(sum(out[i].numel() for i in group), dtype=out[group[0]].dtype,
                           device=out[group[0]].device)
        offset = 0
        for i in group:
            n = out[i].numel()
            out[i] = flat[offset:offset + n].view(out[i].shape)
            offset += n
        works.append(dist.irecv(flat, src=src, tag=t))
    return Pending(out, works)


def post_send(tensors: Sequence[torch.Tensor], dst: int, microbatch: int, channel: int) -> list[Any]:
    """Send one message: the tensors of each dtype packed into one flat buffer (one transfer, one
    latency, instead of one per tensor; a stage boundary inside a residual block carries two)."""
    t = tag(microbatch, channel)
    works = []
    for group in _groups(tensors):
        if len(group) == 1:
            works.append(dist.isend(tensors[group[0]].contiguous(), dst=dst, tag=t))
        else:
            works.append(dist.isend(torch.cat([tensors[i].reshape(-1) for i in group]), dst=dst, tag=t))
    return works
