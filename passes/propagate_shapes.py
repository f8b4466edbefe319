"""The ``propagate-shapes`` pass: run the graph once on example inputs and record every value's meta.

It only writes ``node.meta["pd.tensor"]`` (fx's own ``tensor_meta`` is kept too): a
:class:`pdcompile.ir.TensorMeta`, a tuple/dict of them for nodes that produce containers (an
LSTM's ``(output, (h, c))``), or ``None`` for non-tensor values. ``nbytes`` is
``numel * element_size`` of the real dtype. Printed, a node reads
``%fc1 : call_module[target=fc1](args = (%x,))  # float32[8,32]``.
"""

from __future__ import annotations

import contextlib
import io
from typing import Any

import torch
import torch.fx as fx
from torch.fx.passes.shape_prop import ShapeProp

from pdcompile.ir import CompileState, TensorMeta, need


def tensor_meta_of(value: Any) -> Any:
    """TensorMeta (or a tuple/dict of them, None for non-tensors) describing ``value``."""
    if isinstance(value, torch.Tensor):
        return TensorMeta(
            shape=tuple(int(s) for s in value.shape),
            dtype=str(value.dtype),
            nbytes=int(value.numel() * value.element_size()),
            requires_grad=bool(value.is_floating_point() or value.is_complex()),
        )
    if isinstance(value, (tuple, list)):
        return tuple(tensor_meta_of(v) for v in value)
    if isinstance(value, dict):
        return {k: tensor_meta_of(v) for k, v in value.items()}
    return None


class _PdShapeProp(ShapeProp):
    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        n.meta["pd.tensor"] = tensor_meta_of(result)
        return result


def propagate_shapes(gm: fx.GraphModule, example_inputs: tuple[Any, ...]) -> fx.GraphModule:
    """Annotate every node of ``gm`` with ``pd.tensor`` by running it on ``example_inputs``."""
    # ShapeProp prints the failing node's traceback to stderr before re-raising; the pass runner
    # reports the error itself (one line naming the pass), so keep stderr clean.
    with torch.no_grad(), contextlib.redirect_stderr(io.StringIO()):
        _PdShapeProp(gm).propagate(*example_inputs)
    return gm


def run(state: CompileState) -> CompileState:
    """Annotates ``gm`` (on ``example_inputs``)."""
    return state.replace(gm=propagate_shapes(need(state.gm, "gm"), state.graph_inputs))


def format_graph_with_shapes(gm: fx.GraphModule) -> str:
    """The graph, one node per line, each with its ``pd.tensor`` annotation."""
    lines = []
    for n in gm.graph.nodes:
        meta = n.meta.get("pd.tensor")
        lines.append(f"{n.format_node() or n.name}  # {_fmt(meta)}")
    return "\n".join(lines)


def _fmt(meta: Any) -> str:
    if isinstance(meta, TensorMeta):
        return str(meta)
    if isinstance(meta, tuple):
        return "(" + ", ".join(_fmt(m) for m in meta) + ")"
    if isinstance(meta, dict):
        return "{" + ", ".join(f"{k}: {_fmt(v)}" for k, v in meta.items()) + "}"
    return "-"
