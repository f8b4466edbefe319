"""Validation through the pipeline (``--eval-data``; docs/training-loop.md): forward only, at a flush
point, with the stages' current weights: no backward, no weight versions, ``torch.no_grad`` and
``eval()`` on every stage.

Microbatch ``k`` of the validation data goes through every stage in order, on replica ``k % r`` of a
stage with ``r`` replicas. Every rank walks ``k = 0, 1, ...`` and, for each, its own stages in order:
a stage receives its inputs (from the rank of the stage before, or in memory when that is this rank),
runs, and sends its outputs on. The target goes from the first stage to the last, first of that
microbatch's messages between the two ranks (or the last stage reads it itself: ``--targets local``).
Each pair of ranks thus sends and receives in one order, as NCCL needs. The last stage's replicas sum
the loss and metric of their microbatches; its first replica reports the mean over microbatches."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pdcompile.runtime import comm, devices, tensor_parallel
from pdcompile.runtime.data import Reader
from pdcompile.runtime.executor import StageExecutor
from pdcompile.runtime.program import PICKLED, Program, load_callable

Metric = Callable[[Any, torch.Tensor], Any]


def accuracy(output: Any, target: torch.Tensor) -> torch.Tensor:
    """The fraction of ``target``'s entries equal to the argmax of the output's last dimension (class
    scores per sample, or per token)."""
    logits = output if isinstance(output, torch.Tensor) else output[0]
    return (logits.argmax(-1) == target).float().mean()


def metric_of(name: str | None, folder: Path | None = None) -> tuple[str, Metric] | None:
    """``--eval-metric``: ``accuracy``, ``MODULE:FUNCTION`` (named by its function) or ``FILE.pkl`` (a
    function pdcompile serialized by value, named by its own name, or the file's for a lambda), or None."""
    if name is None:
        return None
    if name == "accuracy":
        return "accuracy", accuracy
    fn = load_callable(name, folder)
    if not name.endswith(PICKLED):
        return name.rpartition(":")[2], fn
    own = getattr(fn, "__name__", "")
    return (own if own.isidentifier() else Path(name).stem), fn


class Evaluator:
    """One rank's part of an evaluation; :meth:`run` takes a fresh :class:`Reader` of the validation data
    (or None on ranks that read none) and returns ``{"loss": ..., metric: ...}`` on the reporting rank
    (the last stage's first replica), None elsewhere."""

    def __init__(self, program: Program, rank: int, executors: Sequence[StageExecutor], steps: int, M: int,
                 metric: tuple[str, Metric] | None, local_targets: bool, last_group: Any) -> None:
        self.program, self.rank, self.executors = program, rank, list(executors)
        self.steps, self.M, self.metric = steps, M, metric
        self.local_targets = local_targets
        self.last_group = last_group  # the last stage's replicas (None: one replica)
        self.last = program.num_stages - 1
        self.reports = any(ex.stage == self.last and rank == program.stages[self.last].ranks[0] for ex in executors)

    def _peer(self, stage: int, k: int) -> int:
        ranks = self.program.stages[stage].ranks
        return ranks[k % len(ranks)]

    def run(self, reader: Reader | None) -> dict[str, float] | None:
        device = devices.rank_device()
        for ex in self.executors:
            ex.module.eval()
        try:
            with torch.no_grad():
                sums = self._walk(reader, device)
        finally:
            for ex in self.executors:
                ex.module.train()
        if self.last_group is not None and any(ex.stage == self.last for ex in self.executors):
            dist.all_reduce(sums, group=self.last_group)
        if not self.reports:
            return None
        n = max(1.0, float(sums[2]))
        out = {"loss": float(sums[0]) / n}
        if self.metric is not None:
            out[self.metric[0]] = float(sums[1]) / n
        return out

    def _walk(self, reader: Reader | None, device: torch.device) -> torch.Tensor:
        """Every microbatch through this rank's stages; (loss sum, metric sum, microbatches) of the last stage."""
        sums = torch.zeros(3, dtype=torch.float64, device=device)
        sends: deque[list[Any]] = deque()
        local: dict[tuple[str, int], list[torch.Tensor]] = {}  # hand-overs between this rank's stages
        batch: dict[int, tuple[tuple[torch.Tensor, ...], torch.Tensor]] = {}
        mine = {ex.stage for ex in self.executors}

        def data(k: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
            nonlocal batch
            while k not in batch:
                assert reader is not None, f"rank {self.rank} reads no validation data"
                i, pos, inputs, target = next(reader)
                if i > k // self.M:
                    raise RuntimeError(f"validation microbatch {k} was not read by rank {self.rank}")
                b = self.program.raw["microbatch_size"]
                ins = [x.split(b) for x in inputs]
                batch = {i * self.M + j: (tuple(x[n] for x in ins), target.split(b)[n]) for n, j in enumerate(pos)}
            return batch[k]

        for k in range(self.steps * self.M):
            target_rx: comm.Pending | None = None
            last_here = self.last in mine and self._peer(self.last, k) == self.rank
            src0 = self._peer(0, k)
            if last_here and not self.local_targets and src0 != self.rank:  # first of k's messages from src0
                target_rx = comm.post_recv([self.program.target.empty(device)], src0)
            for ex in self.executors:
                s = ex.stage
                if self._peer(s, k) != self.rank:
                    continue
                spec = self.program.stages[s]
                relay_in = self.program.relayed(s) if not self.local_targets else ()
                relay_out = self.program.relayed(s + 1) if not self.local_targets and s < self.last else ()
                if s == 0:
                    inputs_cpu, target = data(k)
                    xs = [x.to(device) for x in inputs_cpu]
                    relayed = {j: xs[j] for j in relay_out}
                    dst = self._peer(self.last, k)
                    if dst != self.rank and not self.local_targets:
                        sends.append(comm.post_send([target.to(device)], dst))
                    elif dst == self.rank:
                        local[("T", k)] = [target.to(device)]
                else:
                    src = self._peer(s - 1, k)
                    if src == self.rank:
                        got = local.pop(("A", k))
                    else:
                        bufs = [t.empty_wire(ex.precision, device) for t in spec.inputs] + \
                            [self.program.stages[0].inputs[j].empty(device) for j in relay_in]
                        got = comm.post_recv(bufs, src).wait()
                    n = len(spec.inputs)
                    xs = [x.to(t.dtype) for x, t in zip(got[:n], spec.inputs)]
                    relayed = dict(zip(relay_in, got[n:]))  # model inputs relayed from stage 0 (--targets send)
                    xs += [data(k)[0][j].to(device) if self.local_targets else relayed[j] for j, _ in spec.data]
                with ex._autocast():
                    out = ex.module(*xs)
                if s < self.last:
                    outs = [o.detach().to(t.wire(ex.precision)) for o, t in zip(out, spec.outputs)]
                    outs += [relayed[j] for j in relay_out]
                    dst = self._peer(s + 1, k)
                    if dst == self.rank:
                        local[("A", k)] = outs
                    else:
                        sends.append(comm.post_send(outs, dst))
                    continue
                if ("T", k) in local:
                    target = local.pop(("T", k))[0]
                elif target_rx is not None:
                    target = target_rx.wait()[0]
                else:  # --targets local: the last stage reads it
                    target = data(k)[1].to(device)
                assert ex.loss_fn is not None
                with ex._autocast():
                    loss = ex.loss_fn(out, target)
                sums[0] += loss.double()
                if self.metric is not None:
                    sums[1] += float(self.metric[1](tensor_parallel.whole_output(out), target))
                sums[2] += 1
            while len(sends) > 4 * self.M:  # bounded: each is taken by its receiver in order
                for w in sends.popleft():
                    w.wait()
        for works in sends:
            for w in works:
                w.wait()
        return sums
