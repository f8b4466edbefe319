"""The cost models, each one object behind :class:`CostModel`: what a stage, a boundary, a weight
sync and data parallelism cost, and the same terms in the vectorized forms the search reads.

``default`` (ours: the weight all-reduce overlapped with the backward, the optimizer step) and
``paper`` (SOSP'19 section 3.1 as written) are here; ``pipedream`` (the released optimizer's
formulas, with its own evaluation and DP) is in ``pipedream.py``. ``partition_dp``'s docstring has
every formula.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence

import numpy as np

from pdcompile.cluster import ClusterSpec
from pdcompile.passes.planner.arrays import ChainArrays, cumsum0, rng
from pdcompile.passes.planner.blocks import Block, Evaluation
from pdcompile.passes.planner.evaluate import evaluate_tree
from pdcompile.passes.planner.memory import EPS
from pdcompile.passes.planner.pipedream import PipeDreamCosts
from pdcompile.passes.planner.sharding import comm_factors

__all__ = ["COST_CLASSES", "COST_MODELS", "CostModel", "DefaultCosts", "PaperCosts", "make_costs"]

COST_MODELS = ("default", "paper", "pipedream")


class CostModel(Protocol):
    """A cost model: seconds per minibatch of each part of a configuration."""

    name: str
    #: the model's own solver, where the bisection search does not apply (None: the search)
    solver: Callable[[Any], tuple[Block, ...]] | None
    #: whether the memory limit is on unless the caller says (``memory_limit=None``)
    memory_by_default: bool
    #: whether it models memory at all (a limit, recomputation); off: it refuses a limit, never recomputes
    models_memory: bool

    def stage_time(self, i: int, j: int, r: int, again: float = 0.0, shard: str = "none") -> tuple[float, float]:
        """(time, its weight-sync part) of a worker-level stage ``i..j`` on ``r`` replicas that runs
        ``again`` seconds of forward again in its backward (recomputation), its replicas holding their
        state as ``shard`` (``sharding.comm_factors``: what each mode moves and exposes)."""
        ...

    def boundary_time(self, nbytes: float, level: int) -> float:
        """A boundary of ``nbytes`` between two stages at ``level`` (1-based): activations and gradients."""
        ...

    def weight_sync_time(self, i: int, j: int, r: int, level: int) -> float:
        """The weight sync of a level-``level`` (>= 2) block of ``r`` units, per minibatch."""
        ...

    def data_parallel_time(self) -> float:
        """One stage of all layers replicated over every unit of every level."""
        ...

    def evaluate(self, model: Any, blocks: Sequence[Block]) -> Evaluation:
        """A block tree's time, bottleneck, per-stage costs and memory under ``model``."""
        ...

    # -- the vectorized forms the search reads --------------------------------------------
    def time_prefix(self, extra: np.ndarray | None) -> np.ndarray:
        """Prefix sums of the per-layer terms a level-1 stage's threshold bounds, with ``extra``
        forward seconds per layer run again (None: nothing)."""
        ...

    def sync_start(self, end: np.ndarray, thr: np.ndarray, r: np.ndarray) -> np.ndarray:
        """Smallest start of a level-1 stage ending at ``end`` on ``r`` replicas whose weight-sync
        bound fits ``thr`` (the part of the stage's time that does not depend on recomputation)."""
        ...

    def outer_sync_bytes(self, thr: np.ndarray, r: np.ndarray, level: int) -> np.ndarray:
        """The most weight bytes a level-``level`` block of ``r`` units may sync within ``thr``."""
        ...


def smallest_start(P: np.ndarray, end: np.ndarray, thr: np.ndarray) -> np.ndarray:
    """Smallest i with P[end+1] - P[i] <= thr (any shapes)."""
    return np.searchsorted(P, P[end + 1] - thr * (1 + EPS), side="left")


class _Ours:
    """What ``default`` and ``paper`` share: the hierarchy's recursion and boundaries."""

    name = ""
    solver: Callable[[Any], tuple[Block, ...]] | None = None
    memory_by_default = False
    models_memory = True

    def __init__(self, arrays: ChainArrays, cluster: ClusterSpec) -> None:
        self.a = arrays
        self.B = [float(lv.bandwidth) for lv in cluster.levels]
        self.counts = [lv.count for lv in cluster.levels]
        self._stacks: dict[tuple[str, str, float], np.ndarray] = {}  # _stacked_start's arrays

    def stage_time(self, i: int, j: int, r: int, again: float = 0.0, shard: str = "none") -> tuple[float, float]:
        raise NotImplementedError

    def comm_per_byte(self, r: np.ndarray | int) -> np.ndarray:
        """Seconds per weight byte of a level-1 stage's all-reduce over ``r`` replicas, as the model charges it."""
        raise NotImplementedError

    def shard_starts(self, P: np.ndarray, end: np.ndarray, thr: np.ndarray, r: np.ndarray,
                     shard: str, key: str = "none") -> tuple[np.ndarray, np.ndarray]:
        """For level-1 stages ending at ``end`` on ``r`` replicas held as ``shard``: (smallest start whose
        compute terms, prefix ``P`` (:meth:`time_prefix`, named ``key``), plus the exposed communication
        fit ``thr``; smallest start whose weight-sync bound, overlapped and exposed communication, fits
        ``thr``)."""
        ov, ex = comm_factors(shard)
        compute = self._stacked_start(("time", key, ex), P, ex, end, thr, r) if ex else smallest_start(P, end, thr)
        sync = self.sync_start(end, thr, r) if ov + ex == 1.0 else self._sync_scaled(end, thr, r, ov + ex)
        return compute, sync

    def _stacked_start(self, key: tuple[str, str, float], P: np.ndarray, scale: float, end: np.ndarray,
                       thr: np.ndarray, r: np.ndarray) -> np.ndarray:
        """Smallest i with ``P[end+1] - P[i] + scale a_r (PW[end+1] - PW[i]) <= thr`` (``a_r``:
        :meth:`comm_per_byte`) on one array of the rows ``r = 0..m1`` each offset above the one before, so
        that one bisection serves every ``r`` (as :class:`DefaultCosts`' weight-sync bound); built once."""
        flat = self._stacks.get(key)
        N1 = self.a.N + 1
        if flat is None:
            rows = P[None, :] + scale * self.comm_per_byte(np.arange(self.counts[0] + 1))[:, None] * self.a.PW[None, :]
            span = 2.0 * float(rows[:, -1].max()) or 1.0  # relative, so tiny times keep their precision
            flat = (rows + span * np.arange(self.counts[0] + 1)[:, None]).ravel()
            self._stacks[key] = flat
        row = np.asarray(r) * N1
        v = flat[row + end + 1] - thr * (1 + EPS)
        return np.searchsorted(flat, v, side="left") - row

    def _sync_scaled(self, end: np.ndarray, thr: np.ndarray, r: np.ndarray, scale: float) -> np.ndarray:
        raise NotImplementedError

    def sync_start(self, end: np.ndarray, thr: np.ndarray, r: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def weight_sync_time(self, i: int, j: int, r: int, level: int) -> float:
        raise NotImplementedError

    def boundary_time(self, nbytes: float, level: int) -> float:
        return 2.0 * nbytes / self.B[level - 1]

    def data_parallel_time(self) -> float:
        n = self.a.N - 1
        t, _ = self.stage_time(0, n, self.counts[0])
        for level in range(2, len(self.counts) + 1):
            r = self.counts[level - 1]
            t = max(t / r, self.weight_sync_time(0, n, r, level))
        return t

    def evaluate(self, model: Any, blocks: Sequence[Block]) -> Evaluation:
        return evaluate_tree(model, blocks)


class PaperCosts(_Ours):
    """SOSP'19 section 3.1: a stage takes ``max(C, 2 (r-1) W / B) / r``."""

    name = "paper"

    def stage_time(self, i: int, j: int, r: int, again: float = 0.0, shard: str = "none") -> tuple[float, float]:
        W = rng(self.a.PW, i, j)
        C = rng(self.a.PC, i, j) + again
        comm = 2.0 * (r - 1) * W / self.B[0]
        ov, ex = comm_factors(shard)
        return (max(C, ov * comm) + ex * comm) / r, (ov + ex) * comm / r

    def comm_per_byte(self, r: np.ndarray | int) -> np.ndarray:
        return np.asarray(2.0 * np.maximum(np.asarray(r) - 1, 0) / self.B[0], dtype=float)

    def _sync_scaled(self, end: np.ndarray, thr: np.ndarray, r: np.ndarray, scale: float) -> np.ndarray:
        return self.sync_start(end, thr / scale, r)

    def weight_sync_time(self, i: int, j: int, r: int, level: int) -> float:
        return 2.0 * (r - 1) * rng(self.a.PW, i, j) / self.B[level - 1] / r

    def time_prefix(self, extra: np.ndarray | None) -> np.ndarray:
        return self.a.PC if extra is None else cumsum0(self.a.c + extra)

    def sync_start(self, end: np.ndarray, thr: np.ndarray, r: np.ndarray) -> np.ndarray:
        with np.errstate(divide="ignore"):
            wthr = np.where(r > 1, thr * self.B[0] / (2.0 * (r - 1)), np.inf)
        return smallest_start(self.a.PW, end, wthr)

    def outer_sync_bytes(self, thr: np.ndarray, r: np.ndarray, level: int) -> np.ndarray:
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(r > 1, thr * self.B[level - 1] / (2.0 * (r - 1)), np.inf)


class DefaultCosts(_Ours):
    """Ours: ``(F + max(Bw, AR_r) + OPT) / r`` with a ring all-reduce ``AR_r = 2 (r-1)/r W / B``
    overlapped with the backward and the optimizer step ``OPT = kappa W`` (``kappa = (3 + 2 f) /
    memory bandwidth``, 0 when the device's is unknown)."""

    name = "default"
    memory_by_default = True

    def __init__(self, arrays: ChainArrays, cluster: ClusterSpec, optimizer_state_factor: float) -> None:
        super().__init__(arrays, cluster)
        mb = cluster.device.memory_bandwidth
        self.kappa = (3.0 + 2.0 * optimizer_state_factor) / mb if mb else 0.0
        f, w = arrays.f, arrays.w
        # level 1, r replicas: F + AR_r + OPT with AR_r = 2 (r-1)/(r B1) W
        m1 = self.counts[0]
        P2 = np.stack([cumsum0(f + self._alpha(r) * w) for r in range(m1 + 1)])
        # rows offset so that the whole array is sorted: one searchsorted serves every r
        span = 2.0 * float(P2[:, -1].max()) or 1.0  # relative, so tiny times keep their precision
        self.P2flat = (P2 + span * np.arange(m1 + 1)[:, None]).ravel()

    def _alpha(self, r: int) -> float:
        return 2.0 * (r - 1) / (r * self.B[0]) + self.kappa if r >= 1 else 0.0

    def stage_time(self, i: int, j: int, r: int, again: float = 0.0, shard: str = "none") -> tuple[float, float]:
        W = rng(self.a.PW, i, j)
        F = rng(self.a.PF, i, j)
        Bw = rng(self.a.PC, i, j) - F + again
        ar = 2.0 * (r - 1) * W / (r * self.B[0])
        ov, ex = comm_factors(shard)
        return (F + max(Bw, ov * ar) + ex * ar + self.kappa * W) / r, (ov + ex) * ar / r

    def comm_per_byte(self, r: np.ndarray | int) -> np.ndarray:
        r = np.maximum(np.asarray(r), 1)
        return np.asarray(2.0 * (r - 1) / (r * self.B[0]), dtype=float)

    def _sync_scaled(self, end: np.ndarray, thr: np.ndarray, r: np.ndarray, scale: float) -> np.ndarray:
        # F + OPT + scale AR_r <= thr: the prefix of f + kappa w, plus scale AR_r per weight byte
        P = self._stacks.get(("sync", "", 0.0))
        if P is None:
            P = self._stacks[("sync", "", 0.0)] = cumsum0(self.a.f + self.kappa * self.a.w)
        return self._stacked_start(("sync", "", scale), P, scale, end, thr, r)

    def weight_sync_time(self, i: int, j: int, r: int, level: int) -> float:
        return 2.0 * (r - 1) * rng(self.a.PW, i, j) / (r * self.B[level - 1]) / r

    def time_prefix(self, extra: np.ndarray | None) -> np.ndarray:
        c = self.a.c if extra is None else self.a.c + extra
        return cumsum0(c + self.kappa * self.a.w)  # F + Bw + OPT

    def sync_start(self, end: np.ndarray, thr: np.ndarray, r: np.ndarray) -> np.ndarray:
        # F + AR_r + OPT <= thr on row r of the stacked, offset prefix arrays
        row = r * (self.a.N + 1)
        v = self.P2flat[row + end + 1] - thr * (1 + EPS)
        return np.searchsorted(self.P2flat, v, side="left") - row

    def outer_sync_bytes(self, thr: np.ndarray, r: np.ndarray, level: int) -> np.ndarray:
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(r > 1, r * thr * self.B[level - 1] / (2.0 * (r - 1)), np.inf)


#: each cost model's class, by name (what a model promises before it is built: ``memory_by_default``, ``models_memory``)
COST_CLASSES: dict[str, Any] = {"default": DefaultCosts, "paper": PaperCosts, "pipedream": PipeDreamCosts}


def make_costs(name: str, arrays: ChainArrays, cluster: ClusterSpec, optimizer_state_factor: float) -> CostModel:
    """The cost model called ``name`` (one of :data:`COST_MODELS`) for a chain on a cluster."""
    makers: dict[str, Callable[[], CostModel]] = {
        "default": lambda: DefaultCosts(arrays, cluster, optimizer_state_factor),
        "paper": lambda: PaperCosts(arrays, cluster),
        "pipedream": lambda: PipeDreamCosts(arrays, cluster),
    }
    return makers[name]()
