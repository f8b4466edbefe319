"""Shared test helpers: build, emit and launch small pipelines."""

from __future__ import annotations

import itertools
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

os.environ.setdefault("OMP_NUM_THREADS", "1")
# Every launched program runs its point-to-point transfers under NCCL's rules (runtime/comm.py): an
# order that would hang on GPUs fails here; tests/test_nccl_rules.py compares with plain gloo.
os.environ.setdefault("PDCOMPILE_NCCL_RULES", "1")

# Property tests draw the same examples on every run (CI must not fail on an example no earlier run
# saw); PDC_HYPOTHESIS_EXPLORE=1 draws fresh ones, to hunt for new counterexamples (a new find goes
# into the test as an @example, as in test_partition_ilp.py).
from hypothesis import settings as _hypothesis_settings  # noqa: E402

_hypothesis_settings.register_profile("pdcompile", derandomize=not os.environ.get("PDC_HYPOTHESIS_EXPLORE"))
_hypothesis_settings.load_profile("pdcompile")

_caches = itertools.count()


# The suite runs on two pytest-xdist workers (pyproject: ``-n 2 --dist loadgroup``), each test dispatched to
# whichever worker is free, ``multiproc`` tests (several processes, gloo on 127.0.0.1, a timeout on every
# collective) beside each other and beside single-process tests: the two cores stay busy. (Until
# 2026-12-06 a hook here marked every multiproc test ``xdist_group("multiproc")`` to run them one at a time on
# one worker; it ran after xdist had read the groups, so it never took effect, and every CI time recorded
# since 4819f98 is of this arrangement. Taking effect, it would leave one worker most of the suite.)
# Their ranks are forked from a process that has already imported torch (tests/_fork_ranks.py).


@pytest.fixture(autouse=True)
def pdcompile_cache(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every test reads and writes pdcompile's machine cache (``python -m pdcompile.calibrate``'s constants,
    whose per-action cost ``schedule="auto"`` charges) in a folder of its own, empty until written, never
    ``~/.cache/pdcompile``: no result depends on whether, or for which runtime, this machine was calibrated.
    Launched processes inherit it. A test that needs a calibration writes one here (or sets its own)."""
    folder = tmp_path_factory.getbasetemp() / "pdcompile-cache" / str(next(_caches))
    monkeypatch.setenv("PDCOMPILE_CACHE", str(folder))
    return folder
