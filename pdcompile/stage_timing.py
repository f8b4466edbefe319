"""One stage of an emitted program run in this process as the runtime runs it, and timed: the reference that
``python -m pdcompile.calibrate`` (the in-run factor) and ``benchmarks/bench_compute_error.py`` hold a stage's
time in a pipeline run, or its predicted compute, against."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch


class StageRun:
    """One stage of an emitted program, runnable as the runtime runs it: ``forward()`` then ``backward()``."""

    def __init__(self, program: str, stage: int, inputs: tuple[torch.Tensor, ...], target: torch.Tensor) -> None:
        from pdcompile.runtime.program import Program

        prog = Program.load(program)
        self.spec = prog.stages[stage]
        self.last = stage == prog.num_stages - 1
        self.module = prog.build_stage(stage)
        self.loss_fn = prog.build_loss() if self.last else None
        self.target = target
        # the stage's arguments: the previous stages' outputs (run here once), then the model inputs it reads
        args: list[torch.Tensor] = list(inputs)
        with torch.no_grad():
            for k in range(stage):
                prev = prog.build_stage(k)
                out = prev(*args)
                args = list(out) + [inputs[j] for j, _ in prog.stages[k + 1].data]
        self.args = [a.detach().clone().requires_grad_(spec.requires_grad and a.is_floating_point())
                     for a, spec in zip(args, self.spec.args)] + args[len(self.spec.args):]
        self.out: Any = None
        self.seeds: list[torch.Tensor] | None = None

    def forward(self) -> None:
        out = self.module(*self.args)
        if self.last:
            assert self.loss_fn is not None
            self.out = [self.loss_fn(out, self.target)]
        else:
            self.out = [o for o, spec in zip(out, self.spec.outputs) if spec.requires_grad and o.requires_grad]
            if self.seeds is None:
                self.seeds = [torch.ones_like(o) for o in self.out]

    def backward(self) -> None:
        if self.out:
            torch.autograd.backward(self.out, None if self.last else self.seeds)
        self.out = None


def time_stage(run: StageRun, repeats: int, warmup: int = 5) -> tuple[float, float]:
    """(forward s, backward s): medians of ``repeats`` after ``warmup``, wall clock."""
    for _ in range(warmup):
        run.forward()
        run.backward()
    fs, bs = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run.forward()
        t1 = time.perf_counter()
        run.backward()
        t2 = time.perf_counter()
        fs.append(t1 - t0)
        bs.append(t2 - t1)
    return statistics.median(fs), statistics.median(bs)


def in_run_factor(in_run: dict[tuple[int, str], list[float]], alone: dict[tuple[int, str], float],
                  overhead_s: dict[str, float]) -> float:
    """How much slower a stage computes inside a pipeline run than alone in one process: per (stage, "F" or "B"),
    the run's median action less the runtime's per-action cost (``overhead_s``, charged apart), over the same stage
    timed alone (``alone``); the median over them, at least 1. 1 where nothing pairs up."""
    ratios = []
    for key, times in in_run.items():
        if times and alone.get(key, 0.0) > 0.0:
            ratios.append(max(statistics.median(times) - overhead_s.get(key[1], 0.0), 0.0) / alone[key])
    return max(1.0, statistics.median(ratios)) if ratios else 1.0
