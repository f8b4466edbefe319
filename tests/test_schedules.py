"""Schedules as data: generation, printing/parsing, validation, weight versions (no torch)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdcompile.errors import ScheduleError, UsageError
from pdcompile.runtime.schedules import (
    SCHEDULES,
    Action,
    Kind,
    flush,
    format_grid,
    forward_versions,
    gpipe,
    live_versions,
    make_schedule,
    parse_grid,
    peak_in_flight,
    peak_weight_versions,
    rank_of,
    replay,
    stage_of_rank,
    stage_ranks,
    validate,
    warmup_depth,
)

# ------------------------------------------------------------------------------------------------
# actions, ranks


@pytest.mark.parametrize("text", ["1F3", "2B0", "0SF1", "1RF1", "1SB12", "0RB1", "0AR", "3TG", "0ST", "2WV7"])
def test_action_round_trip(text: str) -> None:
    a = Action.from_str(text)
    assert str(a) == text
    assert Action.from_str(str(a)) == a


@pytest.mark.parametrize("text", ["F3", "1X3", "1F", "0ST3", "0WV", "1 F3", ""])
def test_action_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="not an action"):
        Action.from_str(text)


def test_weight_version_action() -> None:
    """A weight version is its own field: WV has one and no microbatch, the others the reverse."""
    a = Action(0, Kind.WEIGHT_VERSION, version=2)
    assert a.version == 2 and a.microbatch is None and str(a) == "0WV2" and Action.from_str("0WV2") == a
    assert Action(0, Kind.FORWARD, 1).version is None and Action(0, Kind.FORWARD, 1).mb == 1
    for bad in (lambda: Action(0, Kind.WEIGHT_VERSION, 2), lambda: Action(0, Kind.FORWARD, 1, version=1),
                lambda: Action(0, Kind.STEP).mb):
        with pytest.raises(ValueError):
            bad()


def test_stage_ranks_and_round_robin() -> None:
    ranks = stage_ranks([2, 1, 3])
    assert ranks == [[0, 1], [2], [3, 4, 5]]
    assert [rank_of(0, k, ranks) for k in range(5)] == [0, 1, 0, 1, 0]
    assert [rank_of(2, k, ranks) for k in range(5)] == [3, 4, 5, 3, 4]
    with pytest.raises(UsageError):
        stage_ranks([1, 0])


def test_warmup_depth_is_pipedreams() -> None:
    # PipeDream runtime: num_warmup_minibatches = (ranks after the earlier stages - 1) // r_s; + 1
    assert [warmup_depth([1, 1, 1, 1], s) for s in range(4)] == [4, 3, 2, 1]
    assert [warmup_depth([2, 1], s) for s in range(2)] == [2, 1]  # NOAM = ceil(3 / 2)
    assert [warmup_depth([3, 1], s) for s in range(2)] == [2, 1]
    assert [warmup_depth([1, 2], s) for s in range(2)] == [3, 1]


# ------------------------------------------------------------------------------------------------
# golden grids


def test_golden_1f1b_4_stages_8_microbatches() -> None:
    sched = make_schedule("1f1b", [1, 1, 1, 1], 8)
    assert format_grid(sched) == """\
rank 0: 0F0 0F1 0F2 0F3 0B0 0ST 0F4 0B1 0ST 0F5 0B2 0ST 0F6 0B3 0ST 0F7 0B4 0ST 0B5 0ST 0B6 0ST 0B7 0ST
rank 1: 1F0 1F1 1F2 1B0 1ST 1F3 1B1 1ST 1F4 1B2 1ST 1F5 1B3 1ST 1F6 1B4 1ST 1F7 1B5 1ST 1B6 1ST 1B7 1ST
rank 2: 2F0 2F1 2B0 2ST 2F2 2B1 2ST 2F3 2B2 2ST 2F4 2B3 2ST 2F5 2B4 2ST 2F6 2B5 2ST 2F7 2B6 2ST 2B7 2ST
rank 3: 3F0 3B0 3ST 3F1 3B1 3ST 3F2 3B2 3ST 3F3 3B3 3ST 3F4 3B4 3ST 3F5 3B5 3ST 3F6 3B6 3ST 3F7 3B7 3ST"""
    # every action, stage 1 of the 4: receive, forward, send; stash-aware version switches
    assert format_grid({1: sched[1][:16]}, compute_only=False) == (
        "rank 1: 1RF0 1F0  1SF0 1RF1 1F1  1SF1 1RF2 1F2  1SF2 1RB0 1B0  1SB0 1ST  1WV1 1RF3 1F3")


def test_golden_1f1b_rr_2_1() -> None:
    # stage 0 on ranks 0 and 1 (even / odd microbatches), stage 1 on rank 2; NOAM = ceil(3/2) = 2;
    # the replicas all-reduce after each backward and step together, once per 2 microbatches.
    sched = make_schedule("1f1b", [2, 1], 6)
    assert format_grid(sched, compute_only=False) == """\
rank 0: 0F0  0SF0 0F2  0SF2 0RB0 0B0  0AR  0ST  0WV1 0F4  0SF4 0RB2 0B2  0AR  0ST  0RB4 0B4  0AR  0ST
rank 1: 0F1  0SF1 0F3  0SF3 0RB1 0B1  0AR  0ST  0WV1 0F5  0SF5 0RB3 0B3  0AR  0ST  0RB5 0B5  0AR  0ST
rank 2: 1RF0 1F0  1B0  1SB0 1ST  1WV1 1RF1 1F1  1B1  1SB1 1ST  1WV2 1RF2 1F2  1B2  1SB2 1ST  1WV3 1RF3 1F3  1B3  1SB3 1ST  1WV4 1RF4 1F4  1B4  1SB4 1ST  1WV5 1RF5 1F5  1B5  1SB5 1ST"""
    assert make_schedule("1f1b", [2, 1], 6) == sched


def test_golden_flush_and_gpipe() -> None:
    assert format_grid(make_schedule("flush", [1, 1, 1], 4, split_backward=False)) == """\
rank 0: 0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3 0ST
rank 1: 1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3 1ST
rank 2: 2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3 2ST"""
    assert format_grid(make_schedule("gpipe", [1, 1], 3, split_backward=False)) == """\
rank 0: 0F0 0F1 0F2 0B2 0B1 0B0 0ST
rank 1: 1F0 1F1 1F2 1B2 1B1 1B0 1ST"""
    # the default splits every later stage's last backward of a step: W right after its SB
    assert format_grid(make_schedule("flush", [1, 1, 1], 4), compute_only=False).splitlines()[1:] == [
        "rank 1: 1RF0 1F0  1SF0 1RF1 1F1  1SF1 1RB0 1B0  1SB0 1RF2 1F2  1SF2 1RB1 1B1  1SB1 1RF3 1F3  1SF3 "
        "1RB2 1B2  1SB2 1RB3 1B3  1SB3 1W3  1ST",
        "rank 2: 2RF0 2F0  2B0  2SB0 2RF1 2F1  2B1  2SB1 2RF2 2F2  2B2  2SB2 2RF3 2F3  2B3  2SB3 2W3  2ST"]
    assert format_grid(make_schedule("gpipe", [1, 2], 3, num_steps=2)) == """\
rank 0: 0F0 0F1 0F2 0B2 0B1 0B0 0ST 0F3 0F4 0F5 0B5 0B4 0B3 0ST
rank 1: 1F0 1F2 1B2 1B0 1W0 1ST 1F4 1B4 1W4 1ST
rank 2: 1F1 1B1 1W1 1ST 1F3 1F5 1B5 1B3 1W3 1ST"""
    for name in ("1f1b", "2bw"):  # weight versions: nothing to split
        assert make_schedule(name, [1, 1], 4) == make_schedule(name, [1, 1], 4, split_backward=False)
    assert gpipe(2, 3) == make_schedule("gpipe", [1, 1], 3)
    assert flush(3, 4, tied=True) == make_schedule("flush", [1, 1, 1], 4, tied=True)


def test_golden_2bw() -> None:
    # 2 stages, steps of 2 microbatches: step t's forwards use version max(0, t - 1)
    sched = make_schedule("2bw", [1, 1], 2, num_steps=3)
    assert format_grid(sched, compute_only=False) == """\
rank 0: 0F0  0SF0 0F1  0SF1 0RB0 0B0  0F2  0SF2 0RB1 0B1  0ST  0F3  0SF3 0WV1 0RB2 0B2  0F4  0SF4 0RB3 0B3  0ST  0F5  0SF5 0RB4 0B4  0RB5 0B5  0ST
rank 1: 1RF0 1F0  1B0  1SB0 1RF1 1F1  1B1  1SB1 1ST  1RF2 1F2  1B2  1SB2 1RF3 1F3  1WV1 1B3  1SB3 1ST  1RF4 1F4  1B4  1SB4 1RF5 1F5  1B5  1SB5 1ST"""


# ------------------------------------------------------------------------------------------------
# printing and parsing


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("replicas", [[1], [1, 1, 1], [2, 1], [1, 3, 2]])
def test_grid_round_trip(name: str, replicas: list[int]) -> None:
    sched = make_schedule(name, replicas, 5, num_steps=2)
    assert parse_grid(format_grid(sched, compute_only=False)) == sched
    compute = parse_grid(format_grid(sched))
    assert compute == {r: [a for a in acts if a.kind in (Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT_GRAD, Kind.STEP)]
                       for r, acts in sched.items()}


def test_parse_grid_errors_and_empty_rows() -> None:
    assert parse_grid("rank 0: 0F0 0B0 0ST\nrank 1:\n") == {
        0: [Action(0, Kind.FORWARD, 0), Action(0, Kind.BACKWARD, 0), Action(0, Kind.STEP)], 1: []}
    with pytest.raises(ValueError, match="line 2"):
        parse_grid("rank 0: 0F0\nrnk 1: 1F0")
    with pytest.raises(ValueError, match="line 1: not an action"):
        parse_grid("rank 0: 0F0 0Q1")
    with pytest.raises(ValueError, match="twice"):
        parse_grid("rank 0: 0F0\nrank 0: 0B0")


# ------------------------------------------------------------------------------------------------
# validate accepts every generated schedule (property test)

configs = st.tuples(
    st.sampled_from(SCHEDULES),
    st.lists(st.integers(1, 3), min_size=1, max_size=8),  # replicas of stages 1..8
    st.integers(1, 16),  # microbatches
    st.integers(1, 3),  # steps
    st.booleans(),  # vertical sync
    st.booleans(),  # tied
)


@settings(max_examples=400, deadline=None)
@given(configs)
def test_every_generated_schedule_validates(cfg: tuple) -> None:
    name, replicas, m, steps, vs, tied = cfg
    if tied and name.startswith("1f1b") and len(set(replicas)) > 1:
        with pytest.raises(UsageError, match="tied"):
            make_schedule(name, replicas, m, tied=tied, vertical_sync=vs, num_steps=steps)
        return
    sched = make_schedule(name, replicas, m, tied=tied, vertical_sync=vs, num_steps=steps)
    validate(sched, replicas, m, name, num_steps=steps, vertical_sync=vs)
    # every forward and backward exactly once, on the round-robin replica
    ranks = stage_ranks(replicas)
    seen = sorted((a.stage, a.kind.value, a.microbatch, r) for r, acts in sched.items() for a in acts
                  if a.kind in (Kind.FORWARD, Kind.BACKWARD))
    assert seen == sorted((s, k, mb, rank_of(s, mb, ranks)) for s in range(len(replicas))
                          for mb in range(m * steps) for k in "FB")
    # memory promises
    versions, inflight = peak_weight_versions(sched), peak_in_flight(sched)
    for s, rs in enumerate(ranks):
        for r in rs:
            assert inflight[r] <= (-(-m // replicas[s]) if name == "gpipe" else warmup_depth(replicas, s))
            if name in ("gpipe", "flush"):
                assert versions[r] == 1
            elif name == "2bw":
                assert versions[r] <= 2
            elif not vs:
                assert versions[r] <= warmup_depth(replicas, s)


# ------------------------------------------------------------------------------------------------
# weight versions: what each schedule promises


def test_1f1b_versions_and_stash_depth() -> None:
    S, N = 4, 12
    sched = make_schedule("1f1b", [1] * S, N)
    for s in range(S):
        w = S - s
        assert forward_versions(sched[s]) == {n: max(0, n - w + 1) for n in range(N)}
    assert peak_weight_versions(sched) == {0: 4, 1: 3, 2: 2, 3: 1}
    assert peak_in_flight(sched) == {0: 4, 1: 3, 2: 2, 3: 1}


def test_1f1b_vertical_sync_versions() -> None:
    S, N = 4, 12
    plain = make_schedule("1f1b", [1] * S, N)
    sched = make_schedule("1f1b", [1] * S, N, vertical_sync=True)
    for s in range(S):  # every stage uses the version the input stage had: max(0, n - NOAM + 1)
        assert forward_versions(sched[s]) == {n: max(0, n - S + 1) for n in range(N)}
        # same order of compute and communication; only the WV actions differ
        strip = [a for a in sched[s] if a.kind is not Kind.WEIGHT_VERSION]
        assert strip == [a for a in plain[s] if a.kind is not Kind.WEIGHT_VERSION]
    assert peak_weight_versions(sched) == {0: 4, 1: 4, 2: 4, 3: 4}
    validate(sched, [1] * S, N, "1f1b", vertical_sync=True)
    with pytest.raises(ScheduleError, match="'weight versions'"):
        validate(sched, [1] * S, N, "1f1b")


def test_1f1b_vertical_sync_with_replicas() -> None:
    # input stage replicated twice: after c steps there it has the updates of minibatches < 2c
    sched = make_schedule("1f1b", [2, 1], 10, vertical_sync=True)
    ranks = stage_ranks([2, 1])
    steps_before = {}
    for r in ranks[0]:
        c = 0
        for a in sched[r]:
            c += a.kind is Kind.STEP
            if a.kind is Kind.FORWARD:
                steps_before[a.microbatch] = c
    assert forward_versions(sched[2]) == {n: 2 * steps_before[n] for n in range(10)}


def test_2bw_versions_and_two_buffers() -> None:
    M, steps = 4, 5
    sched = make_schedule("2bw", [1, 1, 1, 1], M, num_steps=steps)
    for r, acts in sched.items():
        assert forward_versions(acts) == {n: max(0, n // M - 1) for n in range(M * steps)}
        assert sum(a.kind is Kind.STEP for a in acts) == steps
    assert peak_weight_versions(sched) == {0: 2, 1: 2, 2: 2, 3: 2}
    # no flush: stage 0 starts step 1's forwards before step 0's last backward
    order = [str(a) for a in sched[0] if a.kind in (Kind.FORWARD, Kind.BACKWARD)]
    assert order.index("0F4") < order.index("0B3")


def test_live_versions_rule() -> None:
    acts = make_schedule("1f1b", [1, 1], 4)[0]  # stage 0 of 2: 0F0 0F1 0B0 0ST 0WV1 0F2 ...
    live = live_versions(acts)
    text = [str(a) for a in acts]
    assert live[text.index("0F1")] == {0}
    assert live[text.index("0ST")] == {0, 1}  # microbatch 1 in flight on version 0; 1 is newest
    assert live[-1] == {4}
    with_vs = live_versions(make_schedule("1f1b", [1, 1, 1], 6, vertical_sync=True)[2])
    assert max(map(len, with_vs)) == 3


def test_flush_multi_step_is_synchronous() -> None:
    sched = make_schedule("flush", [2, 1], 3, num_steps=2)
    for r, acts in sched.items():
        fv = forward_versions(acts)
        assert fv == {mb: mb // 3 for mb in fv}
        text = [str(a) for a in acts]
        assert text.index(f"{acts[0].stage}ST") < min(i for i, a in enumerate(acts)
                                                      if a.kind is Kind.FORWARD and a.microbatch >= 3)


# ------------------------------------------------------------------------------------------------
# make_schedule arguments


def test_make_schedule_rejects_bad_arguments() -> None:
    with pytest.raises(UsageError, match="unknown schedule"):
        make_schedule("pipedream", [1, 1], 4)
    with pytest.raises(UsageError, match="num_microbatches"):
        make_schedule("1f1b", [1, 1], 0)
    with pytest.raises(UsageError, match="tied"):
        make_schedule("1f1b", [2, 1], 4, tied=True)
    make_schedule("1f1b", [2, 2], 4, tied=True)  # equal replica counts: steps line up


def test_fewer_microbatches_than_replicas() -> None:
    # replica 2 of stage 0 has nothing in step 0: it joins the all-reduce with zeros
    sched = make_schedule("flush", [3, 1], 2, num_steps=2)
    validate(sched, [3, 1], 2, "flush", num_steps=2)
    assert [str(a) for a in sched[2]][:3] == ["0AR", "0ST", "0WV1"]


# ------------------------------------------------------------------------------------------------
# validate rejects hand-broken schedules with the right rule


def _swap(acts: list[Action], a: str, b: str) -> list[Action]:
    text = [str(x) for x in acts]
    i, j = text.index(a), text.index(b)
    acts = list(acts)
    acts[i], acts[j] = acts[j], acts[i]
    return acts


def _expect(rule: str, sched: dict, replicas: list[int], m: int, name: str, at: str | None = None,
            **kw: object) -> ScheduleError:
    with pytest.raises(ScheduleError) as err:
        validate(sched, replicas, m, name, **kw)
    msg = str(err.value)
    assert f"breaks rule '{rule}'" in msg, msg
    assert "<-- ERROR HERE" in msg if at is not None else True
    if at is not None:
        # the caret sits under the named action
        lines = msg.splitlines()
        k = next(i for i, l in enumerate(lines) if "<-- ERROR HERE" in l)
        col = lines[k].index("^")
        assert lines[k - 1][col:].split()[0] == at, msg
    return err.value


def test_rejects_wrong_rank_set_and_stage() -> None:
    sched = make_schedule("1f1b", [1, 1], 4)
    _expect("ranks", {0: sched[0]}, [1, 1], 4, "1f1b")
    bad = dict(sched)
    bad[0] = [Action(1, Kind.FORWARD, 0)] + sched[0][1:]
    _expect("ranks", bad, [1, 1], 4, "1f1b", at="1F0")


def test_rejects_round_robin_violation() -> None:
    sched = make_schedule("1f1b", [2, 1], 4)
    bad = dict(sched)
    # replica 0 receives microbatch 1's gradient, which belongs to replica 1
    bad[0] = [Action(0, Kind.RECV_GRAD, 1) if str(a) == "0RB0" else a for a in sched[0]]
    _expect("round-robin routing", bad, [2, 1], 4, "1f1b", at="0RB1")


def test_rejects_duplicate_or_missing_compute() -> None:
    sched = make_schedule("gpipe", [1, 1], 3)
    bad = dict(sched)
    bad[1] = [a for a in sched[1] if str(a) != "1B1"]
    _expect("each forward and backward once", bad, [1, 1], 3, "gpipe")
    bad[1] = sched[1] + [Action(1, Kind.FORWARD, 0)]
    _expect("each forward and backward once", bad, [1, 1], 3, "gpipe")


def test_rejects_unmatched_send_recv() -> None:
    sched = make_schedule("flush", [1, 1], 3)
    bad = dict(sched)
    bad[1] = [a for a in sched[1] if str(a) != "1RF2"]
    _expect("send/recv pairs matched", bad, [1, 1], 3, "flush", at="1F2")
    bad[1] = _swap(sched[1], "1RF2", "1F2")  # receive after the forward that needs it
    _expect("send/recv pairs matched", bad, [1, 1], 3, "flush", at="1RF2")


def test_rejects_backward_before_forward() -> None:
    sched = make_schedule("gpipe", [1], 2)  # one stage: no transfers in the way
    bad = {0: _swap(sched[0], "0F1", "0B1")}
    _expect("backward after forward", bad, [1], 2, "gpipe", at="0B1")


def test_rejects_forward_order() -> None:
    sched = make_schedule("gpipe", [1], 3)
    bad = {0: _swap(sched[0], "0F0", "0F1")}
    _expect("forward order", bad, [1], 3, "gpipe", at="0F0")


def test_rejects_in_flight_bound() -> None:
    # 1F1B with a gpipe-like warm-up on the last stage: 2 in flight where 1 is allowed
    sched = make_schedule("flush", [1, 1], 2)
    bad = dict(sched)
    bad[1] = parse_grid("rank 1: 1RF0 1F0 1RF1 1F1 1B0 1SB0 1B1 1SB1 1ST")[1]
    _expect("in-flight bound", bad, [1, 1], 2, "flush", at="1F1")


def test_rejects_misplaced_steps() -> None:
    sched = make_schedule("1f1b", [1, 1], 4)
    bad = dict(sched)
    bad[1] = [a for a in sched[1] if a.kind not in (Kind.STEP, Kind.WEIGHT_VERSION)] + [Action(1, Kind.STEP)] * 4
    _expect("steps", bad, [1, 1], 4, "1f1b", at="1B1")  # 1F1B steps after every backward
    # the step after a forward that should already see its update
    bad[0] = parse_grid("rank 0: 0F0 0SF0 0F1 0SF1 0RB0 0B0 0F2 0SF2 0ST 0WV1 0RB1 0B1 0ST 0F3 0SF3 0RB2 0B2 0ST "
                        "0RB3 0B3 0ST")[0]
    bad[1] = sched[1]
    _expect("steps", bad, [1, 1], 4, "1f1b", at="0ST")
    sched = make_schedule("flush", [1, 1], 2, tied=True)
    _expect("steps", {0: sched[0], 1: [a for a in sched[1] if a.kind is not Kind.TIED_GRADS]}, [1, 1], 2, "flush")
    sched = make_schedule("1f1b", [2, 1], 4)
    bad = dict(sched)
    bad[0] = [a for a in sched[0] if a.kind is not Kind.ALLREDUCE]
    _expect("steps", bad, [2, 1], 4, "1f1b", at="0ST")


def test_rejects_wrong_weight_version() -> None:
    sched = make_schedule("2bw", [1, 1], 2, num_steps=3)
    bad = dict(sched)
    bad[0] = [Action(0, Kind.WEIGHT_VERSION, version=2) if str(a) == "0WV1" else a for a in sched[0]]
    _expect("weight versions", bad, [1, 1], 2, "2bw", at="0WV2", num_steps=3)
    bad[0] = [a for a in sched[0] if a.kind is not Kind.WEIGHT_VERSION]  # no stashing switch at all
    _expect("weight versions", bad, [1, 1], 2, "2bw", at="0F4", num_steps=3)


def test_rejects_deadlock_and_names_the_cycle() -> None:
    ok = parse_grid("""\
rank 0: 0F0 0F1 0SF1 0SF0 0RB1 0B1 0RB0 0B0 0ST
rank 1: 1RF0 1F0 1RF1 1F1 1B1 1SB1 1B0 1SB0 1ST""")
    validate(ok, [1, 1], 2, "gpipe")  # sends out of order are fine: they don't block
    # rank 0 waits for microbatch 1's gradient before sending its activations: every pair rule
    # holds (each send after its compute, each receive before), but the two ranks wait on each other
    bad = parse_grid("""\
rank 0: 0F0 0SF0 0F1 0RB1 0SF1 0B1 0RB0 0B0 0ST
rank 1: 1RF0 1F0 1RF1 1F1 1B1 1SB1 1B0 1SB0 1ST""")
    err = _expect("no deadlock", bad, [1, 1], 2, "gpipe", at="0RB1")
    assert "rank 0 waits at 0RB1 (step 3) for 1SB1 from rank 1" in str(err)
    assert "rank 1 waits at 1RF1 (step 2) for 0SF1 from rank 0" in str(err)


def test_replay_detects_collective_cycles() -> None:
    sched = parse_grid("rank 0: 0TG 0F0 0SF0 0RB0 0B0 0ST\nrank 1: 1RF0 1F0 1B0 1SB0 1TG 1ST")
    with pytest.raises(ScheduleError, match="rank 0 waits at 0TG .*for ranks \\[1\\] to join.*rank 1 waits at 1RF0"):
        replay(sched, [1, 1])
    sched = parse_grid("rank 0: 0F0 0B0 0AR 0ST 0AR 0ST\nrank 1: 0F1 0B1 0AR 0ST")
    with pytest.raises(ScheduleError, match="rank 0 waits at 0AR .*rank 1 finished without it"):
        replay(sched, [2])


def test_replay_reports_missing_sender() -> None:
    sched = parse_grid("rank 0: 0F0 0ST\nrank 1: 1RF0 1F0 1ST")
    with pytest.raises(ScheduleError, match="no deadlock.*rank 1 waits at 1RF0.*finished without it"):
        replay(sched, [1, 1])


# ------------------------------------------------------------------------------------------------
# version_copies: what the simulator charges for weight stashing, against the real store


@pytest.mark.parametrize("parts", [False, True], ids=["read-whole", "read-in-parts"])
@pytest.mark.parametrize("name,replicas,m,steps", [
    ("1f1b", [1, 1, 1], 4, 2), ("1f1b", [2, 1], 4, 2), ("2bw", [1, 1], 4, 3), ("flush", [1, 1], 4, 2),
    ("gpipe", [1, 1, 1], 3, 2), ("1f1b", [2, 1], 4, 1), ("1f1b", [1, 1, 1], 1, 9), ("2bw", [1, 1, 1], 2, 6)])
def test_version_copies_match_the_versioned_store(name: str, replicas: list[int], m: int, steps: int,
                                                  parts: bool) -> None:
    """The store clones exactly what version_copies charges, whether it reads the whole action list
    first or, as the runtime does on a long run, in parts RankRun.reach ahead of the running action."""
    import torch

    from pdcompile.runtime.schedules import Kind, rank_run, version_copies
    from pdcompile.runtime.weights import VersionedStore

    class Counting(VersionedStore):
        def _materialize(self, v: int) -> dict[str, torch.Tensor]:
            if v not in self.clones:
                self.made += 1
            return super()._materialize(v)

    sched = make_schedule(name, replicas, m, num_steps=steps)
    total = sum(sum(version_copies(acts)) for acts in sched.values())
    assert (total > 0) == (name not in ("flush", "gpipe")), total  # only stashing schedules copy
    for rank, acts in sched.items():
        store = Counting(torch.nn.Linear(2, 2))
        store.made = 0
        reach = rank_run(name, replicas, m, steps, rank).reach
        read = 0
        if not parts:
            store.expect(acts)
        got = []
        for i, a in enumerate(acts):
            if parts and read < min(len(acts), i + reach + 1):  # in uneven parts, as steps come
                n = min(len(acts), i + reach + 1 + i % 3)
                store.expect(acts[read:n], more=n < len(acts))
                read = n
            before, accumulates = store.made, False
            if a.kind is Kind.WEIGHT_VERSION:
                store.set_forward_version(a.version)
            elif a.kind is Kind.FORWARD:
                store.params_for_forward(a.microbatch)
            elif a.kind is Kind.BACKWARD:  # a backward leaves gradients where its forward's weights were
                if a.microbatch in store.cloned:
                    for t in store.clones[store.inflight[a.microbatch]].values():
                        t.grad = torch.ones_like(t)
                    accumulates = any(p.grad is not None for p in store.params.values())
                else:
                    for p in store.params.values():
                        p.grad = torch.ones_like(p) if p.grad is None else p.grad + 1
                store.after_backward(a.microbatch)
            elif a.kind is Kind.STEP:
                store.before_step()
                for p in store.params.values():
                    p.grad = None  # the executor's zero_grad(set_to_none=True)
                store.after_step()
            got.append(store.made - before + accumulates)
        # the store clones at the first forward that needs a version, version_copies charges the ST
        # that makes it old: the same count per step, so compare totals and backward positions
        want = version_copies(acts)
        assert sum(got) == sum(want), (rank, got, want)
        assert [g for g, a in zip(got, acts) if a.kind is Kind.BACKWARD] == \
               [w for w, a in zip(want, acts) if a.kind is Kind.BACKWARD], rank


# ------------------------------------------------------------------------------------------------
# split backward (W)


@pytest.mark.parametrize("name", ["gpipe", "flush"])
@pytest.mark.parametrize("replicas", [[1, 1], [1, 1, 1], [2, 1], [1, 2, 2]])
def test_split_backward_placement(name: str, replicas: list[int]) -> None:
    # every rank of a stage after the first splits exactly its last backward of each step; W sits
    # right after that backward's SB, before the step's collectives; stage 0 never splits
    sched = make_schedule(name, replicas, 4, num_steps=2, tied=True)
    validate(sched, replicas, 4, name, num_steps=2)
    ranks = stage_ranks(replicas)
    for r, acts in sched.items():
        s = stage_of_rank(r, ranks)
        text = [str(a) for a in acts]
        ws = [a for a in acts if a.kind is Kind.WEIGHT_GRAD]
        if s == 0:
            assert not ws
            continue
        steps = [i for i, a in enumerate(acts) if a.kind is Kind.STEP]
        assert len(ws) == len(steps) == 2
        lo = 0
        for w, st_at in zip(ws, steps):
            last_b = max(i for i in range(lo, st_at) if acts[i].kind is Kind.BACKWARD)
            assert acts[last_b].microbatch == w.microbatch
            assert text[last_b + 1:last_b + 3] == [f"{s}SB{w.microbatch}", str(w)]
            lo = st_at
    assert make_schedule(name, replicas, 4, split_backward=False) == {
        r: [a for a in acts if a.kind is not Kind.WEIGHT_GRAD] for r, acts in make_schedule(name, replicas, 4).items()}


def test_rejects_misplaced_weight_grad() -> None:
    sched = make_schedule("flush", [1, 1], 2)
    # W before its SB
    _expect("split backward", {0: sched[0], 1: _swap(sched[1], "1SB1", "1W1")}, [1, 1], 2, "flush", at="1W1")
    # W after the step that needs its gradients
    _expect("split backward", {0: sched[0], 1: _swap(sched[1], "1W1", "1ST")}, [1, 1], 2, "flush", at="1W1")
    # W twice
    _expect("send/recv pairs matched", {0: sched[0], 1: sched[1][:-1] + [Action.from_str("1W1"), sched[1][-1]]},
            [1, 1], 2, "flush", at="1W1")
    # on stage 0 (nothing to send early)
    plain = make_schedule("flush", [1, 1], 2, split_backward=False)
    _expect("split backward", {0: plain[0][:-1] + [Action.from_str("0W1"), plain[0][-1]], 1: plain[1]},
            [1, 1], 2, "flush", at="0W1")
    # in a schedule with weight versions
    one = make_schedule("1f1b", [1, 1], 2)
    i = [str(a) for a in one[1]].index("1SB1")
    _expect("split backward", {0: one[0], 1: one[1][:i + 1] + [Action.from_str("1W1")] + one[1][i + 1:]},
            [1, 1], 2, "1f1b", at="1W1")


# ------------------------------------------------------------------------------------------------
# send release (when a rank may wait for its sends without blocking)


def _happens_before(sched: dict, replicas: list[int]) -> tuple[dict, object]:
    """Brute force: the dependency graph of a schedule (program order; a send -> the action that
    waits for its message, F for SF, B for SB, the last stage's F for stage 0's target; every rank's
    matching collective -> the others') and a reachability test on it."""
    ranks = stage_ranks(replicas)
    last = len(replicas) - 1
    pos = {r: {(a.kind, a.microbatch): i for i, a in enumerate(acts)} for r, acts in sched.items()}
    edges: dict = {}
    for r, acts in sched.items():
        for i, a in enumerate(acts):
            if i + 1 < len(acts):
                edges.setdefault((r, i), []).append((r, i + 1))
            if a.kind in (Kind.SEND_ACT, Kind.SEND_GRAD):
                to = a.stage + 1 if a.kind is Kind.SEND_ACT else a.stage - 1
                peer = rank_of(to, a.microbatch, ranks)
                use = Kind.FORWARD if a.kind is Kind.SEND_ACT else Kind.BACKWARD
                edges.setdefault((r, i), []).append((peer, pos[peer][(use, a.microbatch)]))
    for kind in (Kind.ALLREDUCE, Kind.TIED_GRADS):  # matching collectives: by ordinal and group
        groups: dict = {}
        for r, acts in sched.items():
            seen = 0
            for i, a in enumerate(acts):
                if a.kind is kind:
                    groups.setdefault((a.stage if kind is Kind.ALLREDUCE else -1, seen), []).append((r, i))
                    seen += 1
        for members in groups.values():
            for x in members:
                for y in members:
                    if x != y and x[1] > 0:
                        edges.setdefault((x[0], x[1] - 1), []).append(y)  # everything before one precedes all

    def reaches(src: tuple, dst: tuple) -> bool:
        todo, seen = [src], {src}
        while todo:
            x = todo.pop()
            if x == dst:
                return True
            for y in edges.get(x, ()):
                if y not in seen:
                    seen.add(y)
                    todo.append(y)
        return False
    return pos, reaches


@pytest.mark.parametrize("name", ["gpipe", "flush", "1f1b", "2bw"])
@pytest.mark.parametrize("replicas", [[1, 1], [2, 1], [1, 1, 1]])
def test_send_release_only_after_the_receiver_waited(name: str, replicas: list[int]) -> None:
    from pdcompile.runtime.schedules import send_release

    tied = not (name == "1f1b" and len(set(replicas)) > 1)  # 1F1B can't tie unequal replica counts
    sched = make_schedule(name, replicas, 3, num_steps=2, tied=tied)
    release = send_release(sched, replicas)
    pos, reaches = _happens_before(sched, replicas)
    ranks = stage_ranks(replicas)
    last = len(replicas) - 1
    n_released = 0
    for r, rel in release.items():
        index = {a: i for i, a in enumerate(sched[r])}
        seen = set()
        for after, sends in rel.items():
            for send in sends:
                assert send not in seen and index[send] < after
                seen.add(send)
                if send.kind is Kind.FORWARD:  # stage 0's target, waited for by the last stage's F
                    peer, use = rank_of(last, send.microbatch, ranks), Kind.FORWARD
                else:
                    to = send.stage + 1 if send.kind is Kind.SEND_ACT else send.stage - 1
                    peer = rank_of(to, send.microbatch, ranks)
                    use = Kind.FORWARD if send.kind is Kind.SEND_ACT else Kind.BACKWARD
                # the receiver's waiting action happens-before the release point
                assert reaches((peer, pos[peer][(use, send.microbatch)]), (r, after)), (r, sched[r][after], send)
                n_released += 1
    # most sends are released before the run ends (the last step's are waited for at the end)
    n_sends = sum(a.kind in (Kind.SEND_ACT, Kind.SEND_GRAD) for acts in sched.values() for a in acts)
    assert n_released >= n_sends // 3


# ------------------------------------------------------------------------------------------------
# rank_run: a long run's schedule, step by step


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("replicas,m", [([1, 1], 4), ([1, 1, 1, 1], 2), ([2, 1], 3), ([1, 2, 1], 1), ([3, 2], 2)])
def test_rank_run_is_the_whole_schedule_step_by_step(name: str, replicas: list[int], m: int) -> None:
    """Against make_schedule + send_release laid out whole: the same actions, the same releases, the
    same promised weight versions; and built from a repeating period (not laid out whole)."""
    from pdcompile.runtime.schedules import peak_weight_versions, rank_run, send_release

    tied = not (name.startswith("1f1b") and len(set(replicas)) > 1)
    steps = 41
    sched = make_schedule(name, replicas, m, num_steps=steps, tied=tied)
    release = send_release(sched, replicas)
    peaks = peak_weight_versions(sched)
    for rank, acts in sched.items():
        run = rank_run(name, replicas, m, steps, rank, tied=tied)
        assert run.repeats > 0 and len(run) == len(acts)
        assert list(run) == [(a, tuple(release[rank].get(i, ()))) for i, a in enumerate(acts)], rank
        assert run.promised_versions == peaks[rank]


def test_rank_run_holds_the_same_whatever_the_run_length() -> None:
    from pdcompile.runtime.schedules import rank_run

    short, long = (rank_run("1f1b", [1, 1, 1, 1], 8, n, 1, tied=True) for n in (100, 10**6))
    assert (short.head, short.period, short.tail) == (long.head, long.period, long.tail)
    assert len(long) == len(short) + (10**6 - 100) * len(short.period)
    # the last actions are the drain of the millionth step
    *_, (last, _) = iter(rank_run("flush", [1, 1], 4, 10**4, 1))
    assert str(last) == "1ST"
    tail = [str(a) for a, _ in rank_run("flush", [1, 1], 4, 10**4, 1)][-6:]
    assert tail == [str(a) for a in make_schedule("flush", [1, 1], 4, num_steps=10**4)[1][-6:]]


def test_the_module_examples_hold() -> None:
    import doctest

    import importlib
    import pkgutil

    from pdcompile.runtime import schedules

    attempted = 0
    for info in pkgutil.iter_modules(schedules.__path__):
        result = doctest.testmod(importlib.import_module(f"{schedules.__name__}.{info.name}"))
        assert result.failed == 0, info.name
        attempted += result.attempted
    assert attempted >= 5


def test_one_stage_never_splits_its_backward_where_two_stages_do(monkeypatch: pytest.MonkeyPatch) -> None:
    """The schedule pass splits a drain's backward only where a stage before waits for input gradients: data
    parallelism (one stage, 2 replicas) runs whole backwards (on CPU the split only added actions: the small
    Llama's flush step measured 1.3x gpipe's, bench_plan_regret), 2 stages on as many cores split as before."""
    import os

    from pdcompile.api import pdcompile
    from pdcompile.cluster import local_cpu_cluster
    from pdcompile.zoo import get

    monkeypatch.setattr(os, "cpu_count", lambda: 4)  # a core per process, whatever the machine
    z = get("mlp", batch_size=8, seed=0)
    common = dict(example_inputs=z.example_inputs, example_target=z.target, loss_fn=z.loss_fn, schedule="flush",
                  num_microbatches=2, cluster=local_cpu_cluster(2))
    dp = pdcompile(z.model, stages=1, replicas=[2], **common)
    two = pdcompile(z.model, stages=2, **common)
    dp_spec, two_spec = dp.state.schedule_spec, two.state.schedule_spec
    assert not dp_spec.split_backward and two_spec.split_backward
    assert not any("W" in str(a) for acts in dp_spec.make(1).values() for a in acts)
    assert any("W" in str(a) for acts in two_spec.make(1).values() for a in acts)
