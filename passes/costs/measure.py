"""Timing: seconds per call of many small closures on a busy machine (calibrated samples, visits,
medians), and the fixed cost of one ``torch.autograd.grad`` call."""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Iterator
from typing import Any, Callable

import torch

from pdcompile.runtime.timing import sync

def _sync(device: torch.device) -> None:
    sync(device)  # the runtime's (pdcompile.runtime.timing): one definition of a measured boundary


_THREAD_CLOCK = False  # set by thread_clock(): CPU samples in this thread's CPU time instead of wall time


@contextlib.contextmanager
def thread_clock() -> Iterator[None]:
    """Within: CPU samples (:func:`_sample`) are taken in this thread's CPU time (``time.thread_time``),
    not wall time. The calibration (``pdcompile.calibrate``) times its op-class probes so, as it times the
    whole models its per-node overhead is fitted from: time another process takes from this one (a
    loaded machine) then reaches neither, instead of only the probes, which would leave the per-node fit
    what the load added to the ops subtracted (one thread computes: ``torch.set_num_threads(1)``)."""
    global _THREAD_CLOCK
    before, _THREAD_CLOCK = _THREAD_CLOCK, True
    try:
        yield
    finally:
        _THREAD_CLOCK = before


def _cpu_clock() -> float:
    return time.thread_time() if _THREAD_CLOCK else time.perf_counter()


def _calibrate(fn: Callable[[], Any], device: torch.device, warmup: int,
               min_sample_s: float = 2e-4) -> int:
    """Run ``fn`` ``warmup`` times; return how many back-to-back calls make one sample last
    ``min_sample_s`` (at least one), so timer resolution doesn't dominate fast nodes."""
    for _ in range(warmup):
        fn()
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    once = time.perf_counter() - t0
    return max(1, min(1000, int(min_sample_s / max(once, 1e-9))))


def _sample(fn: Callable[[], Any], device: torch.device, number: int) -> float:
    """Seconds per call of ``fn`` over ``number`` back-to-back calls (CUDA events on a GPU; on a CPU
    wall time, or this thread's CPU time within :func:`thread_clock`)."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(number):
            fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / 1e3 / number
    t0 = _cpu_clock()
    for _ in range(number):
        fn()
    return (_cpu_clock() - t0) / number


def _interleaved_medians(fns: dict[Any, Callable[[], Any] | None], device: torch.device,
                         warmup: int, repeats: int) -> dict[Any, float]:
    """Median seconds per call of every function, sampled in rounds (one sample of each per
    round) so that a burst of interference from other processes spreads over all nodes instead
    of skewing the few being timed when it happens."""
    numbers = {k: _calibrate(fn, device, warmup) for k, fn in fns.items() if fn is not None}
    samples: dict[Any, list[float]] = {k: [] for k in numbers}
    for _ in range(max(1, repeats)):
        for k, number in numbers.items():
            samples[k].append(_sample(fns[k], device, number))  # type: ignore[arg-type]  # fns hold the timed callables
    return {k: statistics.median(samples[k]) if k in samples else 0.0 for k in fns}


def _visit_medians(fns: dict[Any, Callable[[], Any] | None], device: torch.device,
                   warmup: int, repeats: int, visits: int = 3) -> dict[Any, float]:
    """Seconds per call of every function, robust to bursts of load from other processes: the
    samples are taken in ``visits`` passes over all functions; each visit to a function starts
    with an untimed call (its inputs warm in cache, as in a step) and takes
    ``max(2, repeats // visits)`` samples; the function's cost is the smallest of its visits'
    medians. Interference only ever slows a call down, and a burst long enough to cover all the
    samples of one visit (tens of milliseconds: a node is timed for about a millisecond) rarely
    covers the same node in every visit. As with ``timeit``, the result is what the node costs
    without interference (a lower bound; the median of visits was tried and agreed worse between
    two profiles on this shared machine); the benchmarks time whole steps the same way."""
    numbers = {k: _calibrate(fn, device, warmup) for k, fn in fns.items() if fn is not None}
    per_visit = max(2, repeats // visits)
    best: dict[Any, float] = {}
    for _ in range(visits):
        for k, number in numbers.items():
            fns[k]()  # type: ignore[misc]  # fns hold the timed callables
            m = statistics.median(_sample(fns[k], device, number) for _ in range(per_visit))  # type: ignore[arg-type]  # fns hold the timed callables
            best[k] = min(best.get(k, math.inf), m)
    return {k: best.get(k, 0.0) for k in fns}


def _grad_call(y: torch.Tensor, x: torch.Tensor, g: torch.Tensor) -> Callable[[], Any]:
    return lambda: torch.autograd.grad([y], [x], [g], retain_graph=True)


def backward_call_overhead(device: torch.device, warmup: int = 20, repeats: int = 15) -> float:
    """Seconds one ``torch.autograd.grad`` call costs whatever its graph: the graph task and engine
    start-up. Measured on chains of 1 and 11 one-element ``* 1`` nodes on ``device``: the call costs
    ``fixed + n * per_node``, and ``fixed`` is returned (the per-node part is real work a step does
    too). Every node's measured backward pays ``fixed`` once; a training step pays it once for the
    whole graph, so measured mode subtracts it from each node."""
    calls: dict[Any, Callable[[], Any] | None] = {}
    for n in (1, 11):
        x = torch.ones(1, device=device, requires_grad=True)
        with torch.enable_grad():
            y = x
            for _ in range(n):
                y = y * 1.0
        g = torch.ones_like(y)
        calls[n] = _grad_call(y, x, g)
    t = _interleaved_medians(calls, device, warmup, repeats)
    per_node = max(0.0, (t[11] - t[1]) / 10)
    return max(0.0, t[1] - per_node)


def medians(fns: dict[Any, Callable[[], Any] | None], device: torch.device, warmup: int, repeats: int,
            interleave: bool = False) -> dict[Any, float]:
    """Seconds per call of every function (0 for None): the smallest of visits' medians
    (:func:`_visit_medians`), or with ``interleave`` the median of rounds (:func:`_interleaved_medians`)."""
    return (_interleaved_medians if interleave else _visit_medians)(fns, device, warmup, repeats)
