"""A chain's per-layer costs as checked numpy arrays with their prefix sums: what the cost models,
the memory model and the search read (``P[j + 1] - P[i]`` is the sum over layers ``i..j``)."""

from __future__ import annotations

import numpy as np

from pdcompile.errors import UsageError
from pdcompile.ir import Chain

__all__ = ["ChainArrays", "cumsum0", "rng", "sorted_unique"]


def sorted_unique(a: np.ndarray) -> np.ndarray:
    """``np.unique(a)`` (flattened, sorted, each value once) without ``np.unique``, whose first call
    imports ``numpy.ma`` (~10 ms of a cold ``pdcompile plan``, a tenth of its 0.1 s target)."""
    s = np.sort(a, axis=None)
    return s[np.concatenate(([True], s[1:] != s[:-1]))] if s.size else s


def cumsum0(x: np.ndarray) -> np.ndarray:
    """Prefix sums with a leading 0: ``out[k]`` is the sum of ``x[:k]``."""
    out = np.zeros(len(x) + 1)
    np.cumsum(x, out=out[1:])
    return out


def rng(P: np.ndarray, i: int, j: int) -> float:
    """The sum over positions ``i..j`` of the prefix sums ``P``."""
    return float(P[j + 1] - P[i])


class ChainArrays:
    """Forward ``f``, backward ``bw``, compute ``c = f + bw``, parameter bytes ``w``, output bytes ``o``
    and the bytes across each cut (``cut``, inf: forbidden) of a chain, with prefix sums ``PC``,
    ``PF``, ``PW``, and ``inb[i]``, the bytes a stage starting at ``i`` receives (the monotone
    envelope of ``cut[i-1]``). Bad input (negative or non-finite costs) is a UsageError."""

    def __init__(self, chain: Chain) -> None:
        layers = chain.layers
        if len(layers) == 0:
            raise UsageError("the chain has no layers: nothing to plan")
        self.N = N = len(layers)
        f = np.array([l.forward_s for l in layers], dtype=float)
        bw = np.array([l.backward_s for l in layers], dtype=float)
        w = np.array([l.param_bytes for l in layers], dtype=float)
        o = np.array([l.output_bytes for l in layers], dtype=float)
        for name, arr in (("forward_s", f), ("backward_s", bw), ("param_bytes", w), ("output_bytes", o)):
            bad = np.flatnonzero(~np.isfinite(arr) | (arr < 0))
            if len(bad):
                k = int(bad[0])
                raise UsageError(f"layer {k} ({layers[k].name}): {name} must be finite and >= 0 (got {arr[k]})")
        cut = np.array(chain.cut_bytes, dtype=float)
        if np.any(np.isnan(cut)) or np.any(cut < 0):
            raise UsageError("cut_bytes must be >= 0 (math.inf for a forbidden cut)")
        self.f, self.bw, self.c, self.w, self.o, self.cut = f, bw, f + bw, w, o, cut
        self.PC = cumsum0(self.c)
        self.PF = cumsum0(f)
        self.PW = cumsum0(w)
        inb = np.zeros(N + 1)
        for i in range(1, N):
            inb[i] = min(cut[i - 1], inb[i - 1] + o[i - 1])
        self.inb = inb
