"""PipeDream's planner as a dynamic program (used by the ``partition`` pass): stages, replicas and ranks
that make the slowest part of the pipeline as fast as possible.

The design in full: :func:`partition_dp`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Any, Iterable, Sequence

import numpy as np

from pdcompile.cluster import ClusterSpec, Level, format_quantity, require_memory
from pdcompile.errors import InfeasiblePlanError, UsageError
from pdcompile.ir import Chain
from pdcompile.plan import Plan, StagePlan
from pdcompile.runtime.schedules import registry as schedule_registry

__all__ = [
    "COST_MODELS",
    "SCHEDULES",
    "Block",
    "Evaluation",
    "StageCost",
    "partition_dp",
    "pipeline_plan",
    "pipeline_time",
    "stage_time",
    "stage_memory",
    "stage_memory_at",
    "pool_cluster",
    "data_parallel_time",
    "evaluate",
    "plan_from_assignment",
    "blocks_from_ranks",
    "flatten_blocks",
]

COST_MODELS = ("default", "paper", "pipedream")
SCHEDULES = tuple(schedule_registry.SCHEDULES)  # memory from each one's Policy (weight versions, in flight)
RECOMPUTE = ("none", "selective", "full", "auto")  # never, every stage (cheap ops / whole forward), where memory needs it
#: What a stage may recompute (``StageCost.recompute``): nothing; its cheap ops (selective, the layers'
#: ``selective_*`` costs); its first layers (partial: the fewest that fit); its whole forward (full).
MODES = ("none", "selective", "partial", "full")
_PARTIAL_EXACT = 16  # in-flight counts the partial-recomputation search takes exactly (above: rounded up)
_EPS = 1e-10  # relative slack in feasibility tests (floating sums); plans are re-evaluated exactly
_BIG = np.iinfo(np.int64).max // 4


# ---------------------------------------------------------------------------------------------
# Configurations: a tree of blocks, one pipeline per level.
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Block:
    """A stage at some level: chain positions ``first..last`` replicated over ``units`` units of
    the level below; ``inner`` is the pipeline each unit runs (empty at the innermost level,
    whose units are workers)."""

    first: int
    last: int
    units: int
    inner: tuple["Block", ...] = ()


def flatten_blocks(blocks: Sequence[Block], cluster: ClusterSpec) -> list[tuple[int, int, tuple[int, ...]]]:
    """The worker-level stages of a block tree with their ranks: ``(first, last, ranks)``.

    Top-level blocks take consecutive units in order; inside a unit the inner pipeline does the
    same; ranks are innermost-first (``rank = sum index_k * unit_size(k)``).
    """
    top = len(cluster.levels)

    def rec(bs: Sequence[Block], level: int) -> list[tuple[int, int, list[int]]]:
        size = cluster.unit_size(level - 1)
        out: list[tuple[int, int, list[int]]] = []
        u = 0
        for b in bs:
            if level == 1:
                out.append((b.first, b.last, list(range(u, u + b.units))))
            else:
                for first, last, rel in rec(b.inner, level - 1):
                    ranks = [(u + g) * size + x for g in range(b.units) for x in rel]
                    out.append((first, last, sorted(ranks)))
            u += b.units
        return out

    return [(f, l, tuple(r)) for f, l, r in rec(blocks, top)]


def blocks_from_ranks(stages: Sequence[tuple[int, int, Sequence[int]]], cluster: ClusterSpec) -> tuple[Block, ...]:
    """Rebuild the block tree from worker-level stages and their ranks.

    At each level, consecutive stages that occupy the same set of units form one block; a
    stage's ranks must be the same positions in each of those units. Raises ValueError when the
    ranks don't nest in the cluster's levels (e.g. a stage spread over one and a half servers).
    """

    def rec(sts: list[tuple[int, int, list[int]]], level: int) -> tuple[Block, ...]:
        if level == 1:
            for f, l, r in sts:
                if len(set(r)) != len(r):
                    raise ValueError(f"stage {f}..{l} lists a rank twice")
            return tuple(Block(f, l, len(r)) for f, l, r in sts)
        size = cluster.unit_size(level - 1)
        groups: list[tuple[frozenset[int], list[tuple[int, int, list[int]]]]] = []
        for f, l, r in sts:
            units = frozenset(x // size for x in r)
            rel_sets = {u: sorted(x % size for x in r if x // size == u) for u in units}
            rels = list(rel_sets.values())
            if any(rel != rels[0] for rel in rels):
                raise ValueError(
                    f"stage {f}..{l}: its ranks {sorted(r)} are not the same positions in each "
                    f"unit of level {cluster.levels[level - 1].name!r}"
                )
            if groups and groups[-1][0] == units:
                groups[-1][1].append((f, l, rels[0]))
            else:
                if any(units & g for g, _ in groups):
                    raise ValueError(f"stage {f}..{l} shares units with a non-adjacent stage")
                groups.append((units, [(f, l, rels[0])]))
        out = []
        for units, inner in groups:
            out.append(Block(inner[0][0], inner[-1][1], len(units), rec(inner, level - 1)))
        return tuple(out)

    sts = [(int(f), int(l), sorted(int(x) for x in r)) for f, l, r in stages]
    m = cluster.num_workers
    for f, l, r in sts:
        if not r:
            raise ValueError(f"stage {f}..{l} has no ranks")
        if r[0] < 0 or r[-1] >= m:
            raise ValueError(f"stage {f}..{l}: ranks must be in 0..{m - 1}")
    return rec(sts, len(cluster.levels))


# ---------------------------------------------------------------------------------------------
# The cost model over arrays
# ---------------------------------------------------------------------------------------------


def _cumsum0(x: np.ndarray) -> np.ndarray:
    out = np.zeros(len(x) + 1)
    np.cumsum(x, out=out[1:])
    return out


@dataclass(frozen=True)
class StageCost:
    """One worker-level stage as the cost model sees it (see :class:`pdcompile.plan.StagePlan`)."""

    first: int
    last: int
    ranks: tuple[int, ...]
    compute_s: float
    comm_s: float
    time_s: float
    send_s: float
    memory_bytes: float
    in_flight: int
    weight_versions: int
    recompute: str = "none"  # one of MODES
    recompute_layers: int = 0  # layers whose forward runs again (partial: the stage's first ones; full: all)


@dataclass(frozen=True)
class Evaluation:
    """A configuration's predicted cost: ``seconds`` per minibatch (the max of ``terms``),
    ``terms`` as (what, seconds) — stages, links, weight syncs — with the ``bottleneck`` named,
    and every worker-level stage's costs."""

    seconds: float
    bottleneck: str
    terms: tuple[tuple[str, float], ...]
    stages: tuple[StageCost, ...]
    peak_memory: float


class PlanModel:
    """Arrays and parameters of one planning problem (chain x cluster x cost model)."""

    #: Bytes of partial recomputation's rows kept at most (then built again as asked).
    partial_store_bytes = 2**28
    #: One-query searches (the top level, rebuilds) by breakpoints (:meth:`_group_start_one`);
    #: off: the vectorized search for them too. Both off switches are the tests' reference.
    breakpoint_search = True
    #: The vectorized search tries, at step ``w``, every downstream count ``d <= w - r`` (on: the
    #: unpruned search; off: ``d = w - r`` only, which finds the same, see :meth:`_group_start`).
    exhaustive_pairs = False

    def __init__(
        self,
        chain: Chain,
        cluster: ClusterSpec,
        cost_model: str = "default",
        schedule: str = "1f1b",
        memory_limit: bool | None = None,
        optimizer_state_factor: float = 1.0,
        allow_replication: bool = True,
        num_microbatches: int = 1,
        recompute: str = "none",
    ) -> None:
        if recompute not in RECOMPUTE:
            raise UsageError(f"unknown recompute {recompute!r} (use one of {', '.join(RECOMPUTE)})")
        if cost_model not in COST_MODELS:
            raise UsageError(f"unknown cost model {cost_model!r} (use one of {', '.join(COST_MODELS)})")
        if schedule not in SCHEDULES:
            raise UsageError(f"unknown schedule {schedule!r} (use one of {', '.join(SCHEDULES)})")
        if len(chain) == 0:
            raise UsageError("the chain has no layers: nothing to plan")
        if optimizer_state_factor < 0:
            raise UsageError(f"optimizer_state_factor must be >= 0 (got {optimizer_state_factor})")
        if cost_model == "pipedream" and memory_limit:
            raise UsageError("the pipedream cost model reproduces PipeDream's released optimizer, which plans without "
                             "a memory limit by default; use cost_model='default' (or 'paper') with memory_limit=True")
        self.chain = chain
        self.cluster = cluster
        self.cost_model = cost_model
        self.schedule = schedule
        self.policy = schedule_registry.policy(schedule)
        self.M = max(1, int(num_microbatches))
        self.recompute = recompute if cost_model != "pipedream" else "none"
        self.opt_factor = float(optimizer_state_factor)
        self.allow_replication = allow_replication
        self.memory_on = (cost_model == "default") if memory_limit is None else bool(memory_limit)
        self.mem_budget = require_memory(cluster) if self.memory_on else math.inf

        layers = chain.layers
        self.N = N = len(layers)
        f = np.array([l.forward_s for l in layers], dtype=float)
        bw = np.array([l.backward_s for l in layers], dtype=float)
        w = np.array([l.param_bytes for l in layers], dtype=float)
        o = np.array([l.output_bytes for l in layers], dtype=float)
        for name, arr in (("forward_s", f), ("backward_s", bw), ("param_bytes", w), ("output_bytes", o)):
            bad = np.flatnonzero(~np.isfinite(arr) | (arr < 0))
            if len(bad):
                k = int(bad[0])
                raise UsageError(f"layer {k} ({layers[k].name}): {name} must be finite and >= 0 (got {arr[k]})")
        cut = np.array(chain.cut_bytes, dtype=float)
        if np.any(np.isnan(cut)) or np.any(cut < 0):
            raise UsageError("cut_bytes must be >= 0 (math.inf for a forbidden cut)")
        self.f, self.bw, self.c, self.w, self.o, self.cut = f, bw, f + bw, w, o, cut

        self.L = len(cluster.levels)
        self.counts = [lv.count for lv in cluster.levels]
        self.B = [float(lv.bandwidth) for lv in cluster.levels]
        self.sizes = [cluster.unit_size(k) for k in range(self.L + 1)]
        mb = cluster.device.memory_bandwidth
        self.kappa = (3.0 + 2.0 * self.opt_factor) / mb if (cost_model == "default" and mb) else 0.0

        self.PC = _cumsum0(self.c)
        self.PF = _cumsum0(f)
        self.PW = _cumsum0(w)
        self.PO = _cumsum0(o)
        self.P1 = _cumsum0(self.c + self.kappa * w)  # default: F + Bw + OPT
        # default level 1, r replicas: F + AR_r + OPT with AR_r = 2 (r-1)/(r B1) W
        m1 = self.counts[0]
        self.P2 = np.stack([_cumsum0(f + self._alpha(r) * w) for r in range(m1 + 1)])
        # rows offset so that the whole array is sorted: one searchsorted serves every r
        span = 2.0 * float(self.P2[:, -1].max()) or 1.0  # relative, so tiny times keep their precision
        self.P2flat = (self.P2 + span * np.arange(m1 + 1)[:, None]).ravel()
        # bytes received by a stage starting at i (monotone envelope of cut_bytes[i-1])
        inb = np.zeros(N + 1)
        for i in range(1, N):
            inb[i] = min(cut[i - 1], inb[i - 1] + o[i - 1])
        self.inb = inb
        # per-microbatch activation bytes X(i..j) = PX[j+1] - PX[i] + xin[i] + xout[j] (module doc)
        known = all(l.saved_bytes is not None for l in layers)
        sv = np.array([l.saved_bytes if known else l.output_bytes for l in layers], dtype=float)
        self.PX = _cumsum0(sv)
        outb = np.append(np.where(np.isfinite(cut), cut, 0.0), o[-1])  # last stage: the loss keeps a copy of its input
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
        self.PWM = _cumsum0(w + np.array([l.shared_param_bytes for l in layers], dtype=float))
        self.P1r = _cumsum0(self.c + f + self.kappa * w)
        self.PCr = _cumsum0(self.c + f)
        # selective recomputation: per layer what stays saved (SAC's cached outputs), the forward run again
        # and the saved bytes a rebuild makes
        # (what the cache keeps may include outputs autograd never saves; what a rebuild makes is the rest)
        sel = [(l.selective_saved_bytes, l.selective_recompute_s, l.selective_rebuilt_bytes) for l in layers]
        self.selective_known = known and all(None not in t for t in sel)
        ss, fs, rs = (np.array([t[x] for t in sel] if self.selective_known else [0.0] * N, dtype=float)
                      for x in range(3))
        self.PS = _cumsum0(ss)
        zero = np.zeros(N + 1)
        # per mode: (time prefix sums default, paper; saved bytes kept per microbatch, rebuilt once; in, out)
        self._arr: dict[str, tuple[np.ndarray, ...]] = {
            "none": (self.P1, self.PC, self.PX, zero, self.xin, self.xout),
            "full": (self.P1r, self.PCr, zero, self.PX, self.xin_r, self.xout_r),
            "selective": (_cumsum0(self.c + fs + self.kappa * w), _cumsum0(self.c + fs), self.PS,
                          _cumsum0(rs), self.xin_r, self.xout_r),
        }
        if recompute == "selective" and not self.selective_known and cost_model != "pipedream":
            raise UsageError("recompute='selective' needs each layer's selective costs (what stays saved when cheap "
                             "ops are rebuilt), which this chain lacks (profiles imported from PipeDream have none); "
                             "use recompute='full' or 'auto'")
        # the modes the search may give a stage
        self.modes: tuple[str, ...] = {"none": ("none",), "selective": ("selective",), "full": ("full",)}.get(
            self.recompute, ("none",) + (("selective",) if self.selective_known else ()) + ("partial", "full"))
        if self.recompute == "auto" and not self.memory_on:
            self.modes = ("none",)  # recomputation only where memory needs it
        # partial recomputation's rows, built on demand: (k, end) -> row of _pstore, for _pindex_budget
        self._pstore = np.empty((0, N + 1))
        self._pindex: dict[tuple[int, int], int] = {}
        self._pindex_budget: float | None = None
        self._pused = 0
        # the compute terms the threshold bounds (the stage's own time without its weight sync)
        self.PT = self.PC if cost_model == "paper" else self.P1
        self._partial_cap = 2.0 * float(self.PT[-1] + self.PF[-1]) or 1.0  # above any time; relative: tiny ones keep precision
        self._partial_k: tuple[float, int] | None = None  # (budget, _partial_kmax)
        # boundary thresholds per level: 2 a / B_k (inf: forbidden cut)
        self.tcut = [2.0 * cut / b for b in self.B]
        self._mem_tables: dict[str, np.ndarray] = {}
        self._tau: float | None = None
        self._nxt: dict[int, np.ndarray] = {}
        self._pair_cache: dict[tuple[int, int, bool, bool], tuple[np.ndarray, np.ndarray]] = {}

    # -- scalar pieces of the model ------------------------------------------------------------
    def _alpha(self, r: int) -> float:
        return 2.0 * (r - 1) / (r * self.B[0]) + self.kappa if r >= 1 else 0.0

    def versions(self, k: int) -> int:
        """Weight versions a replica keeps with ``k`` workers at it and downstream per replica."""
        return self.policy.weight_versions((1,) * max(1, k), 0)

    def in_flight(self, depth: int, r: int) -> int:
        """Microbatches in flight on a replica of a stage of ``r`` replicas with ``depth`` =
        ceil(workers at and after it / r) (:meth:`Policy.in_flight`: GPipe holds its M / r)."""
        return self.policy.in_flight((r,) + (1,) * (r * (max(1, depth) - 1)), 0, self.M)

    def rng(self, P: np.ndarray, i: int, j: int) -> float:
        return float(P[j + 1] - P[i])

    @staticmethod
    def _mode(recompute: bool | str) -> str:
        return ("full" if recompute else "none") if isinstance(recompute, bool) else recompute

    def activations(self, i: int, j: int, recompute: bool | str = False) -> float:
        """Bytes a stage ``i..j`` keeps per microbatch in flight (full: its inputs and outputs only;
        selective: those and what stays saved; not for ``partial``, whose bytes depend on its head)."""
        _, _, PA, _, xin, xout = self._arr[self._mode(recompute)]
        return self.rng(PA, i, j) + float(xin[i] + xout[j])

    def memory(self, i: int, j: int, k: int, recompute: bool | str = False, depth: int | None = None,
               head: int = 0) -> float:
        """Per-worker bytes of a stage ``i..j`` with ``k`` minibatches in flight: weights x versions
        (``depth``: the stage's warmup depth, default ``k``), gradients, optimizer state, ``k``
        microbatches' activations (with recomputation: what stays saved, and one microbatch
        rebuilt at its backward; ``head``: partial's recomputed layers)."""
        return self.memory_at(i, j, k, self.versions(depth or k), recompute, head=head)

    def memory_at(self, i: int, j: int, k: int, versions: int, recompute: bool | str = False,
                  activation_scale: float = 1.0, head: int = 0) -> float:
        """Per-worker bytes of a stage ``i..j`` with ``k`` microbatches in flight and ``versions``
        weight versions (activations scaled by ``activation_scale``, e.g. another microbatch size).
        ``partial``: layers ``i..i+head-1`` run under checkpoint, the rest as usual."""
        mode = self._mode(recompute)
        W = self.rng(self.PWM, i, j)
        s = activation_scale
        if mode == "partial":
            q = i + head - 1
            xin = float(self.xin_r[i]) * s
            T = (float(self.PX[j + 1] - self.PX[q + 1] + self.RS[q + 1]) + float(self.xout[j])) * s  # tail's, per microbatch
            H = float(self.PX[q + 1] - self.PX[i]) * s  # the head's, rebuilt at its backward
            Wt = self.rng(self.PWM, q + 1, j)  # the tail's weights: its gradients exist when the head is rebuilt
            v0 = versions + self.opt_factor
            return max(_partial_term(W * cv + (Wt if rb and cv < v0 + 0.5 else 0.0), kk, rb, xin, T, H)
                       for cv, kk, rb in self._memory_terms(k, versions=versions))
        X = self.activations(i, j, mode) * s
        R = self.rng(self._arr[mode][3], i, j) * s
        return max(W * cv + X * kk + R * rb for cv, kk, rb in self._memory_terms(k, versions=versions))

    def recompute_s(self, i: int, j: int, mode: str, head: int = 0) -> float:
        """Forward seconds a stage ``i..j`` runs again in its backward under ``mode``."""
        if mode == "full":
            return self.rng(self.PF, i, j)
        if mode == "partial":
            return self.rng(self.PF, i, i + head - 1)
        if mode == "selective":
            return self.rng(self._arr["selective"][1], i, j) - self.rng(self.PC, i, j)
        return 0.0

    def choose_recompute(self, i: int, j: int, k: int, depth: int | None = None, *, versions: int | None = None,
                         activation_scale: float = 1.0) -> tuple[str, int]:
        """(mode, recomputed layers) of a stage ``i..j`` with ``k`` in flight: the allowed mode that
        fits the memory limit with the least forward run again (partial: its fewest first layers);
        none fitting, the one that needs least memory. ``versions`` and ``activation_scale`` as for
        :meth:`memory_at` (the simulator's counts; default the planner's at ``depth``)."""
        budget = self.mem_budget * (1 + _EPS)
        if self.recompute != "auto" or not self.memory_on:
            mode = self.modes[0]
            return mode, (j - i + 1 if mode == "full" else 0)
        v = self.versions(depth or k) if versions is None else versions
        best: tuple[float, float, str, int] | None = None  # (extra time, memory, mode, head)
        least: tuple[float, str, int] | None = None
        for mode in self.modes:
            heads = range(1, j - i + 1) if mode == "partial" else (j - i + 1 if mode == "full" else 0,)
            for h in heads:
                mem = self.memory_at(i, j, k, v, mode, activation_scale, head=h)
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

    def _memory_terms(self, k: int, depth: int | None = None, versions: int | None = None) -> list[tuple[float, int, int]]:
        """(weight-bytes factor, microbatches of activations, rebuilds) of the moments that may
        peak: with an update per microbatch (1F1B) gradients live from a backward (where a rebuild
        happens) to its update, while the microbatch is no longer in flight; a schedule that holds
        the step (GPipe) has none until its first backward frees one; else all step long."""
        v = (self.versions(depth or k) if versions is None else versions) + self.opt_factor
        if self.policy.update_per_microbatch:
            return [(v, k, 1), (v + 1, k - 1, 0)]
        if self.policy.holds_step:
            return [(v, k, 1), (v + 1, k - 1, 1)]
        return [(v + 1, k, 1)]

    def max_in_flight(self, i: int, j: int) -> int:
        """The largest in-flight count whose memory (:meth:`memory`, nondecreasing in it) fits
        (0: not even one); the ILP's memory constraint reads it, so both solvers see one model."""
        top = self.sizes[-1] + 1
        if not self.memory_on:
            return top
        budget = self.mem_budget * (1 + _EPS)
        lo, hi = 0, top  # memory(lo) fits (lo = 0: nothing needed), the answer is in lo..hi
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.memory(i, j, mid) <= budget:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def level1_stage(self, i: int, j: int, r: int, recompute: bool | str = False, head: int = 0) -> tuple[float, float]:
        """(stage time per minibatch, its weight-sync part) of a level-1 stage (recompute: what the
        mode runs again in the backward, :meth:`recompute_s`)."""
        W = self.rng(self.PW, i, j)
        again = self.recompute_s(i, j, self._mode(recompute), head)
        if self.cost_model == "paper":
            C = self.rng(self.PC, i, j) + again
            comm = 2.0 * (r - 1) * W / self.B[0]
            return max(C, comm) / r, comm / r
        if self.cost_model == "pipedream":
            comm = (4.0 * (r - 1) * W) / (self.B[0] * r)
            return (self.rng(self.PC, i, j) + comm) / r, comm / r
        F = self.rng(self.PF, i, j)
        Bw = self.rng(self.PC, i, j) - F + again
        ar = 2.0 * (r - 1) * W / (r * self.B[0])
        return (F + max(Bw, ar) + self.kappa * W) / r, ar / r

    def outer_comm(self, i: int, j: int, r: int, level: int) -> float:
        """The weight-sync term of a level-``level`` (1-based, >= 2) block, per minibatch."""
        W = self.rng(self.PW, i, j)
        B = self.B[level - 1]
        if self.cost_model == "paper":
            return 2.0 * (r - 1) * W / B / r
        return 2.0 * (r - 1) * W / (r * B) / r

    # -- evaluation of a block tree -------------------------------------------------------------
    def evaluate(self, blocks: Sequence[Block]) -> Evaluation:
        if self.cost_model == "pipedream":
            return self._evaluate_pipedream(blocks)
        terms: list[tuple[str, float]] = []
        stages: list[StageCost] = []
        flat = flatten_blocks(blocks, self.cluster)
        names = self.chain.layers

        def rec(bs: Sequence[Block], level: int, scale: Fraction, e: Fraction) -> None:
            for p, b in enumerate(bs):
                d_after = sum(x.units for x in bs[p + 1:])
                if level == 1:
                    depth = math.ceil((b.units + d_after + e) / b.units)
                    k = self.in_flight(depth, b.units)
                    mode, head = self.choose_recompute(b.first, b.last, k, depth)
                    t, comm = self.level1_stage(b.first, b.last, b.units, mode, head)
                    terms.append((f"stage {len(stages)} ({_span(names, b.first, b.last)})", float(t * scale)))
                    compute = self.rng(self.PC, b.first, b.last) + self.recompute_s(b.first, b.last, mode, head)
                    stages.append(StageCost(
                        b.first, b.last, flat[len(stages)][2],
                        compute_s=float(compute / b.units * scale),
                        comm_s=float(comm * scale), time_s=float(t * scale), send_s=0.0,
                        memory_bytes=self.memory(b.first, b.last, k, mode, depth, head), in_flight=k,
                        weight_versions=self.versions(depth), recompute=mode,
                        recompute_layers=head if mode == "partial" else (b.last - b.first + 1 if mode == "full" else 0),
                    ))
                else:
                    first_stage = len(stages)
                    rec(b.inner, level - 1, scale / b.units, (e + d_after * self.sizes[level - 1]) / b.units)
                    comm = float(self.outer_comm(b.first, b.last, b.units, level) * scale)
                    if b.units > 1:
                        lvname = self.cluster.levels[level - 1].name
                        terms.append((f"weight sync of stages {first_stage}-{len(stages) - 1} across "
                                      f"{b.units} {lvname}", comm))
                    for q in range(first_stage, len(stages)):
                        stages[q] = replace(stages[q], comm_s=max(stages[q].comm_s, comm))
                if p + 1 < len(bs):
                    a = float(self.cut[b.last])
                    tl = float(2.0 * a / self.B[level - 1] * scale) if a > 0 else 0.0
                    idx = len(stages) - 1
                    terms.append((f"link {idx}->{idx + 1} ({self.cluster.levels[level - 1].name}, "
                                  f"{format_quantity(a, 'memory')})", tl))
                    stages[idx] = replace(stages[idx], send_s=tl)

        rec(blocks, self.L, Fraction(1), Fraction(0))
        seconds = max((t for _, t in terms), default=0.0)
        bottleneck = max(terms, key=lambda kv: kv[1])[0] if terms else ""
        peak = max((s.memory_bytes for s in stages), default=0.0)
        return Evaluation(seconds, bottleneck, tuple(terms), tuple(stages), peak)

    def _pd_nmw(self, level: int) -> int:
        """The released optimizer's ``num_machines_within_machine`` at ``level``: the count of the
        level just below (not the product of all levels below), 1 at the innermost level."""
        return self.counts[level - 2] if level > 1 else 1

    def _evaluate_pipedream(self, blocks: Sequence[Block]) -> Evaluation:
        """A block tree under the released optimizer's recursion (module doc, ``pipedream``).

        A level-``k`` block's time is ``(X + comm) / r``, ``X`` the max of its inner terms, so every
        inner term is carried up as ``(v + comm) / r``: the max of the flat terms is the cost."""
        flat = flatten_blocks(blocks, self.cluster)
        names = self.chain.layers
        last_pos = self.N - 1
        # entries: [name, value, stage index or -1, stage whose send it is or -1, compute, comm]
        stage_info: list[tuple[int, int, int, float]] = []  # first, last, in-flight, memory

        def rec(bs: Sequence[Block], level: int, e: Fraction) -> list[list[Any]]:
            B = self.B[level - 1]
            lvname = self.cluster.levels[level - 1].name
            out: list[list[Any]] = []
            ends: list[int] = []  # index of the last worker stage of each block
            for p, b in enumerate(bs):
                r = b.units
                d_after = sum(x.units for x in bs[p + 1:])
                comm = (4.0 * (r - 1) * self.rng(self.PW, b.first, b.last)) / (B * r)
                if p == 0:
                    comm /= self._pd_nmw(level)
                if level == 1:
                    C = self.rng(self.PC, b.first, b.last)
                    k = math.ceil((b.units + d_after + e) / b.units)
                    q = len(stage_info)
                    stage_info.append((b.first, b.last, k, self.memory(b.first, b.last, k)))
                    out.append([f"stage {q} ({_span(names, b.first, b.last)})", (C + comm) / r, q, -1, C / r, comm / r])
                else:
                    for ent in rec(b.inner, level - 1, (e + d_after * self.sizes[level - 1]) / b.units):
                        ent[1] = (ent[1] + comm) / r
                        if ent[2] >= 0:
                            ent[4], ent[5] = ent[4] / r, ent[5] / r + comm / r
                        out.append(ent)
                ends.append(len(stage_info) - 1)
                if p >= 1:  # a block after a split: its input (and its output, unless the chain ends)
                    a_in = float(self.cut[bs[p - 1].last])
                    q = ends[p - 1]
                    out.append([f"link {q}->{q + 1} ({lvname}, {format_quantity(a_in, 'memory')})",
                                (2.0 * a_in) / (B * r), -1, q, 0.0, 0.0])
                    if b.last < last_pos:
                        a_out = float(self.cut[b.last])
                        q = ends[p]
                        out.append([f"link {q}->{q + 1} ({lvname}, {format_quantity(a_out, 'memory')}, "
                                    f"as the output of block {b.first}..{b.last})", (2.0 * a_out) / (B * r),
                                    -1, q, 0.0, 0.0])
            return out

        entries = rec(blocks, self.L, Fraction(0))
        terms = tuple((str(ent[0]), float(ent[1])) for ent in entries)
        stages: list[StageCost] = []
        for q, (first, last, k, mem) in enumerate(stage_info):
            (st,) = [ent for ent in entries if ent[2] == q]
            sends = [float(ent[1]) for ent in entries if ent[3] == q]
            stages.append(StageCost(first, last, flat[q][2], compute_s=float(st[4]), comm_s=float(st[5]),
                                    time_s=float(st[1]), send_s=max(sends, default=0.0), memory_bytes=mem,
                                    in_flight=k, weight_versions=self.versions(k)))
        seconds = max((t for _, t in terms), default=0.0)
        bottleneck = max(terms, key=lambda kv: kv[1])[0] if terms else ""
        peak = max((s.memory_bytes for s in stages), default=0.0)
        return Evaluation(seconds, bottleneck, terms, tuple(stages), peak)

    def data_parallel_time(self) -> float:
        """One stage of all layers replicated over every unit of every level."""
        n = self.N - 1
        if self.cost_model == "pipedream":  # the released optimizer's own baseline
            t, W = self.rng(self.PC, 0, n), self.rng(self.PW, 0, n)
            for level in range(1, self.L + 1):
                m = self.counts[level - 1]
                t = (t + (4.0 * (m - 1) * W) / (self.B[level - 1] * m) / self._pd_nmw(level)) / m
            return t
        t, _ = self.level1_stage(0, n, self.counts[0])
        for level in range(2, self.L + 1):
            r = self.counts[level - 1]
            t = max(t / r, self.outer_comm(0, n, r, level))
        return t

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
            ok[:, 1:N] = finite & (self.tcut[level - 1][None, :] <= mults * tau * (1 + _EPS))
            idx = np.where(ok, np.arange(N + 1), N)
            self._nxt[level] = np.minimum.accumulate(idx[:, ::-1], axis=1)[:, ::-1]

    def _mem_rows(self, mode: bool | str = "none") -> np.ndarray:
        """``T[k, end]``: smallest start of a stage ending at ``end`` whose memory under recompute
        ``mode`` (not partial, :meth:`_partial_rows`) with ``k`` minibatches in flight fits (row 0:
        no limit; the last row: nothing fits). Weight versions are taken at depth ``k`` (a schedule
        whose in-flight count differs from its depth, GPipe, keeps versions that do not grow with it)."""
        mode = self._mode(mode)
        cached = self._mem_tables.get(mode)
        if cached is not None:
            return cached
        N = self.N
        ends = np.arange(N)
        rows = [np.zeros(N, dtype=np.int64)]
        if self.memory_on:
            kmax = max(self.sizes[-1], self.M if self.policy.holds_step else 0)
            budget = self.mem_budget * (1 + _EPS)
            _, _, PA, PR, xin, xout = self._arr[mode]
            for k in range(1, kmax + 1):
                start = np.zeros(N, dtype=np.int64)
                for cv, kk, rb in self._memory_terms(k):  # every moment that may peak must fit
                    g = -(self.PWM * cv) - PA * kk - PR * rb + xin * kk  # mem(i..end) = H(end) + g(i)
                    H = self.PWM[1:] * cv + PA[1:] * kk + PR[1:] * rb + xout * kk
                    neg = np.maximum.accumulate(-g[:N])
                    start = np.maximum(start, np.searchsorted(neg, -(budget - H), side="left"))
                start = np.minimum(start, ends + 1)
                rows.append(start.astype(np.int64))
                if np.all(start > ends):
                    break
        rows.append(np.arange(1, N + 1, dtype=np.int64))
        table = np.stack(rows)
        self._mem_tables[mode] = table
        return table

    def _partial_grid(self, ks: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Partial recomputation for the stages ``i..end`` with ``k`` in flight (rows: pairs of
        ``ks`` and ``ends``, columns: every start): (whether some head fits, its end ``q + 1`` with
        the fewest layers). :meth:`memory_at`'s partial moments solved for the head in closed form:
        each bounds the nondecreasing ``(kk - 1) PX[q+1] + g PWM[q+1]`` (or ``PX[q+1]``) from below
        or above, so the fewest layers are the largest of the lower bounds."""
        N = self.N
        R_ = len(ends)
        I = np.arange(N)[None, :]
        J = ends[:, None]
        budget = self.mem_budget * (1 + _EPS)
        Wm = self.PWM[J + 1] - self.PWM[I]
        xin = self.xin_r[I]
        A = self.PX[J + 1] + self.xout[J]  # T = A - PX[q+1] + RS[q+1]; H = PX[q+1] - PX[i]
        PXi = self.PX[I]
        q1 = np.broadcast_to(I + 1, (R_, N)).copy()  # q + 1: the head's end, at least one layer
        hi = np.full((R_, N), np.inf)
        ok = J > I  # a head and a tail, each of at least one layer
        tol = 1e-9 * max(1.0, float(self.PX[-1]), float(self.PWM[-1]))
        terms = [self._memory_terms(int(k)) for k in ks]
        v0 = np.array([self.versions(int(k)) + self.opt_factor for k in ks])[:, None]
        with np.errstate(divide="ignore", invalid="ignore"):
            for t in range(len(terms[0])):
                cv = np.array([tt[t][0] for tt in terms], dtype=float)[:, None]
                kk = np.array([tt[t][1] for tt in terms], dtype=float)[:, None]
                rb = terms[0][t][2]  # the same moment of every count
                some = kk >= 1
                if rb == 0:  # kk (xin + T) within the budget: PX[q+1] - RS[q+1] from below; none in flight: weights
                    low = np.searchsorted(self.PX - self.RS,
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
                R = cv * Wm + g * self.PWM[J + 1] + kk * (xin + A) - PXi - budget
                F = (kk - 1) * self.PX[None, :] + g * self.PWM[None, :] - kk * self.RS[None, :]  # nondecreasing
                rows = np.arange(R_)[:, None]
                low = _first_true(N + 1, R.shape, lambda m: F[rows, m] >= R - tol)  # F's rows nondecreasing
                q1 = np.where(some, np.maximum(q1, low), q1)
        q1c = np.minimum(q1, N)
        ok &= (q1 <= J) & (self.PX[q1c] <= hi + tol)
        return ok, q1c

    def _partial_rows(self, pairs: list[tuple[int, int]]) -> np.ndarray:
        """Where rows ``(k, end)`` of the partial table are in ``self._pstore`` (built on demand):
        over starts ``0..N``, the running minimum of the stage's time with its fewest first layers
        recomputed that make it fit with ``k`` in flight (:meth:`_partial_grid`; ``2 cap`` where
        none does), so that a bisection finds the smallest start within a time."""
        if self._pindex_budget != self.mem_budget:
            self._pindex, self._pindex_budget, self._pused = {}, self.mem_budget, 0
        index = self._pindex
        want = sorted({pair for pair in pairs if pair not in index})
        if want:
            if self._pused + len(want) > len(self._pstore):
                cap_rows = max(1, self.partial_store_bytes // (8 * (self.N + 1)))
                if self._pused + len(want) > cap_rows:  # full: start again (this call's rows built anew)
                    index.clear()
                    self._pused = 0
                    want = sorted(set(pairs))
                rows = min(max(2 * len(self._pstore), self._pused + len(want), 64), max(cap_rows, len(want)))
                grown = np.empty((rows, self.N + 1))
                grown[:self._pused] = self._pstore[:self._pused]
                self._pstore = grown
            I = np.arange(self.N)[None, :]
            ks = np.array([k for k, _ in want], dtype=np.int64)
            ends = np.array([e for _, e in want], dtype=np.int64)
            ok, q1 = self._partial_grid(ks, ends)
            G = np.where(ok, self.PT[ends[:, None] + 1] - self.PT[I] + self.PF[q1] - self.PF[I], 2.0 * self._partial_cap)
            at = slice(self._pused, self._pused + len(want))
            self._pstore[at, :self.N] = np.minimum.accumulate(G, axis=1)
            self._pstore[at, self.N] = self._pstore[at, self.N - 1]  # column N (no start there): rows stay sorted
            for j, pair in enumerate(want):
                index[pair] = self._pused + j
            self._pused += len(want)
        return np.array([index[pair] for pair in pairs], dtype=np.int64)

    def _partial_kmax(self) -> int:
        """The largest in-flight count at which some stage fits with partial recomputation (0: none):
        stages only fit less with more in flight, so a bisection finds it."""
        key = self.mem_budget
        if self._partial_k is not None and self._partial_k[0] == key:
            return self._partial_k[1]
        ends = np.arange(self.N)

        def any_fits(k: int) -> bool:
            return bool(np.any(self._partial_grid(np.full(self.N, k), ends)[0]))

        lo, hi = 0, max(self.sizes[-1], self.M)
        if any_fits(hi):
            lo = hi
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if any_fits(mid):
                lo = mid
            else:
                hi = mid - 1
        self._partial_k = (key, lo)
        return lo

    def _partial_start(self, se_c: np.ndarray, thr: np.ndarray, kin: np.ndarray,
                       need: np.ndarray | None = None) -> np.ndarray:
        """Smallest start of stages ending at ``se_c`` that fit with partial recomputation within
        ``thr`` (compute terms), ``kin`` in flight; > the end where none does. ``need``: the queries
        worth asking (elsewhere the answer is taken as none)."""
        se_b, thr_b, k_b = np.broadcast_arrays(se_c, thr, kin)
        N = self.N
        out = np.full(se_b.shape, N + 1, dtype=np.int64)
        idx = np.flatnonzero(np.broadcast_to(True if need is None else need, se_b.shape))
        if len(idx):
            idx = idx[k_b.ravel()[idx] <= self._partial_kmax()]  # beyond it no stage fits
        if not len(idx):
            return out
        e = se_b.ravel()[idx]
        ks = k_b.ravel()[idx].astype(np.int64)
        # past _PARTIAL_EXACT in flight, a count is rounded up to a power of two (fewer rows to build;
        # conservative: more in flight never lets a stage fit with fewer layers recomputed)
        big = ks > _PARTIAL_EXACT
        ks[big] = 2 ** np.ceil(np.log2(ks[big])).astype(np.int64)
        keys = ks * N + e
        uniq, inv = np.unique(keys, return_inverse=True)
        rows = self._partial_rows([(int(u) // N, int(u) % N) for u in uniq])[inv]
        t = np.minimum(thr_b.ravel()[idx] * (1 + _EPS), self._partial_cap)
        # the first start whose running minimum is within t (each row nonincreasing)
        out.reshape(-1)[idx] = _first_true(N + 1, t.shape, lambda m: self._pstore[rows, m] <= t)
        return out

    @staticmethod
    def _ss(P: np.ndarray, end: np.ndarray, thr: np.ndarray) -> np.ndarray:
        """Smallest i with P[end+1] - P[i] <= thr (any shapes)."""
        return np.searchsorted(P, P[end + 1] - thr * (1 + _EPS), side="left")

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

    def _level1_start(self, se_c: np.ndarray, thr: np.ndarray, rr: np.ndarray, dd: np.ndarray,
                      e2: np.ndarray, options: tuple[str, ...]) -> np.ndarray:
        """Smallest start of level-1 stages ending at ``se_c`` within ``thr`` and the memory limit,
        the furthest-reaching of the recomputation ``options`` (the weight-sync term, which does
        not depend on recomputation, and the in-flight counts are computed once for both)."""
        if self.cost_model == "paper":
            with np.errstate(divide="ignore"):
                wthr = np.where(rr > 1, thr * self.B[0] / (2.0 * (rr - 1)), np.inf)
            common = self._ss(self.PW, se_c, wthr)
        else:
            # F + AR_r + OPT <= thr on row r of the stacked, offset prefix arrays
            row = rr * (self.N + 1)
            v = self.P2flat[row + se_c + 1] - thr * (1 + _EPS)
            common = np.searchsorted(self.P2flat, v, side="left") - row
        kin = None
        if self.memory_on:
            depth = np.ceil((rr + dd + e2) / rr - 1e-9).astype(np.int64)
            kin = -(-self.M // rr) if self.policy.holds_step else depth  # Policy.in_flight, vectorized
            kin = np.broadcast_to(kin, depth.shape).copy()
        out = None
        for mode in options:
            if mode == "partial":
                if kin is None:
                    continue
                timed = self._ss(self.PT, se_c, thr)  # partial runs more: it cannot start before this
                # only where memory stops a stage without recomputation can partial reach further back
                table = self._mem_rows("none")
                bound = table[np.minimum(kin, len(table) - 1), se_c] > timed
                s = np.maximum(self._partial_start(se_c, thr, kin, bound), timed)
            else:
                P1m, PCm = self._arr[mode][:2]
                s = self._ss(PCm if self.cost_model == "paper" else P1m, se_c, thr)
                if kin is not None:
                    table = self._mem_rows(mode)
                    s = np.maximum(s, table[np.minimum(kin, len(table) - 1), se_c])
            s = np.maximum(s, common)
            out = s if out is None else np.minimum(out, s)
        assert out is not None
        return out

    def _stage_starts(self, level: int, se_c: np.ndarray, rr: np.ndarray, dd: np.ndarray, mult: np.ndarray,
                      e: np.ndarray) -> np.ndarray:
        """Smallest start of a stage of ``rr`` units of ``level`` ending at ``se_c`` within its
        threshold ``rr * mult * tau`` (and the memory limit, ``dd`` units of this level downstream
        and ``e`` extra downstream workers per unit replica). Arrays of any broadcastable shapes."""
        tau = self._tau
        assert tau is not None
        thr = (rr * mult) * tau  # the stage's units x its group's threshold
        if level == 1:
            return self._level1_start(se_c, thr, rr, dd, e, self.modes)
        B = self.B[level - 1]
        with np.errstate(divide="ignore", invalid="ignore"):
            if self.cost_model == "paper":
                wthr = np.where(rr > 1, thr * B / (2.0 * (rr - 1)), np.inf)
            else:
                wthr = np.where(rr > 1, rr * thr * B / (2.0 * (rr - 1)), np.inf)
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
            s = self._stage_starts(level, se_c, rr, dd, mult2, e2)
            cand = np.where((se >= 0) & (s <= se), s, _BIG)
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
            s = self._stage_starts(level, se_c, w_ - dd, dd, np.array(mult, dtype=np.int64), np.array(e, dtype=float))
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
        saved, tables = self.mem_budget, self._mem_tables
        try:
            lo = 0.0
            hi = self.memory(0, self.N - 1, 1)  # everything on one worker
            for _ in range(60):
                if hi - lo <= 1e-4 * hi:
                    break
                mid = 0.5 * (lo + hi)
                self.mem_budget, self._mem_tables = mid, {}
                if self.feasible(math.inf):
                    hi = mid
                else:
                    lo = mid
            return hi
        finally:
            self.mem_budget, self._mem_tables = saved, tables
            self._tau = None


def _first_true(n: int, shape: tuple[int, ...], at: Any) -> np.ndarray:
    """Per element, the first index ``0..n-1`` where ``at(index array)`` holds (it must hold from
    there on, as on a sorted row), ``n`` where it never does: one bisection for every element at once."""
    lo = np.zeros(shape, dtype=np.int64)
    hi = np.full(shape, n, dtype=np.int64)
    while np.any(lo < hi):
        mid = (lo + hi) // 2
        holds = at(np.minimum(mid, n - 1))
        hi = np.where(holds & (lo < hi), mid, hi)
        lo = np.where(~holds & (lo < hi), mid + 1, lo)
    return lo


def _partial_term(w: float, kk: int, rb: int, xin: float, T: float, H: float) -> float:
    """One moment's bytes of a partially recomputing stage (:meth:`PlanModel.memory_at`): weights,
    gradients and state ``w``; ``kk`` microbatches in flight keep their inputs ``xin`` and tails
    ``T``; at a rebuild (``rb``) one of them holds its head ``H`` again (its tail still charged, as
    the stage's meter counts it; none in flight: the rebuilt one's input and head)."""
    if rb == 0:
        return w + kk * (xin + T)
    if kk == 0:
        return w + xin + H
    return w + kk * (xin + T) + H


def _span(layers: Sequence[Any], first: int, last: int) -> str:
    if first == last:
        return layers[first].name
    return f"{layers[first].name}..{layers[last].name}"


# ---------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------


def _minmax(P: np.ndarray, Q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``min_k max(P[i, k], Q[k, j])`` and its first argmin ``k``, in row chunks."""
    R, N = P.shape[0], Q.shape[1]
    val = np.empty((R, N))
    arg = np.empty((R, N), dtype=np.int64)
    step = max(1, 4_000_000 // max(1, Q.shape[0] * N))
    for a in range(0, R, step):
        T = np.maximum(P[a:a + step, :, None], Q[None, :, :])
        arg[a:a + step] = T.argmin(axis=1)
        val[a:a + step] = np.take_along_axis(T, arg[a:a + step, None, :], axis=1)[:, 0, :]
    return val, arg


def _solve_pipedream(model: PlanModel) -> tuple[Block, ...]:
    """The released optimizer's DP (``optimizer_graph_hierarchical.compute_partitioning`` with
    ``--activation_compression_ratio 1``), vectorized: per level, ``A[m][i, j]`` is the best time
    of range ``i..j`` on exactly ``m`` units; the level above uses ``A[count]`` as its compute.
    O(levels * count^2 * N^3) like the original (only row 0 at the top level)."""
    N, L = model.N, model.L
    idx = np.arange(N)
    I, J = idx[:, None], idx[None, :]
    valid = J >= I
    X = np.where(valid, model.PC[np.minimum(J + 1, N)] - model.PC[I], np.inf)
    Wm = np.where(valid, model.PW[np.minimum(J + 1, N)] - model.PW[I], 0.0)
    a = np.append(model.cut, 0.0)  # a[j]: bytes across the cut after j
    choices: list[dict[int, np.ndarray]] = []
    best_time = math.inf
    for level in range(1, L + 1):
        M, B, nmw = model.counts[level - 1], model.B[level - 1], model._pd_nmw(level)
        rows = slice(0, 1) if level == L else slice(None)
        rmax = M if model.allow_replication else 1

        def base(r: int) -> np.ndarray:
            if r > rmax:
                return np.full_like(X[rows], np.inf)
            return (X[rows] + (4.0 * (r - 1) * Wm[rows]) / (B * r) / nmw) / r

        A: dict[int, np.ndarray] = {1: base(1)}
        ch: dict[int, np.ndarray] = {1: np.full(A[1].shape, -1, dtype=np.int64)}
        last_q: dict[int, np.ndarray] = {}
        for m in range(2, M + 1):
            best = base(m)
            arg = np.full(best.shape, -1, dtype=np.int64)
            for mp in range(1, min(m - 1, rmax) + 1):
                if mp not in last_q:  # Q[k, j]: a non-first stage k+1..j on mp units, with its transfers
                    ts = (X[1:] + (4.0 * (mp - 1) * Wm[1:]) / (B * mp)) / mp
                    recv = (2.0 * a[:N - 1]) / (B * mp)
                    out = np.where(idx < N - 1, (2.0 * a[:N]) / (B * mp), 0.0)
                    q = np.maximum(np.maximum(ts, recv[:, None]), out[None, :])
                    last_q[mp] = np.vstack([q, np.full((1, N), np.inf)])
                val, kk = _minmax(A[m - mp], last_q[mp])
                better = val < best
                best = np.where(better, val, best)
                arg = np.where(better, kk * (M + 1) + mp, arg)
            A[m], ch[m] = best, arg
        choices.append(ch)
        if level < L:
            X = A[M]
        else:
            best_time = float(A[M][0, N - 1])
    if not math.isfinite(best_time):
        raise InfeasiblePlanError(
            f"no plan of {model.chain.name} uses exactly all {model.cluster.num_workers} workers as the pipedream cost "
            "model requires (a straight pipeline needs at least one layer per worker): allow replication, or use "
            "cost_model='paper'")

    def rebuild(level: int, i: int, j: int, m: int) -> list[Block]:
        c = int(choices[level - 1][m][0 if level == L else i, j])
        inner = (lambda f, l: tuple(rebuild(level - 1, f, l, model.counts[level - 2]))) if level > 1 else (lambda f, l: ())
        if c < 0:
            return [Block(i, j, m, inner(i, j))]
        k, mp = divmod(c, model.counts[level - 1] + 1)
        return rebuild(level, i, k, m - mp) + [Block(k + 1, j, mp, inner(k + 1, j))]

    return tuple(rebuild(L, 0, N - 1, model.counts[L - 1]))


def _solve(model: PlanModel) -> tuple[tuple[Block, ...], Evaluation]:
    if model.cost_model == "pipedream":
        blocks = _solve_pipedream(model)
        return blocks, model.evaluate(blocks)
    if not model.feasible(math.inf):
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


def build_plan(
    model: PlanModel,
    blocks: Sequence[Block],
    ev: Evaluation,
    *,
    solver: str,
    planning_seconds: float,
    optimal: bool,
    gap: float,
    notes: Iterable[str] = (),
    baseline: PlanModel | None = None,
) -> Plan:
    """The Plan of ``blocks``; ``baseline`` (default ``model``) rates data parallelism and names the cluster."""
    chain = model.chain
    base = baseline or model
    stages = []
    for idx, sc in enumerate(ev.stages):
        layers = chain.layers[sc.first:sc.last + 1]
        members = tuple(m for l in layers for m in (l.members or (l.name,)))
        stages.append(StagePlan(
            index=idx, first=sc.first, last=sc.last, layer_names=tuple(l.name for l in layers),
            members=members, replicas=len(sc.ranks), ranks=sc.ranks, compute_s=sc.compute_s,
            comm_s=sc.comm_s, memory_bytes=sc.memory_bytes, time_s=sc.time_s, send_s=sc.send_s,
            in_flight=sc.in_flight, weight_versions=sc.weight_versions,
            recompute=sc.recompute, recompute_layers=sc.recompute_layers,
        ))
    dp = base.data_parallel_time()
    b = chain.batch_size
    notes = list(notes)
    device_memory = model.cluster.device.memory
    if not model.memory_on and device_memory:
        for idx, sc in enumerate(ev.stages):
            if sc.memory_bytes > device_memory * (1 + 1e-9):
                notes.append(f"warning: stage {idx} needs "
                             f"{format_quantity(sc.memory_bytes, 'memory')} per worker, over the device's "
                             f"{format_quantity(device_memory, 'memory')} (the memory limit is off: "
                             "use memory_limit=True or --memory-limit to plan within it)")
    if model.memory_on and model.N > 0:
        need = model.memory(0, model.N - 1, 1)  # the whole model, its gradients, optimizer state, one minibatch
        if need > model.mem_budget * (1 + _EPS):
            notes.append(f"data parallelism does not fit: it needs {format_quantity(need, 'memory')} per worker, over "
                         f"the {format_quantity(model.mem_budget, 'memory')} limit; the speedup compares with "
                         f"what it would do if it did")
    return Plan(
        stages=tuple(stages),
        solver=solver,
        cost_model=model.cost_model,
        schedule=model.schedule,
        microbatch_size=b,
        seconds_per_minibatch=ev.seconds,
        samples_per_second=(b / ev.seconds) if ev.seconds > 0 else math.inf,
        data_parallel_samples_per_second=(b / dp) if dp > 0 else math.inf,
        bottleneck=ev.bottleneck,
        planning_seconds=planning_seconds,
        optimal=optimal,
        gap=gap,
        num_workers=model.cluster.num_workers,
        model=chain.name,
        cluster=str(base.cluster),
        memory_limit_bytes=model.mem_budget if model.memory_on else None,
        notes=tuple(notes),
    )


def partition_dp(
    chain: Chain,
    cluster: ClusterSpec,
    *,
    cost_model: str = "default",
    schedule: str = "1f1b",
    memory_limit: bool | None = None,
    optimizer_state_factor: float = 1.0,
    allow_replication: bool = True,
    num_microbatches: int = 1,
    recompute: str = "none",
    pool: bool = False,
) -> Plan:
    """The best plan for ``chain`` on ``cluster`` under ``cost_model`` (see the module doc).

    ``pool``: also plan the workers as one pool at the slowest link (:func:`pool_cluster`), where
    stages need not nest in the hierarchy, and keep that plan when it is strictly faster.

    ``num_microbatches``: per minibatch (a schedule that holds them all, GPipe, keeps ``M / r`` in
    flight). ``recompute``: ``none``, ``full`` (every stage) or ``auto`` (where memory needs it).

    ``memory_limit``: None = the cost model's default (on for ``default``, off for ``paper`` and
    ``pipedream``, which refuses it).
    Raises :class:`InfeasiblePlanError` (with the smallest per-worker memory that would fit)
    when no plan fits, and :class:`ClusterSpecError` when the limit is on but the device memory
    is unknown.

    The design, in full (moved from the module docstring):

    Paper: Narayanan et al., "PipeDream: Generalized Pipeline Parallelism for DNN Training",
    SOSP'19, section 3.1 (arXiv 1806.03377). Pure functions over numpy arrays; no torch.

    Cost models
    -----------
    ``paper`` is section 3.1 of the SOSP'19 paper as written. For a chain with per-layer compute
    ``c_l = forward + backward``, parameter bytes ``w_l``, bytes ``a_s`` live across cut ``s`` and
    a level of bandwidth ``B``:

    1. a stage of layers ``i..j`` replicated ``r`` times takes
       ``T = (1/r) * max(sum c_l, 2 (r-1) sum w_l / B)``;
    2. a boundary after layer ``s`` costs ``2 a_s / B`` (activations forward, gradients back);
    3. the pipeline's time per minibatch is the maximum over stages and boundaries;
    4. hierarchy (levels innermost first, level ``k`` has ``m_k`` units of level ``k-1``): the best
       time ``A^{k-1}(i..j)`` of a range on one unit of level ``k`` (a whole level-(k-1) group) is
       that range's compute time at level ``k``: ``T^k = (1/r) max(A^{k-1}(i..j), 2 (r-1) W / B_k)``,
       and boundaries between level-k stages cost ``2 a / B_k``. A range may use *up to* its units
       (replicas may use fewer than all workers when that is faster);
    5. data parallelism: one stage of all layers replicated over every unit of every level.

    ``pipedream`` is PipeDream's released optimizer (``optimizer/optimizer_graph_hierarchical.py`` in
    msr-fiddle/pipedream, run with ``--activation_compression_ratio 1`` as its README does), which
    differs from the paper's text; with ``C`` the range's compute at this level (level 1: the sum of
    ``c_l``; above: the level below's best time), ``W`` its weights, ``r`` its replicas:

    1. a stage costs ``(C + 4 (r-1) W / (r B)) / r``: a sum where the paper takes the max, and
       ``4 (r-1)/r W`` bytes (twice a ring all-reduce's) where the paper has ``2 (r-1) W``;
    2. in a level's pipeline, every block after the first also costs ``2 a / (B r)`` for the cut
       before it and, unless it ends the chain, for the cut after it (``r``: that block's replicas;
       without ``--activation_compression_ratio`` the released code charges no boundary at all);
    3. at level ``k >= 2`` the *first* block's weight term is divided by the count of level ``k-1``
       (the released ``num_machines_within_machine``), later blocks' are not;
    4. every range uses exactly all its units (no ``--use_fewer_machines``), no memory limit;
    5. data parallelism: ``t = C``, then per level ``t = (t + 4 (m-1) W / (m B) / n) / m``.

    It is solved by its own DP (:func:`_solve_pipedream`), not the bisection below; ties between
    equally fast configurations may break differently (the released code's order varies from run to
    run). The ILP refuses it.

    ``default`` is ours: the same structure (and the same boundaries), plus

    - the **all-reduce** among ``r`` replicas is a ring all-reduce, ``2 (r-1)/r * W / B``, done once
      per round of ``r`` minibatches (each replica processes one) and overlapped with the backward
      pass: a level-1 stage takes ``(F + max(Bw, AR) + OPT) / r`` per minibatch, where ``F``/``Bw``
      are the forward/backward sums; at outer levels ``max(A^{k-1}, AR_k) / r``;
    - the **optimizer step** ``OPT = (3 + 2 f) W / memory_bandwidth`` (read weights, gradients and
      ``f`` x weights of optimizer state; write weights and state) when the device's memory bandwidth
      is known, else 0;
    - the **memory limit** (on by default for this model; off by default for ``paper``).

    Memory (``default`` and ``paper``, when the limit is on)
    -------------------------------------------
    A worker of a stage holds ``W * (versions + 1 + f) + X * k`` bytes: ``W`` the stage's parameter
    bytes, ``versions`` the weight versions the schedule keeps (1F1B with stashing: ``k``; Flush: 1;
    2BW: 2), one gradient buffer, ``f = optimizer_state_factor`` bytes of optimizer state per
    parameter byte, and ``k`` in-flight minibatches of stashed activations ``X`` (the outputs of the
    stage's layers plus the bytes it receives). ``k = ceil(D / n)``, with ``n`` the stage's workers
    and ``D`` the workers at it and downstream: NOAM = ceil(workers / input replicas) at the input
    stage, fewer downstream. In a hierarchy, downstream stages of an *outer* level count with all
    the workers of their groups (a safe upper bound); within a group the count is exact.
    The bytes a stage starting at ``i`` receives are ``cut_bytes[i-1]``, capped to keep them
    monotone (``in[i+1] <= in[i] + output[i]``, which every chain from ``linearize`` satisfies).

    Pooled workers (``pool=True``): see :func:`pool_cluster`. A plan made without the memory limit
    whose stage exceeds the device's memory says so in a note (the stage, its bytes, the device's).

    Algorithm
    ---------
    Bisection on the bottleneck value ``tau`` (in log space, then one exact step on the found
    plan's own time). For a given ``tau`` a backward greedy decides feasibility exactly: ``L[w]`` is
    the smallest start of a suffix of the chain that ``w`` units can cover with every stage and
    boundary within ``tau``; prepending a stage of ``r`` units in front of the suffix covered by
    ``D`` units uses the cut just before that suffix (the first allowed one), and the stage may
    reach back as far as its cost allows (prefix sums + ``searchsorted``). Stage cost and memory are
    monotone in the range, so the furthest-back suffix dominates. Step ``w`` tries ``D = w - r``:
    with the memory limit too this is every ``(r, D)`` pair, as ``L`` is a running minimum and a
    pair does not depend on ``w`` (:meth:`PlanModel._group_start`). At level ``k`` the stage check
    asks the level-``k-1`` greedy (one group, threshold ``r * tau``), vectorized over all
    candidate stages of a step. The top level's one query searches by breakpoints
    (:meth:`PlanModel._group_start_one`): only a ``D`` where ``L`` drops can improve a step, and
    each such ``D``'s stages are asked once, vectorized over ``r``, so a level of ``m`` units costs
    O(breakpoints x m) stage checks, not O(m^2); the result is the same search's. Everything is
    vectorized with numpy; see ``benchmarks/bench_planner.py``.
    """
    t0 = time.perf_counter()
    if pool and cost_model == "pipedream":
        raise UsageError("the pipedream cost model reproduces PipeDream's released optimizer, whose stages nest in "
                         "the cluster's levels; pool=True goes with cost_model='default' or 'paper'")
    args = (cost_model, schedule, memory_limit, optimizer_state_factor, allow_replication, num_microbatches, recompute)
    model = PlanModel(chain, cluster, *args)
    baseline = model
    try:
        blocks, ev = _solve(model)
    except InfeasiblePlanError:
        if not (pool and model.L > 1):
            raise
        blocks, ev = (), None
    notes = []
    if pool and model.L > 1:  # the workers as one pool at the slowest link: stages need not nest
        pooled = PlanModel(chain, pool_cluster(cluster), *args)
        try:
            pblocks, pev = _solve(pooled)
        except InfeasiblePlanError:
            if ev is None:
                _solve(model)  # raises the hierarchy's error (it names the memory that fits)
            pblocks, pev = (), None
        if pev is not None and (ev is None or pev.seconds < ev.seconds * (1 - 1e-9)):
            model, blocks, ev = pooled, pblocks, pev
            notes.append(f"pooled: the stages need not nest in {cluster.levels[-1].name}; every stage and link "
                         f"is rated at the slowest link ({format_quantity(pooled.B[0], 'bandwidth')})")
    assert ev is not None
    optimal = True
    return build_plan(model, blocks, ev, solver="dp", planning_seconds=time.perf_counter() - t0,
                       optimal=optimal, gap=0.0 if optimal else math.nan, notes=notes, baseline=baseline)


def pool_cluster(cluster: ClusterSpec) -> ClusterSpec:
    """The cluster's workers as one level at its slowest link: a stage may take any ``r`` of them
    (15 of 4 servers x 4), rated by the slowest link it may span.

    In the hierarchy a stage nests (whole units of a level, or a share of one). ``partition_dp(...,
    pool=True)`` also plans on this pool, where every stage, weight sync and boundary is rated at the
    slowest link (exact for a stage that spans servers, an upper bound for one that does not), and
    keeps the pooled plan when strictly faster; its ranks are consecutive and :func:`evaluate` rates
    them with ``pool=True``. The ILP refuses ``pool=True`` on more than one level; the ``pipedream``
    model refuses it (the released optimizer's stages nest)."""
    if len(cluster.levels) == 1:
        return cluster
    return ClusterSpec(cluster.device, (Level("pool", cluster.num_workers, min(cluster.bandwidths)),))


def _model(chain: Chain, cluster: ClusterSpec, options: dict[str, Any]) -> PlanModel:
    allowed = {"cost_model", "schedule", "memory_limit", "optimizer_state_factor", "allow_replication",
               "num_microbatches", "recompute", "pool"}
    bad = set(options) - allowed
    if bad:
        raise UsageError(f"unknown option(s) {sorted(bad)}; use {sorted(allowed)}")
    options = dict(options)
    if options.pop("pool", False):  # rate the stages on the pool (ranks need not nest)
        cluster = pool_cluster(cluster)
    if options.get("memory_limit") is None and cluster.device.memory is None:
        options = {**options, "memory_limit": False}  # evaluating needs no limit
    return PlanModel(chain, cluster, **options)


def _to_blocks(stages: Any, cluster: ClusterSpec) -> tuple[Block, ...]:
    """Accept a Plan, StagePlans, (first, last, replicas[, ranks]) tuples or Blocks."""
    if isinstance(stages, Plan):
        stages = stages.stages
    stages = list(stages)
    if stages and isinstance(stages[0], Block):
        return tuple(stages)
    flat: list[tuple[int, int, Sequence[int]]] = []
    next_rank = 0
    for s in stages:
        if isinstance(s, StagePlan):
            flat.append((s.first, s.last, s.ranks))
            continue
        if len(s) == 4:
            first, last, reps, ranks = s
            if len(ranks) != reps:
                raise UsageError(f"stage {first}..{last}: {reps} replicas but {len(ranks)} ranks")
        else:
            first, last, reps = s
            ranks = range(next_rank, next_rank + reps)
        flat.append((first, last, tuple(ranks)))
        next_rank = max(next_rank, max(ranks) + 1)
    try:
        return blocks_from_ranks(flat, cluster)
    except ValueError as e:
        raise UsageError(str(e)) from None


def _check_cover(blocks: Sequence[Block], first: int, last: int, cluster: ClusterSpec, level: int) -> None:
    """Blocks must cover ``first..last`` contiguously (recursively) within the level's units."""
    pos = first
    for b in blocks:
        if b.first != pos or b.last < b.first:
            raise UsageError(f"stages must cover the chain contiguously: expected a stage starting at "
                             f"{pos}, got {b.first}..{b.last}")
        if level > 1:
            _check_cover(b.inner, b.first, b.last, cluster, level - 1)
        pos = b.last + 1
    if pos != last + 1:
        raise UsageError(f"stages end at {pos - 1} but must reach {last}")
    if sum(b.units for b in blocks) > cluster.levels[level - 1].count:
        raise UsageError(f"the stages use more units of level {cluster.levels[level - 1].name!r} "
                         f"than it has ({cluster.levels[level - 1].count})")


def evaluate(chain: Chain, cluster: ClusterSpec, stages: Any, **options: Any) -> Evaluation:
    """Evaluate a configuration (Plan, StagePlans, ``(first, last, replicas[, ranks])`` tuples, or
    a Block tree) under the cost model: time, bottleneck, per-stage costs and memory
    (``pool=True``: on :func:`pool_cluster`, where the ranks need not nest)."""
    model = _model(chain, cluster, {k: v for k, v in options.items()})
    blocks = _to_blocks(stages, model.cluster)
    _check_cover(blocks, 0, len(chain) - 1, model.cluster, len(model.cluster.levels))
    return model.evaluate(blocks)


def pipeline_time(chain: Chain, cluster: ClusterSpec, stages: Any, **options: Any) -> float:
    """Seconds per minibatch of a given configuration under the cost model (see :func:`evaluate`)."""
    return evaluate(chain, cluster, stages, **options).seconds


def stage_time(chain: Chain, cluster: ClusterSpec, first: int, last: int, replicas: int, *,
               cost_model: str = "default") -> float:
    """Time per minibatch of one worker-level stage ``first..last`` replicated ``replicas`` times
    over the innermost level's links."""
    return PlanModel(chain, cluster, cost_model, memory_limit=False).level1_stage(first, last, replicas)[0]


def stage_memory(chain: Chain, first: int, last: int, in_flight: int, *, schedule: str = "1f1b",
                 optimizer_state_factor: float = 1.0) -> float:
    """Per-worker bytes of stage ``first..last`` with ``in_flight`` minibatches (module doc)."""
    from pdcompile.cluster import Device, Level

    cluster = ClusterSpec(Device("any", memory=1.0), (Level("l", 1, 1.0),))
    model = PlanModel(chain, cluster, "paper", schedule, False, optimizer_state_factor)
    return model.memory(first, last, in_flight)


def stage_model(chain: Chain, *, schedule: str = "1f1b", optimizer_state_factor: float = 1.0,
                num_microbatches: int = 1, memory_limit: float | None = None) -> PlanModel:
    """The planner's model of ``chain``'s stages for the simulator's counts (:meth:`PlanModel.memory_at`,
    :meth:`PlanModel.recompute_s`); with ``memory_limit`` (bytes per worker), ``recompute="auto"``
    under it (:meth:`PlanModel.choose_recompute`)."""
    from pdcompile.cluster import Device

    cluster = ClusterSpec(Device("any", memory=1.0 if memory_limit is None else float(memory_limit)),
                          (Level("l", 1, 1.0),))
    return PlanModel(chain, cluster, "paper", schedule, memory_limit is not None, optimizer_state_factor,
                     num_microbatches=num_microbatches, recompute="auto" if memory_limit is not None else "none")


def stage_memory_at(chain: Chain, first: int, last: int, *, in_flight: int, weight_versions: int,
                    schedule: str = "1f1b", optimizer_state_factor: float = 1.0, recompute: bool | str = False,
                    num_microbatches: int = 1, activation_scale: float = 1.0, head: int = 0) -> float:
    """Per-worker bytes of stage ``first..last`` at given in-flight and weight-version counts: the
    planner's stage memory (module doc), for the simulator's counts; activations scaled by
    ``activation_scale``."""
    model = stage_model(chain, schedule=schedule, optimizer_state_factor=optimizer_state_factor,
                        num_microbatches=num_microbatches)
    return model.memory_at(first, last, in_flight, weight_versions, recompute, activation_scale, head)


def data_parallel_time(chain: Chain, cluster: ClusterSpec, cost_model: str = "default") -> float:
    """Seconds per minibatch of pure data parallelism over all workers under ``cost_model``."""
    return PlanModel(chain, cluster, cost_model, memory_limit=False).data_parallel_time()


def plan_from_assignment(chain: Chain, cluster: ClusterSpec, assignment: Any, *, solver: str = "fixed",
                         **options: Any) -> Plan:
    """A Plan for a given configuration (see :func:`evaluate` for the accepted forms)."""
    t0 = time.perf_counter()
    model = _model(chain, cluster, options)
    blocks = _to_blocks(assignment, model.cluster)
    _check_cover(blocks, 0, len(chain) - 1, model.cluster, len(model.cluster.levels))
    ev = model.evaluate(blocks)
    notes = []
    if not model.memory_ok(ev):
        notes.append(f"exceeds the memory limit: {format_quantity(ev.peak_memory, 'memory')} per worker")
    baseline = _model(chain, cluster, {k: v for k, v in options.items() if k != "pool"})
    return build_plan(model, blocks, ev, solver=solver, planning_seconds=time.perf_counter() - t0,
                       optimal=False, gap=math.nan, notes=notes, baseline=baseline)


def pipeline_plan(chain: Chain, stage_bounds: Sequence[int], cluster: ClusterSpec, **options: Any) -> Plan:
    """A straight pipeline with a fixed split: stage ``k`` runs on rank ``k`` alone.

    ``stage_bounds`` are the first positions of stages 1..S-1 (e.g. ``[3, 7]`` splits a 10-layer
    chain into 0..2, 3..6, 7..9); ``[]`` is one stage. Options as for :func:`partition_dp`.
    """
    bounds = [0, *[int(b) for b in stage_bounds], len(chain)]
    if any(b <= a for a, b in zip(bounds, bounds[1:])):
        raise UsageError(f"stage bounds must increase within 1..{len(chain) - 1} (got {list(stage_bounds)})")
    if len(bounds) - 1 > cluster.num_workers:
        raise UsageError(f"{len(bounds) - 1} stages need {len(bounds) - 1} workers; the cluster has {cluster.num_workers}")
    assignment = [(a, b - 1, 1, (k,)) for k, (a, b) in enumerate(zip(bounds, bounds[1:]))]
    return plan_from_assignment(chain, cluster, assignment, solver="fixed", **options)
