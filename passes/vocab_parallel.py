"""The vocabulary-parallel part of the ``tensor-parallel`` pass: which embeddings and which LM head a
stage splits by vocabulary, and the loss check that allows the head's split.

Megatron's layout splits the token embedding's rows (each of the ``t`` ranks holds ``V / t`` of the
vocabulary; torch's ``RowwiseParallel`` on an ``nn.Embedding``: ids outside a rank's rows give zeros,
and the ranks' outputs are summed) and the LM head's output features (``ColwiseParallel``, its logits
left sharded on the last dimension), which only a cross-entropy computed on the shards can read:
torch's ``loss_parallel`` does that for ``aten._log_softmax`` and ``aten.nll_loss_forward`` on a
DTensor sharded on the class dimension. So the head is split only where the traced loss is a plain
cross-entropy over the logits (:func:`cross_entropy_why`); anything else keeps the head whole, and the
plan says why. Position embeddings (indices that are no stage input) stay whole, as in Megatron.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx

if TYPE_CHECKING:
    from pdcompile.passes.trace_loss import LossProgram

_RESHAPES = {"view", "reshape", "_unsafe_view", "flatten", "contiguous", "alias", "clone", "float", "to",
             "_to_copy", "type_as"}


def _name(node: fx.Node) -> str:
    if node.op == "call_method":
        return str(node.target)
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return t._schema.name.split("::")[-1]
    return str(getattr(t, "__name__", t))


def _arg(node: fx.Node, i: int, name: str, default: Any = None) -> Any:
    return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)


def _keeps_last(node: fx.Node, ndim: int, vocab: int) -> int | None:
    """The rank of ``node``'s output where it only reshapes (or casts) its input of rank ``ndim`` and keeps
    the last dimension, of size ``vocab``, whole and last; else None."""
    name = _name(node)
    if name in ("contiguous", "alias", "clone", "float", "to", "_to_copy", "type_as"):
        return ndim
    if name == "flatten":
        start, end = int(_arg(node, 1, "start_dim", 0)), int(_arg(node, 2, "end_dim", -1))
        start, end = start % ndim, end % ndim
        return ndim - (end - start) if end < ndim - 1 else None
    sizes: Any = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (list, tuple)) else node.args[1:]
    sizes = list(sizes)
    if sizes and isinstance(sizes[-1], int) and sizes[-1] == vocab:
        return len(sizes)
    return None


def cross_entropy_why(loss: LossProgram | None, ndim: int, vocab: int) -> str | None:
    """None where ``loss`` is a plain cross-entropy over the logits (of rank ``ndim``, ``vocab`` classes
    last): the output only reshaped to ``(N, vocab)`` into ``F.cross_entropy`` (no weight, no label
    smoothing, mean or sum) or ``aten._log_softmax`` over the classes then ``aten.nll_loss_forward``, whose
    value is the loss; else why not (the LM head then stays whole)."""
    if loss is None:
        return "the loss is not known when it is split (no example_target=); the head stays whole"
    if loss.traced is None:
        return "the loss is not traced (rebuilt by class path), so it is no plain cross-entropy over the logits"
    graph = loss.traced.gm.graph
    places = [n for n in graph.nodes if n.op == "placeholder"]
    if not places:
        return "the loss reads no logits"
    ranks: dict[fx.Node, int] = {places[0]: ndim}
    result: fx.Node | None = None
    for node in graph.nodes:
        ins = [a for a in node.all_input_nodes if a in ranks]
        if not ins or node.op == "output":
            continue
        name = _name(node)
        x = node.args[0] if node.args else None
        if not isinstance(x, fx.Node) or ins != [x] or len(x.users) != 1:
            return f"the loss combines the logits with other values ({node.name}), not a plain cross-entropy"
        if name in _RESHAPES:
            k = _keeps_last(node, ranks[x], vocab)
            if k is None:
                return f"the loss reshapes the logits' vocabulary dimension ({node.name})"
            ranks[node] = k
            continue
        if ranks[x] != 2:
            return f"{node.name} ({name}) reads logits of rank {ranks[x]}; a plain cross-entropy over (N, vocab) splits"
        if name == "cross_entropy" and node.op == "call_function":
            if (_arg(node, 2, "weight") is not None or float(_arg(node, 7, "label_smoothing", 0.0) or 0.0) != 0.0
                    or _arg(node, 3, "size_average") is not None or _arg(node, 5, "reduce") is not None
                    or _arg(node, 6, "reduction", "mean") not in ("mean", "sum")):
                return "the loss is a cross-entropy with class weights, label smoothing or no reduction"
            result = node
        elif name == "_log_softmax" and int(node.args[1]) in (1, -1) and len(node.users) == 1:
            nll = next(iter(node.users))
            if _name(nll) != "nll_loss_forward" or nll.args[0] is not node or nll.args[2] is not None \
                    or int(nll.args[3]) not in (1, 2):
                return f"the log-softmax {node.name} feeds no plain nll_loss (class weights, no reduction)"
            item = [u for u in nll.users if u.op == "call_function" and u.target is operator.getitem and u.args[1] == 0]
            if len(item) != 1:
                return "the nll_loss's value is not the loss"
            result = item[0]
            return _is_result(graph, result)
        else:
            return f"the loss computes {name} on the logits ({node.name}), not a plain cross-entropy"
        return _is_result(graph, result)
    return "the loss does not read the logits through a cross-entropy"


def _is_result(graph: fx.Graph, node: fx.Node) -> str | None:
    out = next(n for n in graph.nodes if n.op == "output")
    if out.args[0] is node:
        return None
    return "the loss does more than a cross-entropy over the logits (its value is changed after it)"


def embedding_weight(gm: fx.GraphModule, node: fx.Node, refs: Mapping[Any, int]) -> tuple[torch.Tensor | None, str]:
    """(weight, "") of an embedding node the vocabulary split can take (an ``nn.Embedding`` call, or
    ``aten.embedding`` on a weight attribute nothing else reads), else (None, why not)."""
    if node.op == "call_module":
        m = gm.get_submodule(str(node.target))
        if type(m) is not torch.nn.Embedding:
            return None, f"{node.name}: a {type(m).__name__}, not an nn.Embedding"
        if m.padding_idx is not None or m.max_norm is not None or m.scale_grad_by_freq or m.sparse:
            return None, f"{node.name}: an embedding with padding_idx, max_norm or sparse gradients stays whole"
        return m.weight, ""
    if node.op == "call_function" and node.target is torch.ops.aten.embedding.default:
        w = node.args[0]
        extra = list(node.args[2:])
        if extra and (extra[0] != -1 or any(bool(e) for e in extra[1:])):
            return None, f"{node.name}: an embedding with padding_idx or sparse gradients stays whole"
        if not (isinstance(w, fx.Node) and w.op == "get_attr" and len(w.users) == 1
                and refs.get(w.target, 0) == 1 + len(_device_reads(gm.graph, w))):
            return None, f"{node.name}: its weight is read by another node of the stage too"
        obj: Any = gm
        for part in str(w.target).split("."):
            obj = getattr(obj, part)
        if not isinstance(obj, torch.nn.Parameter) or obj.dim() != 2:
            return None, f"{node.name}: its weight is no 2-d parameter"
        return obj, ""
    return None, f"{node.name}: an embedding call the pass does not read"


def _device_reads(graph: fx.Graph, w: fx.Node) -> list[fx.Node]:
    """The other reads of ``w``'s attribute that only take its device (split-stages' ``stage_device``)."""
    return [n for n in graph.nodes if n.op == "get_attr" and n.target == w.target and n is not w and n.users
            and all(u.op == "call_function" and u.target is getattr and u.args[1:] == ("device",) for u in n.users)]


def free_module_name(gm: fx.GraphModule, weight_target: str, suffix: str) -> str:
    """A name no attribute of ``gm`` has, for the module that takes over the weight attribute ``weight_target``
    (``layer_weight`` -> ``layer``; any other name gets ``suffix``), numbered where taken."""
    base = weight_target[: -len("_weight")] if weight_target.endswith("_weight") and len(weight_target) > 7 \
        else weight_target + suffix
    name, i = base, 1
    while hasattr(gm, name):
        name, i = f"{base}_{i}", i + 1
    return name


def as_embedding(gm: fx.GraphModule, node: fx.Node, param_names: dict[str, str]) -> str:
    """The module name of an embedding node; ``aten.embedding`` on a weight attribute becomes a call of a
    new ``nn.Embedding`` holding the same parameter (``param_names`` follows the new name)."""
    if node.op == "call_module":
        return str(node.target)
    w_node = node.args[0]
    assert isinstance(w_node, fx.Node)
    name = free_module_name(gm, str(w_node.target), "_embedding")
    obj: Any = gm
    for part in str(w_node.target).split("."):
        obj = getattr(obj, part)
    emb: Any = torch.nn.Embedding(obj.shape[0], obj.shape[1], device="meta", dtype=obj.dtype)
    emb.weight = obj
    gm.add_submodule(name, emb)
    param_names[f"{name}.weight"] = param_names.pop(str(w_node.target), str(w_node.target))
    for read in _device_reads(gm.graph, w_node):  # the device read from the module's weight now
        read.target = f"{name}.weight"
    with gm.graph.inserting_before(node):
        call = gm.graph.call_module(name, (node.args[1],))
    call.meta = dict(node.meta)
    node.replace_all_uses_with(call)
    gm.graph.erase_node(node)
    if not w_node.users:
        gm.graph.erase_node(w_node)
        target = str(w_node.target)
        if "." not in target and hasattr(gm, target):
            delattr(gm, target)
    return name
