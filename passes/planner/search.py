"""The planner's search: :class:`PlanModel` holds one planning problem (chain x cluster x cost model
x schedule) as the arrays its parts give it, a cost model (``costs.py``), the memory model
(``memory.py``) and the recomputation decision (``decisions.py``), and decides by a vectorized
greedy whether a bottleneck time is feasible; :func:`solve` bisects on that time. The search
reads the cost model only through :class:`~pdcompile.passes.planner.costs.CostModel`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import replace
from typing import Sequence

import numpy as np

from pdcompile.cluster import ClusterSpec, format_quantity, require_memory
from pdcompile.errors import InfeasiblePlanError, UsageError
from pdcompile.ir import Chain
from pdcompile.passes.planner.arrays import ChainArrays, rng
from pdcompile.passes.planner.blocks import Block, Evaluation
from pdcompile.passes.planner.costs import COST_CLASSES, COST_MODELS, make_costs
from pdcompile.passes.planner.decisions import PartialTable, Recompute, allowed_modes, RECOMPUTE
from pdcompile.passes.planner.memory import EPS, MemoryModel, mode_of
from pdcompile.passes.planner.options import PlanOptions
from pdcompile.passes.planner.sharding import allowed as shard_allowed
from pdcompile.passes.planner.sharding import check_option as check_shard
from pdcompile.passes.planner.sharding import comm_factors, full_refusal
from pdcompile.runtime.schedules import registry as schedule_registry

__all__ = ["PlanModel", "SCHEDULES", "solve", "refusals_without_memory"]

#: whether a refusal names the smallest per-worker memory that would fit: a bisection of feasibility tests, the
#: search's costliest answer; off inside :func:`refusals_without_memory`
_NAME_NEEDED_MEMORY: ContextVar[bool] = ContextVar("name_needed_memory", default=True)


@contextmanager
def refusals_without_memory() -> Iterator[None]:
    """Inside it, a search that finds no plan refuses without naming the memory that would fit (no bisection):
    for callers that try many problems and discard refusals (the tensor-parallel degree loop, whose step search
    tries every microbatch count and copy count at every degree), and ask again for the one they report."""
    token = _NAME_NEEDED_MEMORY.set(False)
    try:
        yield
    finally:
        _NAME_NEEDED_MEMORY.reset(token)

SCHEDULES = tuple(schedule_registry.SCHEDULES)  # memory from each one's Policy (weight versions, in flight)
BIG = np.iinfo(np.int64).max // 4


class PlanModel:
    """Arrays and parameters of one planning problem (chain x cluster x cost model), and its search."""

    #: Bytes of partial recomputation's rows kept at most (then built again as asked).
    partial_store_bytes = 2**28
    #: One-query searches (the top level, rebuilds) by breakpoints (:meth:`_group_start_one`);
    #: off: the vectorized search for them too. Both off switches are the tests' reference.
    breakpoint_search = True
    #: The vectorized search tries, at step ``w``, every downstream count ``d <= w - r`` (on: the
    #: unpruned search; off: ``d = w - r`` only, which finds the same, see :meth:`_group_start`).
    exhaustive_pairs = False

    def __init__(self, chain: Chain, cluster: ClusterSpec, options: PlanOptions | None = None) -> None:
        """``options.pool`` is the caller's (``partition_dp`` plans on the pooled cluster it gives)."""
        opts = self.options = options if options is not None else PlanOptions()
        cost_model, schedule, recompute = opts.cost_model, opts.schedule, opts.recompute
        num_microbatches = opts.num_microbatches
        if recompute not in RECOMPUTE:
            raise UsageError(f"unknown recompute {recompute!r} (use one of {', '.join(RECOMPUTE)})")
        if cost_model not in COST_MODELS:
            raise UsageError(f"unknown cost model {cost_model!r} (use one of {', '.join(COST_MODELS)})")
        if schedule not in SCHEDULES:
            raise UsageError(f"unknown schedule {schedule!r} (use one of {', '.join(SCHEDULES)})")
        if len(chain) == 0:
            raise UsageError("the chain has no layers: nothing to plan")
        if opts.optimizer_state_factor < 0:
            raise UsageError(f"optimizer_state_factor must be >= 0 (got {opts.optimizer_state_factor})")
        kind = COST_CLASSES[cost_model]
        if not kind.models_memory and opts.memory_limit:
            raise UsageError("the pipedream cost model reproduces PipeDream's released optimizer, which plans without "
                             "a memory limit by default; use cost_model='default' (or 'paper') with memory_limit=True")
        self.chain = chain
        self.cluster = cluster
        self.cost_model = cost_model
        self.schedule = schedule
        self.policy = schedule_registry.policy(schedule)
        self.num_microbatches = num_microbatches  # None: not given (the step's count is then 1, uncapped)
        self.M = max(1, int(num_microbatches or 1))
        # a model without memory (the released optimizer's) neither limits it nor recomputes
        self.recompute = recompute if kind.models_memory else "none"
        self.opt_factor = float(opts.optimizer_state_factor)
        self.allow_replication = opts.allow_replication
        #: the ``shard=`` option (planner/sharding.py); ``step_M``: the step's microbatch count where it is known
        #: (``PlanOptions.step_microbatches``; not given, or ``pdcompile plan``'s: None), which ``full`` needs one
        #: per replica of: an unknown count does not refuse it, as the memory model and ``with_shard`` read it
        self.shard = check_shard(opts.shard, "planner")
        self.shard_full = opts.shard_full  # auto may choose "full" (not on stages split by tensor parallelism)
        self.step_M = opts.step_microbatches
        if self.shard == "full" and self.policy.version_lag != 0:  # refused before any search (sharding.resolve)
            raise UsageError(f"shard='full': {full_refusal(schedule, 2, None)}")
        self.memory_on = kind.memory_by_default if opts.memory_limit is None else bool(opts.memory_limit)

        self.arrays = arrays = ChainArrays(chain)
        self.N = arrays.N
        self.cut, self.PC, self.PF, self.PW = arrays.cut, arrays.PC, arrays.PF, arrays.PW
        self.L = len(cluster.levels)
        self.counts = [lv.count for lv in cluster.levels]
        self.B = [float(lv.bandwidth) for lv in cluster.levels]
        self.sizes = [cluster.unit_size(k) for k in range(self.L + 1)]

        self.costs = make_costs(cost_model, arrays, cluster, self.opt_factor)
        self.mem = MemoryModel.of(arrays, chain, opts, workers=self.sizes[-1],
                                  budget=require_memory(cluster) if self.memory_on else math.inf, on=self.memory_on)
        self.selective_known = self.mem.selective_known
        if self.recompute == "selective" and not self.selective_known:
            raise UsageError("recompute='selective' needs each layer's selective costs (what stays saved when cheap "
                             "ops are rebuilt), which this chain lacks (profiles imported from PipeDream have none); "
                             "use recompute='full' or 'auto'")
        #: whether the search shards replicated stages ("none": it does not), and the modes it tries for each
        #: (each its own time and memory, sharding.py; a list per stage is searched unsharded)
        self.search_shards: tuple[str, ...] = ("none",)
        if self.memory_on and kind.models_memory and isinstance(self.shard, str) and self.shard != "none":
            self.search_shards = (("none", "full", "optimizer") if self.policy.version_lag == 0 and self.shard_full else
                                  ("none", "optimizer")) if self.shard == "auto" else ("none", self.shard)
        # the modes the search may give a stage
        self.modes = allowed_modes(self.recompute, self.selective_known, self.memory_on)
        self.decide = Recompute(arrays, self.mem, self.modes, self.recompute == "auto" and self.memory_on)
        if self.costs.solver is None:
            # the compute terms a level-1 stage's threshold bounds, per mode (forward run again added)
            extra = {"none": None, "full": arrays.f, "selective": self.mem.selective_s}
            self.time_prefix = {mode: self.costs.time_prefix(x) for mode, x in extra.items()}
            self.PT = self.P1 = self.time_prefix["none"]
            self.partial = PartialTable(arrays, self.mem, self.PT, self.partial_store_bytes)
        # boundary thresholds per level: 2 a / B_k (inf: forbidden cut)
        self.tcut = [2.0 * arrays.cut / b for b in self.B]
        self._tau: float | None = None
        self._nxt: dict[int, np.ndarray] = {}
        self._pair_cache: dict[tuple[int, int, bool, bool], tuple[np.ndarray, np.ndarray]] = {}

    # -- the parts, as one problem sees them ---------------------------------------------------
    @property
    def mem_budget(self) -> float:
        """Bytes per worker a stage must fit (inf when the memory limit is off)."""
        return self.mem.budget

    def versions(self, k: int) -> int:
        return self.mem.versions(k)

    def in_flight(self, depth: int, r: int) -> int:
        return self.mem.in_flight(depth, r)

    def rng(self, P: np.ndarray, i: int, j: int) -> float:
        return rng(P, i, j)

    def activations(self, i: int, j: int, recompute: bool | str = False) -> float:
        return self.mem.activations(i, j, recompute)

    def memory(self, i: int, j: int, k: int, recompute: bool | str = False, depth: int | None = None,
               head: int = 0) -> float:
        return self.mem.memory(i, j, k, recompute, depth, head)

    def memory_at(self, i: int, j: int, k: int, versions: int, recompute: bool | str = False,
                  activation_scale: float = 1.0, head: int = 0) -> float:
        return self.mem.memory_at(i, j, k, versions, recompute, activation_scale, head)

    def max_in_flight(self, i: int, j: int) -> int:
        return self.mem.max_in_flight(i, j)

    def recompute_s(self, i: int, j: int, mode: str, head: int = 0) -> float:
        return self.decide.recompute_s(i, j, mode, head)

    def choose_recompute(self, i: int, j: int, k: int, depth: int | None = None, *, versions: int | None = None,
                         activation_scale: float = 1.0) -> tuple[str, int]:
        return self.decide.choose(i, j, k, depth, versions=versions, activation_scale=activation_scale)

    def _mem_rows(self, mode: bool | str = "none") -> np.ndarray:
        return self.mem.rows(mode)

    def _partial_start(self, se_c: np.ndarray, thr: np.ndarray, kin: np.ndarray,
                       need: np.ndarray | None = None) -> np.ndarray:
        return self.partial.start(se_c, thr, kin, need)

    def shard_modes(self, stage: int, replicas: int) -> tuple[str, ...]:
        """The shard modes stage ``stage`` of ``replicas`` replicas may take, preferred first (auto:
        none, then full, then optimizer, where it can run; without a memory limit: none)."""
        asked = self.shard if isinstance(self.shard, str) else (
            self.shard[stage] if stage < len(self.shard) else "none")
        if asked == "auto" and not (self.memory_on and self.costs.solver is None):
            return ("none",)
        modes = shard_allowed(asked, replicas, self.schedule, self.step_M)
        return modes if self.shard_full or asked != "auto" else tuple(m for m in modes if m != "full")

    def choose_stage(self, i: int, j: int, k: int, depth: int, stage: int, replicas: int,
                     units: int | None = None) -> tuple[str, str, int]:
        """(shard mode, recompute mode, recomputed layers) of stage ``stage`` = ``i..j`` of ``replicas``
        replicas (``units`` of them at level 1, whose all-reduce the stage's time charges; default all)
        with ``k`` in flight: of the pairs that fit, the least stage time (each shard mode's
        communication, ``sharding.comm_factors``, and the forward run again), ties to the preferred shard
        mode (:meth:`shard_modes`); none fitting, the pair that needs least memory."""
        shards = self.shard_modes(stage, replicas)
        if len(shards) == 1 and shards[0] == "none":
            return ("none", *self.decide.choose(i, j, k, depth, replicas=replicas))
        budget = self.mem_budget * (1 + EPS)
        r1 = replicas if units is None else units
        best: tuple[float, str, str, int] | None = None
        least: tuple[float, str, str, int] | None = None
        for sh in shards:
            mode, head = self.decide.choose(i, j, k, depth, shard=sh, replicas=replicas)
            mem = self.mem.memory(i, j, k, mode, depth, head, shard=sh, replicas=replicas)
            if least is None or mem < least[0]:
                least = (mem, sh, mode, head)
            if mem <= budget:
                t = self.costs.stage_time(i, j, r1, self.recompute_s(i, j, mode, head), sh)[0]
                if best is None or t < best[0] * (1 - 1e-12):
                    best = (t, sh, mode, head)
        assert least is not None
        _, sh, mode, head = best if best is not None else least
        return sh, mode, head

    def level1_stage(self, i: int, j: int, r: int, recompute: bool | str = False, head: int = 0) -> tuple[float, float]:
        """(stage time per minibatch, its weight-sync part) of a level-1 stage (recompute: what the
        mode runs again in the backward, :meth:`recompute_s`)."""
        return self.costs.stage_time(i, j, r, self.recompute_s(i, j, mode_of(recompute), head))

    def outer_comm(self, i: int, j: int, r: int, level: int) -> float:
        """The weight-sync term of a level-``level`` (1-based, >= 2) block, per minibatch."""
        return self.costs.weight_sync_time(i, j, r, level)

    def evaluate(self, blocks: Sequence[Block]) -> Evaluation:
        return self.costs.evaluate(self, blocks)

    def data_parallel_time(self) -> float:
        """One stage of all layers replicated over every unit of every level."""
        return self.costs.data_parallel_time()

    def memory_ok(self, ev: Evaluation) -> bool:
        return (not self.memory_on) or ev.peak_memory <= self.mem_budget * (1 + 1e-9)

    # -- the feasibility oracle --------------------------------------------------------------
    def _set_tau(self, tau: float) -> None:
        """Fix the bottleneck under test; build, per level, the table ``nxt[mult, p]``: the
        smallest start >= p whose preceding cut is allowed (finite, ``2a/B_k <= mult * tau``);
        N when none. ``mult`` is the product of the enclosing blocks' units."""
        if self._tau == tau:
            return
        self._tau = tau
        N = self.N
        self._nxt = {}
        finite = np.isfinite(self.cut)
        for level in range(1, self.L + 1):
            mmax = self.sizes[-1] // self.sizes[level]  # units of the levels above
            mults = np.maximum(np.arange(mmax + 1, dtype=float), 1.0)[:, None]
            ok = np.ones((mmax + 1, N + 1), dtype=bool)
            ok[:, 1:N] = finite & (self.tcut[level - 1][None, :] <= mults * tau * (1 + EPS))
            idx = np.where(ok, np.arange(N + 1), N)
            self._nxt[level] = np.minimum.accumulate(idx[:, ::-1], axis=1)[:, ::-1]

    @staticmethod
    def _ss(P: np.ndarray, end: np.ndarray, thr: np.ndarray) -> np.ndarray:
        """Smallest i with P[end+1] - P[i] <= thr (any shapes)."""
        return np.searchsorted(P, P[end + 1] - thr * (1 + EPS), side="left")

    def _pairs(self, m: int, w: int, exact: bool) -> tuple[np.ndarray, np.ndarray]:
        """Candidate (replicas r, downstream units d) of step ``w`` of a level with ``m`` units, as
        (P, 1) columns: ``exact``, every d <= w - r, else only d = w - r."""
        key = (m, w, exact, self.allow_replication)
        got = self._pair_cache.get(key)
        if got is None:
            rmax = min(w, m if self.allow_replication else 1)
            pairs = [(r, d) for r in range(1, rmax + 1) for d in (range(w - r + 1) if exact else (w - r,))]
            got = (np.array([r for r, _ in pairs], dtype=np.int64)[:, None],
                   np.array([d for _, d in pairs], dtype=np.int64)[:, None])
            self._pair_cache[key] = got
        return got

    def _mem_start(self, mode: str, kin: np.ndarray, se_c: np.ndarray, reps: np.ndarray,
                   low: np.ndarray, shard: str = "none") -> np.ndarray:
        """Smallest start of stages ending at ``se_c`` with ``kin`` in flight whose memory under
        recompute ``mode`` fits; a stage of ``reps`` > 1 replicas held as ``shard``
        (:meth:`MemoryModel.sharded_starts`), asked only where the unsharded start is above ``low``
        (the time's bound: elsewhere it changes nothing) unless ``shard`` may hold more than unsharded
        (``full`` with few replicas and little optimizer state: its gathered copy plus its shard)."""
        table = self.mem.rows(mode)
        kin, se_c, reps, low = np.broadcast_arrays(kin, se_c, reps, low)
        out = table[np.minimum(kin, len(table) - 1), se_c]
        if shard != "none" or self.mem.by_replicas:  # unsharded too where a replica's share of the step counts
            need = (out > low) & (reps > 1)
            if shard == "full":  # 1 + (1 + f) / r per weight byte against none's 1 + f (one version): more if r < 1 + 1/f
                f = self.mem.opt_factor
                need |= (reps > 1) & ((1.0 + f) > f * reps)
            if np.any(need):
                out[need] = self.mem.sharded_starts(mode, shard, kin[need], se_c[need], reps[need])
        return out

    def _shard_ok(self, shard: str, reps: np.ndarray) -> np.ndarray | None:
        """Where a stage of ``reps`` replicas may take ``shard`` (:meth:`shard_modes`, vectorized; None: everywhere)."""
        if shard == "none":
            return reps <= 1 if self.shard in ("optimizer", "full") else None
        ok = reps > 1
        if shard == "full" and self.shard == "auto" and self.step_M is not None:
            ok &= reps <= self.step_M  # a microbatch per replica (sharding.full_refusal)
        return ok

    def _level1_start(self, se_c: np.ndarray, thr: np.ndarray, rr: np.ndarray, dd: np.ndarray,
                      e2: np.ndarray, options: tuple[str, ...], cutoff: np.ndarray | int | None = None,
                      mult: np.ndarray | int = 1) -> np.ndarray:
        """Smallest start of level-1 stages ending at ``se_c`` within ``thr`` and the memory limit,
        the furthest-reaching of the recomputation ``options`` (the weight-sync term, which does
        not depend on recomputation, and the in-flight counts are computed once for all).

        ``cutoff``: the caller reads a start only where it is below this; elsewhere the answer may
        be any start at or above it (partial recomputation is not asked there). ``mult``: the units of
        the enclosing blocks (a stage's replicas are ``rr * mult``, what sharding divides by)."""
        kin = None
        if self.memory_on:
            depth = np.ceil((rr + dd + e2) / rr - 1e-9).astype(np.int64)
            kin = -(-self.M // rr) if self.policy.holds_step else depth  # Policy.in_flight, vectorized
            if self.mem.cap:  # MemoryModel.in_flight: at most a replica's share of the step
                kin = np.minimum(kin, -(-self.M // rr))
            kin = np.broadcast_to(kin, depth.shape).copy()
        out = None
        reps = rr * mult
        for shard in self.search_shards:  # each shard mode its own time (sharding.comm_factors) and memory
            ok = self._shard_ok(shard, reps)
            sharded = shard != "none"
            if sharded:
                comp, common = self.costs.shard_starts(self.PT, se_c, thr, rr, shard)  # type: ignore[attr-defined]
                exposed = comm_factors(shard)[1] * self.costs.comm_per_byte(rr)  # type: ignore[attr-defined]
            else:
                common = self.costs.sync_start(se_c, thr, rr)  # the weight-sync bound: the same for every mode
            for mode in options:
                if mode == "partial":
                    continue
                if sharded:
                    s = (comp if mode == "none" else
                         self.costs.shard_starts(self.time_prefix[mode], se_c, thr, rr, shard, mode)[0])  # type: ignore[attr-defined]
                else:
                    s = self._ss(self.time_prefix[mode], se_c, thr)
                if kin is not None:
                    s = np.maximum(s, self._mem_start(mode, kin, se_c, reps, np.maximum(s, common), shard))
                s = np.maximum(s, common)
                if ok is not None:
                    s = np.where(ok, s, BIG)
                out = s if out is None else np.minimum(out, s)
            if "partial" in options and kin is not None:
                timed = comp if sharded else self._ss(self.PT, se_c, thr)  # partial runs more: not before this
                # only where memory stops a stage without recomputation can partial reach further back, and
                # only where that bound is below what the other modes reach and what the caller reads
                table = self.mem.rows("none")
                low = np.maximum(timed, common)
                need = table[np.minimum(kin, len(table) - 1), se_c] > timed
                if ok is not None:
                    need = need & ok
                if out is not None:
                    need &= low < out
                if cutoff is not None:
                    need &= low < cutoff
                part = (self.partial.start_sharded(se_c, thr, kin, need, reps, shard, exposed) if sharded
                        else self.partial.start(se_c, thr, kin, need))
                s = np.maximum(np.maximum(part, timed), common)
                if ok is not None:
                    s = np.where(ok, s, BIG)
                out = s if out is None else np.minimum(out, s)
        assert out is not None
        return out

    def _stage_starts(self, level: int, se_c: np.ndarray, rr: np.ndarray, dd: np.ndarray, mult: np.ndarray,
                      e: np.ndarray, cutoff: np.ndarray | int | None = None) -> np.ndarray:
        """Smallest start of a stage of ``rr`` units of ``level`` ending at ``se_c`` within its
        threshold ``rr * mult * tau`` (and the memory limit, ``dd`` units of this level downstream
        and ``e`` extra downstream workers per unit replica). Arrays of any broadcastable shapes.
        ``cutoff``: as for :meth:`_level1_start`."""
        tau = self._tau
        assert tau is not None
        thr = (rr * mult) * tau  # the stage's units x its group's threshold
        if level == 1:
            return self._level1_start(se_c, thr, rr, dd, e, self.modes, cutoff, mult)
        wthr = self.costs.outer_sync_bytes(thr, rr, level)
        s = self._ss(self.PW, se_c, wthr)
        shape = s.shape
        s_in = self._group_start(
            level - 1,
            np.broadcast_to(se_c, shape).ravel(),
            np.broadcast_to(rr * mult, shape).ravel(),
            np.broadcast_to((e + dd * self.sizes[level - 1]) / rr, shape).ravel(),
        ).reshape(shape)
        return np.maximum(s, s_in)

    def _group_start(
        self, level: int, end: np.ndarray, mult: np.ndarray, e: np.ndarray, trace: list | None = None
    ) -> np.ndarray:
        """Smallest start of a range ending at ``end`` that one group of ``level`` (its
        ``counts[level-1]`` units) covers within ``mult * tau``, with ``e`` extra downstream
        workers per unit replica (memory). Vectorized over queries (1-d arrays); one query (the
        top level, and every rebuild) goes to :meth:`_group_start_one` unless
        ``breakpoint_search`` is off (the reference search the tests compare it with).

        Step ``w`` tries a stage of ``r`` units in front of the suffix that ``d = w - r`` units
        cover. That is the whole search, with the memory limit too: a candidate ``(r, d)`` does not
        depend on ``w`` (its suffix ``L[d]``, its in-flight counts from ``d``), and ``L[w]`` is a
        running minimum, so the pairs with ``d < w - r`` were all tried at step ``r + d < w``
        (``exhaustive_pairs`` tries them again: the tests' reference)."""
        if len(end) == 1 and self.breakpoint_search:
            return np.array([self._group_start_one(level, int(end[0]), int(mult[0]), float(e[0]), trace)],
                            dtype=np.int64)
        tau = self._tau
        assert tau is not None
        m = self.counts[level - 1]
        Q = len(end)
        Ls = np.empty((m + 1, Q), dtype=np.int64)
        Ls[0] = end + 1
        exact = self.exhaustive_pairs and self.memory_on
        nxt = self._nxt[level]
        end2, mult2, e2 = end[None, :], mult[None, :], e[None, :]
        endp1 = end2 + 1
        cols = np.arange(Q)
        for w in range(1, m + 1):
            rr, dd = self._pairs(m, w, exact)
            p = Ls[dd[:, 0]]  # (P, Q): start of the suffix covered by d units
            p2 = np.where(p > end2, endp1, np.minimum(nxt[mult2, np.minimum(p, self.N)], endp1))
            se = p2 - 1  # the new stage ends just before that suffix
            se_c = np.maximum(se, 0)
            # a pair changes L[w] only below L[w - 1]: elsewhere any start at or above it does
            s = self._stage_starts(level, se_c, rr, dd, mult2, e2, Ls[w - 1][None, :])
            cand = np.where((se >= 0) & (s <= se), s, BIG)
            if trace is None:
                np.minimum(Ls[w - 1], cand.min(axis=0), out=Ls[w])
            else:
                bi = np.argmin(cand, axis=0)
                best = cand[bi, cols]
                Ls[w] = np.minimum(Ls[w - 1], best)
                if best[0] < Ls[w - 1][0]:
                    b = int(bi[0])
                    trace.append((int(rr[b, 0]), int(dd[b, 0]), int(p2[b, 0]), int(s[b, 0])))
                else:
                    trace.append(None)
            if Q == 1 and trace is None and Ls[w, 0] <= 0:  # the whole chain is covered
                Ls[m] = Ls[w]
                break
        return Ls[m]

    def _group_start_one(self, level: int, end: int, mult: int, e: float, trace: list | None = None) -> int:
        """:meth:`_group_start` for one query in O(breakpoints x units) stage checks, not
        O(units^2); the same result, plan and ties.

        Why it is the same search. ``L[w]`` (the smallest start ``w`` units cover) is
        non-increasing in ``w``; call ``b`` a *breakpoint* where ``L[b] < L[b-1]`` (and ``b = 0``).
        Step ``w`` tries ``r`` units in front of the suffix that ``d = w - r`` units cover; that
        pair's start ``S(r, d)`` does not depend on ``w``. Let ``b <= d`` be the last breakpoint:
        ``L[d] = L[b]``, so both pairs' stages end at the same cut, and ``d`` differs from ``b`` only
        in the memory's in-flight counts, which grow with ``d`` (the counts passed down,
        ``(e + d * size) / r``; the rows of :meth:`_mem_rows` are non-decreasing in the in-flight
        count), hence ``S(r, d) >= S(r, b)``, which step ``r + b <= w`` already tried: when
        ``d > b`` the pair cannot lower ``L[w - 1]``. So step ``w`` needs only ``S(r, b)`` for the
        breakpoints ``b`` with ``r = w - b``: each breakpoint's row ``S(., b)`` is asked once,
        vectorized over ``r`` (up to a horizon of steps that doubles as ``w`` grows), and a step
        reads one entry per breakpoint. Ties break as in the vectorized search: the smallest ``r``
        (the last breakpoint). ``tests/test_partition_dp.py`` compares the two, and the exhaustive
        pairs, on random instances."""
        m = self.counts[level - 1]
        N = self.N
        nxt_row = self._nxt[level][mult]
        rmax = m if self.allow_replication else 1
        big = np.iinfo(np.int32).max
        T = np.full((m + 1, 8), big, dtype=np.int32)  # T[w, j] = S(w - b_j, b_j); big: no stage
        bp_d: list[int] = []  # breakpoints (downstream unit counts), in order
        bp_p2: list[int] = []  # the first position after each breakpoint's stage (its suffix's cut)
        H = 0  # steps 1..H are filled for every breakpoint

        def fill(rows: list[int], lo: int, hi: int) -> None:
            """T[lo..hi, rows]: one vectorized query of every row's stages for those steps."""
            ws, js = [], []
            for j in rows:
                a, z = max(lo, bp_d[j] + 1), min(hi, bp_d[j] + rmax)
                if a <= z:
                    ws.append(np.arange(a, z + 1, dtype=np.int64))
                    js.append(np.full(z - a + 1, j, dtype=np.int64))
            if not ws:
                return
            w_, j_ = np.concatenate(ws), np.concatenate(js)
            dd = np.array(bp_d, dtype=np.int64)[j_]
            se = np.array(bp_p2, dtype=np.int64)[j_] - 1
            se_c = np.maximum(se, 0)
            # a step reads an entry only below the best start so far, which only decreases
            s = self._stage_starts(level, se_c, w_ - dd, dd, np.array(mult, dtype=np.int64), np.array(e, dtype=float),
                                   best_so_far)
            T[w_, j_] = np.where((se >= 0) & (s <= se), s, big)

        def add_breakpoint(d: int, start: int) -> None:
            nonlocal T
            j = len(bp_d)
            if j == T.shape[1]:
                T = np.hstack([T, np.full_like(T, big)])
            bp_d.append(d)
            bp_p2.append(end + 1 if start > end else min(int(nxt_row[min(start, N)]), end + 1))
            fill([j], d + 1, H)

        best_so_far = end + 1
        add_breakpoint(0, best_so_far)
        for w in range(1, m + 1):
            if w > H:  # every row's stages for the next steps
                old, H = H, min(m, max(2 * H, 32))
                fill(list(range(len(bp_d))), old + 1, H)
            col = T[w, :len(bp_d)]
            j = len(bp_d) - 1 - int(np.argmin(col[::-1]))  # ties: the last breakpoint, the fewest replicas
            best = int(col[j])
            if best < best_so_far:
                best_so_far = best
                if trace is not None:
                    trace.append((w - bp_d[j], bp_d[j], bp_p2[j], best))
                if best <= 0:  # the whole chain is covered: no later step can do better
                    break
                add_breakpoint(w, best)
            elif trace is not None:
                trace.append(None)
        if trace is not None:
            trace.extend([None] * (m - len(trace)))
        return best_so_far

    def feasible(self, tau: float) -> bool:
        """Whether some configuration has every stage, link and weight sync within ``tau``."""
        # the search checks each worker-level stage's compute terms (PT's, the least of any mode) within
        # its workers x tau, so a plan's sum over the chain is within all workers x tau (the 1e-9: far
        # above the rounding of those checks): below that bound no plan exists, and no search is needed
        if float(self.PT[-1]) > self.sizes[-1] * tau * (1 + EPS) * (1 + 1e-9):
            return False
        self._set_tau(tau)
        end = np.array([self.N - 1], dtype=np.int64)
        return bool(self._group_start(self.L, end, np.array([1], dtype=np.int64), np.zeros(1))[0] <= 0)

    def reconstruct(self, tau: float) -> tuple[Block, ...]:
        self._set_tau(tau)
        return self._rebuild(self.L, 0, self.N - 1, 1, 0.0)

    def _rebuild(self, level: int, start: int, end: int, mult: int, e: float) -> tuple[Block, ...]:
        trace: list = []
        L = self._group_start(level, np.array([end], dtype=np.int64), np.array([mult], dtype=np.int64),
                              np.array([e], dtype=float), trace)
        if L[0] > start:  # pragma: no cover - callers only rebuild feasible ranges
            raise AssertionError(f"range {start}..{end} is not coverable at level {level}")
        choices = [None] + trace  # choices[w]
        blocks: list[Block] = []
        w = self.counts[level - 1]
        req = start
        while True:
            while w > 0 and choices[w] is None:
                w -= 1
            if w == 0:
                break
            r, d, p2, s = choices[w]
            first, last = max(s, req), p2 - 1
            if first <= last:
                inner: tuple[Block, ...] = ()
                if level > 1:
                    inner = self._rebuild(level - 1, first, last, mult * r,
                                          (e + d * self.sizes[level - 1]) / r)
                blocks.append(Block(first, last, r, inner))
            if p2 > end:
                break
            req = max(req, p2)
            w = d
        return tuple(blocks)

    def min_memory_to_fit(self) -> float:
        """The smallest per-worker memory for which some plan fits (bisection)."""
        saved = self.mem.budget
        try:
            lo = 0.0
            hi = self.memory(0, self.N - 1, 1)  # everything on one worker
            for _ in range(60):
                if hi - lo <= 1e-4 * hi:
                    break
                mid = 0.5 * (lo + hi)
                self.mem.budget = mid
                if self.feasible(math.inf):
                    hi = mid
                else:
                    lo = mid
            return hi
        finally:
            self.mem.budget = saved
            self._tau = None



def solve(model: PlanModel) -> tuple[tuple[Block, ...], Evaluation]:
    """The best configuration of ``model`` and its evaluation. ``shard="auto"`` under a memory limit
    keeps the unsharded search's configuration unless sharding makes one fit or strictly faster
    (:func:`_solve_auto`)."""
    if model.shard == "auto" and model.search_shards != ("none",):
        return _solve_auto(model)
    return _solve(model)


def _solve_auto(model: PlanModel) -> tuple[tuple[Block, ...], Evaluation]:
    """``shard="auto"``: the configuration the search finds without sharding (evaluated under ``auto``,
    where a stage may shard instead of recomputing), unless some configuration is strictly faster with
    sharding (one feasibility test at that time says whether to search) or none fits without it: so
    that equally fast plans do not shard."""
    base = PlanModel(model.chain, model.cluster, replace(model.options, memory_limit=model.memory_on,
                                                         recompute=model.recompute, shard="none"))
    # the same chain, cluster, schedule and budget: one memory model, one set of unsharded tables (the
    # sharded ones are keyed apart), built once for both searches
    base.mem, base.decide = model.mem, model.decide
    if model.costs.solver is None:
        base.partial = model.partial
    try:
        blocks0, ev0 = _solve(base, needed=False)  # where none fits unsharded, the sharded search answers
    except InfeasiblePlanError:
        return _solve(model)
    ev = model.evaluate(blocks0)
    if ev.seconds > 0 and model.feasible(ev.seconds * (1 - 1e-9)):
        blocks1, ev1 = _solve(model)
        if ev1.seconds < ev.seconds * (1 - 1e-9):
            return blocks1, ev1
    return blocks0, ev


def _solve(model: PlanModel, needed: bool = True) -> tuple[tuple[Block, ...], Evaluation]:
    """The search (module doc). Where no plan fits: InfeasiblePlanError naming the smallest per-worker memory
    that would (a bisection of feasibility tests; ``needed=False``: not computed, for a caller that discards
    the error, as :func:`_solve_auto` does before its sharded search)."""
    if model.costs.solver is not None:  # a model with its own DP (the released optimizer's)
        blocks = model.costs.solver(model)
        return blocks, model.evaluate(blocks)
    if not model.feasible(math.inf):
        if not needed or not _NAME_NEEDED_MEMORY.get():
            raise InfeasiblePlanError(f"no plan of {model.chain.name} fits in "
                                      f"{format_quantity(model.mem_budget, 'memory')} per worker")
        need = model.min_memory_to_fit()
        err = InfeasiblePlanError(
            f"no plan of {model.chain.name} fits in {format_quantity(model.mem_budget, 'memory')} per worker "
            f"on {model.cluster.num_workers} workers with schedule {model.schedule}; the smallest "
            f"per-worker memory that fits is {format_quantity(need, 'memory')} ({need:.0f} bytes): "
            "use devices with more memory, a smaller microbatch, or the flush schedule (one weight version)"
        )
        err.needed_memory_bytes = need  # type: ignore[attr-defined]  # an attribute for callers that read it
        raise err
    blocks = model.reconstruct(math.inf)
    ev = model.evaluate(blocks)
    hi = ev.seconds
    if model.allow_replication:  # data parallelism, where it fits, often brackets the optimum far more tightly
        dp: tuple[Block, ...] = ()
        for count in model.counts:
            dp = (Block(0, model.N - 1, count, dp),)
        ev_dp = model.evaluate(dp)
        if 0 < ev_dp.seconds < hi and ev_dp.peak_memory <= model.mem_budget and model.feasible(ev_dp.seconds):
            hi = ev_dp.seconds  # a bound only: the plan is the search's, as without it
    if hi <= 0:
        return blocks, ev
    if not math.isfinite(hi):  # pragma: no cover - every feasible plan has a finite time
        raise InfeasiblePlanError(f"no plan of {model.chain.name} has a finite time")
    # every plan takes at least C / workers (each stage's time >= its compute / its workers)
    lo = min(float(model.PC[-1]) / model.cluster.num_workers * (1 - 1e-9), hi)
    if lo <= 0:
        lo = hi * 1e-12
        while lo > 0 and model.feasible(lo):
            hi, lo = lo, lo * 1e-6
    best = (blocks, ev)
    for _round in range(32):
        # bisection in log space down to a 1e-5 bracket (~20 steps for a 1e4 range) ...
        for _ in range(200):
            if not hi > lo * (1 + 1e-5) or lo <= 0:
                break
            mid = lo * math.sqrt(hi / lo)
            if not lo < mid < hi:
                break
            if model.feasible(mid):
                hi = mid
            else:
                lo = mid
        blocks = model.reconstruct(hi)
        ev = model.evaluate(blocks)
        if ev.seconds < best[1].seconds:
            best = (blocks, ev)
        # ... then the exact step: is anything strictly better than the found plan's own time?
        probe = best[1].seconds * (1 - 1e-9)
        if probe <= lo or not model.feasible(probe):
            break
        hi = probe
    return best


