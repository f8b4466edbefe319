"""The ``linearize`` pass: a profile's layer DAG as a chain of cut points with the bytes live
across each cut, so that branchy graphs can be partitioned into contiguous ranges.

Cut ``i`` lies between ``layers[i]`` and ``layers[i+1]`` of a topological order; a value produced
at or before layer ``i`` and read after it counts once (model inputs as produced before layer 0,
``Profile.outputs`` as read after the last). A live non-tensor value makes the cut ``math.inf``.
Of the orders in :data:`RULES` (``greedy`` fewest-bytes-live, ``dfs``, the ``profile``'s own) the
one with the fewest blocked cuts, then the narrowest widest cut, then the smallest sum wins.
Pure Python on plain data; only :func:`run` reads the graph (cuts split-stages can't make).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Sequence

from pdcompile.errors import ProfileError
from pdcompile.ir import Chain, ChainLayer, CompileState, need
from pdcompile.profile import Profile

RULES = ("greedy", "dfs", "profile")


@dataclass(frozen=True)
class _Dag:
    """Index form of a profile: layer ``k``'s producers and consumers, sizes and tensor flags."""

    names: tuple[str, ...]
    nbytes: tuple[float, ...]  # per layer output
    tensor: tuple[bool, ...]
    preds: tuple[tuple[int, ...], ...]  # distinct producer layers
    succs: tuple[tuple[int, ...], ...]  # distinct consumer layers
    is_output: tuple[bool, ...]
    # model inputs: (bytes, tensor?, consumer layers); they are live from before layer 0
    inputs: tuple[tuple[float, bool, tuple[int, ...], bool], ...]


def _dag(profile: Profile, include_inputs: bool) -> _Dag:
    index = {layer.name: k for k, layer in enumerate(profile.layers)}
    input_index = {i.name: k for k, i in enumerate(profile.inputs)}
    preds: list[tuple[int, ...]] = []
    succs: list[list[int]] = [[] for _ in profile.layers]
    input_consumers: list[list[int]] = [[] for _ in profile.inputs]
    for k, layer in enumerate(profile.layers):
        ps: list[int] = []
        for src in dict.fromkeys(layer.inputs):
            if src in index:
                ps.append(index[src])
                succs[index[src]].append(k)
            elif src in input_index:
                input_consumers[input_index[src]].append(k)
            else:  # Profile validates this; keep a clear error for hand-built profiles
                raise ProfileError(f"layer {layer.name!r} reads unknown {src!r}")
        preds.append(tuple(ps))
    outputs = set(profile.outputs)
    inputs = tuple(
        (i.output_bytes if include_inputs else 0.0, i.tensor_output or not include_inputs,
         tuple(input_consumers[k]), i.name in outputs)
        for k, i in enumerate(profile.inputs)
    )
    return _Dag(
        names=tuple(layer.name for layer in profile.layers),
        nbytes=tuple(float(layer.output_bytes) for layer in profile.layers),
        tensor=tuple(layer.tensor_output for layer in profile.layers),
        preds=tuple(preds),
        succs=tuple(tuple(s) for s in succs),
        is_output=tuple(layer.name in outputs for layer in profile.layers),
        inputs=inputs,
    )


def cut_bytes(dag_or_profile: Profile | _Dag, order: Sequence[int], include_inputs: bool = True
              ) -> tuple[float, ...]:
    """Bytes live across each cut of ``order`` (a permutation of layer indices); inf if a
    non-tensor value is live there."""
    dag = dag_or_profile if isinstance(dag_or_profile, _Dag) else _dag(dag_or_profile, include_inputs)
    n = len(order)
    if n <= 1:
        return ()
    pos = [0] * n
    for i, k in enumerate(order):
        pos[k] = i
    diff = [0.0] * (n + 1)
    bad = [0] * (n + 1)

    def add(start: int, last_use: int, nbytes: float, tensor: bool) -> None:
        # live across cuts start .. last_use - 1 (cut i is after position i)
        lo, hi = max(start, 0), min(last_use, n - 1)
        if lo >= hi:
            return
        if tensor:
            diff[lo] += nbytes
            diff[hi] -= nbytes
        else:
            bad[lo] += 1
            bad[hi] -= 1

    for k in range(n):
        last = max((pos[s] for s in dag.succs[k]), default=-1)
        if dag.is_output[k]:
            last = n
        if last > pos[k]:
            add(pos[k], last, dag.nbytes[k], dag.tensor[k])
    for nbytes, tensor, consumers, is_out in dag.inputs:
        last = n if is_out else max((pos[c] for c in consumers), default=-1)
        if last >= 0:
            add(0, last, nbytes, tensor)
    cuts: list[float] = []
    run, run_bad = 0.0, 0
    for i in range(n - 1):
        run += diff[i]
        run_bad += bad[i]
        cuts.append(math.inf if run_bad > 0 else max(run, 0.0))
    return tuple(cuts)


def _order_profile(dag: _Dag) -> list[int]:
    return list(range(len(dag.names)))


def _order_dfs(dag: _Dag) -> list[int]:
    indeg = [len(p) for p in dag.preds]
    stack = [k for k in range(len(indeg)) if indeg[k] == 0][::-1]
    order: list[int] = []
    while stack:
        k = stack.pop()
        order.append(k)
        ready = []
        for s in dag.succs[k]:
            indeg[s] -= 1
            if indeg[s] == 0:
                ready.append(s)
        stack.extend(sorted(ready, reverse=True))
    return order


def _order_greedy(dag: _Dag) -> list[int]:
    n = len(dag.names)
    indeg = [len(p) for p in dag.preds]
    remaining = [len(s) for s in dag.succs]
    ready = {k for k in range(n) if indeg[k] == 0}
    order: list[int] = []
    last = -1
    while ready:
        best_key: tuple[float, ...] | None = None
        best = -1
        last_succs = set(dag.succs[last]) if last >= 0 else set()
        for k in ready:
            bad = 0
            delta = 0.0
            if remaining[k] > 0 or dag.is_output[k]:
                if dag.tensor[k]:
                    delta += dag.nbytes[k]
                else:
                    bad += 1
            for p in dag.preds[k]:
                if remaining[p] == 1 and not dag.is_output[p]:
                    if dag.tensor[p]:
                        delta -= dag.nbytes[p]
                    else:
                        bad -= 1
            key = (bad, delta, 0 if k in last_succs else 1, k)
            if best_key is None or key < best_key:
                best_key, best = key, k
        ready.discard(best)
        order.append(best)
        last = best
        for p in dag.preds[best]:
            remaining[p] -= 1
        for s in dag.succs[best]:
            indeg[s] -= 1
            if indeg[s] == 0:
                ready.add(s)
    return order


_BUILDERS = {"greedy": _order_greedy, "dfs": _order_dfs, "profile": _order_profile}


def order_layers(profile: Profile, rule: str = "best", include_inputs: bool = True
                 ) -> tuple[list[int], tuple[float, ...], str]:
    """The chosen order (indices into ``profile.layers``), its cut bytes and the rule used."""
    dag = _dag(profile, include_inputs)
    rules = RULES if rule == "best" else (rule,)
    best: tuple[tuple[float, float, float, int], list[int], tuple[float, ...], str] | None = None
    for r, name in enumerate(rules):
        if name not in _BUILDERS:
            raise ProfileError(f"unknown linearize rule {name!r}; use 'best' or one of {RULES}")
        order = _BUILDERS[name](dag)
        if len(order) != len(dag.names):  # pragma: no cover - Profile guarantees a DAG
            raise ProfileError("the layer graph has a cycle")
        cuts = cut_bytes(dag, order)
        finite = [c for c in cuts if math.isfinite(c)]
        blocked = len(cuts) - len(finite)
        widest = max(finite, default=0.0)
        # fewest blocked cuts first, then the narrowest widest cut, less total traffic, rule order
        score = (float(blocked), widest, sum(finite), r)
        if best is None or score < best[0]:
            best = (score, order, cuts, name)
    assert best is not None
    return best[1], best[2], best[3]


def linearize(profile: Profile, *, rule: str = "best", include_inputs: bool = True) -> Chain:
    """The profile as a :class:`pdcompile.ir.Chain` in a narrow-cut topological order.

    One chain layer per profile layer (``members == (name,)``). ``rule`` is ``"best"`` (try
    every rule in :data:`RULES`, keep the narrowest) or one rule's name. With
    ``include_inputs=False`` model inputs don't count in the cuts (PipeDream's convention: every
    stage can read them from the data loader).
    """
    order, cuts, _ = order_layers(profile, rule, include_inputs)
    layers = tuple(
        ChainLayer(
            name=l.name, op=l.op, forward_s=l.forward_s, backward_s=l.backward_s,
            output_bytes=l.output_bytes, param_bytes=l.param_bytes, members=(l.name,),
            saved_bytes=l.saved_bytes, saved_input_bytes=l.saved_input_bytes,
            saved_output_bytes=l.saved_output_bytes, shared_param_bytes=l.shared_param_bytes,
            tied_params=l.tied_params, param_tensors=l.param_tensors,
            input_grad_s=l.input_grad_s, weight_grad_s=l.weight_grad_s,
            selective_saved_bytes=l.selective_saved_bytes, selective_recompute_s=l.selective_recompute_s,
            selective_rebuilt_bytes=l.selective_rebuilt_bytes, resaved_bytes=l.resaved_bytes,
            forward_fixed_s=l.forward_fixed_s, backward_fixed_s=l.backward_fixed_s,
        )
        for l in (profile.layers[k] for k in order)
    )
    return Chain(layers=layers, cut_bytes=cuts, batch_size=profile.batch_size, name=profile.name)


def report(chain: Chain) -> str:
    """One line: number of layers and the widest cut (bytes and where)."""
    finite = [(c, i) for i, c in enumerate(chain.cut_bytes) if math.isfinite(c)]
    blocked = len(chain.cut_bytes) - len(finite)
    if not finite:
        return f"{chain.name}: {len(chain)} layers, no allowed cut"
    widest, at = max(finite)
    return (
        f"{chain.name}: {len(chain)} layers, widest cut {widest:.0f} B after "
        f"{chain.layers[at].name} (#{at}); {blocked} blocked cuts"
    )


def run(state: CompileState) -> CompileState:
    """Reads ``profile`` and ``gm``; writes ``chain``, blocking the cuts where more than single
    tensors would cross a stage boundary."""
    from pdcompile.passes.split_stages import blocked_cuts, rebuildable  # torch: this module stays pure data

    # model inputs cross no cut: a later stage that reads one takes it from the data, and makes again what
    # it reads that cheap ops make from them alone (split-stages: ``targets.view(-1)``, a mask expanded)
    gm = need(state.gm, "gm")
    profile = need(state.profile, "profile")
    made = {n.name for n in rebuildable(gm, from_inputs=True)} - {n.name for n in rebuildable(gm)}
    sizes = {layer.name: layer.output_bytes for layer in profile.layers}
    if made:
        profile = dataclasses.replace(profile, layers=tuple(
            dataclasses.replace(layer, output_bytes=0.0) if layer.name in made else layer for layer in profile.layers))
    chain = linearize(profile, include_inputs=False)
    if made:  # the layers' own sizes back: only the cuts leave them out
        chain = dataclasses.replace(chain, layers=tuple(dataclasses.replace(layer, output_bytes=sizes[layer.name])
                                                        for layer in chain.layers))
    order = [m for layer in chain.layers for m in (layer.members or (layer.name,))]
    blocked = blocked_cuts(gm, order)
    if blocked:
        pos, cuts = 0, list(chain.cut_bytes)
        for i, layer in enumerate(chain.layers[:-1]):
            pos += len(layer.members or (layer.name,))
            if pos - 1 in blocked:
                cuts[i] = math.inf
        chain = dataclasses.replace(chain, cut_bytes=tuple(cuts))
    return state.replace(chain=chain)


__all__ = ["RULES", "cut_bytes", "linearize", "order_layers", "report", "run"]
