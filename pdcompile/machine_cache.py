"""Where this machine's measured constants are cached and whom they hold for: the piece that
:mod:`pdcompile.calibrate` (which measures and writes them) and :mod:`pdcompile.api` (which reads
the runtime's per-action cost for ``schedule="auto"``, never measuring) share, below both. Without a
calibration for this runtime, :func:`action_cost` gives a conservative built-in estimate and the
line that says so."""

from __future__ import annotations

import json
import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any


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


@dataclass(frozen=True)
class ActionCost:
    """The runtime's fixed seconds per action kind that ``schedule="auto"`` charges, and whence:
    measured for this very runtime (``calibrated``), else the built-in estimate and why."""

    seconds: dict[str, float]
    calibrated: bool
    problem: str = ""  # when not calibrated: what the cache lacks, in a few words

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
    return ActionCost(seconds, True)


def _builtin(problem: str) -> ActionCost:
    return ActionCost(dict.fromkeys(ACTION_KINDS, BUILTIN_ACTION_S), False, problem)
