"""glibc malloc settings for training on CPU: keep freed memory instead of handing it back.

A training step frees almost everything it allocated and allocates the same sizes again in the
next. With glibc's defaults, blocks of 128 KiB and up are ``mmap``-ed one by one and unmapped on
free, and the heap's top is trimmed once 128 KiB are free there, so every step page-faults in fresh
zero-filled pages again (benchmarks/RESULTS.md "Allocator"). :func:`keep_freed_memory` raises both
thresholds (``mallopt``), as PyTorch's CUDA caching allocator keeps GPU memory: the process keeps
its peak footprint (the peak itself is unchanged). ``train.py --no-keep-freed-memory`` keeps glibc's
defaults. Not glibc (macOS, musl): nothing is changed.
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


def keep_freed_memory(on: bool = True) -> bool:
    """Keep (``on``) or return (glibc's default thresholds) freed memory; whether glibc took it."""
    fn = _mallopt()
    if fn is None:
        return False
    mmap_t, trim_t = (KEEP_MMAP_THRESHOLD, KEEP_TRIM_THRESHOLD) if on else (GLIBC_MMAP_THRESHOLD, GLIBC_TRIM_THRESHOLD)
    ok = bool(fn(M_MMAP_THRESHOLD, mmap_t)) and bool(fn(M_TRIM_THRESHOLD, trim_t))
    if not ok:
        log.warning("mallopt refused the thresholds %d/%d: freed memory goes back to the system", mmap_t, trim_t)
    return ok
