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
from collections.abc import Sequence
from typing import Any

from pdcompile.cluster import ClusterSpec, Level, format_quantity
from pdcompile.errors import UsageError
from pdcompile.ir import Chain, ChainLayer

__all__ = ["DEGREES", "LINK_LATENCY_S", "allreduce_s", "split_time", "split_bytes", "layer_at", "chain_at", "stages_at",
           "cluster_at", "view", "degrees", "split_backward", "why_not", "splittable", "stage_reason"]

#: the degrees ``tensor_parallel="auto"`` tries (each must divide the innermost level's count)
DEGREES = (1, 2, 4, 8)
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
