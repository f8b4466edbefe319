"""FLOP counting: ``FlopCounterMode`` over a node's forward and backward (a grouped convolution's
backward counted right), recurrent leaves by formula (:func:`rnn_flops`)."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch.utils.flop_counter import FlopCounterMode, conv_flop_count, sdpa_backward_flop_count, sdpa_flop_count

from pdcompile.passes.costs.nodes import NodeCall, flat_tensors

def _conv_backward_flop(grad_out_shape: Any, x_shape: Any, w_shape: Any, _bias: Any,
                        _stride: Any, _padding: Any, _dilation: Any, transposed: bool,
                        _output_padding: Any, _groups: Any, output_mask: Sequence[bool],
                        out_shape: Any = None, **kwargs: Any) -> int:
    """Convolution backward: the input gradient and the weight gradient each take exactly the
    multiplications of the forward convolution. (torch's own formula over-counts the weight
    gradient of a grouped convolution by the number of groups.)"""
    fwd = conv_flop_count(list(x_shape), list(w_shape), list(grad_out_shape), transposed)
    return fwd * (int(bool(output_mask[0])) + int(bool(output_mask[1])))


def _sdpa_cpu_flop(q_shape: Any, k_shape: Any, v_shape: Any, *args: Any, **kwargs: Any) -> int:
    """CPU attention (``scaled_dot_product_attention``'s flash kernel for CPU, which torch's table lacks):
    the two batched matmuls, as torch counts its GPU kernels."""
    return int(sdpa_flop_count(q_shape, k_shape, v_shape))


def _sdpa_cpu_backward_flop(grad_shape: Any, q_shape: Any, k_shape: Any, v_shape: Any, *args: Any,
                            **kwargs: Any) -> int:
    return int(sdpa_backward_flop_count(grad_shape, q_shape, k_shape, v_shape))


_FLOP_OVERRIDES: dict[Any, Any] = {torch.ops.aten.convolution_backward: _conv_backward_flop}
for _name, _fn in (("_scaled_dot_product_flash_attention_for_cpu", _sdpa_cpu_flop),
                   ("_scaled_dot_product_flash_attention_for_cpu_backward", _sdpa_cpu_backward_flop)):
    if hasattr(torch.ops.aten, _name):
        _FLOP_OVERRIDES[getattr(torch.ops.aten, _name)] = _fn


def count_flops(fn: Callable[[], Any]) -> tuple[int, Any]:
    with FlopCounterMode(display=False, custom_mapping=_FLOP_OVERRIDES) as counter:
        result = fn()
    return int(counter.get_total_flops()), result


def rnn_flops(module: torch.nn.RNNBase, input_shape: Sequence[int]) -> int:
    """Forward FLOPs of an ``nn.LSTM``/``GRU``/``RNN`` on an input of ``input_shape``: per step,
    layer and direction, ``2 * batch * gates * hidden * (in + hidden)`` for the two matmuls (plus
    the projection of an LSTM with ``proj_size``). Elementwise gate math is not counted, as
    FlopCounterMode doesn't count it elsewhere either."""
    gates = {"LSTM": 4, "GRU": 3}.get(module.mode, 1)
    if len(input_shape) == 2:
        steps, batch = input_shape[0], 1
    elif module.batch_first:
        batch, steps = input_shape[0], input_shape[1]
    else:
        steps, batch = input_shape[0], input_shape[1]
    dirs = 2 if module.bidirectional else 1
    h = module.hidden_size
    proj = getattr(module, "proj_size", 0) or 0
    h_out = proj or h
    total = 0
    for layer in range(module.num_layers):
        inp = module.input_size if layer == 0 else h_out * dirs
        per_step = 2 * batch * gates * h * (inp + h_out) + (2 * batch * h * proj if proj else 0)
        total += dirs * steps * per_step
    return total


def node_flops(call: NodeCall, values: dict[fx.Node, Any]) -> tuple[int, int, Any]:
    """Forward and backward FLOPs of one node, and its output (computed with grad)."""
    with torch.enable_grad():
        fwd, out = count_flops(call.forward)
        bwd_fn = call.backward_fn(out)
        bwd = count_flops(bwd_fn)[0] if bwd_fn is not None else 0
    if isinstance(call.module, torch.nn.RNNBase) and fwd == 0:
        x = next((v for v in flat_tensors(call.args)), None)
        if x is not None:
            fwd = rnn_flops(call.module, tuple(x.shape))
            # backward: gradient w.r.t. inputs and w.r.t. weights, each as costly as forward
            bwd = 2 * fwd if bwd_fn is not None else 0
    return fwd, bwd, out
