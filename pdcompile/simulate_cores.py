"""A plan's step on a local CPU cluster of processes sharing the host's cores (issue 36): the fixed point that
charges each stage as its ranks share the cores and compute side by side, and each message the wait of a rank
woken for a core held by others. :func:`pdcompile.simulate.simulate_plan` applies it outside both replays."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdcompile.simulate import SimResult


def shared_cores(run: Callable[[Sequence[float], float, Mapping[int, float]], SimResult],
                 sched_ranks: Sequence[Sequence[int]], cluster: Any, iterations: int = 12, tol: float = 1e-3,
                 corun: Mapping[int, float] | Sequence[tuple[int, float]] | None = None,
                 wake_s: float = 0.0) -> SimResult:
    """A plan's step on a local CPU cluster (issue 36), each stage's work charged as its ranks share the cores
    and slow each other computing side by side. ``run(scale, k, wake)`` simulates with stage ``s``'s chain compute
    x ``scale[s]``, the per-action cost x ``k``, each message to rank ``r`` ``wake[r]`` later. The chain's compute
    carries the static time-sharing charge
    (:func:`~pdcompile.passes.costs.roofline.contention`, ``w``: every worker always computing) and no
    co-running one; here each stage's is its ranks' mean expected stretch instead
    (:func:`~pdcompile.passes.costs.roofline.shared_core_stretch` at the ranks' busy shares, ``busy /
    makespan``, of the run before, with the calibration's co-running slowdowns ``corun``, ``OpCostTable.corun``
    as (processes, factor) pairs: the one place they are charged): ``scale[s] = stretch / w``. The per-action
    cost (the runtime's dispatch, calibrated on no more processes than cores, beside each other) is stretched
    by the ranks' mean time-sharing stretch alone, ``k``. From every rank always busy (an upper bound) the
    charges only fall, to the fixed point where the shares the run gives are the ones it was charged at (at
    most ``iterations`` runs; ``tol`` relative). A rank woken by a message may find every core held by ranks
    computing: ``wake_s`` (the calibration's wait for a core then, :func:`pdcompile.calibrate_link.measure_wake`) x
    that chance (:func:`~pdcompile.passes.costs.roofline.cores_held`, at the same shares; 0 on no more ranks than
    cores) is added to every message to it (absorbed where the rank was not yet waiting). Data-parallel replicas,
    all busy at once, get the whole charge; a rank computing alone none of it; a pipeline, less. A
    cluster naming no cores, or one with nothing to charge: ``run([1] * S, 1)`` once. One place for
    ``simulate()``, the step search and auto alike (all call :func:`simulate_plan`), applied outside both
    replays (:func:`simulate`, :mod:`pdcompile.simulate_fast`) identically."""
    from pdcompile.passes.costs.roofline import THREADS_PER_PROCESS, contention, cores_held, shared_core_stretch

    S = len(sched_ranks)
    static = contention(cluster)
    cores = getattr(getattr(cluster, "device", None), "cores", None)
    ranks = sorted({r for rs in sched_ranks for r in rs})
    if not cores or not ranks:
        return run([1.0] * S, 1.0, {})

    def charges(shares: Sequence[float]) -> tuple[list[float], float, dict[int, float]]:
        both = dict(zip(ranks, shared_core_stretch(shares, cores, THREADS_PER_PROCESS, corun)))
        alone = shared_core_stretch(shares, cores, THREADS_PER_PROCESS)  # time-sharing only: the actions'
        wake = {r: wake_s * q for r, q in zip(ranks, cores_held(shares, cores, THREADS_PER_PROCESS))} \
            if wake_s > 0 else {}
        return ([sum(both[r] for r in rs) / len(rs) / static if rs else 1.0 for rs in sched_ranks],
                sum(alone) / len(alone), wake)

    top, k_top, w_top = charges([1.0] * len(ranks))  # every rank always busy
    if static <= 1.0 and all(s <= 1.0 for s in top) and not any(w_top.values()):
        return run([1.0] * S, 1.0, {})  # nothing charged and nothing to charge
    scale, k, wake = top, k_top, w_top
    res = run(scale, k, wake)
    for _ in range(iterations):
        span = float(res.makespan_s) or 1.0
        nxt, k_nxt, w_nxt = charges([float(res.busy.get(r, 0.0)) / span for r in ranks])
        nxt, k_nxt = [min(a, b) for a, b in zip(nxt, top)], min(k_top, k_nxt)
        w_nxt = {r: min(v, w_top[r]) for r, v in w_nxt.items()}
        if max(abs(a - b) / b for a, b in zip([*nxt, k_nxt], [*scale, k])) < tol \
                and all(abs(w_nxt[r] - wake[r]) <= tol * max(wake[r], 1e-9) for r in wake):
            break
        scale, k, wake = nxt, k_nxt, w_nxt
        res = run(scale, k, wake)
    return res
