"""A node's backward split into its two parts, the input gradients (``B``) and the weight
gradients (``W``): timed each on its own where both exist, else apportioned by FLOPs."""

from __future__ import annotations

from typing import Any

import torch

from pdcompile.passes.costs.flops import count_flops
from pdcompile.passes.costs.nodes import NodeCall

def splits(call: NodeCall) -> bool:
    """Whether the node's backward has both parts: gradients of inputs and of parameters."""
    return 0 < len(call.leaves) < len(call.grad_inputs)


def input_grad_flop_share(call: NodeCall, out: Any, backward_flops: int) -> float:
    """The input gradients' share of the node's backward FLOPs (counted by ``FlopCounterMode`` on
    each part; a recurrent leaf, which the counter can't see into, 0.5; no parameters: 1)."""
    if not splits(call):
        return 1.0 if call.leaves else 0.0
    if backward_flops <= 0:
        return 0.5
    with torch.enable_grad():
        part = call.backward_fn(out, "inputs")
        flops = count_flops(part)[0] if part is not None else 0
    return min(1.0, flops / backward_flops) if flops else 0.5


def split_parts(backward_s: float, input_share: float, weight_pass_s: float = 0.0) -> dict[str, float]:
    """The backward's two parts by ``input_share``; the weight part also pays ``weight_pass_s``, what running
    it apart costs beyond its share (a calibrated cost per parameter tensor: ``OpCostTable.w_param_s``)."""
    return {"input_grad_s": backward_s * input_share,
            "weight_grad_s": backward_s * (1.0 - input_share) + weight_pass_s}


def measured_parts(medians: dict[tuple[Any, str], float], node: Any, backward_s: float, whole_share: float,
                   call_overhead: float) -> dict[str, float]:
    """A measured node's two parts: each timed on its own (keys ``(node, "in")``, ``(node, "w")``),
    less the call's fixed cost, which each part pays once too; else its whole backward given to the one
    part it has (``whole_share``: 1 inputs only, 0 parameters only)."""
    if (node, "in") in medians:
        return {"input_grad_s": max(0.0, medians[(node, "in")] - call_overhead),
                "weight_grad_s": max(0.0, medians[(node, "w")] - call_overhead)}
    return split_parts(backward_s, whole_share)
