"""runtime/allocator.py: keeping freed memory stops a step-like allocation pattern from faulting
its pages in afresh every time (what made CPU backwards 20-30% slower in runtime traces)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from pdcompile.runtime import allocator
from pdcompile.runtime import devices as launch

pytestmark = pytest.mark.timeout(120)

# A training step in miniature: tensors of mixed sizes (128 KiB - 4 MiB) allocated, written, and all
# freed in another order; ten such steps after a first one, counting the page faults they take.
PATTERN = textwrap.dedent("""
    import random, resource, sys, torch
    from pdcompile.runtime import allocator
    def steps():
        rng = random.Random(0)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(10):
            ts = [torch.ones(rng.randrange(1 << 15, 1 << 20)) for _ in range(30)]
            rng.shuffle(ts)
            while ts:
                ts.pop()
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    if sys.argv[1] == "keep":
        assert allocator.keep_freed_memory(True)
    steps()
    print(steps())
""")


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PATTERN, mode], capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.split()[-1])


def test_kept_memory_is_not_faulted_in_again() -> None:
    if allocator._mallopt() is None:
        pytest.skip("not glibc: the allocator is left as it is")  # CI and the emitted programs' Linux hosts are glibc
    default, kept = _faults("default"), _faults("keep")
    # measured on this machine (5 runs): 24000-46000 faults with glibc's defaults, 0-1100 kept
    assert default > 10000, f"the pattern no longer exercises glibc's trimming ({default} faults)"
    assert kept * 5 < default, (kept, default)


def test_default_is_on_for_cpu_only() -> None:
    assert launch.keep_freed_memory(None, torch.device("cpu")) is True
    assert launch.keep_freed_memory(None, torch.device("cuda", 0)) is False
    assert launch.keep_freed_memory(False, torch.device("cpu")) is False
    assert launch.keep_freed_memory(True, torch.device("cuda", 0)) is True
