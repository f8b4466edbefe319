"""Replaying a schedule: every rank's actions in an order that respects blocking receives and
collectives (deadlock detection, shared by validate and the simulator), and which sends each
action lets go (:func:`send_release`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

from pdcompile.errors import ScheduleError
from pdcompile.runtime.schedules.actions import Action, Kind, Placement, Schedule, rank_of, schedule_error, stage_ranks


def _sender_key(a: Action) -> tuple[Kind, int, int]:
    """The send that a receive action waits for: (send kind, sender stage, microbatch)."""
    if a.kind is Kind.RECV_ACT:
        return (Kind.SEND_ACT, a.stage - 1, a.mb)
    return (Kind.SEND_GRAD, a.stage + 1, a.mb)


def is_collective(a: Action, step_collective: bool = False) -> bool:
    """Whether ``a`` is a collective: ``AR`` (the stage's replicas), ``TG`` (every rank), and with
    ``step_collective`` ``ST`` too (every rank: global-norm clipping all-reduces at each step)."""
    return a.kind in (Kind.ALLREDUCE, Kind.TIED_GRADS) or (step_collective and a.kind is Kind.STEP)


def collective_key(a: Action, ordinal: int) -> tuple[Kind, int, int]:
    """Which collective ``a`` joins: its kind, its stage for ``AR`` (-1: every rank), its ordinal
    among the rank's actions of that kind (the k-th ``ST`` of every rank meet)."""
    return (a.kind, a.stage if a.kind is Kind.ALLREDUCE else -1, ordinal)


def replay(sched: Schedule, replicas: Sequence[int],
           execute: Callable[[list[tuple[int, int]], Action], None] | None = None, *, name: str = "schedule",
           placement: Placement | None = None, step_collective: bool = False) -> None:
    """Run every rank's actions in order, as the executor would, and detect deadlock.

    A receive waits until its matching send has run; ``AR`` waits for all replicas of the stage to
    reach their matching (same ordinal) ``AR``; ``TG`` waits for every rank's matching ``TG``.
    Sends never block. ``execute(participants, action)`` is called for each action once it can run
    (``participants`` is ``[(rank, index)]``, all of them for a collective), in an order that
    respects those dependencies. Raises :class:`ScheduleError` (rule 'no deadlock') naming the
    ranks that wait on each other, with the grid. ``placement``: ranks per stage (virtual stages;
    a transfer between two stages of one rank is a local hand-over: its receive waits for its send).
    ``step_collective``: every rank's k-th ``ST`` waits for every rank's k-th ``ST`` (global-norm
    clipping: the runtime all-reduces the squared gradient norms over all ranks at each step).
    """
    ranks = stage_ranks(replicas, placement)
    all_ranks = sorted(sched)
    pcs = {r: 0 for r in all_ranks}
    sent: set[tuple[Kind, int, int]] = set()
    ordinal: dict[int, list[int]] = {}  # rank -> per index, ordinal of that AR/TG on the rank
    for r in all_ranks:
        seen: Counter[Kind] = Counter()
        ords = []
        for a in sched[r]:
            ords.append(seen[a.kind])
            seen[a.kind] += 1
        ordinal[r] = ords
    arrived: dict[tuple, dict[int, int]] = {}

    def participants(a: Action) -> list[int]:
        return list(ranks[a.stage]) if a.kind is Kind.ALLREDUCE else all_ranks

    progress = True
    while progress:
        progress = False
        for r in all_ranks:
            acts = sched[r]
            while pcs[r] < len(acts):
                i = pcs[r]
                a = acts[i]
                if a.kind in (Kind.RECV_ACT, Kind.RECV_GRAD):
                    if _sender_key(a) not in sent:
                        break
                elif is_collective(a, step_collective):
                    key = collective_key(a, ordinal[r][i])
                    group = participants(a)
                    got = arrived.setdefault(key, {})
                    got[r] = i
                    if len(got) < len(group):
                        break
                    if execute is not None:
                        execute([(q, got[q]) for q in group], a)
                    for q in group:
                        pcs[q] += 1
                    del arrived[key]
                    progress = True
                    continue
                if execute is not None:
                    execute([(r, i)], a)
                if a.kind in (Kind.SEND_ACT, Kind.SEND_GRAD):
                    sent.add((a.kind, a.stage, a.mb))
                pcs[r] += 1
                progress = True
    blocked = [r for r in all_ranks if pcs[r] < len(sched[r])]
    if blocked:
        raise _deadlock(sched, name, ranks, pcs, arrived, blocked)


def causal_replay(sched: Schedule, replicas: Sequence[int],
                  execute: Callable[[list[tuple[int, int]], Action], None], *, name: str = "schedule",
                  placement: Placement | None = None, step_collective: bool = False, part: bool = False) -> None:
    """:func:`replay`'s dependencies and callbacks in time linear in the actions: a rank that blocks
    waits until the send or the collective it waits for completes, instead of every rank being
    looked at again on each round. The order of the ``execute`` calls respects every dependency but
    may differ from :func:`replay`'s, so it serves callers whose result depends on the dependencies
    alone (vector clocks, longest paths). A deadlock is reported by :func:`replay`, as it names it.

    ``part``: ``sched`` holds only some ranks (a rank and its peers): a receive from a rank not in it
    runs at once, and a collective waits only for its participants in it. What the replay proves
    then still holds in the whole cluster (its dependencies are a subset of the cluster's)."""
    where = ranks = stage_ranks(replicas, placement)
    all_ranks = sorted(sched)
    present = set(all_ranks)
    if part:
        ranks = [[q for q in rs if q in present] for rs in ranks]
    pcs = {r: 0 for r in all_ranks}
    sent: set[tuple[Kind, int, int]] = set()
    waiting: dict[tuple[Kind, int, int], list[int]] = {}  # a send -> the ranks blocked on its receive
    seen: dict[int, Counter[Kind]] = {r: Counter() for r in all_ranks}  # collectives' ordinals so far
    arrived: dict[tuple[Kind, int, int], dict[int, int]] = {}
    collectives = (Kind.ALLREDUCE, Kind.TIED_GRADS, Kind.STEP) if step_collective else (Kind.ALLREDUCE, Kind.TIED_GRADS)
    ready = list(reversed(all_ranks))
    while ready:
        r = ready.pop()
        acts = sched[r]
        while pcs[r] < len(acts):
            i = pcs[r]
            a = acts[i]
            kind = a.kind
            if kind is Kind.RECV_ACT or kind is Kind.RECV_GRAD:
                key = (Kind.SEND_ACT, a.stage - 1, a.microbatch) if kind is Kind.RECV_ACT else \
                    (Kind.SEND_GRAD, a.stage + 1, a.microbatch)
                if key not in sent and not (part and rank_of(key[1], a.mb, where) not in present):
                    waiting.setdefault(key, []).append(r)  # type: ignore[arg-type]
                    break
            elif kind in collectives:
                ckey = collective_key(a, seen[r][a.kind])
                got = arrived.setdefault(ckey, {})
                got[r] = i
                group = list(ranks[a.stage]) if a.kind is Kind.ALLREDUCE else all_ranks
                if len(got) < len(group):
                    break
                del arrived[ckey]
                execute([(q, got[q]) for q in group], a)
                for q in group:
                    seen[q][a.kind] += 1
                    pcs[q] += 1
                    if q != r:
                        ready.append(q)
                continue
            execute([(r, i)], a)
            if kind is Kind.SEND_ACT or kind is Kind.SEND_GRAD:
                key = (kind, a.stage, a.microbatch)  # type: ignore[assignment]
                sent.add(key)  # type: ignore[arg-type]
                ready.extend(waiting.pop(key, ()))  # type: ignore[arg-type]
            pcs[r] += 1
    if any(pcs[r] < len(sched[r]) for r in all_ranks):
        if part:
            raise ScheduleError(f"{name}: rule 'no deadlock' broken: ranks {all_ranks} wait on each other "
                                f"(validate the whole schedule to see where)")
        replay(sched, replicas, name=name, placement=placement, step_collective=step_collective)  # names it
        raise ScheduleError(f"{name}: internal: a deadlock that replay does not see")  # pragma: no cover


def send_release(sched: Schedule, replicas: Sequence[int], placement: Placement | None = None, *,
                 step_collective: bool = False, ranks: Sequence[int] | None = None
                 ) -> dict[int, dict[int, list[Action]]]:
    """Per rank: after which of its actions the sends of earlier actions are known to be complete.

    A send's buffer must stay alive until the receiver has taken the message, and on gloo nothing
    says so without blocking (``Work.is_completed()`` stays false until ``wait()``, and ``wait()``
    blocks until the receiver posts its receive). So a rank waits for a send only once the schedule
    guarantees the receiver has already *waited* for it: the receiver's consuming action (``F k``
    for ``SF k``, ``B k`` for ``SB k``; the last stage's ``F k`` for the target the first stage
    sends inside its ``F k``) happens-before an action of this rank through the messages and
    collectives of the schedule (vector clocks over :func:`replay`; knowledge carried by a message
    counts from the action that waits for it, ``F``/``B``, not from the posting ``RF``/``RB``). Such
    a wait returns at once; every other send is left alone until the end of the run.

    Returns ``{rank: {index: [earlier actions whose sends are complete after action index]}}``
    (by index: ``ST``, ``AR`` and ``TG`` occur once per step).

    ``step_collective``: ``ST`` counts as a collective over every rank too, which it is only where
    the runtime all-reduces there (global-norm clipping); it may then release sends sooner. The
    runtime does not pass it: the release computed without it stays correct with clipping (every
    happens-before it uses still holds), so one release serves runs with and without clipping.

    ``ranks``: only these ranks' releases (default all). A rank's release reads only what it knows
    of the ranks it sends to, so the vector clocks are cut to those components. With one stage per
    rank it replays only the rank and the ranks it exchanges messages with (:func:`near_ranks`,
    ``causal_replay(part=True)``): what that proves holds in the whole cluster, and a target's
    send is known complete at the latest at the first stage's ``B k``, whose gradient came down
    from the last stage's ``B k``, after its ``F k``. So a rank's release costs its own and its
    peers' actions, whatever the size of the cluster. With virtual stages (one pipeline, one
    replica per stage) the whole schedule is replayed.

    >>> from pdcompile.runtime.schedules import make_schedule
    >>> sched = make_schedule("gpipe", [1, 1], 2, split_backward=False)
    >>> {str(sched[0][i]): [str(b) for b in bs] for i, bs in send_release(sched, [1, 1])[0].items()}
    {'0B1': ['0F0', '0SF0', '0F1', '0SF1']}
    """
    if placement is not None:  # virtual stages: one pipeline, replayed whole
        execute, got = release_recorder(sched, replicas, placement, step_collective=step_collective, ranks=ranks)
        causal_replay(sched, replicas, execute, name="send release", placement=placement,
                      step_collective=step_collective)
        return got
    where = stage_ranks(replicas)
    out: dict[int, dict[int, list[Action]]] = {}
    for r in (sorted(sched) if ranks is None else ranks):
        part = {q: sched[q] for q in [r, *near_ranks(sched[r], r, where)]}
        execute, got = release_recorder(part, replicas, step_collective=step_collective, ranks=(r,))
        causal_replay(part, replicas, execute, name="send release", step_collective=step_collective, part=True)
        out[r] = got[r]
    return out


def near_ranks(acts: Sequence[Action], rank: int, ranks: Sequence[Sequence[int]]) -> list[int]:
    """The other ranks a rank with actions ``acts`` sends to or receives from (targets included)."""
    S = len(ranks)
    out: set[int] = set()
    for a in acts:
        if a.kind in (Kind.SEND_ACT, Kind.SEND_GRAD) or (a.kind is Kind.FORWARD and a.stage == 0):
            out.update(_receivers(a, ranks))
        elif a.kind in (Kind.RECV_ACT, Kind.RECV_GRAD):
            _, stage, mb = _sender_key(a)
            out.add(rank_of(stage, mb, ranks))
        elif a.kind is Kind.FORWARD and a.stage == S - 1 and S > 1:
            out.add(rank_of(0, a.mb, ranks))
    out.discard(rank)
    return sorted(out)


Execute = Callable[[list[tuple[int, int]], Action], None]


def release_recorder(sched: Schedule, replicas: Sequence[int], placement: Placement | None = None, *,
                     step_collective: bool = False, ranks: Sequence[int] | None = None
                     ) -> tuple[Execute, dict[int, dict[int, list[Action]]]]:
    """:func:`send_release` as a replay callback and the result it fills, so that one replay can
    serve it and :func:`~.transfers.clock_recorder` together (:func:`~.periodic.rank_run`)."""
    where = stage_ranks(replicas, placement)
    last = len(where) - 1
    all_ranks = sorted(sched)
    mine = set(all_ranks if ranks is None else ranks)
    track = all_ranks if ranks is None else \
        sorted(mine | {q for r in mine for a in sched[r] for q in _receivers(a, where)})
    col = {q: c for c, q in enumerate(track)}
    pos: dict[int, dict[tuple[Kind, int | None], int]] = {}  # rank -> (kind, microbatch) -> its index

    def index_of(peer: int, use: Kind, k: int) -> int:
        if peer not in pos:
            pos[peer] = {(a.kind, a.microbatch): i for i, a in enumerate(sched[peer])}
        return pos[peer][(use, k)]

    last_f: dict[int, dict[int, int]] = {}  # a last-stage rank -> microbatch -> its index of that stage's F

    def last_forward(peer: int, k: int) -> int:
        if peer not in last_f:
            last_f[peer] = {a.mb: i for i, a in enumerate(sched[peer]) if a.kind is Kind.FORWARD and a.stage == last}
        return last_f[peer][k]

    vc = {r: [-1] * len(track) for r in all_ranks}
    snapshot: dict[tuple[Kind, int, int], list[int]] = {}  # a send -> its sender's clock then
    merge_at: dict[int, dict[tuple[Kind, int], list[int]]] = {r: {} for r in all_ranks}
    open_: dict[int, list[tuple[int, int, Action]]] = {r: [] for r in mine}  # (peer, its index, send)
    out: dict[int, dict[int, list[Action]]] = {r: {} for r in all_ranks if r in mine}

    def merge(into: list[int], other: list[int]) -> None:
        for q, x in enumerate(other):
            if x > into[q]:
                into[q] = x

    def release(r: int, i: int) -> None:
        if r not in mine:
            return
        keep = []
        for peer, at, send in open_[r]:
            if vc[r][col[peer]] >= at:
                out[r].setdefault(i, []).append(send)
            else:
                keep.append((peer, at, send))
        open_[r] = keep

    F, B, RF, RB, SF, SB = Kind.FORWARD, Kind.BACKWARD, Kind.RECV_ACT, Kind.RECV_GRAD, Kind.SEND_ACT, Kind.SEND_GRAD
    collectives = (Kind.ALLREDUCE, Kind.TIED_GRADS, Kind.STEP) if step_collective else (Kind.ALLREDUCE, Kind.TIED_GRADS)

    def execute(parts: list[tuple[int, int]], a: Action) -> None:
        kind = a.kind
        if kind in collectives:
            both = [-1] * len(track)
            for q, i in parts:
                if q in col:
                    vc[q][col[q]] = i
                merge(both, vc[q])
            for q, i in parts:
                vc[q] = list(both)
                release(q, i)
            return
        (r, i), k = parts[0], (a.microbatch if a.microbatch is not None else -1)
        c = col.get(r)
        if c is not None:
            vc[r][c] = i
        if kind is F or kind is B:
            got = merge_at[r].pop((kind, k), None)
            if got is not None:
                merge(vc[r], got)
            if kind is B and a.stage == 0 and last > 0 and r in mine:  # k's gradient came down from the last stage
                peer = rank_of(last, k, where)
                if peer in col:
                    vc[r][col[peer]] = max(vc[r][col[peer]], last_forward(peer, k))
            if kind is F and a.stage == 0 and last > 0 and r in mine:  # the target, to the last stage
                peer = rank_of(last, k, where)
                open_[r].append((peer, index_of(peer, F, k), a))
        elif kind is RF:
            got = snapshot.get((SF, a.stage - 1, k))  # None: sent by a rank outside a part's replay
            if got is not None:
                merge_at[r][(F, k)] = got
        elif kind is RB:
            got = snapshot.get((SB, a.stage + 1, k))
            if got is not None:
                merge_at[r][(B, k)] = got
        elif kind is SF or kind is SB:
            snapshot[(kind, a.stage, k)] = list(vc[r])
            if r in mine:
                to = a.stage + 1 if kind is SF else a.stage - 1
                peer = rank_of(to, k, where)
                open_[r].append((peer, index_of(peer, F if kind is SF else B, k), a))
        if r in mine:
            release(r, i)

    return execute, out


def _receivers(a: Action, ranks: Sequence[Sequence[int]]) -> list[int]:
    """The ranks whose consuming action releases a send of ``a`` (activations, gradients, the target)."""
    k = a.microbatch if a.microbatch is not None else -1
    if a.kind is Kind.SEND_ACT:
        return [rank_of(a.stage + 1, k, ranks)]
    if a.kind is Kind.SEND_GRAD:
        return [rank_of(a.stage - 1, k, ranks)]
    if a.kind is Kind.FORWARD and a.stage == 0 and len(ranks) > 1:
        return [rank_of(len(ranks) - 1, k, ranks)]
    return []


def _deadlock(sched: Schedule, name: str, ranks: list[list[int]], pcs: dict[int, int],
              arrived: dict[tuple, dict[int, int]], blocked: list[int]) -> ScheduleError:
    def waits_for(r: int) -> tuple[list[int], str]:
        a = sched[r][pcs[r]]
        if a.kind in (Kind.RECV_ACT, Kind.RECV_GRAD):
            kind, stage, mb = _sender_key(a)
            if not 0 <= stage < len(ranks):
                return [], f"rank {r} waits at {a} for a send from stage {stage}, which does not exist"
            q = rank_of(stage, mb, ranks)
            return [q], f"rank {r} waits at {a} (step {pcs[r]}) for {stage}{kind.value}{mb} from rank {q}"
        group = list(ranks[a.stage]) if a.kind is Kind.ALLREDUCE else sorted(sched)  # TG, ST: every rank
        here = next((got for got in arrived.values() if r in got), {})
        missing = [q for q in group if q not in here]
        return missing, f"rank {r} waits at {a} (step {pcs[r]}) for ranks {missing} to join"

    start = blocked[0]
    chain: list[str] = []
    r = start
    seen: dict[int, int] = {}
    while r not in seen:
        seen[r] = len(chain)
        peers, text = waits_for(r)
        chain.append(text)
        nxt = next((q for q in peers if q in pcs and pcs[q] < len(sched[q])), None)
        if nxt is None:
            done = [q for q in peers if q in pcs]
            why = (f"; rank {done[0]} finished without it" if done else "")
            return schedule_error(sched, name, "no deadlock", r, pcs[r], "; ".join(chain[-1:]) + why)
        r = nxt
    cycle = chain[seen[r]:]
    return schedule_error(sched, name, "no deadlock", r, pcs[r], "these ranks wait on each other: " + "; ".join(cycle))
