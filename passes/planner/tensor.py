"""What tensor parallelism of degree ``t`` costs a stage (Megatron's layout, docs/tensor-parallel.md):
pure functions on plain numbers, and the chain and cluster a degree turns a plan into.

The rule, per chain layer (its ``tp_*`` fields say what Megatron's layout splits):

- **compute**: the split share ``s`` of a layer's time runs ``t`` ways as the op-class model has it,
  ``alpha + work / rate`` (``passes/costs/opclass.py``): the fixed part (``forward_fixed_s``,
  ``backward_fixed_s``: each op's launch and the like) is paid whole by each of the ``t`` ranks, the
  rest is divided by ``t``; so smaller shapes lose efficiency where fixed costs matter. The whole share
  ``1 - s`` (norms, embeddings, residual adds, the LM head) runs on every rank.
- **all-reduces**: each column/row pair all-reduces its output in the forward and its input gradient
  in the backward: a ring all-reduce of ``A`` bytes over ``t`` ranks at the level's bandwidth ``B``
  takes ``2 (t-1)/t A / B + 2 (t-1) latency``, on the critical path (not overlapped).
- **memory**: the split share of parameters (so gradients and optimizer state) and of the saved
  activations is ``1/t`` per rank; the rest, and every boundary tensor, stays whole.

A plan at degree ``t`` is planned as a plan of groups: every worker of :func:`cluster_at` is ``t``
workers of the innermost level (``tensor innermost`` on the mesh), the chain is :func:`chain_at`.
"""

from __future__ import annotations

import dataclasses
import math
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from pdcompile.cluster import ClusterSpec, Level, format_quantity
from pdcompile.errors import UsageError
from pdcompile.ir import Chain, ChainLayer

__all__ = ["DEGREES", "LINK_LATENCY_S", "EXACT_LIMIT", "allreduce_s", "split_time", "split_bytes", "layer_at", "chain_at",
           "stages_at", "cluster_at", "view", "degrees", "split_backward", "why_not", "splittable", "stage_reason",
           "RankBlocks", "rank_blocks", "blocks_fit", "plan_view", "stage_choices", "tied_groups", "assignments",
           "SPLIT_LIMIT", "DESCENT_LIMIT", "StageAt", "consecutive_ranks", "layout_ok", "degree_moves", "split_moves", "mixed_reason"]

#: the degrees ``tensor_parallel="auto"`` tries (each must divide the innermost level's count)
DEGREES = (1, 2, 4, 8)
#: the most per-stage assignments the per-stage search rates every one of (exact over them); above it, a descent
EXACT_LIMIT = 256
#: the most split moves one step of that descent rates (more, and it moves degrees alone)
SPLIT_LIMIT = 64
#: the most candidates the descent rates in all (each a plan and a lower bound, or a simulation): it stops there
DESCENT_LIMIT = 96
#: one step of a ring all-reduce's fixed cost (NCCL's per-hop latency inside a server is a few us)
LINK_LATENCY_S = 5e-6


def allreduce_s(nbytes: float, t: int, bandwidth: float, count: int = 1, latency: float = LINK_LATENCY_S) -> float:
    """Seconds of ``count`` ring all-reduces moving ``nbytes`` in all over ``t`` ranks at ``bandwidth``
    bytes/s: ``2 (t-1)/t nbytes / bandwidth + count 2 (t-1) latency``; 0 for ``t = 1``."""
    if t <= 1 or (nbytes <= 0 and count <= 0):
        return 0.0
    return 2.0 * (t - 1) / t * nbytes / bandwidth + count * 2.0 * (t - 1) * latency


def split_backward(t: int) -> bool | None:
    """Whether a plan of degree ``t`` splits a drain's backwards (``B`` then ``W``), as the schedule pass runs it
    and ``simulate()`` replays it: a stage split across ranks runs its backward whole (``False``); ``t = 1``:
    None, the cluster's default (``default_split_backward``)."""
    return None if t == 1 else False


def split_time(total_s: float, fixed_s: float, share: float, t: int) -> float:
    """A layer's time at degree ``t``: its whole part, plus the split part's fixed cost whole and
    its work ``1/t`` (``alpha + work / (t rate)``)."""
    whole, split = total_s * (1.0 - share), total_s * share
    fixed = min(fixed_s * share, split)
    return whole + fixed + (split - fixed) / t


def split_bytes(nbytes: float, share: float, t: int) -> float:
    """Bytes per rank of ``nbytes`` of which ``share`` is split ``t`` ways."""
    return nbytes * (1.0 - share) + nbytes * share / t


def layer_at(layer: ChainLayer, t: int, bandwidth: float) -> ChainLayer:
    """``layer`` as one of ``t`` tensor-parallel ranks runs it (module docstring), its all-reduces at
    ``bandwidth``: times, parameters and saved bytes per rank; its output (a boundary) stays whole."""
    if t == 1:
        return layer
    ar = allreduce_s(layer.tp_allreduce_bytes, t, bandwidth, layer.tp_allreduces)
    lat = allreduce_s(0.0, t, bandwidth, layer.tp_allreduces)  # the part a smaller microbatch pays alike
    f = split_time(layer.forward_s, layer.forward_fixed_s, layer.tp_share, t) + ar
    b = split_time(layer.backward_s, layer.backward_fixed_s, layer.tp_share, t) + ar
    fb = b / layer.backward_s if layer.backward_s else 1.0
    ff = f / layer.forward_s if layer.forward_s else 1.0
    ps, ss = layer.tp_param_share, layer.tp_saved_share

    def sb(x: float | None) -> float | None:
        return None if x is None else split_bytes(x, ss, t)

    def sc(x: float | None, k: float) -> float | None:
        return None if x is None else x * k

    return dataclasses.replace(
        layer, forward_s=f, backward_s=b, param_bytes=split_bytes(layer.param_bytes, ps, t),
        shared_param_bytes=split_bytes(layer.shared_param_bytes, ps, t), saved_bytes=sb(layer.saved_bytes),
        selective_saved_bytes=sb(layer.selective_saved_bytes), selective_rebuilt_bytes=sb(layer.selective_rebuilt_bytes),
        resaved_bytes=split_bytes(layer.resaved_bytes, ss, t),
        input_grad_s=sc(layer.input_grad_s, fb), weight_grad_s=sc(layer.weight_grad_s, fb),
        selective_recompute_s=sc(layer.selective_recompute_s, ff),
        forward_fixed_s=layer.forward_fixed_s + lat, backward_fixed_s=layer.backward_fixed_s + lat)


def chain_at(chain: Chain, t: int, bandwidth: float) -> Chain:
    """Every layer of ``chain`` at degree ``t`` (:func:`layer_at`); cuts stay whole."""
    if t == 1:
        return chain
    return dataclasses.replace(chain, layers=tuple(layer_at(l, t, bandwidth) for l in chain.layers))


def stages_at(chain: Chain, stages: Sequence[tuple[int, int, int]], bandwidth: float) -> Chain:
    """``chain`` with each stage's layers at that stage's own degree: ``stages`` are ``(first, last, t)``
    (a given split with a degree per stage, each pipeline rank its stage's ``t`` processes; cuts stay whole)."""
    at = {i: t for first, last, t in stages for i in range(first, last + 1)}
    if all(t == 1 for t in at.values()):
        return chain
    return dataclasses.replace(chain, layers=tuple(layer_at(l, at.get(i, 1), bandwidth)
                                                   for i, l in enumerate(chain.layers)))


def cluster_at(cluster: ClusterSpec, t: int) -> ClusterSpec:
    """The cluster of ``t``-worker groups: the innermost level's count divided by ``t`` (a level left with
    one group is dropped where an outer one remains). ``t`` must divide that count (:func:`degrees`)."""
    if t == 1:
        return cluster
    inner = cluster.levels[0]
    assert inner.count % t == 0, (inner.count, t)
    rest = cluster.levels[1:]
    if inner.count == t and rest:
        return ClusterSpec(cluster.device, rest)
    return ClusterSpec(cluster.device, (Level(inner.name, inner.count // t, inner.bandwidth), *rest))


def view(chain: Chain, cluster: ClusterSpec, t: int) -> tuple[Chain, ClusterSpec]:
    """The chain and cluster a plan of degree ``t`` was planned on, which its simulation replays."""
    return (chain, cluster) if t == 1 else (chain_at(chain, t, cluster.levels[0].bandwidth), cluster_at(cluster, t))


def splittable(chain: Chain) -> bool:
    """Whether tensor parallelism splits anything of ``chain`` (a profile without ``tp_*`` fields: no)."""
    return any(l.tp_share > 0 or l.tp_param_share > 0 for l in chain.layers)


def _divisor(chain: Chain) -> int:
    d = 0
    for l in chain.layers:
        d = math.gcd(d, l.tp_divisor)
    return d


def check_fits(t: int, cluster: ClusterSpec) -> None:
    """Refuse a degree ``t`` that does not fit the cluster's innermost level (a server's GPUs, a machine's
    processes): tensor parallelism stays inside it, whether the planner or the user chose the stages."""
    inner = cluster.levels[0]
    if t > 1 and inner.count % t:
        raise UsageError(f"tensor_parallel={t} does not fit in one {inner.name} unit of {inner.count} workers "
                         f"(tensor parallelism stays inside the innermost level); give a degree that divides "
                         f"{inner.count}, or 'auto'")


def degrees(option: Any, cluster: ClusterSpec, chain: Chain) -> tuple[int, ...]:
    """The degrees to plan for ``tensor_parallel=option``: ``"auto"``, those of :data:`DEGREES` that divide
    the innermost level's count and every layer's ``tp_divisor`` (only 1 on a CPU cluster, or where
    nothing splits); an int, itself, refused with one line naming the fix where it does not fit."""
    inner = cluster.levels[0]
    div = _divisor(chain)
    if option == "auto":
        if cluster.device.name == "cpu" or cluster.device.cores is not None or not splittable(chain):
            return (1,)
        return tuple(t for t in DEGREES if inner.count % t == 0 and (div == 0 or div % t == 0))
    if isinstance(option, bool) or not isinstance(option, int) or option < 1:
        raise UsageError(f"tensor_parallel={option!r}: give a positive int or 'auto'")
    t = option
    if t > 1 and not splittable(chain):
        raise UsageError(f"tensor_parallel={t}: this chain does not say what tensor parallelism splits (a profile "
                         f"has no tp_* shares); compile the model itself (pdcompile emit/run MODEL "
                         f"--tensor-parallel {t}), or plan with 1 or 'auto'")
    check_fits(t, cluster)
    if t > 1 and div and div % t:
        raise UsageError(f"tensor_parallel={t} does not divide the head counts and hidden sizes the split needs "
                         f"(their greatest common divisor is {div}); give a degree that divides {div}, or 'auto'")
    return (t,)


def why_not(cluster: ClusterSpec, chain: Chain) -> str:
    """Why ``auto`` tries no degree above 1 (:func:`degrees`), in a few words."""
    if cluster.device.name == "cpu" or cluster.device.cores is not None:
        return "CPU workers: auto keeps t=1 (give a degree to split anyway)"
    if not splittable(chain):
        return "nothing in this chain splits (a profile records no tensor-parallel shares)"
    return (f"no degree of {DEGREES[1:]} divides both the {cluster.levels[0].count} workers of "
            f"{cluster.levels[0].name} and the split sizes (gcd {_divisor(chain)})")


def stage_reason(t: int, compute_whole: float, compute_t: float, allreduce: float, params_whole: float,
                 params_t: float, level: Level, chosen_over: Sequence[str] = (), why_one: str = "") -> str:
    """One line: why a stage runs at degree ``t`` (its compute and parameter bytes per rank at 1 and at t)."""
    if t == 1:
        return "t=1: " + (f"faster than {', '.join(chosen_over)}" if chosen_over else (why_one or "the only degree tried"))
    return (f"t={t} over {level.name} ({format_quantity(level.bandwidth, 'bandwidth')}): compute "
            f"{compute_whole:.4g} s -> {compute_t:.4g} s per microbatch, of it {allreduce:.3g} s all-reduces; "
            f"parameters {format_quantity(params_whole, 'memory')} -> {format_quantity(params_t, 'memory')} per rank")


# -- a degree per stage (``tensor_parallel="auto"``'s per-stage search, partition_dp.plan_tensor_parallel) --------------


@dataclass(frozen=True)
class RankBlocks(ClusterSpec):
    """The cluster's processes seen as pipeline ranks of their own degrees, as ``runtime/tensor_parallel.py``
    ``RankLayout`` places them: pipeline rank ``q`` is the block of ``rank_degrees[q]`` processes from
    ``bases[q]``. What ``simulate()`` replays a plan with a degree per stage on (its ranks are pipeline ranks):
    a link between two ranks is the link between their blocks' first processes (each block sits in one unit of
    the innermost level, :func:`blocks_fit`), and a send to a rank of ``k`` times the sender's degree costs ``k``
    copies on the sender's link (receiving index ``i`` takes the value from sending index ``i % t_send``, so each
    sending process sends it ``k`` times); a replicated stage's all-reduce runs on its blocks' slowest link."""

    bases: tuple[int, ...] = ()
    rank_degrees: tuple[int, ...] = ()

    def bandwidth_between(self, rank_a: int, rank_b: int) -> float:
        copies = max(1, self.rank_degrees[rank_b] // self.rank_degrees[rank_a])
        return ClusterSpec.bandwidth_between(self, self.bases[rank_a], self.bases[rank_b]) / copies

    def slowest_bandwidth(self, ranks: Any) -> float:
        rs = sorted({self.bases[r] for r in ranks})
        return min((ClusterSpec.bandwidth_between(self, a, b) for a, b in zip(rs, rs[1:])), default=math.inf)


def rank_blocks(stage_ranks: Sequence[Sequence[int]], degrees: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Each pipeline rank's first process and degree (``RankLayout.bases``, ``rank_degrees``): the blocks of
    processes in rank order."""
    n = 1 + max((q for rs in stage_ranks for q in rs), default=-1)
    deg = [1] * n
    for rs, t in zip(stage_ranks, degrees):
        for q in rs:
            deg[q] = int(t)
    return tuple(itertools.accumulate(deg, initial=0))[:-1], tuple(deg)


def blocks_fit(bases: Sequence[int], rank_degrees: Sequence[int], inner: int) -> bool:
    """Whether every block of processes lies inside one unit of ``inner`` workers (the innermost level, where
    tensor parallelism stays)."""
    return all(b // inner == (b + t - 1) // inner for b, t in zip(bases, rank_degrees))


def plan_view(chain: Chain, cluster: ClusterSpec, stages: Sequence[Any]) -> tuple[Chain, ClusterSpec]:
    """The chain and cluster a plan the planner gave degrees is simulated on (``stages``: its StagePlans, each
    with ``first``, ``last``, ``ranks`` and ``tensor_parallel``): one degree for all, :func:`view` (groups of
    ``t`` workers); a degree per stage, each stage's layers at its own degree (:func:`stages_at`) on
    :class:`RankBlocks` of the cluster."""
    degs = [int(st.tensor_parallel) for st in stages]
    if len(set(degs)) <= 1:
        return view(chain, cluster, degs[0] if degs else 1)
    bases, per_rank = rank_blocks([st.ranks for st in stages], degs)
    return (stages_at(chain, [(st.first, st.last, t) for st, t in zip(stages, degs)], cluster.levels[0].bandwidth),
            RankBlocks(cluster.device, cluster.levels, bases, per_rank))


def stage_choices(workers: int, degrees: Sequence[int], microbatches: int | None) -> list[tuple[int, int]]:
    """A stage's ``(t, replicas)`` on ``workers`` processes: every degree of ``degrees`` dividing them, its
    replicas ``workers / t`` (a count that divides ``microbatches``, so each replica takes a share of every
    minibatch, where that is given)."""
    return [(t, workers // t) for t in degrees
            if workers % t == 0 and (not microbatches or microbatches % (workers // t) == 0)]


def tied_groups(chain: Chain, spans: Sequence[tuple[int, int]]) -> list[set[int]]:
    """Sets of stages (of ``spans``, first and last layer each) that hold one tied parameter: they need one degree
    (passes/tensor_parallel.py splits a tied weight only where every user does at one degree; the planner charges
    it split)."""
    where: dict[str, set[int]] = {}
    for s, (a, b) in enumerate(spans):
        for layer in chain.layers[a:b + 1]:
            for name, _ in layer.tied_params:
                where.setdefault(name, set()).add(s)
    return [g for g in where.values() if len(g) > 1]


def assignments(choices: Sequence[Sequence[tuple[int, int]]], groups: Sequence[set[int]]) -> Iterator[tuple[tuple[int, int], ...]]:
    """Every per-stage choice (one of ``choices[s]`` per stage) whose stages in each of ``groups`` share a degree."""
    for combo in itertools.product(*choices):
        if all(len({combo[s][0] for s in g}) == 1 for g in groups):
            yield combo


#: one stage of a plan with a degree per stage: its first and last layer, its degree and its replicas (pipeline ranks)
StageAt = tuple[int, int, int, int]


def consecutive_ranks(stages: Sequence[StageAt]) -> list[tuple[int, ...]]:
    """Each stage's pipeline ranks, stage by stage (its processes, ``replicas x t``, follow the previous stage's)."""
    out, nxt = [], 0
    for _, _, _, r in stages:
        out.append(tuple(range(nxt, nxt + r)))
        nxt += r
    return out


def layout_ok(chain: Chain, stages: Sequence[StageAt], inner: int) -> bool:
    """Whether the runtime runs ``stages`` as planned: stages that share a tied weight at one degree
    (:func:`tied_groups`), and each pipeline rank's block of processes inside one innermost unit (:func:`blocks_fit`)."""
    if any(len({stages[s][2] for s in g}) > 1 for g in tied_groups(chain, [(a, b) for a, b, _, _ in stages])):
        return False
    return blocks_fit(*rank_blocks(consecutive_ranks(stages), [t for _, _, t, _ in stages]), inner)


def degree_moves(stages: Sequence[StageAt], degrees: Sequence[int], microbatches: int | None) -> Iterator[tuple[StageAt, ...]]:
    """``stages`` with one stage's processes run at another degree (:func:`stage_choices`)."""
    for s, (a, b, t, r) in enumerate(stages):
        for t2, r2 in stage_choices(t * r, degrees, microbatches):
            if t2 != t:
                yield (*stages[:s], (a, b, t2, r2), *stages[s + 1:])


def split_moves(stages: Sequence[StageAt], degrees: Sequence[int], microbatches: int | None) -> Iterator[tuple[StageAt, ...]]:
    """``stages`` with one stage cut in two at one of its cuts, its processes shared between the halves in whole
    blocks of its degree (``t`` processes), each half at a degree of its own (:func:`stage_choices`): a small part
    of a stage whole beside a split one."""
    for s, (a, b, t, r) in enumerate(stages):
        w = t * r
        for c in range(a, b):
            for w1 in range(t, w, t):
                for t1, r1 in stage_choices(w1, degrees, microbatches):
                    for t2, r2 in stage_choices(w - w1, degrees, microbatches):
                        yield (*stages[:s], (a, c, t1, r1), (c + 1, b, t2, r2), *stages[s + 1:])


def mixed_reason(t: int, uniform_t: int, replicas: int, compute_t: float, compute_u: float, memory_t: float,
                 memory_u: float, level: Level, cut: bool = False) -> str:
    """One line: why a stage of a plan with a degree per stage runs at ``t`` where the best one-degree plan ran
    its layers at ``uniform_t``: its compute per microbatch per rank and memory per process at each (``cut``: the
    stage is part of one of that plan's, on part of its processes)."""
    what = f"t={t} x{replicas} " + (f"over {level.name}" if t > 1 else "(whole)")
    if t == uniform_t and not cut:
        return (f"{what}: as the best one-degree plan (compute {compute_t:.4g} s per microbatch per rank, "
                f"{format_quantity(memory_t, 'memory')} per process)")
    where = "part of a stage of the best one-degree plan, on part of its processes" if cut else "on the same processes"
    mem = (f"{format_quantity(memory_t, 'memory')} per process (that whole stage: {format_quantity(memory_u, 'memory')})"
           if cut else f"memory {format_quantity(memory_u, 'memory')} -> {format_quantity(memory_t, 'memory')} per process")
    return (f"{what} instead of t={uniform_t} ({where}): compute {compute_u:.4g} s -> {compute_t:.4g} s per "
            f"microbatch per rank, {mem}")
