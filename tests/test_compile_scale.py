"""A rank's transfer plan and send release read only its own and its peers' action lists; they are
checked against the whole-cluster vector-clock replay they replaced (kept below as the reference,
as it was) on every built-in schedule: equal plans with one pipeline per replica, NCCL's rules
completing every plan, no send let go before the reference proves it received; the periodic form
likewise; plan.json's schedule check is small and still refuses a list this runtime would not
rebuild (#28 item 7)."""

from __future__ import annotations

import bisect
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import pytest

from pdcompile.errors import ScheduleError, UsageError
from pdcompile.runtime.schedules import make_schedule
from pdcompile.runtime.schedules.actions import Action, Kind, Placement, Schedule, rank_of, stage_ranks
from pdcompile.runtime.schedules.registry import SCHEDULES, VIRTUAL_SCHEDULES, layout
from pdcompile.runtime.schedules.replay import _sender_key, is_collective, replay, send_release
from pdcompile.runtime.schedules.transfers import (
    Message,
    Posts,
    _UNIT,
    check_transfers,
    endpoints,
    is_local,
    peers,
    rank_transfer_plan,
    receives_of,
    sends_of,
    transfer_plan,
    waits_of,
)

pytestmark = pytest.mark.timeout(300)


# --- the reference: transfers.py's whole-cluster replay as it was before #28 (full vector clocks) ---

@dataclass(frozen=True)
class _Sent:
    rank: int
    index: int
    clock: list[int]
    time: int


def _ref_send_clocks(sched: Schedule, replicas: Sequence[int], placement: Placement | None = None) -> dict[Message, _Sent]:
    """Each message -> who sends it, when, and what its sender knows then (vector clock; knowledge
    a message carries counts from the action that waits for it, ``F``/``B``)."""
    S = len(replicas)
    n = max(sched, default=-1) + 1
    vc = {r: [-1] * n for r in sched}
    now = {r: 0 for r in sched}
    out: dict[Message, _Sent] = {}

    def execute(parts: list[tuple[int, int]], a: Action) -> None:
        if a.kind in (Kind.ALLREDUCE, Kind.TIED_GRADS):
            both, t = [-1] * n, max(now[q] for q, _ in parts)
            for q, i in parts:
                vc[q][q] = i
                both = [max(x, y) for x, y in zip(both, vc[q])]
            for q, _ in parts:
                vc[q], now[q] = list(both), t
            return
        (r, i) = parts[0]
        vc[r][r] = i
        for m in waits_of(a, S):
            if m in out:
                vc[r] = [max(x, y) for x, y in zip(vc[r], out[m].clock)]
                now[r] = max(now[r], out[m].time)
        for m in sends_of(a, S):  # a target counts as sent with its activations (at F's end): they stay adjacent
            out[m] = _Sent(r, i, list(vc[r]), now[r] + _UNIT.get(a.kind, 0))
        now[r] += _UNIT.get(a.kind, 0)

    replay(sched, replicas, execute, name="transfer order", placement=placement)
    return out


def _ref_link_order(sched: Schedule, replicas: Sequence[int],
               placement: Placement | None = None) -> dict[tuple[int, int], list[Message]]:
    """Per pair of ranks ``(low, high)``, the order in which both issue their messages: a linear
    extension of happens-before (either side's sends in its own issue order; of two messages
    neither of which happens before the other, the one sent sooner if ``F``, ``B`` and ``W`` took
    1, 2 and 1 units, then the smaller microbatch)."""
    ranks = stage_ranks(replicas, placement)
    clocks = _ref_send_clocks(sched, replicas, placement)
    chains: dict[tuple[int, int], dict[int, list[Message]]] = {}
    for m, sent in sorted(clocks.items(), key=lambda kv: (kv[1].rank, kv[1].index, kv[0].kind != "T")):
        src, dst = endpoints(m, ranks)
        if src == dst:  # local: no message
            continue
        chains.setdefault((min(src, dst), max(src, dst)), {}).setdefault(src, []).append(m)

    def before(x: Message, y: Message) -> bool:  # x happens-before y
        return clocks[y].clock[clocks[x].rank] >= clocks[x].index

    def first(x: Message, y: Message) -> bool:  # x goes first: it must, or neither must and it is sent sooner
        if before(x, y) or before(y, x):
            return before(x, y)
        return (clocks[x].time, x) < (clocks[y].time, y)

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


def reference_transfer_plan(sched: Schedule, replicas: Sequence[int], placement: Placement | None = None) -> Posts:
    """Per rank and action index, the receive actions (``RF``/``RB``) to post just before that action.

    On each pair's :func:`link_order`, a receive goes after this rank's sends that precede it and
    before those that follow it, and after the pair's earlier receives; within that, as early as
    one computation (``F``/``B``) before its own ``RF``/``RB``, so its data can land while the rank
    computes. Every ``RF``/``RB`` is posted exactly once, at or before its own index. The pair order
    is happens-before; ties go to the message sent sooner in a unit-cost timing.
    """
    ranks = stage_ranks(replicas, placement)
    S = len(replicas)
    order = _ref_link_order(sched, replicas, placement)
    index: dict[Message, int] = {m: i for seq in order.values() for i, m in enumerate(seq)}
    posts: Posts = {r: [() for _ in acts] for r, acts in sched.items()}
    for r, acts in sched.items():
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
            posts[r][pos] = posts[r][pos] + (a,)
    return posts




# --- the cases: every built-in schedule, several rank and microbatch counts, replicas, virtual stages ---

def _cases() -> Iterator[tuple[str, Schedule, list[int], Placement | None]]:
    for name in SCHEDULES:
        for replicas, m, steps, tied in (([1, 1], 2, 2, False), ([1, 1, 1], 3, 2, True), ([1] * 4, 4, 2, False),
                                        ([2, 1], 4, 2, False), ([2, 2, 2], 4, 2, True), ([1, 3, 2], 6, 1, False)):
            try:
                sched = make_schedule(name, replicas, m, num_steps=steps, tied=tied)
            except UsageError:  # 1F1B: tied weights need equal replica counts
                assert name == "1f1b" and tied
                continue
            yield f"{name} {replicas} M={m}", sched, replicas, None
    for name in VIRTUAL_SCHEDULES:
        for p, m, steps in ((2, 4, 2), (3, 6, 1), (4, 8, 2)):
            v = 2  # stages per rank
            replicas = [1] * (p * v)
            sched = make_schedule(name, replicas, m, num_steps=steps, virtual_stages=v)
            place = layout(name, replicas, m, steps, virtual_stages=v).stage_ranks
            yield f"{name} p={p} M={m}", sched, replicas, place


CASES = list(_cases())


def test_the_cases_cover_every_built_in_schedule() -> None:
    assert {c.split()[0] for c, *_ in CASES} == set(SCHEDULES) | set(VIRTUAL_SCHEDULES)
    assert len(CASES) >= 40


def _peers_only(sched: Schedule, replicas: Sequence[int], r: int, place: Placement | None) -> Schedule:
    """Rank ``r``'s list and its peers' (every rank's with virtual stages), as a rank's start-up builds them."""
    if place is not None:
        return sched
    return {q: sched[q] for q in [r, *peers(sched, replicas, r)]}


def _uniform(replicas: Sequence[int], place: Placement | None) -> bool:
    return place is not None or len(set(replicas)) == 1


@pytest.mark.parametrize("case", range(len(CASES)), ids=[c for c, *_ in CASES])
def test_each_ranks_plan_from_its_peers_is_the_clusters_and_nccl_completes_it(case: int) -> None:
    """A rank's plan from its own and its peers' lists alone is the cluster's; NCCL's rules complete
    it (targets sent or not); it equals the whole-cluster replay's wherever every stage has as many
    replicas (one pipeline per replica: a pair's order reads the same times); with other replica
    counts the tie between two concurrent messages may go the other way."""
    _, sched, replicas, place = CASES[case]
    got = transfer_plan(sched, replicas, place)
    for r in sched:
        assert rank_transfer_plan(_peers_only(sched, replicas, r, place), replicas, r, place) == got[r], r
    for targets in (None, set()):
        check_transfers(sched, replicas, got, placement=place, targets=targets)
    if _uniform(replicas, place):
        assert got == reference_transfer_plan(sched, replicas, place)
    assert sum(len(p) for ps in got.values() for p in ps) > 0  # the plans post receives


def test_mixed_replicas_change_a_few_ties_and_nccl_still_completes() -> None:
    """Where the replay of a pair alone breaks a tie differently from the whole cluster's (1F1B on
    [2, 1]), the plans differ and both complete under NCCL's rules."""
    sched = make_schedule("1f1b", [2, 1], 4, num_steps=2)
    got, ref = transfer_plan(sched, [2, 1]), reference_transfer_plan(sched, [2, 1])
    assert got != ref
    for posts in (got, ref):
        check_transfers(sched, [2, 1], posts, targets=None)


@pytest.mark.parametrize("case", range(0, len(CASES), 3), ids=[c for c, *_ in CASES[::3]])
def test_each_ranks_send_release_from_its_peers_is_sound(case: int) -> None:
    """A rank's release from its own and its peers' lists is the cluster's and never lets a send go
    before the whole-cluster replay proves its receiver has it (it may later: knowledge that goes
    round through other replicas' all-reduces is not seen)."""
    _, sched, replicas, place = CASES[case]
    got, want = send_release(sched, replicas, place), _reference_send_release(sched, replicas, place)
    for r in sched:
        assert send_release(_peers_only(sched, replicas, r, place), replicas, place, ranks=[r]) == {r: got[r]}, r
        proven = {b: i for i, bs in want[r].items() for b in bs}
        for i, bs in got[r].items():
            for b in bs:
                assert b in proven and proven[b] <= i, (r, b, i)
    if _uniform(replicas, place) and not any(a.kind is Kind.ALLREDUCE for acts in sched.values() for a in acts):
        assert got == want


def test_a_rank_builds_only_its_own_list() -> None:
    for name, replicas, m, kw in (("flush", [2, 3, 1], 6, {}), ("1f1b", [2, 2], 4, {"vertical_sync": True}),
                                  ("zb-v", [1] * 4, 4, {"virtual_stages": 2})):
        full = make_schedule(name, replicas, m, num_steps=2, **kw)
        for r in full:
            assert make_schedule(name, replicas, m, num_steps=2, ranks=[r], **kw) == {r: full[r]}


def test_a_deadlock_is_still_named() -> None:
    sched = make_schedule("gpipe", [1, 1], 2, split_backward=False)
    sched = {0: sched[0], 1: [a for a in sched[1] if not (a.kind is Kind.SEND_GRAD and a.mb == 0)]}
    with pytest.raises(ScheduleError, match="no deadlock"):
        transfer_plan(sched, [1, 1])


def _reference_send_release(sched: Schedule, replicas: Sequence[int], placement: Placement | None = None, *,
                 step_collective: bool = False) -> dict[int, dict[int, list[Action]]]:
    """replay.send_release as it was before #28: full vector clocks over every rank."""
    ranks = stage_ranks(replicas, placement)
    last = len(ranks) - 1
    all_ranks = sorted(sched)
    n = max(all_ranks, default=-1) + 1
    pos = {r: {(a.kind, a.microbatch): i for i, a in enumerate(acts)} for r, acts in sched.items()}
    vc = {r: [-1] * n for r in all_ranks}
    snapshot: dict[tuple[Kind, int, int], list[int]] = {}  # a send -> its sender's clock then
    merge_at: dict[int, dict[tuple[Kind, int], list[int]]] = {r: {} for r in all_ranks}
    open_: dict[int, list[tuple[int, int, Action]]] = {r: [] for r in all_ranks}  # (peer, its index, send)
    out: dict[int, dict[int, list[Action]]] = {r: {} for r in all_ranks}

    def merge(into: list[int], other: list[int]) -> None:
        for q in range(n):
            if other[q] > into[q]:
                into[q] = other[q]

    def release(r: int, i: int) -> None:
        keep = []
        for peer, at, send in open_[r]:
            if vc[r][peer] >= at:
                out[r].setdefault(i, []).append(send)
            else:
                keep.append((peer, at, send))
        open_[r] = keep

    def execute(parts: list[tuple[int, int]], a: Action) -> None:
        if is_collective(a, step_collective):
            both = [-1] * n
            for q, i in parts:
                vc[q][q] = i
                merge(both, vc[q])
            for q, i in parts:
                vc[q] = list(both)
                release(q, i)
            return
        (r, i), k = parts[0], (a.microbatch if a.microbatch is not None else -1)
        vc[r][r] = i
        if a.kind in (Kind.FORWARD, Kind.BACKWARD) and (a.kind, k) in merge_at[r]:
            merge(vc[r], merge_at[r].pop((a.kind, k)))
        if a.kind in (Kind.RECV_ACT, Kind.RECV_GRAD):
            use = Kind.FORWARD if a.kind is Kind.RECV_ACT else Kind.BACKWARD
            merge_at[r][(use, k)] = snapshot[_sender_key(a)]
        elif a.kind in (Kind.SEND_ACT, Kind.SEND_GRAD):
            snapshot[(a.kind, a.stage, k)] = list(vc[r])
            to = a.stage + 1 if a.kind is Kind.SEND_ACT else a.stage - 1
            peer = rank_of(to, k, ranks)
            use = Kind.FORWARD if a.kind is Kind.SEND_ACT else Kind.BACKWARD
            open_[r].append((peer, pos[peer][(use, k)], a))
        elif a.kind is Kind.FORWARD and a.stage == 0 and last > 0:  # the target, sent to the last stage
            peer = rank_of(last, k, ranks)
            open_[r].append((peer, pos[peer][(Kind.FORWARD, k)], a))
        release(r, i)

    replay(sched, replicas, execute, name="send release", placement=placement, step_collective=step_collective)
    return out



@pytest.mark.parametrize("name,replicas,m,virtual", [("flush", [2, 1, 1], 2, 1), ("1f1b", [1, 1, 1], 3, 1),
                                                     ("interleaved-1f1b", [1] * 4, 4, 2), ("zb-v", [1] * 4, 4, 2)])
def test_the_periodic_form_runs_what_the_reference_laid_out_whole(name: str, replicas: list[int], m: int,
                                                                  virtual: int) -> None:
    """A rank's run of many steps (its head, period and tail, each action with its sends released and
    receives posted) is the schedule laid out whole with the reference's release and plan."""
    from pdcompile.runtime.schedules.periodic import rank_run

    steps = 14
    sched = make_schedule(name, replicas, m, num_steps=steps, virtual_stages=virtual)
    place = layout(name, replicas, m, steps, virtual_stages=virtual).stage_ranks if virtual > 1 else None
    release, posts = _reference_send_release(sched, replicas, place), reference_transfer_plan(sched, replicas, place)
    for r in sched:
        run = rank_run(name, replicas, m, steps, r, virtual_stages=virtual)
        assert run.repeats > 0, r  # the periodic form, not the whole run laid out
        want = [(a, tuple(release[r].get(i, ())), posts[r][i]) for i, a in enumerate(sched[r])]
        assert list(run.steps()) == want, r


def test_plan_json_checks_every_rank_by_digest_and_spells_out_a_few() -> None:
    from pdcompile.runtime.schedules.spec import CHECK_TEXT_RANKS, ScheduleSpec, agrees

    spec = ScheduleSpec("flush", (2,) * 16, 8)  # 32 ranks
    raw = json.loads(json.dumps(spec.to_json()))
    check = raw["check"]
    assert sorted(map(int, check["digests"])) == list(range(32))
    assert sorted(map(int, check["ranks"])) == list(range(CHECK_TEXT_RANKS))
    lists = spec.make(check["steps"])
    for r in (0, CHECK_TEXT_RANKS - 1, CHECK_TEXT_RANKS, 31):
        assert agrees(spec, raw, r)
    assert " ".join(map(str, lists[3])) == check["ranks"]["3"]
    # a digest of another list is refused, with or without the text beside it
    for r in (3, 20):
        bad = json.loads(json.dumps(raw))
        bad["check"]["digests"][str(r)] = bad["check"]["digests"][str(r + 1)]
        assert not agrees(spec, bad, r) and agrees(spec, bad, r + 1)
    # a rank the check does not name is refused
    gone = json.loads(json.dumps(raw))
    del gone["check"]["digests"]["20"]
    assert not agrees(spec, gone, 20)
    # an older plan.json: every rank's text, no digests
    old = {**raw, "check": {"steps": check["steps"], "ranks": {str(r): " ".join(map(str, a)) for r, a in lists.items()}}}
    assert all(agrees(spec, old, r) for r in (0, 20, 31))
    old["check"]["ranks"]["20"] = old["check"]["ranks"]["20"].replace("F", "B", 1)
    assert not agrees(spec, old, 20) and agrees(spec, old, 21)
    # a different schedule with the same shape fails every rank's check
    other = ScheduleSpec("gpipe", (2,) * 16, 8)
    assert not any(agrees(other, raw, r) for r in range(32))


def test_plan_json_stays_small_at_a_thousand_ranks() -> None:
    from pdcompile.runtime.schedules.spec import ScheduleSpec, agrees

    spec = ScheduleSpec("flush", (64,) * 16, 512)  # 1,024 ranks, 8 microbatches each per step
    raw = json.loads(json.dumps(spec.to_json()))
    text = json.dumps(raw)
    assert len(raw["check"]["digests"]) == 1024
    assert len(text) < 64 * 1024, len(text)  # a digest per rank; every rank's lists were megabytes
    full = sum(len(" ".join(map(str, a))) for a in spec.make(2).values())
    assert full > 10 * len(text)
    assert agrees(spec, raw, 1000) and agrees(spec, raw, 5)
