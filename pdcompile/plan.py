"""The Plan and the planners' entry point: :func:`plan` runs a planner (``passes/partition_dp.py``,
``passes/partition_ilp.py``) and also chooses the microbatch size when the caller can give the
chain at several sizes. The Plan itself (plain, frozen data with a JSON form and a text table)
lives in ``pdcompile/plan_data.py``, below the planners that build it; it is re-exported here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Sequence

from pdcompile.errors import InfeasiblePlanError, UsageError
from pdcompile.passes.partition_dp import partition_dp
from pdcompile.passes.partition_ilp import partition_ilp
from pdcompile.passes.planner.options import PlanOptions
from pdcompile.plan_data import PLAN_FORMAT, PLAN_VERSION, Plan, StagePlan

if TYPE_CHECKING:  # pragma: no cover
    from pdcompile.cluster import ClusterSpec
    from pdcompile.ir import Chain

__all__ = ["PLAN_FORMAT", "PLAN_VERSION", "StagePlan", "Plan", "PlanOptions", "plan"]


def plan(
    chain: "Chain | Callable[[int], Chain]",
    cluster: "ClusterSpec",
    options: PlanOptions | None = None,
    *,
    solver: str = "dp",
    microbatch_sizes: Sequence[int] | None = None,
    **overrides: Any,
) -> Plan:
    """Plan ``chain`` for ``cluster`` with ``solver`` (``"dp"`` or ``"ilp"``).

    ``chain`` is a :class:`~pdcompile.ir.Chain` (planned at its own batch size), or a callable
    ``chain_for(b) -> Chain`` giving the costs at microbatch size ``b``; then every size in
    ``microbatch_sizes`` is planned and the plan with the highest predicted samples per second
    that fits in memory wins (ties: the smaller size). Raises
    :class:`~pdcompile.errors.InfeasiblePlanError` when no size fits. ``options``
    (:class:`PlanOptions`) and other keyword options go to the solver (``schedule=``, ...; the ILP's
    ``time_limit_s``, ``hint``).
    """
    solvers: dict[str, Callable[..., Plan]] = {"dp": partition_dp, "ilp": partition_ilp}
    if solver not in solvers:
        raise UsageError(f"unknown solver {solver!r} (use 'dp' or 'ilp')")
    solve = solvers[solver]
    if not callable(chain):
        if microbatch_sizes:
            raise UsageError("microbatch_sizes needs a callable chain_for(b) -> Chain")
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
