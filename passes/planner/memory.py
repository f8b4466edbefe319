"""The planner's memory model: a stage's bytes per worker, and the tables the search reads.

A worker of stage ``i..j`` holds its weights x the schedule's versions, gradients, optimizer state,
and per microbatch in flight what its layers save for backward and its boundary tensors; with
recomputation what stays saved, plus one microbatch rebuilt at its backward (``partial``: the head
``i..i+head-1`` checkpointed, the tail as usual). The moments that may peak come from the schedule's
``Policy`` (:meth:`MemoryModel.terms`). ``partition_dp``'s docstring has the model in full.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pdcompile.ir import Chain
from pdcompile.passes.planner.arrays import ChainArrays, cumsum0, rng, sorted_unique
from pdcompile.passes.planner.options import PlanOptions
from pdcompile.passes.planner.sharding import weight_factors
from pdcompile.runtime.schedules import registry as schedule_registry

__all__ = ["EPS", "SHARD_EXACT", "MemoryModel", "mode_of", "partial_term"]

EPS = 1e-10  # relative slack in feasibility tests (floating sums); plans are re-evaluated exactly
#: replica counts the search rates sharded memory at exactly; above, at the power of two below (a bound:
#: a sharded stage's memory falls as its replicas grow), one table each (the plan's evaluation is exact)
SHARD_EXACT = 16
#: queries per table row (in-flight count) :meth:`MemoryModel.sharded_starts` answers one by one rather than
#: building tables (more: whole tables, built once)
SHARD_DIRECT = 4


def mode_of(recompute: bool | str) -> str:
    """A recomputation mode from a mode name or a flag (True: full)."""
    return ("full" if recompute else "none") if isinstance(recompute, bool) else recompute


def partial_term(w: float, kk: int, rb: int, xin: float, T: float, H: float) -> float:
    """One moment's bytes of a partially recomputing stage (:meth:`MemoryModel.memory_at`): weights,
    gradients and state ``w``; ``kk`` microbatches in flight keep their inputs ``xin`` and tails
    ``T``; at a rebuild (``rb``) one of them holds its head ``H`` again (its tail still charged, as
    the stage's meter counts it; none in flight: the rebuilt one's input and head)."""
    if rb == 0:
        return w + kk * (xin + T)
    if kk == 0:
        return w + xin + H
    return w + kk * (xin + T) + H


def closed_starts(g: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Per end ``e``: the smallest ``s`` with ``g[i] <= c[e]`` for every ``i`` in ``s..e`` (``e + 1``: none);
    along the last axis, so one call answers a stack of rows (``g``, ``c`` of one shape).

    A stage's memory is not monotone in its start: what it receives across its first cut (``xin``)
    can outweigh the layers a later start drops (Llama's rotary tables and residual cross many cuts).
    The search reads a start as "every later start fits too" (a group clips its first stage to where
    the previous one ends), so the table keeps only starts whose every shorter suffix fits: a range
    maximum by binary lifting over a sparse table, vectorized over the ends."""
    N = g.shape[-1]
    levels = [g]
    while (1 << len(levels)) <= N:
        prev, half = levels[-1], 1 << (len(levels) - 1)
        levels.append(np.maximum(prev[..., :-half], prev[..., half:]))  # max of g[i .. i + 2^l - 1]
    rows = int(np.prod(c.shape[:-1], dtype=np.int64))
    s = np.broadcast_to(np.arange(1, N + 1, dtype=np.int64), (rows, N))
    c2 = c.reshape(rows, N)
    for lv in range(len(levels) - 1, -1, -1):
        L = levels[lv].shape[-1]
        flat = np.broadcast_to(levels[lv], c.shape[:-1] + (L,)).reshape(-1)
        cand = s - (1 << lv)
        vals = flat[np.clip(cand, 0, L - 1) + (np.arange(rows, dtype=np.int64) * L)[:, None]]
        s = np.where((cand >= 0) & (vals <= c2), cand, s)
    return s.reshape(c.shape)


#: table rows (in-flight counts) :meth:`MemoryModel.rows` computes in one vectorized block: about this many
#: elements per block (a block past the first row that fits nothing is work thrown away)
ROW_BLOCK_ELEMENTS = 1 << 17


class MemoryModel:
    """Stage memory of one chain under one schedule's policy, within ``budget`` bytes per worker
    (``on``: the limit holds; off: ``budget`` is inf). ``workers``: the cluster's, the most in
    flight the search asks about."""

    def __init__(self, arrays: ChainArrays, chain: Chain, policy: Any, *, optimizer_state_factor: float,
                 num_microbatches: int, workers: int, budget: float, on: bool,
                 microbatches_known: bool = False) -> None:
        self.chain = chain
        self.policy = policy
        self.opt_factor = float(optimizer_state_factor)
        self.M = num_microbatches
        #: a replica never holds more than its share of a step's microbatches in flight (the generator warms
        #: up with min(depth, its microbatches)): where the step is real (accumulating schedules, M known)
        self.cap = microbatches_known and not policy.update_per_microbatch
        self.workers = workers
        self.on = on
        self._budget = budget
        layers = chain.layers
        N = arrays.N
        inb, cut, o = arrays.inb, arrays.cut, arrays.o
        # per-microbatch activation bytes X(i..j) = PX[j+1] - PX[i] + xin[i] + xout[j]
        known = all(l.saved_bytes is not None for l in layers)
        sv = np.array([l.saved_bytes if known else l.output_bytes for l in layers], dtype=float)
        self.PX = cumsum0(sv)
        outb = np.append(np.where(np.isfinite(cut), cut, 0.0), o[-1])  # last stage: the loss keeps a copy of its input
        sin = np.zeros(N + 1)
        if known:
            sin = np.array([l.saved_input_bytes for l in layers] + [0.0])
            sout = np.array([l.saved_output_bytes for l in layers])
            self.xin = np.maximum(inb - sin, 0.0)
            self.xout = np.maximum(outb - sout, 0.0)
        else:  # PipeDream's profiles: the stage's outputs plus what it receives
            self.xin, self.xout = inb.copy(), np.zeros(N)
        # partial: a tail's first layer keeps what it saves that a head layer saved first (counted there);
        # as a bound nonincreasing in the head's end, the most any later layer keeps so (RS[q+1]: tail at q+1)
        rs = np.array([l.resaved_bytes for l in layers] + [0.0], dtype=float)
        self.RS = np.maximum.accumulate(rs[::-1])[::-1]
        # full recomputation keeps only the inputs and outputs, and rebuilds one microbatch at its backward
        self.xin_r, self.xout_r = inb.copy(), outb if known else np.zeros(N)
        if known:  # the first stage receives nothing; it keeps its data inputs, as its first layer saves them
            self.xin_r[0] = sin[0]
        # weights a stage holds: its own and copies of those an earlier layer uses too (tied)
        self.PWM = cumsum0(arrays.w + np.array([l.shared_param_bytes for l in layers], dtype=float))
        # selective recomputation: per layer what stays saved (SAC's cached outputs), the forward run again
        # and the saved bytes a rebuild makes
        # (what the cache keeps may include outputs autograd never saves; what a rebuild makes is the rest)
        sel = [(l.selective_saved_bytes, l.selective_recompute_s, l.selective_rebuilt_bytes) for l in layers]
        self.selective_known = known and all(None not in t for t in sel)
        ss, fs, rb = (np.array([t[x] for t in sel] if self.selective_known else [0.0] * N, dtype=float)
                      for x in range(3))
        #: per layer, the forward seconds selective recomputation runs again
        self.selective_s = fs
        self.PS = cumsum0(ss)
        zero = np.zeros(N + 1)
        #: per mode (not partial): (saved bytes kept per microbatch, rebuilt once; in, out)
        self.parts: dict[str, tuple[np.ndarray, ...]] = {
            "none": (self.PX, zero, self.xin, self.xout),
            "full": (zero, self.PX, self.xin_r, self.xout_r),
            "selective": (self.PS, cumsum0(rb), self.xin_r, self.xout_r),
        }
        self._tables: dict[str, np.ndarray] = {}
        self._stacks: dict[tuple[str, str], tuple[np.ndarray, np.ndarray]] = {}
        self._rows1: dict[tuple[str, str, int, int], np.ndarray] = {}  # _direct_row's

    @classmethod
    def of(cls, arrays: ChainArrays, chain: Chain, options: PlanOptions, *, workers: int, budget: float,
           on: bool) -> MemoryModel:
        """The memory model of ``options``' schedule, optimizer state and microbatches (none given: a step
        of one, in-flight counts not capped by it), built one way for the search and the simulator."""
        return cls(arrays, chain, schedule_registry.policy(options.schedule),
                   optimizer_state_factor=options.optimizer_state_factor,
                   num_microbatches=max(1, int(options.num_microbatches or 1)), workers=workers, budget=budget,
                   on=on, microbatches_known=options.step_microbatches is not None)

    def share_tables(self, other: MemoryModel) -> bool:
        """Read and fill ``other``'s tables from now on where both models rate the same chain arrays under
        the same schedule, optimizer state, microbatches, workers and budget (the pooled and the
        hierarchical search of one plan): one set built for both. Whether they were shared."""
        same = (self.chain is other.chain and self.policy is other.policy and self.opt_factor == other.opt_factor
                and self.M == other.M and self.cap == other.cap and self.workers == other.workers
                and self.on == other.on and self._budget == other._budget)
        if same:
            self._tables, self._stacks, self._rows1 = other._tables, other._stacks, other._rows1
        return same

    @property
    def budget(self) -> float:
        """Bytes per worker the stages must fit (inf when the limit is off)."""
        return self._budget

    @budget.setter
    def budget(self, value: float) -> None:
        self._budget = value
        self._tables = {}
        self._stacks = {}
        self._rows1 = {}

    def versions(self, k: int) -> int:
        """Weight versions a replica keeps with ``k`` workers at it and downstream per replica."""
        return self.policy.weight_versions((1,) * max(1, k), 0)

    def in_flight(self, depth: int, r: int) -> int:
        """Microbatches in flight on a replica of a stage of ``r`` replicas with ``depth`` =
        ceil(workers at and after it / r) (:meth:`Policy.in_flight`: GPipe holds its M / r), and with
        :attr:`cap` at most its ceil(M / r) microbatches of the step (flush: 32 per step on a stage 56 deep
        holds 32)."""
        k = self.policy.in_flight((r,) + (1,) * (r * (max(1, depth) - 1)), 0, self.M)
        return min(k, -(-self.M // max(1, r))) if self.cap else k

    def base(self, versions: int, shard: str = "none", replicas: int = 1) -> float:
        """Bytes per weight byte before the step's gradients exist: ``versions + f`` unsharded, else
        ``shard``'s over ``replicas`` (``sharding.weight_factors``)."""
        if shard == "none" or replicas <= 1:
            return versions + self.opt_factor
        return weight_factors(shard, replicas, versions, self.opt_factor)[0]

    @property
    def by_replicas(self) -> bool:
        """Whether a stage's bytes at an in-flight count depend on its replica count even unsharded
        (:meth:`whole_step` compares the count with a replica's share of a known step): its tables are
        then one per replica count (:meth:`rows`, :meth:`sharded_starts` with ``shard`` none)."""
        return self.cap and self.policy.version_lag == 0 and not self.policy.holds_step

    def whole_step(self, k: int, replicas: int = 1) -> bool:
        """Whether a replica of a stage of ``replicas`` replicas with ``k`` microbatches in flight holds
        all its microbatches of the step at once, so each of its forwards comes before its first backward
        and the step's gradients never meet a forward: GPipe always (``holds_step``); a schedule with one
        update per step on the step's own weights (flush, ZB-H1: ``version_lag`` 0, gradients freed at the
        step) where ``k`` reaches the replica's share ceil(M / ``replicas``) of a known step (flush at M no
        more than a stage's warm-up depth runs GPipe's actions, and is rated as GPipe is); never 1F1B or
        2BW, whose forwards run on into the next update."""
        pol = self.policy
        if pol.holds_step:
            return True
        return self.cap and pol.version_lag == 0 and k >= -(-self.M // max(1, replicas))

    def terms(self, k: int, depth: int | None = None, versions: int | None = None, shard: str = "none",
              replicas: int = 1, whole_step: bool | None = None) -> list[tuple[float, int, int]]:
        """(weight-bytes factor, microbatches of activations, rebuilds) of the moments that may
        peak: with an update per microbatch (1F1B) gradients live from a backward (where a rebuild
        happens) to its update, while the microbatch is no longer in flight; a replica that holds its
        whole step (:meth:`whole_step`, or as ``whole_step`` says) has none until its first backward
        frees one; else all step long (a schedule that may hold its whole step keeps the moment before
        its gradients too: every count has as many moments, which the tables stack). The weights'
        factor is ``shard``'s over ``replicas`` (``sharding.weight_factors``)."""
        v = self.base(self.versions(depth or k) if versions is None else versions, shard, replicas)
        if self.policy.update_per_microbatch:
            return [(v, k, 1), (v + 1, k - 1, 0)]
        if self.whole_step(k, replicas) if whole_step is None else whole_step:
            return [(v, k, 1), (v + 1, k - 1, 1)]
        if self.policy.holds_step or (self.cap and self.policy.version_lag == 0):
            return [(v, k, 1), (v + 1, k, 1)]
        return [(v + 1, k, 1)]

    def activations(self, i: int, j: int, recompute: bool | str = False) -> float:
        """Bytes a stage ``i..j`` keeps per microbatch in flight (full: its inputs and outputs only;
        selective: those and what stays saved; not for ``partial``, whose bytes depend on its head)."""
        PA, _, xin, xout = self.parts[mode_of(recompute)]
        return rng(PA, i, j) + float(xin[i] + xout[j])

    def memory(self, i: int, j: int, k: int, recompute: bool | str = False, depth: int | None = None,
               head: int = 0, shard: str = "none", replicas: int = 1) -> float:
        """Per-worker bytes of a stage ``i..j`` with ``k`` minibatches in flight: weights x versions
        (``depth``: the stage's warmup depth, default ``k``), gradients, optimizer state, ``k``
        microbatches' activations (with recomputation: what stays saved, and one microbatch
        rebuilt at its backward; ``head``: partial's recomputed layers); the weights' part as
        ``shard`` holds it over ``replicas``."""
        return self.memory_at(i, j, k, self.versions(depth or k), recompute, head=head, shard=shard,
                              replicas=replicas)

    def memory_at(self, i: int, j: int, k: int, versions: int, recompute: bool | str = False,
                  activation_scale: float = 1.0, head: int = 0, shard: str = "none", replicas: int = 1,
                  whole_step: bool | None = None) -> float:
        """Per-worker bytes of a stage ``i..j`` with ``k`` microbatches in flight and ``versions``
        weight versions (activations scaled by ``activation_scale``, e.g. another microbatch size).
        ``partial``: layers ``i..i+head-1`` run under checkpoint, the rest as usual. ``shard`` over
        ``replicas``: how the replicas hold weights, gradients and optimizer state (sharding.py).
        ``whole_step``: whether the replica holds its whole step (default :meth:`whole_step`)."""
        mode = mode_of(recompute)
        W = rng(self.PWM, i, j)
        s = activation_scale
        terms = self.terms(k, versions=versions, shard=shard, replicas=replicas, whole_step=whole_step)
        if mode == "partial":
            q = i + head - 1
            xin = float(self.xin_r[i]) * s
            T = (float(self.PX[j + 1] - self.PX[q + 1] + self.RS[q + 1]) + float(self.xout[j])) * s  # tail's, per microbatch
            H = float(self.PX[q + 1] - self.PX[i]) * s  # the head's, rebuilt at its backward
            Wt = rng(self.PWM, q + 1, j)  # the tail's weights: its gradients exist when the head is rebuilt
            v0 = self.base(versions, shard, replicas)
            return max(partial_term(W * cv + (Wt if rb and cv < v0 + 0.5 else 0.0), kk, rb, xin, T, H)
                       for cv, kk, rb in terms)
        X = self.activations(i, j, mode) * s
        R = rng(self.parts[mode][1], i, j) * s
        return max(W * cv + X * kk + R * rb for cv, kk, rb in terms)

    def sharded_starts(self, mode: str, shard: str, kin: np.ndarray, ends: np.ndarray, reps: np.ndarray) -> np.ndarray:
        """:meth:`rows`' smallest start for each (in flight ``kin``, ``ends``, ``reps`` replicas), a
        stage of several replicas held as ``shard``; vectorized over replica counts by one stack of the
        tables of their classes (exact up to :data:`SHARD_EXACT`, then the power of two below)."""
        kin, ends, reps = np.broadcast_arrays(kin, ends, np.maximum(reps, 1))
        cls = np.where(reps > SHARD_EXACT, 2 ** np.floor(np.log2(reps)).astype(np.int64), reps)
        key = (mode_of(mode), shard)
        slot_of, stack = self._stacks.get(key, (np.full(1, -1, dtype=np.int64), np.empty((0, 1, 0), dtype=np.int64)))
        top = int(cls.max()) if cls.size else 1
        if top >= len(slot_of):
            slot_of = np.concatenate([slot_of, np.full(top + 1 - len(slot_of), -1, dtype=np.int64)])
        missing = sorted_unique(cls[slot_of[cls] < 0]) if cls.size else cls
        # a table costs a pass over the chain per in-flight count; the search asks a few queries (where memory
        # clipped an unsharded start): those are answered one by one unless their tables are built already
        if len(missing) and kin.size <= SHARD_DIRECT * max(self.workers, self.M if self.policy.holds_step else 0):
            return self._sharded_direct(key[0], shard, kin.ravel(), ends.ravel(), cls.ravel()).reshape(kin.shape)
        if len(missing):
            tables = [stack[q] for q in range(len(stack))]
            tables += [self.rows(mode, shard, int(r)) for r in missing]
            H = max(len(t) for t in tables)
            stack = np.stack([np.concatenate([t, np.repeat(t[-1:], H - len(t), axis=0)]) for t in tables])
            slot_of[missing] = np.arange(len(tables) - len(missing), len(tables))
        self._stacks[key] = (slot_of, stack)
        return stack[slot_of[cls], np.minimum(kin, stack.shape[1] - 1), ends]

    def _moment(self, mode: str, cv: Any, kk: Any, rb: Any) -> tuple[np.ndarray, np.ndarray]:
        """One moment's memory of stages ``i..end`` under recompute ``mode`` as ``H[end] + g[i]`` (weights'
        factor ``cv``, ``kk`` microbatches of activations, ``rb`` rebuilds: :meth:`terms`); scalars, or
        columns for a stack of rows."""
        PA, PR, xin, xout = self.parts[mode]
        g = -(self.PWM * cv) - PA * kk - PR * rb + xin * kk
        H = self.PWM[1:] * cv + PA[1:] * kk + PR[1:] * rb + xout * kk
        return g, H

    def _sharded_direct(self, mode: str, shard: str, kin: np.ndarray, ends: np.ndarray,
                        reps: np.ndarray) -> np.ndarray:
        """:meth:`sharded_starts` for a few queries, each read off the row of its in-flight count and
        replica count (:meth:`_direct_row`) rather than whole tables (:meth:`rows`, a table per replica
        class costs ``kmax`` passes over the chain): the same arithmetic, so the same starts (past
        ``kmax`` in flight, or row 0, as the table reads)."""
        out = np.zeros(len(kin), dtype=np.int64)
        if not self.on:
            return out
        kmax = max(self.workers, self.M if self.policy.holds_step else 0)
        for q in range(len(kin)):
            k, e = int(kin[q]), int(ends[q])
            if k == 0:
                continue
            out[q] = self._direct_row(mode, shard, k, int(reps[q]))[e] if k <= kmax else e + 1
        return out

    #: rows :meth:`_direct_row` keeps at most (then it starts again): a few MiB on a chain of thousands of layers
    DIRECT_ROWS = 2048

    def _direct_row(self, mode: str, shard: str, k: int, replicas: int) -> np.ndarray:
        """Per end, the smallest start of a stage with ``k`` in flight, ``replicas`` replicas held as ``shard``,
        whose every moment fits (one row of :meth:`rows`' table for that replica count, the same
        arithmetic): built once for every end by a range maximum, so that the many queries of one count
        cost one pass over the chain, not one each."""
        key = (mode, shard, k, replicas)
        row = self._rows1.get(key)
        if row is None:
            N = len(self.PX) - 1
            budget = self.budget * (1 + EPS)
            row = np.zeros(N, dtype=np.int64)
            for cv, kk, rb in self.terms(k, shard=shard, replicas=replicas):  # as rows(): every moment must fit
                g, H = self._moment(mode, cv, kk, rb)
                row = np.maximum(row, closed_starts(g[:N], budget - H))
            row = np.minimum(row, np.arange(1, N + 1))
            if len(self._rows1) >= self.DIRECT_ROWS:
                self._rows1.clear()
            self._rows1[key] = row
        return row

    def max_in_flight(self, i: int, j: int) -> int:
        """The largest in-flight count whose memory (:meth:`memory`, nondecreasing in it) fits
        (0: not even one); the ILP's memory constraint reads it, so both solvers see one model."""
        top = self.workers + 1
        if not self.on:
            return top
        budget = self.budget * (1 + EPS)
        lo, hi = 0, top  # memory(lo) fits (lo = 0: nothing needed), the answer is in lo..hi
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.memory(i, j, mid) <= budget:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def rows(self, mode: bool | str = "none", shard: str = "none", replicas: int = 1) -> np.ndarray:
        """``T[k, end]``: smallest start of a stage ending at ``end`` whose memory under recompute
        ``mode`` (not partial: ``decisions.PartialTable``) with ``k`` minibatches in flight fits (row 0:
        no limit; the last row: nothing fits). Weight versions are taken at depth ``k`` (a schedule
        whose in-flight count differs from its depth, GPipe, keeps versions that do not grow with it).
        ``shard`` over ``replicas``: the weights' part as :meth:`terms` holds it, and a replica's share of
        the step (:meth:`whole_step`, where :attr:`by_replicas`): a table each."""
        mode = mode_of(mode)
        key = mode if replicas <= 1 or (shard == "none" and not self.by_replicas) else f"{mode}/{shard}/{replicas}"
        cached = self._tables.get(key)
        if cached is not None:
            return cached
        N = len(self.PX) - 1
        ends = np.arange(N)
        rows = [np.zeros(N, dtype=np.int64)]
        if self.on:
            kmax = max(self.workers, self.M if self.policy.holds_step else 0)
            budget = self.budget * (1 + EPS)
            block = max(1, min(64, ROW_BLOCK_ELEMENTS // max(1, N)))
            k0 = 1
            while k0 <= kmax:
                ks = range(k0, min(kmax, k0 + block - 1) + 1)
                terms = [self.terms(k, shard=shard, replicas=replicas) for k in ks]  # every moment that may peak must fit
                start = np.zeros((len(ks), N), dtype=np.int64)
                for t in range(len(terms[0])):
                    cv, kk, rb = (np.array([[tk[t][x]] for tk in terms]) for x in range(3))
                    g, H = self._moment(mode, cv, kk, rb)  # mem(i..end) = H(end) + g(i)
                    start = np.maximum(start, closed_starts(g[:, :N], budget - H))
                start = np.minimum(start, ends + 1)
                full = np.flatnonzero(np.all(start > ends, axis=1))  # from the first row that fits nothing: done
                rows.extend(start[: int(full[0]) + 1 if len(full) else len(ks)])
                if len(full):
                    break
                k0 += len(ks)
        rows.append(np.arange(1, N + 1, dtype=np.int64))
        table = np.stack(rows)
        self._tables[key] = table
        return table
