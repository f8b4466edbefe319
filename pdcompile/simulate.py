"""Predict a pipeline run: replay a schedule's actions with the cost model.

The design in full: :func:`simulate`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from pdcompile.cluster import LOOPBACK_BANDWIDTH
from pdcompile.errors import UsageError
from pdcompile.passes.costs.roofline import weight_copy_s
from pdcompile.passes.planner.decisions import Recompute, stage_decisions
from pdcompile.passes.planner.options import PlanOptions
from pdcompile.runtime.schedules import (
    Action,
    Kind,
    Placement,
    Schedule,
    live_versions,
    make_schedule,
    version_copies,
    rank_of,
    replay,
    layout,
    stage_ranks,
)
from pdcompile.simulate_step import (  # the end of a stage's step, kept importable from here
    collective_s as collective_s,
    ring_allreduce_s as ring_allreduce_s,
    stage_param_tensors as stage_param_tensors,
    stage_step_s as stage_step_s,
    tensor_costs as tensor_costs,
    update_bandwidth_of as update_bandwidth_of,
)
from pdcompile.simulate_cores import shared_cores
from pdcompile.timeline import Event, category_of

SendCost = Callable[[int, int, int, int], Any]  # (stage_from, stage_to, rank_a, rank_b) -> seconds

# A split backward's parts as shares of the whole backward, as the runtime computes them (measured on
# the benchmark models' second stages, CPU, one thread: input gradients 0.53 (VGG) - 0.74 (GPT) of
# an unsplit backward, the per-submodule weight pass 0.56 (GPT) - 0.64 (VGG); together a little
# more than one backward: two engine calls, and the input pass also hands back submodule outputs'
# gradients).
INPUT_GRAD_SHARE = 0.6
WEIGHT_GRAD_SHARE = 0.6


@dataclass(frozen=True)
class SimResult:
    """What :func:`simulate` predicts. Times in seconds; per-stage lists are indexed by stage.

    * ``makespan_s``: from the first action to the last, for the whole schedule;
      ``step_time_s = makespan_s / num_steps``; ``time_per_microbatch_s = makespan_s / num_microbatches``.
    * ``throughput``: ``num_microbatches * microbatch_size / makespan_s`` (samples/s; microbatches/s
      when ``microbatch_size`` is 1).
    * ``busy[r]``: seconds rank ``r`` computes (F, B, ST) or is held by communication (AR, TG,
      blocking sends); ``utilization[r]``: compute seconds / makespan; ``bubble_fraction``:
      ``1 - sum(busy) / (ranks * makespan)``, the idle share of all ranks' time.
    * ``peak_in_flight[s]``: most microbatches whose activations a replica of stage ``s`` holds
      (F done, B not; W not, for a split backward); ``peak_weight_versions[s]``: most weight versions alive on a replica
      (:func:`~pdcompile.runtime.schedules.live_versions`); ``peak_memory_bytes[s]``, when sizes were
      given: ``static + activation * in_flight + weights * versions`` at the worst point.
    """

    makespan_s: Any
    num_microbatches: int
    num_steps: int
    microbatch_size: int
    step_time_s: Any
    time_per_microbatch_s: Any
    throughput: Any
    bubble_fraction: Any
    busy: dict[int, Any]
    utilization: dict[int, Any]
    stage_of_rank: dict[int, int]
    peak_in_flight: list[int]
    peak_weight_versions: list[int]
    peak_memory_bytes: list[Any] | None
    events: list[Event]
    # per stage: most microbatches in flight after a forward (or before the ST) while the stage holds
    # weight gradients (from its first gradient-making B, or W for a split one, to its ST, which
    # frees them); a schedule that runs every forward of a stage before its first backward (looped
    # BFS, interleaved 1F1B's first stage) peaks without them
    peak_in_flight_with_grads: list[int] = field(default_factory=list)
    # per stage: most microbatches in flight (the backward's own included) when a backward starts
    # while the stage holds weight gradients: where a recomputing stage rebuilds a microbatch beside
    # them (looped BFS's and a V's stages run their later backwards back to back)
    peak_in_flight_at_rebuild: list[int] = field(default_factory=list)

    @property
    def num_stages(self) -> int:
        return len(self.peak_in_flight)

    def stage_utilization(self) -> list[Any]:
        """Mean utilization of each stage's replicas."""
        out = []
        for s in range(self.num_stages):
            us = [u for r, u in self.utilization.items() if self.stage_of_rank[r] == s]
            out.append(sum(us) / len(us) if us else 0)
        return out

    def summary(self) -> str:
        """A few lines for people: step time, throughput, bubble, and a row per stage."""
        lines = [
            f"makespan {float(self.makespan_s):.6g} s for {self.num_microbatches} microbatches "
            f"({self.num_steps} step{'s' if self.num_steps != 1 else ''}): step {float(self.step_time_s):.6g} s, "
            f"{float(self.throughput):.6g} samples/s, bubble {float(self.bubble_fraction):.1%}",
            "stage  ranks        util   in-flight  versions" + ("  peak memory" if self.peak_memory_bytes else ""),
        ]
        util = self.stage_utilization()
        for s in range(self.num_stages):
            ranks = [r for r in sorted(self.stage_of_rank) if self.stage_of_rank[r] == s]
            mem = f"  {float(self.peak_memory_bytes[s]) / 2**20:10.1f} MiB" if self.peak_memory_bytes else ""
            lines.append(f"{s:5d}  {','.join(map(str, ranks)):<11} {float(util[s]):5.1%}  "
                         f"{self.peak_in_flight[s]:9d}  {self.peak_weight_versions[s]:8d}{mem}")
        return "\n".join(lines)


def _infer_replicas(sched: Schedule) -> list[int]:
    stages: dict[int, int] = {}
    for rank in sorted(sched):
        acts = sched[rank]
        if not acts:
            raise UsageError(f"rank {rank} has no actions, so its stage is unknown: pass replicas=")
        stages[rank] = acts[0].stage
    reps: list[int] = []
    for rank in sorted(stages):
        s = stages[rank]
        if s == len(reps):
            reps.append(1)
        elif s == len(reps) - 1:
            reps[-1] += 1
        else:
            raise UsageError(f"rank {rank} runs stage {s}: ranks must be assigned stage by stage; pass replicas=")
    return reps


def _per_stage(name: str, values: Sequence[Any] | None, num_stages: int, default: Any = 0) -> list[Any]:
    if values is None:
        return [default] * num_stages
    if isinstance(values, (int, float)) or not isinstance(values, Sequence):
        return [values] * num_stages  # type: ignore[list-item]  # a scalar broadcast to every stage
    if len(values) != num_stages:
        raise UsageError(f"{name} has {len(values)} values, the schedule has {num_stages} stages")
    return list(values)


def simulate(sched: Schedule, *, forward_s: Sequence[Any], backward_s: Sequence[Any],
             replicas: Sequence[int] | None = None,
             send_s: SendCost | Any | None = None,
             boundary_bytes: Sequence[Any] | None = None,
             bandwidth: Callable[[int, int], Any] | Any | None = None,
             latency_s: Any = 0,
             allreduce_s: Sequence[Any] | None = None,
             step_s: Sequence[Any] | None = None,
             version_s: Sequence[Any] | None = None,
             input_grad_s: Sequence[Any] | None = None,
             weight_grad_s: Sequence[Any] | None = None,
             tied_s: Any = 0,
             tied_stages: Sequence[int] | None = None,
             overhead_s: Mapping[str, Any] | Any = 0,
             overlap_comm: bool = True,
             recv_progress: str = "background",
             microbatch_size: int = 1,
             num_steps: int = 1,
             activation_bytes: Sequence[Any] | None = None,
             weight_bytes: Sequence[Any] | None = None,
             static_bytes: Sequence[Any] | None = None,
             placement: Placement | None = None, timeline: bool = True) -> SimResult:
    """Replay ``sched`` with the cost model (see the module docstring) and predict its run.

    Per-stage arguments (``forward_s``, ``backward_s``, ``allreduce_s``, ``step_s``,
    ``activation_bytes`` per microbatch in flight, ``weight_bytes`` per weight version,
    ``static_bytes`` e.g. optimizer state) are sequences indexed by stage; a single number applies
    to every stage. Transfer time: ``send_s`` (a number, or a function of
    ``(stage_from, stage_to, rank_a, rank_b)``), else ``boundary_bytes[b] / bandwidth + latency_s``
    (``bandwidth`` in bytes/s: a number or a function of ``(rank_a, rank_b)``), else free.
    ``replicas`` is inferred from the schedule when omitted. ``placement`` (ranks per stage) lets a
    rank run several stages, each at its own costs; a transfer between two stages of one rank is
    free (a hand-over in memory); ``stage_of_rank`` then names a rank's first stage. Raises
    :class:`~pdcompile.errors.ScheduleError` if the schedule deadlocks.

    The design, in full (moved from the module docstring):

    Pure Python over the schedule data (:mod:`pdcompile.runtime.schedules`); no torch. The model:

    * every rank runs its actions in order, one at a time;
    * ``F``/``B``/``ST`` of stage ``s`` take ``forward_s[s]``/``backward_s[s]``/``step_s[s]`` seconds
      (per microbatch); a split backward (a ``W k`` follows ``B k`` on the rank) costs
      ``input_grad_s[s]`` for its ``B`` and ``weight_grad_s[s]`` for its ``W`` (defaults: ``backward_s``
      and 0, i.e. as if it were not split);
    * a send (``SF``/``SB``) puts the microbatch's tensor on the directed link from the sender to the
      receiving replica (``rank_of``); a link carries one transfer at a time, in the sender's order,
      each taking ``send_s(stage_from, stage_to, rank_a, rank_b)`` (or ``boundary_bytes[b] /
      bandwidth(rank_a, rank_b) + latency_s`` for boundary ``b = min(stage_from, stage_to)``; gradients
      are as large as the activations they belong to). With ``overlap_comm`` the sender goes on
      computing while the transfer runs; without, it is busy until the transfer ends;
    * a receive (``RF``/``RB``) waits until the matching transfer has arrived. With
      ``recv_progress="on_wait"`` a transfer that would have arrived while the receiver was busy is taken
      off the link only once the receiver waits for it (it then takes its transfer time from there): what
      gloo does on CPU when every core runs a stage's compute, because the receiving process's I/O
      thread gets no core until its compute thread blocks. With ``recv_progress="both_wait"`` a
      transfer's bytes move only while both its sender and its receiver are idle or waiting (neither runs
      an action, a collective, a blocking send or an action's overhead): it starts when sent (and the link is
      free) and arrives once the two have been idle together for its transfer time, so one sent before the
      sender's long forward arrives only after that forward. It is found by iteration: each pass takes the
      ranks' busy intervals from the previous one (the first assumes ``"background"``) until the
      arrivals repeat (at most 100 passes). It needs ``overlap_comm`` (the sender's share of the transfer
      is its idle time). It is the strict reading of gloo traces with every core running a stage (a send
      posted while its sender computes arriving once the sender waits); most transfers there move sooner,
      so there it over-predicts waits (``benchmarks/RESULTS.md``, bench_predicted_vs_measured, compares
      it with ``"on_wait"``). The default, ``"background"``, overlaps fully;
    * ``AR`` starts when all replicas of the stage have reached it and takes ``allreduce_s[s]``;
      ``TG`` likewise across the ranks of ``tied_stages`` (every rank when not given; a rank of another
      stage passes its ``TG`` at no cost, as the runtime's tied-gradient group leaves it out) and takes
      ``tied_s``; neither overlaps compute;
    * ``WV`` costs nothing; with ``version_s`` (seconds to copy stage ``s``'s weights once), weight
      stashing costs what the runtime's versioned store copies
      (:func:`~pdcompile.runtime.schedules.version_copies`): a clone before an ``ST`` whose version must
      outlive it, and the gradient hand-over after the ``B`` of a microbatch that ran on a clone;
    * ``overhead_s`` (optional) adds a fixed cost per action kind — the runtime's dispatch, posting a
      transfer, the loss on the last stage — to the rank that runs it (a number for every kind, or a
      mapping from the kind's code, ``"F"``, ``"SF"``, ``"ST"``, ... to seconds). It is measured, not
      guessed: see ``benchmarks/bench_predicted_vs_measured.py``.

    The result (:class:`SimResult`) has the makespan, the step time, throughput, bubble fraction,
    per-rank utilization, per-stage peak memory (microbatches in flight, weight versions, bytes when
    sizes are given) and the timeline events (:class:`pdcompile.timeline.Event`).

    Numbers are never converted: pass :class:`fractions.Fraction` costs and the times come back exact.

    ``timeline=False``: no timeline (``SimResult.events`` empty), the rest the same, replayed by
    :func:`pdcompile.simulate_fast.replay` where it applies (one stage per rank, not ``"both_wait"``).
    """
    if placement is not None and replicas is None:
        raise UsageError("placement= needs replicas=")
    reps = list(replicas) if replicas is not None else _infer_replicas(sched)
    ranks = stage_ranks(reps, placement)
    S = len(reps)
    fwd = _per_stage("forward_s", forward_s, S)
    bwd = _per_stage("backward_s", backward_s, S)
    ar = _per_stage("allreduce_s", allreduce_s, S)
    st = _per_stage("step_s", step_s, S)
    ver = _per_stage("version_s", version_s, S)
    b_in = bwd if input_grad_s is None else _per_stage("input_grad_s", input_grad_s, S)
    b_w = _per_stage("weight_grad_s", weight_grad_s, S)
    stage_of: dict[int, int] = {}
    for s_, rs in enumerate(ranks):
        for r_ in rs:
            stage_of.setdefault(r_, s_)
    tg_stages = set(range(S)) if tied_stages is None else set(tied_stages)
    if not tg_stages <= set(range(S)):
        raise UsageError(f"tied_stages {sorted(tied_stages or ())} name stages the schedule lacks (it has {S})")
    kinds = {k.value for k in Kind}
    if isinstance(overhead_s, Mapping):
        unknown = set(overhead_s) - kinds
        if unknown:
            raise UsageError(f"overhead_s has unknown action kinds {sorted(unknown)}; use {sorted(kinds)}")
        over = {k: overhead_s.get(k, 0) for k in kinds}
    else:
        over = dict.fromkeys(kinds, overhead_s)
    if recv_progress not in ("background", "on_wait", "both_wait"):
        raise UsageError(f"recv_progress={recv_progress!r}: use 'background', 'on_wait' or 'both_wait'")
    if recv_progress == "both_wait" and not overlap_comm:
        raise UsageError("recv_progress='both_wait' moves bytes only while the sender waits: it needs overlap_comm=True")
    if set(sched) != set(stage_of):
        raise UsageError(f"the schedule has ranks {sorted(sched)}, replicas {reps} give {sorted(stage_of)}")

    if callable(send_s):
        transfer: SendCost = send_s
    elif send_s is not None:
        transfer = lambda sa, sb, ra, rb: send_s  # noqa: E731
    elif boundary_bytes is not None:
        nbytes = _per_stage("boundary_bytes", boundary_bytes, max(S - 1, 0))
        if bandwidth is None:
            raise UsageError("boundary_bytes needs bandwidth= (bytes/s, a number or a function of two ranks)")
        bw = bandwidth if callable(bandwidth) else (lambda ra, rb: bandwidth)
        transfer = lambda sa, sb, ra, rb: nbytes[min(sa, sb)] / bw(ra, rb) + latency_s  # noqa: E731
    else:
        transfer = lambda sa, sb, ra, rb: 0  # noqa: E731

    if not timeline and placement is None:  # the same replay without a timeline (pdcompile/simulate_fast.py)
        from pdcompile.simulate_fast import replay as fast_replay
        fast = fast_replay(sched, reps, fwd=fwd, bwd=bwd, input_grad=b_in, weight_grad=b_w, step=st, allreduce=ar,
                           version=ver if version_s is not None else None, tied_s=tied_s, tied_stages=tg_stages,
                           overhead=over, transfer=transfer, overlap_comm=overlap_comm, recv_progress=recv_progress,
                           activation_bytes=_per_stage("activation_bytes", activation_bytes, S, None),
                           weight_bytes=_per_stage("weight_bytes", weight_bytes, S, None),
                           static_bytes=_per_stage("static_bytes", static_bytes, S, None),
                           sized=activation_bytes is not None or weight_bytes is not None or static_bytes is not None)
        if fast is not None:
            m_ = fast.makespan_s
            return _without_events(m_, fast.num_microbatches, num_steps, microbatch_size, fast.busy,
                                   {r: (c / m_ if m_ else 0) for r, c in fast.compute.items()}, stage_of,
                                   fast.peak_in_flight, fast.peak_weight_versions, fast.peak_memory_bytes,
                                   fast.peak_in_flight_with_grads, fast.peak_in_flight_at_rebuild)
    clock: dict[int, Any] = {}
    busy: dict[int, Any] = {}
    compute: dict[int, Any] = {}
    link_free: dict[tuple[int, int], Any] = {}
    arrival: dict[tuple[Kind, int, int], Any] = {}
    duration: dict[tuple[Kind, int, int], Any] = {}
    events: list[Event] = []
    # both_wait: per rank, its busy intervals (start, end) in time order, this pass's and the previous one's
    held: dict[int, list[tuple[Any, Any]]] = {}
    held_before: dict[int, list[tuple[Any, Any]]] | None = None

    def hold(r: int, start: Any, end: Any) -> None:
        if end > start:
            held[r].append((start, end))

    def both_idle(ra: int, rb: int, start: Any, need: Any) -> Any:
        """When ``ra`` and ``rb`` (the previous pass's busy intervals) have been idle together for
        ``need`` seconds from ``start``."""
        if held_before is None:
            return start + need
        t, left = start, need
        for a, b in sorted(held_before[ra] + held_before[rb]):
            if b <= t:
                continue
            if a > t:
                if a - t >= left:
                    return t + left
                left -= a - t
            t = b
        return t + left

    copies = {r: version_copies(acts) if version_s is not None else [0] * len(acts) for r, acts in sched.items()}
    split = {r: {(a.stage, a.microbatch) for a in acts if a.kind is Kind.WEIGHT_GRAD}  # per stage: virtual ones
             for r, acts in sched.items()}

    def execute(parts: list[tuple[int, int]], a: Action) -> None:
        if a.kind in (Kind.ALLREDUCE, Kind.TIED_GRADS):
            if a.kind is Kind.TIED_GRADS:
                parts = [(q, i) for q, i in parts if stage_of[q] in tg_stages]
            if not parts:
                return
            start = max(clock[q] for q, _ in parts)
            dur = (ar[a.stage] if a.kind is Kind.ALLREDUCE else tied_s) + over[a.kind.value]
            for q, _ in parts:
                name = f"{stage_of[q]}{a.kind.value}"
                events.append(Event(q, name, start, start + dur, category_of(name)))
                clock[q] = start + dur
                busy[q] += dur
                hold(q, start, start + dur)
            return
        (r, _), name = parts[0], str(a)
        if over[a.kind.value]:  # the runtime's fixed cost of running this action
            busy[r] += over[a.kind.value]
            hold(r, clock[r], clock[r] + over[a.kind.value])
            clock[r] += over[a.kind.value]
        t = clock[r]
        if a.kind in (Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT_GRAD, Kind.STEP):
            if a.kind is Kind.BACKWARD and (a.stage, a.microbatch) in split[r]:
                dur = b_in[a.stage]
            else:
                dur = {Kind.FORWARD: fwd, Kind.BACKWARD: bwd, Kind.WEIGHT_GRAD: b_w, Kind.STEP: st}[a.kind][a.stage]
            if copies[r][parts[0][1]]:
                dur = dur + ver[a.stage] * copies[r][parts[0][1]]
            events.append(Event(r, name, t, t + dur, category_of(name)))
            clock[r] = t + dur
            busy[r] += dur
            compute[r] += dur
            hold(r, t, t + dur)
        elif a.kind in (Kind.SEND_ACT, Kind.SEND_GRAD):
            dst = a.stage + 1 if a.kind is Kind.SEND_ACT else a.stage - 1
            peer = rank_of(dst, a.mb, ranks)
            start = max(t, link_free.get((r, peer), t))
            if peer == r:  # one rank's stages: no link
                end = t
            elif recv_progress == "both_wait":
                end = both_idle(r, peer, start, transfer(a.stage, dst, r, peer))
            else:
                end = start + transfer(a.stage, dst, r, peer)
            if peer != r:
                link_free[(r, peer)] = end
            arrival[(a.kind, a.stage, a.mb)] = end
            duration[(a.kind, a.stage, a.mb)] = end - start
            if overlap_comm:
                events.append(Event(r, name, t, t, "send"))
                if end > start:
                    events.append(Event(r, name, start, end, "transfer"))
            else:
                events.append(Event(r, name, t, end, "send"))
                busy[r] += end - t
                hold(r, t, end)
                clock[r] = end
        elif a.kind in (Kind.RECV_ACT, Kind.RECV_GRAD):
            src = a.stage - 1 if a.kind is Kind.RECV_ACT else a.stage + 1
            send_kind = Kind.SEND_ACT if a.kind is Kind.RECV_ACT else Kind.SEND_GRAD
            key = (send_kind, src, a.microbatch)
            end = max(t, arrival[key])  # type: ignore[index]  # keys of sends, filled before their receives
            if recv_progress == "on_wait":
                end = max(end, t + duration[key])  # type: ignore[index]  # keys of sends, filled before their receives
            events.append(Event(r, name, t, end, "recv"))
            clock[r] = end
        # WV: bookkeeping only

    for _ in range(100 if recv_progress == "both_wait" else 1):
        before = dict(arrival)
        clock.update({r: 0 for r in sched})
        busy.update({r: 0 for r in sched})
        compute.update({r: 0 for r in sched})
        held.update({r: [] for r in sched})
        link_free.clear()
        arrival.clear()
        duration.clear()
        events.clear()
        replay(sched, reps, execute, name="simulated schedule", placement=placement)
        if arrival == before:
            break
        held_before = {r: list(iv) for r, iv in held.items()}

    makespan = max([0, *clock.values(), *arrival.values()])
    T = len({a.microbatch for acts in sched.values() for a in acts if a.kind is Kind.FORWARD})
    R = len(sched)
    util = {r: (compute[r] / makespan if makespan else 0) for r in sorted(sched)}
    bubble = 1 - sum(busy.values()) / (R * makespan) if makespan else 0

    # memory: walk each rank's actions (in-flight and live versions change only at its actions)
    act_b = _per_stage("activation_bytes", activation_bytes, S, None)
    w_b = _per_stage("weight_bytes", weight_bytes, S, None)
    static_b = _per_stage("static_bytes", static_bytes, S, None)
    sized = activation_bytes is not None or weight_bytes is not None or static_bytes is not None
    peak_in = [0] * S
    peak_v = [0] * S
    peak_mem: list[Any] = [0] * S
    views = [(r, s_, [a for a in acts if a.stage == s_] if placement is not None else acts)
             for r, acts in sched.items() for s_ in ({a.stage for a in acts} if placement is not None else {stage_of[r]})]
    peak_grads = [0] * S
    peak_rebuild = [0] * S
    for r, s, acts in views:
        n = 0
        grads = False
        live = live_versions(acts)
        peak_v[s] = max(peak_v[s], max((len(x) for x in live), default=1))
        for a, versions in zip(acts, live or []):
            frees = Kind.WEIGHT_GRAD if (a.stage, a.microbatch) in split[r] else Kind.BACKWARD  # split: at its W
            if grads and a.kind is Kind.BACKWARD:  # the meter's point at a rebuild: before B frees its microbatch
                peak_rebuild[s] = max(peak_rebuild[s], n)
            n += (a.kind is Kind.FORWARD) - (a.kind is frees)
            peak_in[s] = max(peak_in[s], n)
            if grads and a.kind in (Kind.FORWARD, Kind.STEP):  # the meter's points: after F, before ST
                peak_grads[s] = max(peak_grads[s], n)
            grads = (grads or a.kind is frees) and a.kind is not Kind.STEP
            if sized:
                mem = (static_b[s] or 0) + (act_b[s] or 0) * n + (w_b[s] or 0) * len(versions)
                peak_mem[s] = max(peak_mem[s], mem)
        if sized and not acts:
            peak_mem[s] = max(peak_mem[s], (static_b[s] or 0) + (w_b[s] or 0))

    return SimResult(
        makespan_s=makespan, num_microbatches=T, num_steps=num_steps, microbatch_size=microbatch_size,
        step_time_s=makespan / num_steps, time_per_microbatch_s=(makespan / T if T else 0),
        throughput=(T * microbatch_size / makespan if makespan else math.inf),
        bubble_fraction=bubble, busy=dict(sorted(busy.items())), utilization=util, stage_of_rank=stage_of,
        peak_in_flight=peak_in, peak_weight_versions=peak_v, peak_memory_bytes=peak_mem if sized else None,
        events=sorted(events, key=lambda e: (e.start_s, e.rank, e.end_s)), peak_in_flight_with_grads=peak_grads,
        peak_in_flight_at_rebuild=peak_rebuild,
    )


def _without_events(makespan: Any, T: int, num_steps: int, microbatch_size: int, busy: dict[int, Any],
                    utilization: dict[int, Any], stage_of: dict[int, int], *peaks: Any) -> SimResult:
    """A :class:`SimResult` with no timeline from a replay's makespan, per-rank figures and per-stage peaks."""
    R = len(busy)
    return SimResult(
        makespan_s=makespan, num_microbatches=T, num_steps=num_steps, microbatch_size=microbatch_size,
        step_time_s=makespan / num_steps, time_per_microbatch_s=(makespan / T if T else 0),
        throughput=(T * microbatch_size / makespan if makespan else math.inf),
        bubble_fraction=1 - sum(busy.values()) / (R * makespan) if makespan else 0, busy=dict(sorted(busy.items())),
        utilization=dict(sorted(utilization.items())), stage_of_rank=stage_of,
        peak_in_flight=peaks[0], peak_weight_versions=peaks[1], peak_memory_bytes=peaks[2], events=[],
        peak_in_flight_with_grads=peaks[3], peak_in_flight_at_rebuild=peaks[4])


def simulate_schedule(name: str, replicas: Sequence[int], num_microbatches: int, *, num_steps: int = 1,
                      vertical_sync: bool = False, tied: bool = False, split_backward: bool = True,
                      virtual_stages: int = 1, timeline: bool = True, **costs: Any) -> SimResult:
    """Build the named schedule (:func:`~pdcompile.runtime.schedules.make_schedule`) and simulate it
    (``virtual_stages``: stages per rank, on the schedule's placement). ``timeline=False``: no timeline; where
    the pipeline splits into identical lanes (:func:`pdcompile.simulate_fast.lane_factor`) one is simulated."""
    send = costs.get("send_s")
    if not timeline and virtual_stages == 1 and costs.get("boundary_bytes") is None \
            and costs.get("recv_progress", "background") != "both_wait":
        from pdcompile.simulate_fast import lane_factor, lane_of, lane_schedule
        fixed = send if callable(send) else None if send is None else (lambda sa, sb, ra, rb: send)
        g = lane_factor(replicas, num_microbatches, num_steps, fixed)
        if g == 1:
            return simulate(lane_schedule(name, replicas, 1, num_microbatches, tied=tied, vertical_sync=vertical_sync,
                                          num_steps=num_steps, split_backward=split_backward),
                            replicas=replicas, num_steps=num_steps, timeline=False, **costs)
        else:  # one lane of g, its ranks' transfers priced as lane 0's in the whole pipeline
            red, to_full, of_full = lane_of(replicas, g)
            lane = dict(costs, send_s=(lambda sa, sb, ra, rb: send(sa, sb, to_full(ra), to_full(rb)))
                        if callable(send) else send)
            one = simulate(lane_schedule(name, replicas, g, num_microbatches, tied=tied, vertical_sync=vertical_sync,
                                         num_steps=num_steps, split_backward=split_backward),
                           replicas=red, num_steps=num_steps, timeline=False, **lane)
            stage_of = {r: s for s, rs in enumerate(stage_ranks(replicas)) for r in rs}
            return _without_events(one.makespan_s, one.num_microbatches * g, num_steps, one.microbatch_size,
                                   {r: one.busy[of_full[r]] for r in stage_of},
                                   {r: one.utilization[of_full[r]] for r in stage_of}, stage_of,
                                   one.peak_in_flight, one.peak_weight_versions, one.peak_memory_bytes,
                                   one.peak_in_flight_with_grads, one.peak_in_flight_at_rebuild)
    sched = make_schedule(name, replicas, num_microbatches, tied=tied, vertical_sync=vertical_sync,
                          num_steps=num_steps, split_backward=split_backward, virtual_stages=virtual_stages)
    lay = layout(name, replicas, num_microbatches, num_steps, virtual_stages=virtual_stages)
    placement = lay.stage_ranks if lay.policy.placement is not None else None
    return simulate(sched, replicas=replicas, num_steps=num_steps, placement=placement, timeline=timeline, **costs)


def _part(profiled: Any, backward_s: Any, share: float) -> Any:
    """One part of a layer's split backward: as profiled, else ``share`` of its backward."""
    return profiled if profiled is not None else backward_s * share


def _slowest(cluster: Any, ranks: Sequence[int]) -> float:
    """The slowest link among ``ranks`` of ``cluster`` (``ClusterSpec.slowest_bandwidth``; another object
    with ``bandwidth_between``: every pair)."""
    fast = getattr(cluster, "slowest_bandwidth", None)
    if fast is not None:
        return float(fast(ranks))
    return min((cluster.bandwidth_between(a, b) for a in ranks for b in ranks if a != b), default=math.inf)


def _scaled_overhead(overhead_s: Mapping[str, Any] | Any, k: float) -> Mapping[str, Any] | Any:
    """The per-action cost x ``k`` (a number, or a mapping per action kind)."""
    if k == 1.0:
        return overhead_s
    if isinstance(overhead_s, Mapping):
        return {kind: v * k for kind, v in overhead_s.items()}
    return overhead_s * k


def simulate_plan(plan: Any, chain: Any, cluster: Any, schedule_name: str | None = None,
                  num_microbatches: int = 8, *, num_steps: int = 1, vertical_sync: bool = False,
                  overlap_comm: bool = True, step_s: Sequence[float] | None = None,
                  tied_bytes: float = 0.0, tied_stages: Sequence[int] = (),
                  latency_s: float = 0.0, collective_latency_s: float | None = None,
                  overhead_s: Mapping[str, float] | float = 0.0, recv_progress: str = "background",
                  copy_bandwidth: float | None = None, split_backward: bool = True,
                  input_grad_share: float = INPUT_GRAD_SHARE, weight_grad_share: float = WEIGHT_GRAD_SHARE,
                  optimizer_state_factor: float = 1.0, virtual_stages: int = 1,
                  refit_recompute: float | None = None, update_bandwidth: float | None = None,
                  collective: tuple[float, float] | None = None, timeline: bool = True,
                  corun: Mapping[int, float] | Sequence[tuple[int, float]] | None = None,
                  wake_s: float = 0.0) -> SimResult:
    """Simulate a :class:`pdcompile.plan.Plan` of ``chain`` on ``cluster``.

    ``tied_bytes``: bytes of parameters tied across ``tied_stages`` (a GPT's embedding and output
    projection): the schedule then sums their gradients before every step (``TG``), costed as a
    ring all-reduce over every rank of those stages on their slowest link; ranks of other stages
    don't wait for it. ``latency_s`` is added to every transfer, ``collective_latency_s`` (default
    ``latency_s``) to every all-reduce (a link's fixed cost per message); ``overhead_s`` is the
    runtime's fixed cost per action and ``recv_progress`` when a receive's transfer may run (see
    :func:`simulate`). ``copy_bandwidth`` (bytes/s of a memory copy on the workers): weight stashing's
    copies of a stage's ``param_bytes`` are charged (``version_s``). A split backward (zb-h1's every
    one; gpipe's and flush's drain with ``split_backward``) costs the sums of the stage's layers'
    profiled ``input_grad_s`` for ``B`` and ``weight_grad_s`` for ``W``; a layer without them (an
    older or imported profile) ``input_grad_share`` and ``weight_grad_share`` of its backward
    (:data:`INPUT_GRAD_SHARE`). ``update_bandwidth`` (bytes/s a pass over memory moves on a worker,
    :func:`update_bandwidth_of`): where ``step_s`` is not given, each stage's ``ST`` costs its optimizer
    step (:func:`stage_step_s`), and where ``copy_bandwidth`` is not given, weight stashing's copies cost
    :func:`~pdcompile.passes.costs.roofline.weight_copy_s` at that bandwidth, as the runtime pays them.
    ``collective`` (fixed s, bytes/s; a local cluster's calibration, ``ActionCost.collective``): every
    all-reduce costs :func:`collective_s` with it, the runtime's measured all-reduce, instead of the ring
    at the link's bandwidth. ``corun`` (a calibration's co-running slowdowns, ``OpCostTable.corun`` as
    (processes, factor) pairs; :func:`pdcompile.api.corun_of`): on a local CPU cluster each stage's compute is
    charged them as its ranks compute side by side (:func:`shared_cores`), the chain carrying none; ``wake_s``
    (``ActionCost.wake``) there as a woken rank's wait for a core (:func:`shared_cores`).

    Stage ``s`` (chain layers ``first..last``) costs the sum of its layers' ``forward_s`` /
    ``backward_s``; its boundary sends ``chain.cut_bytes[last]`` forward (and as many gradient bytes back) at
    ``cluster.bandwidth_between`` the two ranks, on an emulated link (``collective`` given: this host; slower than
    its rate) then at loopback's (``pdcompile.slowlink`` hands the bytes on once they crossed); a replicated stage
    all-reduces its ``param_bytes`` with a ring over the slowest link among its ranks. Chain costs are per
    minibatch of ``chain.batch_size`` and are scaled linearly to ``plan.microbatch_size``, less each
    layer's fixed part (``ChainLayer.scaled``: its ops' fixed costs, paid whatever the size). A stage
    that recomputes runs again before its backward (``B``) what its mode rebuilds
    (:meth:`~pdcompile.passes.planner.decisions.Recompute.recompute_s`).
    Memory: the planner's stage memory (:meth:`~pdcompile.passes.planner.memory.MemoryModel.memory_at`: saved
    activations, weights x versions, gradients, ``optimizer_state_factor`` x weights of optimizer
    state) at the simulated peak in-flight and weight-version counts. Schedule ranks are consecutive by stage; replica ``i`` of stage ``s``
    runs on ``plan.stages[s].ranks[i]`` of the cluster. ``schedule_name`` defaults to the plan's.
    ``virtual_stages`` (> 1): the plan's stages are placed as the schedule's policy says, rank ``r``
    on the cluster's worker ``r``; a stage's memory is then flush's model (one weight version) at
    the larger of its peak with gradients (``peak_in_flight_with_grads``) and its peak before them
    (one weight copy less); tied stages on one rank sum their copies with no collective. ``timeline=False``:
    no events, replayed faster (:func:`simulate_schedule`), the rest the same.
    """
    # what the planner's memory model and recomputation decision read, as one object (stage_decisions)
    planned = PlanOptions(schedule=schedule_name or plan.schedule, optimizer_state_factor=optimizer_state_factor,
                          num_microbatches=num_microbatches)
    if refit_recompute is not None and virtual_stages == 1:
        # recomputation chosen again for this schedule and microbatch size: each stage the mode that
        # fits refit_recompute bytes with least forward run again, at the in-flight and version
        # counts a first run with the plan's modes gives (more recomputation never changes them)
        kw = dict(num_steps=num_steps, vertical_sync=vertical_sync, overlap_comm=overlap_comm, step_s=step_s,
                  update_bandwidth=update_bandwidth,
                  tied_bytes=tied_bytes, tied_stages=tied_stages, latency_s=latency_s,
                  collective_latency_s=collective_latency_s, overhead_s=overhead_s, recv_progress=recv_progress,
                  copy_bandwidth=copy_bandwidth, split_backward=split_backward, input_grad_share=input_grad_share,
                  weight_grad_share=weight_grad_share, optimizer_state_factor=optimizer_state_factor,
                  collective=collective, timeline=timeline, corun=corun, wake_s=wake_s)
        first = simulate_plan(plan, chain, cluster, schedule_name, num_microbatches, **kw)  # type: ignore[arg-type]
        fit = stage_decisions(chain, planned, budget=refit_recompute)
        chosen = [fit.choose(st_.first, st_.last, first.peak_in_flight[s], versions=first.peak_weight_versions[s],
                             activation_scale=plan.microbatch_size / chain.batch_size,
                             shard=getattr(st_, "shard", "none"), replicas=st_.replicas)
                  for s, st_ in enumerate(plan.stages)]
        stages = tuple(replace(st_, recompute=mode, recompute_layers=head)
                       for st_, (mode, head) in zip(plan.stages, chosen))
        return simulate_plan(replace(plan, stages=stages), chain, cluster, schedule_name, num_microbatches,
                             **kw)  # type: ignore[arg-type]
    name = schedule_name or plan.schedule
    reps = [st_.replicas for st_ in plan.stages]
    scale = plan.microbatch_size / chain.batch_size
    layers = chain.layers
    models: dict[str, Recompute] = {}

    def model(sched: str) -> Recompute:  # the planner's stage memory and recomputation per schedule
        if sched not in models:
            models[sched] = stage_decisions(chain, replace(planned, schedule=sched))
        return models[sched]

    overhead_s, step_t, flat_t = tensor_costs(overhead_s, cluster)
    fwd, bwd, params, cut, b_in, b_w, tensors = [], [], [], [], [], [], []
    for st_ in plan.stages:
        mine = layers[st_.first:st_.last + 1]
        # run again at B: what its recomputation rebuilds
        again = model("flush").recompute_s(st_.first, st_.last, getattr(st_, "recompute", "none"),
                                           getattr(st_, "recompute_layers", 0)) * scale
        sized = [l.scaled(scale) for l in mine]  # ops' fixed costs paid whatever the microbatch's size
        fwd.append(sum(f for f, _, _ in sized))
        bwd.append(sum(b for _, b, _ in sized) + again)
        b_in.append(sum(_part(l.input_grad_s, l.backward_s, input_grad_share) * k
                        for l, (_, _, k) in zip(mine, sized)) + again)
        b_w.append(sum(_part(l.weight_grad_s, l.backward_s, weight_grad_share) * k for l, (_, _, k) in zip(mine, sized)))
        params.append(sum(l.param_bytes for l in mine))
        tensors.append(stage_param_tensors(mine))
        cut.append(chain.cut_bytes[st_.last] * scale if st_.last < len(chain.cut_bytes) else 0.0)
    if update_bandwidth is not None and math.isfinite(update_bandwidth):
        if step_s is None:
            step_s = [stage_step_s(p, st_.replicas, getattr(st_, "shard", "none"), optimizer_state_factor,
                                   update_bandwidth, n, step_t) for p, n, st_ in zip(params, tensors, plan.stages)]
        if copy_bandwidth is None:  # version_s: bytes / copy_bandwidth, i.e. weight_copy_s(bytes, update_bandwidth)
            copy_bandwidth = 1.0 / weight_copy_s(1.0, update_bandwidth)
    if virtual_stages > 1:
        sched_ranks = layout(name, reps, num_microbatches, 1, virtual_stages=virtual_stages).stage_ranks
        cluster_rank = {r: r for rs in sched_ranks for r in rs}
    else:
        sched_ranks = stage_ranks(reps)
        cluster_rank = {r: plan.stages[s].ranks[i] if len(plan.stages[s].ranks) == reps[s] else r
                        for s, rs in enumerate(sched_ranks) for i, r in enumerate(rs)}

    link_bw: dict[tuple[int, int], float] = {}  # each link's bandwidth, looked up once

    def send(sa: int, sb: int, ra: int, rb: int) -> float:
        nbytes = cut[min(sa, sb)]
        if not nbytes:
            return 0.0
        if (bw := link_bw.get((ra, rb))) is None:
            bw = link_bw[ra, rb] = cluster.bandwidth_between(cluster_rank[ra], cluster_rank[rb])
        emulated = collective is not None and bw < collective[1]  # as collective_s: then loopback's path (slowlink)
        return nbytes / bw + latency_s + (nbytes / LOOPBACK_BANDWIDTH if emulated else 0.0)

    coll_lat = latency_s if collective_latency_s is None else collective_latency_s
    allreduce = []
    for s, rs in enumerate(sched_ranks):
        cr = [cluster_rank[r] for r in rs]
        bw = _slowest(cluster, cr)
        allreduce.append(collective_s(params[s], len(rs), bw, coll_lat, collective, tensors[s], flat_t))
    tied_s = 0.0
    if tied_bytes and tied_stages:
        cr = sorted({cluster_rank[r] for s in tied_stages for r in sched_ranks[s]})
        bw = _slowest(cluster, cr)
        # on one rank (a V's ends) its stages' copies are summed in memory, no collective
        tied_s = collective_s(tied_bytes, len(cr), bw, coll_lat, collective)
    def run(scale_s: Sequence[float], k: float, wake: Mapping[int, float]) -> SimResult:
        # stage s's chain compute x scale_s[s], actions' x k, each message to rank r wake[r] later (shared_cores)
        def x(v: list[float]) -> list[float]:
            return [a * f for a, f in zip(v, scale_s)]

        def woken(sa: int, sb: int, ra: int, rb: int) -> float:
            t = send(sa, sb, ra, rb)
            return t + wake.get(rb, 0.0) if t and ra != rb else t
        return simulate_schedule(name, reps, num_microbatches, num_steps=num_steps, vertical_sync=vertical_sync,
                                 split_backward=split_backward, virtual_stages=virtual_stages,
                                 input_grad_s=x(b_in), weight_grad_s=x(b_w),
                                 tied=bool(tied_bytes and tied_stages), tied_s=tied_s,
                                 tied_stages=list(tied_stages) if tied_bytes and tied_stages else None,
                                 overhead_s=_scaled_overhead(overhead_s, k), recv_progress=recv_progress,
                                 version_s=[p / copy_bandwidth for p in params] if copy_bandwidth else None,
                                 forward_s=x(fwd), backward_s=x(bwd), send_s=woken if wake else send,
                                 allreduce_s=allreduce,
                                 step_s=step_s, overlap_comm=overlap_comm, microbatch_size=plan.microbatch_size,
                                 timeline=timeline)

    res = shared_cores(run, sched_ranks, cluster, corun=corun, wake_s=wake_s if any(cut) else 0.0)

    def at(s: int, k: int, versions: int, sched: str, whole_step: bool | None = None) -> float:
        st_ = plan.stages[s]
        return float(model(sched).memory.memory_at(st_.first, st_.last, k, versions, getattr(st_, "recompute", "none"),
                                            scale, getattr(st_, "recompute_layers", 0),
                                            shard=getattr(st_, "shard", "none"), replicas=st_.replicas,
                                            whole_step=whole_step))

    if virtual_stages == 1:
        # the schedule's moments at the simulated counts: a stage that holds the whole step in flight holds no
        # gradients before its last forward (MemoryModel.whole_step: flush at M=1 runs, and is rated as, GPipe)
        memory = [at(s, res.peak_in_flight[s], res.peak_weight_versions[s], name) for s in range(len(plan.stages))]
    else:
        # virtual stages: one weight version, flush's model (gradients all step long) at the simulated
        # in-flight count while the stage holds gradients, and without them (one version's bytes less)
        # at its peak before its first backward; a recomputing stage also at its rebuilds while it
        # holds gradients (the meter measures there)
        memory = [max(at(s, res.peak_in_flight_with_grads[s], 1, "flush", False),
                      2 * at(s, res.peak_in_flight[s], 1, "flush", False)
                      - at(s, res.peak_in_flight[s], 2, "flush", False),
                      at(s, res.peak_in_flight_at_rebuild[s], 1, "flush", False)
                      if getattr(plan.stages[s], "recompute", "none") != "none" and res.peak_in_flight_at_rebuild[s]
                      else 0.0)
                  for s in range(len(plan.stages))]
    return replace(res, peak_memory_bytes=memory)
