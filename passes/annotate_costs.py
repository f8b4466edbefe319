"""The ``annotate-costs`` pass: what every node of a traced model costs, measured or analytic,
with activation bytes and FLOPs as sympy expressions of the microbatch size ``b``.

Each node gets ``node.meta["pd.cost"]`` (a :class:`NodeCost`; :func:`format_costs` prints one a
line). **measured**: the node called on copies of its real inputs, forward and its own backward
(``torch.autograd.grad``) timed, the smallest of several visits' medians. **analytic**: FLOPs
from ``FlopCounterMode`` (recurrent leaves by :func:`rnn_flops`) over a :class:`DeviceSpec`
roofline, the same on every machine. **symbolic**: bytes and FLOPs refitted at other batch sizes
as ``slope*b + intercept``. Details in :func:`annotate_costs`. :func:`run` also builds the Profile.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator, Sequence, cast

import torch
import torch.fx as fx
from torch.utils.flop_counter import FlopCounterMode, conv_flop_count

from pdcompile.cluster import ClusterSpec
from pdcompile.errors import PassError, UsageError
from pdcompile.ir import CompileState, TensorMeta, meta_bytes, need
from pdcompile.profile import Profile, ProfileInput, ProfileLayer, optimizer_state_factor
from pdcompile.runtime.recompute import FlopOutputs
from pdcompile.runtime.timing import sync

MODES = ("measured", "analytic")
FIT_BATCH_SIZES = (2, 3)
CHECK_BATCH_SIZES = (5,)


@dataclass(frozen=True)
class DeviceSpec:
    """A device for analytic costs: dense peak FLOP/s, memory bandwidth (B/s), and the fraction
    of each a real kernel reaches."""

    name: str
    peak_flops: float
    mem_bandwidth: float = 0.0  # 0: ignore memory traffic
    efficiency: float = 0.5
    bandwidth_efficiency: float = 0.7

    def seconds(self, flops: float, nbytes: float = 0.0) -> float:
        compute = flops / (self.peak_flops * self.efficiency)
        memory = nbytes / (self.mem_bandwidth * self.bandwidth_efficiency) if self.mem_bandwidth else 0.0
        return max(compute, memory)

    def __str__(self) -> str:
        return (f"{self.name}: {self.peak_flops / 1e12:.1f} TFLOP/s x {self.efficiency}, "
                f"{self.mem_bandwidth / 1e9:.0f} GB/s x {self.bandwidth_efficiency}")


#: Published dense FP32 (TF32 for A100/H100/H200 tensor cores not assumed) peaks and HBM bandwidth.
DEVICE_SPECS: dict[str, DeviceSpec] = {
    "cpu": DeviceSpec("cpu", 100e9, 20e9),
    "v100": DeviceSpec("v100", 15.7e12, 900e9),
    "a100": DeviceSpec("a100", 19.5e12, 1.555e12),
    "h100": DeviceSpec("h100", 67e12, 3.35e12),
    "h200": DeviceSpec("h200", 67e12, 4.8e12),
}


def resolve_device_spec(spec: DeviceSpec | str | None) -> DeviceSpec:
    """A DeviceSpec from itself, a name in :data:`DEVICE_SPECS`, or None (``"cpu"``)."""
    if spec is None:
        return DEVICE_SPECS["cpu"]
    if isinstance(spec, DeviceSpec):
        return spec
    try:
        return DEVICE_SPECS[spec.lower()]
    except KeyError:
        raise UsageError(f"unknown device spec {spec!r}; use one of {sorted(DEVICE_SPECS)} "
                         f"or pass a DeviceSpec") from None


@dataclass(frozen=True)
class NodeCost:
    """``node.meta["pd.cost"]``: one node's costs at the example batch size."""

    forward_s: float = 0.0
    backward_s: float = 0.0
    forward_flops: int = 0
    backward_flops: int = 0
    output_bytes: int = 0
    param_bytes: int = 0
    buffer_bytes: int = 0
    optimizer_bytes: float = 0.0
    mode: str = "measured"
    tensor_output: bool = True
    output_bytes_expr: str | None = None
    forward_flops_expr: str | None = None
    backward_flops_expr: str | None = None
    symbolic_note: str = ""
    # what autograd saves for backward (saved-tensor hooks, :func:`saved_tensor_bytes`)
    saved_bytes: int = 0
    saved_input_bytes: int = 0
    saved_output_bytes: int = 0
    shared_param_bytes: int = 0  # parameters an earlier node uses too (tied: a later stage holds a copy)
    # a split backward's parts: gradients of the inputs only, of the parameters only (None: not known)
    input_grad_s: float | None = None
    weight_grad_s: float | None = None
    # under selective recomputation (runtime/recompute.py): the bytes that stay saved per microbatch
    # (the cached outputs of its FLOP-counted ops) and the forward time rebuilt at backward
    selective_saved_bytes: int = 0
    selective_recompute_s: float = 0.0
    selective_rebuilt_bytes: int = 0  # of saved_bytes, what a backward rebuilds (not cached)
    resaved_bytes: int = 0  # what it saves that an earlier node saved first (not in saved_bytes)

    def __str__(self) -> str:
        expr = f' ("{self.output_bytes_expr}")' if self.output_bytes_expr else ""
        note = f"  [{self.symbolic_note}]" if self.symbolic_note else ""
        return (f"fwd {self.forward_s:.3e}s bwd {self.backward_s:.3e}s  flops "
                f"{self.forward_flops}+{self.backward_flops}  out {self.output_bytes} B{expr}  "
                f"param {self.param_bytes} B buf {self.buffer_bytes} B saved {self.saved_bytes} B{note}")


# -- what autograd saves ------------------------------------------------------------------------


def _storage(t: torch.Tensor) -> tuple[int, int]:
    st = t.untyped_storage()
    return st.data_ptr(), st.nbytes()


class _SavedRecorder(fx.Interpreter):
    """Runs the graph with autograd on, noting per node the storages its ops save for backward
    (``torch.autograd.graph.saved_tensors_hooks``) and the storages of its outputs."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.saved: dict[fx.Node, dict[int, int]] = {}
        # selective recomputation: storages of the outputs of its FLOP-counted ops, and the bytes of the
        # new storages its FLOP-counted and its other ops made
        self.cached: dict[fx.Node, dict[int, int]] = {}
        self.made: dict[fx.Node, tuple[int, int]] = {}
        self.produced: dict[int, fx.Node] = {}  # storage -> the node whose output it is (latest)
        self.keep: list[Any] = []  # every value stays alive, so no storage is reused during the run
        self.static: set[int] = {_storage(t)[0] for t in [*gm.parameters(), *gm.buffers()]}

    def run_node(self, n: fx.Node) -> Any:
        mine: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            ptr, nbytes = _storage(t)
            mine[ptr] = nbytes
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), FlopOutputs() as flops:
            result = super().run_node(n)
        self.saved[n] = mine
        self.cached[n] = dict(_storage(t) for t in flops.outputs)
        self.made[n] = (flops.new_bytes[True], flops.new_bytes[False])
        for t in _flat_tensors(result):
            if n.op == "get_attr":
                self.static.add(_storage(t)[0])
            else:
                self.produced.setdefault(_storage(t)[0], n)
        self.keep.append(result)
        return result


def _record_saved(gm: fx.GraphModule, inputs: Sequence[Any]) -> _SavedRecorder:
    """One forward with autograd on under :class:`_SavedRecorder` (every value kept: ``keep.clear()`` after)."""
    # an example microbatch cut from a larger batch is a view of the batch's storage: give each input
    # its own storage, so that what it saves is a microbatch's bytes, not its batch's
    inputs = [x.detach().clone(memory_format=torch.contiguous_format).requires_grad_(x.requires_grad)
              if isinstance(x, torch.Tensor) and x.untyped_storage().nbytes() > x.numel() * x.element_size() else x
              for x in inputs]
    rec = _SavedRecorder(gm)
    with torch.enable_grad():
        rec.run(*inputs)
    return rec


def _saved_from(rec: _SavedRecorder, gm: fx.GraphModule) -> dict[fx.Node, tuple[int, int, int]]:
    seen: set[int] = set(rec.static)
    out: dict[fx.Node, tuple[int, int, int]] = {}
    for n in gm.graph.nodes:
        total = from_before = own = 0
        for ptr, nbytes in rec.saved.get(n, {}).items():
            if ptr in seen:
                continue
            seen.add(ptr)
            total += nbytes
            if rec.produced.get(ptr) is n:
                own += nbytes
            else:
                from_before += nbytes
        out[n] = (total, from_before, own)
    return out


def _resaved_from(rec: _SavedRecorder, gm: fx.GraphModule) -> dict[fx.Node, int]:
    """Per node, the bytes of what it saves that an earlier node saved first (a conv saving the
    output an in-place ReLU saved): counted at that first saver, so a stage whose first layers are
    rebuilt (partial recomputation) keeps them for its tail all the same."""
    seen: set[int] = set(rec.static)
    out: dict[fx.Node, int] = {}
    for n in gm.graph.nodes:
        mine = rec.saved.get(n, {})
        out[n] = sum(nbytes for ptr, nbytes in mine.items() if ptr in seen and ptr not in rec.static)
        seen.update(mine)
    return out


def _selective_from(rec: _SavedRecorder, gm: fx.GraphModule) -> dict[fx.Node, tuple[int, float, int]]:
    every_cached = {ptr for c in rec.cached.values() for ptr in c}
    seen: set[int] = set()
    saved_seen: set[int] = set(rec.static)
    out: dict[fx.Node, tuple[int, float, int]] = {}
    for n in gm.graph.nodes:
        cached = 0
        for ptr, nbytes in rec.cached.get(n, {}).items():
            if ptr not in seen:
                seen.add(ptr)
                cached += nbytes
        rebuilt = 0  # of what it saves (each storage at its first saver, as saved_bytes), what is not cached
        for ptr, nbytes in rec.saved.get(n, {}).items():
            if ptr not in saved_seen:
                saved_seen.add(ptr)
                rebuilt += 0 if ptr in every_cached else nbytes
        flop_made, other_made = rec.made.get(n, (0, 0))
        if not rec.cached.get(n):
            share = 1.0  # no FLOP-counted op: the whole node is rebuilt
        else:
            share = other_made / (flop_made + other_made) if flop_made + other_made else 0.0
        out[n] = (cached, share, rebuilt)
    return out


def saved_tensor_bytes(gm: fx.GraphModule, inputs: Sequence[Any]) -> dict[fx.Node, tuple[int, int, int]]:
    """Per node: (bytes autograd saves for backward, of them those whose storage an earlier node or
    input produced, of the node's own output storages those it saves itself).

    Measured with saved-tensor hooks during one forward with autograd on. Each storage counts once,
    at the first node that saves it (views and in-place ops share their base's storage); parameters
    and buffers are not activations and are left out. A stage ``i..j`` keeps ``sum saved`` per
    microbatch; its first node's ``saved_input_bytes`` are (part of) what it receives and its last
    node's ``saved_output_bytes`` (part of) what it sends."""
    rec = _record_saved(gm, inputs)
    out = _saved_from(rec, gm)
    rec.keep.clear()
    return out


def resaved_tensor_bytes(gm: fx.GraphModule, inputs: Sequence[Any]) -> dict[fx.Node, int]:
    """Per node: the bytes of what it saves that an earlier node saved first (:func:`_resaved_from`)."""
    rec = _record_saved(gm, inputs)
    out = _resaved_from(rec, gm)
    rec.keep.clear()
    return out


def selective_bytes(gm: fx.GraphModule, inputs: Sequence[Any]) -> dict[fx.Node, tuple[int, float, int]]:
    """Per node, under selective recomputation (:mod:`pdcompile.runtime.recompute`): (bytes that stay
    saved per microbatch: the storages of the outputs of its ops ``torch.utils.flop_counter`` counts,
    each storage once, at its first node, what the checkpoint's cache keeps; the share of its forward
    time rebuilt at backward; the bytes of its ``saved_bytes`` a backward rebuilds: those not cached).
    The share: 1 for a node without a FLOP-counted op; else the bytes of the new storages its other
    ops make over those all its ops make (0 for a Linear or a convolution, whose other ops are views):
    ``selective_recompute_s = forward_s x share``. A cached output autograd does not save (a matmul
    feeding a scaling, a projection feeding a residual add) stays in flight but is not rebuilt, so the
    rebuilt bytes are not ``saved_bytes - selective_saved_bytes``."""
    rec = _record_saved(gm, inputs)
    out = _selective_from(rec, gm)
    rec.keep.clear()
    return out


# -- running single nodes ----------------------------------------------------------------------

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


def _capture(gm: fx.GraphModule, inputs: Sequence[Any]) -> dict[fx.Node, Any]:
    cap = _Capture(gm)
    with torch.no_grad():
        cap.run(*inputs)
    return cap.values


def _flat_tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _flat_tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _flat_tensors(v)


def _is_inplace(gm: fx.GraphModule, node: fx.Node) -> bool:
    if node.op == "call_module":
        return bool(getattr(gm.get_submodule(str(node.target)), "inplace", False))
    name = getattr(node.target, "__name__", str(node.target))
    if node.op == "call_function" and getattr(node.target, "__module__", "") in ("_operator", "operator"):
        return name.startswith("i") and name not in ("is_", "is_not", "index", "invert")
    return name.endswith("_") and not name.endswith("__")


class _NodeCall:
    """One node, callable again and again on fresh copies of the inputs it saw."""

    def __init__(self, gm: fx.GraphModule, node: fx.Node, values: dict[fx.Node, Any]) -> None:
        self.node = node
        self.inplace = _is_inplace(gm, node)
        self.module = gm.get_submodule(str(node.target)) if node.op == "call_module" else None
        self.leaves: list[torch.Tensor] = []
        grad_ok = {}

        def leaf(a: fx.Node) -> Any:
            v = values[a]
            if not isinstance(v, torch.Tensor):
                return v
            if a.op == "get_attr":  # a parameter or buffer: used as is
                return v
            if a.op != "placeholder" and (v.is_floating_point() or v.is_complex()):
                if a not in grad_ok:
                    grad_ok[a] = v.detach().clone().requires_grad_(True)
                    self.leaves.append(grad_ok[a])
                return grad_ok[a]
            return v.detach()

        self.args = fx.node.map_arg(node.args, leaf)
        self.kwargs = fx.node.map_arg(node.kwargs, leaf)
        params = list(self.module.parameters()) if self.module is not None else []
        params += [v for v in _flat_tensors((self.args, self.kwargs))
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
        outs = [t for t in _flat_tensors(out) if t.requires_grad]
        n_in = len(self.leaves)
        inputs = {"all": self.grad_inputs, "inputs": self.grad_inputs[:n_in],
                  "params": self.grad_inputs[n_in:]}[wrt]
        if not outs or not inputs:
            return None
        grads = [torch.ones_like(t) for t in outs]

        def run() -> Any:
            return torch.autograd.grad(outs, inputs, grads, retain_graph=True, allow_unused=True)

        return run


def _splits(call: _NodeCall) -> bool:
    """Whether the node's backward has both parts: gradients of inputs and of parameters."""
    return 0 < len(call.leaves) < len(call.grad_inputs)


def _input_grad_flop_share(call: _NodeCall, out: Any, backward_flops: int) -> float:
    """The input gradients' share of the node's backward FLOPs (counted by ``FlopCounterMode`` on
    each part; a recurrent leaf, which the counter can't see into, 0.5; no parameters: 1)."""
    if not _splits(call):
        return 1.0 if call.leaves else 0.0
    if backward_flops <= 0:
        return 0.5
    with torch.enable_grad():
        part = call.backward_fn(out, "inputs")
        flops = _count_flops(part)[0] if part is not None else 0
    return min(1.0, flops / backward_flops) if flops else 0.5


def _split_parts(backward_s: float, input_share: float) -> dict[str, float]:
    return {"input_grad_s": backward_s * input_share, "weight_grad_s": backward_s * (1.0 - input_share)}


def _sync(device: torch.device) -> None:
    sync(device)  # the runtime's (pdcompile.runtime.timing): one definition of a measured boundary


def _calibrate(fn: Callable[[], Any], device: torch.device, warmup: int,
               min_sample_s: float = 2e-4) -> int:
    """Run ``fn`` ``warmup`` times; return how many back-to-back calls make one sample last
    ``min_sample_s`` (at least one), so timer resolution doesn't dominate fast nodes."""
    for _ in range(warmup):
        fn()
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    once = time.perf_counter() - t0
    return max(1, min(1000, int(min_sample_s / max(once, 1e-9))))


def _sample(fn: Callable[[], Any], device: torch.device, number: int) -> float:
    """Seconds per call of ``fn`` over ``number`` back-to-back calls (CUDA events on a GPU)."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(number):
            fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / 1e3 / number
    t0 = time.perf_counter()
    for _ in range(number):
        fn()
    return (time.perf_counter() - t0) / number


def _interleaved_medians(fns: dict[Any, Callable[[], Any] | None], device: torch.device,
                         warmup: int, repeats: int) -> dict[Any, float]:
    """Median seconds per call of every function, sampled in rounds (one sample of each per
    round) so that a burst of interference from other processes spreads over all nodes instead
    of skewing the few being timed when it happens."""
    numbers = {k: _calibrate(fn, device, warmup) for k, fn in fns.items() if fn is not None}
    samples: dict[Any, list[float]] = {k: [] for k in numbers}
    for _ in range(max(1, repeats)):
        for k, number in numbers.items():
            samples[k].append(_sample(fns[k], device, number))  # type: ignore[arg-type]  # fns hold the timed callables
    return {k: statistics.median(samples[k]) if k in samples else 0.0 for k in fns}


def _visit_medians(fns: dict[Any, Callable[[], Any] | None], device: torch.device,
                   warmup: int, repeats: int, visits: int = 3) -> dict[Any, float]:
    """Seconds per call of every function, robust to bursts of load from other processes: the
    samples are taken in ``visits`` passes over all functions; each visit to a function starts
    with an untimed call (its inputs warm in cache, as in a step) and takes
    ``max(2, repeats // visits)`` samples; the function's cost is the smallest of its visits'
    medians. Interference only ever slows a call down, and a burst long enough to cover all the
    samples of one visit (tens of milliseconds: a node is timed for about a millisecond) rarely
    covers the same node in every visit. As with ``timeit``, the result is what the node costs
    without interference (a lower bound; the median of visits was tried and agreed worse between
    two profiles on this shared machine); the benchmarks time whole steps the same way."""
    numbers = {k: _calibrate(fn, device, warmup) for k, fn in fns.items() if fn is not None}
    per_visit = max(2, repeats // visits)
    best: dict[Any, float] = {}
    for _ in range(visits):
        for k, number in numbers.items():
            fns[k]()  # type: ignore[misc]  # fns hold the timed callables
            m = statistics.median(_sample(fns[k], device, number) for _ in range(per_visit))  # type: ignore[arg-type]  # fns hold the timed callables
            best[k] = min(best.get(k, math.inf), m)
    return {k: best.get(k, 0.0) for k in fns}


def _grad_call(y: torch.Tensor, x: torch.Tensor, g: torch.Tensor) -> Callable[[], Any]:
    return lambda: torch.autograd.grad([y], [x], [g], retain_graph=True)


def backward_call_overhead(device: torch.device, warmup: int = 20, repeats: int = 15) -> float:
    """Seconds one ``torch.autograd.grad`` call costs whatever its graph: the graph task and engine
    start-up. Measured on chains of 1 and 11 one-element ``* 1`` nodes on ``device``: the call costs
    ``fixed + n * per_node``, and ``fixed`` is returned (the per-node part is real work a step does
    too). Every node's measured backward pays ``fixed`` once; a training step pays it once for the
    whole graph, so measured mode subtracts it from each node."""
    calls: dict[Any, Callable[[], Any] | None] = {}
    for n in (1, 11):
        x = torch.ones(1, device=device, requires_grad=True)
        with torch.enable_grad():
            y = x
            for _ in range(n):
                y = y * 1.0
        g = torch.ones_like(y)
        calls[n] = _grad_call(y, x, g)
    t = _interleaved_medians(calls, device, warmup, repeats)
    per_node = max(0.0, (t[11] - t[1]) / 10)
    return max(0.0, t[1] - per_node)


def _conv_backward_flop(grad_out_shape: Any, x_shape: Any, w_shape: Any, _bias: Any,
                        _stride: Any, _padding: Any, _dilation: Any, transposed: bool,
                        _output_padding: Any, _groups: Any, output_mask: Sequence[bool],
                        out_shape: Any = None, **kwargs: Any) -> int:
    """Convolution backward: the input gradient and the weight gradient each take exactly the
    multiplications of the forward convolution. (torch's own formula over-counts the weight
    gradient of a grouped convolution by the number of groups.)"""
    fwd = conv_flop_count(list(x_shape), list(w_shape), list(grad_out_shape), transposed)
    return fwd * (int(bool(output_mask[0])) + int(bool(output_mask[1])))


_FLOP_OVERRIDES = {torch.ops.aten.convolution_backward: _conv_backward_flop}


def _count_flops(fn: Callable[[], Any]) -> tuple[int, Any]:
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


def _node_flops(call: _NodeCall, values: dict[fx.Node, Any]) -> tuple[int, int, Any]:
    """Forward and backward FLOPs of one node, and its output (computed with grad)."""
    with torch.enable_grad():
        fwd, out = _count_flops(call.forward)
        bwd_fn = call.backward_fn(out)
        bwd = _count_flops(bwd_fn)[0] if bwd_fn is not None else 0
    if isinstance(call.module, torch.nn.RNNBase) and fwd == 0:
        x = next((v for v in _flat_tensors(call.args)), None)
        if x is not None:
            fwd = rnn_flops(call.module, tuple(x.shape))
            # backward: gradient w.r.t. inputs and w.r.t. weights, each as costly as forward
            bwd = 2 * fwd if bwd_fn is not None else 0
    return fwd, bwd, out


# -- the pass ----------------------------------------------------------------------------------


def _resize_batch(value: Any, b: int) -> Any:
    """``value`` with dim 0 resized to ``b`` by repeating its rows (tokens stay valid)."""
    if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] > 0:
        idx = torch.arange(b, device=value.device) % value.shape[0]
        return value.index_select(0, idx)
    return value


def _batch_size_of(inputs: Sequence[Any]) -> int:
    for v in inputs:
        if isinstance(v, torch.Tensor) and v.dim() >= 1:
            return int(v.shape[0])
    raise UsageError("no tensor input with a batch dimension; pass batch_size= explicitly")


def _device_of(gm: fx.GraphModule, inputs: Sequence[Any]) -> torch.device:
    for p in gm.parameters():
        return p.device
    for v in inputs:
        if isinstance(v, torch.Tensor):
            return v.device
    return torch.device("cpu")


def device_name(device: torch.device) -> str:
    """``"cpu"`` or ``"cuda:NVIDIA H200"``: what a profile records as its device."""
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return device.type


def _shared_param_bytes(gm: fx.GraphModule) -> dict[fx.Node, int]:
    """Per compute node, bytes of the parameters it uses that an earlier node used already."""
    seen: set[int] = set()
    out: dict[fx.Node, int] = {}
    for node in gm.graph.nodes:
        if node.op not in COMPUTE_OPS:
            continue
        params = list(gm.get_submodule(str(node.target)).parameters()) if node.op == "call_module" else []
        params += [t for a in node.all_input_nodes if a.op == "get_attr"
                   for t in [_fetch_attr(gm, str(a.target))] if isinstance(t, torch.nn.Parameter)]
        mine = {id(p): p for p in params}
        out[node] = sum(p.numel() * p.element_size() for i, p in mine.items() if i in seen)
        seen.update(mine)
    return out


def _param_attribution(gm: fx.GraphModule) -> dict[fx.Node, tuple[int, int]]:
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


def _is_tensor_output(meta: Any) -> bool:
    leaves: list[Any] = []

    def walk(m: Any) -> None:
        if isinstance(m, (tuple, list)):
            for v in m:
                walk(v)
        elif isinstance(m, dict):
            for v in m.values():
                walk(v)
        else:
            leaves.append(m)

    walk(meta)
    return bool(leaves) and all(isinstance(x, TensorMeta) for x in leaves)


def _output_meta(value: Any) -> Any:
    from pdcompile.passes.propagate_shapes import tensor_meta_of

    return tensor_meta_of(value)


def _sizes_at(gm: fx.GraphModule, inputs: Sequence[Any], nodes: Sequence[fx.Node],
              flops: bool) -> dict[fx.Node, tuple[int, int, int]]:
    """(output bytes, forward FLOPs, backward FLOPs) of every node, at the batch of ``inputs``."""
    values = _capture(gm, inputs)
    out: dict[fx.Node, tuple[int, int, int]] = {}
    for node in nodes:
        nb = meta_bytes(_output_meta(values.get(node)))
        ff = bf = 0
        if flops and node.op in COMPUTE_OPS:
            ff, bf, _ = _node_flops(_NodeCall(gm, node, values), values)
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


def _progress(total: int, enabled: bool | None, label: str) -> Any:
    if enabled is None:
        enabled = total >= 50 and sys.stderr.isatty()
    if not enabled:
        return None
    from rich.progress import Progress

    prog = Progress(transient=True)
    prog.start()
    task = prog.add_task(label, total=total)
    return prog, task


def annotate_costs(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    mode: str = "measured",
    device_spec: DeviceSpec | str | None = None,
    optimizer: str = "sgd-momentum",
    warmup: int = 2,
    repeats: int = 5,
    symbolic: bool = True,
    batch_fn: Callable[[int], Sequence[Any]] | None = None,
    progress: bool | None = None,
    interleave: bool = False,
    cpu_threads: int | None = 1,
) -> fx.GraphModule:
    """Write ``node.meta["pd.cost"]`` (a :class:`NodeCost`) on every node of ``gm``; return ``gm``.

    ``cpu_threads``: in measured mode on the CPU, time with this many intra-op threads (default 1,
    what each torchrun worker process gets); None keeps the current setting.

    ``mode`` is ``"measured"`` (time the node here) or ``"analytic"`` (FLOPs and bytes over
    ``device_spec``). ``batch_fn(b)`` makes inputs at batch size ``b`` for the symbolic fit
    (default: ``example_inputs`` resized along dim 0); ``symbolic=False`` skips the fit.
    Runs ``propagate_shapes`` first when the nodes lack ``pd.tensor``.

    How each cost is obtained (for each node, on the values a full forward run fed it):

    - **measured** — the node is called on copies of its real inputs, float inputs that come from
      other nodes marked ``requires_grad`` as in training. Forward: the call itself, with autograd
      recording, timed. Backward: ``torch.autograd.grad`` of the node's outputs (grad-outputs of ones)
      with respect to its differentiable inputs and its parameters — the real backward kernels of this
      node, measured, not guessed (``retain_graph`` lets the same graph be timed repeatedly). Each is
      run ``warmup`` times, then timed ``repeats`` times (each sample repeating the call until it
      lasts 0.2 ms) in three visits over the whole graph; each visit to a node starts with an untimed
      call (its inputs warm in cache, as in a training step), and the node's cost is the smallest of
      its visits' medians, so a burst of load from another process that covers one visit does not
      reach the profile (:func:`_visit_medians`). The fixed cost of one ``autograd.grad`` call
      (:func:`backward_call_overhead`: measured once, the part of a call beyond its nodes) is
      subtracted from every backward: a step pays it once, not once per node. Every node's input
      copies and backward graph stay alive until the timing ends (about a step's activations). With
      ``interleave=True`` every sample is its own visit, without the untimed call, and the median is
      kept (cold caches). On CUDA, CUDA events with a synchronisation; on CPU, ``time.perf_counter``.
    - **analytic** — FLOPs of the forward call and of that backward call, counted by
      ``torch.utils.flop_counter.FlopCounterMode`` (recurrent leaves — LSTM, GRU, RNN, which the
      counter can't see into — by the formula in :func:`rnn_flops`), turned into time by a
      :class:`DeviceSpec` on a roofline: ``max(flops / (peak * efficiency), bytes / bandwidth)``. No
      timing, so the result is the same on every run and machine.
    - **bytes** — output activation bytes from the real dtypes and shapes (``pd.tensor``); parameter
      and buffer bytes of the module (each ``Parameter`` counted once, at the first node that uses it,
      so totals equal the model's; ``get_attr`` nodes are folded into the node that reads them);
      optimizer state as parameter bytes times :data:`pdcompile.profile.OPTIMIZER_STATE_FACTOR`.
    - **symbolic** — the graph is re-run at batch sizes 2 and 3 (inputs resized along dim 0, or by
      ``batch_fn``), output bytes and FLOPs fitted as ``slope*b + intercept`` and the fit checked at 5
      and at the example batch size. A node whose cost is not affine in ``b`` keeps a ``Piecewise``
      table of what was measured and says so in ``symbolic_note``.
    """
    if mode not in MODES:
        raise UsageError(f"annotate-costs mode must be one of {MODES}, got {mode!r}")
    device = _device_of(gm, tuple(example_inputs))
    if mode == "measured" and device.type == "cpu" and cpu_threads:
        # Time nodes with the threads a worker will have: torchrun gives each process one
        # (OMP_NUM_THREADS=1). Timing with more threads than free cores makes OpenMP's threads
        # wait on each other and inflates small kernels by 10-100x on a busy machine.
        before = torch.get_num_threads()
        torch.set_num_threads(cpu_threads)
        try:
            return annotate_costs(gm, example_inputs, mode=mode, device_spec=device_spec, optimizer=optimizer,
                                  warmup=warmup, repeats=repeats, symbolic=symbolic, batch_fn=batch_fn,
                                  progress=progress, interleave=interleave, cpu_threads=None)
        finally:
            torch.set_num_threads(before)
    spec = resolve_device_spec(device_spec) if mode == "analytic" else None
    opt_factor = optimizer_state_factor(optimizer)
    inputs = tuple(example_inputs)
    device = _device_of(gm, inputs)
    nodes = list(gm.graph.nodes)
    compute = [n for n in nodes if n.op in COMPUTE_OPS]
    try:
        values = _capture(gm, inputs)
    except Exception as e:  # noqa: BLE001 - say which pass failed and why
        raise PassError(f"annotate-costs: running the graph on the example inputs failed: "
                        f"{type(e).__name__}: {e}") from e
    attribution = _param_attribution(gm)
    rec = _record_saved(gm, inputs)
    saved, selective, resaved = _saved_from(rec, gm), _selective_from(rec, gm), _resaved_from(rec, gm)
    rec.keep.clear()
    shared = _shared_param_bytes(gm)

    # symbolic sizes: re-run at other batch sizes
    exprs: dict[fx.Node, tuple[str | None, str | None, str | None, str]] = {}
    if symbolic:
        exprs = _symbolic(gm, inputs, nodes, batch_fn)

    timed: dict[tuple[fx.Node, str], Callable[[], Any] | None] = {}
    whole: dict[fx.Node, float] = {}  # a node whose backward is one part: 1 inputs only, 0 parameters only
    call_overhead = backward_call_overhead(device) if mode == "measured" else 0.0
    bar = _progress(len(compute), progress, f"annotate-costs ({mode})")
    try:
        for node in nodes:
            meta = _output_meta(values.get(node)) if node.op != "output" else None
            out_bytes = meta_bytes(meta) if node.op in COMPUTE_OPS + ("placeholder",) else 0
            e_out, e_f, e_b, note = exprs.get(node, (None, None, None, ""))
            if node.op not in COMPUTE_OPS:
                note = note or ("folded into its readers" if node.op == "get_attr" else "")
                node.meta["pd.cost"] = NodeCost(
                    output_bytes=out_bytes, mode=mode, tensor_output=_is_tensor_output(meta),
                    output_bytes_expr=e_out if node.op == "placeholder" else None,
                    symbolic_note=note if node.op != "output" else "",
                )
                continue
            call = _NodeCall(gm, node, values)
            ff, bf, out = _node_flops(call, values)
            if mode == "measured":
                fwd_s = bwd_s = 0.0
                with torch.enable_grad():  # timed below, over all nodes at once
                    timed.update({(node, "fwd"): call.forward, (node, "bwd"): call.backward_fn(out)})
                    if _splits(call):  # both parts non-empty: each timed on its own
                        timed.update({(node, "in"): call.backward_fn(out, "inputs"),
                                      (node, "w"): call.backward_fn(out, "params")})
                    else:
                        whole[node] = 1.0 if call.leaves else 0.0
            else:
                assert spec is not None
                in_bytes = sum(t.numel() * t.element_size()
                               for t in _flat_tensors((call.args, call.kwargs)))
                fwd_s = spec.seconds(ff, in_bytes + out_bytes)
                bwd_s = spec.seconds(bf, 2 * (in_bytes + out_bytes)) if call.backward_fn(out) else 0.0
                share = _input_grad_flop_share(call, out, bf)
            pb, bb = attribution[node]
            node.meta["pd.cost"] = NodeCost(
                forward_s=fwd_s, backward_s=bwd_s, forward_flops=ff, backward_flops=bf,
                output_bytes=out_bytes, param_bytes=pb, buffer_bytes=bb,
                optimizer_bytes=pb * opt_factor, mode=mode, tensor_output=_is_tensor_output(meta),
                output_bytes_expr=e_out, forward_flops_expr=e_f, backward_flops_expr=e_b,
                symbolic_note=note, **({} if mode == "measured" else _split_parts(bwd_s, share)),
                saved_bytes=saved[node][0], saved_input_bytes=saved[node][1],
                saved_output_bytes=saved[node][2], shared_param_bytes=shared[node],
                selective_saved_bytes=selective[node][0], selective_recompute_s=fwd_s * selective[node][1],
                selective_rebuilt_bytes=selective[node][2], resaved_bytes=resaved[node],
            )
            if "pd.tensor" not in node.meta:
                node.meta["pd.tensor"] = meta
            if bar is not None:
                bar[0].advance(bar[1])
    finally:
        if bar is not None:
            bar[0].stop()
    if timed:
        with torch.enable_grad():
            medians = (_interleaved_medians if interleave else _visit_medians)(timed, device, warmup, repeats)
        for node in compute:
            bwd_s = max(0.0, medians[(node, "bwd")] - call_overhead)
            if (node, "in") in medians:  # each part pays the call's fixed cost once too
                parts = {"input_grad_s": max(0.0, medians[(node, "in")] - call_overhead),
                         "weight_grad_s": max(0.0, medians[(node, "w")] - call_overhead)}
            else:
                parts = _split_parts(bwd_s, whole.get(node, 1.0))
            node.meta["pd.cost"] = replace(node.meta["pd.cost"], forward_s=medians[(node, "fwd")],
                                           backward_s=bwd_s, **parts,
                                           selective_recompute_s=medians[(node, "fwd")] * selective[node][1])
    return gm


def _symbolic(gm: fx.GraphModule, inputs: tuple[Any, ...], nodes: list[fx.Node],
              batch_fn: Callable[[int], Sequence[Any]] | None
              ) -> dict[fx.Node, tuple[str | None, str | None, str | None, str]]:
    """Per node: output-bytes, forward- and backward-FLOPs expressions of ``b``, and a note."""
    try:
        b_ex = _batch_size_of(inputs)
    except UsageError:
        return {}
    make = batch_fn or (lambda b: tuple(_resize_batch(v, b) for v in inputs))
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


# -- profile from an annotated graph ----------------------------------------------------------


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
                input_grad_s=cost.input_grad_s, weight_grad_s=cost.weight_grad_s,
                selective_saved_bytes=float(cost.selective_saved_bytes),
                selective_recompute_s=float(cost.selective_recompute_s),
                selective_rebuilt_bytes=float(cost.selective_rebuilt_bytes),
                resaved_bytes=float(cost.resaved_bytes),
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


def format_costs(gm: fx.GraphModule) -> str:
    """The graph one node a line with its ``pd.cost`` (the pass's IR dump)."""
    lines = ["# annotate-costs"]
    for node in gm.graph.nodes:
        cost = node.meta.get("pd.cost")
        lines.append(f"{node.name:<24} {node.op:<14} {cost if cost is not None else '-'}")
    return "\n".join(lines)


def profile_model(
    model: torch.nn.Module,
    example_inputs: Sequence[Any],
    *,
    mode: str = "measured",
    leaf_modules: Sequence[type | str] = (),
    device_spec: DeviceSpec | str | None = None,
    batch_size: int | None = None,
    optimizer: str = "sgd-momentum",
    warmup: int = 2,
    repeats: int = 5,
    symbolic: bool = True,
    batch_fn: Callable[[int], Sequence[Any]] | None = None,
    progress: bool | None = None,
    name: str | None = None,
) -> Profile:
    """Trace, propagate shapes, annotate costs and build the Profile, in one call."""
    from pdcompile.passes.propagate_shapes import propagate_shapes
    from pdcompile.passes.trace import trace

    inputs = tuple(example_inputs)
    gm = trace(model, leaf_modules)
    propagate_shapes(gm, inputs)
    annotate_costs(gm, inputs, mode=mode, device_spec=device_spec, optimizer=optimizer,
                   warmup=warmup, repeats=repeats, symbolic=symbolic, batch_fn=batch_fn,
                   progress=progress)
    b = batch_size or _batch_size_of(inputs)
    dev = device_name(_device_of(gm, inputs))
    if mode == "analytic":
        dev = f"analytic:{device_spec_name(device_spec)}"
    return profile_from_graph(gm, batch_size=b, device=dev, name=name or type(model).__name__,
                              optimizer=optimizer)


def device_spec_name(spec: DeviceSpec | str | None) -> str:
    return resolve_device_spec(spec).name


def device_spec_for(cluster: ClusterSpec | None, precision: str = "fp32") -> DeviceSpec:
    """Analytic costs for the cluster's device: its peak FLOP/s (under ``precision="bf16"`` its bf16
    peak, where the cluster gives one) and memory bandwidth when the cluster gives them, a preset of
    the same name (v100, a100, h100, h200), else this CPU."""
    dev = getattr(cluster, "device", None)
    if dev is None:
        return DEVICE_SPECS["cpu"]
    key = dev.name.lower().split("-")[0]
    base = DEVICE_SPECS.get(key, DEVICE_SPECS["cpu"])
    peak = dev.peak_flops_bf16 if precision == "bf16" and dev.peak_flops_bf16 else dev.peak_flops
    if peak:
        return DeviceSpec(dev.name, peak, dev.memory_bandwidth or base.mem_bandwidth)
    return base


@dataclass(frozen=True)
class AnnotateOptions:
    microbatch_size: int
    mode: str = "analytic"  # "measured" or "analytic"
    cluster: ClusterSpec | None = None  # analytic costs use its device (device_spec_for)
    symbolic: bool = False  # fit costs as expressions of the microbatch size (slower)
    precision: str = "fp32"  # "bf16": analytic costs at the device's bf16 peak (device_spec_for)


def run(state: CompileState, opts: AnnotateOptions) -> CompileState:
    """Annotates ``gm`` with ``pd.cost``; writes ``profile``."""
    spec = device_spec_for(opts.cluster, opts.precision)
    gm = annotate_costs(need(state.gm, "gm"), state.example_inputs, mode=opts.mode, device_spec=spec,
                        progress=False, symbolic=opts.symbolic)
    profile = profile_from_graph(gm, batch_size=opts.microbatch_size, device=spec.name,
                                 name=type(state.model).__name__)
    return state.replace(gm=gm, profile=profile)


__all__ = [
    "COMPUTE_OPS", "DEVICE_SPECS", "AnnotateOptions", "DeviceSpec", "MODES", "NodeCost", "annotate_costs",
    "device_name", "device_spec_for", "run",
    "resolve_device_spec", "format_costs", "profile_from_graph", "profile_model", "rnn_flops", "saved_tensor_bytes",
    "resaved_tensor_bytes",
]
