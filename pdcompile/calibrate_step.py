"""This machine's optimizer step and the data-parallel all-reduce's work around its collective (part of
``python -m pdcompile.calibrate``; ``--step`` measures only these): each fitted as ``fixed + tensors x per_tensor
+ bytes / rate`` over probe sets whose tensor count and bytes vary apart, in this process, one thread (~2 s)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any


#: the probe sets of :func:`measure_step`: (tensors, float32 elements each); tensor count and bytes vary apart
STEP_PROBES = ((1, 1 << 10), (64, 1 << 4), (128, 1 << 4), (1, 1 << 20), (2, 1 << 20), (64, 1 << 14))


def fit_tensor_cost(samples: Sequence[tuple[int, float, float]]) -> tuple[float, float, float]:
    """(fixed s, s per tensor, bytes/s) of ``time = fixed + tensors x per_tensor + bytes / rate`` through
    ``samples`` of (tensors, bytes, s): least squares in relative error (each sample weighted by ``1 / s``, so
    a small set's fixed and per-tensor cost count as much as a large one's rate). A negative fixed or
    per-tensor part is fitted again as 0 (the others alone); the rate is inf where the bytes cost nothing."""
    import numpy as np

    pts = [(float(n), float(b), float(t)) for n, b, t in samples if t > 0]
    if len(pts) < 3:
        raise ValueError(f"fit_tensor_cost needs 3 or more timed sets, got {len(pts)}")
    cols = [0, 1, 2]
    while True:
        a = np.array([[(1.0, n, b)[c] / t for c in cols] for n, b, t in pts])
        x = np.linalg.lstsq(a, np.ones(len(pts)), rcond=None)[0]
        coef = dict.fromkeys((0, 1, 2), 0.0) | {c: float(v) for c, v in zip(cols, x)}
        bad = [c for c in cols if coef[c] < 0 and len(cols) > 1]
        if not bad:
            break
        cols.remove(min(bad, key=lambda c: coef[c]))
    rate = 1.0 / coef[2] if coef[2] > 0 else float("inf")
    return max(coef[0], 0.0), max(coef[1], 0.0), rate


def _step_sample(tensors: int, numel: int, repeats: int) -> float:
    """Median seconds of one SGD-with-momentum step and ``zero_grad(set_to_none=True)`` (as the runtime
    steps, runtime/executor.py) over ``tensors`` parameters of ``numel`` floats, gradients set afresh
    before each (untimed); the first steps (which make the momentum buffers) left out."""
    import torch

    params = [torch.nn.Parameter(torch.zeros(numel)) for _ in range(tensors)]
    grads = [torch.zeros(numel) for _ in range(tensors)]
    opt = torch.optim.SGD(params, lr=0.0, momentum=0.9)
    times = []
    for i in range(repeats + 3):
        for p, g in zip(params, grads):
            p.grad = g
        t0 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_step() -> tuple[float, float, float]:
    """(fixed s, s per parameter tensor, parameter bytes/s) of the optimizer step: SGD with momentum and
    ``zero_grad`` over the sets of :data:`STEP_PROBES` (1 - 128 tensors, 4 KiB - 8 MiB, count and bytes
    varied apart), one thread, fitted as ``fixed + tensors x per_tensor + bytes / rate``
    (:func:`fit_tensor_cost`). torch's SGD on CPU tensors loops over them one by one (no foreach kernel
    by default off CUDA): a few microseconds each, which a stage of many small tensors pays. ~1 s."""
    import torch

    torch.set_num_threads(1)
    samples = []
    for _ in range(2):  # the sets twice, interleaved: a passing load spreads over both
        for n, numel in STEP_PROBES:
            samples.append((n, 4.0 * n * numel, _step_sample(n, numel, 15 if numel < (1 << 18) else 6)))
    return fit_tensor_cost(samples)


def _flatten_sample(tensors: int, numel: int, repeats: int) -> float:
    """Median seconds of ``allreduce_flat``'s work around its collective over ``tensors`` gradients of ``numel``
    floats: the flatten (``torch.cat``) and the copy of each back (runtime/executor.py)."""
    import torch

    ts = [torch.zeros(numel) for _ in range(tensors)]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        flat = torch.cat([t.reshape(-1) for t in ts])
        offset = 0
        for t in ts:
            t.copy_(flat[offset:offset + numel].view_as(t))
            offset += numel
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_flatten() -> tuple[float, float, float]:
    """(fixed s, s per tensor, bytes/s) of the data-parallel all-reduce's flatten and copy back
    (``allreduce_flat`` less its collective), in this process, one thread, over the sets of
    :data:`STEP_PROBES` (:func:`fit_tensor_cost`). Its per-tensor part is what a stage's all-reduce pays per
    gradient beyond the collective probe's (``calibrate_link._GRAD_TENSORS`` tensors, in its fixed part). ~0.5 s."""
    import torch

    torch.set_num_threads(1)
    samples = []
    for _ in range(2):
        for n, numel in STEP_PROBES:
            samples.append((n, 4.0 * n * numel, _flatten_sample(n, numel, 15 if numel < (1 << 18) else 6)))
    return fit_tensor_cost(samples)


def time_step(params: list[Any], repeats: int) -> float:
    """Median seconds of an SGD-with-momentum step and zero_grad over ``params`` (their grads zeros)."""
    import torch

    for p in params:
        p.grad = torch.zeros_like(p)
    opt = torch.optim.SGD(params, lr=0.0, momentum=0.9)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=False)
        times.append(time.perf_counter() - t0)
    for p in params:
        p.grad = None
    return statistics.median(times)


def step_seconds(stage_modules: list[Any], repeats: int = 20) -> list[float]:
    """Measured optimizer step (SGD with momentum, zero_grad) of each module's parameters."""
    out = []
    for mod in stage_modules:
        params = [p for p in mod.parameters() if p.requires_grad]
        out.append(time_step(params, repeats) if params else 0.0)
    return out
