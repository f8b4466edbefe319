"""The recomputation decision: which mode a stage runs (none, selective, partial, full) and what it
runs again in its backward. The planner and the simulator call the same functions
(:class:`Recompute`); the search reads partial recomputation through :class:`PartialTable`.

``recompute="auto"`` gives each stage the allowed mode that fits the memory limit with the least
forward run again (partial: its fewest first layers that fit, solved in closed form per in-flight
count and end by :meth:`PartialTable.grid`).
"""

from __future__ import annotations

import numpy as np

from pdcompile.errors import UsageError
from pdcompile.ir import Chain
from pdcompile.passes.planner.arrays import ChainArrays, cumsum0, rng, sorted_unique
from pdcompile.passes.planner.memory import EPS, SHARD_EXACT, MemoryModel
from pdcompile.passes.planner.options import PlanOptions

__all__ = ["MODES", "RECOMPUTE", "PartialTable", "Recompute", "allowed_modes", "stage_decisions"]

RECOMPUTE = ("none", "selective", "full", "auto")  # never, every stage (cheap ops / whole forward), where memory needs it
#: What a stage may recompute (``StageCost.recompute``): nothing; its cheap ops (selective, the layers'
#: ``selective_*`` costs); its first layers (partial: the fewest that fit); its whole forward (full).
MODES = ("none", "selective", "partial", "full")
PARTIAL_EXACT = 16  # in-flight counts the partial-recomputation search takes exactly (above: rounded up)


def allowed_modes(recompute: str, selective_known: bool, memory_on: bool) -> tuple[str, ...]:
    """The modes a stage may be given under the ``recompute`` option (auto: those the chain's costs
    allow, and only where a memory limit needs them)."""
    if recompute not in RECOMPUTE:
        raise UsageError(f"unknown recompute {recompute!r} (use one of {', '.join(RECOMPUTE)})")
    fixed = {"none": ("none",), "selective": ("selective",), "full": ("full",)}
    if recompute in fixed:
        return fixed[recompute]
    if not memory_on:
        return ("none",)  # recomputation only where memory needs it
    return ("none",) + (("selective",) if selective_known else ()) + ("partial", "full")


class Recompute:
    """The recomputation decision of stages of one chain under one memory model: the ``modes``
    allowed, chosen per stage when ``auto`` (else the one fixed mode)."""

    def __init__(self, arrays: ChainArrays, memory: MemoryModel, modes: tuple[str, ...], auto: bool) -> None:
        self.memory = memory
        self.modes = modes
        self.auto = auto
        self.PF, self.PC = arrays.PF, arrays.PC
        self.PCsel = cumsum0(arrays.c + memory.selective_s)  # compute with selective's forward run again

    def recompute_s(self, i: int, j: int, mode: str, head: int = 0) -> float:
        """Forward seconds a stage ``i..j`` runs again in its backward under ``mode``."""
        if mode == "full":
            return rng(self.PF, i, j)
        if mode == "partial":
            return rng(self.PF, i, i + head - 1)
        if mode == "selective":
            return rng(self.PCsel, i, j) - rng(self.PC, i, j)
        return 0.0

    def choose(self, i: int, j: int, k: int, depth: int | None = None, *, versions: int | None = None,
               activation_scale: float = 1.0, shard: str = "none", replicas: int = 1) -> tuple[str, int]:
        """(mode, recomputed layers) of a stage ``i..j`` with ``k`` in flight: the allowed mode that
        fits the memory limit with the least forward run again (partial: its fewest first layers);
        none fitting, the one that needs least memory. ``versions`` and ``activation_scale`` as for
        :meth:`MemoryModel.memory_at` (the simulator's counts; default the planner's at ``depth``); the
        weights held as ``shard`` over ``replicas`` (planner/sharding.py)."""
        mem_model = self.memory
        budget = mem_model.budget * (1 + EPS)
        if not self.auto:
            mode = self.modes[0]
            return mode, (j - i + 1 if mode == "full" else 0)
        v = mem_model.versions(depth or k) if versions is None else versions
        best: tuple[float, float, str, int] | None = None  # (extra time, memory, mode, head)
        least: tuple[float, str, int] | None = None
        for mode in self.modes:
            heads = range(1, j - i + 1) if mode == "partial" else (j - i + 1 if mode == "full" else 0,)
            for h in heads:
                mem = mem_model.memory_at(i, j, k, v, mode, activation_scale, head=h, shard=shard, replicas=replicas)
                if least is None or mem < least[0]:
                    least = (mem, mode, h)
                if mem <= budget:
                    t = self.recompute_s(i, j, mode, h)
                    if best is None or t < best[0] * (1 - 1e-12):
                        best = (t, mem, mode, h)
                    break  # partial: more layers only cost more time
        if best is not None:
            return best[2], best[3]
        assert least is not None
        return least[1], least[2]


def stage_decisions(chain: Chain, options: PlanOptions | None = None, *, budget: float | None = None) -> Recompute:
    """The planner's stage memory and recomputation decision for ``chain`` under ``options`` (their
    schedule, optimizer state and microbatches: one object, so the simulator rates a plan with what it
    was planned with) at the simulator's counts (``.memory.memory_at``, :meth:`Recompute.recompute_s`);
    with ``budget`` (bytes per worker), ``recompute="auto"`` under it (:meth:`Recompute.choose`)."""
    arrays = ChainArrays(chain)
    on = budget is not None
    memory = MemoryModel.of(arrays, chain, options if options is not None else PlanOptions(), workers=1,
                            budget=float(budget) if budget is not None else float("inf"), on=on)
    return Recompute(arrays, memory, allowed_modes("auto" if on else "none", memory.selective_known, on), on)


def _groups(keys: np.ndarray) -> list[np.ndarray]:
    """The positions of each distinct value of ``keys`` (1-d), in order of the values."""
    order = np.argsort(keys, kind="stable")
    cuts = np.flatnonzero(np.diff(keys[order])) + 1
    return np.split(order, cuts)


class PartialTable:
    """Partial recomputation for the search: per (in-flight count, end), over every start, the
    stage's time (``PT``, the compute terms a threshold bounds, plus its head's forward again) with
    its fewest first layers recomputed that make it fit; rows built on demand, at most
    ``store_bytes`` of them kept."""

    def __init__(self, arrays: ChainArrays, memory: MemoryModel, PT: np.ndarray, store_bytes: int,
                 shard: str = "none", replicas: int = 1, exposed: float = 0.0) -> None:
        self.arrays = arrays
        self.memory = memory
        #: how the stage's replicas hold its weights and state (planner/sharding.py), and the seconds per
        #: weight byte its mode adds to the compute terms (the exposed communication): a table each
        self.shard, self.replicas, self.exposed = shard, replicas, exposed
        self._sharded: dict[tuple[str, int, float], PartialTable] = {}
        self.N = arrays.N
        self.PF = arrays.PF
        self.PT = PT
        self.store_bytes = store_bytes
        # above any time (the exposed communication too); relative: tiny ones keep their precision
        self.cap = 2.0 * float(PT[-1] + arrays.PF[-1] + exposed * arrays.PW[-1]) or 1.0
        self._neg = np.empty((0, self.N + 1))
        # the row of each (count class, end) in _neg; -1: not built
        self._row_of = np.full((PARTIAL_EXACT + 64, self.N), -1, dtype=np.int64)
        self._index_budget: float | None = None
        self._used = 0
        self._kmax: tuple[float, int] | None = None  # (budget, kmax())

    def grid(self, ks: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Partial recomputation for the stages ``i..end`` with ``k`` in flight (rows: pairs of
        ``ks`` and ``ends``, columns: every start): (whether some head fits, its end ``q + 1`` with
        the fewest layers). :meth:`MemoryModel.memory_at`'s partial moments solved for the head in closed
        form: each bounds the nondecreasing ``(kk - 1) PX[q+1] + g PWM[q+1]`` (or ``PX[q+1]``) from
        below or above, so the fewest layers are the largest of the lower bounds."""
        mm = self.memory
        N = self.N
        R_ = len(ends)
        I = np.arange(N)[None, :]
        J = ends[:, None]
        budget = mm.budget * (1 + EPS)
        Wm = mm.PWM[J + 1] - mm.PWM[I]
        xin = mm.xin_r[I]
        A = mm.PX[J + 1] + mm.xout[J]  # T = A - PX[q+1] + RS[q+1]; H = PX[q+1] - PX[i]
        PXi = mm.PX[I]
        q1 = np.broadcast_to(I + 1, (R_, N)).copy()  # q + 1: the head's end, at least one layer
        hi = np.full((R_, N), np.inf)
        ok = J > I  # a head and a tail, each of at least one layer
        tol = 1e-9 * max(1.0, float(mm.PX[-1]), float(mm.PWM[-1]))
        terms = [mm.terms(int(k), shard=self.shard, replicas=self.replicas) for k in ks]
        v0 = np.array([mm.base(mm.versions(int(k)), self.shard, self.replicas) for k in ks])[:, None]
        with np.errstate(divide="ignore", invalid="ignore"):
            for t in range(len(terms[0])):
                cv = np.array([tt[t][0] for tt in terms], dtype=float)[:, None]
                kk = np.array([tt[t][1] for tt in terms], dtype=float)[:, None]
                rb = terms[0][t][2]  # the same moment of every count
                some = kk >= 1
                if rb == 0:  # kk (xin + T) within the budget: PX[q+1] - RS[q+1] from below; none in flight: weights
                    low = np.searchsorted(mm.PX - mm.RS,
                                          np.where(some, A - (budget - cv * Wm) / kk + xin - tol, -np.inf))
                    q1 = np.maximum(q1, low)
                    ok &= some | (cv * Wm <= budget)
                    continue
                # none in flight (GPipe after a backward; its gradients exist): cv W + xin + H
                hi = np.where(some, hi, np.minimum(hi, budget - cv * Wm - xin + PXi))
                # cv W + g Wt + kk (xin + T) + H, Wt = PWM[j+1] - PWM[q+1] (a rebuild before the step's
                # gradients: the tail's exist): the rebuilt microbatch is charged its tail too (the
                # meter's view; autograd frees it by then)
                g = (cv < v0 + 0.5).astype(float)
                R = cv * Wm + g * mm.PWM[J + 1] + kk * (xin + A) - PXi - budget
                # F = (kk - 1) PX + g PWM - kk RS is nondecreasing (sums and products of monotone arrays
                # round monotonically) and the same for equal counts: one F and one bisection per count
                # find the first F >= R - tol
                low = np.empty(R.shape, dtype=np.int64)
                for rows in _groups(ks):
                    r0 = rows[0]
                    F = (kk[r0] - 1) * mm.PX + g[r0] * mm.PWM - kk[r0] * mm.RS
                    low[rows] = np.searchsorted(F, R[rows] - tol, side="left")
                q1 = np.where(some, np.maximum(q1, low), q1)
        q1c = np.minimum(q1, N)
        ok &= (q1 <= J) & (mm.PX[q1c] <= hi + tol)
        return ok, q1c

    def _klass(self, ks: np.ndarray) -> np.ndarray:
        """The row class of each in-flight count (exact up to PARTIAL_EXACT, then one per power of two)."""
        big = ks > PARTIAL_EXACT
        return np.where(big, PARTIAL_EXACT - 4 + np.log2(np.maximum(ks, 1)).astype(np.int64), ks)

    def rows(self, ks: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """Where rows ``(k, end)`` of the table are in ``self._neg`` (built on demand; negated, so that
        rows are nondecreasing): over starts ``0..N``, the running minimum of the stage's time with
        its fewest first layers recomputed that make it fit with ``k`` in flight (:meth:`grid`;
        ``2 cap`` where none does), so that a bisection finds the smallest start within a time.
        ``ks`` are counts as :meth:`start` rounds them."""
        if self._index_budget != self.memory.budget:
            self._row_of.fill(-1)
            self._index_budget, self._used = self.memory.budget, 0
        kc = self._klass(ks)
        got = self._row_of[kc, ends]
        missing = got < 0
        if np.any(missing):
            keys = sorted_unique(ks[missing] * self.N + ends[missing])
            want_k, want_e = keys // self.N, keys % self.N
            if self._used + len(keys) > len(self._neg):
                cap_rows = max(1, self.store_bytes // (8 * (self.N + 1)))
                if self._used + len(keys) > cap_rows:  # full: start again (this call's rows built anew)
                    self._row_of.fill(-1)
                    self._used = 0
                    keys = sorted_unique(ks * self.N + ends)
                    want_k, want_e = keys // self.N, keys % self.N
                rows = min(max(2 * len(self._neg), self._used + len(keys), 64), max(cap_rows, len(keys)))
                grown = np.empty((rows, self.N + 1))
                grown[:self._used] = self._neg[:self._used]
                self._neg = grown
            I = np.arange(self.N)[None, :]
            ok, q1 = self.grid(want_k, want_e)
            G = np.where(ok, self.PT[want_e[:, None] + 1] - self.PT[I] + self.PF[q1] - self.PF[I], 2.0 * self.cap)
            if self.exposed:  # the shard mode's exposed communication: seconds per weight byte of the stage
                PW = self.arrays.PW
                G = np.where(ok, G + self.exposed * (PW[want_e[:, None] + 1] - PW[I]), G)
            at = slice(self._used, self._used + len(keys))
            self._neg[at, :self.N] = -np.minimum.accumulate(G, axis=1)
            self._neg[at, self.N] = self._neg[at, self.N - 1]  # column N (no start there): rows stay sorted
            self._row_of[self._klass(want_k), want_e] = np.arange(self._used, self._used + len(keys))
            self._used += len(keys)
            got = self._row_of[kc, ends]
        return got

    def kmax(self) -> int:
        """The largest in-flight count at which some stage fits with partial recomputation (0: none):
        stages only fit less with more in flight, so a bisection finds it."""
        key = self.memory.budget
        if self._kmax is not None and self._kmax[0] == key:
            return self._kmax[1]
        if self.shard != "none":  # a sharded table (one per replica count) is asked a few rows: bisecting its
            return max(self.memory.workers, self.memory.M)  # kmax costs more than the rows it spares
        ends = np.arange(self.N)

        # a witness among every 16th end and the last 64 first (one fit answers; else every end)
        few = sorted_unique(np.concatenate((ends[::16], ends[-64:])))  # np.union1d, without numpy.ma

        def any_fits(k: int) -> bool:
            return bool(np.any(self.grid(np.full(len(few), k), few)[0])
                        or (len(few) < self.N and np.any(self.grid(np.full(self.N, k), ends)[0])))

        lo, hi = 0, max(self.memory.workers, self.memory.M)
        if any_fits(hi):
            lo = hi
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if any_fits(mid):
                lo = mid
            else:
                hi = mid - 1
        self._kmax = (key, lo)
        return lo

    def start_sharded(self, se_c: np.ndarray, thr: np.ndarray, kin: np.ndarray, need: np.ndarray | None,
                      reps: np.ndarray, shard: str, exposed: np.ndarray | float = 0.0) -> np.ndarray:
        """:meth:`start` for stages of ``reps`` replicas holding their state as ``shard`` (a stage of one
        replica, or ``none``: unsharded), its mode's ``exposed`` seconds per weight byte added to the
        time: a table per (replica count, exposed) (counts exact up to ``SHARD_EXACT``, then the power of
        two below: fewer replicas hold more, a bound), each answering its own queries."""
        if shard == "none":
            return self.start(se_c, thr, kin, need)
        se_b, thr_b, k_b, r_b, x_b = np.broadcast_arrays(se_c, thr, kin, reps, exposed)
        need_b = np.broadcast_to(True if need is None else need, se_b.shape)
        cls = np.where(r_b > SHARD_EXACT, 2 ** np.floor(np.log2(np.maximum(r_b, 1))).astype(np.int64), r_b)
        out = np.full(se_b.shape, self.N + 1, dtype=np.int64)
        ask = need_b & (cls > 1)
        for r, x in sorted({(int(r), float(x)) for r, x in zip(cls[ask].ravel(), x_b[ask].ravel())}):
            table = self._sharded.get((shard, r, x))
            if table is None:
                table = PartialTable(self.arrays, self.memory, self.PT, self.store_bytes, shard, r, x)
                self._sharded[(shard, r, x)] = table
            sel = ask & (cls == r) & (x_b == x)
            out = np.where(sel, table.start(se_b, thr_b, k_b, sel), out)
        return out

    def start(self, se_c: np.ndarray, thr: np.ndarray, kin: np.ndarray, need: np.ndarray | None = None) -> np.ndarray:
        """Smallest start of stages ending at ``se_c`` that fit with partial recomputation within
        ``thr`` (compute terms), ``kin`` in flight; > the end where none does. ``need``: the queries
        worth asking (elsewhere the answer is taken as none)."""
        se_b, thr_b, k_b = np.broadcast_arrays(se_c, thr, kin)
        N = self.N
        out = np.full(se_b.shape, N + 1, dtype=np.int64)
        idx = np.flatnonzero(np.broadcast_to(True if need is None else need, se_b.shape))
        if len(idx):
            idx = idx[k_b.ravel()[idx] <= self.kmax()]  # beyond it no stage fits
        if not len(idx):
            return out
        e = se_b.ravel()[idx]
        ks = k_b.ravel()[idx].astype(np.int64)
        # past PARTIAL_EXACT in flight, a count is rounded up to a power of two (fewer rows to build;
        # conservative: more in flight never lets a stage fit with fewer layers recomputed)
        big = ks > PARTIAL_EXACT
        ks[big] = 2 ** np.ceil(np.log2(ks[big])).astype(np.int64)
        rows = self.rows(ks, e)
        t = np.minimum(thr_b.ravel()[idx] * (1 + EPS), self.cap)
        # the first start whose running minimum is within t: each stored row (negated) is nondecreasing,
        # so one bisection per row for all its queries
        found = np.empty(len(idx), dtype=np.int64)
        for sel in _groups(rows):
            found[sel] = np.searchsorted(self._neg[rows[sel[0]]], -t[sel], side="left")
        out.reshape(-1)[idx] = found
        return out


