"""Running single nodes of a traced graph: the values a full forward feeds each node, and one node
callable again and again on fresh copies of them (what timing, FLOP counting and the I/W split
run)."""

from __future__ import annotations

import weakref
from typing import Any, Callable, Iterator, Sequence, cast

import torch
import torch.fx as fx

COMPUTE_OPS = ("call_module", "call_function", "call_method")


class _Capture(fx.Interpreter):
    """Runs the graph once and keeps every node's value (under no_grad: values only)."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.values: dict[fx.Node, Any] = {}

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        self.values[n] = result
        return result


def capture(gm: fx.GraphModule, inputs: Sequence[Any]) -> dict[fx.Node, Any]:
    cap = _Capture(gm)
    with torch.no_grad():
        cap.run(*inputs)
    return cap.values


def flat_tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from flat_tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from flat_tensors(v)


def _is_inplace(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether ``node`` writes an argument in place, as split-stages reads it (an aten op's schema,
    ``x.add_``, ``x += y``, ``inplace=True``, a module's ``inplace``): its leaves are cloned before each call."""
    from pdcompile.passes.split_stages import writes_in_place

    return bool(writes_in_place(node, gm))


_GRAD_NODES: "weakref.WeakKeyDictionary[fx.GraphModule, tuple[int, int, frozenset[fx.Node]]]" = weakref.WeakKeyDictionary()


def grad_nodes(gm: fx.GraphModule) -> frozenset[fx.Node]:
    """The nodes whose value depends on a trainable parameter: in the model's forward only they require grad
    (a router's ``histc`` of expert indices does not, and its ``cumsum(dtype=int32)`` runs only so)."""
    key = (id(gm.graph), len(gm.graph.nodes))
    cached = _GRAD_NODES.get(gm)
    if cached is not None and cached[:2] == key:
        return cached[2]
    from pdcompile.passes.split_stages import nodes_needing_grad

    names = nodes_needing_grad(gm)
    found = frozenset(n for n in gm.graph.nodes if n.name in names)
    _GRAD_NODES[gm] = (*key, found)
    return found


class NodeCall:
    """One node, callable again and again on fresh copies of the inputs it saw."""

    def __init__(self, gm: fx.GraphModule, node: fx.Node, values: dict[fx.Node, Any]) -> None:
        self.node = node
        self.inplace = _is_inplace(gm, node)
        self.module = gm.get_submodule(str(node.target)) if node.op == "call_module" else None
        self.leaves: list[torch.Tensor] = []
        grad_ok = {}
        needs_grad = grad_nodes(gm)

        def leaf(a: fx.Node) -> Any:
            v = values[a]
            if not isinstance(v, torch.Tensor):
                return v
            if a.op == "get_attr":  # a parameter or buffer: used as is
                return v
            if a in needs_grad and (v.is_floating_point() or v.is_complex()):
                if a not in grad_ok:
                    grad_ok[a] = v.detach().clone().requires_grad_(True)
                    self.leaves.append(grad_ok[a])
                return grad_ok[a]
            return v.detach()

        self.args = fx.node.map_arg(node.args, leaf)
        self.kwargs = fx.node.map_arg(node.kwargs, leaf)
        params = list(self.module.parameters()) if self.module is not None else []
        params += [v for v in flat_tensors((self.args, self.kwargs))
                   if isinstance(v, torch.nn.Parameter)]
        self.grad_inputs = [t for t in self.leaves] + [p for p in dict.fromkeys(params) if p.requires_grad]
        self.gm = gm

    def _fresh(self) -> tuple[Any, Any]:
        if not self.inplace:
            return self.args, self.kwargs
        clone = lambda v: v.clone() if isinstance(v, torch.Tensor) and v.requires_grad and v.is_leaf and not isinstance(v, torch.nn.Parameter) else v  # noqa: E731
        return (fx.node.map_aggregate(self.args, clone), fx.node.map_aggregate(self.kwargs, clone))

    def forward(self) -> Any:
        args, kwargs = self._fresh()
        n = self.node
        if n.op == "call_module":
            return cast(torch.nn.Module, self.module)(*args, **kwargs)
        if n.op == "call_function":
            return cast(Callable[..., Any], n.target)(*args, **kwargs)
        self_obj, *rest = args
        return getattr(self_obj, str(n.target))(*rest, **kwargs)

    def backward_fn(self, out: Any, wrt: str = "all") -> Callable[[], Any] | None:
        """A closure running this node's backward once (None if nothing to differentiate): with
        respect to its differentiable inputs and parameters (``wrt="all"``), or only its inputs
        (``"inputs"``: a split backward's ``B``) or only its parameters (``"params"``: its ``W``)."""
        outs = [t for t in flat_tensors(out) if t.requires_grad]
        n_in = len(self.leaves)
        inputs = {"all": self.grad_inputs, "inputs": self.grad_inputs[:n_in],
                  "params": self.grad_inputs[n_in:]}[wrt]
        if not outs or not inputs:
            return None
        grads = [torch.ones_like(t) for t in outs]

        def run() -> Any:
            return torch.autograd.grad(outs, inputs, grads, retain_graph=True, allow_unused=True)

        return run


def output_meta(value: Any) -> Any:
    from pdcompile.passes.propagate_shapes import tensor_meta_of

    return tensor_meta_of(value)


class _Uncacheable(Exception):
    """A value :func:`call_key` can't describe exactly: the node is counted on its own."""


def _value_key(v: Any) -> Any:
    """``v`` described by everything a call's FLOP count and backward can depend on: a tensor's
    class, layout, shape, strides, offset, dtype, device and autograd flags (not its data); a Python value exactly,
    tagged with its type (``1``, ``True`` and ``1.0`` differ; floats by ``float.hex``)."""
    if isinstance(v, torch.Tensor):
        return ("T", type(v), v.layout, tuple(v.shape), tuple(v.stride()), v.storage_offset(), v.dtype, v.device,
                v.requires_grad, v.is_leaf, isinstance(v, torch.nn.Parameter))
    if isinstance(v, (tuple, list)):
        return (type(v).__name__, tuple(_value_key(x) for x in v))
    if isinstance(v, dict):
        return ("dict", tuple((_value_key(k), _value_key(x)) for k, x in v.items()))
    if isinstance(v, float):
        return ("float", v.hex())
    if isinstance(v, slice):
        return ("slice", _value_key(v.start), _value_key(v.stop), _value_key(v.step))
    if v is None or v is Ellipsis or isinstance(v, (bool, int, str, torch.dtype, torch.device, torch.layout,
                                                   torch.memory_format)):
        return (type(v).__name__, v)
    raise _Uncacheable(type(v).__name__)


def call_key(node: fx.Node, values: dict[fx.Node, Any]) -> Any:
    """A hashable description of what :class:`NodeCall` of ``node`` would run, such that two nodes
    with the same key have the same forward and backward FLOP counts (None: not described; count it).

    For ``call_function``/``call_method`` nodes only (a module's call depends on its attributes): the
    target, the arguments with each input node as the position of its first use in this call (``x * x``
    differs from ``x * y``), what kind of node made it (a parameter read, a graph input, an activation that
    depends on a parameter or one that does not: :class:`NodeCall` treats each differently) and :func:`_value_key` of its value; and the node's own
    output's description (an output whose shape depends on the data is in the key too). A Llama's
    decoder layers repeat one another node for node, so their calls are counted once."""
    if node.op not in ("call_function", "call_method"):
        return None
    first: dict[fx.Node, int] = {}
    needs_grad = grad_nodes(node.graph.owning_module) if node.graph.owning_module is not None else frozenset()

    def walk(a: Any) -> Any:
        if isinstance(a, fx.Node):
            kind = "attr" if a.op == "get_attr" else "input" if a.op == "placeholder" else \
                "value" if a in needs_grad else "constant value"
            return ("node", first.setdefault(a, len(first)), kind, _value_key(values[a]))
        if isinstance(a, (tuple, list)):
            return (type(a).__name__, tuple(walk(x) for x in a))
        if isinstance(a, dict):
            return ("dict", tuple((_value_key(k), walk(x)) for k, x in a.items()))
        return ("const", _value_key(a))

    try:
        key = (node.op, node.target, walk(node.args), walk(node.kwargs), _value_key(values.get(node)))
        hash(key)
    except Exception:  # noqa: BLE001 - _Uncacheable, unhashable, a tensor without strides (sparse): counted
        return None
    return key
