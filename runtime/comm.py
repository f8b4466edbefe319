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


def post_recv(buffers: Sequence[torch.Tensor], src: int, microbatch: int, channel: int) -> Pending:
    t = tag(microbatch, channel)
    return Pending(list(buffers), [dist.irecv(b, src=src, tag=t) for b in buffers])


def post_send(tensors: Sequence[torch.Tensor], dst: int, microbatch: int, channel: int) -> list[Any]:
    t = tag(microbatch, channel)
    return [dist.isend(x.contiguous(), dst=dst, tag=t) for x in tensors]
