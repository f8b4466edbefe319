"""A stage's own memory accounting during a run: the quantities the planner's memory model predicts.

:class:`MemoryMeter` counts, at the executor's measuring points (after every forward, before every
optimizer step), the bytes of live storages: weights x live versions, gradients, optimizer state,
and per microbatch in flight what autograd saved for it (saved-tensor hooks around its forward and
loss), its inputs (receive buffers) and outputs, each storage once; plus posted receive buffers.
With recomputation, a backward's rebuild is a measuring point too, where one microbatch's saved
tensors (measured once by a probe forward) come on top. The peak and its parts go to the metrics JSON.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch


def storages(tensors: Iterable[Any]) -> dict[int, int]:
    """``{storage pointer: bytes}`` of the tensors among ``tensors`` (each storage once)."""
    out: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            st = t.untyped_storage()
            out[st.data_ptr()] = st.nbytes()
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
        self.activations: dict[int, dict[int, int]] = {}  # microbatch -> its storages
        self.recompute_bytes = 0  # one microbatch's saved tensors, rebuilt at its backward (recompute)
        self.peak: dict[str, int] = {"total": 0}

    @contextmanager
    def saving(self, microbatch: int, weights: Iterable[torch.Tensor] = ()) -> Iterator[dict[int, int]]:
        """Record the storages autograd saves inside the block as ``microbatch``'s (not parameters
        nor ``weights``, the version the forward uses)."""
        if not self.enabled:
            yield {}
            return
        skip = self.static | set(storages(weights))
        mine = self.activations.setdefault(microbatch, {})

        def pack(t: torch.Tensor) -> torch.Tensor:
            st = t.untyped_storage()
            if st.data_ptr() not in skip:
                mine[st.data_ptr()] = st.nbytes()
            return t.detach()  # a detached alias: no cycle through an output's own grad_fn

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield mine

    def add(self, microbatch: int, tensors: Iterable[Any]) -> None:
        """Count ``tensors`` (a microbatch's inputs, outputs) with ``microbatch``'s storages."""
        if not self.enabled:
            return
        self.activations.setdefault(microbatch, {}).update(
            {p: n for p, n in storages(tensors).items() if p not in self.static})

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
        acts: dict[int, int] = {}
        for k in keep:
            acts.update(self.activations.get(k, {}))
        recv = {p: n for p, n in storages(posted).items() if p not in acts}
        grads = storages(p.grad for p in self.module.parameters() if p.grad is not None)
        state = storages(v for s in self.optimizer.state.values() for v in s.values())
        parts = {
            "weights": self.param_bytes * live_versions, "gradients": sum(grads.values()),
            "optimizer_state": sum(state.values()), "activations": sum(acts.values()),
            "receive_buffers": sum(recv.values()), "recompute": self.recompute_bytes if rebuilding else 0,
            "in_flight": len(keep),
        }
        total = sum(v for k, v in parts.items() if k != "in_flight")
        if total > self.peak["total"]:
            self.peak = {"total": total, **parts}

    def report(self) -> dict[str, int]:
        return dict(self.peak)
