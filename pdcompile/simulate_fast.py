"""The schedule replay of :func:`pdcompile.simulate.simulate`, fast, for the planner's many candidates.

Two exact shortcuts, each a pure function on plain data; ``simulate()`` dispatches to them where the
caller asks for no timeline (``events=False``: the step search of ``pdcompile/plan.py`` ``plan_step``),
and its own replay remains the reference (``tests/test_simulate_fast.py`` checks the two agree):

* :func:`replay`: the same model as ``simulate()`` (every rank's actions in order, a send on its
  directed link in the sender's order, a receive waiting for its send, ``AR``/``TG`` once their group is
  there) over the same per-stage costs that ``simulate()`` has resolved, with the same arithmetic in the
  same order, so the same floats; but a rank is run until it blocks and resumed when what it waits for
  happens (a worklist, not passes over every rank), on integer keys, and with no timeline events. The
  times of a DAG's events do not depend on the order it is walked in (each is the max of its
  predecessors' plus its cost; a link's sends are in its sender's order whatever the walk).
* :func:`lane_factor` / :func:`lane_of`: ``g`` identical lanes. Microbatch ``i`` runs on replica
  ``i mod r_s`` of every stage; where ``g`` divides every ``r_s`` and the run's microbatches,
  ``i mod r_s = g (q mod r_s/g) + (i mod g)`` for ``q = i // g``, so the microbatches ``i = j (mod g)``
  meet only the replicas ``= j (mod g)``: lane ``j`` is the pipeline of ``r_s / g`` replicas and ``M / g``
  microbatches relabelled (every schedule's order of a rank depends on its stage, its count of local
  microbatches and the bounds ``warmup_depth`` and ``ceil(M / r_s)``, which the division leaves alone).
  Lanes share no link; they meet only in the collectives (``AR`` of a stage's replicas, ``TG``), whose
  start is the max over their ranks. Where every lane's transfers cost what lane 0's do (checked on every
  pair of ranks the lanes send between), the timeline that copies lane 0's to every lane satisfies every
  constraint of the whole pipeline's, which has one solution: so one lane, simulated alone, is exact.
  The planner's copies of one pipeline (PTD-P's ``d``) are such lanes where their links are alike.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import reduce
from typing import Any

from pdcompile.runtime.schedules import (Action, Kind, Schedule, layout, live_versions, make_schedule, stage_ranks,
                                         version_copies)

Transfer = Callable[[int, int, int, int], Any]  # (stage_from, stage_to, rank_a, rank_b) -> seconds


@dataclass(frozen=True)
class Replayed:
    """What :func:`replay` computes, per rank (``busy``, ``compute``: seconds) and per stage (the peaks
    ``SimResult`` documents); the makespan is the last clock or arrival."""

    makespan_s: Any
    busy: dict[int, Any]
    compute: dict[int, Any]
    num_microbatches: int
    peak_in_flight: list[int]
    peak_weight_versions: list[int]
    peak_memory_bytes: list[Any] | None
    peak_in_flight_with_grads: list[int]
    peak_in_flight_at_rebuild: list[int]


def replay(sched: Schedule, replicas: Sequence[int], *, fwd: Sequence[Any], bwd: Sequence[Any],
           input_grad: Sequence[Any], weight_grad: Sequence[Any], step: Sequence[Any], allreduce: Sequence[Any],
           version: Sequence[Any] | None, tied_s: Any, tied_stages: set[int], overhead: Mapping[str, Any],
           transfer: Transfer, overlap_comm: bool, recv_progress: str,
           activation_bytes: Sequence[Any], weight_bytes: Sequence[Any], static_bytes: Sequence[Any],
           sized: bool) -> Replayed | None:
    """``simulate()``'s replay of ``sched`` (ranks consecutive by stage, one stage each) at its resolved
    per-stage costs, without events; None where it deadlocks (``simulate()`` then replays it itself and
    names the ranks) or where ``recv_progress`` is ``"both_wait"`` (iterated; not here)."""
    if recv_progress not in ("background", "on_wait"):
        return None
    ranks = stage_ranks(replicas)
    R = sum(len(rs) for rs in ranks)
    if set(sched) != set(range(R)):
        return None
    stage_of = [0] * R
    for s, rs in enumerate(ranks):
        for r in rs:
            stage_of[r] = s
    first = [rs[0] for rs in ranks]
    reps = [len(rs) for rs in ranks]
    F, B, W, ST = Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT_GRAD, Kind.STEP
    SF, SB, RF, RB = Kind.SEND_ACT, Kind.SEND_GRAD, Kind.RECV_ACT, Kind.RECV_GRAD
    AR, TG = Kind.ALLREDUCE, Kind.TIED_GRADS
    over = {k: overhead.get(k.value, 0) for k in Kind}
    on_wait = recv_progress == "on_wait"
    read = [_read(sched[r]) for r in range(R)]
    top = 1 + max(x[2] for x in read)

    def key(grad: bool, stage: int, mb: int) -> int:  # a message: its send's kind, stage and microbatch
        return (stage * top + mb) * 2 + grad

    clock = [0] * R
    busy = [0] * R
    comp = [0] * R
    pcs = [0] * R
    arrival: dict[int, Any] = {}
    duration: dict[int, Any] = {}
    waiting: dict[int, int] = {}
    link_free: dict[tuple[int, int], Any] = {}
    cost: dict[tuple[int, int, int, int], Any] = {}
    plain = [x[3] for x in read]
    copies = {r: [0] * len(acts) if plain[r] else version_copies(acts) for r, acts in sched.items()} \
        if version is not None else None
    split = [x[1] for x in read]
    # collectives: (kind, stage or -1, ordinal) -> ranks there; each rank's count of each kind so far
    there: dict[tuple[Kind, int, int], list[int]] = {}
    seen = [{AR: 0, TG: 0} for _ in range(R)]
    tg_ranks = [q for q in range(R) if stage_of[q] in tied_stages]
    ready = list(range(R - 1, -1, -1))
    while ready:
        r = ready.pop()
        acts = sched[r]
        n = len(acts)
        pc = pcs[r]
        s_r = stage_of[r]
        mine = split[r]
        cp = copies[r] if copies is not None else None
        while pc < n:
            a = acts[pc]
            k = a.kind
            if k is AR or k is TG:
                ck = (k, a.stage if k is AR else -1, seen[r][k])
                seen[r][k] += 1
                group = there.setdefault(ck, [])
                group.append(r)
                need = reps[a.stage] if k is AR else R
                if len(group) < need:
                    pcs[r] = pc
                    break
                del there[ck]
                parts = group if k is AR else [q for q in sorted(group) if stage_of[q] in tied_stages]
                if parts:
                    start = max(clock[q] for q in parts)
                    dur = (allreduce[a.stage] if k is AR else tied_s) + over[k]
                    for q in parts:
                        clock[q] = start + dur
                        busy[q] += dur
                for q in group:
                    if q != r:
                        pcs[q] += 1
                        ready.append(q)
                pc += 1
                continue
            if k is RF or k is RB:
                grad = k is RB
                mk = key(grad, a.stage + 1 if grad else a.stage - 1, a.microbatch)  # type: ignore[arg-type]
                if mk not in arrival:
                    waiting[mk] = r
                    pcs[r] = pc
                    break
            o = over[k]
            if o:
                busy[r] += o
                clock[r] += o
            t = clock[r]
            if k is F or k is B or k is W or k is ST:
                s = a.stage
                if k is B and a.microbatch in mine:
                    dur = input_grad[s]
                elif k is F:
                    dur = fwd[s]
                elif k is B:
                    dur = bwd[s]
                elif k is W:
                    dur = weight_grad[s]
                else:
                    dur = step[s]
                if cp is not None and cp[pc]:
                    dur = dur + version[s] * cp[pc]  # type: ignore[index]
                clock[r] = t + dur
                busy[r] += dur
                comp[r] += dur
            elif k is SF or k is SB:
                s, mb = a.stage, a.mb
                dst = s + 1 if k is SF else s - 1
                peer = first[dst] + mb % reps[dst]
                ck2 = (s, dst, r, peer)
                x = cost.get(ck2)
                if x is None:
                    x = cost[ck2] = transfer(s, dst, r, peer)
                lk = (r, peer)
                start = max(t, link_free.get(lk, t))
                end = start + x
                link_free[lk] = end
                mk = key(k is SB, s, mb)
                arrival[mk] = end
                duration[mk] = end - start
                w = waiting.pop(mk, None)
                if w is not None:
                    ready.append(w)
                if not overlap_comm:
                    busy[r] += end - t
                    clock[r] = end
            elif k is RF or k is RB:
                end = max(t, arrival[mk])
                if on_wait:
                    end = max(end, t + duration[mk])
                clock[r] = end
            pc += 1
        else:
            pcs[r] = pc
    if any(pcs[r] < len(sched[r]) for r in range(R)):
        return None
    makespan = max([0, *clock, *arrival.values()])
    T = len(set().union(*(x[0] for x in read)))
    peaks = _peaks(sched, stage_of, len(ranks), split, plain, activation_bytes, weight_bytes, static_bytes, sized)
    return Replayed(makespan, dict(enumerate(busy)), dict(enumerate(comp)), T, *peaks)


def _read(acts: Sequence[Action]) -> tuple[set[Any], set[Any], int, bool]:
    """One rank's actions in one pass: the microbatches it forwards, those whose backward is split (a ``W``),
    the largest microbatch, and whether it keeps one weight version throughout and copies none
    (``live_versions`` one version after each action, ``version_copies`` all 0: no ``WV``, every ``ST`` after
    every ``F``, ``B`` and ``W``, every microbatch forwarded also backwarded; one step of GPipe or Flush)."""
    F, B, W, ST, WV = Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT_GRAD, Kind.STEP, Kind.WEIGHT_VERSION
    stepped = versions = False
    fs: set[Any] = set()
    bs: set[Any] = set()
    ws: set[Any] = set()
    for a in acts:
        k = a.kind
        if k is F:
            fs.add(a.microbatch)
        elif k is B:
            bs.add(a.microbatch)
        elif k is W:
            ws.add(a.microbatch)
        elif k is ST:
            stepped = True
            continue
        elif k is WV:
            versions = True
            continue
        else:
            continue
        versions = versions or stepped
    return fs, ws, max(fs | bs | ws, default=0), not versions and fs == bs


def _peaks(sched: Schedule, stage_of: Sequence[int], S: int, split: Sequence[set[Any]], plain: Sequence[bool],
           act_b: Sequence[Any], w_b: Sequence[Any], static_b: Sequence[Any],
           sized: bool) -> tuple[list[int], list[int], list[Any] | None, list[int], list[int]]:
    """The per-stage peaks of ``simulate()``'s memory walk (its rules, read off each rank's actions)."""
    F, B, W, ST = Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT_GRAD, Kind.STEP
    peak_in, peak_v, peak_grads, peak_rebuild = [0] * S, [0] * S, [0] * S, [0] * S
    peak_mem: list[Any] = [0] * S
    for r, acts in sched.items():
        s = stage_of[r]
        mine = split[r]
        live: Sequence[Any] = [(0,)] * len(acts) if plain[r] else live_versions(acts)  # (0,): one version
        peak_v[s] = max(peak_v[s], max((len(x) for x in live), default=1))
        n = 0
        grads = False
        a_s, w_s, st_s = act_b[s] or 0, w_b[s] or 0, static_b[s] or 0
        for a, versions in zip(acts, live):
            k = a.kind
            frees = W if a.microbatch in mine else B
            if grads and k is B:
                if n > peak_rebuild[s]:
                    peak_rebuild[s] = n
            n += (k is F) - (k is frees)
            if n > peak_in[s]:
                peak_in[s] = n
            if grads and (k is F or k is ST) and n > peak_grads[s]:
                peak_grads[s] = n
            grads = (grads or k is frees) and k is not ST
            if sized:
                mem = st_s + a_s * n + w_s * len(versions)
                peak_mem[s] = max(peak_mem[s], mem)
        if sized and not acts:
            peak_mem[s] = max(peak_mem[s], st_s + w_s)
    return peak_in, peak_v, peak_mem if sized else None, peak_grads, peak_rebuild


def lane_pairs(replicas: Sequence[int], total: int) -> list[tuple[int, int, int, int]]:
    """Every (stage_from, stage_to, replica_a, replica_b) that some microbatch of ``total`` crosses (a
    forward's activations, a backward's gradients), replicas numbered within their stage."""
    out = []
    for s in range(len(replicas) - 1):
        a, b = replicas[s], replicas[s + 1]
        for q in range(min(total, a * b // math.gcd(a, b))):
            out += [(s, s + 1, q % a, q % b), (s + 1, s, q % b, q % a)]
    return out


def lane_factor(replicas: Sequence[int], num_microbatches: int, num_steps: int, transfer: Transfer | None,
                most_checks: int = 200_000) -> int:
    """The most lanes ``g`` (module docstring) that the pipeline of ``replicas`` with ``num_microbatches``
    a step splits into with every lane's transfers costing what lane 0's do (``transfer`` of whole-pipeline
    ranks; None: free): ``g`` divides every replica count and the step's microbatches; 1 where none."""
    total = num_microbatches * num_steps
    g0 = reduce(math.gcd, replicas, num_microbatches)
    if g0 <= 1:
        return 1
    firsts = [sum(replicas[:s]) for s in range(len(replicas))]
    for g in sorted((d for d in range(2, g0 + 1) if g0 % d == 0), reverse=True):
        red = [r // g for r in replicas]
        pairs = lane_pairs(red, total // g)
        if transfer is None:
            return g
        if len(pairs) * g > most_checks:
            continue

        def costs(j: int) -> list[Any]:
            return [transfer(sa, sb, firsts[sa] + g * ra + j, firsts[sb] + g * rb + j) for sa, sb, ra, rb in pairs]

        base = costs(0)
        if all(costs(j) == base for j in range(1, g)):
            return g
    return 1


def lane_of(replicas: Sequence[int], g: int) -> tuple[list[int], Callable[[int], int], dict[int, int]]:
    """Lane 0 of ``g`` (module docstring): its replicas per stage, its rank -> the whole pipeline's rank,
    and every whole-pipeline rank -> the lane's rank whose timeline it repeats."""
    red = [r // g for r in replicas]
    firsts = [sum(replicas[:s]) for s in range(len(replicas))]
    red_firsts = [sum(red[:s]) for s in range(len(red))]
    to_full = {}
    of_full = {}
    for s, (f, rf) in enumerate(zip(firsts, red_firsts)):
        for i in range(replicas[s]):
            of_full[f + i] = rf + i // g
        for i in range(red[s]):
            to_full[rf + i] = f + g * i
    return red, to_full.__getitem__, of_full


def lane_schedule(name: str, replicas: Sequence[int], g: int, num_microbatches: int,
                  ranks: Sequence[int] | None = None, **kw: Any) -> Schedule:
    """Lane 0 of ``g``'s schedule: ``make_schedule`` of its replicas and ``num_microbatches / g``, with the
    ``AR`` that a stage replicated in the whole pipeline but not in the lane runs before each update (a
    collective of identical lanes: it starts when its own rank is there). ``ranks``: only these lane ranks."""
    red = [r // g for r in replicas]
    lay = layout(name, red, num_microbatches // g, kw.get("num_steps", 1), kw.get("vertical_sync", False),
                 kw.get("split_backward", True))
    if lay.num_steps == 1 and lay.policy.version_lag == 0 and not lay.policy.update_per_microbatch \
            and lay.policy.placement is None:
        # one step, every forward at version 0: make_schedule would insert no WV (insert_versions)
        tied = kw.get("tied", False)
        sched = {r: lay.policy.order(lay, s, i, tied) for s, rs in enumerate(lay.stage_ranks) for i, r in enumerate(rs)
                 if ranks is None or r in ranks}
    else:
        sched = make_schedule(name, red, num_microbatches // g, ranks=ranks, **kw)
    for s, rs in enumerate(stage_ranks(red)):
        if replicas[s] > 1 and red[s] == 1 and rs[0] in sched:
            acts, out = sched[rs[0]], list[Action]()
            for i, a in enumerate(acts):
                if a.kind is Kind.STEP or (a.kind is Kind.TIED_GRADS and i + 1 < len(acts)
                                           and acts[i + 1].kind is Kind.STEP):
                    if not out or out[-1].kind is not Kind.TIED_GRADS:
                        out.append(Action(s, Kind.ALLREDUCE))
                out.append(a)
            sched[rs[0]] = out
    return sched
