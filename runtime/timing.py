"""Clocks that say what the device did, not what the CPU queued.

On a GPU, torch returns from a kernel launch before the kernel ran: a ``time.perf_counter()`` pair
around a step measures how fast the CPU queued it. Every time the runtime and the profilers report
goes through here: :func:`sync` / :func:`now` wait for the device at a measured boundary,
:class:`StepTimer` times consecutive steps with CUDA events (read at logging points, so there is
no host synchronisation per step), and :func:`recorder` ends each traced action after the device
finished it. On the CPU all of them are the plain clock (nothing to wait for).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch


def _cuda(device: torch.device | str) -> torch.device | None:
    d = torch.device(device)
    return d if d.type == "cuda" else None


def sync(device: torch.device | str) -> None:
    """Wait until ``device`` has finished the work queued so far (no-op on the CPU)."""
    d = _cuda(device)
    if d is not None:
        torch.cuda.synchronize(d)


def now(device: torch.device | str) -> float:
    """``time.perf_counter()`` once ``device`` has finished what was queued: a boundary's time."""
    sync(device)
    return time.perf_counter()


class StepTimer:
    """Seconds of consecutive intervals (``start()`` ... ``stop()``), as the device ran them.

    CPU: ``time.perf_counter``. CUDA: an event pair per interval on the current stream; the seconds
    exist once the events have run, so :meth:`collect` waits for the newest one (the caller collects
    at its logging points; a step in between costs no host synchronisation).
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = _cuda(device)
        self._open: Any = None
        self._done: list[tuple[Any, Any]] = []

    def start(self) -> None:
        if self.device is None:
            self._open = time.perf_counter()
        else:
            self._open = torch.cuda.Event(enable_timing=True)
            self._open.record()

    def stop(self) -> None:
        if self._open is None:
            raise RuntimeError("StepTimer.stop() without start()")
        if self.device is None:
            end: Any = time.perf_counter()
        else:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
        self._done.append((self._open, end))
        self._open = None

    @property
    def pending(self) -> int:
        """Intervals stopped but not collected yet."""
        return len(self._done)

    def collect(self) -> list[float]:
        """The seconds of every interval stopped since the last call, oldest first."""
        done, self._done = self._done, []
        if self.device is None:
            return [e - s for s, e in done]
        if done:
            done[-1][1].synchronize()  # events complete in order on one stream
        return [s.elapsed_time(e) / 1e3 for s, e in done]  # elapsed_time is in milliseconds


def recorder(sink: Callable[[tuple[str, float, float]], Any],
             device: torch.device | str) -> Callable[[str, float, float], None]:
    """The executor's trace recorder ``(name, start, end)`` appending to ``sink``. On CUDA each
    action's end is taken after a device synchronisation, so a slice lasts until its kernels
    finished (the next slice then starts on an idle device); this costs a synchronisation per
    action, which only ``--trace`` runs pay. On the CPU the times are kept as given."""
    d = _cuda(device)

    def record(name: str, start: float, end: float) -> None:
        sink((name, start, end if d is None else max(end, now(d))))

    return record


__all__ = ["StepTimer", "now", "recorder", "sync"]


def sched_totals() -> tuple[float, float, int]:
    """This process's scheduling so far, every thread summed (Linux ``/proc/self/task/*/schedstat``): seconds on a
    core, seconds runnable but waiting for one (another process or thread held it), and the times it was put on a
    core; zeros where the kernel does not say. What a step's time cannot tell apart: computing slower, or waiting."""
    run = wait = 0
    slices = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0.0, 0.0, 0
    for t in tasks:
        try:
            with open(f"/proc/self/task/{t}/schedstat") as f:
                a, b, c = (int(x) for x in f.read().split()[:3])
        except (OSError, ValueError):
            continue  # a thread that ended meanwhile
        run, wait, slices = run + a, wait + b, slices + c
    return run / 1e9, wait / 1e9, slices
