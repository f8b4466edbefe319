"""A node's op class and what one op of a class costs: a fixed cost plus its work at a rate,
``seconds = alpha + work / rate``, forward and backward apart.

Op classes are the kinds of kernel whose fixed cost and speed differ: ``matmul`` (linear, matmul,
recurrent cells), ``conv``, ``attention`` (a fused kernel: scaled_dot_product_attention), ``bmm`` (a matmul of
two batched operands: an attention written out, ``q @ k^T`` and ``scores @ v``), ``norm``, ``pool`` (max and
average pooling: on one CPU thread a max pool moves its bytes tens of times slower than arithmetic does),
``elementwise`` (activations, dropout, arithmetic), three elementwise kinds whose bytes cost several times an
addition's (``softmax``; ``masked``: masked_fill; ``gelu_tanh``: GELU's tanh approximation; a GPT written out
spends much of its time in them: on a 1-thread Xeon 0.8, 1.1 and 1.8 ns per float against 0.1-0.4 for an
addition, :data:`ELEMENTWISE_KINDS`), ``embedding`` (and gathers), ``loss`` and ``view`` (shape ops that launch
no kernel). Work is FLOPs for the first three, bytes read and written for the others, ``bmm`` included (what
``annotate-costs`` counts for a node). ``python -m pdcompile.calibrate`` times each class at several
sizes on this machine and fits ``alpha`` and ``rate`` (:func:`fit_op_cost`); without a calibration
the analytic model adds :data:`DEFAULT_ALPHA_S` to its roofline (``roofline.DeviceSpec``). Beside the
classes, the calibration fits what every node costs when a whole stage runs (``OpCostTable.node_s``,
:func:`fit_node_overhead`): the generated forward's Python, autograd's node per op and its engine's
visit in the backward, ops run one after another rather than each timed alone in a loop.
Pure data and arithmetic: the node classifier reads only an fx node's target, its keywords and, for a module, its
class and ``approximate``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from pdcompile.errors import UsageError


def corun_at(corun: Mapping[int, float] | Sequence[tuple[int, float]] | None, processes: int) -> float:
    """Each process's co-running slowdown with ``processes`` computing at once on their own cores, read off a
    calibration's table (``OpCostTable.corun``, as a mapping or (processes, factor) pairs; ``OpCostTable.corun_factor``
    reads its own through it): the factor of the largest count measured that is at most ``processes``; 1 for one
    process or without a table."""
    pairs = corun.items() if isinstance(corun, Mapping) else (corun or ())
    known = [(int(n), float(f)) for n, f in pairs if int(n) <= processes]
    return max(known)[1] if known else 1.0


__all__ = ["DEFAULT_ALPHA_S", "ELEMENTWISE_KINDS", "FLOP_CLASSES", "OP_CLASSES", "PARENT_CLASS", "WEIGHT_CLASSES", "OpCost", "OpCostTable", "corun_at",
           "default_alphas", "fit_node_overhead", "fit_op_cost", "fit_weight_rate", "is_aten", "op_class", "op_class_of_name", "op_name"]

OP_CLASSES = ("matmul", "conv", "attention", "bmm", "norm", "pool", "elementwise", "softmax", "masked", "gelu_tanh",
              "embedding", "loss", "view")
#: work in FLOPs; the others' in bytes read + written (``bmm`` too: a written-out attention's products of a few tens
#: of rows and columns each run at the rate their operands' bytes move, which the heads' transposed views are copied
#: in; over the probes' shapes its time follows their bytes (+-25%) where it follows FLOPs only to +-40%)
FLOP_CLASSES = ("matmul", "conv", "attention")
#: elementwise kinds probed on their own (``pdcompile.calibrate.kernel_samples``): their bytes cost several times an
#: addition's on a CPU thread (a 1-thread Xeon, floats in L2: softmax 0.8 ns per element, masked_fill with a
#: broadcast mask 1.1, GELU's tanh approximation 1.8, against 0.1-0.4 for add, ReLU or GELU's erf form); a table
#: without one of them (a calibration before it) charges it as ``elementwise`` (:data:`PARENT_CLASS`)
ELEMENTWISE_KINDS = ("softmax", "masked", "gelu_tanh")
#: a class a table may lack (a calibration before it) -> the class it is then charged as: the elementwise kinds as
#: elementwise, their work in the same unit. Not ``bmm`` (a matmul of two batched operands, :func:`_batched`), which
#: such a calibration charged as attention: its work is bytes, attention's FLOPs; a table without it charges it as
#: any class it did not fit, the roofline with the documented fixed cost (``DeviceSpec.op_seconds``)
PARENT_CLASS = {k: "elementwise" for k in ELEMENTWISE_KINDS}

#: The fixed seconds of one op per class, forward (a backward is charged 1.5 times as much: it runs
#: one or two kernels per op) when no calibration is at hand. CPU: eager PyTorch's dispatch and one thread's
#: kernel set-up, the order the calibration fits on x86 (a few to tens of microseconds; the fits on the
#: 2-core development VM are in benchmarks/RESULTS.md); GPU: a kernel launch from eager PyTorch
#: (5-10 us, the host's dispatch dominating small kernels), more for the few-kernel ops.
DEFAULT_ALPHA_S: dict[str, dict[str, float]] = {
    "cpu": {"matmul": 20e-6, "conv": 40e-6, "attention": 25e-6, "bmm": 20e-6, "norm": 15e-6, "pool": 10e-6, "elementwise": 3e-6,
            "softmax": 5e-6, "masked": 3e-6, "gelu_tanh": 3e-6, "embedding": 15e-6, "loss": 15e-6, "view": 2e-6},
    "gpu": {"matmul": 10e-6, "conv": 15e-6, "attention": 25e-6, "bmm": 10e-6, "norm": 10e-6, "pool": 8e-6, "elementwise": 8e-6,
            "softmax": 10e-6, "masked": 8e-6, "gelu_tanh": 8e-6, "embedding": 10e-6, "loss": 20e-6, "view": 3e-6},
}
BACKWARD_ALPHA_FACTOR = 1.5


def default_alphas(device_name: str) -> dict[str, float]:
    """:data:`DEFAULT_ALPHA_S` for a device named ``device_name`` (``cpu`` or any accelerator)."""
    return dict(DEFAULT_ALPHA_S["cpu" if device_name.lower().startswith("cpu") else "gpu"])


@dataclass(frozen=True)
class OpCost:
    """One class's ``seconds = alpha_s + work / rate`` (``rate`` in FLOP/s or bytes/s; inf: no size term)."""

    alpha_s: float
    rate: float

    def seconds(self, work: float) -> float:
        return self.alpha_s + (work / self.rate if work and self.rate < float("inf") else 0.0)


@dataclass(frozen=True)
class OpCostTable:
    """A machine's fitted :class:`OpCost` per class, forward and backward, and where they came from
    (``source``: what ``explain()`` prints, e.g. "calibrated 2026-12-07 05:01 UTC on host")."""

    forward: Mapping[str, OpCost] = field(default_factory=dict)
    backward: Mapping[str, OpCost] = field(default_factory=dict)
    source: str = ""
    #: busy processes -> how much slower each computes than one alone (memory bandwidth and caches
    #: shared; measured by ``python -m pdcompile.calibrate`` up to the host's cores; 1 when absent)
    corun: Mapping[int, float] = field(default_factory=dict)
    #: (forward, backward) seconds every node pays beyond its op's cost when a whole stage runs: the
    #: generated forward's line and module call, autograd's node and the engine's visit of it in the
    #: backward (a backward only for nodes that have one); fitted by ``python -m pdcompile.calibrate``
    #: from whole probe models of 1 and 4 blocks (:func:`fit_node_overhead`); (0, 0) when absent
    node_s: tuple[float, float] = (0.0, 0.0)
    #: (forward, backward) bytes/s at which a matmul's or convolution's weights stream, charged per weight
    #: byte beyond its FLOPs (``weight_seconds``): at a small microbatch a layer's time is its weights',
    #: read in the forward, read again and their gradient written and accumulated in the backward, which
    #: FLOPs do not see (a 1568x512 Linear at 6 samples: 0.3 ms forward, 1.2 ms backward on the 2-core VM
    #: against 0.1 and 0.2 for its FLOPs); fitted by ``python -m pdcompile.calibrate`` (``fit_weight_rate``)
    #: from Linears of two weight sizes at one sample; (0, 0) when absent: not charged
    weight_rate: tuple[float, float] = (0.0, 0.0)
    #: seconds a split backward's weight pass (``W``, runtime/graph_split.py: the traced backward graph's weight
    #: half, run op by op) costs per trainable parameter tensor beyond the weight gradients' own share of the
    #: backward: its ops' dispatch, views and accumulation into ``.grad``; fitted by ``python -m
    #: pdcompile.calibrate`` from the probe model's weight pass at 1 and 4 blocks; 0 when absent
    w_param_s: float = 0.0
    #: (forward, backward) per-node overhead of a node that calls an ATen overload (``is_aten``: the graphs torch.export
    #: makes, e.g. a Hugging Face model's): its generated line calls ``torch.ops.aten.X.overload``, whose Python
    #: dispatch costs more than a module's or a torch function's call; fitted by ``python -m pdcompile.calibrate``
    #: from the probe models exported; (0, 0) when absent: such nodes pay :attr:`node_s`
    node_aten_s: tuple[float, float] = (0.0, 0.0)

    def __post_init__(self) -> None:
        # an elementwise kind this table did not fit (:data:`PARENT_CLASS`: a calibration from before they were
        # probed) is charged as elementwise, as such a calibration charged it
        for name in ("forward", "backward"):
            part = dict(getattr(self, name))
            missing = {k: part[p] for k, p in PARENT_CLASS.items() if k not in part and p in part}
            if missing:
                object.__setattr__(self, name, {**part, **missing})

    def weight_seconds(self, weight_bytes: float, backward: bool = False) -> float:
        """Seconds a matmul's or convolution's ``weight_bytes`` of weights cost beyond its FLOPs (0 uncalibrated)."""
        rate = float(self.weight_rate[1 if backward else 0])
        return weight_bytes / rate if weight_bytes > 0 and rate > 0 else 0.0

    def node_overhead(self, backward: bool = False, aten: bool = False) -> float:
        """Seconds one node pays beyond its op's fitted cost in a whole stage's forward (or backward); ``aten``: a
        node calling an ATen overload (:attr:`node_aten_s` where fitted)."""
        if aten and any(self.node_aten_s):
            return float(self.node_aten_s[1 if backward else 0])
        return float(self.node_s[1 if backward else 0])

    def corun_factor(self, processes: int) -> float:
        """Each process's slowdown with ``processes`` computing at once on their own cores: the measured
        factor for the largest count measured that is at most ``processes`` (1 for one process)."""
        return corun_at(self.corun, processes)

    def to_dict(self) -> dict[str, Any]:
        def rate(r: float) -> float | None:
            return None if r == float("inf") else r  # JSON has no infinity

        return {"source": self.source,
                "forward": {k: [v.alpha_s, rate(v.rate)] for k, v in sorted(self.forward.items())},
                "backward": {k: [v.alpha_s, rate(v.rate)] for k, v in sorted(self.backward.items())},
                "corun": {str(n): f for n, f in sorted(self.corun.items())},
                "node": [float(self.node_s[0]), float(self.node_s[1])],
                "weight": [float(self.weight_rate[0]), float(self.weight_rate[1])],
                "w_param": float(self.w_param_s),
                "node_aten": [float(self.node_aten_s[0]), float(self.node_aten_s[1])]}

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> OpCostTable:
        """The table :meth:`to_dict` wrote; a bad layout is a ValueError."""
        def part(key: str) -> dict[str, OpCost]:
            out = {}
            for k, v in dict(d[key]).items():
                a, r = float(v[0]), float("inf") if v[1] is None else float(v[1])
                if len(v) != 2:
                    raise ValueError(f"bad op cost {k}: {v}")
                if k not in OP_CLASSES or not (a >= 0 and r > 0):
                    raise ValueError(f"bad op cost {k}: {v}")
                out[k] = OpCost(a, r)
            return out

        corun = {int(n): float(f) for n, f in dict(d.get("corun") or {}).items()}
        if any(n < 1 or not f >= 1.0 for n, f in corun.items()):
            raise ValueError(f"bad co-running slowdowns {corun}")
        node = [float(x) for x in (d.get("node") or (0.0, 0.0))]  # absent in calibrations before it: none
        aten = [float(x) for x in (d.get("node_aten") or (0.0, 0.0))]
        if len(node) != 2 or len(aten) != 2 or not all(x >= 0 and math.isfinite(x) for x in node + aten):
            raise ValueError(f"bad per-node overhead {node}, {aten}")
        weight = [float(x) for x in (d.get("weight") or (0.0, 0.0))]  # absent in calibrations before it: none
        if len(weight) != 2 or not all(x >= 0 and math.isfinite(x) for x in weight):
            raise ValueError(f"bad weight rates {weight}")
        w_param = float(d.get("w_param") or 0.0)
        if not (w_param >= 0 and math.isfinite(w_param)):
            raise ValueError(f"bad weight-pass cost per parameter {w_param}")
        return OpCostTable(part("forward"), part("backward"), str(d.get("source", "")), corun, (node[0], node[1]),
                           (weight[0], weight[1]), w_param, (aten[0], aten[1]))


def fit_op_cost(work: Sequence[float] | np.ndarray, seconds: Sequence[float] | np.ndarray,
                trim: bool = True) -> OpCost:
    """The ``alpha + work / rate`` through timings ``seconds`` of ops of ``work`` each, fitted in
    relative error (small and large ops count alike: rows scaled by ``1 / seconds``), ``alpha >= 0``
    (a negative intercept refits through the origin); with ``trim`` (five or more timings) fitted again
    without the fifth that fits worst (a timing a busy machine inflated). Needs two or more distinct works."""
    w = np.asarray(work, dtype=float)
    t = np.asarray(seconds, dtype=float)
    if w.shape != t.shape or w.ndim != 1 or len(np.unique(w)) < 2:
        raise UsageError("fit_op_cost: needs equal-length 1-D arrays with at least two distinct works")
    if np.any(t <= 0) or np.any(w < 0) or not np.all(np.isfinite(t)):
        raise UsageError("fit_op_cost: timings must be positive and finite, works >= 0")
    alpha, inv_rate = _fit(w, t)
    if trim and len(t) >= 5:  # timings on a busy machine: refit without the worst fifth
        resid = np.abs((alpha + w * inv_rate) / t - 1.0)
        keep = resid <= np.quantile(resid, 0.8)
        if len(np.unique(w[keep])) >= 2:
            alpha, inv_rate = _fit(w[keep], t[keep])
    if inv_rate <= 0:  # no size dependence measurable: all fixed cost
        return OpCost(float(np.median(t)), float("inf"))
    return OpCost(float(alpha), float(1.0 / inv_rate))


WEIGHT_CLASSES = ("matmul", "conv")  # op classes whose weights' bytes are charged (OpCostTable.weight_seconds)


def fit_weight_rate(weight_bytes: Sequence[float], seconds: Sequence[float],
                    flop_seconds: Sequence[float]) -> float:
    """Bytes/s at which weights stream: through ops of ``weight_bytes`` each timed at ``seconds``, of which
    ``flop_seconds`` is what the class's fit charges (fixed cost and FLOPs), the median over the ops of
    ``weight_bytes / (seconds - flop_seconds)`` (one op timed high or low moves it little); 0 where no op
    took longer than its FLOPs (nothing to charge)."""
    rates = sorted(float(b) / (t - f) for b, t, f in zip(weight_bytes, seconds, flop_seconds) if b > 0 and t > f)
    if not weight_bytes or len(weight_bytes) != len(seconds) or len(seconds) != len(flop_seconds):
        raise UsageError("fit_weight_rate: needs equal-length, non-empty weight sizes, timings and FLOP costs")
    if not rates:
        return 0.0
    n = len(rates)
    return rates[n // 2] if n % 2 else 0.5 * (rates[n // 2 - 1] + rates[n // 2])


def fit_node_overhead(nodes: Sequence[float] | np.ndarray, residual_s: Sequence[float] | np.ndarray) -> tuple[float, float]:
    """``(fixed, per_node)`` through a whole model's time beyond its ops' costs (``residual_s``) at ``nodes``
    nodes each: the line ``fixed + nodes x per_node``, fitted robustly (Theil-Sen: the median of the
    slopes between every two timings of different node counts, then the median intercept), so that a
    timing a busy machine inflated moves neither; both clamped at 0 (the fixed part: a call's own cost,
    e.g. the autograd engine's start). Needs two or more distinct node counts."""
    n = np.asarray(nodes, dtype=float)
    r = np.asarray(residual_s, dtype=float)
    if n.shape != r.shape or n.ndim != 1 or len(np.unique(n)) < 2:
        raise UsageError("fit_node_overhead: needs equal-length 1-D arrays with at least two distinct node counts")
    if not np.all(np.isfinite(r)):
        raise UsageError("fit_node_overhead: residual timings must be finite")
    i, j = np.triu_indices(len(n), 1)
    keep = n[i] != n[j]
    slope = max(0.0, float(np.median((r[j] - r[i])[keep] / (n[j] - n[i])[keep])))
    return max(0.0, float(np.median(r - slope * n))), slope


def _fit(w: np.ndarray, t: np.ndarray) -> tuple[float, float]:
    """(alpha >= 0, 1 / rate) minimising the relative residuals ``(alpha + w / rate) / t - 1``."""
    A = np.stack([1.0 / t, w / t], axis=1)
    (alpha, inv_rate), *_ = np.linalg.lstsq(A, np.ones_like(t), rcond=None)
    if alpha < 0:
        return 0.0, float(np.sum(w / t) / np.sum((w / t) ** 2))
    return float(alpha), float(inv_rate)


_MODULE_CLASSES: tuple[tuple[tuple[str, ...], str], ...] = (
    (("Softmax", "Softmin"), "softmax"),
    (("Linear", "Bilinear", "LSTM", "GRU", "RNN"), "matmul"),
    (("Conv",), "conv"),
    (("Attention",), "attention"),
    (("Norm",), "norm"),
    (("MaxPool", "AvgPool", "LPPool"), "pool"),
    (("Embedding",), "embedding"),
    (("Loss",), "loss"),
    (("Flatten", "Unflatten", "Identity"), "view"),
)
_MATMUL = {"linear", "matmul", "bmm", "addmm", "baddbmm", "addbmm", "einsum", "mm", "lstm", "gru", "rnn"}
_EMBEDDING = {"embedding", "embedding_bag", "gather", "index_select", "take", "take_along_dim"}
_SOFTMAX = {"softmax", "log_softmax", "softmin"}
_MASKED = {"masked_fill"}
_VIEW = {"getitem", "getattr", "size", "view", "reshape", "flatten", "unflatten", "permute", "transpose", "squeeze",
         "unsqueeze", "expand", "split", "chunk", "unbind", "contiguous", "dim", "t", "narrow", "detach", "view_as",
         "expand_as", "movedim", "swapaxes", "slice", "select", "alias", "unsafe_view", "split_with_sizes",
         "as_strided", "sym_size"}


def op_class_of_name(name: str, module: bool = False) -> str:
    """The op class of a module's class name (``module``) or a function or method's name; elementwise
    when nothing more specific matches (activations, pooling, dropout, softmax, arithmetic)."""
    if module:
        return next((cls for keys, cls in _MODULE_CLASSES if any(k in name for k in keys)), "elementwise")
    low = name.lower().strip("_.")
    if "attention" in low:
        return "attention"
    if low in _SOFTMAX:
        return "softmax"
    if low in _MASKED:
        return "masked"
    if low.startswith("conv"):
        return "conv"
    if low in _MATMUL:
        return "matmul"
    if "norm" in low:
        return "norm"
    if "pool" in low and "pooler" not in low:
        return "pool"
    if low in _EMBEDDING:
        return "embedding"
    if "loss" in low or "entropy" in low or low == "kl_div":
        return "loss"
    return "view" if low in _VIEW else "elementwise"


def op_name(target: Any) -> str:
    """The name an fx node's function target is classified by: an ATen overload (``torch.ops.aten.linear.default``,
    what torch.export's graphs call) by its op's name (``linear``), not its overload's (``linear.default``);
    anything else by its ``__name__``."""
    packet = getattr(target, "_overloadpacket", None)
    if packet is not None:
        return str(getattr(packet, "__name__", packet)).split(".")[-1]
    return str(getattr(target, "__name__", target))


def is_aten(node: Any) -> bool:
    """Whether an fx node calls an ATen overload (``torch.ops.aten.X.overload``: a graph torch.export made),
    whose call from a generated forward costs more than a module's or a torch function's
    (``OpCostTable.node_aten_s``)."""
    return node.op == "call_function" and getattr(node.target, "_overloadpacket", None) is not None


_BATCHED = {"matmul", "bmm", "baddbmm"}


def _batched(node: Any) -> bool:
    """Whether a matmul node multiplies two batched operands (both 3-D or more, ``node.meta["pd.tensor"]`` of its
    first two arguments): the heads' ``q @ k^T`` and ``scores @ v`` of an attention written out, many small
    products on transposed views (copied first), which run at neither a Linear's rate nor a fused attention's
    (a 1-thread Xeon: 36-58 GFLOP/s for 4 heads of 32 x 24, 61-101 for 4 of 64 x 32, against ~150 for a 96 -> 288
    Linear over 1024 rows; 7.5-12 GB/s of their operands' and output's bytes in both): class ``bmm``, its work
    bytes (:data:`FLOP_CLASSES`), probed at such shapes (``pdcompile.calibrate.BMM_PROBES``)."""
    args = [a for a in node.args[:2]]
    ranks = [len(getattr(getattr(a, "meta", {}).get("pd.tensor"), "shape", ())) for a in args]
    return len(ranks) == 2 and min(ranks) >= 3


def _tanh_gelu(node: Any, gm: Any) -> bool:
    """Whether an fx node is GELU's tanh approximation: an ``nn.GELU(approximate="tanh")`` through ``gm``, or a
    ``gelu`` call (``F.gelu``, ``aten.gelu``) with ``approximate="tanh"``."""
    if node.op == "call_module":
        return gm is not None and getattr(gm.get_submodule(str(node.target)), "approximate", None) == "tanh"
    name = str(node.target) if node.op == "call_method" else op_name(node.target)
    return name.lower().strip("_.") == "gelu" and node.kwargs.get("approximate") == "tanh"


def op_class(node: Any, gm: Any = None) -> str:
    """The op class of an fx node (``call_module`` through ``gm``'s submodule's class name); a matmul of two
    batched operands (:func:`_batched`) is ``bmm``; GELU's tanh approximation is ``gelu_tanh``."""
    if node.op in ("call_module", "call_function", "call_method") and _tanh_gelu(node, gm):
        return "gelu_tanh"
    if node.op == "call_module" and gm is not None:
        return op_class_of_name(type(gm.get_submodule(str(node.target))).__name__, module=True)
    name = str(node.target) if node.op == "call_method" else op_name(node.target)
    cls = op_class_of_name(name)
    if cls == "matmul" and name.lower().strip("_.") in _BATCHED and _batched(node):
        return "bmm"
    return cls
