"""Analytic time: a :class:`DeviceSpec` roofline turns FLOPs and bytes into seconds, the same on
every machine; presets by name, or the cluster's own device. Each op also pays its class's fixed
cost (``passes/costs/opclass.py``): a preset's documented default, or, with this machine's
calibration (``op_costs``), the fitted ``alpha + work / rate`` per class instead of the roofline, and every
node the per-node overhead of a whole stage the calibration fitted (``OpCostTable.node_s``)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from pdcompile.cluster import ClusterSpec
from pdcompile.errors import UsageError
from pdcompile.passes.costs.opclass import (BACKWARD_ALPHA_FACTOR, FLOP_CLASSES, WEIGHT_CLASSES, OpCostTable, corun_at,
                                            default_alphas)

@dataclass(frozen=True)
class DeviceSpec:
    """A device for analytic costs: dense peak FLOP/s, memory bandwidth (B/s), and the fraction
    of each a real kernel reaches."""

    name: str
    peak_flops: float
    mem_bandwidth: float = 0.0  # 0: ignore memory traffic
    efficiency: float = 0.5
    bandwidth_efficiency: float = 0.7
    # fixed seconds of one forward op per class (opclass.OP_CLASSES; a backward pays BACKWARD_ALPHA_FACTOR
    # times it); empty: none (a spec built by hand says what it wants; the presets carry the defaults)
    alphas: tuple[tuple[str, float], ...] = ()
    op_costs: OpCostTable | None = None  # this machine's fit per class (python -m pdcompile.calibrate)

    def seconds(self, flops: float, nbytes: float = 0.0) -> float:
        """The roofline alone: ``max(flops / (peak x efficiency), bytes / (bandwidth x efficiency))``."""
        compute = flops / (self.peak_flops * self.efficiency)
        memory = nbytes / (self.mem_bandwidth * self.bandwidth_efficiency) if self.mem_bandwidth else 0.0
        return max(compute, memory)

    def op_seconds(self, op: str, flops: float, nbytes: float, backward: bool = False,
                   weight_bytes: float = 0.0, aten: bool = False) -> float:
        """One op of class ``op`` in a stage: with a calibration that fitted the class, its ``alpha + work /
        rate`` (work: FLOPs for matmul, conv and attention, else bytes), plus for a matmul or convolution
        its ``weight_bytes`` at the calibrated weight rate (``OpCostTable.weight_seconds``); otherwise the
        roofline plus the class's fixed cost (:attr:`alphas`, x1.5 for a backward); with a calibration, plus
        the node's overhead in a whole stage (:meth:`node_overhead`; ``aten``: a node calling an ATen overload)."""
        fit = None if self.op_costs is None else (self.op_costs.backward if backward else self.op_costs.forward).get(op)
        if fit is not None:
            weights = self.op_costs.weight_seconds(weight_bytes, backward) \
                if self.op_costs is not None and op in WEIGHT_CLASSES else 0.0
            return fit.seconds(flops if op in FLOP_CLASSES else nbytes) + weights + self.node_overhead(backward, aten)
        alpha = dict(self.alphas).get(op, 0.0) * (BACKWARD_ALPHA_FACTOR if backward else 1.0)
        return alpha + self.node_overhead(backward, aten) + (0.0 if op == "view" else self.seconds(flops, nbytes))  # a view moves no bytes

    def op_fixed(self, op: str, backward: bool = False, weight_bytes: float = 0.0, aten: bool = False) -> float:
        """Of :meth:`op_seconds`, the fixed part (a microbatch of any size pays it once: its weights' too)."""
        fit = None if self.op_costs is None else (self.op_costs.backward if backward else self.op_costs.forward).get(op)
        if fit is not None:
            weights = self.op_costs.weight_seconds(weight_bytes, backward) \
                if self.op_costs is not None and op in WEIGHT_CLASSES else 0.0
            return fit.alpha_s + weights + self.node_overhead(backward, aten)
        return dict(self.alphas).get(op, 0.0) * (BACKWARD_ALPHA_FACTOR if backward else 1.0) + \
            self.node_overhead(backward, aten)

    def node_overhead(self, backward: bool = False, aten: bool = False) -> float:
        """Seconds each node pays in a whole stage beyond its op (this machine's calibration,
        ``OpCostTable.node_s``, or ``node_aten_s`` for a node calling an ATen overload; 0 without one)."""
        return 0.0 if self.op_costs is None else self.op_costs.node_overhead(backward, aten)

    def with_default_alphas(self) -> DeviceSpec:
        """This spec with its device kind's documented fixed cost per op class (opclass.DEFAULT_ALPHA_S)."""
        return replace(self, alphas=tuple(sorted(default_alphas(self.name).items())))

    def calibrated(self, table: OpCostTable | None) -> DeviceSpec:
        """This spec with this machine's fitted op costs (None: as it is)."""
        return self if table is None else replace(self, op_costs=table)

    def describe(self) -> str:
        """One line for ``explain()``: which time model the costs came from."""
        if self.op_costs is not None:
            f, b = self.op_costs.node_s
            node = (f"; every node {f * 1e6:.1f} us forward, {b * 1e6:.1f} us backward beyond its op "
                    f"(per-node overhead of a whole stage, fitted)" if f or b else
                    "; no per-node overhead of a whole stage (calibrated before it: python -m pdcompile.calibrate --refresh)")
            return (f"fixed cost + work / rate per op class, fitted on this machine ({self.op_costs.source}); "
                    f"roofline {self} for classes it did not fit{node}")
        if self.alphas:
            return (f"roofline {self} plus a documented default fixed cost per op "
                    f"({', '.join(f'{k} {v * 1e6:g} us' for k, v in self.alphas)}; x{BACKWARD_ALPHA_FACTOR:g} "
                    f"backward)")
        return f"roofline {self}, no fixed cost per op"

    def __str__(self) -> str:
        return (f"{self.name}: {self.peak_flops / 1e12:.1f} TFLOP/s x {self.efficiency}, "
                f"{self.mem_bandwidth / 1e9:.0f} GB/s x {self.bandwidth_efficiency}")


def optimizer_step_bytes(param_bytes: float, optimizer_state_factor: float) -> float:
    """Bytes one optimizer step streams through memory over ``param_bytes`` of weights: it reads the
    weights and their gradients and writes the weights (3x), and reads and writes its state
    (``optimizer_state_factor`` x the weights, 2x): plain SGD 3x, SGD with momentum 5x, Adam 7x."""
    return param_bytes * (3.0 + 2.0 * optimizer_state_factor)


def stream_bandwidth(spec: DeviceSpec) -> float:
    """Bytes per second an elementwise pass over memory moves on ``spec`` (the optimizer step, a weight
    copy): its memory bandwidth x efficiency, as :meth:`DeviceSpec.seconds` charges bytes; inf when the
    spec ignores memory traffic."""
    return spec.mem_bandwidth * spec.bandwidth_efficiency if spec.mem_bandwidth else math.inf


#: Seconds per parameter tensor where no calibration gives them (``python -m pdcompile.calibrate`` measures
#: both: ``step_tensor_s``, ``collective_tensor_s``), by device kind: the optimizer step (SGD with momentum)
#: and the data-parallel all-reduce's flatten and copy back (``runtime/executor.py`` ``allreduce_flat``).
#: On CPU torch's optimizers loop over the tensors one by one (no foreach kernel by default off CUDA):
#: ~6 us a tensor for the step and ~4 us for the flatten and copy back on the 2-core x86 development VM
#: (benchmarks/RESULTS.md, session 22). On a GPU torch steps all tensors with foreach (or fused) kernels, a
#: launch per op over every tensor at once: 0 per tensor here (their launches are the per-action cost's).
TENSOR_STEP_S: dict[str, float] = {"cpu": 6e-6}
TENSOR_FLATTEN_S: dict[str, float] = {"cpu": 4e-6}
#: An optimizer's work per parameter tensor against SGD with momentum's (what the calibration times), by its
#: state per weight byte (``optimizer_state_factor``): plain SGD (0) one op a tensor, SGD with momentum (1) four,
#: Adam (2) about a dozen. Measured on the 2-core x86 development VM, torch 2 on CPU, 16-float tensors: 1.8, 6.2
#: and 20 us a tensor (step and zero_grad; benchmarks/RESULTS.md, session 22); between them linear, beyond the
#: last the last.
TENSOR_WORK: tuple[tuple[float, float], ...] = ((0.0, 0.3), (1.0, 1.0), (2.0, 3.3))


def tensor_work(optimizer_state_factor: float) -> float:
    """:data:`TENSOR_WORK` at ``optimizer_state_factor``: the optimizer's per-tensor work against SGD with
    momentum's, read linearly between its points."""
    pts = TENSOR_WORK
    f = min(max(optimizer_state_factor, pts[0][0]), pts[-1][0])
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if f <= x1:
            return y0 + (y1 - y0) * (f - x0) / (x1 - x0)
    return pts[-1][1]


def optimizer_step_s(param_bytes: float, optimizer_state_factor: float, bandwidth: float,
                     tensors: float = 0.0, tensor_s: float = 0.0) -> float:
    """One optimizer step over ``param_bytes`` of weights at ``bandwidth`` bytes/s of streamed memory
    (:func:`optimizer_step_bytes`; its fixed cost is the runtime's per-action ``ST`` cost), plus ``tensor_s``
    for each of its ``tensors`` parameter tensors (measured for SGD with momentum, :data:`TENSOR_STEP_S` or
    the calibration's), x the optimizer's own work per tensor (:func:`tensor_work`: plain SGD 0.3, Adam 3.3)."""
    per = tensors * tensor_s * tensor_work(optimizer_state_factor) if tensors and tensor_s else 0.0
    return optimizer_step_bytes(param_bytes, optimizer_state_factor) / bandwidth + per


def weight_copy_s(param_bytes: float, bandwidth: float) -> float:
    """One copy of ``param_bytes`` of weights (read and written) at ``bandwidth`` bytes/s: what weight
    stashing's clone costs (``runtime/weights.py``'s VersionedStore)."""
    return 2.0 * param_bytes / bandwidth


#: Published dense FP32 (TF32 for A100/H100/H200 tensor cores not assumed) peaks and HBM bandwidth.
#: Each with its kind's default fixed cost per op class (opclass.DEFAULT_ALPHA_S).
DEVICE_SPECS: dict[str, DeviceSpec] = {k: v.with_default_alphas() for k, v in {
    "cpu": DeviceSpec("cpu", 100e9, 20e9),
    "v100": DeviceSpec("v100", 15.7e12, 900e9),
    "a100": DeviceSpec("a100", 19.5e12, 1.555e12),
    "h100": DeviceSpec("h100", 67e12, 3.35e12),
    "h200": DeviceSpec("h200", 67e12, 4.8e12),
}.items()}


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
        return DeviceSpec(dev.name, peak, dev.memory_bandwidth or base.mem_bandwidth).with_default_alphas()
    return base


#: intra-op threads of each runtime process on CPU (torchrun's OMP_NUM_THREADS=1, the launcher's default)
THREADS_PER_PROCESS = 1


def contention(cluster: ClusterSpec | None, threads: int = THREADS_PER_PROCESS) -> float:
    """How much slower each process computes when a local CPU cluster's ``workers x threads`` exceed its
    host's cores (``Device.cores``, set by ``local_cpu_cluster``): ``max(1, workers x threads / cores)``,
    the time-sharing of every busy core; 1 for a cluster whose device does not name its cores."""
    cores = getattr(getattr(cluster, "device", None), "cores", None)
    if cluster is None or not cores:
        return 1.0
    return max(1.0, cluster.num_workers * threads / cores)


def cores_held(shares: Sequence[float], cores: float, threads: int = THREADS_PER_PROCESS) -> list[float]:
    """For each process ``i`` of a host of ``cores`` shared by processes that compute ``shares[j]`` of the time
    (0..1; ``threads`` threads each), the chance that, when it is woken (a message for a blocking receive),
    the others computing hold every core: ``P(threads x N_i >= cores)``, ``N_i`` the others computing then,
    each independently with its share (:func:`others_busy`, as :func:`shared_core_stretch` reads it). 0 wherever the
    others' threads are fewer than the cores (no more processes than cores, one thread each)."""
    return [sum(q for k, q in enumerate(others_busy(shares, i)) if threads * k >= cores) for i in range(len(shares))]


def others_busy(shares: Sequence[float], i: int) -> list[float]:
    """``P(N_i = k)`` for ``k = 0 .. len(shares) - 1``: ``N_i`` the processes other than ``i`` computing at a
    moment, each independently with its busy share ``shares[j]`` (clamped to 0..1): a Poisson binomial."""
    dist = [1.0]
    for j, p_j in enumerate(shares):
        if j == i:
            continue
        p = min(1.0, max(0.0, float(p_j)))
        nxt = [0.0] * (len(dist) + 1)
        for k, q in enumerate(dist):
            nxt[k] += q * (1 - p)
            nxt[k + 1] += q * p
        dist = nxt
    return dist


def shared_core_stretch(shares: Sequence[float], cores: float, threads: int = THREADS_PER_PROCESS,
                        corun: Mapping[int, float] | Sequence[tuple[int, float]] | None = None) -> list[float]:
    """Each process's compute slowdown on a host of ``cores`` shared by processes that compute
    ``shares[i]`` of the time (their busy share of a step, 0..1), with ``threads`` threads each: processor
    sharing, where ``n`` threads computing at once on ``cores`` each run ``max(1, n / cores)`` slower, and,
    with a calibration's co-running slowdowns ``corun`` (:func:`corun_at`: shared memory bandwidth and caches),
    ``corun(min(n, cores))`` slower again. For process ``i``: ``E[corun(min(1 + N_i, cores)) x max(1, threads
    x (1 + N_i) / cores)]``, ``N_i`` the others computing while it does, each independently with its share (a
    Poisson binomial). A process alone keeps its time (1); without ``corun``, so do peers never more than the
    cores; every one of ``w`` always busy gets the static ``corun(min(w, cores)) x w x threads / cores``
    (:func:`contention`); a pipeline's stages, idle in its fill and drain, get less."""
    out = []
    memo: dict[float, float] = {}
    for i, p_i in enumerate(shares):
        if p_i in memo:  # the others are the same multiset for every process of one share (a stage's replicas)
            out.append(memo[p_i])
            continue
        dist = others_busy(shares, i)
        memo[p_i] = sum(q * corun_at(corun, min(1 + k, max(1, int(cores)))) * max(1.0, threads * (1 + k) / cores)
                        for k, q in enumerate(dist))
        out.append(memo[p_i])
    return out
