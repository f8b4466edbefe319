"""Where this machine's measured constants are cached and whom they hold for: the piece that
:mod:`pdcompile.calibrate` (which measures and writes them) and :mod:`pdcompile.api` (which reads
the runtime's per-action cost for ``schedule="auto"``, never measuring) share, below both."""

from __future__ import annotations

import json
import os
import platform
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
