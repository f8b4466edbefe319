"""An emulated slow link between local processes: a message takes its bytes' time on the wire, as a NIC moves it.

    PDCOMPILE_LINK_BPS=20e6 torchrun --nproc-per-node=2 -m pdcompile.slowlink PROGRAM_DIR [train.py flags]

On one machine every process talks over loopback, where data parallelism's all-reduce is cheap;
PipeDream's case is a slow network between workers. This makes that case reproducible here without
touching the runtime: only processes that install it with ``PDCOMPILE_LINK_BPS`` (bytes per second)
set are slowed; nothing in ``runtime/`` knows about it. The link model is :func:`occupy`'s:
one serial link per direction between two ranks, and one for collectives. :func:`install` and
:func:`ddp_hook` apply it; run as a module, it installs and runs ``train.py``.

Both sides are treated alike, as a NIC treats them: a point-to-point message starts crossing when it
is sent (or its link frees) and has arrived ``bytes / B`` later, whatever either process computes
meanwhile. The sender's handle completes then; a copy of the bytes is handed to torch.distributed at
that moment by a thread of the sending process, so the receiver gets them no earlier, and a receiver
that posts later finds them there. Their real transfer over loopback follows, so a waiting receiver
has them ``bytes / B`` plus loopback's own time after the send (``simulate_plan`` charges both on such
a link). An all-reduce is charged its ring's bytes once it completed (in DDP's hook, in the future's
callback, so backward overlaps it). The simulator's default
``recv_progress="background"`` (a transfer on its directed link from the send, in the sender's order)
is this model.
"""

from __future__ import annotations

import os
import queue
import runpy
import sys
import threading
import time
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ENV = "PDCOMPILE_LINK_BPS"
COLLECTIVE = "collective"  # the link key of all-reduces (point-to-point links are keyed by the peer)

_lock = threading.Lock()
_link_free: dict[Hashable, float] = {}  # per link: perf_counter time when it is next free


def bandwidth() -> float:
    """The emulated link's bytes per second (from ``PDCOMPILE_LINK_BPS``); 0 means no emulation."""
    return float(os.environ.get(ENV, "0") or 0)


def occupy(nbytes: float, link: Hashable = COLLECTIVE, *, now: float | None = None) -> float:
    """Reserve ``link`` for ``nbytes`` from ``now`` (default: the present) or when it frees; return the finish time.

    Each link is serial: a message of ``n`` bytes occupies it for ``n / B`` seconds from the later of
    its start and the end of the message before it. A rank's sends to one peer share one link (the
    peer is the key); all-reduces share :data:`COLLECTIVE`, where one among ``p`` ranks costs the
    ring's ``2 (p-1)/p * n / B`` (:func:`ring_bytes`)."""
    bps = bandwidth()
    now = time.perf_counter() if now is None else now
    if bps <= 0:
        return now
    with _lock:
        _link_free[link] = end = max(_link_free.get(link, 0.0), now) + nbytes / bps
        return end


def sleep_until(t: float) -> None:
    """Sleep until ``perf_counter()`` reaches ``t`` (returns at once if it has)."""
    d = t - time.perf_counter()
    if d > 0:
        time.sleep(d)


def ring_bytes(nbytes: float, world: int) -> float:
    """Bytes one rank moves in a ring all-reduce of ``nbytes`` among ``world`` ranks."""
    return 2.0 * (world - 1) / world * nbytes if world > 1 else 0.0


class _SentWork:
    """A send's handle: complete once its bytes have crossed the emulated link and their copy was
    handed to torch.distributed (:class:`_Wire`), whatever the receiver is doing."""

    def __init__(self, arrives: float, tensor: torch.Tensor | None = None, rest: tuple[Any, ...] = (),
                 options: dict[str, Any] | None = None) -> None:
        self.arrives, self.tensor, self.rest, self.options = arrives, tensor, rest, options or {}
        self.posted = threading.Event()
        self.error: BaseException | None = None

    def wait(self, timeout: Any = None) -> bool:
        sleep_until(self.arrives)
        self.posted.wait()
        if self.error is not None:
            raise RuntimeError(f"emulated link: the send failed: {self.error}") from self.error
        return True

    def is_completed(self) -> bool:
        return self.posted.is_set()

    def is_success(self) -> bool:
        return self.posted.is_set() and self.error is None


class _Wire:
    """This rank's link to one peer: its messages in the order sent, each handed to torch.distributed
    (an ``isend`` of its copy) once its bytes have crossed. A second thread waits for those real sends
    in turn (gloo completes a send only once it is waited for), which frees their copies."""

    def __init__(self, peer: int, isend: Callable[..., Any]) -> None:
        self.peer, self.isend = peer, isend
        self.queue: queue.SimpleQueue[_SentWork] = queue.SimpleQueue()
        self.real: queue.SimpleQueue[Any] = queue.SimpleQueue()  # real sends, or an Event to set (flush)
        threading.Thread(target=self._run, name=f"pdcompile-slowlink-{peer}", daemon=True).start()
        threading.Thread(target=self._reap, name=f"pdcompile-slowlink-{peer}-done", daemon=True).start()

    def _run(self) -> None:
        while True:
            work = self.queue.get()
            sleep_until(work.arrives)
            if work.tensor is not None:
                try:
                    self.real.put(self.isend(work.tensor, self.peer, *work.rest, **work.options))
                except BaseException as e:  # noqa: BLE001 - handed to the sender's wait
                    work.error = e
                work.tensor = None
            work.posted.set()

    def _reap(self) -> None:
        while True:
            item = self.real.get()
            if isinstance(item, threading.Event):
                item.set()
                continue
            try:
                item.wait()
            except BaseException:  # noqa: BLE001 - a failed peer; the process group reports it
                pass

    def flush(self, timeout: float) -> None:
        """Wait (up to ``timeout``) until every message queued so far was handed over and delivered."""
        deadline = time.monotonic() + timeout
        marker = _SentWork(0.0)
        self.queue.put(marker)
        marker.posted.wait(timeout)
        delivered = threading.Event()
        self.real.put(delivered)
        delivered.wait(max(0.0, deadline - time.monotonic()))


_wires: dict[int, _Wire] = {}
_post_lock = threading.Lock()


def _post(tensor: torch.Tensor, dst: int, isend: Callable[..., Any], rest: tuple[Any, ...],
          options: dict[str, Any]) -> _SentWork:
    """Put a copy of ``tensor`` on the link to ``dst``; its handle completes when its bytes have crossed."""
    copy = tensor.detach().clone()  # a NIC reads the bytes as they go; the caller may reuse its buffer after wait()
    with _post_lock:  # reservations and the queue in one order
        wire = _wires.get(dst)
        if wire is None:
            wire = _wires[dst] = _Wire(dst, isend)
        work = _SentWork(occupy(tensor.numel() * tensor.element_size(), dst), copy, rest, options)
        wire.queue.put(work)
    return work


def flush(timeout: float = 60.0) -> None:
    """Wait until every message this process sent over the emulated link was delivered (before teardown)."""
    for wire in list(_wires.values()):
        wire.flush(timeout)


class _ReducedWork:
    """An asynchronous all-reduce's handle: its ring's bytes take the collective link from when it
    completed (recorded in its future's callback, so the caller's compute overlaps them)."""

    def __init__(self, work: Any, nbytes: float) -> None:
        self.work, self.finish = work, 0.0
        self.ready = threading.Event()

        def done(_: Any) -> None:
            self.finish = occupy(nbytes)
            self.ready.set()

        work.get_future().add_done_callback(done)

    def wait(self, *a: Any, **k: Any) -> Any:
        r = self.work.wait(*a, **k)
        self.ready.wait()
        sleep_until(self.finish)
        return r

    def is_completed(self) -> bool:
        return self.ready.is_set() and time.perf_counter() >= self.finish

    def __getattr__(self, name: str) -> Any:
        return getattr(self.work, name)


def _dst(a: tuple[Any, ...], k: dict[str, Any]) -> tuple[int, tuple[Any, ...]]:
    """The destination rank of a ``send``/``isend`` call, and the other positional arguments."""
    if a:
        return int(a[0]), a[1:]
    return int(k.pop("dst")), ()


def install() -> bool:
    """Put torch.distributed's sends and all-reduces on the emulated link (only if the variable is set).

    The runtime calls ``isend``/``send``/``all_reduce`` through the module, so the wrappers see every
    transfer; receives are torch's own (their bytes arrive when the link delivers them).
    ``destroy_process_group`` first waits for the messages still on the link."""
    if bandwidth() <= 0:
        return False
    isend, all_reduce, destroy = dist.isend, dist.all_reduce, dist.destroy_process_group

    def slow_isend(tensor: torch.Tensor, *a: Any, **k: Any) -> Any:
        dst, rest = _dst(a, k)
        return _post(tensor, dst, isend, rest, k)

    def slow_send(tensor: torch.Tensor, *a: Any, **k: Any) -> None:
        dst, rest = _dst(a, k)
        _post(tensor, dst, isend, rest, k).wait()

    def slow_all_reduce(tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: Any = None,
                        async_op: bool = False) -> Any:
        r = all_reduce(tensor, op, group=group, async_op=async_op)
        n = ring_bytes(tensor.numel() * tensor.element_size(), dist.get_world_size(group))
        if async_op:
            return _ReducedWork(r, n)
        sleep_until(occupy(n))
        return r

    def slow_destroy(*a: Any, **k: Any) -> Any:
        flush()
        return destroy(*a, **k)

    dist.isend, dist.send, dist.all_reduce = slow_isend, slow_send, slow_all_reduce  # type: ignore[assignment]  # patching torch.distributed on purpose
    dist.destroy_process_group = slow_destroy
    return True


def ddp_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: average the bucket with an all-reduce, then hold it for the emulated link time.

    DDP's reducer calls C++ directly, so :func:`install` can't see it; register this instead
    (``model.register_comm_hook(None, ddp_hook)``). The delay is added in the future's callback,
    so backward keeps overlapping with communication as in stock DDP."""
    world = dist.get_world_size()
    buf = bucket.buffer()
    buf.div_(world)
    fut = dist.all_reduce(buf, async_op=True).get_future()
    n = ring_bytes(buf.numel() * buf.element_size(), world)

    def delayed(f: torch.futures.Future[Any]) -> torch.Tensor:
        sleep_until(occupy(n))
        return f.value()[0]

    return fut.then(delayed)


# DDP checks a hook's annotations as objects, not the strings ``from __future__ import annotations`` leaves.
ddp_hook.__annotations__ = {"state": object, "bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}


def main(argv: list[str] | None = None) -> None:
    """torchrun entry: install the emulation, then run ``PROGRAM_DIR/train.py`` with the other flags."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-"):
        sys.exit(f"usage: {ENV}=BYTES_PER_S torchrun ... -m pdcompile.slowlink PROGRAM_DIR [train.py flags]")
    folder = Path(argv[0]).resolve()
    install()
    sys.argv = [str(folder / "train.py"), *argv[1:]]
    runpy.run_path(str(folder / "train.py"), run_name="__main__")


if __name__ == "__main__":
    main()
