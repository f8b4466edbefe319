"""Planner configurations: a tree of blocks (one pipeline per level of the cluster), the ranks they
give each worker-level stage, and what an evaluation of one records (:class:`StageCost`,
:class:`Evaluation`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from pdcompile.cluster import ClusterSpec

__all__ = ["Block", "Evaluation", "StageCost", "blocks_from_ranks", "flatten_blocks", "span"]


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
    shard: str = "none"  # how its replicas hold its state (planner/sharding.py)


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


def span(layers: Sequence[Any], first: int, last: int) -> str:
    if first == last:
        return layers[first].name
    return f"{layers[first].name}..{layers[last].name}"
