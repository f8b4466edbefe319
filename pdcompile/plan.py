"""The Plan and the planners' entry point: :func:`plan` runs a planner (``passes/partition_dp.py``,
``passes/partition_ilp.py``) and also chooses the microbatch size when the caller can give the
chain at several sizes. For a synchronous schedule (flush, gpipe, zb-h1) the objective is the step
that schedule runs, as :func:`pdcompile.simulate.simulate_plan` replays it (fill and drain
included): :func:`plan_step`. The Plan itself (plain, frozen data with a JSON form and a text
table) lives in ``pdcompile/plan_data.py``, below the planners that build it; it is re-exported here.
"""

from __future__ import annotations

import heapq
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from pdcompile.errors import InfeasiblePlanError, UsageError
from pdcompile.passes.costs.roofline import contention
from pdcompile.passes.partition_dp import partition_dp
from pdcompile.passes.partition_ilp import partition_ilp
from pdcompile.passes.planner.options import PlanOptions
from pdcompile.plan_data import PLAN_FORMAT, PLAN_VERSION, Plan, StagePlan
from pdcompile.runtime.schedules import POLICIES

if TYPE_CHECKING:  # pragma: no cover
    from pdcompile.cluster import ClusterSpec
    from pdcompile.ir import Chain

__all__ = ["PLAN_FORMAT", "PLAN_VERSION", "StagePlan", "Plan", "PlanOptions", "plan", "plan_step", "step_objective",
           "chooses_microbatches", "step_headline", "layout_of", "tied_of"]


def plan(
    chain: "Chain | Callable[[int], Chain]",
    cluster: "ClusterSpec",
    options: PlanOptions | None = None,
    *,
    solver: str = "dp",
    microbatch_sizes: Sequence[int] | None = None,
    split_backward: bool | None = None,
    faster_than: float | None = None,
    **overrides: Any,
) -> Plan:
    """Plan ``chain`` for ``cluster`` with ``solver`` (``"dp"`` or ``"ilp"``).

    ``chain`` is a :class:`~pdcompile.ir.Chain` (planned at its own batch size), or a callable
    ``chain_for(b) -> Chain`` giving the costs at microbatch size ``b``; then every size in
    ``microbatch_sizes`` is planned and the plan with the highest predicted samples per second
    that fits in memory wins (ties: the smaller size). Raises
    :class:`~pdcompile.errors.InfeasiblePlanError` when no size fits. ``options``
    (:class:`PlanOptions`) and other keyword options go to the solver (``schedule=``, ...; the ILP's
    ``time_limit_s``, ``hint``). ``split_backward``: whether the program splits a drain's backwards, for the
    step search of a synchronous schedule (None: the cluster's default, as the schedule pass decides).
    ``faster_than``: the step search's cut (:func:`plan_step`; other planners ignore it).
    """
    solvers: dict[str, Callable[..., Plan]] = {"dp": partition_dp, "ilp": partition_ilp}
    if solver not in solvers:
        raise UsageError(f"unknown solver {solver!r} (use 'dp' or 'ilp')")
    solve = solvers[solver]
    tp = overrides.get("tensor_parallel", (options or PlanOptions()).tensor_parallel)
    if tp != 1:  # each degree planned as the rest is (passes/partition_dp.py plan_tensor_parallel)
        if callable(chain):
            raise UsageError("tensor_parallel with a callable chain: plan one Chain (its microbatch size) at a time")
        from pdcompile.passes.partition_dp import plan_tensor_parallel
        known = set(PlanOptions.names())
        rest = {k: v for k, v in overrides.items() if k not in known}
        opts = (options or PlanOptions()).with_({k: v for k, v in overrides.items() if k in known})
        return plan_tensor_parallel(chain, cluster, opts, lambda c, cl, o, split, faster: plan(
            c, cl, o, solver=solver, split_backward=split, faster_than=faster, **rest),
            rate=_step_rate(opts, cluster) if step_objective(opts.schedule) else None)
    if not callable(chain):
        if microbatch_sizes:
            raise UsageError("microbatch_sizes needs a callable chain_for(b) -> Chain")
        schedule = overrides.get("schedule", (options or PlanOptions()).schedule)
        if step_objective(schedule):
            return plan_step(chain, cluster, options, solver=solver, split_backward=split_backward,
                             faster_than=faster_than, **overrides)
        return solve(chain, cluster, options, **overrides)
    if not microbatch_sizes:
        raise UsageError("a callable chain needs microbatch_sizes to choose from")
    t0 = time.perf_counter()
    best: Plan | None = None
    failures: list[str] = []
    for b in sorted(set(int(b) for b in microbatch_sizes)):
        if b <= 0:
            raise UsageError(f"microbatch sizes must be positive (got {b})")
        try:
            p = solve(chain(b), cluster, options, **overrides)
        except InfeasiblePlanError as e:
            failures.append(f"{b}: {e}")
            continue
        if best is None or p.samples_per_second > best.samples_per_second * (1 + 1e-12):
            best = p
    if best is None:
        raise InfeasiblePlanError(
            "no microbatch size fits in memory (" + "; ".join(failures) + ")"
        )
    return replace(best, planning_seconds=time.perf_counter() - t0,
                   notes=best.notes + (f"microbatch size chosen among {sorted(set(microbatch_sizes))}",))


def _step_rate(opts: PlanOptions, cluster: "ClusterSpec") -> Callable[[Plan, "Chain", Any, float], tuple[bool, float]]:
    """How a plan with a degree per stage is rated (``partition_dp.per_stage_degrees``): its simulated step, as
    :func:`plan_step` and the compiled program's ``simulate()`` charge it (each stage's optimizer step, the
    per-action cost, the tied all-reduce; backwards whole, as a split stage runs them), and whether it is over
    memory (the plan's own stage memory, then the simulated peak). One that cannot beat ``beat`` (its stage memory
    over the limit, or :func:`_plan_lower_bound` at or above it) is not simulated: ``(over, inf)``."""
    from pdcompile.simulate import update_bandwidth_of

    update_bw = opts.update_bandwidth if opts.update_bandwidth is not None else update_bandwidth_of(cluster)
    memory_on = opts.memory_limit if opts.memory_limit is not None else opts.cost_model == "default"
    limit = float(cluster.device.memory) if memory_on and cluster.device.memory else math.inf

    def rate(p: Plan, chain: "Chain", view: Any, beat: float) -> tuple[bool, float]:
        m = p.num_microbatches or 1
        if any(float(st.memory_bytes) > limit * (1 + 1e-9) for st in p.stages):
            return True, math.inf
        if _plan_lower_bound(p, chain, view, m, False, update_bw, opts.optimizer_state_factor, opts.schedule,
                             False, opts.overhead_s) >= beat:
            return False, math.inf
        res = _simulated(p, chain, view, opts, m, False, update_bw)
        peak = max(map(float, res.peak_memory_bytes or [0.0]))
        return peak > limit * (1 + 1e-9), float(res.step_time_s)

    return rate


def _simulated(p: Plan, chain: "Chain", cluster: Any, opts: PlanOptions, m: int, split: bool,
               update_bw: float) -> Any:
    """``p`` simulated as the step search rates its candidates and the compiled program's ``simulate()`` charges
    it: each stage's optimizer step, the per-action cost, the tied all-reduce, the calibrated collective, the
    co-running slowdown while ranks compute side by side (simulate.shared_cores); no
    events (the fast replay, pdcompile/simulate_fast.py)."""
    from pdcompile.simulate import simulate_plan

    tied_bytes, tied_stages = tied_of(p, chain)
    return simulate_plan(p, chain, cluster, opts.schedule, m, split_backward=split,
                         optimizer_state_factor=opts.optimizer_state_factor, update_bandwidth=update_bw,
                         overhead_s=opts.overhead_s, tied_bytes=tied_bytes, tied_stages=tied_stages,
                         collective=opts.collective, corun=opts.corun, wake_s=opts.wake_s, timeline=False)


def step_objective(schedule: str) -> bool:
    """Whether plans for ``schedule`` are chosen by their simulated step (:func:`plan_step`): the
    synchronous schedules with a stage per rank (flush, gpipe, zb-h1), whose step fills and drains
    the pipeline. 1F1B and 2BW keep PipeDream's steady-state objective (their pipeline never
    drains); virtual stages are planned by the partition pass (``virtual_plan``)."""
    pol = POLICIES.get(schedule)
    return pol is not None and pol.synchronous and pol.placement is None


def chooses_microbatches(cluster: Any, schedule: str, *given: Any) -> bool:
    """Whether ``pdcompile()`` lets the step search choose the microbatch count: where ``given`` (the
    microbatch count, size and stages asked) are all None, for a schedule :func:`step_objective`
    plans, on a cluster (a ClusterSpec). CPU workers too: the analytic model charges each operation's
    fixed cost, which makes small microbatches dearer per sample (issue 36; bench_plan_regret measured the
    old fixed default, 4, at 1.23-1.39x the best candidate there)."""
    device = getattr(cluster, "device", None)
    return all(g is None for g in given) and device is not None and step_objective(schedule)


def step_headline(schedule: str, num_microbatches: int, microbatch_size: int) -> str:
    """What a compiled program's headline is (``Plan.predicted_by``): its ``simulate()``."""
    what = "fill and drain included" if POLICIES[schedule].synchronous else \
        "one step from an empty pipeline; its steady state is the bottleneck x microbatches"
    return (f"simulate() of the compiled {schedule} step: {num_microbatches} microbatch"
            f"{'es' if num_microbatches != 1 else ''} of {microbatch_size}, {what}")


def microbatch_choices(minibatch: int, most: int = 64) -> list[int]:
    """The microbatch counts a step may be cut into: every divisor of ``minibatch`` up to ``most``."""
    return [m for m in range(1, min(minibatch, most) + 1) if minibatch % m == 0]


@dataclass(frozen=True)
class ChainWork:
    """What a lower bound of a synchronous step reads of a chain: per layer its forward and backward, their
    fixed parts (paid whatever the microbatch's size) and a split backward's input- and weight-gradient
    parts (as profiled, else the simulator's shares of the backward); the parameter bytes. Plain arrays;
    :meth:`at` gives them at another microbatch size as the simulator scales them."""

    forward: np.ndarray
    forward_fixed: np.ndarray
    backward: np.ndarray
    backward_fixed: np.ndarray
    input_grad: np.ndarray
    weight_grad: np.ndarray
    split: bool
    param_bytes: float
    batch_size: int
    rerun: bool = False

    @classmethod
    def of(cls, chain: "Chain", split: bool, rerun: bool = False) -> "ChainWork":
        """``split``: some backward may be split (``B`` then ``W``), as :func:`~pdcompile.simulate.simulate_plan`
        costs the parts; ``rerun``: every stage runs its forward again in its backward (``recompute="full"``,
        the only mode the planner then gives a stage)."""
        from pdcompile.simulate import INPUT_GRAD_SHARE, WEIGHT_GRAD_SHARE

        def col(get: Callable[[Any], float]) -> np.ndarray:
            return np.array([get(l) for l in chain.layers], dtype=float)

        return cls(col(lambda l: l.forward_s), col(lambda l: l.forward_fixed_s), col(lambda l: l.backward_s),
                   col(lambda l: l.backward_fixed_s),
                   col(lambda l: l.input_grad_s if l.input_grad_s is not None else l.backward_s * INPUT_GRAD_SHARE),
                   col(lambda l: l.weight_grad_s if l.weight_grad_s is not None else l.backward_s * WEIGHT_GRAD_SHARE),
                   split, float(sum(l.param_bytes for l in chain.layers)), chain.batch_size, rerun)

    def at(self, microbatch_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per layer at ``microbatch_size`` (``ChainLayer.scaled``): the forward; the part of the backward
        a stage finishes before it sends its input gradient (the input-gradient part where backwards
        may be split, else all of it); a microbatch's whole work on its stage (the forward and the least
        its backward costs, split or not); with ``rerun``, the backward's parts each with the forward run again
        before them (the simulator adds a stage's recomputation to its ``B``, whole or split)."""
        s = microbatch_size / self.batch_size
        f = self.forward_fixed + (self.forward - self.forward_fixed) * s
        b = self.backward_fixed + (self.backward - self.backward_fixed) * s
        again = f if self.rerun else np.zeros_like(f)
        if not self.split:
            return f, b + again, f + b + again
        k = np.divide(b, self.backward, out=np.full_like(b, s), where=self.backward != 0)
        gi, gw = self.input_grad * k, self.weight_grad * k
        return f, np.minimum(gi, b) + again, f + np.minimum(b, gi + gw) + again


def step_lower_bound(cw: ChainWork, microbatch_size: int, num_microbatches: int, copies: int, workers: int,
                     allow_replication: bool = True) -> float:
    """A bound below the simulated synchronous step of every plan of ``copies`` pipeline copies on
    ``workers`` workers with ``num_microbatches`` microbatches of ``microbatch_size``, read off the chain
    alone (no plan): one microbatch's way forward through every layer and its input gradient back (the
    critical path); the whole step's work shared by every worker; the busiest layer's work on one
    worker's share of a copy's microbatches. Transfers, all-reduces and recomputation only add."""
    f, back, work = cw.at(microbatch_size)
    per_copy, width = num_microbatches // copies, workers // copies
    path = float(f.sum() + back.sum())
    shared = num_microbatches * float(work.sum()) / workers
    busiest = math.ceil(per_copy / (width if allow_replication else 1)) * float(work.max(initial=0.0))
    return max(path, shared, busiest) * (1 - 1e-9)  # the sums in another order than the simulator's


def copies_fit(cw: ChainWork, copies: int, workers: int, budget: float, optimizer_state_factor: float,
               shard: Any = "none") -> bool:
    """Whether one of ``copies`` copies (``workers / copies`` workers of ``budget`` bytes) can hold the chain's
    state, read off the chain alone: a replica of a stage holds its weights x ``2 + f / r`` at least when
    its gradients exist (sharding.py: one working copy, the gradients, its share of the optimizer state,
    which ``optimizer`` divides least), so ``r`` replicas together at least ``2 + f``. A copy that cannot
    is over memory under every plan, in the planner's model and the simulator's alike. ``shard``: the
    replicas' state as ``PlanOptions.shard`` allows it: the optimizer state sharded (``"optimizer"``) is
    divided among every replica of a stage, the copies' included, so a copy holds the weights and gradients
    at least; weights sharded too (``"full"``, ``"auto"``, per stage): no test."""
    if not math.isfinite(budget) or shard not in ("none", "optimizer"):
        return True
    need = cw.param_bytes * (2.0 + (optimizer_state_factor if shard == "none" else 0.0))
    return need <= (workers // copies) * budget * (1 + 1e-9)


def copy_options(opts: PlanOptions, per_copy: int) -> PlanOptions:
    """The options one pipeline copy of :func:`plan_step` is planned with: its ``per_copy`` microbatches,
    and with one microbatch no replicated stage (a second replica would have no microbatch to run: the
    planner's steady-state objective shares a stage's work among replicas however few microbatches there
    are, so it would replicate where the step cannot use it; data parallelism is the copies' part)."""
    return replace(opts, num_microbatches=per_copy, choose_microbatches=False,
                   allow_replication=opts.allow_replication and per_copy > 1)


def plan_step(chain: "Chain", cluster: "ClusterSpec", options: PlanOptions | None = None, *, solver: str = "dp",
              split_backward: bool | None = None, faster_than: float | None = None, **overrides: Any) -> Plan:
    """The plan of ``chain`` on ``cluster`` whose step under ``options.schedule`` (synchronous) is the
    shortest that :func:`~pdcompile.simulate.simulate_plan` predicts (each stage's optimizer step
    included, at ``options.update_bandwidth`` or else the cluster's ``update_bandwidth_of``, every
    action's ``options.action_overhead_s``, and the all-reduce of weights tied across its stages,
    :func:`tied_of`); its ``seconds_per_minibatch``
    is that step (the minibatch is ``chain.batch_size x num_microbatches``).

    The outer search is over the microbatch count ``M`` (every divisor of the minibatch with
    ``options.choose_microbatches``, else the given one) and the number ``k`` of pipeline copies
    (``k`` divides the workers and ``M``): the planner (DP or ILP, the inner search, minimising the
    bottleneck) plans one copy on the cluster's first ``W / k`` workers with ``M / k`` microbatches,
    at the microbatch size ``minibatch / M`` (``Chain.at_batch``); its ``k`` copies side by side, or
    each stage's ``k`` copies of replicas next to each other, are rated on the whole cluster and
    simulated. The search is best first: a candidate is planned in the order of a bound of its step read
    off the chain alone (:func:`step_lower_bound`), each arrangement of its copies is then simulated in the
    order of its plan's own bound (:func:`_plan_lower_bound`: the busiest replicas' work, all-reduces and
    optimizer steps, each stage's first replica in the schedule's order), the two kinds interleaved by
    bound, and the search stops where the least bound left passes the best step that fits: most candidates
    are never planned, most planned ones never simulated. A copy too small to hold the chain's state
    (:func:`copies_fit`) is not planned. A candidate whose simulated peak memory is over the device's
    loses to one that fits; of equal steps, the first in the chain-bound order wins. Each plan planned (and
    each of ``options.also_rate``) is also queued at the other counts its replicas divide, at their chain-only
    bounds: the bottleneck-optimal plan for one count can run another count's step best. The step is no
    longer than planning and simulating every candidate, and no shorter than those plans simulated at every
    count (``tests/test_plan_step.py`` checks both against that search). ``faster_than`` (another search's step, e.g. another tensor-parallel degree's): bounds
    at or above it end the search too, and where that cut left no plan faster than it,
    :class:`~pdcompile.passes.partition_dp.SlowerPlanError`."""
    from pdcompile.passes.partition_dp import plan_from_assignment
    from pdcompile.runtime.schedules.spec import default_split_backward
    from pdcompile.simulate import update_bandwidth_of

    t0 = time.perf_counter()
    solve = {"dp": partition_dp, "ilp": partition_ilp}[solver]
    names = set(PlanOptions.names())
    opts = (options or PlanOptions()).with_({k: v for k, v in overrides.items() if k in names})
    # each stage's optimizer step and the runtime's per-action cost, as simulate() of the compiled pipeline
    # charges them (the figures PlanOptions carries, from pdcompile.api: calibrated on this machine or not)
    update_bw = opts.update_bandwidth if opts.update_bandwidth is not None else update_bandwidth_of(cluster)
    rest = {k: v for k, v in overrides.items() if k not in names}
    m0 = max(1, int(opts.num_microbatches or 1))
    minibatch = chain.batch_size * m0
    workers = cluster.num_workers
    counts = microbatch_choices(minibatch, minibatch) if opts.choose_microbatches else [m0]
    split = default_split_backward("cpu" if cluster.device.name == "cpu" else "gpu", workers, os.cpu_count() or 1) \
        if split_backward is None else split_backward  # as the schedule pass decides (tensor parallelism: whole)
    pol = POLICIES[opts.schedule]
    cw = ChainWork.of(chain, split or pol.splits_every_backward or pol.order_splits, opts.recompute == "full")
    # the memory limit as the planner applies it: on where asked, else the default cost model's default
    memory_on = opts.memory_limit if opts.memory_limit is not None else opts.cost_model == "default"
    limit = float(cluster.device.memory) if memory_on and cluster.device.memory else math.inf
    # the bounds read the chain's compute, which carries the static charge of a cluster of more processes than cores;
    # simulate_plan charges a rank alone none of it (simulate.shared_cores): bounds x low stay below its steps
    low = 1.0 / contention(cluster)
    order = sorted((step_lower_bound(cw, minibatch // m, m, k, workers, opts.allow_replication) * low, m, k)
                   for m in counts for k in range(1, workers + 1) if workers % k == 0 and m % k == 0)
    failures: list[str] = []
    # (over memory, step, candidate's place in the order, arrangement), plan, its copy, M: of equal steps the
    # first in the order wins, as a search visiting the candidates in that order would keep it
    best: tuple[tuple[bool, float, int, int], Plan, Plan, int] | None = None
    chains: dict[int, Chain] = {}
    planned = rated = 0
    # best first: a candidate to plan (arrangement 0) at its chain-only bound, a planned copy's arrangements at
    # their own bounds (_plan_lower_bound); each popped in the order of its bound, until none left can beat
    # the best that fits
    heap: list[tuple[float, int, int, Any]] = [(lb, i, 0, (m, k)) for i, (lb, m, k) in enumerate(order)]
    cap = math.inf if faster_than is None else faster_than
    cut = False  # whether the cap ended the search

    def rate_elsewhere(one: _Layout, k: int, planned_m: int, sub: Plan | None) -> None:
        """Queue ``one`` (``k`` copies) at every other count its replicas divide, at that count's chain-only
        bound: the bottleneck-optimal plan for one count can run another count's step best (Fashion-MNIST on 3
        processes: the 16-count plan at 6 microbatches, 30.6 ms, against 38.4 at 16 and 42.9 for the 6-count's
        own plan). Ordered after every candidate of the chain order, so ties keep the order's first."""
        for m in counts:
            if m != planned_m and m % k == 0 and all((m // k) % st.replicas == 0 for st in one.stages):
                lb = step_lower_bound(cw, minibatch // m, m, k, workers, opts.allow_replication) * low
                heapq.heappush(heap, (lb, len(order) + len(elsewhere), -1, (one, k, m, sub)))
                elsewhere.append(m)

    elsewhere: list[int] = []
    for given in _given_plans(opts.also_rate, workers):  # e.g. the plan chosen before a re-plan at its count
        rate_elsewhere(given, 1, 0, None)
    while heap:
        bound, idx, arrangement, item = heapq.heappop(heap)
        if best is not None and not best[0][0] and bound >= best[0][1]:
            break  # no candidate left can beat the best that fits
        if bound >= cap:
            cut = True
            break  # nor the other search's step
        if arrangement < 0:  # a plan planned for another count (or given), rated at this one: its copies placed
            one, k, m, sub = item
            chain_m = chains.setdefault(m, chain.at_batch(minibatch // m))
            if best is not None and not best[0][0] and \
                    _step_lower_bound(one, chain_m, m // k, split or pol.splits_every_backward) * low >= best[0][1]:
                continue
            for j, full in enumerate(_copies(one, k, chain_m, cluster, replace(opts, num_microbatches=m,
                                                                               choose_microbatches=False),
                                             plan_from_assignment, again=True)):
                own = _plan_lower_bound(full, chain_m, cluster, m, split or pol.splits_every_backward, update_bw,
                                        opts.optimizer_state_factor, opts.schedule, split, opts.overhead_s) * low
                heapq.heappush(heap, (max(bound, own), idx, j + 1, (full, sub or full, m, chain_m)))
            continue
        if arrangement:  # a planned candidate's copies placed one way: simulated
            full, sub, m, chain_m = item
            res = _simulated(full, chain_m, cluster, opts, m, split, update_bw)
            rated += 1
            # over memory by the simulator's peak or by the planner's own model of the copies' stages (a
            # stage replicated at an outer level: the model charges a replica the inner block's share)
            peak = max([*map(float, res.peak_memory_bytes or [0.0]), *(float(st.memory_bytes) for st in full.stages)])
            key = (peak > limit * (1 + 1e-9), float(res.step_time_s), idx, arrangement)
            if best is None or key < best[0]:
                best = (key, full, sub, m)
            continue
        m, k = item
        if not copies_fit(cw, k, workers, limit, opts.optimizer_state_factor, opts.shard):
            failures.append(f"M={m}, {k} copies: {workers // k} workers cannot hold the weights, gradients and "
                            f"optimizer state")
            continue
        part = cluster.first_workers(workers // k)
        if part is None:
            continue
        chain_m = chains.setdefault(m, chain.at_batch(minibatch // m))
        try:
            sub = solve(chain_m, part, copy_options(opts, m // k), **rest)
        except InfeasiblePlanError as e:
            failures.append(f"M={m}, {k} copies: {e}")
            continue
        planned += 1
        # its stages alone (whatever they recompute at this count: another count's bound counts none)
        rate_elsewhere(_Layout(tuple(_StageAt(st.first, st.last, tuple(st.ranks)) for st in sub.stages)), k, m, sub)
        own = _step_lower_bound(sub, chain_m, m // k, split or pol.splits_every_backward) * low
        if best is not None and not best[0][0] and own >= best[0][1]:
            continue
        if own >= cap:
            cut = True
            continue
        for j, full in enumerate(_copies(sub, k, chain_m, cluster, replace(opts, num_microbatches=m,
                                                                           choose_microbatches=False),
                                         plan_from_assignment)):
            own = _plan_lower_bound(full, chain_m, cluster, m, split or pol.splits_every_backward, update_bw,
                                    opts.optimizer_state_factor, opts.schedule, split, opts.overhead_s) * low
            heapq.heappush(heap, (max(bound, own), idx, j + 1, (full, sub, m, chain_m)))
    if cut and (best is None or best[0][0] or best[0][1] >= cap):
        from pdcompile.passes.partition_dp import SlowerPlanError
        raise SlowerPlanError(f"no {opts.schedule} plan faster than {cap:.4g} s")
    if best is None:
        if planned == 0 and failures:  # no copy could hold the state: the planner's own refusal of one copy at
            # the count asked says what would fit (the smallest memory per worker), which the pre-check does not
            solve(chain.at_batch(minibatch // m0), cluster, replace(opts, num_microbatches=m0, choose_microbatches=False),
                  **rest)
        raise InfeasiblePlanError(failures[0] if len(failures) == 1 else
                                  "no plan fits: " + "; ".join(failures[:4]) + ("; ..." if len(failures) > 4 else ""))
    (over, step, _, _), full, sub, m = best
    if over:  # every candidate's simulated peak is over the device's memory: none fits, as the planners say
        raise InfeasiblePlanError(f"no {opts.schedule} plan fits {limit:.4g} bytes per worker: each candidate's "
                                  f"simulated peak memory is over it ({rated} simulated)")
    note = (f"chosen by its simulated {opts.schedule} step: of {len(order)} candidates (microbatch count x "
            f"pipeline copies), {planned} planned and {rated} simulated; the rest bounded out")
    return replace(full, solver=solver, schedule=opts.schedule, seconds_per_minibatch=step,
                   samples_per_second=minibatch / step if step > 0 else math.inf, num_microbatches=m,
                   predicted_by=f"simulated {opts.schedule} step of {m} microbatch{'es' if m != 1 else ''} "
                                f"(fill and drain included)",
                   planning_seconds=time.perf_counter() - t0, optimal=sub.optimal, gap=sub.gap,
                   cluster=str(cluster), num_workers=workers, notes=(*full.notes, note))


def tied_of(plan: Plan, chain: "Chain") -> tuple[float, list[int]]:
    """The bytes of the parameters that ``plan``'s stages share (``ChainLayer.tied_params``: a parameter used
    by layers in several stages, a GPT's embedding and LM head) and those stages: what the runtime sums across
    them every step (``TG``) and ``simulate_plan`` charges as one ring all-reduce (``tied_bytes``,
    ``tied_stages``), as ``pdcompile()``'s simulate() reads them off the split stages."""
    stage_of = {i: st.index for st in plan.stages for i in range(st.first, st.last + 1)}
    where: dict[str, tuple[float, set[int]]] = {}
    for i, layer in enumerate(chain.layers):
        for name, nbytes in layer.tied_params:
            held = where.setdefault(name, (float(nbytes), set()))[1]
            if i in stage_of:
                held.add(stage_of[i])
    tied = [(b, held) for b, held in where.values() if len(held) > 1]
    return float(sum(b for b, _ in tied)), sorted(set().union(*(held for _, held in tied)))


def _step_lower_bound(sub: Plan, chain: "Chain", per_copy: int, split: bool) -> float:
    """A bound below the simulated step of ``sub``'s copies, each with ``per_copy`` microbatches: some
    replica of stage ``s`` runs ``q = ceil(per_copy / r_s)`` forwards and backwards (with what its
    recomputation runs again), after the first microbatch's forward through the stages before it; its last
    input gradient (after all its forwards and input gradients) then goes back through them (``split``: a
    backward may be split, its weight part later)."""
    return _stages_bound(sub.stages, chain, [math.ceil(per_copy / st.replicas) for st in sub.stages], split,
                         [0.0] * len(sub.stages))


def _plan_lower_bound(full: Plan, chain: "Chain", cluster: "ClusterSpec", num_microbatches: int, split: bool,
                      update_bandwidth: float, optimizer_state_factor: float, schedule: str | None = None,
                      split_backward: bool = False, overhead_s: Any = 0.0) -> float:
    """A bound below ``full``'s simulated step (its ``num_microbatches`` at the chain's batch size), tighter
    than :func:`_step_lower_bound` by what ends every rank's step in ``simulate()``: after a replica's last
    backward, its stage's gradient all-reduce (a ring over the slowest link among its ranks, once every
    replica is there) and its optimizer step (:func:`~pdcompile.simulate.stage_step_s`), neither overlapped.
    Per stage ``s`` with ``R`` replicas: the busiest replica (``ceil(M / R)`` microbatches) after the first
    forward's way to it, then ``s``'s all-reduce and step; and its last input gradient's way back to
    stage 0, then stage 0's. With ``schedule`` (simulated with ``split_backward``), also each stage's first
    replica in that schedule's order (:func:`_ranks_bound`). Transfers and per-action costs only add; the
    per-tensor costs ``overhead_s`` gives (:func:`~pdcompile.simulate.tensor_costs`) are charged as simulate_plan
    charges them (each parameter tensor's optimizer step, and its flatten and copy back in an all-reduce)."""
    from pdcompile.simulate import ring_allreduce_s, stage_param_tensors, stage_step_s, tensor_costs

    _, step_t, flat_t = tensor_costs(overhead_s, cluster)
    ars, steps, nxt = [], [], 0
    for st in full.stages:  # each stage's all-reduce and optimizer step, as simulate_plan charges them
        ranks = st.ranks if len(st.ranks) == st.replicas else tuple(range(nxt, nxt + st.replicas))
        nxt += st.replicas
        mine = chain.layers[st.first:st.last + 1]
        params = sum(l.param_bytes for l in mine)
        tensors = stage_param_tensors(mine)
        ars.append(ring_allreduce_s(params, st.replicas, cluster.slowest_bandwidth(ranks)) + tensors * flat_t
                   if st.replicas > 1 else 0.0)
        steps.append(stage_step_s(params, st.replicas, st.shard, optimizer_state_factor, update_bandwidth,
                                  tensors, step_t) if math.isfinite(update_bandwidth) else 0.0)
    ends = [x + y for x, y in zip(ars, steps)]
    bound = _stages_bound(full.stages, chain, [math.ceil(num_microbatches / st.replicas) for st in full.stages],
                          split, ends)
    if schedule is None:
        return bound
    return max(bound, _ranks_bound(full.stages, chain, schedule, num_microbatches, split_backward, ars, steps))


def _ranks_bound(stages: Sequence[StagePlan], chain: "Chain", schedule: str, num_microbatches: int,
                 split_backward: bool, ars: Sequence[float], steps: Sequence[float]) -> float:
    """A bound below the simulated step read off each stage's first replica (its most microbatches) alone,
    in the schedule's own order (``make_schedule`` for that rank): its actions one after another at their
    simulated costs (the all-reduce ``ars``, the optimizer step ``steps``), a forward no sooner than the
    first microbatch can reach it, a backward no sooner than its forward's end plus the microbatch's round
    trip through the later stages (their forwards and input gradients, recomputation included); then its
    last input gradient's way back to stage 0, and stage 0's all-reduce and step. Every other rank is taken
    as infinitely fast, so the simulator's timeline of that rank is never earlier: its fill and drain count."""
    from pdcompile.runtime.schedules import layout
    from pdcompile.runtime.schedules.actions import Kind
    from pdcompile.simulate import INPUT_GRAD_SHARE, WEIGHT_GRAD_SHARE

    layers = chain.layers
    fwd, bwd, b_in, b_w = [], [], [], []
    for st in stages:  # as simulate_plan sums a stage's costs (at the chain's own batch size)
        mine = layers[st.first:st.last + 1]
        mode = getattr(st, "recompute", "none")
        head = len(mine) if mode == "full" else getattr(st, "recompute_layers", 0) if mode == "partial" else 0
        again = sum(l.forward_s for l in mine[:head])
        fwd.append(sum(l.forward_s for l in mine))
        bwd.append(sum(l.backward_s for l in mine) + again)
        b_in.append(sum(l.input_grad_s if l.input_grad_s is not None else l.backward_s * INPUT_GRAD_SHARE
                        for l in mine) + again)
        b_w.append(sum(l.weight_grad_s if l.weight_grad_s is not None else l.backward_s * WEIGHT_GRAD_SHARE
                       for l in mine))
    S = len(stages)
    gi = [min(x, y) for x, y in zip(b_in, bwd)]  # a backward's input-gradient part, split or not
    pf = np.concatenate(([0.0], np.cumsum(fwd)))
    pg = np.concatenate(([0.0], np.cumsum(gi)))
    reps = [st.replicas for st in stages]
    firsts = [int(x) for x in np.concatenate(([0], np.cumsum(reps)))[:-1]]
    lay = layout(schedule, reps, num_microbatches, 1, False, split_backward)
    sched = {rank: _first_replica(lay, s) for s, rank in enumerate(firsts)}
    out = 0.0
    for s, rank in enumerate(firsts):
        acts = sched[rank]
        split = {a.microbatch for a in acts if a.kind is Kind.WEIGHT_GRAD}
        trip = float(pf[S] - pf[s + 1] + pg[S] - pg[s + 1])
        clock, f_end, last_b = float(pf[s]), {}, 0.0
        for a in acts:
            if a.kind is Kind.FORWARD:
                clock += fwd[s]
                f_end[a.microbatch] = clock
            elif a.kind is Kind.BACKWARD:
                clock = max(clock, f_end.get(a.microbatch, 0.0) + trip) + (b_in[s] if a.microbatch in split else bwd[s])
                last_b = clock
            elif a.kind is Kind.WEIGHT_GRAD:
                clock += b_w[s]
            elif a.kind is Kind.ALLREDUCE:
                clock += ars[s]
            elif a.kind is Kind.STEP:
                clock += steps[s]
        out = max(out, clock, last_b + float(pg[s]) + ars[0] + steps[0])
    return out * (1 - 1e-9)


_FIRSTS: dict[tuple[Any, ...], list[Any]] = {}  # _first_replica's lists, by what they depend on


def _first_replica(lay: Any, s: int) -> list[Any]:
    """Stage ``s``'s first replica's actions in ``lay`` (one step of a synchronous schedule: ``make_schedule``'s
    list, which inserts no ``WV`` there), kept by what the order reads (its warm-up and held bounds, its count of
    microbatches, whether it is the first or last stage or replicated, split drains): the same list up to its
    actions' stage and microbatches' numbers, which ``_ranks_bound`` reads only as names within the list
    (``tests/test_simulate_fast.py`` checks it against ``make_schedule``)."""
    S, r = lay.num_stages, lay.replicas[s]
    key = (lay.name, lay.in_flight_bound(s), lay.held_bound(s), -(-lay.total // r), s == 0, s == S - 1, r > 1,
           lay.split_backward)
    got = _FIRSTS.get(key)
    if got is None:
        if len(_FIRSTS) >= 256:
            _FIRSTS.clear()
        got = _FIRSTS[key] = lay.policy.order(lay, s, 0, False)
    return got


def _stages_bound(stages: Sequence[StagePlan], chain: "Chain", counts: Sequence[int], split: bool,
                  ends: Sequence[float]) -> float:
    """The bounds of :func:`_plan_lower_bound` for ``stages`` whose busiest replicas run ``counts``
    microbatches, each stage's step ending ``ends`` after its replicas' last backward; a stage's
    recomputation (its mode: the forward of its layers, or of its first ``recompute_layers``) runs again
    in each of its backwards, as ``simulate_plan`` charges it.

    Per stage, that replica (``q`` forwards ``F``, ``q`` backwards ``B`` of input-gradient part ``G`` and
    whole part ``B``, from ``a``, when the first forward can reach it): all its work, then its stage's end;
    all its forwards and input gradients, then the last one's way back and stage 0's end. And the pipeline's
    round trip ``R`` (a microbatch's forward and input gradient through the later stages): its first backward
    waits ``F + R`` after its first forward, so either every forward runs before it (the step at least
    ``a + max(q F, F + R) + q B`` and an end) or some backward runs before its last forward, whose backward
    then waits ``R`` again (at least ``a + q F + G + R + G`` and an end)."""
    f, back, work = ChainWork.of(chain, split).at(chain.batch_size)
    pf, pi, pw = (np.concatenate(([0.0], np.cumsum(a))) for a in (f, back, work))
    again = []
    for st in stages:
        mode = getattr(st, "recompute", "none")
        head = st.last - st.first + 1 if mode == "full" else getattr(st, "recompute_layers", 0) if mode == "partial" else 0
        again.append(float(pf[st.first + head] - pf[st.first]))
    rerun = np.concatenate(([0.0], np.cumsum(again)))  # recomputation of the stages before each
    n = len(chain.layers)
    out = 0.0
    for s, (st, q, end) in enumerate(zip(stages, counts, ends)):
        a, z = st.first, st.last + 1
        before_f, way_back = float(pf[a]), float(pi[a]) + float(rerun[s])
        fs, gs, bs = float(pf[z] - pf[a]), float(pi[z] - pi[a]) + again[s], float(pw[z] - pw[a]) - float(pf[z] - pf[a]) + again[s]
        trip = float(pf[n] - pf[z] + pi[n] - pi[z]) + float(rerun[len(stages)] - rerun[s + 1])
        back_end = way_back + ends[0]  # the last input gradient's way back to stage 0, then stage 0's end
        first = before_f + max(q * fs, fs + trip)  # the first backward's start, every forward before it
        drained = first + max(q * bs + end, q * gs + back_end)
        if q >= 2:  # or a backward before the last forward
            drained = min(drained, before_f + q * fs + gs + trip + max(bs + end, gs + back_end))
        out = max(out, before_f + q * (fs + bs) + end, before_f + q * (fs + gs) + back_end, drained)
    return out * (1 - 1e-9)


@dataclass(frozen=True)
class _StageAt:
    """One stage of a plan as :func:`_copies` reads it: its layers and ranks."""

    first: int
    last: int
    ranks: tuple[int, ...]

    @property
    def replicas(self) -> int:
        return len(self.ranks)


@dataclass(frozen=True)
class _Layout:
    """A plan's stages alone (``PlanOptions.also_rate``'s form), to be rated on a chain by :func:`_copies`."""

    stages: tuple[_StageAt, ...]


def _given_plans(given: Sequence[Sequence[tuple[int, int, tuple[int, ...]]]], workers: int) -> list[_Layout]:
    """``PlanOptions.also_rate``'s plans; one that names a rank outside ``workers`` is left out (a plan for
    another cluster)."""
    return [_Layout(tuple(_StageAt(a, b, tuple(ranks)) for a, b, ranks in stages)) for stages in given
            if all(0 <= r < workers for _, _, ranks in stages for r in ranks)]


def layout_of(plan: Plan) -> tuple[tuple[int, int, tuple[int, ...]], ...]:
    """``plan``'s stages as ``PlanOptions.also_rate`` takes them: (first layer, last layer, ranks) each."""
    return tuple((st.first, st.last, tuple(st.ranks)) for st in plan.stages)


def _copies(sub: Plan | _Layout, k: int, chain: "Chain", cluster: "ClusterSpec", options: PlanOptions,
            rate: Callable[..., Plan], again: bool = False) -> list[Plan]:
    """``k`` copies of ``sub`` (planned on the first ``W / k`` workers) on the whole cluster, rated
    there: side by side (copy ``j`` on workers ``j W / k ..``; one copy: ``sub`` itself, or with
    ``again`` rated again on ``chain``, another microbatch size's), and each stage's replicas of all
    copies on consecutive ranks (one copy: where the planner placed a stage's replicas apart, in one
    server's ranks where they fit, which its all-reduce may prefer)."""
    width = cluster.num_workers // k
    side = [(st.first, st.last, len(st.ranks) * k, tuple(sorted(r + j * width for j in range(k) for r in st.ranks)))
            for st in sub.stages]
    nxt, grouped = 0, []
    for st in sub.stages:
        n = len(st.ranks) * k
        grouped.append((st.first, st.last, n, tuple(range(nxt, nxt + n))))
        nxt += n
    out = [sub] if k == 1 and not again and isinstance(sub, Plan) else []
    for assignment in ((side,) if k > 1 or again else ()) + ((grouped,) if grouped != side else ()):
        for pool in (False, True):  # ranks that do not nest in the levels: rated on the pool
            try:
                out.append(rate(chain, cluster, assignment, options, pool=pool))
                break
            except UsageError:
                continue
    return out
