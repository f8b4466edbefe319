"""A stage's own memory accounting during a run: the quantities the planner's memory model predicts.

:class:`MemoryMeter` counts, at the executor's measuring points (after every forward, before every
optimizer step), the bytes of live storages: weights x live versions, gradients, optimizer state,
and per microbatch in flight what autograd saved for it (saved-tensor hooks around its forward and
loss), its inputs (receive buffers) and outputs, each storage once; plus posted receive buffers.
A microbatch's views of the minibatch it was cut from (the first stage's data, registered with
:meth:`MemoryMeter.data`) count the bytes they span, not the minibatch's storage.
With recomputation (runtime/recompute.py), a backward's rebuild is a measuring point too, where what
one rebuild makes comes on top, measured once by a probe forward. What each mode counts:

* per microbatch in flight, always its inputs, its outputs and what autograd saved outside a
  checkpoint (the hooks of :meth:`MemoryMeter.saving` do not see inside one: checkpoint's own hooks
  take those tensors, and drop them). ``none``: every saved tensor. ``full``: nothing more.
  ``selective``: the checkpoint's cache, the outputs of the FLOP-counted ops (the executor adds them).
  ``partial``: the tail's saved tensors (the head's outputs among them, where the tail saves them).
* at a rebuild (``recompute``): ``full``, what autograd saves in one forward of the stage;
  ``selective``, that less the cached outputs' storages (not rebuilt); ``partial``, what the head saves.

The peak and its parts go to the metrics JSON, with the largest single microbatch (``microbatch``)
and one rebuild's bytes (``rebuilt``) beside them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from pdcompile.runtime.shard import local


def storages(tensors: Iterable[Any]) -> dict[int, int]:
    """``{storage pointer: bytes}`` of the tensors among ``tensors`` (each storage once)."""
    out: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            st = local(t).untyped_storage()  # a sharded stage's DTensor: this replica's shard
            out[st.data_ptr()] = st.nbytes()
    return out


def plain_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor, without autograd (inside a saved-tensor hook), as of any wrapper subclass
    (a functional collective's pending result, which a split embedding's sum saves); a plain tensor itself."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    while is_traceable_wrapper_subclass(t):
        inner = getattr(t, t.__tensor_flatten__()[0][0], None)
        if not isinstance(inner, torch.Tensor):
            break
        t = inner
    return t


def span(t: torch.Tensor) -> tuple[int, int, int]:
    """``(storage pointer, first byte, end byte)`` of the part of its storage ``t`` views."""
    st = t.untyped_storage()
    if t.numel() == 0:
        return st.data_ptr(), 0, 0
    es = t.element_size()
    lo = int(t.storage_offset()) * es
    hi = lo + (1 + sum((int(n) - 1) * abs(int(d)) for n, d in zip(t.shape, t.stride()))) * es
    return st.data_ptr(), lo, min(hi, st.nbytes())


Spans = dict[int, tuple[int, int]]  # storage pointer -> (first byte, end byte) of what is counted


def _note(spans: Spans, t: torch.Tensor, data: set[int]) -> None:
    """Add ``t`` to ``spans``: the bytes it views of the minibatch's storage (``data``), else its whole
    storage (a view it keeps holds all of it)."""
    ptr, lo, hi = span(t)
    if ptr not in data:
        lo, hi = 0, t.untyped_storage().nbytes()
    if ptr in spans:  # two views of one storage in one microbatch: the bytes from the first to the last
        a, b = spans[ptr]
        lo, hi = min(a, lo), max(b, hi)
    spans[ptr] = (lo, hi)


def span_bytes(groups: Iterable[Spans]) -> dict[int, int]:
    """``{storage pointer: bytes}`` covered by the spans of ``groups`` together (overlaps once)."""
    by_ptr: dict[int, list[tuple[int, int]]] = {}
    for g in groups:
        for p, iv in g.items():
            by_ptr.setdefault(p, []).append(iv)
    out: dict[int, int] = {}
    for p, ivs in by_ptr.items():
        total, end = 0, -1
        for lo, hi in sorted(ivs):
            if hi > end:
                total += hi - max(lo, end)
                end = hi
        out[p] = total
    return out


class MemoryMeter:
    """Live bytes of one stage, by category, and their peak over the run. ``enabled=False``: every
    method is a no-op (a hook per saved tensor costs time, so only runs that report it measure)."""

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, enabled: bool = True) -> None:
        self.enabled = enabled
        self.module = module
        self.optimizer = optimizer
        self.param_bytes = sum(storages(module.parameters()).values())
        self.static = set(storages([*module.parameters(), *module.buffers()]))
        self.activations: dict[int, Spans] = {}  # microbatch -> the parts of storages it holds
        self.data_storages: set[int] = set()  # storages of the minibatches read (views count their span)
        self.recompute_bytes = 0  # one microbatch's saved tensors, rebuilt at its backward (recompute)
        self.peak: dict[str, int] = {"total": 0}
        self.microbatch_peak = 0  # the most bytes one microbatch in flight held at a measuring point
        self.sharded = False  # shard "full" (runtime/shard.py): weights are this replica's shard, plus "gathered"

    @contextmanager
    def saving(self, microbatch: int, weights: Iterable[torch.Tensor] = ()) -> Iterator[Spans]:
        """Record the storages autograd saves inside the block as ``microbatch``'s (not parameters
        nor ``weights``, the version the forward uses)."""
        if not self.enabled:
            yield {}
            return
        skip = self.static | set(storages(weights))
        mine = self.activations.setdefault(microbatch, {})
        gathered = not self.sharded  # shard "full": FSDP2 gathers the parameters inside the forward, not before

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal gathered
            if not gathered:  # the first saved tensor: the gathered working copy is held now (not an activation)
                skip.update(storages(p for p in self.module.parameters() if p is local(p)))
                gathered = True
            held = plain_tensor(t)  # a DTensor autograd saves (tensor parallelism): its local tensor's storage
            if held.untyped_storage().data_ptr() not in skip:
                _note(mine, held, self.data_storages)
            return t.detach()  # a detached alias: no cycle through an output's own grad_fn

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield mine

    def data(self, tensors: Iterable[Any]) -> None:
        """Register ``tensors`` as a microbatch's data: views of the minibatch, which the data path
        holds for its step whatever is in flight; a microbatch is charged the bytes it spans."""
        if self.enabled:
            self.data_storages.update(storages(tensors))

    def add(self, microbatch: int, tensors: Iterable[Any]) -> None:
        """Count ``tensors`` (a microbatch's inputs, outputs) with ``microbatch``'s storages."""
        if not self.enabled:
            return
        mine = self.activations.setdefault(microbatch, {})
        for t in tensors:
            held = plain_tensor(t) if isinstance(t, torch.Tensor) else None  # a DTensor: its local tensor
            if held is not None and held.untyped_storage().data_ptr() not in self.static:
                _note(mine, held, self.data_storages)

    def measure(self, in_flight: Iterable[int], posted: Iterable[torch.Tensor], live_versions: int,
                rebuilding: bool = False) -> None:
        """One measuring point: ``in_flight`` microbatches (forward done, backward not), ``posted``
        receive buffers not yet consumed, ``live_versions`` weight versions alive; ``rebuilding``: a
        backward is recomputing a forward (its saved tensors come on top)."""
        if not self.enabled:
            return
        keep = set(in_flight)
        for k in [k for k in self.activations if k not in keep]:
            del self.activations[k]
        acts = span_bytes(self.activations.get(k, {}) for k in keep)
        for k in keep:
            self.microbatch_peak = max(self.microbatch_peak, sum(span_bytes([self.activations.get(k, {})]).values()))
        self.data_storages &= set(acts)  # minibatches no microbatch in flight views any more are gone
        recv = {p: n for p, n in storages(posted).items() if p not in acts}
        grads = storages(p.grad for p in self.module.parameters() if p.grad is not None)
        state = storages(v for s in self.optimizer.state.values() for v in s.values())
        parts = {
            "weights": self.param_bytes * live_versions, "gradients": sum(grads.values()),
            "optimizer_state": sum(state.values()), "activations": sum(acts.values()),
            "receive_buffers": sum(recv.values()), "recompute": self.recompute_bytes if rebuilding else 0,
            # FSDP2's gathered working copy, while the module holds it (its parameters are plain tensors then)
            "gathered": sum(p.numel() * p.element_size() for p in self.module.parameters() if p is local(p))
            if self.sharded else 0,
            "in_flight": len(keep),
        }
        total = sum(v for k, v in parts.items() if k != "in_flight")
        if total > self.peak["total"]:
            self.peak = {"total": total, **parts}

    def report(self) -> dict[str, int]:
        """The peak and its parts; beside them (not parts of it) ``microbatch``, the most one microbatch
        in flight held, and ``rebuilt``, what one backward's rebuild brings (0 without recomputation)."""
        return {**self.peak, "microbatch": self.microbatch_peak, "rebuilt": self.recompute_bytes}
