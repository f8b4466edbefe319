"""Point-to-point transfers between stage ranks, and a mode in which gloo follows NCCL's rules.

Shapes and dtypes of every boundary tensor are known from plan.json, so receivers allocate buffers
up front and no handshake is needed. Transfers are asynchronous (``isend``/``irecv``); the
executor waits on a receive only when the computation needs it. No tags: messages between two
ranks are told apart by their order alone, which both sides issue identically
(runtime/schedules/transfers.py), as NCCL requires. :func:`configure` turns on the mode in which
gloo follows NCCL's rules, so the test suite catches on CPU what would hang on GPUs.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

NCCL_RULES_ENV = "PDCOMPILE_NCCL_RULES"


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


class _Queued:
    """A transfer queued behind the earlier ones to the same peer (NCCL-rules mode)."""

    def __init__(self, what: str, peer: int, timeout: float) -> None:
        self.what, self.peer, self.timeout = what, peer, timeout
        self.done = threading.Event()
        self.error: BaseException | None = None

    def wait(self) -> bool:
        if not self.done.wait(self.timeout):
            raise RuntimeError(
                f"{self.what} with rank {self.peer} timed out after {self.timeout:g} s under NCCL's rules "
                f"(PDCOMPILE_NCCL_RULES=1: transfers with one peer run one at a time, in issue order): the peer is "
                f"stuck, or the two ranks issue their transfers in different orders, which hangs on NCCL")
        if self.error is not None:
            raise RuntimeError(f"{self.what} with rank {self.peer} failed: {self.error}") from self.error
        return True


class _PeerLine:
    """One peer's transfers, run one after another by a thread of their own."""

    def __init__(self, peer: int) -> None:
        self.peer = peer
        self.ops: queue.SimpleQueue[tuple[Callable[[], Any], _Queued]] = queue.SimpleQueue()
        threading.Thread(target=self._work, name=f"pdcompile-p2p-{peer}", daemon=True).start()

    def _work(self) -> None:
        while True:
            start, op = self.ops.get()
            try:
                start().wait()
            except BaseException as e:  # noqa: BLE001 - handed to the waiter
                op.error = e
            op.done.set()


@dataclass
class _Mode:
    nccl_rules: bool = False
    timeout: float = 120.0
    lines: dict[int, _PeerLine] = field(default_factory=dict)
    route: Callable[[str, int], Sequence[int]] | None = None  # a pipeline rank's processes (tensor parallelism)


_mode = _Mode()


def configure(*, nccl_rules: bool, timeout: float, route: Callable[[str, int], Sequence[int]] | None = None) -> None:
    """Choose plain transfers, or gloo following NCCL's rules (``PDCOMPILE_NCCL_RULES=1`` for train.py).

    With ``nccl_rules``, gloo behaves as NCCL does with point-to-point transfers: per peer, one
    transfer at a time in issue order (the next starts once the previous completed), callers not
    blocked, and a wait that gives up with a named error after ``timeout``. The runtime issues no
    ``batch_isend_irecv`` groups, so the mode has none to start together. ``route``: the processes a transfer
    (``"send"`` or ``"recv"``) with a pipeline rank the actions name goes to (``runtime/tensor_parallel.py``
    ``RankLayout``: a receive comes from exactly one, a send goes to none, one or several); None: the rank itself."""
    global _mode
    _mode = _Mode(nccl_rules, timeout, route=route)


def nccl_rules() -> bool:
    return _mode.nccl_rules


def _issue(kind: str, tensor: torch.Tensor, peer: int) -> list[Any]:
    """One transfer with pipeline rank ``peer``: its works, one per process it is routed to."""
    peers = [peer] if _mode.route is None else list(_mode.route(kind, peer))
    if kind == "recv" and len(peers) != 1:
        raise RuntimeError(f"a receive from rank {peer} routed to processes {peers}: a receive has one sender")
    return [_issue_one(kind, tensor, p) for p in peers]


def _issue_one(kind: str, tensor: torch.Tensor, peer: int) -> Any:
    fn = dist.isend if kind == "send" else dist.irecv
    if not _mode.nccl_rules:
        return fn(tensor, peer)
    op = _Queued(f"{kind} of {tensor.numel()} x {tensor.dtype}", peer, _mode.timeout)
    line = _mode.lines.get(peer)
    if line is None:
        line = _mode.lines[peer] = _PeerLine(peer)
    line.ops.put((lambda: fn(tensor, peer), op))
    return op


def _groups(tensors: Sequence[torch.Tensor]) -> list[list[int]]:
    """Indices of ``tensors`` by dtype, in order of first appearance: one message per group."""
    by: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        by.setdefault(t.dtype, []).append(i)
    return list(by.values())


def post_recv(buffers: Sequence[torch.Tensor], src: int) -> Pending:
    """Post the receives of one message: the tensors of each dtype arrive packed in one flat buffer
    (as :func:`post_send` packs them) and are handed out as views of it, shaped like ``buffers``."""
    out: list[torch.Tensor] = list(buffers)
    works = []
    for group in _groups(buffers):
        if len(group) == 1:
            works += _issue("recv", out[group[0]], src)
            continue
        flat = torch.empty(sum(out[i].numel() for i in group), dtype=out[group[0]].dtype,
                           device=out[group[0]].device)
        offset = 0
        for i in group:
            n = out[i].numel()
            out[i] = flat[offset:offset + n].view(out[i].shape)
            offset += n
        works += _issue("recv", flat, src)
    return Pending(out, works)


_sent: dict[str, int] = {}


def sent_bytes() -> dict[str, int]:
    """Bytes this process has sent point-to-point so far, by dtype (metrics: what the wire carried)."""
    return dict(_sent)


def post_send(tensors: Sequence[torch.Tensor], dst: int) -> list[Any]:
    """Send one message: the tensors of each dtype packed into one flat buffer (one transfer, one
    latency, instead of one per tensor; a stage boundary inside a residual block carries two)."""
    works = []
    for t in tensors:
        key = str(t.dtype).replace("torch.", "")
        _sent[key] = _sent.get(key, 0) + t.numel() * t.element_size()
    for group in _groups(tensors):
        if len(group) == 1:
            works += _issue("send", tensors[group[0]].contiguous(), dst)
        else:
            works += _issue("send", torch.cat([tensors[i].reshape(-1) for i in group]), dst)
    return works
