"""Sharding a replicated stage's state over its replicas (``shard=``): the option, the modes a stage
may take, and what each mode holds per replica.

``none``: every replica holds the stage's weights, gradients and optimizer state whole. ``optimizer``
(ZeRO-1, the runtime's ``ZeroRedundancyOptimizer``): gradients all-reduced as with ``none``, each
replica keeps and steps 1/r of the optimizer state, then the updated parameters are broadcast.
``full`` (FSDP2 ``fully_shard``, ``reshard_after_forward`` off as torchtitan runs it under a
pipeline): parameters, gradients and optimizer state are 1/r per replica; the parameters are gathered
at the step's first forward and kept until its last backward, which alone reduce-scatters the
gradients (they accumulate unsharded until then). ``full`` needs one weight version (a stashed
version is a whole copy: 1F1B, 2BW refuse it) and a microbatch per replica each step; ``runtime/shard.py``
refuses the same. A stage of one replica has nothing to shard: ``none``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pdcompile.errors import UsageError
from pdcompile.plan_data import SHARD_MODES
from pdcompile.runtime.schedules import registry as schedule_registry

__all__ = ["SHARD_MODES", "SHARD_OPTIONS", "check_option", "comm_factors", "full_refusal", "resolve", "weight_factors"]

#: what ``shard=`` takes: a mode for every replicated stage, or ``auto`` (the planner chooses per stage)
SHARD_OPTIONS = (*SHARD_MODES, "auto")


def check_option(value: Any, where: str = "pdcompile") -> str | tuple[str, ...]:
    """``shard=`` checked: one of :data:`SHARD_OPTIONS`, or a list of them (one per stage)."""
    if isinstance(value, str):
        if value not in SHARD_OPTIONS:
            raise UsageError(f"{where}: shard must be one of {', '.join(map(repr, SHARD_OPTIONS))} or a list of "
                             f"them per stage, got {value!r}")
        return value
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) for v in value):
        bad = [v for v in value if v not in SHARD_OPTIONS]
        if bad:
            raise UsageError(f"{where}: shard={list(value)} names {bad[0]!r}; each stage's mode is one of "
                             f"{', '.join(map(repr, SHARD_OPTIONS))}")
        return tuple(value)
    raise UsageError(f"{where}: shard must be one of {', '.join(map(repr, SHARD_OPTIONS))} or a non-empty list of "
                     f"them per stage, got {value!r}")


def full_refusal(schedule: str, replicas: int, num_microbatches: int | None) -> str | None:
    """Why a stage of ``replicas`` replicas cannot run ``full`` under ``schedule`` (None: it can;
    ``num_microbatches`` None: not known, not checked)."""
    pol = schedule_registry.policy(schedule)
    if pol.version_lag != 0:
        return (f"schedule {schedule!r} keeps stashed weight versions, each a whole copy of the stage: "
                f"use shard='optimizer' (optimizer state only) or a synchronous schedule (flush, gpipe, zb-h1, ...)")
    if num_microbatches is not None and num_microbatches < replicas:
        return (f"a step has {num_microbatches} microbatches for {replicas} replicas, and a replica without one "
                f"would miss the step's reduce-scatter: give at least {replicas} microbatches")
    return None


def allowed(shard: str, replicas: int, schedule: str, num_microbatches: int | None) -> tuple[str, ...]:
    """The modes a stage of ``replicas`` replicas may take under the option ``shard`` (one mode or
    ``auto``), cheapest first: one replica, ``none``; ``auto`` leaves out ``full`` where it cannot run."""
    if replicas <= 1 or shard == "none":
        return ("none",)
    if shard != "auto":
        return (shard,)
    ok = full_refusal(schedule, replicas, num_microbatches) is None
    return ("none", "full", "optimizer") if ok else ("none", "optimizer")


def resolve(replicas: Sequence[int], shard: str | Sequence[str], schedule: str, num_microbatches: int | None,
            planned: Sequence[str] | None = None) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Each stage's mode for the option ``shard`` on stages of these ``replicas`` (``auto``: the
    planner's choice, ``planned``, else ``none``), and notes on what the option left unsharded. A mode a stage
    cannot run is a :class:`UsageError`: a list naming a mode for a stage of one replica, ``full``
    with weight stashing or fewer microbatches than replicas."""
    n = len(replicas)
    if isinstance(shard, str):
        asked: tuple[str, ...] = (shard,) * n
    else:
        asked = tuple(shard)
        if len(asked) != n:
            raise UsageError(f"shard={list(asked)} names {len(asked)} stages but the plan has {n}; give one mode "
                             f"per stage, or one mode (or 'auto') for all")
    modes: list[str] = []
    alone: list[str] = []
    for k, (mode, r) in enumerate(zip(asked, replicas)):
        if mode == "auto":
            mode = planned[k] if planned is not None else "none"
        if mode != "none" and r <= 1:
            if not isinstance(shard, str):
                raise UsageError(f"shard={list(asked)}: stage {k} has one replica, so there is nothing to shard "
                                 f"'{mode}' over; give 'none' for it (or replicate it)")
            alone.append(str(k))
            mode = "none"
        if mode == "full":
            why = full_refusal(schedule, r, num_microbatches)
            if why is not None:
                raise UsageError(f"shard='full' on stage {k} ({r} replicas): {why}")
        modes.append(mode)
    notes: tuple[str, ...] = ()
    if alone:
        which = f"stage {alone[0]} has" if len(alone) == 1 else f"stages {', '.join(alone)} have"
        notes = (f"shard='{shard}': {which} one replica and run{'s' if len(alone) == 1 else ''} unsharded",)
    return tuple(modes), notes


def weight_factors(mode: str, replicas: int, versions: int, optimizer_state_factor: float) -> tuple[float, float]:
    """(bytes per weight byte before the step's first backward, the extra once gradients exist) that a
    replica of a stage holds under ``mode`` with ``versions`` weight versions:

    - ``none``: ``versions + f`` and ``+1`` (gradients);
    - ``optimizer``: ``versions + f / r`` and ``+1``;
    - ``full``: ``1 + (1 + f) / r`` (the gathered working copy, the replica's shard of the parameters
      and of the optimizer state) and ``+1`` (the gradients accumulate unsharded until the step's last
      backward reduce-scatters them; the 1/r sharded gradients replace them after it).
    """
    r = max(1, replicas)
    f = optimizer_state_factor
    if mode == "none" or r == 1:
        return versions + f, 1.0
    if mode == "optimizer":
        return versions + f / r, 1.0
    if mode == "full":
        return 1.0 + (1.0 + f) / r, 1.0
    raise ValueError(f"unknown shard mode {mode!r}")


def comm_factors(mode: str) -> tuple[float, float]:
    """(overlapped, exposed): what a replicated stage's replicas move per step under ``mode``, each in
    units of the data-parallel all-reduce's time ``AR`` (a ring moves ``2 (r-1)/r W``): the part the
    cost model overlaps with the backward as it does ``AR``, and the part no compute can hide.

    - ``none``: ``AR`` after the backwards (1, 0);
    - ``optimizer`` (``ZeroRedundancyOptimizer``): ``AR``, then after the step each owner broadcasts its
      updated parameters, ``(r-1)/r W`` received per replica, before the next forward can use them
      (1, 1/2): 1.5 ``AR``'s bytes;
    - ``full`` (FSDP2): the parameters all-gathered at the step's first forward, before any compute
      (exposed, ``(r-1)/r W``), the gradients reduce-scattered once in the last backward (``(r-1)/r W``,
      overlapped as ``AR`` is) (1/2, 1/2): ``AR``'s bytes, half of them exposed.

    A stage's time is then ``F + max(Bw, overlapped AR) + exposed AR + OPT`` (``default``), ``max(C,
    overlapped comm) + exposed comm`` (``paper``), over its replicas (planner/costs.py)."""
    if mode == "none":
        return 1.0, 0.0
    if mode == "optimizer":
        return 1.0, 0.5
    if mode == "full":
        return 0.5, 0.5
    raise ValueError(f"unknown shard mode {mode!r}")


def describe(plan: Any, shard: str | Sequence[str]) -> list[str]:
    """``explain()``'s lines on sharding: each replicated stage's mode, and the rule that chose it (the
    planner's reasons, a stage's memory under the modes, are the plan's notes)."""
    reps = [st for st in plan.stages if st.replicas > 1]
    if not reps:
        return []
    rule = ("per stage, of the modes and recomputations that fit, the fastest (none: the all-reduce, overlapped "
            "with the backward; full (FSDP2): the same bytes, half of them, the all-gather before the first "
            "forward, exposed; optimizer (ZeRO-1): the all-reduce and the updated weights' broadcast, exposed), "
            "ties to none, full, optimizer" if shard == "auto" else "as asked")
    lines = ["", f"sharding (shard={shard if isinstance(shard, str) else list(shard)!r}): {rule}"]
    for st in reps:
        lines.append(f"  stage {st.index} (x{st.replicas}): {st.shard}")
    return lines


def untie(plan: Any, tied_stages: set[int], shard: str | Sequence[str]) -> Any:
    """``plan`` with no ``full`` stage among ``tied_stages`` (stages holding a parameter tied across
    stages, whose gradients are summed outside FSDP2, which the runtime refuses): ``auto`` gives such a
    stage ``optimizer`` instead (it needs less memory than ``full``, but moves more: the plan's time,
    rated with ``full``, is then a little low), with a note; a ``full`` asked for one is a
    :class:`UsageError` naming the fix."""
    from dataclasses import replace

    hit = [st for st in plan.stages if st.index in tied_stages and st.shard == "full"]
    if not hit:
        return plan
    asked = [shard] * len(plan.stages) if isinstance(shard, str) else list(shard)
    forced = [st.index for st in hit if asked[st.index] == "full"]
    if forced:
        raise UsageError(f"shard='full' on stage {forced[0]}, which holds a parameter tied to another stage's (its "
                         f"gradient is summed across stages, outside FSDP2): give shard='optimizer' or 'none' for it")
    stages = tuple(replace(st, shard="optimizer") if st in hit else st for st in plan.stages)
    note = (f"shard: stage{'s' if len(hit) > 1 else ''} {', '.join(str(st.index) for st in hit)} hold{'' if len(hit) > 1 else 's'} "
            f"a parameter tied across stages, which FSDP2 cannot shard: optimizer (ZeRO-1) instead of full (the "
            f"memory column keeps full's bytes, a bound)")
    return replace(plan, stages=stages, notes=(*plan.notes, note))
