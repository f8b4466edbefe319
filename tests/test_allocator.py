"""runtime/allocator.py: keeping freed memory stops a step-like allocation pattern from faulting
its pages in afresh every time (what made CPU backwards 20-30% slower in runtime traces)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from pdcompile.errors import UsageError
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


# Memory freed below a live block: 16 MiB of 256 KiB tensors (a microbatch's activations) under a
# tensor made after them (the gradients), then freed; VmRSS (MiB) before and after the free.
HOLE = textwrap.dedent("""
    import sys, torch
    from pdcompile.runtime import allocator
    def rss():
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) for l in f if l.startswith("VmRSS:")) / 1024
    assert allocator.set_mode(sys.argv[1])
    acts = [torch.ones(1 << 16) for _ in range(64)]
    above = torch.ones(1 << 16)
    before = rss()
    del acts
    print(before - rss(), float(above.sum()))
""")


def _dropped(mode: str) -> float:
    out = subprocess.run([sys.executable, "-c", HOLE, mode], capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr
    return float(out.stdout.split()[0])


def test_release_hands_freed_blocks_back_at_once() -> None:
    if allocator._mallopt() is None:
        pytest.skip("not glibc: the allocator is left as it is")
    kept, released = _dropped("keep"), _dropped("release")
    assert released >= 12, f"release: freeing 16 MiB below a live tensor dropped the RSS by {released:.1f} MiB"
    assert kept <= 4, f"keep: the freed 16 MiB should stay resident, the RSS dropped by {kept:.1f} MiB"


def test_malloc_mode_of_the_flags() -> None:
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert launch.malloc_mode(None, None, cpu) == "keep"
    assert launch.malloc_mode(None, None, gpu) == "glibc"
    assert launch.malloc_mode("release", None, cpu) == "release"
    assert launch.malloc_mode("release", None, gpu) == "release"
    assert launch.malloc_mode(None, False, cpu) == "glibc"  # --no-keep-freed-memory, the older spelling
    assert launch.malloc_mode(None, True, gpu) == "keep"
    assert launch.malloc_mode("keep", True, cpu) == "keep"
    with pytest.raises(UsageError, match="--malloc release and --keep-freed-memory"):
        launch.malloc_mode("release", True, cpu)
    with pytest.raises(UsageError, match="--malloc keep and --no-keep-freed-memory"):
        launch.malloc_mode("keep", False, cpu)
    with pytest.raises(ValueError, match="malloc mode"):
        allocator.set_mode("tight")


def test_pdcompile_run_offers_train_pys_modes() -> None:
    from pdcompile._cli.run import MALLOC_MODES  # the CLI's parser is built without torch: a copy

    assert MALLOC_MODES == allocator.MODES
