"""The planning options: one frozen :class:`PlanOptions` that ``partition_dp``, ``partition_ilp``,
:class:`~pdcompile.passes.planner.search.PlanModel`, ``pdcompile plan`` and the partition pass all
take, so a new option is added here once. Below every planner module: it imports none of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pdcompile.errors import UsageError

__all__ = ["PlanOptions", "plan_options"]


@dataclass(frozen=True)
class PlanOptions:
    """What one planning problem asks besides its chain and cluster (defaults: ``partition_dp``'s).
    Values are checked where they are read (``PlanModel``), with the message naming the fix."""

    cost_model: str = "default"  # "default", "paper" or "pipedream" (planner/costs.py)
    schedule: str = "1f1b"  # whose Policy gives weight versions and microbatches in flight
    memory_limit: bool | None = None  # None: the cost model's default (on for default, off for paper)
    optimizer_state_factor: float = 1.0  # optimizer-state bytes per weight byte (Adam 2, momentum SGD 1, SGD 0)
    allow_replication: bool = True  # stages may be replicated (data parallel within a stage)
    num_microbatches: int | None = None  # per minibatch; None: 1, and in-flight counts not capped by it
    recompute: str = "none"  # "none", "selective", "full" or "auto" (per stage, where memory needs it)
    pool: bool = False  # also plan the workers as one pool at the slowest link (partition_dp.pool_cluster)
    shard: str | tuple[str, ...] = "none"  # replicas' state: "none", "optimizer", "full", "auto", or one per stage
    microbatches_known: bool = True  # off: the step's count is unknown (full is then not refused for too few)
    choose_microbatches: bool = False  # a synchronous schedule's step search may cut the minibatch (batch x
    # num_microbatches) into any count dividing it (pdcompile.plan.plan_step), else num_microbatches
    tensor_parallel: int | str = 1  # ranks each stage is split across (planner/tensor.py), or "auto": planned
    shard_full: bool = True  # shard="auto" may give a stage "full" (FSDP2); off where the stages are split by
    # tensor parallelism (partition_dp.plan_tensor_parallel at t > 1): the runtime shards a split stage's replicas
    # with ZeRO-1 only (passes/schedule.py refuses "full" there)
    # What the step search (pdcompile.plan.plan_step) charges besides the chain's costs, as simulate() of the
    # compiled pipeline and schedule="auto" charge it (pdcompile.api sets both; docs/reading-a-plan.md):
    update_bandwidth: float | None = None  # bytes/s the optimizer step and weight copies stream; None: the
    # cluster's analytic figure (simulate.update_bandwidth_of), else this machine's calibrated one
    action_overhead_s: tuple[tuple[str, float], ...] = ()  # the runtime's fixed seconds per action kind
    # (machine_cache.action_cost, as (kind, seconds) pairs; a mapping is accepted), () none
    collective: tuple[float, float] | None = None  # the runtime's all-reduce on this host, (fixed s, bytes/s):
    # a local cluster's calibration (ActionCost.collective; simulate.collective_s), None: the ring at the link
    corun: tuple[tuple[int, float], ...] = ()  # this machine's co-running slowdowns, (processes computing at
    # once, factor) pairs (OpCostTable.corun; a mapping is accepted): a local CPU cluster's calibration
    # (pdcompile.api.corun_of), charged while ranks compute side by side (simulate.shared_cores), () none
    wake_s: float = 0.0  # this host's wait of a process woken while the others hold every core (ActionCost.wake;
    # calibrate_link.measure_wake): charged on a local cluster of more workers than cores (simulate.shared_cores)
    also_rate: tuple[tuple[tuple[int, int, tuple[int, ...]], ...], ...] = ()  # plans the step search rates beside
    # its own at each microbatch count it tries, each as its stages' (first layer, last layer, ranks) on the whole
    # cluster: pdcompile() re-planning at the count it chose keeps the plan it chose there (pdcompile.api)

    def __post_init__(self) -> None:
        if isinstance(self.shard, list):  # a list per stage is kept as a tuple: the options stay hashable
            object.__setattr__(self, "shard", tuple(self.shard))
        if isinstance(self.action_overhead_s, Mapping):  # kept as sorted pairs: hashable, deterministic
            object.__setattr__(self, "action_overhead_s",
                               tuple(sorted((str(k), float(v)) for k, v in self.action_overhead_s.items())))
        if isinstance(self.corun, Mapping):
            object.__setattr__(self, "corun", tuple(sorted((int(k), float(v)) for k, v in self.corun.items())))

    @property
    def overhead_s(self) -> dict[str, float]:
        """``action_overhead_s`` as the simulator takes it (action kind -> seconds)."""
        return dict(self.action_overhead_s)

    def __str__(self) -> str:
        def show(v: Any) -> str:
            if isinstance(v, tuple) and not v:
                return "none"
            return ",".join(f"{x[0]}:{x[1]:g}" if isinstance(x, tuple) else str(x) for x in v) \
                if isinstance(v, tuple) else str(v)

        def plans(v: Any) -> str:  # each plan as its stages' layers and ranks: 0-5@0,1/6-11@2
            return ";".join("/".join(f"{a}-{b}@{','.join(map(str, r))}" for a, b, r in p) for p in v) or "none"

        return " ".join(f"{f.name}={(plans if f.name == 'also_rate' else show)(getattr(self, f.name))}"
                        for f in dataclasses.fields(self))

    @property
    def step_microbatches(self) -> int | None:
        """The step's microbatch count where it is known (given, and ``microbatches_known``), else None:
        what caps a replica's in-flight count (``MemoryModel.of``) and what ``full`` needs one per replica of
        (``with_shard``, ``PlanModel``'s shard checks: an unknown count does not refuse it)."""
        return self.num_microbatches if self.microbatches_known else None

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    def with_(self, overrides: Mapping[str, Any]) -> PlanOptions:
        """These options with ``overrides`` (keyword options of the entry points); an unknown name is a
        UsageError listing the known ones."""
        if not overrides:
            return self
        bad = sorted(set(overrides) - set(self.names()))
        if bad:
            raise UsageError(f"unknown planning option(s) {bad}; use {sorted(self.names())}")
        return dataclasses.replace(self, **overrides)


def plan_options(options: PlanOptions | None, overrides: Mapping[str, Any]) -> PlanOptions:
    """``options`` (default: :class:`PlanOptions`'s defaults) with keyword ``overrides``."""
    return (options if options is not None else PlanOptions()).with_(overrides)
