"""The :class:`~pdcompile.profile.Profile` of an annotated graph: one layer per compute node."""

from __future__ import annotations

import torch.fx as fx

from pdcompile.errors import PassError
from pdcompile.passes.costs.nodes import COMPUTE_OPS
from pdcompile.profile import Profile, ProfileInput, ProfileLayer

def profile_from_graph(gm: fx.GraphModule, *, batch_size: int, device: str,
                       name: str | None = None, optimizer: str = "sgd-momentum") -> Profile:
    """A :class:`Profile` of an annotated graph: one layer per call_module/call_function/
    call_method node, placeholders as model inputs, get_attr folded into readers, output node
    excluded (its arguments become ``Profile.outputs``)."""
    layers: list[ProfileLayer] = []
    inputs: list[ProfileInput] = []
    outputs: list[str] = []
    mode = "measured"
    for node in gm.graph.nodes:
        cost = node.meta.get("pd.cost")
        if node.op == "output":
            outputs = [a.name for a in node.all_input_nodes if a.op != "get_attr"]
            continue
        if cost is None:
            raise PassError(f"profile_from_graph: node {node.name!r} has no pd.cost; run "
                            f"annotate_costs first")
        if node.op == "placeholder":
            inputs.append(ProfileInput(node.name, float(cost.output_bytes), cost.output_bytes_expr,
                                       cost.tensor_output))
        elif node.op in COMPUTE_OPS:
            mode = cost.mode
            layers.append(ProfileLayer(
                name=node.name, op=_op_name(gm, node), forward_s=cost.forward_s,
                backward_s=cost.backward_s, output_bytes=float(cost.output_bytes),
                param_bytes=float(cost.param_bytes),
                inputs=tuple(dict.fromkeys(a.name for a in node.all_input_nodes
                                           if a.op != "get_attr")),
                desc=_desc(gm, node), buffer_bytes=float(cost.buffer_bytes),
                forward_flops=float(cost.forward_flops), backward_flops=float(cost.backward_flops),
                tensor_output=cost.tensor_output, output_bytes_expr=cost.output_bytes_expr,
                forward_flops_expr=cost.forward_flops_expr,
                backward_flops_expr=cost.backward_flops_expr, symbolic_note=cost.symbolic_note,
                saved_bytes=float(cost.saved_bytes), saved_input_bytes=float(cost.saved_input_bytes),
                saved_output_bytes=float(cost.saved_output_bytes),
                shared_param_bytes=float(cost.shared_param_bytes),
                tied_params=tuple((n, float(b)) for n, b in getattr(cost, "tied_params", ())),
                param_tensors=int(getattr(cost, "param_tensors", 0)),
                input_grad_s=cost.input_grad_s, weight_grad_s=cost.weight_grad_s,
                selective_saved_bytes=float(cost.selective_saved_bytes),
                selective_recompute_s=float(cost.selective_recompute_s),
                selective_rebuilt_bytes=float(cost.selective_rebuilt_bytes),
                resaved_bytes=float(cost.resaved_bytes),
                forward_fixed_s=float(cost.forward_fixed_s), backward_fixed_s=float(cost.backward_fixed_s),
            ))
    return Profile(layers=tuple(layers), batch_size=batch_size, device=device,
                   name=name or type(gm).__name__, mode=mode, optimizer=optimizer,
                   inputs=tuple(inputs), outputs=tuple(dict.fromkeys(outputs)))


def _op_name(gm: fx.GraphModule, node: fx.Node) -> str:
    if node.op == "call_module":
        return type(gm.get_submodule(str(node.target))).__name__
    if node.op == "call_method":
        return f".{node.target}"
    return getattr(node.target, "__name__", str(node.target))


def _desc(gm: fx.GraphModule, node: fx.Node) -> str:
    if node.op == "call_module":
        return f"{node.target}: {gm.get_submodule(str(node.target))!r}".replace("\n", " ")[:200]
    return f"{node.op} {getattr(node.target, '__qualname__', node.target)}"
