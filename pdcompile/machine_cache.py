"""Where this machine's measured constants are cached and whom they hold for: the piece that
:mod:`pdcompile.calibrate` (which measures and writes them) and :mod:`pdcompile.api` (which reads
the runtime's per-action cost for ``schedule="auto"``, never measuring) share, below both. Without a
calibration for this runtime, :func:`action_cost` gives a conservative built-in estimate and the
line that says so; :func:`op_costs` gives the fitted cost per op class (or None and why), which the
``calibrated`` cost mode reads."""

from __future__ import annotations

import json
import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdcompile.cluster import ClusterSpec
    from pdcompile.passes.costs.opclass import OpCostTable


def cache_path() -> Path:
    """Where the constants are kept: ``$PDCOMPILE_CACHE/machine-constants.json`` (default ``~/.cache/pdcompile``)."""
    root = os.environ.get("PDCOMPILE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "pdcompile")
    return Path(root) / "machine-constants.json"


def machine_key() -> str:
    """Constants hold for one host, core count, Python and torch build, and one version of the runtime
    (its per-action cost is its code's)."""
    import hashlib

    import torch

    import pdcompile.runtime as rt

    h = hashlib.sha1()
    for f in sorted(Path(rt.__file__).parent.rglob("*.py")):
        h.update(f.read_bytes())
    return (f"{platform.node()}|{os.cpu_count()}|{platform.python_version()}|{torch.__version__}|"
            f"runtime {h.hexdigest()[:12]}")


def cached() -> dict[str, Any] | None:
    """The cached constants as written, if they hold for this machine (:func:`machine_key`); else None
    (no cache, unreadable, or another machine's)."""
    try:
        d = json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return None
    return d if isinstance(d, dict) and d.get("key") == machine_key() else None


# The runtime's per-action cost when this runtime has no calibration: a flat 0.3 ms per action of every
# kind pdcompile.calibrate measures, about twice the costliest kind it measured on the 2-core x86
# development VM (benchmarks/RESULTS.md, bench_predicted_vs_measured). Conservative on purpose: an
# estimate too high costs schedule="auto" a little bubble (it keeps fewer, larger microbatches); one
# too low (zero, every action free) made 48 microbatches of one sample look fastest for the
# time-to-accuracy CNN, several times slower per step than the calibrated choice (RESULTS.md).
BUILTIN_ACTION_S = 3e-4
ACTION_KINDS = ("F", "B", "W", "SF", "SB", "RF", "RB", "ST", "WV")  # those pdcompile.calibrate measures
CALIBRATE_COMMAND = "python -m pdcompile.calibrate"
_KEY_PARTS = ("host", "core count", "Python", "torch", "runtime")
# The per-tensor costs ride with the per-action ones (``ActionCost.seconds``, ``simulate_plan``'s ``overhead_s``,
# ``PlanOptions.action_overhead_s``: one channel to the step search, simulate() and auto alike) under these two
# keys, which are no action kinds: the optimizer step's seconds per parameter tensor of its stage, and the
# data-parallel all-reduce's (its flatten and copy back); ``simulate.tensor_costs`` takes them out
STEP_TENSOR_KEY = "ST/tensor"
FLATTEN_TENSOR_KEY = "AR/tensor"
#: gradients per all-reduce in the collective probe (``calibrate_link``): its fit's fixed part holds their
#: flatten and copy back, which :func:`action_cost` takes out where it charges them per tensor
COLLECTIVE_PROBE_TENSORS = 8


@dataclass(frozen=True)
class ActionCost:
    """The runtime's fixed seconds per action kind that ``schedule="auto"`` charges, and whence:
    measured for this very runtime (``calibrated``), else the built-in estimate and why."""

    seconds: dict[str, float]
    calibrated: bool
    problem: str = ""  # when not calibrated: what the cache lacks, in a few words
    # the runtime's data-parallel all-reduce on this host between 2 processes, (fixed s, bytes/s), where
    # calibrated (simulate_plan's ``collective``; charged on a local cluster only: pdcompile.api.step_costs)
    collective: tuple[float, float] | None = None
    # the same all-reduce measured with more processes than cores (cores + 1 on a host of few cores: the ring's
    # turns wait for a core), (fixed s, bytes/s of a ring's bytes); charged instead of ``collective`` on a local
    # cluster of more workers than cores (pdcompile.api.step_costs)
    crowded: tuple[float, float] | None = None
    # the wait of a process woken (a blocking receive) while the other processes hold every core, s, where
    # calibrated (calibrate_link.measure_wake); charged on a local cluster of more workers than cores
    # (simulate.shared_cores; pdcompile.api.step_costs), 0 not measured
    wake: float = 0.0

    def warning(self, chose_count: bool = True) -> str:
        """One line: not calibrated, what that does to the microbatch choice (``chose_count`` False: the
        count was given, only the schedule chosen), and the fix ("" when calibrated)."""
        if self.calibrated:
            return ""
        chose = "the microbatch count" if chose_count else "the schedule at the given microbatch count"
        return (f"the runtime's per-action cost is not calibrated for this runtime ({self.problem}): "
                f"schedule='auto' chose {chose} with a built-in {BUILTIN_ACTION_S * 1e3:g} ms per "
                f"action, which errs toward fewer microbatches than a calibrated choice; fix: {CALIBRATE_COMMAND}")


def action_cost() -> ActionCost:
    """The cached per-action cost if it holds for this machine and runtime (:func:`machine_key`), else
    :data:`BUILTIN_ACTION_S` for every kind, saying what was wrong with the cache."""
    path = cache_path()
    try:
        d = json.loads(path.read_text())
    except FileNotFoundError:
        return _builtin(f"no calibration at {path}")
    except (OSError, ValueError):
        return _builtin(f"{path} is unreadable")
    key = machine_key()
    have = d.get("key") if isinstance(d, dict) else None
    if have != key:
        theirs = str(have).split("|")
        diff = [name for name, a, b in zip(_KEY_PARTS, theirs, key.split("|")) if a != b] \
            if len(theirs) == len(_KEY_PARTS) else ["layout"]
        return _builtin(f"{path} was measured for another {', '.join(diff)}")
    try:
        seconds = {str(k): float(v) for k, v in dict(d["overhead_s"]).items()}
    except (KeyError, TypeError, ValueError):
        return _builtin(f"{path} holds no per-action cost")
    step_t, flat_t = _tensor_costs(d)
    seconds.update({STEP_TENSOR_KEY: step_t, FLATTEN_TENSOR_KEY: flat_t})
    try:
        wake = max(0.0, float(d.get("wake_crowded_s", 0.0)))
    except (TypeError, ValueError):
        wake = 0.0
    return ActionCost(seconds, True, collective=_collective(d, flat_t=flat_t),
                      crowded=_collective(d, "collective_crowded", flat_t), wake=wake)


def _tensor_costs(d: dict[str, Any]) -> tuple[float, float]:
    """The cache's seconds per parameter tensor of the optimizer step (``step_tensor_s``) and of the
    all-reduce's flatten and copy back (``collective_tensor_s``), each where the cache lacks it (one calibrated
    before session 22; ``python -m pdcompile.calibrate --step`` adds them) CPU's documented default
    (``roofline.TENSOR_STEP_S``, ``TENSOR_FLATTEN_S``): the cache is a CPU host's."""
    from pdcompile.passes.costs.roofline import TENSOR_FLATTEN_S, TENSOR_STEP_S

    def read(name: str, default: float) -> float:
        try:
            v = float(d.get(name, 0.0))
        except (TypeError, ValueError):
            return default
        return v if v > 0 and v != float("inf") else default

    return read("step_tensor_s", TENSOR_STEP_S["cpu"]), read("collective_tensor_s", TENSOR_FLATTEN_S["cpu"])


def _collective(d: dict[str, Any], name: str = "collective", flat_t: float = 0.0) -> tuple[float, float] | None:
    """The cache's fit of the runtime's all-reduce (``collective_fixed_s``, ``collective_rate``; ``name``
    ``"collective_crowded"``: on more processes than cores), or None where it has none (an older cache:
    ``python -m pdcompile.calibrate --refresh`` measures it). Its fixed part less the probe's
    :data:`COLLECTIVE_PROBE_TENSORS` gradients at ``flat_t`` each (charged per tensor instead, at least 0)."""
    try:
        fixed, rate = float(d.get(f"{name}_fixed_s", 0.0)), float(d.get(f"{name}_rate", 0.0))
    except (TypeError, ValueError):
        return None
    return (max(0.0, fixed - COLLECTIVE_PROBE_TENSORS * flat_t), rate) if rate > 0 and fixed >= 0 else None


def _builtin(problem: str) -> ActionCost:
    return ActionCost(dict.fromkeys(ACTION_KINDS, BUILTIN_ACTION_S), False, problem)


def _machine_entry() -> tuple[dict[str, Any] | None, str]:
    """The cache's calibration where it was measured on this host, core count, Python and torch (the
    runtime's code aside: what torch computes does not depend on it), else None and what is wrong."""
    path = cache_path()
    try:
        d = json.loads(path.read_text())
    except FileNotFoundError:
        return None, f"no calibration at {path}"
    except (OSError, ValueError):
        return None, f"{path} is unreadable"
    have = str(d.get("key") if isinstance(d, dict) else "").split("|")
    key = machine_key().split("|")
    if len(have) != len(_KEY_PARTS) or have[:-1] != key[:-1]:
        diff = [name for name, a, b in zip(_KEY_PARTS[:-1], have, key) if a != b] \
            if len(have) == len(_KEY_PARTS) else ["layout"]
        return None, f"{path} was measured for another {', '.join(diff)}"
    return d, ""


def op_costs() -> tuple[OpCostTable | None, str]:
    """This machine's fitted cost per op class (``python -m pdcompile.calibrate``), or None and what the
    cache lacks. They hold for the host, core count, Python and torch of :func:`machine_key`, whatever
    the runtime's code (the ops are torch's, not the runtime's)."""
    from pdcompile.passes.costs.opclass import OpCostTable

    d, problem = _machine_entry()
    if d is None:
        return None, problem
    path = cache_path()
    try:
        table = OpCostTable.from_dict(d["op_costs"])
    except (KeyError, TypeError, ValueError):
        return None, f"{path} holds no cost per op class (calibrated by an older pdcompile)"
    return table, ""


def update_bandwidth() -> tuple[float | None, str]:
    """Bytes/s this machine's optimizer step streams, from the calibration's ``step_rate`` (parameter
    bytes/s of SGD with momentum, which streams 5 bytes per weight byte: ``roofline.optimizer_step_bytes``),
    or None and what the cache lacks. It holds for the host, core count, Python and torch of
    :func:`machine_key`, as :func:`op_costs` does (the step is torch's, not the runtime's)."""
    from pdcompile.passes.costs.roofline import optimizer_step_bytes

    d, problem = _machine_entry()
    if d is None:
        return None, problem
    path = cache_path()
    try:
        rate = float(d["step_rate"])
    except (KeyError, TypeError, ValueError):
        return None, f"{path} holds no optimizer step rate"
    if not rate > 0 or rate == float("inf"):
        return None, f"{path} holds an optimizer step rate of {rate}"
    return rate * optimizer_step_bytes(1.0, 1.0), ""


COST_MODES = ("auto", "measured", "calibrated", "analytic")


@dataclass(frozen=True)
class CostSource:
    """Which cost mode a compilation used and from what: ``mode`` is what annotate-costs runs
    (``measured`` or ``analytic``), ``table`` this machine's fitted cost per op class (``calibrated``),
    ``line`` what ``explain()`` prints."""

    asked: str
    mode: str
    table: OpCostTable | None
    line: str

    def explain(self, cluster: ClusterSpec, precision: str = "fp32") -> list[str]:
        """``explain()``'s lines: the cost mode and calibration used, the time per op, core contention."""
        from pdcompile.passes.costs.roofline import THREADS_PER_PROCESS, contention, device_spec_for

        lines = [f"costs: cost_mode={self.asked} -> {self.line}"]
        if self.mode == "analytic":
            lines.append(f"  time per op: {device_spec_for(cluster, precision).calibrated(self.table).describe()}")
        if (c := contention(cluster)) > 1.0:
            lines.append(f"  cores: {cluster.num_workers} processes x {THREADS_PER_PROCESS} thread on "
                         f"{cluster.device.cores} cores: every compute time charged x{c:.2f} (roofline.contention) "
                         f"in the planner's search; simulate() and the step search charge each stage as its ranks "
                         f"share the cores instead (simulate.shared_cores: x1 alone, x{c:.2f} all busy)")
        cores = cluster.device.cores
        if self.table is not None and cores and (k := self.table.corun_factor(min(cluster.num_workers, cores))) > 1.0:
            lines.append(f"  side by side: {min(cluster.num_workers, cores)} processes computing at once each run "
                         f"x{k:.2f} slower than one alone (calibrated; OpCostTable.corun): charged by simulate() "
                         f"and the step search only while ranks compute at once (simulate.shared_cores: a rank "
                         f"alone x1, every rank always busy x{k * max(1.0, contention(cluster)):.2f} in all), "
                         f"not in the chain's costs nor the planner's search")
        return lines


def is_local(cluster: ClusterSpec | None) -> bool:
    """Whether the compiling host is the target: no cluster given (a local one), or a local CPU cluster
    (``local_cpu_cluster``: a ``cpu`` device that names this host's cores)."""
    return cluster is None or (cluster.device.name == "cpu" and cluster.device.cores is not None)


def cost_source(asked: str, local: bool) -> CostSource:
    """Resolve ``cost_mode``: ``auto`` (the default) is ``calibrated`` where the compiling host is the
    target (``local``: a local CPU cluster, or none given) and a calibration for this machine is cached,
    else ``analytic``, the roofline with a documented default fixed cost per op class (said so, with the
    fix); ``calibrated`` without a calibration is a UsageError naming the command. ``measured`` times
    every node here (a model on meta is refused by the API)."""
    from pdcompile.errors import UsageError

    if asked not in COST_MODES:
        raise UsageError(f"pdcompile: cost_mode must be one of {COST_MODES}, got {asked!r}")
    if asked == "measured":
        return CostSource(asked, "measured", None, "measured: every node timed on this host, one thread")
    table, problem = op_costs() if asked == "calibrated" or (asked == "auto" and local) else (None, "")
    if asked == "calibrated" and table is None:
        raise UsageError(f"pdcompile: cost_mode='calibrated' needs this machine's cost per op class: {problem}. "
                         f"Fix: {CALIBRATE_COMMAND}, or cost_mode='analytic'")
    if table is not None:
        return CostSource(asked, "analytic", table, f"calibrated: {table.source}")
    why = (f"no fitted cost per op class for this machine ({problem}; fix: {CALIBRATE_COMMAND})" if problem
           else "the target is not this host")
    return CostSource(asked, "analytic", None, f"analytic: {why}")
