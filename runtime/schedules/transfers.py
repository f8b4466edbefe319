"""Point-to-point transfers in the order NCCL needs: one order per pair of ranks, from the schedule.

NCCL ignores tags and runs a rank's transfers to one peer one after another, in the order they
were issued (each pair has one communicator and one stream); a send completes only once the peer's
matching receive runs. So both sides of every pair must issue their transfers in the same order.
:func:`transfer_plan` orders each pair's messages and places every receive; :func:`check_transfers`
replays a schedule with its plan under NCCL's rules, issuing exactly as ``runtime/executor.py``
does, and names the first mismatch or stuck pair. A transfer between two stages on one rank
(virtual stages) keeps its ``SF``/``RF`` pair in the schedule but is no message: it is in no
pair's order, needs no post, and is received as soon as it is sent. Pure Python, no torch.
"""

from __future__ import annotations

import bisect
from collections import Counter, defaultdict, deque
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from pdcompile.errors import ScheduleError
from pdcompile.runtime.schedules.actions import Action, Kind, Placement, Schedule, rank_of, stage_ranks
from pdcompile.runtime.schedules.replay import Execute, causal_replay, collective_key, is_collective, near_ranks, release_recorder

Posts = dict[int, list[tuple[Action, ...]]]  # rank -> per action index, the receives posted before it


@dataclass(frozen=True, order=True)
class Message:
    """One point-to-point message: ``kind`` "A" (activations), "G" (input gradients) or "T" (the
    target, first stage to last), sent by ``stage`` for ``microbatch``. Prints as ``0A3``."""

    microbatch: int
    kind: str
    stage: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"


def _receiver_stage(m: Message, num_stages: int) -> int:
    return {"A": m.stage + 1, "G": m.stage - 1, "T": num_stages - 1}[m.kind]


def endpoints(m: Message, ranks: Sequence[Sequence[int]]) -> tuple[int, int]:
    """(sending rank, receiving rank) of ``m``."""
    return rank_of(m.stage, m.microbatch, ranks), rank_of(_receiver_stage(m, len(ranks)), m.microbatch, ranks)


def sends_of(a: Action, num_stages: int, targets: Collection[int] | None = None) -> list[Message]:
    """The messages action ``a`` sends (``targets``: the microbatches whose target is sent; None: all)."""
    k = a.microbatch if a.microbatch is not None else -1
    if a.kind is Kind.SEND_ACT:
        return [Message(k, "A", a.stage)]
    if a.kind is Kind.SEND_GRAD:
        return [Message(k, "G", a.stage)]
    if a.kind is Kind.FORWARD and a.stage == 0 and num_stages > 1 and (targets is None or k in targets):
        return [Message(k, "T", 0)]
    return []


def receives_of(a: Action, num_stages: int) -> list[Message]:
    """The message that posting receive action ``a`` (``RF``/``RB``) receives (targets: :class:`TargetPosts`)."""
    k = a.microbatch if a.microbatch is not None else -1
    if a.kind is Kind.RECV_ACT:
        return [Message(k, "A", a.stage - 1)]
    if a.kind is Kind.RECV_GRAD:
        return [Message(k, "G", a.stage + 1)]
    return []


class TargetPosts:
    """Which targets (first stage to last) to send or post now, in microbatch order; one object per
    first-stage replica (sending) and per last-stage replica (receiving).

    ``upto(k)`` gives every microbatch of this replica not given yet up to the end of ``k``'s window
    of ``window`` microbatches (``window`` 1: up to ``k``). The sender calls it at its ``F k``, the
    receiver when it posts an ``RF k`` of any stage on its rank, before that receive. With one stage
    per rank the window is 1: ``T k`` goes right before ``A k`` (maybe on the same pair of ranks),
    received before that ``RF k``. Where a rank holds several stages (:func:`target_window`) it is
    a step, ``M`` microbatches: the first ``F`` of a step sends the step's targets and the last
    stage's rank posts them at its first ``RF`` of the step, so on the pair of the first and the
    last stage's ranks (which also carries chunk hand-overs) both issue them as one block between
    the two steps' other transfers: a synchronous schedule issues every transfer of a step on that
    pair after its first ``RF``/``F`` of the step and after the previous step's (the previous
    step's last gradients must reach the ranks the next step's activations come from)."""

    def __init__(self, first: int, replicas: int, targets: Collection[int] | None = None, window: int = 1) -> None:
        self.next, self.step, self.targets, self.window = first, replicas, targets, max(1, window)

    def upto(self, k: int) -> list[int]:
        """Microbatches whose target to send, or whose receive to post, now (before ``RF k``'s activations)."""
        end = (k // self.window + 1) * self.window - 1
        out = []
        while self.next <= end:
            if self.targets is None or self.next in self.targets:
                out.append(self.next)
            self.next += self.step
        return out


def several_per_rank(ranks: Sequence[Sequence[int]]) -> bool:
    """Whether a placement (ranks per stage) puts several stages on one rank (virtual stages)."""
    flat = [r for rs in ranks for r in rs]
    return len(set(flat)) < len(flat)


def target_window(sched: Schedule, ranks: Sequence[Sequence[int]]) -> int:
    """The targets' window (:class:`TargetPosts`): 1 with one stage per rank; with several, the
    microbatches of a step, read off the actions (stage 0's forwards before its first ``ST``, over
    its replicas)."""
    if not several_per_rank(ranks):
        return 1
    m = 0
    for r in ranks[0]:
        for a in sched.get(r, ()):
            if a.kind is Kind.STEP and a.stage == 0:
                break
            m += a.kind is Kind.FORWARD and a.stage == 0
    return max(1, m)


def waits_of(a: Action, num_stages: int, targets: Collection[int] | None = None) -> list[Message]:
    """The messages compute action ``a`` waits for."""
    k = a.microbatch if a.microbatch is not None else -1
    if a.kind is Kind.FORWARD and a.stage > 0:
        target = a.stage == num_stages - 1 and (targets is None or k in targets)
        return [Message(k, "A", a.stage - 1)] + ([Message(k, "T", 0)] if target else [])
    if a.kind is Kind.BACKWARD and a.stage < num_stages - 1:
        return [Message(k, "G", a.stage + 1)]
    return []


_UNIT = {Kind.FORWARD: 1, Kind.BACKWARD: 2, Kind.WEIGHT_GRAD: 1}  # rough relative costs, for ties only


def is_local(m: Message, ranks: Sequence[Sequence[int]]) -> bool:
    """Whether ``m`` goes between two stages on one rank (no message: a hand-over in memory)."""
    src, dst = endpoints(m, ranks)
    return src == dst


_Key = tuple[int, str, int]  # a Message's fields, in its order: (microbatch, kind, stage)
_Clock = tuple[int, int, tuple[int, ...], int]  # a message's sender: rank, index, its clock then, the unit-cost time


def clock_recorder(replicas: Sequence[int], track: Sequence[int]) -> tuple[Execute, dict[_Key, _Clock]]:
    """Each message -> who sends it, when, and what its sender knows then of the ranks in ``track``
    (a vector clock cut to those components; knowledge a message carries counts from the action
    that waits for it, ``F``/``B``). One pass over every action, each carrying ``len(track)``
    numbers: a rank's plan tracks only itself and its peers. Messages are keyed by plain tuples of
    :class:`Message`'s fields (:func:`waits_of`, :func:`sends_of` and ``_UNIT`` inlined: this runs
    on every action of the cluster)."""
    S = len(replicas)
    col = {q: c for c, q in enumerate(track)}
    vc: dict[int, list[int]] = defaultdict(lambda: [-1] * len(track))
    now: dict[int, int] = defaultdict(int)
    out: dict[_Key, _Clock] = {}
    F, B, W, SF, SB = Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT_GRAD, Kind.SEND_ACT, Kind.SEND_GRAD

    def execute(parts: list[tuple[int, int]], a: Action) -> None:
        kind = a.kind
        if kind is Kind.ALLREDUCE or kind is Kind.TIED_GRADS:
            both, t = [-1] * len(track), max(now[q] for q, _ in parts)
            for q, i in parts:
                if q in col:
                    vc[q][col[q]] = i
                both = [max(x, y) for x, y in zip(both, vc[q])]
            for q, _ in parts:
                vc[q], now[q] = list(both), t
            return
        (r, i) = parts[0]
        clock = vc[r]
        c = col.get(r)
        if c is not None:
            clock[c] = i
        k, st = (a.microbatch if a.microbatch is not None else -1), a.stage
        if kind is F:
            waits = ((k, "A", st - 1), (k, "T", 0)) if st == S - 1 and st > 0 else ((k, "A", st - 1),) if st > 0 else ()
        elif kind is B and st < S - 1:
            waits = ((k, "G", st + 1),)
        else:
            waits = ()
        for m in waits:
            got = out.get(m)
            if got is not None:
                vc[r] = clock = [max(x, y) for x, y in zip(clock, got[2])]
                if got[3] > now[r]:
                    now[r] = got[3]
        unit = 1 if kind is F or kind is W else 2 if kind is B else 0
        if kind is SF:
            out[(k, "A", st)] = (r, i, tuple(clock), now[r])
        elif kind is SB:
            out[(k, "G", st)] = (r, i, tuple(clock), now[r])
        elif kind is F and st == 0 and S > 1:  # a target counts as sent with its activations (at F's end)
            out[(k, "T", 0)] = (r, i, tuple(clock), now[r] + unit)
        now[r] += unit

    return execute, out


def _peers(acts: Sequence[Action], S: int, ranks: Sequence[Sequence[int]]) -> list[int]:
    """The ranks a rank with actions ``acts`` receives posted messages (``RF``/``RB``) from."""
    return sorted({endpoints(m, ranks)[0] for a in acts for m in receives_of(a, S) if not is_local(m, ranks)})


def link_order(sched: Schedule, replicas: Sequence[int], placement: Placement | None = None,
               pairs: Collection[tuple[int, int]] | None = None) -> dict[tuple[int, int], list[Message]]:
    """Per pair of ranks ``(low, high)`` (those in ``pairs``, default every pair that exchanges a
    message), the order in which both issue their messages (:func:`pair_order`). With one stage per
    rank a pair's order is a function of its two ranks' action lists alone, so both sides, each
    knowing only its own peers' lists, derive the same one."""
    where = stage_ranks(replicas, placement)
    if pairs is None:
        pairs = {(min(r, p), max(r, p)) for r in sched for p in _peers(sched[r], len(replicas), where)}
    if placement is not None:  # virtual stages: the whole pipeline's replay (see pair_order)
        track = sorted({q for pair in pairs for q in pair})
        execute, clocks = clock_recorder(replicas, track)
        causal_replay(sched, replicas, execute, name="transfer order", placement=placement)
        return _link_order(clocks, track, where, pairs)
    return {pair: pair_order(sched, replicas, pair) for pair in sorted(pairs)}


def pair_order(sched: Schedule, replicas: Sequence[int], pair: tuple[int, int],
               placement: Placement | None = None) -> list[Message]:
    """The order in which ranks ``pair = (low, high)`` issue their messages to each other: each
    side's sends in its own issue order; of a message from each side, the one that happens before
    the other first, else the one sent sooner if ``F``, ``B`` and ``W`` took 1, 2 and 1 units, then
    the smaller microbatch.

    With one stage per rank (no ``placement``) happens-before and the unit-cost times come from a
    replay of the two ranks alone (``sched`` needs no other rank's list; messages from other ranks
    arrive at once, a collective joins its participants among the two). Any such order lets NCCL
    complete the pair's transfers: a rank blocks only in a computation that waits for a message,
    and by then it has issued everything that comes before that message on the pair, so no pair
    waits for anything but the schedule's own dependencies. Reading only the pair keeps a rank's
    plan linear in its own and its peers' actions, whatever the size of the cluster.

    With virtual stages the targets travel a step's at a time and are posted where the last
    stage's rank posts its step's first receive, wherever that is; a replay of the two ranks alone
    can order a step's targets after a message that rank sends later (the tie's unit-cost times
    no longer see the pipeline). There the times come from the whole cluster's replay: such a
    schedule has one replica per stage, so its cluster is one pipeline (:func:`link_order`)."""
    if placement is not None:
        return link_order(sched, replicas, placement, {pair}).get(pair, [])
    track = sorted(set(pair))
    part = {q: sched[q] for q in track}
    execute, clocks = clock_recorder(replicas, track)
    causal_replay(part, replicas, execute, name="transfer order", part=True)
    return _link_order(clocks, track, stage_ranks(replicas), {pair}).get(pair, [])


def _link_order(clocks: dict[_Key, _Clock], track: Sequence[int], ranks: Sequence[Sequence[int]],
                pairs: Collection[tuple[int, int]] | None) -> dict[tuple[int, int], list[Message]]:
    """:func:`link_order` from the send clocks over ``track``."""
    col = {q: c for c, q in enumerate(track)}
    sent: dict[Message, _Clock] = {}
    for key, clock in clocks.items():
        if clock[0] not in col:  # sent by a rank of no pair here
            continue
        m = Message(*key)
        src, dst = endpoints(m, ranks)
        if src != dst and (pairs is None or (min(src, dst), max(src, dst)) in pairs):  # local: no message
            sent[m] = clock
    chains: dict[tuple[int, int], dict[int, list[Message]]] = {}
    for m, clock in sorted(sent.items(), key=lambda kv: (kv[1][0], kv[1][1], kv[0].kind != "T")):
        src, dst = endpoints(m, ranks)
        chains.setdefault((min(src, dst), max(src, dst)), {}).setdefault(src, []).append(m)

    def before(x: Message, y: Message) -> bool:  # x happens-before y
        return sent[y][2][col[sent[x][0]]] >= sent[x][1]

    def first(x: Message, y: Message) -> bool:  # x goes first: it must, or neither must and it is sent sooner
        if before(x, y) or before(y, x):
            return before(x, y)
        return (sent[x][3], x) < (sent[y][3], y)

    out: dict[tuple[int, int], list[Message]] = {}
    for pair, by in chains.items():
        a, b = by.get(pair[0], []), by.get(pair[1], [])
        i = j = 0
        seq: list[Message] = []
        while i < len(a) or j < len(b):
            if j == len(b) or (i < len(a) and first(a[i], b[j])):
                seq.append(a[i])
                i += 1
            else:
                seq.append(b[j])
                j += 1
        out[pair] = seq
    return out


def transfer_plan(sched: Schedule, replicas: Sequence[int], placement: Placement | None = None,
                  ranks: Collection[int] | None = None) -> Posts:
    """Per rank (those in ``ranks``, default all) and action index, the receive actions
    (``RF``/``RB``) to post just before that action.

    On each pair's :func:`pair_order`, a receive goes after this rank's sends that precede it and
    before those that follow it, and after the pair's earlier receives; within that, as early as
    one computation (``F``/``B``) before its own ``RF``/``RB``, so its data can land while the rank
    computes. Every ``RF``/``RB`` is posted exactly once, at or before its own index.

    A rank's plan reads only its own list and those of the ranks it receives from: ``sched`` needs
    no other (:func:`rank_transfer_plan`).
    """
    where = stage_ranks(replicas, placement)
    S = len(replicas)
    mine = sorted(sched) if ranks is None else sorted(ranks)
    pairs = {(min(r, p), max(r, p)) for r in mine for p in _peers(sched[r], S, where)}
    order = link_order(sched, replicas, placement, pairs)
    index: dict[Message, int] = {m: i for seq in order.values() for i, m in enumerate(seq)}
    return {r: _posts(r, sched[r], S, where, order, index) for r in mine}


def rank_transfer_plan(sched: Schedule, replicas: Sequence[int], rank: int,
                       placement: Placement | None = None) -> list[tuple[Action, ...]]:
    """:func:`transfer_plan` of one rank: per action index of ``rank``, the receives posted before it."""
    return transfer_plan(sched, replicas, placement, ranks=(rank,))[rank]


def peers(sched: Schedule, replicas: Sequence[int], rank: int, placement: Placement | None = None) -> list[int]:
    """The ranks ``rank`` exchanges messages with (targets included), read off its own list: the
    ranks whose lists its plan and its send release read (:func:`rank_plan`)."""
    return near_ranks(sched[rank], rank, stage_ranks(replicas, placement))


def rank_plan(sched: Schedule, replicas: Sequence[int], rank: int, placement: Placement | None = None
              ) -> tuple[dict[int, list[Action]], list[tuple[Action, ...]]]:
    """One rank's :func:`~.replay.send_release` and :func:`rank_transfer_plan`: what a rank's
    start-up needs of the cluster. With one stage per rank ``sched`` needs only ``rank``'s list and
    its :func:`peers`': the release replays those ranks alone (what it proves holds in the whole
    cluster), each pair's order its two ranks. With virtual stages (one pipeline) every rank's."""
    if placement is not None:
        where = stage_ranks(replicas, placement)
        pair = {(min(rank, p), max(rank, p)) for p in _peers(sched[rank], len(replicas), where)}
        track = sorted({q for pr in pair for q in pr})
        clocks_at, clocks = clock_recorder(replicas, track)
        release_at, release = release_recorder(sched, replicas, placement, ranks=(rank,))

        def both(parts: list[tuple[int, int]], a: Action) -> None:
            clocks_at(parts, a)
            release_at(parts, a)

        causal_replay(sched, replicas, both, name="transfer order", placement=placement)
        order = _link_order(clocks, track, where, pair)
        index: dict[Message, int] = {m: i for seq in order.values() for i, m in enumerate(seq)}
        return release[rank], _posts(rank, sched[rank], len(replicas), where, order, index)
    near = [rank] + peers(sched, replicas, rank)
    part = {q: sched[q] for q in near}
    release_part, release = release_recorder(part, replicas, ranks=(rank,))
    causal_replay(part, replicas, release_part, name="send release", part=True)
    return release[rank], rank_transfer_plan(part, replicas, rank)


def _posts(r: int, acts: Sequence[Action], S: int, ranks: Sequence[Sequence[int]],
           order: dict[tuple[int, int], list[Message]], index: dict[Message, int]) -> list[tuple[Action, ...]]:
    """Where rank ``r`` posts each of its receives, from the orders of the pairs it receives on."""
    posts: list[tuple[Action, ...]] = [() for _ in acts]
    computes = [i for i, a in enumerate(acts) if a.kind in (Kind.FORWARD, Kind.BACKWARD)]
    own_send: dict[Message, int] = {}
    recvs: dict[int, list[tuple[Message, int]]] = {}  # peer -> (primary message, its RF/RB index)
    for i, a in enumerate(acts):
        for m in sends_of(a, S):
            own_send[m] = i
        for m in receives_of(a, S):  # the activations or gradients; targets ride with activations
            if is_local(m, ranks):
                continue
            recvs.setdefault(endpoints(m, ranks)[0], []).append((m, i))
    chosen: list[tuple[int, int, Action]] = []
    for peer, items in recvs.items():
        seq = order[(min(r, peer), max(r, peer))]
        mine = [(index[m], own_send[m]) for m in seq if m in own_send]  # (order index, action index)
        keys = [x for x, _ in mine]
        items.sort(key=lambda it: index[it[0]])
        lo, hi = [], []
        for m, own in items:
            j = bisect.bisect_left(keys, index[m])
            lo.append(mine[j - 1][1] + 1 if j > 0 else 0)
            hi.append(min(own, mine[j][1]) if j < len(mine) else own)
        for t in range(len(items) - 2, -1, -1):
            hi[t] = min(hi[t], hi[t + 1])
        prev = 0
        for t, (m, own) in enumerate(items):
            c = bisect.bisect_left(computes, own)
            want = computes[c - 1] if c > 0 else own
            pos = min(max(want, lo[t], prev), hi[t])
            if pos < max(lo[t], prev):
                raise ScheduleError(f"internal: no place on rank {r} to post the receive of {m} "
                                    f"between steps {max(lo[t], prev)} and {hi[t]}")
            prev = pos
            chosen.append((pos, index[m], acts[own]))
    for pos, _, a in sorted(chosen, key=lambda c: (c[0], c[1])):
        posts[pos] = posts[pos] + (a,)
    return posts


def check_transfers(sched: Schedule, replicas: Sequence[int], posts: Posts | None = None, *,
                    targets: Collection[int] | None = None, name: str = "schedule",
                    placement: Placement | None = None, step_collective: bool = False,
                    target_step: int | None = None) -> None:
    """Replay ``sched`` with its receives posted as ``posts`` says (default: :func:`transfer_plan`)
    under NCCL's rules: per pair of ranks each side runs its transfers one at a time in issue order,
    a send completes together with the peer's receive of the same message when both are next in
    line, ``F``/``B`` wait for what they consume, ``AR``/``TG`` for their group. Tags play no part.
    Raises :class:`ScheduleError` (rule 'transfer order') at the first pair whose next transfers
    are different messages, or naming what every stuck rank and pair waits for.

    The issue rules are the executor's: ``SF k``/``SB k`` send activations/input gradients; the
    first stage's ``F k`` sends the targets :class:`TargetPosts` gives it before it computes (one
    stage per rank: ``T k``, so ``T k`` precedes ``A k``; several: the step's at its first ``F``);
    receives are posted where ``posts`` puts them, the last stage's rank's ``RF k`` (any stage's)
    first posting the targets :class:`TargetPosts` gives it (up to ``k``, or the step's; the window
    is ``target_step``, default :func:`target_window`); sends are waited for only once the schedule
    proves their receiver has them (``send_release``). ``step_collective``: every ``ST`` is a
    collective over all ranks too (global-norm clipping), which a rank blocks in, as in ``AR``/``TG``,
    while its posted transfers go on."""
    ranks = stage_ranks(replicas, placement)
    S = len(replicas)
    posts = transfer_plan(sched, replicas, placement) if posts is None else posts
    queues: dict[tuple[int, int], deque[tuple[str, Message]]] = {}  # (rank, peer) -> issued, unfinished
    received: dict[int, set[Message]] = {r: set() for r in sched}
    posted: dict[int, set[Action]] = {r: set() for r in sched}
    last = ranks[-1]
    window = target_window(sched, ranks) if target_step is None else target_step
    tposts = {r: TargetPosts(last.index(r), len(last), targets, window) for r in last if S > 1}
    tsends = {r: TargetPosts(ranks[0].index(r), len(ranks[0]), targets, window) for r in ranks[0] if S > 1}
    pcs = {r: 0 for r in sched}
    issued = {r: False for r in sched}
    ordinal: dict[int, list[int]] = {}
    for r, acts in sched.items():
        seen: Counter[Kind] = Counter()
        ordinal[r] = []
        for a in acts:
            ordinal[r].append(seen[a.kind])
            seen[a.kind] += 1
    arrived: dict[tuple[Kind, int, int], set[int]] = {}

    def fail(detail: str) -> ScheduleError:
        return ScheduleError(f"{name}: rule 'transfer order' broken: {detail}")

    def issue(r: int, kind: str, m: Message) -> None:
        src, dst = endpoints(m, ranks)
        if src == dst:  # local: received once sent, posted by nothing
            if kind == "send":
                received[r].add(m)
            return
        queues.setdefault((r, dst if kind == "send" else src), deque()).append((kind, m))

    def post(r: int, a: Action) -> None:
        if a not in posted[r]:
            posted[r].add(a)
            if a.kind is Kind.RECV_ACT and r in tposts:
                for k in tposts[r].upto(a.mb):
                    issue(r, "recv", Message(k, "T", 0))
            for m in receives_of(a, S):
                issue(r, "recv", m)

    def issue_action(r: int, i: int) -> None:
        a = sched[r][i]
        for b in posts[r][i]:
            post(r, b)
        if a.kind in (Kind.RECV_ACT, Kind.RECV_GRAD) and a not in posted[r] \
                and all(is_local(m, ranks) for m in receives_of(a, S)):
            post(r, a)  # a local hand-over, which the plan leaves out (the last stage's targets still post)
        if a.kind in (Kind.RECV_ACT, Kind.RECV_GRAD) and a not in posted[r]:
            raise fail(f"rank {r}: {a} (step {i}) was never posted by the plan")
        if window > 1 and a.kind is Kind.FORWARD and a.stage == 0 and r in tsends:
            for k in tsends[r].upto(a.mb):
                issue(r, "send", Message(k, "T", 0))
            return
        for m in sends_of(a, S, targets):
            issue(r, "send", m)

    progress = True
    while progress:
        progress = False
        for r, acts in sched.items():
            while pcs[r] < len(acts):
                i = pcs[r]
                if not issued[r]:
                    issue_action(r, i)
                    issued[r] = progress = True
                a = acts[i]
                if any(m not in received[r] for m in waits_of(a, S, targets)):
                    break
                if is_collective(a, step_collective):
                    group = list(ranks[a.stage]) if a.kind is Kind.ALLREDUCE else sorted(sched)
                    key = collective_key(a, ordinal[r][i])
                    got = arrived.setdefault(key, set())
                    got.add(r)
                    if len(got) < len(group):
                        break
                    del arrived[key]
                    for q in group:
                        if q != r:
                            pcs[q] += 1
                            issued[q] = False
                pcs[r] += 1
                issued[r] = False
                progress = True
        for (r, q), mine in list(queues.items()):
            theirs = queues.get((q, r))
            while mine and theirs and mine[0][0] != theirs[0][0]:
                (k1, m1), (_, m2) = mine[0], theirs[0]
                if m1 != m2:
                    raise fail(f"rank {r}'s next transfer with rank {q} is to {k1} {m1}, but rank {q}'s is to "
                               f"{'receive' if k1 == 'send' else 'send'} {m2}: NCCL pairs them (tags are ignored)")
                mine.popleft()
                theirs.popleft()
                received[q if k1 == "send" else r].add(m1)
                progress = True
    stuck = [r for r in sched if pcs[r] < len(sched[r])]
    lines = [f"rank {r} at {sched[r][pcs[r]]} (step {pcs[r]})" for r in stuck]
    lines += [f"rank {r} -> {q}: next {q_[0][0]} {q_[0][1]}" for (r, q), q_ in sorted(queues.items()) if q_]
    if lines:
        raise fail("stuck: " + "; ".join(lines))
