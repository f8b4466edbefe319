"""An emulated slow link between local processes: delays proportional to the bytes each rank receives.

    PDCOMPILE_LINK_BPS=20e6 torchrun --nproc-per-node=2 -m pdcompile.slowlink PROGRAM_DIR [train.py flags]

On one machine every process talks over loopback, where data parallelism's all-reduce is cheap;
PipeDream's case is a slow network between workers. This makes that case reproducible here without
touching the runtime: only processes that install it with ``PDCOMPILE_LINK_BPS`` (bytes per second)
set are slowed; nothing in ``runtime/`` knows about it. The link model is :func:`occupy`'s;
:func:`install` and :func:`ddp_hook` apply it; run as a module, it installs and runs ``train.py``.
"""

from __future__ import annotations

import os
import runpy
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ENV = "PDCOMPILE_LINK_BPS"

_lock = threading.Lock()
_link_free = 0.0  # perf_counter time when this rank's emulated link is next free


def bandwidth() -> float:
    """The emulated link's bytes per second (from ``PDCOMPILE_LINK_BPS``); 0 means no emulation."""
    return float(os.environ.get(ENV, "0") or 0)


def occupy(nbytes: float) -> float:
    """Reserve the link for ``nbytes`` from now (or when it frees); return the finish time.

    One serial link per receiving rank: a message of ``n`` bytes occupies it for ``n / B`` seconds,
    from when it arrived over loopback and the receiver waits for it, or when the link became free,
    whichever is later; the receiver's ``wait()`` returns only then. Sends stay asynchronous (the
    sender is not slowed). An all-reduce among ``p`` ranks costs the ring's ``2 (p-1)/p * n / B``
    (:func:`ring_bytes`) on the same link."""
    global _link_free
    bps = bandwidth()
    now = time.perf_counter()
    if bps <= 0:
        return now
    with _lock:
        _link_free = max(_link_free, now) + nbytes / bps
        return _link_free


def sleep_until(t: float) -> None:
    """Sleep until ``perf_counter()`` reaches ``t`` (returns at once if it has)."""
    d = t - time.perf_counter()
    if d > 0:
        time.sleep(d)


def ring_bytes(nbytes: float, world: int) -> float:
    """Bytes one rank moves in a ring all-reduce of ``nbytes`` among ``world`` ranks."""
    return 2.0 * (world - 1) / world * nbytes if world > 1 else 0.0


class _SlowWork:
    """A receive's work handle whose ``wait()`` also waits for the emulated link."""

    def __init__(self, work: Any, nbytes: int) -> None:
        self.work, self.nbytes, self.done = work, nbytes, False

    def wait(self, *a: Any, **k: Any) -> Any:
        r = self.work.wait(*a, **k)
        if not self.done:
            self.done = True
            sleep_until(occupy(self.nbytes))
        return r

    def is_completed(self) -> bool:
        return self.done

    def __getattr__(self, name: str) -> Any:
        return getattr(self.work, name)


def install() -> bool:
    """Wrap torch.distributed's receives and all-reduce with the link delay (only if the variable is set).

    The runtime calls ``irecv``/``recv``/``all_reduce`` through the module, so the wrappers see
    every transfer."""
    if bandwidth() <= 0:
        return False
    irecv, recv, all_reduce = dist.irecv, dist.recv, dist.all_reduce

    def slow_irecv(tensor: torch.Tensor, *a: Any, **k: Any) -> Any:
        return _SlowWork(irecv(tensor, *a, **k), tensor.numel() * tensor.element_size())

    def slow_recv(tensor: torch.Tensor, *a: Any, **k: Any) -> Any:
        r = recv(tensor, *a, **k)
        sleep_until(occupy(tensor.numel() * tensor.element_size()))
        return r

    def slow_all_reduce(tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: Any = None,
                        async_op: bool = False) -> Any:
        r = all_reduce(tensor, op, group=group, async_op=async_op)
        n = ring_bytes(tensor.numel() * tensor.element_size(), dist.get_world_size(group))
        if async_op:
            return _SlowWork(r, int(n))
        sleep_until(occupy(n))
        return r

    dist.irecv, dist.recv, dist.all_reduce = slow_irecv, slow_recv, slow_all_reduce  # type: ignore[assignment]  # patching torch.distributed on purpose
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
