"""glibc malloc settings for training on CPU (``train.py --malloc``): keep freed memory, or hand it back at once.

A training step frees almost everything it allocated and allocates the same sizes again in the
next. glibc's defaults unmap blocks of 128 KiB and up on free and trim the heap's top, so every step
faults fresh zero-filled pages in (benchmarks/RESULTS.md "Allocator"), until glibc has raised its
threshold to the blocks it unmapped. ``keep`` reuses freed memory without faults but keeps every hole
in the heap resident; ``release`` unmaps every large block when freed, so the RSS follows the live
tensors at the price of those faults (:func:`set_mode`; RESULTS.md "malloc's held memory"). Not glibc
(macOS, musl): nothing is changed, whatever the mode.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

log = logging.getLogger("pdcompile.runtime")

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
KEEP_MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's upper limit for it on 64-bit: larger blocks stay mmap-ed
KEEP_TRIM_THRESHOLD = 2**31 - 1  # (an int) never trim the heap's top
GLIBC_MMAP_THRESHOLD = GLIBC_TRIM_THRESHOLD = 128 * 1024  # glibc's defaults
RELEASE_MMAP_THRESHOLD = 128 * 1024  # "release": blocks of this size and up are mapped and unmapped one by one
MODES = ("keep", "release", "glibc")


@functools.cache
def _mallopt() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]  # ctypes has no public name for it
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version  # noqa: B018 - glibc only (musl/macOS have other mallocs)
        fn = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def _set(mmap_t: int, trim_t: int) -> bool:
    fn = _mallopt()
    if fn is None:
        return False
    ok = bool(fn(M_MMAP_THRESHOLD, mmap_t)) and bool(fn(M_TRIM_THRESHOLD, trim_t))
    if not ok:
        log.warning("mallopt refused the thresholds %d/%d: malloc keeps its own", mmap_t, trim_t)
    return ok


def keep_freed_memory(on: bool = True) -> bool:
    """Keep (``on``) or return (glibc's default thresholds) freed memory; whether glibc took it."""
    return _set(*((KEEP_MMAP_THRESHOLD, KEEP_TRIM_THRESHOLD) if on else (GLIBC_MMAP_THRESHOLD, GLIBC_TRIM_THRESHOLD)))


def release_freed_memory() -> bool:
    """Hand blocks of 128 KiB and up back to the system as soon as they are freed (the small ones'
    heap is kept, never trimmed); whether glibc took it."""
    return _set(RELEASE_MMAP_THRESHOLD, KEEP_TRIM_THRESHOLD)


def set_mode(mode: str) -> bool:
    """``train.py --malloc``: one of :data:`MODES`; whether glibc took a setting (``glibc``: none made).

    - ``keep`` (CPU's default, :func:`keep_freed_memory`): both thresholds raised, as PyTorch's CUDA
      caching allocator keeps GPU memory: what a step frees is reused by the next without faults. A
      block freed below live ones stays resident, so the peak RSS can exceed the live tensors' peak
      (a flush's first backward frees a microbatch's activations while it makes the gradients,
      which do not fit those holes and go above them).
    - ``release`` (:func:`release_freed_memory`): the mmap threshold fixed at 128 KiB, glibc's own
      starting value, which it then never raises: every block of 128 KiB and up is its own mapping,
      unmapped when freed; each step faults its large buffers in afresh.
    - ``glibc``: its adaptive defaults, untouched.
    """
    if mode not in MODES:
        raise ValueError(f"malloc mode must be one of {MODES}, got {mode!r}")
    if mode == "keep":
        return keep_freed_memory(True)
    if mode == "release":
        return release_freed_memory()
    return False
