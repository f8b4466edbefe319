"""Parameter and buffer bytes per compute node: each tensor once, at its first user; and the
bytes of parameters an earlier node used already (tied weights)."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from pdcompile.passes.costs.nodes import COMPUTE_OPS

def _node_params(gm: fx.GraphModule, node: fx.Node) -> list[torch.nn.Parameter]:
    """The parameters a compute node uses: its module's, and those it reads as attributes."""
    params = list(gm.get_submodule(str(node.target)).parameters()) if node.op == "call_module" else []
    params += [t for a in node.all_input_nodes if a.op == "get_attr"
               for t in [_fetch_attr(gm, str(a.target))] if isinstance(t, torch.nn.Parameter)]
    return params


def shared_param_bytes(gm: fx.GraphModule) -> dict[fx.Node, int]:
    """Per compute node, bytes of the parameters it uses that an earlier node used already."""
    seen: set[int] = set()
    out: dict[fx.Node, int] = {}
    for node in gm.graph.nodes:
        if node.op not in COMPUTE_OPS:
            continue
        mine = {id(p): p for p in _node_params(gm, node)}
        out[node] = sum(p.numel() * p.element_size() for i, p in mine.items() if i in seen)
        seen.update(mine)
    return out


def tied_params(gm: fx.GraphModule) -> dict[fx.Node, tuple[tuple[str, int], ...]]:
    """Per compute node, (name, bytes) of each parameter it uses that another compute node uses too (tied
    weights: a GPT's embedding and LM head), named by the graph's first name for it: the parameters whose
    gradients the runtime sums across the stages holding them (split_stages' ``tied``)."""
    names: dict[int, str] = {}
    for name, p in gm.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    used: dict[fx.Node, dict[int, torch.nn.Parameter]] = {}
    users: dict[int, int] = {}
    for node in gm.graph.nodes:
        if node.op not in COMPUTE_OPS:
            continue
        used[node] = {id(p): p for p in _node_params(gm, node)}
        for i in used[node]:
            users[i] = users.get(i, 0) + 1
    return {node: tuple(sorted((names.get(i, f"param{i}"), p.numel() * p.element_size())
                               for i, p in mine.items() if users[i] > 1)) for node, mine in used.items()}


def param_attribution(gm: fx.GraphModule) -> dict[fx.Node, tuple[int, int]]:
    """(parameter bytes, buffer bytes) per compute node: each tensor once, at its first user;
    get_attr tensors go to the first compute node that reads them."""
    seen: set[int] = set()
    out: dict[fx.Node, tuple[int, int]] = {}

    def nbytes(t: torch.Tensor) -> int:
        if id(t) in seen:
            return 0
        seen.add(id(t))
        return t.numel() * t.element_size()

    for node in gm.graph.nodes:
        if node.op not in COMPUTE_OPS:
            continue
        pb = bb = 0
        if node.op == "call_module":
            mod = gm.get_submodule(str(node.target))
            pb += sum(nbytes(p) for p in mod.parameters())
            bb += sum(nbytes(b) for b in mod.buffers())
        for a in node.all_input_nodes:
            if a.op == "get_attr":
                t = _fetch_attr(gm, str(a.target))
                if isinstance(t, torch.nn.Parameter):
                    pb += nbytes(t)
                elif isinstance(t, torch.Tensor):
                    bb += nbytes(t)
        out[node] = (pb, bb)
    return out


def _fetch_attr(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def param_tensor_counts(gm: fx.GraphModule) -> dict[fx.Node, int]:
    """Trainable parameter tensors per compute node, each counted once at its first user (as
    :func:`param_attribution` attributes their bytes): what a split backward's weight pass computes a
    gradient for at that node (``OpCostTable.w_param_s``)."""
    seen: set[int] = set()
    out: dict[fx.Node, int] = {}

    def new(t: Any) -> int:
        if not isinstance(t, torch.nn.Parameter) or not t.requires_grad or id(t) in seen:
            return 0
        seen.add(id(t))
        return 1

    for node in gm.graph.nodes:
        if node.op not in COMPUTE_OPS:
            continue
        n = sum(new(p) for p in gm.get_submodule(str(node.target)).parameters()) if node.op == "call_module" else 0
        n += sum(new(_fetch_attr(gm, str(a.target))) for a in node.all_input_nodes if a.op == "get_attr")
        out[node] = n
    return out
