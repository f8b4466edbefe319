"""Cores as a resource (issue 36 item 3): a local CPU cluster of more processes than cores charged as its ranks
share the cores. The processor-sharing stretch (``roofline.shared_core_stretch``) against a brute-force
enumeration and hand-computed cases; the fixed point in ``simulate.shared_cores`` on hand-built plans (a rank
alone keeps its time; data-parallel replicas computing together keep the static charge; a pipeline whose stages
take turns is charged less), with simulate() and the fast replay equal under it. Pure: no torch run, no launch."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path
from typing import Any

import pytest

from pdcompile.cluster import ClusterSpec, Device, Level
from pdcompile.passes.costs.roofline import contention, shared_core_stretch

pytestmark = pytest.mark.timeout(60)


def _states(others: list[float]) -> list[tuple[tuple[int, ...], float]]:
    """Every on/off state of ranks busy with probabilities ``others``, with its probability."""
    out = []
    for state in itertools.product((0, 1), repeat=len(others)):
        p = 1.0
        for on, q in zip(state, others):
            p *= q if on else 1 - q
        out.append((state, p))
    return out


def _brute(shares: list[float], cores: int, threads: int, corun: dict[int, float] | None = None) -> list[float]:
    """E[slowdown of i while it computes] over every on/off state of the others (2^n states, each with its
    probability), n threads computing at once on the cores each slowed max(1, n / cores), and with ``corun``
    (processes -> factor, the largest count measured at most the processes computing at once on their own
    cores, min(n, cores)) by that factor too."""
    out = []
    for i in range(len(shares)):
        e = 0.0
        for state, p in _states([q for j, q in enumerate(shares) if j != i]):
            busy = 1 + sum(state)
            known = [c for c in (corun or {}) if c <= min(busy, cores)]
            side = corun[max(known)] if corun and known else 1.0
            e += p * side * max(1.0, busy * threads / cores)
        out.append(e)
    return out


def test_stretch_by_hand() -> None:
    # two ranks always computing on one core each take twice as long; a rank alone keeps its time
    assert shared_core_stretch([1.0, 1.0], 1) == [2.0, 2.0]
    assert shared_core_stretch([1.0], 1) == [1.0]
    assert shared_core_stretch([1.0, 0.0], 1) == [1.0, 2.0]  # the idle one would share, were it to compute
    # w always busy: the static charge, roofline.contention; no more processes than cores: nothing
    three = ClusterSpec(Device("cpu", cores=2), (Level("processes", 3, 2e9),))
    assert shared_core_stretch([1.0] * 3, 2) == [pytest.approx(contention(three))] * 3 == [1.5] * 3
    assert shared_core_stretch([1.0, 1.0], 2) == [1.0, 1.0]
    # a pipeline's 3 stages taking turns (each a third of the step) on 2 cores: only when both others compute
    # too (1/9) is it slowed, by 1.5: 1 + 1/9 x 0.5
    assert shared_core_stretch([1 / 3] * 3, 2) == [pytest.approx(1 + 1 / 18)] * 3
    assert shared_core_stretch([1.0, 1.0], 2, threads=2) == [2.0, 2.0]  # 4 threads on 2 cores


@pytest.mark.parametrize("seed", range(6))
def test_stretch_against_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    n, cores, threads = rng.randint(1, 7), rng.randint(1, 4), rng.choice([1, 1, 2])
    shares = [rng.choice([0.0, 1.0, rng.random(), 0.5]) for _ in range(n)]
    assert shared_core_stretch(shares, cores, threads) == pytest.approx(_brute(shares, cores, threads), rel=1e-12)


# -- simulate_plan: the fixed point on hand-built plans ------------------------------------------------------

def _plan(cores: int | None, stages: int, replicas: int, m: int, params: float = 0.0,
          schedule: str = "flush") -> tuple[Any, Any, Any]:
    """Three equal layers (1 ms forward, 2 ms backward, ``params`` weight bytes each, nothing sent) on 3 workers
    of a host of ``cores`` (None: cores of their own), as ``stages`` stages of ``replicas`` replicas each."""
    from pdcompile.ir import Chain, ChainLayer
    from pdcompile.passes.partition_dp import plan_from_assignment

    chain = Chain(tuple(ChainLayer(f"l{i}", "linear", 1e-3, 2e-3, 0.0, params) for i in range(3)), (0.0, 0.0),
                  batch_size=m)
    cluster = ClusterSpec(Device("cpu", cores=cores), (Level("processes", 3, 1e9),))
    per = 3 // stages
    assignment = [(s * per, s * per + per - 1, replicas, tuple(range(s * replicas, (s + 1) * replicas)))
                  for s in range(stages)]
    return plan_from_assignment(chain, cluster, assignment, schedule=schedule, num_microbatches=m), chain, cluster


def _step(plan: Any, chain: Any, cluster: Any, m: int, **kw: Any) -> float:
    from pdcompile.simulate import simulate_plan

    return float(simulate_plan(plan, chain, cluster, plan.schedule, m, split_backward=False, **kw).step_time_s)


def test_a_pipeline_taking_turns_is_charged_less_than_data_parallel() -> None:
    """3 workers on 2 cores, the chain charged the static x1.5 (every worker always computing). A 3-stage
    pipeline at M=1 computes one stage at a time: each rank a third of the step, so by hand its stretch is
    1 + 1/9 x 0.5 = 19/18 (slowed only while both others compute too, independently 1/9 of the time), and its
    step is the uncrowded one x (19/18) / 1.5. Data parallel x3 (M=3, one microbatch per replica) computes on
    all three at once: it keeps the static charge, its step the same as on cores of their own. Per busy rank
    the data-parallel plan is charged more (1.5 against 19/18)."""
    pipe, chain, own = _plan(None, 3, 1, 1)
    pipe2, chain2, shared = _plan(2, 3, 1, 1)
    alone = _step(pipe, chain, own, 1)
    assert alone == pytest.approx(9e-3 / 1.5 * 1.5, rel=1e-9)  # 3 x (1 + 2) ms, the chain's costs as given
    assert _step(pipe2, chain2, shared, 1) == pytest.approx(alone * (19 / 18) / 1.5, rel=1e-9)
    dp, dchain, downs = _plan(None, 1, 3, 3)
    dp2, dchain2, dshared = _plan(2, 1, 3, 3)
    assert _step(dp2, dchain2, dshared, 3) == pytest.approx(_step(dp, dchain, downs, 3), rel=1e-9)
    # per busy rank: the step over the rank's own (static-charged) compute
    assert _step(dp2, dchain2, dshared, 3) / 9e-3 > _step(pipe2, chain2, shared, 1) / 9e-3 * 1.4


def test_per_action_cost_is_stretched_as_the_ranks_share_the_cores() -> None:
    """The runtime's per-action cost (CPU work, calibrated on no more processes than cores) is stretched by the
    ranks' mean stretch: data parallel x3 on 2 cores pays it x1.5, on cores of their own x1."""
    over = {"F": 1e-4, "B": 1e-4}
    dp, chain, own = _plan(None, 1, 3, 3)
    dp2, chain2, shared = _plan(2, 1, 3, 3)
    extra_own = _step(dp, chain, own, 3, overhead_s=over) - _step(dp, chain, own, 3)
    extra_shared = _step(dp2, chain2, shared, 3, overhead_s=over) - _step(dp2, chain2, shared, 3)
    assert extra_own == pytest.approx(2e-4, rel=1e-9) and extra_shared == pytest.approx(1.5 * 2e-4, rel=1e-9)


@pytest.mark.parametrize("schedule, stages, replicas, m", [("flush", 3, 1, 4), ("zb-h1", 3, 1, 8), ("gpipe", 1, 3, 3),
                                                           ("flush", 3, 1, 1), ("1f1b", 3, 1, 6)])
def test_simulate_and_the_fast_replay_agree_under_shared_cores(schedule: str, stages: int, replicas: int,
                                                               m: int) -> None:
    """The fixed point runs outside both replays: simulate() with its timeline and the fast replay give one step,
    and the step is no more than the static charge's (an upper bound) and no less than the uncrowded one's."""
    from pdcompile.simulate import simulate_plan

    plan, chain, cluster = _plan(2, stages, replicas, m, params=4e5, schedule=schedule)
    kw = dict(split_backward=schedule == "zb-h1", overhead_s={"F": 1e-4, "SF": 5e-5}, update_bandwidth=5e9,
              collective=(1e-3, 7e8))
    slow = simulate_plan(plan, chain, cluster, schedule, m, **kw)
    fast = simulate_plan(plan, chain, cluster, schedule, m, timeline=False, **kw)
    assert fast.makespan_s == pytest.approx(slow.makespan_s, rel=1e-9) and slow.events
    own_plan, own_chain, own = _plan(None, stages, replicas, m, params=4e5, schedule=schedule)
    static = float(simulate_plan(own_plan, own_chain, own, schedule, m,
                                 **{**kw, "overhead_s": {"F": 1.5e-4, "SF": 7.5e-5}}).makespan_s)
    crowd_free = float(simulate_plan(own_plan, own_chain, own, schedule, m, **kw).makespan_s) / 1.5
    assert crowd_free * 0.999 <= float(slow.makespan_s) <= static * (1 + 1e-9)


# -- the all-reduce on more processes than cores ---------------------------------------------------------------

def test_crowded_all_reduce_is_read_back_and_charged_on_more_workers_than_cores(
        pdcompile_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The calibration's all-reduce among cores + 1 processes, fitted on its raw bytes, is stored per ring byte
    (``ring_normalized``: the fit's time comes back through ``collective_s`` at that process count); step_costs
    charges it on a local cluster of more workers than cores, the 2-process one on one of no more."""
    import pdcompile.cluster as cl
    from pdcompile import machine_cache
    from pdcompile.api import step_costs
    from pdcompile.calibrate import ring_normalized
    from pdcompile.cluster import local_cpu_cluster
    from pdcompile.simulate import collective_s

    fixed, rate = 1.6e-3, 5e8
    crowded = ring_normalized((fixed, rate), 3)
    for n in (4096, 4 << 20):
        assert collective_s(n, 3, float("inf"), 0.0, crowded) == pytest.approx(fixed + n / rate, rel=1e-12)
    monkeypatch.setattr(cl, "host_cores", lambda: 2)
    pdcompile_cache.mkdir(parents=True, exist_ok=True)
    (pdcompile_cache / "machine-constants.json").write_text(json.dumps({
        "key": machine_cache.machine_key(), "overhead_s": {"F": 1e-4}, "collective_fixed_s": 4e-4,
        "collective_rate": 6e8, "collective_crowded_fixed_s": crowded[0], "collective_crowded_rate": crowded[1]}))
    source = machine_cache.cost_source("analytic", True)
    three, two = step_costs(local_cpu_cluster(3), source)[0], step_costs(local_cpu_cluster(2), source)[0]
    assert three is not None and two is not None
    # the fits' fixed parts less the probe's gradients' flatten and copy back, charged per tensor instead
    probe = machine_cache.COLLECTIVE_PROBE_TENSORS * three.seconds[machine_cache.FLATTEN_TENSOR_KEY]
    assert three.collective == pytest.approx((crowded[0] - probe, crowded[1]))
    assert two.collective == pytest.approx((4e-4 - probe, 6e8))


def test_the_step_search_on_shared_cores_finds_the_step_of_every_candidate_simulated() -> None:
    """On 3 workers sharing 2 cores the simulated step of a pipeline falls below the bounds read off the chain's
    statically charged compute; the step search scales its bounds by 1 / contention, so it still returns a step
    no longer than planning and simulating every (microbatch count, copies) candidate (test_plan_step's brute
    force) and no shorter than those plans at every count."""
    import random

    from test_plan_step import _every_candidate, _random_chain

    from pdcompile.passes.planner.options import PlanOptions
    from pdcompile.plan import plan

    rng = random.Random(21)
    cluster = ClusterSpec(Device("cpu", memory=400 * 2**30, cores=2), (Level("processes", 3, 1e9),))
    for trial in range(6):
        chain = _random_chain(rng, rng.randint(3, 7), rng.choice([1, 2]))
        opts = PlanOptions(schedule=rng.choice(["flush", "gpipe", "zb-h1"]), num_microbatches=rng.choice([2, 6]),
                           choose_microbatches=True)
        want, every = _every_candidate(chain, cluster, opts)
        assert want is not None and every is not None and not want[0], trial
        step = plan(chain, cluster, opts).seconds_per_minibatch
        assert every[1] * (1 - 1e-9) <= step <= want[1] * (1 + 1e-9), trial


# -- co-running (issue 36): the calibrated slowdown of processes computing side by side, charged while they do ----

@pytest.mark.parametrize("seed", range(6))
def test_stretch_with_corun_against_brute_force(seed: int) -> None:
    """With a calibration's co-running slowdowns (a table of one or two counts, given as a mapping or as pairs)
    the stretch is E[corun(min(k, cores)) x max(1, k / cores)] over the others' busy states, k = 1 + N."""
    rng = random.Random(100 + seed)
    n, cores = rng.randint(1, 6), rng.randint(1, 4)
    corun = {2: 1 + rng.random() / 2} if seed % 2 else {2: 1.2, 3: 1.2 + rng.random()}
    shares = [rng.choice([0.0, 1.0, rng.random(), 0.5]) for _ in range(n)]
    want = _brute(shares, cores, 1, corun)
    assert shared_core_stretch(shares, cores, 1, corun) == pytest.approx(want, rel=1e-12)
    assert shared_core_stretch(shares, cores, 1, tuple(corun.items())) == pytest.approx(want, rel=1e-12)
    # by hand: 2 always busy on 2 cores: x corun(2); with one never computing: x1; on 1 core: 2 x corun(1) = 2
    assert shared_core_stretch([1.0, 1.0], 2, 1, {2: 1.3}) == [pytest.approx(1.3)] * 2
    assert shared_core_stretch([1.0, 0.0], 2, 1, {2: 1.3})[0] == 1.0
    assert shared_core_stretch([1.0, 1.0], 1, 1, {2: 1.3}) == [2.0, 2.0]


def _plan_on(workers: int, cores: int | None, stages: int, replicas: int, m: int,
             schedule: str = "flush") -> tuple[Any, Any, Any]:
    """``_plan``'s three equal layers (1 ms forward, 2 ms backward) on ``workers`` workers of a host of ``cores``,
    as ``stages`` stages (layers split as evenly as they go) of ``replicas`` replicas each."""
    from pdcompile.ir import Chain, ChainLayer
    from pdcompile.passes.partition_dp import plan_from_assignment

    chain = Chain(tuple(ChainLayer(f"l{i}", "linear", 1e-3, 2e-3, 0.0, 0.0) for i in range(3)), (0.0, 0.0),
                  batch_size=m)
    cluster = ClusterSpec(Device("cpu", cores=cores), (Level("processes", workers, 1e9),))
    cuts = [round(3 * s / stages) for s in range(stages + 1)]
    assignment = [(cuts[s], cuts[s + 1] - 1, replicas, tuple(range(s * replicas, (s + 1) * replicas)))
                  for s in range(stages)]
    return plan_from_assignment(chain, cluster, assignment, schedule=schedule, num_microbatches=m), chain, cluster


def test_corun_charges_a_rank_alone_nothing_and_replicas_always_busy_all_of_it() -> None:
    """2 workers on 2 cores (no time-sharing), co-running x1.3 calibrated: one rank computing alone (a plan on
    rank 0 only) keeps the chain's step; two data-parallel replicas, always computing together, take x1.3; on 3
    workers sharing 2 cores, three replicas take x1.5 (time-sharing) x 1.3 (two computing at once on the cores),
    charged once (the chain carrying the static time-sharing x1.5, as the annotate pass charges it, and no
    co-running)."""
    corun = ((2, 1.3),)
    for (workers, cores, stages, replicas, m), want, sharing in [((2, 2, 1, 1, 1), 1.0, 1.0),
                                                                   ((2, 2, 1, 2, 2), 1.3, 1.0),
                                                                   ((3, 2, 1, 3, 3), 1.5 * 1.3, 1.5)]:
        plan, chain, shared = _plan_on(workers, cores, stages, replicas, m)
        own_plan, own_chain, own = _plan_on(workers, None, stages, replicas, m)
        uncharged = _step(own_plan, own_chain, own, m) / contention(shared)  # the chain carries time-sharing
        assert _step(plan, chain, shared, m, corun=corun) == pytest.approx(uncharged * want, rel=1e-9), workers
        # without a calibration: no co-running charge; the chain's static time-sharing only where it crowds
        assert _step(plan, chain, shared, m) == pytest.approx(uncharged * sharing, rel=1e-9), workers


@pytest.mark.parametrize("schedule, m", [("flush", 4), ("gpipe", 2), ("1f1b", 6), ("zb-h1", 4)])
def test_a_two_stage_pipeline_is_charged_corun_only_while_both_compute(schedule: str, m: int) -> None:
    """A 2-stage pipeline on 2 workers and 2 cores, co-running x1.3: its first stage computes alone in the fill,
    its last in the drain, so its step lies strictly between the uncharged one and the one charged x1.3
    throughout (the chain charged statically, as annotate_costs did before); the fast replay agrees."""
    from pdcompile.simulate import simulate_plan

    plan, chain, shared = _plan_on(2, 2, 2, 1, m, schedule)
    kw: dict[str, Any] = dict(split_backward=schedule == "zb-h1")
    base = float(simulate_plan(plan, chain, shared, schedule, m, **kw).step_time_s)
    static = float(simulate_plan(plan, _times(chain, 1.3), shared, schedule, m, **kw).step_time_s)
    assert static == pytest.approx(base * 1.3, rel=1e-9)
    slow = simulate_plan(plan, chain, shared, schedule, m, corun=((2, 1.3),), **kw)
    fast = simulate_plan(plan, chain, shared, schedule, m, corun=((2, 1.3),), timeline=False, **kw)
    assert fast.makespan_s == pytest.approx(slow.makespan_s, rel=1e-9)
    assert base * 1.01 < float(slow.step_time_s) < static * 0.99


def _times(chain: Any, f: float) -> Any:
    """``chain`` with every layer's compute x ``f`` (the static charge annotate_costs.run used to apply)."""
    import dataclasses

    return dataclasses.replace(chain, layers=tuple(dataclasses.replace(l, forward_s=l.forward_s * f,
                                                                       backward_s=l.backward_s * f)
                                                   for l in chain.layers))


def test_corun_is_charged_in_one_place_and_explain_and_the_cli_say_where(pdcompile_cache: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A calibrated local cluster: the annotate pass charges the chain time-sharing only (no co-running), the
    options the step search and simulate() read carry the table (api.corun_of, the CLI's with_step_costs), and
    explain() and the CLI's step-cost line say the simulator charges it while ranks compute together."""
    import pdcompile.cluster as cl
    from pdcompile import machine_cache
    from pdcompile._cli.plan import with_step_costs
    from pdcompile.api import corun_of
    from pdcompile.cluster import local_cpu_cluster
    from pdcompile.passes.costs.opclass import OpCostTable
    from pdcompile.passes.planner.options import PlanOptions

    monkeypatch.setattr(cl, "host_cores", lambda: 2)
    table = OpCostTable(corun={2: 1.3})
    source = machine_cache.CostSource("calibrated", "analytic", table, "calibrated on this host")
    two, three = local_cpu_cluster(2), local_cpu_cluster(3)
    assert corun_of(two, source) == corun_of(three, source) == ((2, 1.3),)
    assert corun_of(two, machine_cache.CostSource("analytic", "analytic", None, "")) == ()
    assert corun_of(ClusterSpec(Device("cpu"), (Level("processes", 2, 1e9),)), source) == ()  # not this host's
    options, line = with_step_costs(PlanOptions(), two, source)
    assert options.corun == ((2, 1.3),) and "corun=2:1.3 " in str(options)
    assert "side by side: compute x1.30 with 2 computing at once, charged only while ranks compute together" in line
    said = " ".join(source.explain(two))
    assert "x1.30 slower than one alone" in said and "only while ranks compute at once" in said
    assert "every rank always busy x1.30" in said and "not in the chain's costs" in said
    assert "every rank always busy x1.95" in " ".join(source.explain(three))  # x1.5 time-sharing, x1.3 beside


def _search_against_every_candidate(seed: int, **charges: Any) -> None:
    """On 2 workers of 2 cores and on 3 sharing 2, random chains: the step search (``PlanOptions(**charges)``
    charged by the simulator) returns a step no longer than planning and simulating every (microbatch count,
    copies) candidate and no shorter than those plans at every count: its bounds stay below every candidate's
    simulated step."""
    from test_plan_step import _every_candidate, _random_chain

    from pdcompile.passes.planner.options import PlanOptions
    from pdcompile.plan import plan

    rng = random.Random(seed)
    for workers in (2, 3):
        cluster = ClusterSpec(Device("cpu", memory=400 * 2**30, cores=2), (Level("processes", workers, 1e9),))
        for trial in range(4):
            chain = _random_chain(rng, rng.randint(3, 7), rng.choice([1, 2]))
            opts = PlanOptions(schedule=rng.choice(["flush", "gpipe", "zb-h1"]), num_microbatches=rng.choice([2, 6]),
                               choose_microbatches=True, **charges)
            want, every = _every_candidate(chain, cluster, opts)
            assert want is not None and every is not None and not want[0], (workers, trial)
            step = plan(chain, cluster, opts).seconds_per_minibatch
            assert every[1] * (1 - 1e-9) <= step <= want[1] * (1 + 1e-9), (workers, trial)


def test_the_step_search_with_corun_finds_the_step_of_every_candidate_simulated() -> None:
    """Co-running charged (x1.4, 2 computing at once): the bounds (the chain's compute / contention: every
    stretch is at least 1) still hold."""
    _search_against_every_candidate(36, corun=((2, 1.4),))


# -- a rank woken by a message on more ranks than cores (issue 36, session 22) -----------------------------------

def _held_brute(shares: list[float], cores: int, threads: int = 1) -> list[float]:
    """P(the others computing hold every core: threads x N >= cores) over every on/off state of the others."""
    out = []
    for i in range(len(shares)):
        e = 0.0
        for state, p in _states([q for j, q in enumerate(shares) if j != i]):
            e += p if threads * sum(state) >= cores else 0.0
        out.append(e)
    return out


@pytest.mark.parametrize("seed", range(6))
def test_cores_held_by_hand_and_against_brute_force(seed: int) -> None:
    from pdcompile.passes.costs.roofline import cores_held

    # by hand: 3 ranks each computing half the time on 2 cores: both others at once 1/4 of the time
    assert cores_held([0.5] * 3, 2) == [pytest.approx(0.25)] * 3
    assert cores_held([1.0, 0.0, 1.0], 2) == [0.0, 1.0, 0.0]  # only the idle one finds both cores held
    assert cores_held([1.0, 1.0], 2) == [0.0, 0.0] and cores_held([1.0] * 3, 3) == [0.0] * 3  # a core each
    assert cores_held([1.0, 1.0], 2, threads=2) == [1.0, 1.0]
    rng = random.Random(seed)
    n, cores, threads = rng.randint(1, 7), rng.randint(1, 4), rng.choice([1, 1, 2])
    shares = [rng.choice([0.0, 1.0, rng.random(), 0.5]) for _ in range(n)]
    assert cores_held(shares, cores, threads) == pytest.approx(_held_brute(shares, cores, threads), rel=1e-12)


def _sent_plan(cores: int | None, workers: int, stages: int, m: int, schedule: str = "flush"
               ) -> tuple[Any, Any, Any]:
    """``_plan``'s layers (1 ms forward, 2 ms backward) with 1 MB sent at every cut over 1 GB/s (1 ms), one
    layer a stage on ``workers`` workers (the rest data parallel: ``stages`` 1)."""
    from pdcompile.ir import Chain, ChainLayer
    from pdcompile.passes.partition_dp import plan_from_assignment

    chain = Chain(tuple(ChainLayer(f"l{i}", "linear", 1e-3, 2e-3, 0.0, 0.0) for i in range(3)), (1e6, 1e6),
                  batch_size=m)
    cluster = ClusterSpec(Device("cpu", cores=cores), (Level("processes", workers, 1e9),))
    if stages == 1:
        assignment = [(0, 2, workers, tuple(range(workers)))]
    else:
        bounds = [(0, 0), (1, 1), (2, 2)] if stages == 3 else [(0, 0), (1, 2)]
        assignment = [(a, b, 1, (s,)) for s, (a, b) in enumerate(bounds)]
    return plan_from_assignment(chain, cluster, assignment, schedule=schedule, num_microbatches=m), chain, cluster


def test_a_woken_rank_waits_wake_x_the_chance_both_cores_are_held_by_hand() -> None:
    """3 stages at M=1 on 2 cores: every message reaches a rank asleep in its receive (it has nothing else to
    do), so each compute after a hand-off starts the transfer (1 ms) plus ``wake_s`` x the chance the other two
    compute at once, which by hand is the product of their busy shares (each share read off the run: busy /
    makespan), after the sender's compute ended."""
    from pdcompile.simulate import simulate_plan

    plan, chain, cluster = _sent_plan(2, 3, 3, 1)
    wake = 4e-3
    res = simulate_plan(plan, chain, cluster, "flush", 1, split_backward=False, wake_s=wake)
    span = float(res.makespan_s)
    share = {r: float(res.busy[r]) / span for r in range(3)}
    ev = {e.name: e for e in res.events if e.category not in ("send", "transfer")}
    checked = 0
    for before, after, rank in (("0F0", "1F0", 1), ("1F0", "2F0", 2), ("2B0", "1B0", 1), ("1B0", "0B0", 0)):
        a, b = (r for r in range(3) if r != rank)
        want = 1e-3 + wake * share[a] * share[b]
        assert float(ev[after].start_s) - float(ev[before].end_s) == pytest.approx(want, rel=2e-3), (before, after)
        checked += 1
    assert checked == 4
    # the same plan without the wake-up: every hand-off the transfer alone
    res0 = simulate_plan(plan, chain, cluster, "flush", 1, split_backward=False)
    ev0 = {e.name: e for e in res0.events}
    assert float(ev0["1F0"].start_s) - float(ev0["0F0"].end_s) == pytest.approx(1e-3, rel=1e-9)
    assert float(res.makespan_s) > float(res0.makespan_s)


@pytest.mark.parametrize("cores, workers, stages", [(2, 2, 2), (None, 3, 3), (3, 3, 3), (2, 3, 1)])
def test_the_wake_up_is_charged_only_on_more_workers_than_cores(cores: int | None, workers: int,
                                                                stages: int) -> None:
    """No charge where each rank has a core (2 on 2, 3 on 3, cores of their own), nor where nothing is sent
    (data parallel x3 on 2 cores: its all-reduce is the crowded one's, calibrated apart): the step is the same
    with ``wake_s`` as without, exactly."""
    from pdcompile.simulate import simulate_plan

    m = 3 if stages == 1 else 2
    plan, chain, cluster = _sent_plan(cores, workers, stages, m)
    kw = dict(split_backward=False, overhead_s={"F": 1e-4, "RF": 5e-5}, collective=(1e-3, 7e8))
    with_wake = simulate_plan(plan, chain, cluster, "flush", m, wake_s=5e-3, **kw)
    without = simulate_plan(plan, chain, cluster, "flush", m, **kw)
    assert with_wake.makespan_s == without.makespan_s


@pytest.mark.parametrize("schedule, m", [("flush", 4), ("zb-h1", 8), ("1f1b", 6), ("flush", 1)])
def test_simulate_and_the_fast_replay_agree_with_the_wake_up(schedule: str, m: int) -> None:
    from pdcompile.simulate import simulate_plan

    plan, chain, cluster = _sent_plan(2, 3, 3, m, schedule=schedule)
    kw = dict(split_backward=schedule == "zb-h1", overhead_s={"F": 1e-4, "SF": 5e-5}, wake_s=2e-3,
              corun=((2, 1.2),))
    slow = simulate_plan(plan, chain, cluster, schedule, m, **kw)
    fast = simulate_plan(plan, chain, cluster, schedule, m, timeline=False, **kw)
    assert slow.events and fast.makespan_s == pytest.approx(slow.makespan_s, rel=1e-9)
    assert float(slow.makespan_s) > float(simulate_plan(plan, chain, cluster, schedule, m,
                                                        **{**kw, "wake_s": 0.0}).makespan_s)


def test_the_wake_up_is_read_back_and_charged_on_a_local_cluster_only(pdcompile_cache: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The calibration's ``wake_crowded_s`` reaches ``ActionCost.wake`` on a local cluster (simulate_plan's
    ``wake_s``, which shared_cores charges only on more workers than cores), 0 on a cluster elsewhere; and
    measure_wake's figure is the median over its rounds of crowded less quiet, at least 0."""
    import pdcompile.cluster as cl
    from pdcompile import machine_cache
    from pdcompile.api import step_costs
    from pdcompile.calibrate_link import wake_of
    from pdcompile.cluster import local_cpu_cluster

    monkeypatch.setattr(cl, "host_cores", lambda: 2)
    pdcompile_cache.mkdir(parents=True, exist_ok=True)
    (pdcompile_cache / "machine-constants.json").write_text(json.dumps({
        "key": machine_cache.machine_key(), "overhead_s": {"F": 1e-4}, "wake_crowded_s": 9e-4}))
    source = machine_cache.cost_source("analytic", True)
    here = step_costs(local_cpu_cluster(3), source)[0]
    elsewhere = step_costs(ClusterSpec(Device("cpu"), (Level("processes", 3, 1e9),)), source)[0]
    assert here is not None and here.wake == 9e-4 and elsewhere is not None and elsewhere.wake == 0.0
    # pdcompile plan / simulate charge it as pdcompile() does, and say so where workers outnumber cores
    from pdcompile._cli.plan import with_step_costs
    from pdcompile.passes.planner.options import PlanOptions

    opts3, line3 = with_step_costs(PlanOptions(), local_cpu_cluster(3), source)
    opts2, line2 = with_step_costs(PlanOptions(), local_cpu_cluster(2), source)
    assert opts3.wake_s == opts2.wake_s == 9e-4
    assert "a rank woken by a message waits 0.90 ms for a core" in line3 and "woken" not in line2
    # rounds: quiet means 0.1, 0.2 and (a burst of other work on the free core) 2.6 ms, left out (> 3 x 0.2);
    # the rest pooled: crowded (1.1 + 1.1 + 0.1 + 2.1) / 4 = 1.1 less quiet (0.1 + 0.1 + 0.1 + 0.3) / 4 = 0.15
    quiet = [[0.1e-3, 0.1e-3], [0.1e-3, 0.3e-3], [3e-3, 2.2e-3]]
    crowded = [[1.1e-3, 1.1e-3], [0.1e-3, 2.1e-3], [0.6e-3, 0.6e-3]]
    assert wake_of(quiet, crowded) == pytest.approx(0.95e-3, rel=1e-9)
    assert wake_of([[1e-3]], [[0.5e-3]]) == 0.0 and wake_of([], []) == 0.0


def test_the_step_search_with_the_wake_up_finds_the_step_of_every_candidate_simulated() -> None:
    """The wake-up charged (and co-running) on 3 workers sharing 2 cores, and on 2 (charged nothing): the wake-up
    only delays messages, so the bounds read off the chain still hold."""
    _search_against_every_candidate(22, corun=((2, 1.2),), wake_s=1e-3)
