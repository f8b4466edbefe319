"""Analytic time: a :class:`DeviceSpec` roofline turns FLOPs and bytes into seconds, the same on
every machine; presets by name, or the cluster's own device."""

from __future__ import annotations

from dataclasses import dataclass

from pdcompile.cluster import ClusterSpec
from pdcompile.errors import UsageError

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
