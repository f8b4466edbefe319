"""What a run reports as it goes (docs/training-loop.md), from the last stage's first replica: a log
line every ``--log-every`` steps (step, epoch, loss, LR, samples/s, tokens/s for token inputs, step
time, peak memory), a progress bar when stdout is a terminal, records in ``metrics.jsonl``
(``--metrics DIR``) and TensorBoard scalars (``--tensorboard DIR``, ``torch.utils.tensorboard``)."""

from __future__ import annotations

import json
import logging
import math
import resource
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("pdcompile.runtime")


def peak_memory_mb(device: torch.device) -> float:
    """The process's peak memory: the CUDA allocator's peak on a GPU, else the peak resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def tokens_per_sample(inputs: Any) -> int | None:
    """Tokens in one sample when the first input is integer token ids of shape (batch, ...): the product
    of its other dimensions; None for other inputs (images, features)."""
    if not inputs:
        return None
    spec = inputs[0]
    if spec.dtype.is_floating_point or len(spec.shape) < 2:
        return None
    return int(math.prod(spec.shape[1:]))


def last_stage_losses(ranks: Sequence[Mapping[str, Any]]) -> list[float]:
    """Every microbatch's loss in microbatch order, from the ranks' ``rank_N.json`` metrics: a replica
    of the last stage holds only its own microbatches' (microbatch ``k`` on replica ``k % r``, numbered
    in ``loss_microbatches``); the other ranks none."""
    by_microbatch = {k: x for r in ranks for k, x in zip(r["loss_microbatches"], r["losses"])}
    return [by_microbatch[k] for k in sorted(by_microbatch)]


def minibatch_sums(unlogged: dict[int, float], first: int, end: int, M: int) -> tuple[list[float], list[float]]:
    """(loss sum, count) of each of minibatches ``[first, end)`` of ``M`` microbatches, from ``unlogged``
    (microbatch -> loss: a replica of the last stage holds those of its own microbatches); those of
    minibatches before ``end`` are taken out, later ones (a forward before the step that completes the
    minibatch before) stay for their minibatch's logging point."""
    total, count = [0.0] * (end - first), [0.0] * (end - first)
    for k in [k for k in unlogged if k < end * M]:
        loss = unlogged.pop(k)
        if k >= first * M:
            total[k // M - first] += loss
            count[k // M - first] += 1
    return total, count


class Bar:
    """A one-line progress bar on the terminal (steps done, elapsed, time left, the last loss), redrawn
    in place; the runtime imports torch only, so it is drawn here rather than by a library."""

    def __init__(self, total: int, start: int, width: int = 30) -> None:
        self.total, self.start, self.width = max(1, total), start, width
        self.t0 = time.monotonic()
        self.shown = False

    def update(self, step: int, note: str) -> None:
        done = step / self.total
        fill = int(self.width * done)
        spent = time.monotonic() - self.t0
        left = spent / max(1, step - self.start) * (self.total - step)
        sys.stdout.write(f"\r[{'#' * fill}{'.' * (self.width - fill)}] {step}/{self.total}  "
                         f"{spent:.0f}s elapsed, {left:.0f}s left  {note}\x1b[K")
        sys.stdout.flush()
        self.shown = True

    def clear(self) -> None:
        if self.shown:
            sys.stdout.write("\r\x1b[K")
            sys.stdout.flush()
            self.shown = False


class RunLog:
    """The reporting rank's records of a run (``enabled``; other ranks make one that does nothing).

    :meth:`step` takes each logging point's steps; :meth:`eval` each evaluation's results; :meth:`close`
    flushes the files. ``total``: the run's steps; ``per_epoch``: steps per epoch (None: no epochs)."""

    def __init__(self, args: Any, enabled: bool, *, total: int, start: int, per_epoch: int | None,
                 samples_per_step: int, tokens: int | None, device: torch.device) -> None:
        self.enabled, self.total, self.per_epoch = enabled, total, per_epoch
        self.samples, self.tokens, self.device = samples_per_step, tokens, device
        self.every = max(1, int(getattr(args, "log_every", 1)))
        self.jsonl = None
        self.tb: Any = None
        self.bar: Bar | None = None
        self._since: list[tuple[float, float]] = []  # (loss, seconds) of the steps since the last line
        self.t0 = time.monotonic()  # records' time_s counts from here (:meth:`start_clock`)
        if not enabled:
            return
        if getattr(args, "metrics", None):
            out = Path(args.metrics)
            out.mkdir(parents=True, exist_ok=True)
            self.jsonl = (out / "metrics.jsonl").open("a" if start else "w")
        if getattr(args, "tensorboard", None):
            from torch.utils.tensorboard import SummaryWriter  # the tensorboard extra: checked by loop.check

            self.tb = SummaryWriter(args.tensorboard)
        if sys.stdout.isatty():
            self.bar = Bar(total, start)

    def start_clock(self) -> None:
        """The run starts now (after every rank is ready): records carry ``time_s`` since then, so a metric
        can be plotted against wall-clock time (time to accuracy)."""
        self.t0 = time.monotonic()

    def epoch_of(self, step: int) -> float | None:
        """The epoch, counted from 1, that step ``step`` (1-based) falls in; None without epochs."""
        return None if not self.per_epoch else (step - 1) // self.per_epoch + 1

    def step(self, step: int, loss: float | None, lr: float | None, seconds: float) -> None:
        """Step ``step`` (1-based) is done: its loss (the mean over its minibatch's microbatches, on every
        replica of the last stage: ``Trainer._minibatch_losses``; None: none computed), the LR it used and
        its time; a line, a record and scalars every ``--log-every`` steps and at the last."""
        if not self.enabled:
            return
        self._since.append((math.nan if loss is None else loss, seconds))
        if self.bar is not None:
            self.bar.update(step, "" if loss is None else f"loss {loss:.4f}")
        if step % self.every and step != self.total:
            return
        losses = [x for x, _ in self._since if not math.isnan(x)]
        secs = sum(s for _, s in self._since)
        n = len(self._since)
        self._since = []
        rec: dict[str, Any] = {
            "type": "train", "step": step, "epoch": self.epoch_of(step),
            "loss": sum(losses) / len(losses) if losses else None, "lr": lr,
            "step_time_s": secs / n, "samples_per_s": self.samples * n / secs if secs > 0 else None,
            "tokens_per_s": self.samples * n * self.tokens / secs if self.tokens and secs > 0 else None,
            "peak_memory_mb": peak_memory_mb(self.device), "time_s": time.monotonic() - self.t0,
        }
        parts = [f"step {step}/{self.total}"]
        if rec["epoch"] is not None:
            parts.append(f"epoch {rec['epoch']}")
        parts.append(f"loss {rec['loss']:.6f}" if rec["loss"] is not None else "loss -")
        if lr is not None:
            parts.append(f"lr {lr:.4g}")
        if rec["samples_per_s"] is not None:
            parts.append(f"{rec['samples_per_s']:.1f} samples/s")
        if rec["tokens_per_s"] is not None:
            parts.append(f"{rec['tokens_per_s']:.0f} tokens/s")
        parts += [f"step {rec['step_time_s'] * 1e3:.1f} ms", f"peak mem {rec['peak_memory_mb']:.0f} MB"]
        self._emit(rec, "  ".join(parts))
        if self.tb is not None:
            for key in ("loss", "lr", "samples_per_s", "tokens_per_s", "step_time_s", "peak_memory_mb"):
                if rec[key] is not None:
                    self.tb.add_scalar(f"train/{key}", rec[key], step)

    def eval(self, step: int, results: dict[str, float]) -> None:
        """An evaluation after step ``step``: its loss and metric."""
        if not self.enabled:
            return
        rec = {"type": "eval", "step": step, "epoch": self.epoch_of(step) if step else 0,
               "time_s": time.monotonic() - self.t0, **results}
        self._emit(rec, f"eval after step {step}: " + "  ".join(f"{k} {v:.6f}" for k, v in results.items()))
        if self.tb is not None:
            for k, v in results.items():
                self.tb.add_scalar(f"eval/{k}", v, step)

    def _emit(self, rec: dict[str, Any], line: str) -> None:
        if self.bar is not None:  # above the bar, on the same terminal
            self.bar.clear()
        log.info("%s", line)
        if self.jsonl is not None:
            self.jsonl.write(json.dumps(rec) + "\n")
            self.jsonl.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.clear()
        if self.jsonl is not None:
            self.jsonl.close()
        if self.tb is not None:
            self.tb.close()
