"""PipeDream's released optimizer (``optimizer/optimizer_graph_hierarchical.py`` in msr-fiddle/pipedream,
``--activation_compression_ratio 1``) as a cost model: its stage and boundary terms, its evaluation
of a block tree (:func:`evaluate_released`) and its own DP (:func:`solve_released`), which the
bisection search does not replace (``partition_dp``'s docstring has the formulas)."""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any, Callable, Sequence

import numpy as np

from pdcompile.cluster import ClusterSpec, format_quantity
from pdcompile.errors import InfeasiblePlanError
from pdcompile.passes.planner.arrays import ChainArrays, rng
from pdcompile.passes.planner.blocks import Block, Evaluation, StageCost, flatten_blocks, span

__all__ = ["PipeDreamCosts", "evaluate_released", "solve_released"]


class PipeDreamCosts:
    """The released optimizer's model: a stage costs ``(C + 4 (r-1) W / (r B)) / r``, a sum where the
    paper takes the max; it plans by its own DP (``solver``)."""

    name = "pipedream"
    memory_by_default = False
    models_memory = False  # the released optimizer plans without a memory limit and never recomputes

    def __init__(self, arrays: ChainArrays, cluster: ClusterSpec) -> None:
        self.a = arrays
        self.B = [float(lv.bandwidth) for lv in cluster.levels]
        self.counts = [lv.count for lv in cluster.levels]
        self.solver: Callable[[Any], tuple[Block, ...]] | None = solve_released

    def nmw(self, level: int) -> int:
        """The released optimizer's ``num_machines_within_machine`` at ``level``: the count of the
        level just below (not the product of all levels below), 1 at the innermost level."""
        return self.counts[level - 2] if level > 1 else 1

    def stage_time(self, i: int, j: int, r: int, again: float = 0.0, shard: str = "none") -> tuple[float, float]:
        # ``shard`` as CostModel has it: the released optimizer's replicas are never sharded
        comm = (4.0 * (r - 1) * rng(self.a.PW, i, j)) / (self.B[0] * r)
        return (rng(self.a.PC, i, j) + comm) / r, comm / r

    def boundary_time(self, nbytes: float, level: int) -> float:
        return (2.0 * nbytes) / self.B[level - 1]

    def weight_sync_time(self, i: int, j: int, r: int, level: int) -> float:
        return (4.0 * (r - 1) * rng(self.a.PW, i, j)) / (self.B[level - 1] * r) / r

    def data_parallel_time(self) -> float:
        """The released optimizer's own baseline: ``t = C``, then per level ``t = (t + 4 (m-1) W /
        (m B) / nmw) / m``."""
        n = self.a.N - 1
        t, W = rng(self.a.PC, 0, n), rng(self.a.PW, 0, n)
        for level in range(1, len(self.counts) + 1):
            m = self.counts[level - 1]
            t = (t + (4.0 * (m - 1) * W) / (self.B[level - 1] * m) / self.nmw(level)) / m
        return t

    def evaluate(self, model: Any, blocks: Sequence[Block]) -> Evaluation:
        return evaluate_released(model, blocks)

    def time_prefix(self, extra: np.ndarray | None) -> np.ndarray:
        raise NotImplementedError("the pipedream cost model plans by its own DP (solve_released), not the search")

    def sync_start(self, end: np.ndarray, thr: np.ndarray, r: np.ndarray) -> np.ndarray:
        raise NotImplementedError("the pipedream cost model plans by its own DP (solve_released), not the search")

    def outer_sync_bytes(self, thr: np.ndarray, r: np.ndarray, level: int) -> np.ndarray:
        raise NotImplementedError("the pipedream cost model plans by its own DP (solve_released), not the search")


def evaluate_released(model: Any, blocks: Sequence[Block]) -> Evaluation:
    """A block tree under the released optimizer's recursion (module doc, ``pipedream``).

    A level-``k`` block's time is ``(X + comm) / r``, ``X`` the max of its inner terms, so every
    inner term is carried up as ``(v + comm) / r``: the max of the flat terms is the cost."""
    flat = flatten_blocks(blocks, model.cluster)
    names = model.chain.layers
    last_pos = model.N - 1
    # entries: [name, value, stage index or -1, stage whose send it is or -1, compute, comm]
    stage_info: list[tuple[int, int, int, float]] = []  # first, last, in-flight, memory

    def rec(bs: Sequence[Block], level: int, e: Fraction) -> list[list[Any]]:
        B = model.B[level - 1]
        lvname = model.cluster.levels[level - 1].name
        out: list[list[Any]] = []
        ends: list[int] = []  # index of the last worker stage of each block
        for p, b in enumerate(bs):
            r = b.units
            d_after = sum(x.units for x in bs[p + 1:])
            comm = (4.0 * (r - 1) * rng(model.PW, b.first, b.last)) / (B * r)
            if p == 0:
                comm /= model.costs.nmw(level)
            if level == 1:
                C = rng(model.PC, b.first, b.last)
                k = math.ceil((b.units + d_after + e) / b.units)
                q = len(stage_info)
                stage_info.append((b.first, b.last, k, model.memory(b.first, b.last, k)))
                out.append([f"stage {q} ({span(names, b.first, b.last)})", (C + comm) / r, q, -1, C / r, comm / r])
            else:
                for ent in rec(b.inner, level - 1, (e + d_after * model.sizes[level - 1]) / b.units):
                    ent[1] = (ent[1] + comm) / r
                    if ent[2] >= 0:
                        ent[4], ent[5] = ent[4] / r, ent[5] / r + comm / r
                    out.append(ent)
            ends.append(len(stage_info) - 1)
            if p >= 1:  # a block after a split: its input (and its output, unless the chain ends)
                a_in = float(model.cut[bs[p - 1].last])
                q = ends[p - 1]
                out.append([f"link {q}->{q + 1} ({lvname}, {format_quantity(a_in, 'memory')})",
                            (2.0 * a_in) / (B * r), -1, q, 0.0, 0.0])
                if b.last < last_pos:
                    a_out = float(model.cut[b.last])
                    q = ends[p]
                    out.append([f"link {q}->{q + 1} ({lvname}, {format_quantity(a_out, 'memory')}, "
                                f"as the output of block {b.first}..{b.last})", (2.0 * a_out) / (B * r),
                                -1, q, 0.0, 0.0])
        return out

    entries = rec(blocks, model.L, Fraction(0))
    terms = tuple((str(ent[0]), float(ent[1])) for ent in entries)
    stages: list[StageCost] = []
    for q, (first, last, k, mem) in enumerate(stage_info):
        (st,) = [ent for ent in entries if ent[2] == q]
        sends = [float(ent[1]) for ent in entries if ent[3] == q]
        stages.append(StageCost(first, last, flat[q][2], compute_s=float(st[4]), comm_s=float(st[5]),
                                time_s=float(st[1]), send_s=max(sends, default=0.0), memory_bytes=mem,
                                in_flight=k, weight_versions=model.versions(k)))
    seconds = max((t for _, t in terms), default=0.0)
    bottleneck = max(terms, key=lambda kv: kv[1])[0] if terms else ""
    peak = max((s.memory_bytes for s in stages), default=0.0)
    return Evaluation(seconds, bottleneck, terms, tuple(stages), peak)


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


def solve_released(model: Any) -> tuple[Block, ...]:
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
        M, B, nmw = model.counts[level - 1], model.B[level - 1], model.costs.nmw(level)
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
