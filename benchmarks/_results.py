"""Write one benchmark's table into benchmarks/RESULTS.md, replacing its previous section.

Every section records the command that produced it, the date and the machine, so figures are
never separated from how they were measured.
"""

from __future__ import annotations

import datetime
import os
import platform
import re
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def machine() -> str:
    """A one-line description of this machine (cores, memory, CPU, Python, torch)."""
    try:
        import torch

        tv: str = str(torch.__version__)
    except ImportError:  # pragma: no cover
        tv = "n/a"
    mem = ""
    try:
        with open("/proc/meminfo") as f:
            kb = int(f.readline().split()[1])
        mem = f", {kb / 2**20:.0f} GiB"
    except OSError:  # pragma: no cover
        pass
    cpu = platform.processor() or platform.machine()
    return f"{os.cpu_count()} cores{mem}, {cpu}, Python {platform.python_version()}, torch {tv}"


def write_section(name: str, body: str, command: str | None = None) -> None:
    """Replace (or append) the section ``## name`` of RESULTS.md with ``body``."""
    command = command or "python " + " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:])
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    section = (
        f"## {name}\n\n"
        f"Command: `{command}`  \nDate: {stamp}  \nMachine: {machine()}\n\n"
        f"{body.rstrip()}\n"
    )
    text = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n\nEach section is written by the command it names.\n"
    pattern = re.compile(rf"^## {re.escape(name)}\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _m: section + "\n", text)
    else:
        text = text.rstrip() + "\n\n" + section
    RESULTS.write_text(text.rstrip() + "\n")


def publish(name: str, body: str, command: str, *, write: bool = True) -> None:
    """Print a benchmark's ``body`` and (``write``; not for ``--quick`` runs) put it in RESULTS.md."""
    if write:
        write_section(name, body, command=command)
    print(body)
