"""Shared test helpers: build, emit and launch small pipelines."""

from __future__ import annotations

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
