"""Symbolic costs: output bytes and FLOPs re-measured at other batch sizes and fitted as
``slope*b + intercept`` (checked at further sizes; a table where not affine)."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from pdcompile.errors import UsageError
from pdcompile.ir import meta_bytes
from pdcompile.passes.costs.flops import node_flops
from pdcompile.passes.costs.nodes import COMPUTE_OPS, NodeCall, call_key, capture, output_meta

FIT_BATCH_SIZES = (2, 3)
CHECK_BATCH_SIZES = (5,)

def resize_batch(value: Any, b: int) -> Any:
    """``value`` with dim 0 resized to ``b`` by repeating its rows (tokens stay valid)."""
    if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] > 0:
        idx = torch.arange(b, device=value.device) % value.shape[0]
        return value.index_select(0, idx)
    return value


def batch_size_of(inputs: Sequence[Any]) -> int:
    for v in inputs:
        if isinstance(v, torch.Tensor) and v.dim() >= 1:
            return int(v.shape[0])
    raise UsageError("no tensor input with a batch dimension; pass batch_size= explicitly")


def _sizes_at(gm: fx.GraphModule, inputs: Sequence[Any], nodes: Sequence[fx.Node],
              flops: bool) -> dict[fx.Node, tuple[int, int, int]]:
    """(output bytes, forward FLOPs, backward FLOPs) of every node, at the batch of ``inputs``."""
    values = capture(gm, inputs)
    out: dict[fx.Node, tuple[int, int, int]] = {}
    counted: dict[Any, tuple[int, int]] = {}  # by call_key: a repeated layer's twins are counted once
    for node in nodes:
        nb = meta_bytes(output_meta(values.get(node)))
        ff = bf = 0
        if flops and node.op in COMPUTE_OPS:
            key = call_key(node, values)
            if key is None or key not in counted:
                ff, bf, _ = node_flops(NodeCall(gm, node, values), values)
                if key is not None:
                    counted[key] = (ff, bf)
            ff, bf = counted.get(key, (ff, bf))
        out[node] = (nb, ff, bf)
    return out


def _fit(points: dict[int, int], fit: Sequence[int]) -> tuple[str | None, str]:
    """An affine expression of ``b`` through the ``fit`` points, checked on the rest; else a
    Piecewise table of all points and a note."""
    import sympy

    b = sympy.Symbol("b", positive=True, integer=True)
    b0, b1 = fit[0], fit[1]
    slope = sympy.Rational(points[b1] - points[b0], b1 - b0)
    icpt = points[b0] - slope * b0
    expr = sympy.expand(slope * b + icpt)
    if all(expr.subs(b, k) == v for k, v in points.items()):
        return str(expr), ""
    table = sympy.Piecewise(*[(v, sympy.Eq(b, k)) for k, v in sorted(points.items())],
                            (sympy.nan, True))
    return str(table), f"not affine in b: table at b in {sorted(points)}"


def symbolic_costs(gm: fx.GraphModule, inputs: tuple[Any, ...], nodes: list[fx.Node],
              batch_fn: Callable[[int], Sequence[Any]] | None
              ) -> dict[fx.Node, tuple[str | None, str | None, str | None, str]]:
    """Per node: output-bytes, forward- and backward-FLOPs expressions of ``b``, and a note."""
    try:
        b_ex = batch_size_of(inputs)
    except UsageError:
        return {}
    make = batch_fn or (lambda b: tuple(resize_batch(v, b) for v in inputs))
    sizes = sorted(set(FIT_BATCH_SIZES) | set(CHECK_BATCH_SIZES) | {b_ex})
    measured: dict[int, dict[fx.Node, tuple[int, int, int]]] = {}
    for b in sizes:
        try:
            measured[b] = _sizes_at(gm, inputs if b == b_ex and batch_fn is None else make(b),
                                    nodes, flops=True)
        except Exception as e:  # noqa: BLE001 - a model that only runs at its own batch size
            note = f"no symbolic costs: the graph fails at batch size {b} ({type(e).__name__})"
            return {n: (None, None, None, note) for n in nodes}
    out = {}
    for node in nodes:
        res = []
        notes = []
        for k in range(3):
            expr, note = _fit({b: measured[b][node][k] for b in sizes}, FIT_BATCH_SIZES)
            res.append(expr)
            if note:
                notes.append(("bytes", "forward flops", "backward flops")[k] + " " + note)
        out[node] = (res[0], res[1], res[2], "; ".join(notes))
    return out
