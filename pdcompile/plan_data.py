"""The Plan: what the partitioners decide — stages, replicas, ranks — and what the cost model
predicts for it.

A :class:`Plan` is plain, frozen data with a JSON form (:meth:`Plan.to_json` /
:meth:`Plan.from_json`) and a deterministic text table (``str(plan)``). Layer positions are
positions in the linearized chain (:class:`pdcompile.ir.Chain`), inclusive at both ends. The
planners (``passes/partition_dp.py``, ``passes/partition_ilp.py``) build plans and import this
module; ``pdcompile/plan.py`` (which imports the planners) re-exports it with :func:`pdcompile.plan.plan`.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Iterable, Sequence

from pdcompile.errors import UsageError

__all__ = ["PLAN_FORMAT", "PLAN_VERSION", "SHARD_MODES", "StagePlan", "Plan"]

PLAN_FORMAT = "pdcompile-plan"
PLAN_VERSION = 1
#: how a replicated stage's replicas hold its state (docs/api.md): whole copies, ZeRO-1, FSDP
SHARD_MODES = ("none", "optimizer", "full")


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage: chain positions ``first..last`` (inclusive) run by ``replicas``
    workers (``ranks``), taking minibatches round-robin.

    ``compute_s`` is the stage's forward+backward time per minibatch divided by its replicas;
    ``comm_s`` its weight synchronisation (all-reduce among replicas) per minibatch under the
    cost model (0 for one replica); ``time_s`` what the cost model charges the stage per
    minibatch (the value compared against the bottleneck); ``send_s`` the time of the boundary
    after it (activations forward + gradients back; 0 for the last stage). ``memory_bytes`` is the
    peak per-worker memory: weights x ``weight_versions`` + gradients + optimizer state + the
    stashed activations of ``in_flight`` minibatches. ``shard`` is how its replicas hold that state:
    ``none`` (whole copies), ``optimizer`` (ZeRO-1: optimizer state 1/r per replica) or ``full``
    (FSDP: parameters, gradients and optimizer state 1/r, gathered for the step); one replica: none.
    """

    index: int
    first: int
    last: int
    layer_names: tuple[str, ...]
    members: tuple[str, ...]
    replicas: int
    ranks: tuple[int, ...]
    compute_s: float
    comm_s: float
    memory_bytes: float
    time_s: float = 0.0
    send_s: float = 0.0
    in_flight: int = 1
    weight_versions: int = 1
    recompute: str = "none"  # activation recomputation: "none", "selective" (cheap ops), "partial", "full"
    recompute_layers: int = 0  # layers whose forward runs again in the backward (partial: the first ones)
    shard: str = "none"  # the replicas' state: "none", "optimizer" (ZeRO-1) or "full" (FSDP2), SHARD_MODES
    tensor_parallel: int = 1  # processes each of its ranks is (Megatron's split, passes/planner/tensor.py)
    tensor_why: str = ""  # why the planner chose that degree (one line; "" where it was given)

    @property
    def recompute_text(self) -> str:
        """The mode as the plan table shows it (partial: how many of the stage's first layers)."""
        if self.recompute == "partial":
            return f"first {self.recompute_layers} of {self.num_layers} layers"
        return self.recompute

    @property
    def layers(self) -> tuple[int, int]:
        return (self.first, self.last)

    @property
    def num_layers(self) -> int:
        return self.last - self.first + 1


def _stage_from_dict(d: dict[str, Any]) -> StagePlan:
    first, last = d["layers"]
    known = {f.name for f in fields(StagePlan)}
    kw = {k: v for k, v in d.items() if k in known}
    kw.update(first=int(first), last=int(last))
    for key in ("layer_names", "members", "ranks"):
        kw[key] = tuple(kw.get(key, ()))
    kw.setdefault("layer_names", ())
    kw.setdefault("members", ())
    kw.setdefault("compute_s", 0.0)
    kw.setdefault("comm_s", 0.0)
    kw.setdefault("memory_bytes", 0.0)
    return StagePlan(**kw)


def _num(x: float) -> float | None:
    """JSON has no NaN/inf: write them as null."""
    return None if (isinstance(x, float) and not math.isfinite(x)) else x


@dataclass(frozen=True)
class Plan:
    """A partition of the chain into stages with replicas and ranks, and its predicted cost."""

    stages: tuple[StagePlan, ...]
    solver: str
    cost_model: str
    schedule: str
    microbatch_size: int
    seconds_per_minibatch: float
    samples_per_second: float
    data_parallel_samples_per_second: float
    bottleneck: str
    planning_seconds: float
    optimal: bool
    gap: float
    num_workers: int
    model: str = ""
    cluster: str = ""
    memory_limit_bytes: float | None = None
    notes: tuple[str, ...] = ()
    num_microbatches: int = 1  # per minibatch (an optimizer step): seconds_per_minibatch covers them all
    # what seconds_per_minibatch is: "" the planner's steady-state bottleneck per microbatch (PipeDream's
    # objective, 1F1B and 2BW); else how it was simulated (a synchronous schedule's step, fill and drain included)
    predicted_by: str = ""

    def with_step(self, seconds: float, num_microbatches: int, how: str) -> "Plan":
        """This plan with its headline a step of ``num_microbatches`` microbatches taking ``seconds``,
        predicted as ``how`` says (the compiled program's ``simulate()``: one number for both)."""
        minibatch = self.microbatch_size * num_microbatches
        return replace(self, seconds_per_minibatch=seconds, num_microbatches=num_microbatches, predicted_by=how,
                       samples_per_second=minibatch / seconds if seconds > 0 else math.inf)

    # -- derived ---------------------------------------------------------------------------
    @property
    def speedup_vs_data_parallel(self) -> float:
        a, b = self.samples_per_second, self.data_parallel_samples_per_second
        if math.isinf(a) and math.isinf(b):
            return 1.0  # both free (a chain that costs nothing)
        if b <= 0:
            return math.inf
        return a / b

    @property
    def data_parallel_seconds_per_minibatch(self) -> float:
        if self.data_parallel_samples_per_second <= 0:
            return math.inf
        return self.microbatch_size / self.data_parallel_samples_per_second

    @property
    def workers_used(self) -> int:
        return sum(s.replicas * s.tensor_parallel for s in self.stages)

    @property
    def configuration(self) -> str:
        """PipeDream's short form: replicas per stage joined by '-' (e.g. ``"3-1"``)."""
        return "-".join(str(s.replicas) for s in self.stages)

    @property
    def stage_bounds(self) -> list[tuple[int, int]]:
        return [(s.first, s.last) for s in self.stages]

    # -- JSON ------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        stages = []
        for s in self.stages:
            d = asdict(s)
            d.pop("first")
            d.pop("last")
            d = {"layers": [s.first, s.last], **d}
            if s.tensor_parallel == 1 and not s.tensor_why:  # plans without it keep the JSON they always had
                d.pop("tensor_parallel")
                d.pop("tensor_why")
            d["layer_names"] = list(s.layer_names)
            d["members"] = list(s.members)
            d["ranks"] = list(s.ranks)
            stages.append(d)
        return {
            "format": PLAN_FORMAT,
            "version": PLAN_VERSION,
            "model": self.model,
            "solver": self.solver,
            "cost_model": self.cost_model,
            "schedule": self.schedule,
            "microbatch_size": self.microbatch_size,
            "num_workers": self.num_workers,
            "workers_used": self.workers_used,
            "configuration": self.configuration,
            "cluster": self.cluster,
            "memory_limit_bytes": self.memory_limit_bytes,
            "stages": stages,
            "predicted": {
                "seconds_per_minibatch": _num(self.seconds_per_minibatch),
                "samples_per_second": _num(self.samples_per_second),
                "data_parallel_samples_per_second": _num(self.data_parallel_samples_per_second),
                "speedup_vs_data_parallel": _num(self.speedup_vs_data_parallel),
                "bottleneck": self.bottleneck,
            },
            "planning_seconds": self.planning_seconds,
            "optimal": self.optimal,
            "gap": _num(self.gap),
            "notes": list(self.notes),
            # a simulated step's (plans predicted by the steady state keep the JSON they always had)
            **({"num_microbatches": self.num_microbatches, "predicted_by": self.predicted_by}
               if self.predicted_by or self.num_microbatches != 1 else {}),
        }

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "Plan":
        if d.get("format", PLAN_FORMAT) != PLAN_FORMAT:
            raise UsageError(f"not a pdcompile plan (format {d.get('format')!r})")
        pred = d.get("predicted", {})

        def f(x: Any, default: float = math.nan) -> float:
            return default if x is None else float(x)

        return Plan(
            stages=tuple(_stage_from_dict(s) for s in d["stages"]),
            solver=d["solver"],
            cost_model=d["cost_model"],
            schedule=d.get("schedule", "1f1b"),
            microbatch_size=int(d.get("microbatch_size", 1)),
            seconds_per_minibatch=f(pred.get("seconds_per_minibatch"), math.inf),
            samples_per_second=f(pred.get("samples_per_second"), 0.0),
            data_parallel_samples_per_second=f(pred.get("data_parallel_samples_per_second"), 0.0),
            bottleneck=pred.get("bottleneck", ""),
            planning_seconds=float(d.get("planning_seconds", 0.0)),
            optimal=bool(d.get("optimal", False)),
            gap=f(d.get("gap")),
            num_workers=int(d.get("num_workers", sum(len(s["ranks"]) for s in d["stages"]))),
            model=d.get("model", ""),
            cluster=d.get("cluster", ""),
            memory_limit_bytes=d.get("memory_limit_bytes"),
            notes=tuple(d.get("notes", ())),
            num_microbatches=int(d.get("num_microbatches", 1)),
            predicted_by=d.get("predicted_by", ""),
        )

    @staticmethod
    def from_json(text: str) -> "Plan":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise UsageError(f"invalid plan JSON at line {e.lineno}: {e.msg}") from None
        return Plan.from_dict(data)

    # -- text ------------------------------------------------------------------------------
    def table(self) -> str:
        """The plan as a plain-text table (deterministic; what ``str(plan)`` prints)."""
        head = (
            f"plan for {self.model or 'model'} on {self.num_workers} workers "
            f"({self.workers_used} used), configuration {self.configuration}"
        )
        lines = [head]
        if self.cluster:
            lines.append(f"cluster: {self.cluster}")
        lines.append(
            f"solver {self.solver}, cost model {self.cost_model}, schedule {self.schedule}, "
            f"microbatch {self.microbatch_size}"
            + (f" x {self.num_microbatches}" if self.num_microbatches != 1 else "")
            + f", planned in {self.planning_seconds * 1e3:.1f} ms"
            + ("" if self.optimal else f" (not proven optimal; gap {_fmt_gap(self.gap)})")
        )
        cols = ["stage", "layers", "names", "replicas", "ranks", "compute", "comm", "send",
                "time", "memory", "in-flight"]
        recomputes = any(s.recompute != "none" for s in self.stages)  # the column only when some stage does
        if recomputes:
            cols.append("recompute")
        shards = any(s.shard != "none" for s in self.stages)  # likewise only when some stage shards
        if shards:
            cols.append("shard")
        tensor = any(s.tensor_parallel != 1 for s in self.stages)  # and tensor parallelism's degree
        if tensor:
            cols.append("t")
        rows = []
        for s in self.stages:
            names = _abbrev_names(s.layer_names)
            rows.append([
                str(s.index), f"{s.first}..{s.last}", names, str(s.replicas), _ranges(s.ranks),
                _fmt_s(s.compute_s), _fmt_s(s.comm_s), _fmt_s(s.send_s), _fmt_s(s.time_s),
                _fmt_bytes(s.memory_bytes), str(s.in_flight),
            ] + ([s.recompute_text] if recomputes else []) + ([s.shard] if shards else [])
                + ([str(s.tensor_parallel)] if tensor else []))
        widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(cols)]
        lines.append("  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip())
        for r in rows:
            lines.append("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())
        lines.append(f"bottleneck: {self.bottleneck}")
        lines.append(
            f"predicted: {_fmt_s(self.seconds_per_minibatch)} per minibatch, "
            f"{self.samples_per_second:.4g} samples/s ("
            + (self.predicted_by or "the steady-state bottleneck per microbatch, PipeDream's objective") + ")"
        )
        lines.append(
            f"data parallel on {self.num_workers} workers: {self.data_parallel_samples_per_second:.4g} samples/s; "
            f"speedup {self.speedup_vs_data_parallel:.3g}x"
        )
        if self.memory_limit_bytes is not None:
            lines.append(f"memory limit per worker: {_fmt_bytes(self.memory_limit_bytes)}")
        for s in self.stages:
            if s.tensor_why:
                lines.append(f"stage {s.index} tensor parallel: {s.tensor_why}")
        for n in self.notes:
            lines.append(f"note: {n}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _fmt_gap(g: float) -> str:
    return "unknown" if not math.isfinite(g) else f"{g * 100:.2f}%"


def _fmt_s(x: float) -> str:
    if x == 0:
        return "0"
    if not math.isfinite(x):
        return str(x)
    if x >= 1:
        return f"{x:.3f} s"
    if x >= 1e-3:
        return f"{x * 1e3:.3f} ms"
    return f"{x * 1e6:.3f} us"


def _fmt_bytes(x: float) -> str:
    from pdcompile.cluster import format_quantity

    return format_quantity(x, "memory")


def _ranges(ranks: Iterable[int]) -> str:
    """``(0,1,2,5,6)`` -> ``"0-2,5-6"``."""
    rs = sorted(ranks)
    out: list[str] = []
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        out.append(str(rs[i]) if i == j else f"{rs[i]}-{rs[j]}")
        i = j + 1
    return ",".join(out)


def _abbrev_names(names: Sequence[str]) -> str:
    if not names:
        return "-"
    if len(names) <= 2:
        return ",".join(names)
    return f"{names[0]}..{names[-1]}"
