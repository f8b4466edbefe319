"""This machine's constants for predicting a local run: the loopback link, the runtime's fixed cost
per action, the optimizer step, and a run's compute against its profile. Measured once and cached
(:func:`load_or_measure`), so a prediction never peeks at the run it predicts; each ``measure_*``
function says how it measures its constant.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pdcompile import machine_cache
from pdcompile.machine_cache import cache_path as cache_path  # where the constants are cached, kept here too
from pdcompile.machine_cache import machine_key as machine_key

OVERHEAD_KINDS = machine_cache.ACTION_KINDS


def _calibration_model() -> Any:
    from pdcompile.zoo import vgg

    return vgg.VGGConfig(layers=(16, 16, vgg.M, 32, 32, vgg.M), image_size=32, hidden=512, num_classes=10)
_M = 4  # microbatches of the overhead run
_WARMUP = 4  # its steps left out


@dataclasses.dataclass(frozen=True)
class MachineConstants:
    """What a local prediction needs besides the profiled compute (seconds, bytes/s)."""

    latency_s: float  # one-way send/recv of a tiny message over loopback
    bandwidth: float  # loopback bytes/s
    allreduce_latency_s: float  # fixed cost of a 2-rank all-reduce
    overhead_s: dict[str, float]  # runtime's fixed cost per action kind
    step_fixed_s: float  # optimizer step: fixed part
    step_rate: float  # optimizer step: parameter bytes per second
    compute_factor: float = 1.0  # a run's forward and backward / their profiled cost
    key: str = ""
    measured_at: str = ""
    op_costs: dict[str, Any] = dataclasses.field(default_factory=dict)  # OpCostTable.to_dict(): cost per op class
    # the runtime's data-parallel all-reduce between 2 processes (allreduce_flat: flatten, gloo, copy back):
    # fixed s + bytes / rate (fit_collective); rate 0: not measured (an older cache)
    collective_fixed_s: float = 0.0
    collective_rate: float = 0.0
    # the same among cores + 1 processes (measure_crowded_collective; bytes/s of a ring's bytes); 0: not measured
    collective_crowded_fixed_s: float = 0.0
    collective_crowded_rate: float = 0.0
    # seconds per parameter tensor (measure_step: SGD with momentum's loop over tensors; measure_flatten: the
    # all-reduce's flatten and copy back); 0: not measured (an older cache: machine_cache reads the defaults)
    step_tensor_s: float = 0.0
    collective_tensor_s: float = 0.0
    # a process woken from a blocking receive while the others hold every core waits this much longer than with
    # a core free (measure_wake, cores + 1 processes), s; 0: not measured
    wake_crowded_s: float = 0.0

    def step_s(self, param_bytes: float, tensors: int = 0) -> float:
        """Predicted optimizer step (SGD with momentum, zero_grad) over ``param_bytes`` of parameters in
        ``tensors`` tensors."""
        return self.step_fixed_s + tensors * self.step_tensor_s + param_bytes / self.step_rate \
            if param_bytes else 0.0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def load_or_measure(refresh: bool = False, log: Any = None) -> tuple[MachineConstants, bool]:
    """The cached constants for this machine, or freshly measured (and cached); and whether cached.

    The cache (``$PDCOMPILE_CACHE`` or ``~/.cache/pdcompile``, file ``machine-constants.json``) is
    keyed by host, core count, Python and torch version and the runtime's source; ``refresh=True``
    (``python -m pdcompile.calibrate --refresh``, ``pdcompile demo --refresh-constants``) measures
    again."""
    d = None if refresh else machine_cache.cached()
    if d is not None:
        try:
            return MachineConstants(**d), True
        except TypeError:
            pass  # from an older layout: measure again
    path = cache_path()
    c = measure(log)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(c.to_dict(), indent=1))
    except OSError:
        pass  # a read-only home: the constants serve this run only
    return c, False


def measure(log: Any = None) -> MachineConstants:
    """Measure every constant now (two short torchrun launches and an in-process timing)."""
    say = log or (lambda msg: None)
    runtime_allocator()
    say("measuring the fixed cost and rate of each op class and each node's overhead in a whole model "
        "(probe models, one thread) ...")
    table = measure_op_costs()
    say("measuring the loopback link (2 processes, gloo ping-pong and the runtime's all-reduce) ...")
    samples = measure_link_samples()
    lat, bw, ar_lat = fit_link(samples)
    coll_fixed, coll_rate = fit_collective(samples["allreduce_flat"])
    say("measuring the runtime's all-reduce on one process more than cores ...")
    crowded = measure_crowded_collective()
    say("measuring the wait of a process woken while the others hold every core ...")
    wake = measure_wake()
    say("measuring the runtime's cost per action (a traced 2-stage run of a tiny model) ...")
    over = measure_overheads()
    say("measuring compute in a run against its profile (a traced 2-stage run of a small VGG) ...")
    from pdcompile.zoo import vgg

    traced = _traced_run(vgg.FAMILY, _calibration_model(), 20, "compute calibration")
    factor = measure_compute_factor(over, node_s=table.node_s, traced=traced)
    fixed, step_tensor, rate = measure_step()
    flat_tensor = measure_flatten()[1]
    say("measuring a stage's compute in a 2-process run against the same stage alone ...")
    ops = with_corun(table, measure_in_run_factor(over, traced=traced))
    return MachineConstants(lat, bw, ar_lat, over, fixed, rate, factor, key=machine_key(),
                            measured_at=time.strftime("%Y-%m-%d %H:%M:%S %Z"), op_costs=ops.to_dict(),
                            collective_fixed_s=coll_fixed, collective_rate=coll_rate,
                            collective_crowded_fixed_s=crowded[0], collective_crowded_rate=crowded[1],
                            step_tensor_s=step_tensor, collective_tensor_s=flat_tensor,
                            wake_crowded_s=wake)


def runtime_allocator() -> None:
    """This process's malloc set as a runtime process on CPU sets it (``runtime/allocator.py`` ``keep``, the CPU
    default): what a step frees is reused without page faults. Under glibc's defaults a tensor of 128 KiB and up is
    often faulted in afresh at each call: a 1 -> 16 channel convolution at 28x28 over 48 images took 1.4 ms so,
    0.36 ms as the runtime runs it; the calibration times ops as the runtime will run them."""
    from pdcompile.runtime import allocator

    allocator.set_mode("keep")


def _probe_model(d: int, channels: int, blocks: int = 1) -> Any:
    """A model with an op of every class (opclass.OP_CLASSES): embedding, then ``blocks`` blocks of norm,
    linear, attention over 4 heads, GELU and a residual add, views, a convolution with ReLU and max
    pooling, and a cross-entropy loss."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(d)
            self.qkv = nn.Linear(d, 3 * d)
            self.fc = nn.Linear(d, d)
            self.act = nn.GELU()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.norm(x)
            b, t, _ = h.shape
            q, k, v = self.qkv(h).view(b, t, 3, 4, d // 4).permute(2, 0, 3, 1, 4).unbind(0)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
            return x + self.act(self.fc(a))

    class Probe(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(512, d)
            self.blocks = nn.Sequential(*(Block() for _ in range(blocks)))
            self.conv = nn.Conv2d(channels, channels, 3, padding=1)
            self.relu = nn.ReLU()
            self.pool = nn.MaxPool2d(2)
            self.head = nn.Linear(d, 16)

        def forward(self, tokens: torch.Tensor, image: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            x = self.blocks(self.emb(tokens))
            b, t, _ = x.shape
            y = self.pool(self.relu(self.conv(image))).mean()
            logits = self.head(x).view(b * t, 16) + y
            return F.cross_entropy(logits, target.view(b * t))

    return Probe()


def op_cost_samples(sizes: tuple[tuple[int, int, int, int], ...] = ((1, 8, 32, 4), (4, 8, 32, 4), (16, 8, 32, 4),
                                                                  (48, 8, 32, 4), (1, 16, 128, 16), (4, 16, 128, 16),
                                                                  (16, 16, 128, 16), (48, 16, 128, 16)),
                    repeats: int = 5) -> dict[str, list[tuple[float, float, float, float]]]:
    """Per op class, ``(forward work, forward s, backward work, backward s)`` of every node of the probe
    model (:func:`_probe_model`) at ``sizes`` (batch, tokens, width, conv channels), timed as
    ``cost_mode="measured"`` times nodes (``annotate_costs``, one thread) but in this thread's CPU time
    (:func:`~pdcompile.passes.costs.measure.thread_clock`), as :func:`_low_times` times the whole models the
    per-node overhead is fitted from, so that a loaded machine inflates neither (wall time here and CPU time
    there left the per-node fit what the load added to the ops, subtracted); its work counted as the
    analytic model counts it (FLOPs, or bytes read and written; twice the bytes for a backward)."""
    import torch

    from pdcompile.passes.annotate_costs import annotate_costs, input_bytes
    from pdcompile.passes.costs.measure import thread_clock
    from pdcompile.passes.costs.nodes import COMPUTE_OPS, capture
    from pdcompile.passes.costs.opclass import FLOP_CLASSES, op_class
    from pdcompile.passes.trace import trace

    out: dict[str, list[tuple[float, float, float, float]]] = {}
    for b, t, d, ch in sizes:
        torch.manual_seed(0)
        model = _probe_model(d, ch)
        inputs = (torch.randint(0, 512, (b, t)), torch.randn(b, ch, 16, 16), torch.randint(0, 16, (b, t)))
        gm = trace(model)
        with thread_clock():
            annotate_costs(gm, inputs, mode="measured", repeats=repeats, symbolic=False, progress=False)
        values = capture(gm, inputs)
        for node in gm.graph.nodes:
            if node.op not in COMPUTE_OPS:
                continue
            c, cls = node.meta["pd.cost"], op_class(node, gm)
            io = float(input_bytes(node, values) + c.output_bytes)
            fw, bw = (float(c.forward_flops), float(c.backward_flops)) if cls in FLOP_CLASSES else (io, 2 * io)
            out.setdefault(cls, []).append((fw, c.forward_s, bw, c.backward_s))
    return out


def fit_op_costs(samples: dict[str, list[tuple[float, float, float, float]]], source: str) -> Any:
    """An :class:`~pdcompile.passes.costs.opclass.OpCostTable` through :func:`op_cost_samples`: per class
    :func:`~pdcompile.passes.costs.opclass.fit_op_cost` of forward and of backward (where two or more
    distinct works were timed; a class of views keeps a fixed cost alone)."""
    import numpy as np

    from pdcompile.passes.costs.opclass import OpCost, OpCostTable, fit_op_cost

    fwd: dict[str, OpCost] = {}
    bwd: dict[str, OpCost] = {}
    for cls, rows in samples.items():
        a = np.array(rows, dtype=float)
        for table, (w, t) in ((fwd, (a[:, 0], a[:, 1])), (bwd, (a[:, 2], a[:, 3]))):
            if cls == "view":  # no kernel: a fixed cost alone, the median including those timed at nothing
                table[cls] = OpCost(float(np.median(t)), float("inf"))
                continue
            keep = t > 0  # a backward timed at nothing (below the autograd call's own cost) says nothing
            w, t = w[keep], t[keep]
            if not len(t):
                continue
            if len(np.unique(w)) < 2:
                table[cls] = OpCost(float(np.median(t)), float("inf"))
            else:
                table[cls] = fit_op_cost(w, t)
    return OpCostTable(fwd, bwd, source)


def measure_op_costs() -> Any:
    """This machine's :class:`~pdcompile.passes.costs.opclass.OpCostTable` (:func:`op_cost_samples`, fitted),
    with the per-node overhead of a whole stage (:func:`measure_node_overhead`)."""
    import platform

    stamp = time.strftime("%Y-%m-%d %H:%M %Z")
    table = fit_op_costs(op_cost_samples(), f"python -m pdcompile.calibrate, {stamp} on {platform.node()}")
    # matmul and convolution at the sizes models use (these instead), and the elementwise kinds the probe model lacks
    kernels = fit_op_costs(kernel_samples(), "")
    table = dataclasses.replace(table, forward={**table.forward, **kernels.forward},
                                backward={**table.backward, **kernels.backward})
    table = dataclasses.replace(table, weight_rate=measure_weight_rate(table))
    table = dataclasses.replace(table, node_s=fit_node_samples(node_overhead_samples(table)),
                                node_aten_s=fit_node_samples(node_overhead_samples(table, frontend="export")))
    return dataclasses.replace(table, w_param_s=measure_weight_pass())


#: (rows, in features, out features) of the matmul probe (:func:`kernel_samples`): a transformer's Linears at widths
#: 64-512 over microbatches of 32-1024 token rows, as models use them
MATMUL_PROBES = ((32, 64, 64), (128, 96, 288), (128, 128, 512), (512, 128, 128), (512, 96, 384), (1024, 128, 128),
                 (256, 512, 128), (64, 256, 256))
#: (input channels, output channels, image side, batch) of the 3x3 convolution probe (:func:`kernel_samples`): a
#: CNN's first layers (1 or 3 channels in, no input gradient) and its 16-64 channel layers, 2-75 MFLOP each
CONV_PROBES = ((3, 16, 32, 2), (16, 16, 16, 2), (1, 16, 28, 12), (16, 32, 14, 4), (32, 32, 8, 8), (3, 16, 32, 32),
               (16, 16, 32, 8), (16, 32, 16, 32), (32, 64, 8, 32), (64, 64, 8, 16))


#: (batch, heads, tokens) of the softmax and masked_fill probes (:func:`kernel_samples`): an attention written out's
#: scores (batch x heads x tokens x tokens floats, 8k-790k of them), as the zoo GPT (4 heads of 32 tokens), the
#: Shakespeare GPT (4 of 64) and a 12-head model of 128 tokens have them
SCORES_PROBES = ((2, 4, 32), (8, 4, 32), (32, 4, 32), (3, 4, 64), (8, 8, 64), (4, 12, 128))
#: (batch, heads, tokens, head size) of the batched-matmul probe (:func:`kernel_samples`, class ``bmm``): an attention
#: written out, ``q @ k^T`` and ``scores @ v`` on the heads' transposed views, as the zoo GPT (4 heads of 32 x 24),
#: the Shakespeare GPT (4 of 64 x 32) and a 12-head model of 128 x 64 run them, 0.4-50 MFLOP (the last, 2-4x
#: the FLOPs per byte of the others, runs 30-50% faster than their bytes' rate says: the fit's trim drops it)
BMM_PROBES = ((2, 4, 32, 24), (8, 4, 32, 24), (32, 4, 32, 24), (3, 4, 64, 32), (6, 4, 64, 32), (2, 12, 128, 64))
#: (rows, width) of the probe of GELU's tanh approximation (:func:`kernel_samples`): an MLP's hidden activations,
#: 8k-520k floats
GELU_PROBES = ((64, 128), (256, 384), (1024, 384), (384, 512), (512, 1024))


def _attention_op_cases() -> list[tuple[str, Any, Any, float]]:
    """:func:`kernel_samples`' cases of an attention written out: ``(class, op, input, forward work)``, the op called
    on the input as a model calls it, its work as annotate-costs counts a node's: for the elementwise kinds
    (``opclass.ELEMENTWISE_KINDS``) its bytes read and written (every tensor argument and the output): softmax over
    the scores' last dimension, ``masked_fill`` of the scores with a causal (tokens x tokens) bool mask broadcast
    over batch and heads, ``nn.GELU(approximate="tanh")``; and ``bmm``, ``q @ k^T`` and ``scores @ v`` on the heads'
    transposed views (:data:`BMM_PROBES`; the input a tuple of both operands, each with a gradient; its work bytes
    too, ``opclass.FLOP_CLASSES``). Work as annotate-costs counts it: FLOPs for none of them."""
    import torch

    cases: list[tuple[str, Any, Any, float]] = []
    for b, h, t in SCORES_PROBES:
        torch.manual_seed(0)
        x = torch.randn(b, h, t, t, requires_grad=True)
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
        nbytes = float(x.numel() * x.element_size())
        cases.append(("softmax", lambda x: torch.softmax(x, dim=-1), x, 2 * nbytes))
        cases.append(("masked", lambda x, mask=mask: x.masked_fill(mask, float("-inf")), x,
                      2 * nbytes + mask.numel() * mask.element_size()))
    for rows, width in GELU_PROBES:
        torch.manual_seed(0)
        x = torch.randn(rows, width, requires_grad=True)
        cases.append(("gelu_tanh", torch.nn.GELU(approximate="tanh"), x, 2.0 * x.numel() * x.element_size()))
    for b, h, t, d in BMM_PROBES:
        torch.manual_seed(0)
        nbytes = 4.0 * (2 * b * h * t * d + b * h * t * t)  # either product: two operands and the output
        # the heads as a model makes them: (b, t, h, d) transposed to (b, h, t, d), views copied by the matmul
        q = torch.randn(b, t, h, d).transpose(1, 2).requires_grad_()
        k = torch.randn(b, t, h, d).transpose(1, 2).requires_grad_()
        scores = torch.randn(b, h, t, t, requires_grad=True)
        cases.append(("bmm", lambda q, k: torch.matmul(q, k.transpose(-2, -1)), (q, k), nbytes))
        cases.append(("bmm", torch.matmul, (scores, k), nbytes))
    return cases


def kernel_cases() -> list[tuple[str, Any, Any, float]]:
    """:func:`kernel_samples`' probes, ``(class, op, input or tuple of inputs, forward work)``: an ``nn.Linear`` at each
    of :data:`MATMUL_PROBES`, an ``nn.Conv2d`` at each of :data:`CONV_PROBES` (work: FLOPs), then
    :func:`_attention_op_cases`."""
    import torch

    cases: list[tuple[str, Any, Any, float]] = []
    for rows, i, o in MATMUL_PROBES:
        torch.manual_seed(0)
        cases.append(("matmul", torch.nn.Linear(i, o), torch.randn(rows, i, requires_grad=True), 2.0 * rows * i * o))
    for ci, co, hw, b in CONV_PROBES:
        torch.manual_seed(0)
        x = torch.randn(b, ci, hw, hw, requires_grad=ci > 3)  # a first layer's input is data: no gradient
        cases.append(("conv", torch.nn.Conv2d(ci, co, 3, padding=1), x,
                      2.0 * ci * co * 9 * hw * hw * b))
    return cases + _attention_op_cases()


def kernel_samples(repeats: int = 15, rounds: int = 3, cases: list[tuple[str, Any, Any, float]] | None = None
                   ) -> dict[str, list[tuple[float, float, float, float]]]:
    """``{"matmul": [...], "conv": [...], "softmax": [...], "masked": [...], "gelu_tanh": [...], "bmm": [...]}`` of
    ``(forward work, forward s, backward work, backward s)``: an ``nn.Linear`` at each of :data:`MATMUL_PROBES`, an
    ``nn.Conv2d`` at each of :data:`CONV_PROBES`, an attention written out's elementwise kinds at
    :data:`SCORES_PROBES` and :data:`GELU_PROBES` and its batched matmuls at :data:`BMM_PROBES`
    (:func:`_attention_op_cases`), forward and forward + backward (from a gradient of ones: into ``.grad`` as a
    stage's backward runs; the attention ops' inputs' gradients handed back, as within a stage) timed :func:`_low_times` in each of ``rounds`` rounds over them all, the median round
    kept (a burst of other work that slowed one round moves nothing), the backward the difference; work as
    annotate-costs counts it (FLOPs, or bytes read and written; twice for the backward). The probe model's
    operands (:func:`op_cost_samples`: widths 32-128, 4-16 channels at 16x16) are smaller than most models' and
    their fitted rates scattered 115-172 GFLOP/s between calibrations on one machine; these are the sizes the
    rates are charged at. The probe model has no batched matmul, softmax, masked_fill or tanh GELU: their classes come
    from here alone. ``cases``: :func:`kernel_cases` (made here when None)."""
    import torch

    from pdcompile.passes.costs.opclass import ELEMENTWISE_KINDS

    torch.set_num_threads(1)
    cases = kernel_cases() if cases is None else cases
    out: dict[str, list[tuple[float, float, float, float]]] = {cls: [] for cls, _, _, _ in cases}
    timed: list[list[tuple[float, float]]] = [[] for _ in cases]
    for _ in range(rounds):
        for i, (cls, mod, x, work) in enumerate(cases):
            xs = x if isinstance(x, tuple) else (x,)
            grad = torch.ones_like(mod(*xs))

            def forward(mod: Any = mod, xs: Any = xs) -> Any:
                return mod(*xs)

            def step(mod: Any = mod, xs: Any = xs, grad: Any = grad, cls: str = cls) -> None:
                if cls in ELEMENTWISE_KINDS or cls == "bmm":  # the inputs' gradients handed on, as in a stage
                    torch.autograd.grad([mod(*xs)], list(xs), [grad])
                else:
                    mod(*xs).backward(grad)

            secs = _low_times({"f": forward, "fb": step}, repeats)
            timed[i].append((secs["f"], secs["fb"]))
    for (cls, _, _, work), got in zip(cases, timed):
        f, fb = statistics.median(t for t, _ in got), statistics.median(t for _, t in got)
        out[cls].append((work, f, 2 * work, max(fb - f, 1e-9)))
    return out


def measure_weight_pass(blocks: tuple[int, int] = (1, 4), repeats: int = 30) -> float:
    """Seconds a split backward's weight pass (``W``) costs per trainable parameter tensor
    (``OpCostTable.w_param_s``): the probe model (:func:`_probe_model`, width 32, 4 conv channels, 2 samples:
    its ops' work negligible) at ``blocks`` blocks, split as the runtime splits it
    (:class:`~pdcompile.runtime.graph_split.GraphSplit`, input gradients of its image input), each ``W``
    timed :func:`_low_times` after its ``I``; the slope of ``W``'s time over the parameter tensors. 0 where the
    split does not apply to the probe."""
    import torch

    from pdcompile.passes.trace import trace
    from pdcompile.runtime.graph_split import GraphSplit, Unsupported

    torch.set_num_threads(1)
    points = []
    for nb in blocks:
        torch.manual_seed(0)
        gm = trace(_probe_model(32, 4, nb))
        inputs = (torch.randint(0, 512, (2, 8)), torch.randn(2, 4, 16, 16, requires_grad=True),
                  torch.randint(0, 16, (2, 8)))
        try:
            gs = GraphSplit(gm, inputs)
        except Unsupported:
            return 0.0

        def through_i(gs: Any = gs, inputs: Any = inputs) -> Any:
            _, rec = gs.capture()
            out = gs.forward(rec, inputs)
            loss = out if isinstance(out, torch.Tensor) else out[0]
            return gs.input_grads([loss], None, inputs, rec)[1]

        def through_w(gs: Any = gs, through_i: Any = through_i) -> None:
            gs.weight_grads(through_i())

        secs = _low_times({"i": through_i, "w": through_w}, repeats)
        points.append((sum(p.requires_grad for p in gm.parameters()), max(secs["w"] - secs["i"], 0.0)))
    (n0, t0), (n1, t1) = points[0], points[-1]
    return max(0.0, (t1 - t0) / (n1 - n0)) if n1 > n0 else 0.0


#: Linears (in, out) of the weight-rate probe (1, 4 and 8 MiB of weights), at WEIGHT_PROBE_BATCH samples (one
#: sample takes another kernel, a matrix-vector product, that streams weights 2-3x faster)
WEIGHT_PROBES = ((512, 512), (1024, 1024), (2048, 1024))
WEIGHT_PROBE_BATCH = 4


def measure_weight_rate(table: Any, repeats: int = 20) -> tuple[float, float]:
    """(forward, backward) bytes/s at which a Linear's weights stream beyond its FLOPs
    (``OpCostTable.weight_rate``): :data:`WEIGHT_PROBES` at :data:`WEIGHT_PROBE_BATCH` samples (their FLOPs a
    small part), each forward and forward + backward timed :func:`_low_times` as a stage runs them (the
    gradient accumulated into ``.grad``), their fixed cost and FLOPs costed by ``table``'s matmul fit; the
    median rate of what is left (:func:`~pdcompile.passes.costs.opclass.fit_weight_rate`). (0, 0) where ``table`` has no matmul fit."""
    import torch

    from pdcompile.passes.costs.opclass import fit_weight_rate

    fwd_fit, bwd_fit = table.forward.get("matmul"), table.backward.get("matmul")
    if fwd_fit is None or bwd_fit is None:
        return 0.0, 0.0
    torch.set_num_threads(1)
    nbytes, tf, tb, ff, fb = [], [], [], [], []
    for i, o in WEIGHT_PROBES:
        torch.manual_seed(0)
        lin = torch.nn.Linear(i, o)
        x = torch.randn(WEIGHT_PROBE_BATCH, i, requires_grad=True)
        def forward(lin: Any = lin, x: Any = x) -> Any:
            return lin(x)

        def step(lin: Any = lin, x: Any = x) -> None:
            lin(x).sum().backward()

        secs = _low_times({"f": forward, "fb": step}, repeats)
        flops = 2.0 * i * o * WEIGHT_PROBE_BATCH
        nbytes.append(float(sum(p.numel() * p.element_size() for p in lin.parameters())))
        tf.append(secs["f"])
        tb.append(max(secs["fb"] - secs["f"], 0.0))
        ff.append(fwd_fit.seconds(flops))
        fb.append(bwd_fit.seconds(2 * flops))
    return fit_weight_rate(nbytes, tf, ff), fit_weight_rate(nbytes, tb, fb)


#: probe sizes (batch, tokens, width, conv channels) of the per-node fit: small, so that the ops' own
#: work is a small part of the residual; blocks 1 and 4 give the node counts their line runs through
NODE_SIZES = ((1, 8, 32, 4), (2, 8, 32, 4), (4, 8, 32, 4))
NODE_BLOCKS = (1, 4)
#: the quantile of the whole models' timings the per-node fit reads: a low one, as the op-class probes keep the
#: smallest of their visits' medians (a lower bound); the median let a loaded machine's slower calls through
NODE_QUANTILE = 0.2


def node_overhead_samples(table: Any, sizes: tuple[tuple[int, int, int, int], ...] = NODE_SIZES,
                          blocks: tuple[int, ...] = NODE_BLOCKS, repeats: int = 40, frontend: str = "fx"
                          ) -> list[tuple[int, float, int, float]]:
    """Per probe model (:func:`_probe_model` at ``sizes`` with ``blocks`` blocks, traced by ``frontend``: ``"fx"``,
    or ``"export"`` for a graph of ATen overloads, ``OpCostTable.node_aten_s``): ``(forward nodes,
    forward s beyond the ops, nodes with a backward, backward s beyond the ops)``. The whole model runs as
    a runtime's stage does (its generated ``forward``, then one backward through autograd from the loss,
    one thread), timed :func:`_low_times` (its :data:`NODE_QUANTILE`); the ops
    are costed by ``table`` as ``cost_mode="calibrated"`` costs them (annotate-costs, analytic), its
    per-node overhead left out, so that what is left is what each node costs beyond its op."""
    import torch

    from pdcompile.passes.annotate_costs import annotate_costs, analytic_flops
    from pdcompile.passes.costs.nodes import COMPUTE_OPS, capture
    from pdcompile.passes.costs.roofline import device_spec_for
    from pdcompile.passes.trace import trace_any

    torch.set_num_threads(1)
    spec = device_spec_for(None).calibrated(dataclasses.replace(table, node_s=(0.0, 0.0), node_aten_s=(0.0, 0.0)))
    out = []
    for nblocks in blocks:
        for b, t, d, ch in sizes:
            torch.manual_seed(0)
            inputs = (torch.randint(0, 512, (b, t)), torch.randn(b, ch, 16, 16), torch.randint(0, 16, (b, t)))
            gm = trace_any(_probe_model(d, ch, nblocks), inputs, frontend=frontend)
            annotate_costs(gm, inputs, mode="analytic", device_spec=spec, symbolic=False, progress=False)
            values = capture(gm, inputs)
            counted: dict[Any, tuple[int, int, bool, float]] = {}
            nodes = [n for n in gm.graph.nodes if n.op in COMPUTE_OPS]
            n_fwd = len(nodes)
            n_bwd = len([n for n in nodes if analytic_flops(gm, n, values, counted)[2]])
            ops_f = sum(n.meta["pd.cost"].forward_s for n in nodes)
            ops_b = sum(n.meta["pd.cost"].backward_s for n in nodes)

            def forward() -> Any:
                with torch.enable_grad():
                    return gm(*inputs)

            def step() -> None:
                forward().backward()

            secs = _low_times({"f": forward, "fb": step}, repeats, NODE_QUANTILE)
            out.append((n_fwd, secs["f"] - ops_f, n_bwd, max(secs["fb"] - secs["f"], 0.0) - ops_b))
    return out


def _low_times(fns: dict[str, Any], repeats: int, quantile: float = 0.5) -> dict[str, float]:
    """Seconds per call of each of ``fns``: ``repeats`` single calls of each, in turn (after 3 untimed),
    and the ``quantile`` of each one's timings, in this thread's CPU time: on a machine shared with other
    work a call of a few milliseconds is often preempted for tens of milliseconds, which wall time would
    count and CPU time does not (one thread computes: ``torch.set_num_threads(1)``, as every runtime
    process does)."""
    import numpy as np

    for fn in fns.values():
        for _ in range(3):
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = time.thread_time()
            fn()
            times[k].append(time.thread_time() - t0)
    return {k: float(np.quantile(v, quantile)) for k, v in times.items()}


def fit_node_samples(samples: list[tuple[int, float, int, float]]) -> tuple[float, float]:
    """``(forward, backward)`` seconds per node through :func:`node_overhead_samples`: the slope of each
    residual over its node count (:func:`~pdcompile.passes.costs.opclass.fit_node_overhead`; the fixed
    part, a call's own cost, is the runtime's per-action cost)."""
    from pdcompile.passes.costs.opclass import fit_node_overhead

    _, fwd = fit_node_overhead([s[0] for s in samples], [s[1] for s in samples])
    _, bwd = fit_node_overhead([s[2] for s in samples], [s[3] for s in samples])
    return fwd, bwd


from pdcompile.calibrate_link import (  # noqa: E402,F401 - the link part, kept importable from here
    _torchrun_module as _torchrun_module,
    _GRAD_TENSORS as _GRAD_TENSORS,
    _link_worker as _link_worker,
    measure_link_samples as measure_link_samples,
    fit_link as fit_link,
    fit_collective as fit_collective,
    CROWDED_MAX_CORES as CROWDED_MAX_CORES,
    ring_normalized as ring_normalized,
    measure_crowded_collective as measure_crowded_collective,
    measure_wake as measure_wake,
    measure_link as measure_link,
)
from pdcompile.calibrate_step import (  # noqa: E402,F401 - the optimizer step's part, kept importable from here
    STEP_PROBES as STEP_PROBES,
    fit_tensor_cost as fit_tensor_cost,
    measure_flatten as measure_flatten,
    measure_step as measure_step,
    step_seconds as step_seconds,
)


def _traced_run(family: Any, cfg: Any, steps: int, what: str) -> tuple[Any, list[Any], Path]:
    """Compile a zoo-family model into 2 stages (costs profiled here, one thread), run it traced;
    (pipeline, events, the emitted program's folder)."""
    import torch

    from pdcompile.api import pdcompile
    from pdcompile.launcher import launch
    from pdcompile.trace_convert import read_runtime_events

    torch.set_num_threads(1)  # profile as each runtime process runs (OMP_NUM_THREADS=1)
    torch.manual_seed(0)
    model = family.build(cfg)
    inputs, target = family.make_batch(cfg, torch.device("cpu"), 0, 8 * _M)
    pipe = pdcompile(model, example_inputs=inputs, example_target=target, loss_fn=family.loss(),
                     optimizer=lambda p: torch.optim.SGD(p, lr=0.01), stages=2, schedule="flush",
                     num_microbatches=_M, cost_mode="measured", leaf_modules=family.leaf_modules)
    work = Path(tempfile.mkdtemp(prefix="pdcompile-calibrate-")).resolve()
    prog = pipe.emit(work / "program")
    # timed as a user's run is: not in the test suite's NCCL-rules mode (a thread per peer, runtime/comm.py)
    rc, log = launch(prog, 2, ["--steps", str(steps), "--trace", str(work / "trace"), "--timeout", "60"],
                     timeout=180, env={"PDCOMPILE_NCCL_RULES": "0"})
    if rc != 0:
        raise RuntimeError(f"the {what} run failed ({rc}):\n{log[-2000:]}")
    return pipe, read_runtime_events(work / "trace", drop_versions=False), prog


def _steady(events: list[Any]) -> list[Any]:
    from pdcompile.trace_convert import microbatch_of

    def late(name: str) -> bool:
        k = microbatch_of(name)
        return k is None or k >= _WARMUP * _M

    return [e for e in events if late(e.name)]


def split_names(events: list[Any]) -> set[str]:
    """A split backward's parts (every ``sW k`` and its ``sB k``): not the whole backward the profile has."""
    split = {e.name for e in events if e.category == "backward" and "W" in e.name}
    return split | {w.replace("W", "B") for w in split}


def with_corun(table: Any, factor: float) -> Any:
    """``table`` with its co-running slowdown (``OpCostTable.corun``): how much slower a stage computes in a
    2-process run than alone, :func:`measure_in_run_factor`; the simulator charges it while 2 or more ranks
    compute at once (``simulate.shared_cores``). At least 1."""
    return dataclasses.replace(table, corun={2: max(1.0, float(factor))})


def measure_compute_factor(overhead_s: dict[str, float], steps: int = 20,
                           node_s: tuple[float, float] = (0.0, 0.0), traced: Any = None) -> float:
    """A run's compute against its profile on this machine: the median, over both stages'
    forward and backward, of the run's median action (less its per-action cost) / the profiled cost,
    each of the stage's nodes charged ``node_s`` (forward, backward) beyond it as the calibrated model
    charges them (``OpCostTable.node_s``), so that the factor is what is left: two processes side by side.

    The run is a traced 2-stage Flush run of a small VGG-style network (convolutions
    16-16-M-32-32-M on 32x32 images, Linear 2048-512-512-10; microbatches of 8), profiled in this
    process. The profiler reports each node's best time with its data in cache, alone; a run's
    actions, back to back beside another process, take longer; this factor carries that over to
    other models on this machine."""
    from pdcompile.zoo import vgg

    pipe, events, _ = traced or _traced_run(vgg.FAMILY, _calibration_model(), steps, "compute calibration")
    chain, plan = pipe.state.chain, pipe.plan
    scale = plan.microbatch_size / chain.batch_size
    split = split_names(events)
    ratios = []
    for s, st in enumerate(plan.stages):
        for cat, attr in (("forward", "forward_s"), ("backward", "backward_s")):
            mine = chain.layers[st.first:st.last + 1]
            prof = sum(getattr(l, attr) for l in mine) * scale + \
                node_s[cat == "backward"] * sum(len(l.members or (l.name,)) for l in mine)
            d = [e.end_s - e.start_s for e in _steady(events)
                 if e.rank == s and e.category == cat and e.name not in split]
            if d and prof > 0:
                ratios.append(max(statistics.median(d) - overhead_s.get(cat[0].upper(), 0.0), 0.0) / prof)
    return statistics.median(ratios) if ratios else 1.0


def measure_in_run_factor(overhead_s: dict[str, float], steps: int = 20, repeats: int = 30,
                          traced: Any = None) -> float:
    """How much slower a stage computes in a 2-process pipeline run than alone (``OpCostTable.corun``, charged
    while ranks compute at once): the traced 2-stage Flush run of :func:`measure_compute_factor`'s small VGG
    (microbatches of 8, both stages busy most of the step), each stage's steady forward and backward actions less
    the per-action cost, over the same stage of the same emitted program timed alone in this process
    (:class:`~pdcompile.stage_timing.StageRun`, one thread, the runtime's allocator):
    :func:`~pdcompile.stage_timing.in_run_factor`. Unlike a bare model timed in two processes side by side (~1.0 on a 2-core Xeon,
    where runs are ~1.2x slower) it holds what a run adds beside the other rank: its gloo threads, the
    launcher, the transfers' copies; unlike a run over its profile, no cost model's own error."""
    import torch

    from pdcompile.stage_timing import StageRun, in_run_factor, time_stage
    from pdcompile.zoo import vgg

    cfg = _calibration_model()
    pipe, events, prog = traced or _traced_run(vgg.FAMILY, cfg, steps, "in-run compute")
    split = split_names(events)
    in_run: dict[tuple[int, str], list[float]] = {}
    for e in _steady(events):
        if e.category in ("forward", "backward") and e.name not in split:
            in_run.setdefault((e.rank, e.category[0].upper()), []).append(e.end_s - e.start_s)
    torch.set_num_threads(1)
    inputs, target = vgg.make_batch(cfg, torch.device("cpu"), 0, 8 * _M)
    mb = pipe.plan.microbatch_size
    alone: dict[tuple[int, str], float] = {}
    for s in range(len(pipe.plan.stages)):
        torch.manual_seed(0)
        f, b = time_stage(StageRun(str(prog), s, tuple(x[:mb] for x in inputs), target[:mb]), repeats)
        alone[(s, "F")], alone[(s, "B")] = f, b
    return in_run_factor(in_run, alone, overhead_s)


def measure_overheads(steps: int = 12) -> dict[str, float]:
    """The runtime's fixed cost per action kind (``F``, ``B``, ``SF``, ...).

    From a traced 2-stage Flush run of a model too small to compute (an MLP 16-16-16-4): the median
    duration of each kind less its compute, plus the median gap between a rank's consecutive actions
    (the executor's loop)."""
    from pdcompile.trace_convert import microbatch_of

    from pdcompile.zoo import mlp

    pipe, events, _ = _traced_run(mlp.FAMILY, mlp.MLPConfig(in_features=16, hidden=(16, 16), num_classes=4), steps,
                               "overhead measurement")
    chain, plan = pipe.state.chain, pipe.plan
    scale = plan.microbatch_size / chain.batch_size
    first, last = plan.stages[0], plan.stages[-1]
    step = [s for s in step_seconds([st.gm for st in pipe.split.stages])]
    compute = {"F": sum(l.forward_s for l in chain.layers[first.first:first.last + 1]) * scale,
               "B": sum(l.backward_s for l in chain.layers[last.first:last.last + 1]) * scale,
               "ST": statistics.fmean(step)}
    split = split_names(events)
    durations: dict[str, list[float]] = {}
    for e in events:
        mb = microbatch_of(e.name)
        if (mb if mb is not None else _WARMUP * _M) < _WARMUP * _M:
            continue
        kind = e.name.lstrip("0123456789").rstrip("0123456789")
        if kind == "F" and e.rank != 0 or kind == "B" and e.rank != len(plan.stages) - 1:
            continue  # these wait for a peer inside the action
        if kind in ("B", "W") and e.name in split:
            continue  # a split backward's parts: not the whole backward the profile has
        durations.setdefault(kind, []).append(e.end_s - e.start_s)
    gap, after_step = action_gaps(events)
    return {k: max(0.0, statistics.median(durations[k]) - compute.get(k, 0.0)) + (after_step if k == "ST" else gap)
            for k in OVERHEAD_KINDS if k in durations}


def action_gaps(events: list[Any]) -> tuple[float, float]:
    """``(between actions, after a step)``: the median idle gap between a rank's consecutive actions (the
    executor's loop, charged with every action), and the median gap from a rank's optimizer step (``ST``) to its
    next action: the trainer's loop between minibatches (the next batch, its metrics; 0.5 ms on a 2-core Xeon),
    charged with the step's action, once a minibatch. A rank's last action has no gap after it."""
    gaps: list[float] = []
    after: list[float] = []
    for r in sorted({e.rank for e in events}):
        mine = sorted((e for e in events if e.rank == r), key=lambda e: e.start_s)
        for a, b in zip(mine, mine[1:]):
            is_step = a.name.lstrip("0123456789").rstrip("0123456789") == "ST"
            (after if is_step else gaps).append(max(0.0, b.start_s - a.end_s))
    gap = statistics.median(gaps) if gaps else 0.0
    return gap, (statistics.median(after) if after else gap)


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m pdcompile.calibrate", description=__doc__.split("\n")[0])
    ap.add_argument("--refresh", action="store_true", help="measure again even when cached")
    ap.add_argument("--ops", action="store_true",
                    help="measure only the cost per op class (seconds, in this process) and add it to the cache")
    ap.add_argument("--step", action="store_true",
                    help="measure only the optimizer step and the all-reduce's flatten (fixed, per tensor, rate; in "
                         "this process) and add them to the cache")
    ap.add_argument("--link-worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.link_worker:
        _link_worker(args.link_worker)
        return 0
    if args.ops:
        runtime_allocator()
        d = machine_cache.cached() or {"key": machine_key()}
        # the in-run factor needs a run (--refresh measures it): the cached one kept
        kept = float(dict((d.get("op_costs") or {}).get("corun") or {}).get("2", 1.0))
        table = with_corun(measure_op_costs(), kept)
        d["op_costs"] = table.to_dict()
        cache_path().parent.mkdir(parents=True, exist_ok=True)
        cache_path().write_text(json.dumps(d, indent=1))
        print(json.dumps({"path": str(cache_path()), "op_costs": d["op_costs"]}, indent=1))
        return 0
    if args.step:
        d = machine_cache.cached() or {"key": machine_key()}
        fixed, per, rate = measure_step()
        d.update(step_fixed_s=fixed, step_tensor_s=per, step_rate=rate, collective_tensor_s=measure_flatten()[1])
        cache_path().parent.mkdir(parents=True, exist_ok=True)
        cache_path().write_text(json.dumps(d, indent=1))
        print(json.dumps({k: d[k] for k in ("step_fixed_s", "step_tensor_s", "step_rate", "collective_tensor_s")}))
        return 0
    c, cached = load_or_measure(refresh=args.refresh, log=print)
    print(json.dumps({"cached": cached, "path": str(cache_path()), **c.to_dict()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
