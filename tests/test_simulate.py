"""The simulator against closed forms (exact, with Fractions) and over every schedule."""

from __future__ import annotations

from collections import Counter
from fractions import Fraction as Fr
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdcompile.errors import ScheduleError
from pdcompile.runtime.schedules import SCHEDULES, Action, Kind, make_schedule, parse_grid, policy
from pdcompile.simulate import simulate, simulate_schedule
from test_partition_dp import make_chain

F, B = Fr(1), Fr(2)  # forward and backward of one microbatch; backward twice the forward

# ------------------------------------------------------------------------------------------------
# one stage


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("m", [1, 3, 8])
def test_one_stage(name: str, m: int) -> None:
    step = Fr(1, 4)
    r = simulate_schedule(name, [1], m, forward_s=[F], backward_s=[B], step_s=[step], microbatch_size=32)
    steps = m if name.startswith("1f1b") else 1  # 1F1B steps after every microbatch
    assert r.makespan_s == m * (F + B) + steps * step
    assert r.bubble_fraction == 0
    assert r.utilization == {0: 1}
    assert r.throughput == Fr(m * 32) / r.makespan_s
    assert r.peak_in_flight == [m if name == "gpipe" else 1] and r.peak_weight_versions == [1]


# ------------------------------------------------------------------------------------------------
# equal stages: makespan (m + S - 1)(f + b), bubble (S - 1) / (m + S - 1)


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("S", [2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 13])
def test_equal_stages_bubble(name: str, S: int, m: int) -> None:
    r = simulate_schedule(name, [1] * S, m, forward_s=[F] * S, backward_s=[B] * S)
    assert r.makespan_s == (m + S - 1) * (F + B)
    assert r.bubble_fraction == Fr(S - 1, m + S - 1)
    assert all(u == Fr(m, m + S - 1) for u in r.utilization.values())


def test_two_stages_peak_memory() -> None:
    r = simulate_schedule("1f1b", [1, 1, 1, 1], 8, forward_s=[F] * 4, backward_s=[B] * 4,
                          activation_bytes=[10] * 4, weight_bytes=[100] * 4, static_bytes=[1000] * 4)
    assert r.peak_in_flight == [4, 3, 2, 1]
    assert r.peak_weight_versions == [4, 3, 2, 1]  # weight stashing: one version per minibatch in flight
    assert r.peak_memory_bytes == [1000 + 40 + 400, 1000 + 30 + 300, 1000 + 20 + 200, 1000 + 10 + 100]
    g = simulate_schedule("gpipe", [1, 1, 1, 1], 8, forward_s=[F] * 4, backward_s=[B] * 4)
    assert g.peak_in_flight == [8] * 4 and g.peak_weight_versions == [1] * 4
    t = simulate_schedule("2bw", [1, 1, 1, 1], 4, num_steps=3, forward_s=[F] * 4, backward_s=[B] * 4)
    assert t.peak_weight_versions == [2] * 4


def test_2bw_has_no_flush_bubble() -> None:
    # K steps of M microbatches: flush pays the fill/drain every step, 2BW (and 1F1B) once
    S, M, K = 2, 4, 3
    kw = dict(forward_s=[F] * S, backward_s=[B] * S)
    assert simulate_schedule("flush", [1] * S, M, num_steps=K, **kw).makespan_s == K * (M + S - 1) * (F + B)
    two = simulate_schedule("2bw", [1] * S, M, num_steps=K, **kw)
    assert two.makespan_s == (K * M + S - 1) * (F + B)
    assert two.step_time_s == two.makespan_s / K
    assert simulate_schedule("1f1b", [1] * S, M, num_steps=K, **kw).makespan_s == (K * M + S - 1) * (F + B)


# ------------------------------------------------------------------------------------------------
# replicated stages


@pytest.mark.parametrize("r", [2, 3])
@pytest.mark.parametrize("m", [1, 2, 5, 6])
def test_data_parallel_stage(r: int, m: int) -> None:
    a, step = Fr(1, 2), Fr(1, 8)
    # flush/gpipe on one replicated stage = data parallelism: each replica does its share, then
    # one all-reduce and one step
    for name in ("flush", "gpipe"):
        res = simulate_schedule(name, [r], m, forward_s=[F], backward_s=[B], allreduce_s=[a], step_s=[step])
        assert res.makespan_s == -(-m // r) * (F + B) + a + step
    # 1F1B-RR: the replicas all-reduce after every backward: one group of r minibatches at a time
    res = simulate_schedule("1f1b", [r], m, forward_s=[F], backward_s=[B], allreduce_s=[a], step_s=[step])
    assert res.makespan_s == -(-m // r) * (F + B + a + step)


def test_replicated_input_stage_balances_a_slow_stage() -> None:
    # 2-1: stage 0 is twice as slow and replicated twice, so both stages run one minibatch per
    # 3 time units. Hand-derived timeline (F/B of stage 0: 2/4, stage 1: 1/2; NOAM = 2):
    #   stage 1: F0 2-3 B0 3-5 F1 5-6 B1 6-8 F2 8-9 B2 9-11 F3 11-12 B3 12-14 F4 14-15 B4 15-17 ...
    #   replica 0: F0 0-2 F2 2-4 B0 5-9 (AR at 12, after replica 1's B1 8-12) F4 12-14 B2 14-18 ...
    #   the last all-reduce follows replica 1's B7 26-30.
    res = simulate_schedule("1f1b", [2, 1], 8, forward_s=[Fr(2), Fr(1)], backward_s=[Fr(4), Fr(2)])
    assert res.makespan_s == 30
    assert res.utilization == {0: Fr(24, 30), 1: Fr(24, 30), 2: Fr(24, 30)}
    assert res.bubble_fraction == Fr(1, 5)
    assert res.peak_in_flight == [2, 1]
    b0 = [e for e in res.events if e.name == "0B0"][0]
    assert (b0.rank, b0.start_s, b0.end_s) == (0, 5, 9)
    ar = [e for e in res.events if e.name == "0AR"]
    assert [(e.rank, e.start_s) for e in ar[:2]] == [(0, 12), (1, 12)]


# ------------------------------------------------------------------------------------------------
# communication


@pytest.mark.parametrize("S", [2, 3, 5])
def test_one_microbatch_with_transfers(S: int) -> None:
    c = Fr(1, 3)
    r = simulate_schedule("gpipe", [1] * S, 1, forward_s=[F] * S, backward_s=[B] * S, send_s=c)
    assert r.makespan_s == S * (F + B) + 2 * (S - 1) * c  # the critical path: down and back up


def test_overlap_of_communication() -> None:
    kw = dict(forward_s=[1, 1], backward_s=[1, 1], boundary_bytes=[100], bandwidth=200.0)  # 0.5 s per transfer
    # overlapped: stage 0 computes F1 while F0's activations travel. Hand-derived:
    #   0: F0 0-1 F1 1-2 B1 5-6 B0 6-7   1: F0 1.5-2.5 F1 2.5-3.5 B1 3.5-4.5 B0 4.5-5.5
    assert simulate_schedule("gpipe", [1, 1], 2, overlap_comm=True, **kw).makespan_s == 7
    # blocking sends: 0: F0 0-1 send 1-1.5 F1 1.5-2.5 send 2.5-3 ... B0 7-8
    res = simulate_schedule("gpipe", [1, 1], 2, overlap_comm=False, **kw)
    assert res.makespan_s == 8
    assert res.busy[0] == 4 + 2 * 0.5


def test_link_carries_one_transfer_at_a_time() -> None:
    # transfers slower than compute queue up on the link
    res = simulate_schedule("gpipe", [1, 1], 3, forward_s=[1, 1], backward_s=[1, 1], send_s=lambda a, b, ra, rb: 3)
    f1 = {e.name: e for e in res.events if e.rank == 1 and e.category == "forward"}
    assert [f1[f"1F{k}"].start_s for k in range(3)] == [4, 7, 10]
    xfer = [e for e in res.events if e.category == "transfer" and e.rank == 0]
    assert [(e.start_s, e.end_s) for e in xfer] == [(1, 4), (4, 7), (7, 10)]


def test_send_cost_sees_stages_and_ranks() -> None:
    calls = []

    def send(sa: int, sb: int, ra: int, rb: int) -> float:
        calls.append((sa, sb, ra, rb))
        return 0.0

    simulate_schedule("1f1b", [2, 1], 2, forward_s=[1, 1], backward_s=[1, 1], send_s=send)
    assert sorted(calls) == [(0, 1, 0, 2), (0, 1, 1, 2), (1, 0, 2, 0), (1, 0, 2, 1)]


# ------------------------------------------------------------------------------------------------
# every schedule: terminates, every F/B once (property test)

configs = st.tuples(
    st.sampled_from(SCHEDULES),
    st.lists(st.integers(1, 3), min_size=1, max_size=6),
    st.integers(1, 12),
    st.integers(1, 3),
    st.booleans(),
    st.lists(st.integers(1, 8), min_size=4, max_size=4),
)


@settings(max_examples=200, deadline=None)
@given(configs)
def test_every_schedule_simulates(cfg: tuple) -> None:
    name, replicas, m, steps, overlap, costs = cfg
    S = len(replicas)
    fwd = [Fr(costs[s % 4], 2) for s in range(S)]
    bwd = [2 * f for f in fwd]
    res = simulate_schedule(name, replicas, m, num_steps=steps, forward_s=fwd, backward_s=bwd,
                            send_s=Fr(costs[0], 4), allreduce_s=[Fr(1, 3)] * S, step_s=[Fr(1, 5)] * S,
                            overlap_comm=overlap)
    compute = Counter((e.name, e.rank) for e in res.events if e.category in ("forward", "backward")
                      and Action.from_str(e.name).kind is not Kind.WEIGHT_GRAD)
    assert len(compute) == 2 * S * m * steps and set(compute.values()) == {1}
    assert all(Action.from_str(e.name).kind is Kind.FORWARD for e in res.events if e.category == "forward")
    # the makespan is at least one microbatch's way through the pipeline and every rank's busy time
    assert res.makespan_s >= sum(fwd) + sum(bwd)
    assert all(b <= res.makespan_s for b in res.busy.values())
    assert 0 <= res.bubble_fraction < 1
    for s in range(S):
        assert 1 <= res.peak_in_flight[s] <= policy(name).held(replicas, s, m)  # held until B, or W when split
    for e in res.events:
        assert e.end_s >= e.start_s >= 0


def test_deadlocked_schedule_raises() -> None:
    bad = parse_grid("rank 0: 0F0 0SF0 0F1 0RB1 0SF1 0B1 0RB0 0B0 0ST\n"
                     "rank 1: 1RF0 1F0 1RF1 1F1 1B1 1SB1 1B0 1SB0 1ST")
    with pytest.raises(ScheduleError, match="no deadlock"):
        simulate(bad, forward_s=[1, 1], backward_s=[1, 1])


def test_events_name_actions_and_summary() -> None:
    res = simulate_schedule("flush", [1, 2], 4, forward_s=[1, 1], backward_s=[2, 2], allreduce_s=[0, 1],
                            send_s=0.25, activation_bytes=[2**20, 2**20], weight_bytes=[2**22, 2**22])
    cats = Counter(e.category for e in res.events)
    # 8 backwards and one W per replica of stage 1 (its last backward is split)
    assert cats["forward"] == 8 and cats["backward"] == 8 + 2
    assert sorted(e.name for e in res.events if "W" in e.name) == ["1W2", "1W3"]
    assert cats["allreduce"] == 2 and cats["step"] == 3
    assert {e.name for e in res.events if e.category == "allreduce"} == {"1AR"}
    text = res.summary()
    assert "bubble" in text and "MiB" in text and text.count("\n") == 3
    assert len(res.stage_utilization()) == 2
    sched = make_schedule("flush", [1, 2], 4)
    assert sum(a.kind is Kind.FORWARD for acts in sched.values() for a in acts) == 8


# ------------------------------------------------------------------------------------------------
# from a plan


def _plan(stages: list[tuple[int, int, tuple[int, ...]]], schedule: str = "1f1b", microbatch: int = 4):
    plan_mod = pytest.importorskip("pdcompile.plan")
    sp = tuple(plan_mod.StagePlan(i, first, last, (), (), len(ranks), ranks, 0.0, 0.0, 0.0)
               for i, (first, last, ranks) in enumerate(stages))
    return plan_mod.Plan(sp, "test", "test", schedule, microbatch, 0.0, 0.0, 0.0, "", 0.0, True, 0.0,
                         sum(len(r) for _, _, r in stages))


def _chain(n: int, cut: float, batch: int = 4, params: float = 0.0):
    from pdcompile.ir import Chain, ChainLayer

    return Chain(tuple(ChainLayer(f"l{i}", "linear", 0.5, 1.0, 10.0, params) for i in range(n)), (cut,) * (n - 1),
                 batch_size=batch)


def test_simulate_plan_uses_the_cluster_levels() -> None:
    from pdcompile.cluster import paper_cluster
    from pdcompile.simulate import simulate_plan

    cluster = paper_cluster("A")  # 4 GPUs per server at 10 GB/s, servers at 10 Gbit/s
    chain = _chain(4, cut=1.25e9)  # two layers per stage: f = 1, b = 2 per stage
    across = simulate_plan(_plan([(0, 1, (0,)), (2, 3, (4,))]), chain, cluster, None, 1)
    assert across.makespan_s == pytest.approx(2 * 3 + 2 * 1.0)  # 1 s each way between servers
    inside = simulate_plan(_plan([(0, 1, (0,)), (2, 3, (1,))]), chain, cluster, None, 1)
    assert inside.makespan_s == pytest.approx(2 * 3 + 2 * 0.125)
    # chain costs are per minibatch of chain.batch_size: a microbatch half as big costs half
    half = simulate_plan(_plan([(0, 1, (0,)), (2, 3, (1,))], microbatch=2), chain, cluster, "gpipe", 1,
                         split_backward=False)
    assert half.makespan_s == pytest.approx(2 * 1.5 + 2 * 0.0625)
    assert half.throughput == pytest.approx(2 / half.makespan_s)
    # the runtime's default splits stage 1's backward: its input gradients (share 0.6 of b = 1) go
    # back first, stage 0's backward starts 0.4 sooner; stage 1's W (0.6) ends before it does
    split = simulate_plan(_plan([(0, 1, (0,)), (2, 3, (1,))], microbatch=2), chain, cluster, "gpipe", 1)
    assert split.makespan_s == pytest.approx(0.5 + 0.0625 + 0.5 + 0.6 + 0.0625 + 1.0)


def test_an_emulated_link_is_charged_its_bytes_then_the_hosts_own_path() -> None:
    """pdcompile.slowlink hands a message to torch.distributed once its bytes crossed the emulated link, so
    on this host (a calibrated all-reduce, ``collective``, given) a transfer over a link slower than the host's
    own path (the all-reduce's rate, as ``collective_s`` reads it) costs its bytes at the link's bandwidth and
    then at loopback's (``LOOPBACK_BANDWIDTH``). Hand-computed
    GPipe timeline, 2 stages, 1 microbatch, f = 0.5, b = 1 per stage, 1 MB each way: 0F0 [0, .5], the
    activations T, 1F0 .5, 1B0 1, the gradients T, 0B0 1: 3 + 2 T."""
    from pdcompile.cluster import LOOPBACK_BANDWIDTH, flat_cluster
    from pdcompile.simulate import simulate_plan

    chain, plan = _chain(2, cut=1e6), _plan([(0, 0, (0,)), (1, 1, (1,))], schedule="gpipe")
    kw = dict(split_backward=False, collective=(0.0, 1e9))
    link = 1e6 / 1e6  # 1 s on a 1 MB/s link
    for timeline in (True, False):  # the event replay and the fast one alike
        slow = simulate_plan(plan, chain, flat_cluster(2, 1e6), "gpipe", 1, timeline=timeline, **kw)
        assert slow.makespan_s == pytest.approx(3 + 2 * (link + 1e6 / LOOPBACK_BANDWIDTH), rel=1e-12)
        # not this host's cluster (no calibrated collective): the link alone, as on a real network
        alone = simulate_plan(plan, chain, flat_cluster(2, 1e6), "gpipe", 1, timeline=timeline,
                              split_backward=False)
        assert alone.makespan_s == pytest.approx(3 + 2 * link, rel=1e-12)
        # a link as fast as the host's own path is that path: nothing added
        fast = simulate_plan(plan, chain, flat_cluster(2, 1e9), "gpipe", 1, timeline=timeline, **kw)
        assert fast.makespan_s == pytest.approx(3 + 2 * 1e6 / 1e9, rel=1e-12)
    transfers = [e.end_s - e.start_s for e in simulate_plan(plan, chain, flat_cluster(2, 1e6), "gpipe", 1, **kw).events
                 if e.category == "transfer"]
    assert transfers == [pytest.approx(link + 1e6 / LOOPBACK_BANDWIDTH, rel=1e-12)] * 2


def test_split_backward_closed_form() -> None:
    # flush, 2 stages, 2 microbatches, f = 1, b = 2, free sends. Unsplit: 0F0 0F1 | 1F0 [1,2] 1B0
    # [2,4] 1F1 [4,5] 1B1 [5,7] | 0B0 [4,6] 0B1 [7,9]: 9. Split (B1 = input gradients, 1; W1 = 1.5):
    # 1B1 [5,6] 1W1 [6,7.5], 0B1 [6,8]: 8 — the saving is b - input_grad_s on the drain's path.
    kw = dict(forward_s=[Fr(1)] * 2, backward_s=[Fr(2)] * 2)
    plain = simulate_schedule("flush", [1, 1], 2, split_backward=False, **kw)
    assert plain.makespan_s == 9
    res = simulate_schedule("flush", [1, 1], 2, input_grad_s=[Fr(1)] * 2, weight_grad_s=[Fr(3, 2)] * 2, **kw)
    assert res.makespan_s == 8
    ev = {e.name: (e.start_s, e.end_s) for e in res.events}
    assert ev["1B1"] == (5, 6) and ev["1W1"] == (6, Fr(15, 2)) and ev["0B1"] == (6, 8)
    assert ev["1B0"] == (2, 4)  # only the step's last backward is split
    # without split costs, a split schedule simulates as the unsplit one (W costs nothing)
    assert simulate_schedule("flush", [1, 1], 2, **kw).makespan_s == 9
    # a long W becomes the critical path: 1W1 [6, 10]
    assert simulate_schedule("flush", [1, 1], 2, input_grad_s=[Fr(1)] * 2, weight_grad_s=[Fr(4)] * 2,
                             **kw).makespan_s == 10


def test_simulate_plan_replicated_stage_all_reduces() -> None:
    from pdcompile.cluster import flat_cluster
    from pdcompile.simulate import ring_allreduce_s, simulate_plan

    chain = _chain(2, cut=0.0, params=1e9)
    res = simulate_plan(_plan([(0, 0, (0, 1)), (1, 1, (2,))]), chain, flat_cluster(3, 1e9), "1f1b", 4)
    assert ring_allreduce_s(1e9, 2, 1e9) == 1.0
    ar = [e for e in res.events if e.category == "allreduce"]
    assert len(ar) == 4 and all(e.end_s - e.start_s == pytest.approx(1.0) for e in ar)
    assert res.peak_weight_versions == [2, 1]
    # the planner's stage memory: 1F1B's peak is after a backward, the gradient (1 x W) live with
    # the versions and optimizer state (1 x W), one microbatch fewer in flight
    assert res.peak_memory_bytes == [pytest.approx((2 + 1 + 1) * 1e9 + 1 * 10), pytest.approx((1 + 1 + 1) * 1e9)]


# ------------------------------------------------------------------------------------------------
# tied gradients and per-action overhead


def test_tied_grads_hold_only_the_owning_stages() -> None:
    # 3 equal stages, one microbatch, gpipe: the embedding is tied between stages 0 and 2. Stage 1's
    # B ends at 3F + 2B (= 7); stage 0's B at 3F + 3B (= 9). With TG over all ranks everybody steps
    # at 9 + tied; with only stages 0 and 2 in the group, stage 1 steps right after its backward.
    tied = Fr(1, 2)
    kw = dict(forward_s=[F] * 3, backward_s=[B] * 3, step_s=[Fr(1, 10)] * 3, tied=True, tied_s=tied)
    everyone = simulate_schedule("gpipe", [1, 1, 1], 1, **kw)
    owners = simulate_schedule("gpipe", [1, 1, 1], 1, tied_stages=[0, 2], **kw)
    st = {(e.rank, e.name): e for e in owners.events}
    assert st[(1, "1ST")].start_s == 3 * F + 2 * B
    assert (1, "1TG") not in st
    assert st[(0, "0TG")].start_s == st[(2, "2TG")].start_s == 3 * F + 3 * B
    assert st[(2, "2ST")].start_s == 3 * F + 3 * B + tied
    assert owners.makespan_s == everyone.makespan_s == 3 * F + 3 * B + tied + Fr(1, 10)
    assert {(e.rank, e.name) for e in everyone.events if e.category == "tied"} == {(0, "0TG"), (1, "1TG"), (2, "2TG")}


def test_tied_stages_must_exist() -> None:
    from pdcompile.errors import UsageError

    with pytest.raises(UsageError, match="tied_stages"):
        simulate_schedule("gpipe", [1, 1], 1, forward_s=[F] * 2, backward_s=[B] * 2, tied=True, tied_stages=[0, 5])


@pytest.mark.parametrize("name", SCHEDULES)
def test_overhead_per_action_on_one_stage(name: str) -> None:
    # one stage runs F, B (and ST per step) only: each costs its overhead on top
    m, o = 3, {"F": Fr(1, 10), "B": Fr(1, 5), "ST": Fr(1, 7)}
    r = simulate_schedule(name, [1], m, forward_s=[F], backward_s=[B], step_s=[0], overhead_s=o)
    steps = m if name.startswith("1f1b") else 1
    assert r.makespan_s == m * (F + B + o["F"] + o["B"]) + steps * o["ST"]
    assert r.utilization[0] == m * (F + B) / r.makespan_s  # overhead is busy time, not compute


def test_overhead_on_sends_delays_the_transfer() -> None:
    # gpipe, 2 stages, 1 microbatch, free transfers, every action costs c (hand-derived):
    #   0: F0 [c, c+F]  SF0 sent at F+2c  RB0 posted at F+3c          ... B0 [F+2B+6c, 2F+2B+6c]  ST
    #   1: RF0 waits to F+2c  F0 [F+3c, 2F+3c]  B0 [2F+4c, 2F+B+4c]  SB0 sent at 2F+B+5c  ST
    c = Fr(1, 100)
    r = simulate_schedule("gpipe", [1, 1], 1, forward_s=[F] * 2, backward_s=[B] * 2, overhead_s=c)
    ev = {(e.rank, e.name): e for e in r.events}
    assert ev[(0, "0F0")].end_s == c + F
    assert ev[(1, "1F0")].start_s == F + 3 * c
    assert ev[(0, "0B0")].start_s == 2 * F + B + 6 * c
    assert r.makespan_s == 2 * (F + B) + 7 * c  # rank 0's ST overhead ends the run


def test_overhead_kinds_are_checked() -> None:
    from pdcompile.errors import UsageError

    with pytest.raises(UsageError, match="unknown action kinds"):
        simulate_schedule("gpipe", [1], 1, forward_s=[F], backward_s=[B], overhead_s={"FWD": 1})


def test_receive_progress_on_wait() -> None:
    # gpipe, 2 stages, 2 microbatches, transfers of 1/2. Stage 1 computes F0 (1.5-2.5) while F1's
    # activations travel (sent at 2, arriving 2.5 in the background). "on_wait": stage 1 starts
    # taking them at 2.5 when it waits, so they arrive at 3 and F1 runs 3-4 instead of 2.5-3.5.
    kw = dict(forward_s=[1, 1], backward_s=[1, 1], send_s=Fr(1, 2))
    bg = simulate_schedule("gpipe", [1, 1], 2, **kw)
    ow = simulate_schedule("gpipe", [1, 1], 2, recv_progress="on_wait", **kw)
    f1 = lambda r: {e.name: e for e in r.events if e.rank == 1 and e.category == "forward"}["1F1"]  # noqa: E731
    assert (f1(bg).start_s, f1(ow).start_s) == (Fr(5, 2), 3)
    assert ow.makespan_s > bg.makespan_s
    # a receiver already waiting sees no difference
    one = dict(forward_s=[1, 1], backward_s=[1, 1], send_s=Fr(1, 2))
    assert (simulate_schedule("gpipe", [1, 1], 1, recv_progress="on_wait", **one).makespan_s
            == simulate_schedule("gpipe", [1, 1], 1, **one).makespan_s == 4 + 2 * Fr(1, 2))
    from pdcompile.errors import UsageError

    with pytest.raises(UsageError, match="recv_progress"):
        simulate_schedule("gpipe", [1, 1], 1, recv_progress="later", **one)


def test_receive_progress_both_wait() -> None:
    # gpipe, 2 stages, 2 microbatches, F = B = 1, transfers of 1/2. "both_wait": bytes move only while
    # sender and receiver are both idle. Rank 0 sends F0's activations at 1 and computes F1 until 2:
    # they move 2-2.5 (rank 1 idle), so 1F0 runs 2.5-3.5 ("background": 1.5-2.5). F1's, sent at 2
    # (link free at 2.5), wait for rank 1's F0: 3.5-4, 1F1 4-5, 1B1 5-6. B1's gradients, sent at 6
    # while rank 1 computes B0 until 7, move 7-7.5; B0's (link free at 7.5) wait for rank 0's B1
    # (7.5-8.5) and move 8.5-9; 0B0 9-10.
    kw = dict(forward_s=[1, 1], backward_s=[1, 1], send_s=Fr(1, 2))
    bw = simulate_schedule("gpipe", [1, 1], 2, recv_progress="both_wait", **kw)
    got = {e.name: (e.start_s, e.end_s) for e in bw.events if e.category in ("forward", "backward") and "W" not in e.name}
    assert got == {"0F0": (0, 1), "0F1": (1, 2), "1F0": (Fr(5, 2), Fr(7, 2)), "1F1": (4, 5), "1B1": (5, 6),
                   "1B0": (6, 7), "0B1": (Fr(15, 2), Fr(17, 2)), "0B0": (9, 10)}
    arrive = {e.name: e.end_s for e in bw.events if e.category == "transfer"}
    assert arrive == {"0SF0": Fr(5, 2), "0SF1": 4, "1SB1": Fr(15, 2), "1SB0": 9}
    assert bw.makespan_s == 10
    assert (simulate_schedule("gpipe", [1, 1], 2, **kw).makespan_s,
            simulate_schedule("gpipe", [1, 1], 2, recv_progress="on_wait", **kw).makespan_s) == (7, 8)
    # a transfer interrupted by the receiver's compute: F1's activations (1/2 of transfer) start at 2
    # while rank 1 is idle, move 2-2.25, stop while rank 1 runs F0 (2.25-3.25), move the rest 3.25-3.5
    part = simulate_schedule("gpipe", [1, 1], 2, recv_progress="both_wait", forward_s=[1, 1], backward_s=[1, 1],
                             send_s=lambda sa, sb, ra, rb: Fr(1, 4) if sa == 0 and sb == 1 else Fr(1, 2))
    f = {e.name: e.start_s for e in part.events if e.category == "forward"}
    assert (f["1F0"], f["1F1"]) == (Fr(9, 4), Fr(7, 2))
    # nothing to overlap (one microbatch, each side idle while the other's bytes move): as background
    assert (simulate_schedule("gpipe", [1, 1], 1, recv_progress="both_wait", **kw).makespan_s
            == simulate_schedule("gpipe", [1, 1], 1, **kw).makespan_s == 5)
    from pdcompile.errors import UsageError

    with pytest.raises(UsageError, match="overlap_comm"):
        simulate_schedule("gpipe", [1, 1], 1, recv_progress="both_wait", overlap_comm=False, **kw)


@pytest.mark.parametrize("name", ["interleaved-1f1b", "looped-bfs", "zb-v"])
def test_receive_progress_both_wait_virtual(name: str) -> None:
    # 4 stages on 2 ranks: hand-overs between one rank's stages stay free; every transfer between the
    # ranks arrives no earlier than in the background, and only while both ranks are idle
    kw = dict(forward_s=[1] * 4, backward_s=[2] * 4, send_s=Fr(1, 3), virtual_stages=2)
    bg = simulate_schedule(name, [1] * 4, 6, **kw)
    bw = simulate_schedule(name, [1] * 4, 6, recv_progress="both_wait", **kw)
    assert bw.makespan_s >= bg.makespan_s
    busy = {r: [(e.start_s, e.end_s) for e in bw.events if e.rank == r and e.category not in ("transfer", "send", "recv")]
            for r in (0, 1)}
    moves = [e for e in bw.events if e.category == "transfer"]
    assert moves and all(e.end_s - e.start_s >= Fr(1, 3) for e in moves)
    for e in moves:  # the last third of a transfer before its arrival: neither rank computes
        assert not any(a < e.end_s and b > e.end_s - Fr(1, 100) for r in (0, 1) for a, b in busy[r])


@pytest.mark.parametrize("name", ["1f1b", "2bw", "flush"])
def test_version_copies_are_charged(name: str) -> None:
    from pdcompile.runtime.schedules import version_copies

    c = Fr(1, 8)
    kw = dict(forward_s=[F] * 2, backward_s=[B] * 2, num_steps=2)
    plain = simulate_schedule(name, [1, 1], 4, **kw)
    copying = simulate_schedule(name, [1, 1], 4, version_s=[c, 2 * c], **kw)
    sched = make_schedule(name, [1, 1], 4, num_steps=2)
    for rank, acts in sched.items():
        assert copying.busy[rank] - plain.busy[rank] == sum(version_copies(acts)) * c * (rank + 1)
    assert (copying.makespan_s > plain.makespan_s) == (name != "flush")


# ------------------------------------------------------------------------------------------------
# memory: the simulator's prediction is the planner's stage memory at the simulated counts
# ------------------------------------------------------------------------------------------------


def _saved_chain(seed: int, layers: int) -> Any:
    """A chain with saved-activation bytes that differ from its outputs (what annotate-costs records)."""
    import random
    from dataclasses import replace as _replace

    rnd = random.Random(seed)
    u = lambda a, b: [rnd.uniform(a, b) for _ in range(layers)]  # noqa: E731
    chain = make_chain(u(1, 10), u(1, 10), u(1, 50), u(1, 50), u(1, 60)[:layers - 1])
    return _replace(chain, layers=tuple(
        _replace(l, saved_bytes=l.output_bytes * rnd.uniform(0.5, 2), saved_input_bytes=rnd.uniform(0, 5),
                 saved_output_bytes=rnd.uniform(0, 5), shared_param_bytes=rnd.choice([0.0, l.param_bytes / 2]))
        for l in chain.layers))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), layers=st.integers(1, 6), data=st.data(),
       schedule=st.sampled_from(["gpipe", "flush", "1f1b", "2bw"]), recompute=st.sampled_from(["none", "full"]))
def test_simulated_memory_is_the_planners(seed: int, layers: int, data: Any, schedule: str, recompute: str) -> None:
    """Planner and simulator agree per stage: the simulated schedule's peak in-flight microbatches
    and live weight versions (two steps: 2BW's second version) are the counts the planner's
    closed form assumes, given enough microbatches to fill the pipeline."""
    from pdcompile.cluster import flat_cluster
    from pdcompile.passes.partition_dp import plan_from_assignment
    from pdcompile.simulate import simulate_plan

    chain = _saved_chain(seed, layers)
    S = data.draw(st.integers(1, layers))
    cuts = sorted(data.draw(st.lists(st.integers(1, max(1, layers - 1)), min_size=S - 1, max_size=S - 1,
                                     unique=True))) if S > 1 else []
    bounds = [0, *cuts, layers]
    reps = data.draw(st.lists(st.integers(1, 2), min_size=S, max_size=S))
    M = 4 * sum(reps)  # every replica fills its pipeline
    cluster = flat_cluster(sum(reps), 10.0, memory=1e15)
    plan = plan_from_assignment(chain, cluster, [(a, b - 1, r) for a, b, r in zip(bounds, bounds[1:], reps)],
                                schedule=schedule, num_microbatches=M, recompute=recompute,
                                optimizer_state_factor=2.0)
    res = simulate_plan(plan, chain, cluster, schedule, M, num_steps=2, optimizer_state_factor=2.0)
    assert res.peak_in_flight == [s.in_flight for s in plan.stages]
    assert res.peak_weight_versions == [s.weight_versions for s in plan.stages]
    assert res.peak_memory_bytes == [pytest.approx(s.memory_bytes, rel=1e-12) for s in plan.stages]


def test_simulated_memory_uses_saved_bytes_not_outputs() -> None:
    """Saved-activation bytes, not output bytes, size what a microbatch in flight keeps."""
    from dataclasses import replace as _replace

    from pdcompile.cluster import flat_cluster
    from pdcompile.passes.partition_dp import plan_from_assignment
    from pdcompile.simulate import simulate_plan

    chain = _saved_chain(7, 3)
    cluster = flat_cluster(1, 10.0, memory=1e15)
    more = _replace(chain, layers=tuple(_replace(l, saved_bytes=l.saved_bytes + 100.0) for l in chain.layers))
    plan = plan_from_assignment(chain, cluster, [(0, 2, 1)], schedule="flush")
    a = simulate_plan(plan, chain, cluster, "flush", 2).peak_memory_bytes[0]
    b = simulate_plan(plan, more, cluster, "flush", 2).peak_memory_bytes[0]
    assert b - a == pytest.approx(3 * 100.0)  # one microbatch in flight, three layers


@pytest.mark.parametrize("M", [2, 4, 5])
def test_virtual_stage_memory_counts_gradients_from_the_first_backward(M: int) -> None:
    """A stage's weight gradients live from its first backward to its ST (the runtime frees them
    there), so a stage that runs every forward before any backward peaks without them. Looped BFS
    (4 stages on 2 ranks) runs each stage's M forwards first: M in flight, none with gradients, and
    each stage's memory is the flush model's at M in flight less one copy of its weights (no layer
    shares parameters here); 1F1B's straight pipeline (flush) reaches its peak (stage s: p - s in
    flight) again after the first backward when a forward follows it (M > p - s)."""
    from dataclasses import replace as _replace

    from pdcompile.cluster import flat_cluster
    from pdcompile.passes.partition_dp import PlanOptions, plan_from_assignment, stage_memory_at
    from pdcompile.simulate import simulate_plan

    chain = _saved_chain(3, 8)
    chain = _replace(chain, layers=tuple(_replace(l, shared_param_bytes=0.0) for l in chain.layers))
    assign = [(2 * k, 2 * k + 1, 1) for k in range(4)]
    plan = plan_from_assignment(chain, flat_cluster(4, 10.0, memory=1e15), assign, schedule="flush",
                                num_microbatches=M)
    res = simulate_plan(plan, chain, flat_cluster(2, 10.0, memory=1e15), "looped-bfs", M, virtual_stages=2)
    assert res.peak_in_flight == [M] * 4 and res.peak_in_flight_with_grads == [0] * 4
    for s, st_ in enumerate(plan.stages):
        # flush's gradients all step long (a step of unknown count: MemoryModel.whole_step never holds)
        flush_model = stage_memory_at(chain, st_.first, st_.last, PlanOptions(schedule="flush", num_microbatches=M,
                                                                              microbatches_known=False),
                                      in_flight=M, weight_versions=1)
        weights = sum(l.param_bytes for l in chain.layers[st_.first:st_.last + 1])
        assert res.peak_memory_bytes[s] == pytest.approx(flush_model - weights, rel=1e-12)
    straight = simulate_plan(plan_from_assignment(chain, flat_cluster(2, 10.0, memory=1e15), [(0, 3, 1), (4, 7, 1)],
                                                  schedule="flush", num_microbatches=M),
                             chain, flat_cluster(2, 10.0, memory=1e15), "flush", M)
    assert straight.peak_in_flight == [min(2 - s, M) for s in range(2)]
    # a forward after the first backward (M > p - s) brings the peak back with gradients
    assert straight.peak_in_flight_with_grads == [2 - s if M > 2 - s else 0 for s in range(2)]


@pytest.mark.parametrize("M", [2, 4])
def test_virtual_stage_rebuild_counts_gradients_from_the_second_backward(M: int) -> None:
    """Looped BFS runs each stage's M backwards back to back: from the second one on, the stage
    holds its weight gradients while it rebuilds a microbatch (M - 1 still in flight, the rebuilt
    one included), a moment the meter measures. With full recomputation the stage's memory is the
    larger of that moment (flush's model at M - 1 in flight: it counts the gradients and one
    rebuild) and the peak before its first backward (M in flight, one weight copy less); without
    recomputation that moment is not a peak the meter sees, and the memory stays as before."""
    from dataclasses import replace as _replace

    from pdcompile.cluster import flat_cluster
    from pdcompile.passes.partition_dp import PlanOptions, plan_from_assignment, stage_memory_at
    from pdcompile.simulate import simulate_plan

    chain = _saved_chain(3, 8)
    chain = _replace(chain, layers=tuple(_replace(l, shared_param_bytes=0.0) for l in chain.layers))
    assign = [(2 * k, 2 * k + 1, 1) for k in range(4)]
    plan = plan_from_assignment(chain, flat_cluster(4, 10.0, memory=1e15), assign, schedule="flush",
                                num_microbatches=M)
    full = _replace(plan, stages=tuple(_replace(st_, recompute="full", recompute_layers=st_.last - st_.first + 1)
                                       for st_ in plan.stages))
    cluster = flat_cluster(2, 10.0, memory=1e15)
    # flush's gradients all step long (a step of unknown count: MemoryModel.whole_step never holds)
    flush = PlanOptions(schedule="flush", num_microbatches=M, microbatches_known=False)
    res = simulate_plan(full, chain, cluster, "looped-bfs", M, virtual_stages=2)
    plain = simulate_plan(plan, chain, cluster, "looped-bfs", M, virtual_stages=2)
    assert res.peak_in_flight_at_rebuild == [M - 1] * 4
    for s, st_ in enumerate(full.stages):
        def at(k: int, recompute: str) -> float:
            return stage_memory_at(chain, st_.first, st_.last, flush, in_flight=k, weight_versions=1,
                                   recompute=recompute)
        weights = sum(l.param_bytes for l in chain.layers[st_.first:st_.last + 1])
        assert res.peak_memory_bytes[s] == pytest.approx(max(at(M - 1, "full"), at(M, "full") - weights), rel=1e-12)
        assert plain.peak_memory_bytes[s] == pytest.approx(at(M, "none") - weights, rel=1e-12)
    # the gradients beside a rebuild: more than the peak before the first backward when weights
    # outweigh a microbatch's kept activations (this chain's)
    assert any(res.peak_memory_bytes[s] > stage_memory_at(chain, st_.first, st_.last, flush, in_flight=M,
                                                          weight_versions=1, recompute="full")
               - sum(l.param_bytes for l in chain.layers[st_.first:st_.last + 1]) * (1 + 1e-9)
               for s, st_ in enumerate(full.stages))


def test_tied_weights_on_one_rank_need_no_collective() -> None:
    """ZB-V puts both ends of a tied weight (stages 0 and 3 of 4) on rank 0, where the runtime sums
    the copies in memory: however large the tied bytes, the step costs what it costs without the
    collective; interleaved 1F1B puts them on ranks 0 and 1, where the all-reduce costs."""
    from pdcompile.cluster import flat_cluster
    from pdcompile.passes.partition_dp import plan_from_assignment
    from pdcompile.simulate import simulate_plan

    chain = _saved_chain(5, 8)
    plan = plan_from_assignment(chain, flat_cluster(4, 10.0, memory=1e15), [(2 * k, 2 * k + 1, 1) for k in range(4)],
                                schedule="flush", num_microbatches=4)
    cluster = flat_cluster(2, 10.0, memory=1e15)
    t = {(name, b): simulate_plan(plan, chain, cluster, name, 4, virtual_stages=2, tied_bytes=b,
                                  tied_stages=(0, 3)).makespan_s
         for name in ("zb-v", "interleaved-1f1b") for b in (1.0, 1e6)}
    assert t[("zb-v", 1e6)] == pytest.approx(t[("zb-v", 1.0)])
    assert t[("interleaved-1f1b", 1e6)] > t[("interleaved-1f1b", 1.0)] + 1e4
