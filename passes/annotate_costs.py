"""The ``annotate-costs`` pass: what every node of a traced model costs, measured or analytic,
with activation bytes and FLOPs as sympy expressions of the microbatch size ``b``.

Each node gets ``node.meta["pd.cost"]`` (a :class:`NodeCost`; :func:`format_costs` prints one a
line). **measured**: the node called on copies of its real inputs, forward and its own backward
(``torch.autograd.grad``) timed, the smallest of several visits' medians. **analytic**: FLOPs
from ``FlopCounterMode`` (recurrent leaves by :func:`rnn_flops`) over a :class:`DeviceSpec`
roofline, the same on every machine. **symbolic**: bytes and FLOPs refitted at other batch sizes
as ``slope*b + intercept``. Details in :func:`annotate_costs`. :func:`run` also builds the Profile.

Each concern is a module of ``passes/costs/`` (running nodes, timing, FLOPs, the roofline, saved
tensors, the I/W split, parameter bytes, symbolic sizes, the profile); this file runs them.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.fx as fx

from pdcompile.cluster import ClusterSpec
from pdcompile.errors import PassError, UsageError
from pdcompile.ir import CompileState, TensorMeta, meta_bytes, need
from pdcompile.passes.costs.flops import node_flops, rnn_flops
from pdcompile.passes.costs.measure import backward_call_overhead, medians
from pdcompile.passes.costs.nodes import COMPUTE_OPS, NodeCall, call_key, capture, flat_tensors, output_meta
from pdcompile.passes.costs.params import param_attribution, param_tensor_counts, shared_param_bytes, tied_params
from pdcompile.passes.costs.opclass import OpCostTable, is_aten, op_class
from pdcompile.passes.costs.profile import profile_from_graph
from pdcompile.passes.costs.roofline import (
    DEVICE_SPECS,
    DeviceSpec,
    contention,
    device_spec_for,
    device_spec_name,
    resolve_device_spec,
)
from pdcompile.passes.costs.saved import (
    record_saved,
    resaved_from,
    resaved_tensor_bytes,
    saved_from,
    saved_tensor_bytes,
    selective_from,
)
from pdcompile.passes.costs.split import input_grad_flop_share, measured_parts, split_parts, splits
from pdcompile.passes.costs.symbolic import batch_size_of, symbolic_costs
from pdcompile.profile import Profile, optimizer_state_factor

MODES = ("measured", "analytic")


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
    # trainable parameter tensors it owns, each once at its first user (params.param_tensor_counts, as param_bytes),
    # less the tied ones (in tied_params: a stage holds a copy of each its nodes use, simulate.stage_param_tensors):
    # the optimizer step and the data-parallel all-reduce cost a few microseconds per tensor on CPU
    param_tensors: int = 0
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
    tied_params: tuple[tuple[str, int], ...] = ()  # (name, bytes) of its parameters another node uses too
    # a split backward's parts: gradients of the inputs only, of the parameters only (None: not known)
    input_grad_s: float | None = None
    weight_grad_s: float | None = None
    # under selective recomputation (runtime/recompute.py): the bytes that stay saved per microbatch
    # (the cached outputs of its FLOP-counted ops) and the forward time rebuilt at backward
    selective_saved_bytes: int = 0
    selective_recompute_s: float = 0.0
    selective_rebuilt_bytes: int = 0  # of saved_bytes, what a backward rebuilds (not cached)
    resaved_bytes: int = 0  # what it saves that an earlier node saved first (not in saved_bytes)
    # of forward_s and backward_s, the fixed part that does not scale with the microbatch (analytic: the
    # op class's alpha; measured: not separated, 0)
    forward_fixed_s: float = 0.0
    backward_fixed_s: float = 0.0

    def __str__(self) -> str:
        expr = f' ("{self.output_bytes_expr}")' if self.output_bytes_expr else ""
        note = f"  [{self.symbolic_note}]" if self.symbolic_note else ""
        return (f"fwd {self.forward_s:.3e}s bwd {self.backward_s:.3e}s  flops "
                f"{self.forward_flops}+{self.backward_flops}  out {self.output_bytes} B{expr}  "
                f"param {self.param_bytes} B buf {self.buffer_bytes} B saved {self.saved_bytes} B{note}")


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
      reach the profile (``costs.measure._visit_medians``). The fixed cost of one ``autograd.grad`` call
      (``costs.measure.backward_call_overhead``: measured once, the part of a call beyond its nodes) is
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
        values = capture(gm, inputs)
    except Exception as e:  # noqa: BLE001 - say which pass failed and why
        raise PassError(f"annotate-costs: running the graph on the example inputs failed: "
                        f"{type(e).__name__}: {e}") from e
    attribution = param_attribution(gm)
    # a split backward's weight pass: its cost per parameter tensor beyond its FLOPs (calibrated; 0 otherwise)
    w_param_s = spec.op_costs.w_param_s if spec is not None and spec.op_costs is not None else 0.0
    tensor_counts = param_tensor_counts(gm)
    w_extra = tensor_counts if w_param_s else {}
    rec = record_saved(gm, inputs)
    saved, selective, resaved = saved_from(rec, gm), selective_from(rec, gm), resaved_from(rec, gm)
    rec.keep.clear()
    shared, tied = shared_param_bytes(gm), tied_params(gm)
    untied = _untied_counts(tensor_counts, tied)

    # symbolic sizes: re-run at other batch sizes
    exprs: dict[fx.Node, tuple[str | None, str | None, str | None, str]] = {}
    if symbolic:
        exprs = symbolic_costs(gm, inputs, nodes, batch_fn)

    counted: dict[Any, tuple[int, int, bool, float]] = {}  # analytic: FLOPs by call_key
    timed: dict[tuple[fx.Node, str], Callable[[], Any] | None] = {}
    whole: dict[fx.Node, float] = {}  # a node whose backward is one part: 1 inputs only, 0 parameters only
    call_overhead = backward_call_overhead(device) if mode == "measured" else 0.0
    bar = _progress(len(compute), progress, f"annotate-costs ({mode})")
    try:
        for node in nodes:
            meta = output_meta(values.get(node)) if node.op != "output" else None
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
            if mode == "analytic":
                ff, bf, has_backward, share = analytic_flops(gm, node, values, counted)
            else:
                call = NodeCall(gm, node, values)
                ff, bf, out = node_flops(call, values)
            if mode == "measured":
                fwd_s = bwd_s = 0.0
                with torch.enable_grad():  # timed below, over all nodes at once
                    timed.update({(node, "fwd"): call.forward, (node, "bwd"): call.backward_fn(out)})
                    if splits(call):  # both parts non-empty: each timed on its own
                        timed.update({(node, "in"): call.backward_fn(out, "inputs"),
                                      (node, "w"): call.backward_fn(out, "params")})
                    else:
                        whole[node] = 1.0 if call.leaves else 0.0
            else:
                assert spec is not None
                io = input_bytes(node, values) + out_bytes
                cls = op_class(node, gm)
                pw = attribution[node][0]  # the node's weights: streamed at a small microbatch (weight_rate)
                aten = is_aten(node)  # an ATen overload's call: its own per-node overhead (OpCostTable.node_aten_s)
                fwd_s = spec.op_seconds(cls, ff, io, weight_bytes=pw, aten=aten)
                bwd_s = spec.op_seconds(cls, bf, 2 * io, backward=True, weight_bytes=pw, aten=aten) \
                    if has_backward else 0.0
                fixed = {"forward_fixed_s": spec.op_fixed(cls, weight_bytes=pw, aten=aten),
                         "backward_fixed_s": spec.op_fixed(cls, backward=True, weight_bytes=pw, aten=aten)
                         if has_backward else 0.0}
            pb, bb = attribution[node]
            node.meta["pd.cost"] = NodeCost(
                forward_s=fwd_s, backward_s=bwd_s, forward_flops=ff, backward_flops=bf,
                output_bytes=out_bytes, param_bytes=pb, buffer_bytes=bb,
                optimizer_bytes=pb * opt_factor, param_tensors=untied.get(node, 0), mode=mode,
                tensor_output=_is_tensor_output(meta),
                output_bytes_expr=e_out, forward_flops_expr=e_f, backward_flops_expr=e_b,
                symbolic_note=note, **({} if mode == "measured" else
                                       split_parts(bwd_s, share, w_extra.get(node, 0) * w_param_s)),
                saved_bytes=saved[node][0], saved_input_bytes=saved[node][1],
                saved_output_bytes=saved[node][2], shared_param_bytes=shared[node], tied_params=tied[node],
                selective_saved_bytes=selective[node][0], selective_recompute_s=fwd_s * selective[node][1],
                selective_rebuilt_bytes=selective[node][2], resaved_bytes=resaved[node],
                **({} if mode == "measured" else fixed),
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
            secs = medians(timed, device, warmup, repeats, interleave)
        for node in compute:
            bwd_s = max(0.0, secs[(node, "bwd")] - call_overhead)
            parts = measured_parts(secs, node, bwd_s, whole.get(node, 1.0), call_overhead)
            node.meta["pd.cost"] = replace(node.meta["pd.cost"], forward_s=secs[(node, "fwd")],
                                           backward_s=bwd_s, **parts,
                                           selective_recompute_s=secs[(node, "fwd")] * selective[node][1])
    for node in reads_params_itself(gm, compute):  # the runtime runs their backward unsplit: B whole, no W
        c = node.meta["pd.cost"]
        node.meta["pd.cost"] = replace(c, input_grad_s=c.backward_s, weight_grad_s=0.0)
    return gm


def reads_params_itself(gm: fx.GraphModule, nodes: Sequence[fx.Node]) -> list[fx.Node]:
    """The compute nodes that read a trainable parameter through ``get_attr``, in a graph where no called
    submodule owns one (an exported graph: every ATen op reads its weights itself): a split backward's ``W``
    would walk their stage's whole graph again (runtime/weight_grads.py: ``WeightPass.walks_whole_graph``), so
    the runtime runs those backwards unsplit, and their cost is charged whole to ``B``, nothing to ``W``."""
    trainable = {name for name, p in gm.named_parameters() if p.requires_grad}
    owned = any(n.op == "call_module" and any(p.requires_grad for p in gm.get_submodule(str(n.target)).parameters())
                for n in nodes)
    if owned:
        return []
    return [n for n in nodes if n.op != "call_module"
            and any(a.op == "get_attr" and a.target in trainable for a in n.all_input_nodes)]


def _untied_counts(counts: dict[fx.Node, int], tied: dict[fx.Node, tuple[tuple[str, int], ...]]) -> dict[fx.Node, int]:
    """Per compute node, its trainable parameter tensors (``counts``: each once, at its first user) less the tied
    ones first used there (``tied``, in graph order as ``counts``): a stage counts each tied parameter its nodes use
    once more (it holds and steps its own copy), :func:`pdcompile.simulate.stage_param_tensors`."""
    seen: set[str] = set()
    out: dict[fx.Node, int] = {}
    for node, n in counts.items():
        names = {name for name, _ in tied.get(node, ())}
        out[node] = max(0, n - len(names - seen))
        seen |= names
    return out


def input_bytes(node: fx.Node, values: dict[fx.Node, Any]) -> int:
    """Bytes of the tensors a node's call reads (its arguments'; a module's parameters not counted)."""
    return sum(t.numel() * t.element_size()
               for t in flat_tensors(fx.node.map_arg((node.args, node.kwargs), values.__getitem__)))


def analytic_flops(gm: fx.GraphModule, node: fx.Node, values: dict[fx.Node, Any],
                   counted: dict[Any, tuple[int, int, bool, float]]) -> tuple[int, int, bool, float]:
    """A node's (forward FLOPs, backward FLOPs, whether it has a backward, the input gradients'
    share of the backward FLOPs), counted on its :class:`NodeCall`; a node whose
    :func:`~pdcompile.passes.costs.nodes.call_key` is in ``counted`` (a repeated layer's twin)
    reads its twin's counts instead of running FlopCounterMode again."""
    key = call_key(node, values)
    if key is not None and key in counted:
        return counted[key]
    call = NodeCall(gm, node, values)
    ff, bf, out = node_flops(call, values)
    found = (ff, bf, call.backward_fn(out) is not None, input_grad_flop_share(call, out, bf))
    if key is not None:
        counted[key] = found
    return found


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
    example_kwargs: Mapping[str, Any] | None = None,
    loss_fn: Callable[..., Any] | None = None,
    contention: float = 1.0,
) -> Profile:
    """Trace, propagate shapes, annotate costs and build the Profile, in one call. ``example_kwargs``:
    forward's keyword inputs (traced by torch.export, as ``pdcompile(example_kwargs=)`` does; their
    tensors are the graph's inputs after the positional ones), the output traced the one ``loss_fn`` reads.
    ``contention``: every compute time charged so (:func:`charge_contention`), as the annotate-costs pass
    charges a cluster's (``pdcompile plan`` passes its cluster's, to plan as ``pdcompile()`` does)."""
    from pdcompile.ir import graph_inputs
    from pdcompile.passes.export_frontend import LossProbe
    from pdcompile.passes.propagate_shapes import propagate_shapes
    from pdcompile.passes.trace import trace, trace_any

    if example_kwargs:
        gm = trace_any(model, tuple(example_inputs), leaf_modules, kwargs=example_kwargs,
                       loss_probe=LossProbe(loss_fn) if loss_fn is not None else None)
        inputs = tuple(graph_inputs(tuple(example_inputs), example_kwargs))
    else:
        inputs = tuple(example_inputs)
        gm = trace(model, leaf_modules, inputs=len(inputs))
    propagate_shapes(gm, inputs)
    annotate_costs(gm, inputs, mode=mode, device_spec=device_spec, optimizer=optimizer,
                   warmup=warmup, repeats=repeats, symbolic=symbolic, batch_fn=batch_fn,
                   progress=progress)
    charge_contention(gm, contention)
    b = batch_size or batch_size_of(inputs)
    dev = device_name(_device_of(gm, inputs))
    if mode == "analytic":
        dev = f"analytic:{device_spec_name(device_spec)}"
    return profile_from_graph(gm, batch_size=b, device=dev, name=name or type(model).__name__,
                              optimizer=optimizer)


@dataclass(frozen=True)
class AnnotateOptions:
    microbatch_size: int
    mode: str = "analytic"  # "measured" or "analytic"
    cluster: ClusterSpec | None = None  # analytic costs use its device (device_spec_for)
    symbolic: bool = False  # fit costs as expressions of the microbatch size (slower)
    precision: str = "fp32"  # "bf16": analytic costs at the device's bf16 peak (device_spec_for)
    op_costs: OpCostTable | None = None  # analytic: this machine's fitted cost per op class (calibrated)


def run(state: CompileState, opts: AnnotateOptions) -> CompileState:
    """Annotates ``gm`` with ``pd.cost``; writes ``profile``. Every compute time is then charged the
    cluster's core contention (:func:`~pdcompile.passes.costs.roofline.contention`: a local CPU cluster of
    more busy processes than cores), so that the planner and the simulator both see it. The co-running
    slowdown (:func:`corun`) is not charged here: the simulator charges it only while ranks compute side
    by side (:func:`pdcompile.simulate.shared_cores`, given ``corun`` by :func:`pdcompile.api.corun_of`)."""
    spec = device_spec_for(opts.cluster, opts.precision).calibrated(opts.op_costs)
    gm = annotate_costs(need(state.gm, "gm"), state.graph_inputs, mode=opts.mode, device_spec=spec,
                        progress=False, symbolic=opts.symbolic)
    charge_contention(gm, contention(opts.cluster))
    profile = profile_from_graph(gm, batch_size=opts.microbatch_size, device=spec.name,
                                 name=type(state.model).__name__)
    return state.replace(gm=gm, profile=profile)


def corun(cluster: Any, table: OpCostTable | None) -> float:
    """Each process's compute slowdown beside its peers on a local CPU cluster, as this machine's
    calibration measured it (``OpCostTable.corun``: shared memory bandwidth and caches) for the processes
    that compute at once (the workers, at most the cores); 1 without a calibration or off a local host."""
    cores = getattr(getattr(cluster, "device", None), "cores", None)
    if table is None or not cores:
        return 1.0
    return table.corun_factor(min(int(cluster.num_workers), int(cores)))


def charge_contention(gm: fx.GraphModule, factor: float) -> None:
    """Every node's times (forward, backward, its parts, what selective recomputation runs again) x ``factor``."""
    if factor == 1.0:
        return
    for node in gm.graph.nodes:
        c = node.meta.get("pd.cost")
        if c is None:
            continue
        node.meta["pd.cost"] = replace(
            c, forward_s=c.forward_s * factor, backward_s=c.backward_s * factor,
            input_grad_s=None if c.input_grad_s is None else c.input_grad_s * factor,
            weight_grad_s=None if c.weight_grad_s is None else c.weight_grad_s * factor,
            selective_recompute_s=c.selective_recompute_s * factor,
            forward_fixed_s=c.forward_fixed_s * factor, backward_fixed_s=c.backward_fixed_s * factor)


__all__ = [
    "COMPUTE_OPS", "DEVICE_SPECS", "AnnotateOptions", "DeviceSpec", "MODES", "NodeCost", "annotate_costs",
    "device_name", "device_spec_for", "run",
    "resolve_device_spec", "format_costs", "profile_from_graph", "profile_model", "rnn_flops", "saved_tensor_bytes",
    "resaved_tensor_bytes",
]
