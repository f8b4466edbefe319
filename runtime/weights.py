"""Weight versions: which parameter tensors each microbatch's forward and backward use (weight stashing).

The schedule says everything through its actions (see :mod:`pdcompile.runtime.schedules.versions`):
``WV v`` makes later forwards use version ``v``, ``B k`` uses the version ``F k`` used, ``ST``
updates the newest version. :class:`VersionedStore` implements exactly that for every schedule,
keeping a version other than the live parameters only while a microbatch needs it.
"""

from __future__ import annotations

import weakref
from collections import Counter
from dataclasses import dataclass, field
from collections.abc import Callable, Sequence
from typing import Any

import torch

from pdcompile.runtime import fused_grads, tensor_parallel
from pdcompile.runtime.executor import WeightStore
from pdcompile.runtime.schedules import Action, Kind


@dataclass
class _Reading:
    """Where a read of the schedule in parts stands (see :meth:`VersionedStore.expect`)."""

    version: int = 0  # the weight version forwards use at this point of the actions
    open: set[int] = field(default_factory=set)  # microbatches whose F was read, their B not yet
    crossed: set[int] = field(default_factory=set)  # of those, the ones an ST came after


class VersionedStore(WeightStore):
    """Versioned parameters driven by the schedule's ``WV``/``F``/``B``/``ST`` actions.

    * The module's live parameters always hold the *newest* version; the optimizer updates them in
      place, so its state (momentum, ...) stays where ``torch.optim`` expects it.
    * An older version, or the newest one when an ``ST`` will come while a microbatch that used it
      is still in flight, lives as a *clone*: detached leaf tensors never modified in place. The
      forward runs on them through ``torch.func.functional_call``, so what autograd saves for the
      backward *is* the stashed version (no ``load_state_dict`` on live parameters, which would
      break autograd's version counters). After the backward, the clone's gradients are added into
      the live parameters' ``.grad``, where ``AR``/``TG``/``ST`` find them.
    * A microbatch whose forward uses the newest version and whose backward comes before the next
      ``ST`` runs on the live parameters directly (GPipe and Flush never clone).
    * A clone is dropped as soon as no microbatch in flight and no later forward uses it.
      :meth:`observe` counts versions alive by weak references to the clone tensors (plus the
      newest, held by the live parameters), so the count measures what memory really holds.
    * ``predict`` (staleness="predict", runtime/staleness.py): a version's clone holds the weights
      it predicts, made while the live parameters and the optimizer's state are that version's;
      every forward then runs on its version's clone (never on the live parameters), and its
      backward is taken at those same predicted weights (they are what is stashed)."""

    def __init__(self, module: torch.nn.Module, predict: Callable[[], dict[str, torch.Tensor]] | None = None) -> None:
        super().__init__(module)
        self.predict = predict
        self.params: dict[str, torch.nn.Parameter] = dict(module.named_parameters())
        self.split = {n: p for n, p in self.params.items() if getattr(p, "placements", None) is not None}  # DTensors
        self.newest = 0
        self.forward_version = 0
        self.clones: dict[int, dict[str, torch.Tensor]] = {}
        self.refs: dict[int, weakref.ref[torch.Tensor]] = {}
        self.inflight: dict[int, int] = {}  # microbatch -> version its forward used
        self.cloned: set[int] = set()  # microbatches in flight that run on a clone
        self.future: Counter[int] | None = None  # versions of the forwards still to run (None: unknown)
        self.direct_ok: set[int] = set()  # microbatches with no ST between their F and B
        self.expected: dict[int, int] = {}
        self.horizon: int | None = None  # reading in parts: versions from this one on may still be used
        self._reading: _Reading | None = None  # between the parts of a read
        self.peak = 1

    # the schedule ------------------------------------------------------------------------------
    def expect(self, actions: Sequence[Action], *, more: bool = False) -> None:
        """Read this rank's actions before they run: which versions later forwards need, and which
        microbatches may run on the live parameters (no ``ST`` between their ``F`` and ``B``).

        A long run is read in parts (``more=True`` while more follow), each before its actions run
        and far enough ahead that every forward's backward is read before the forward runs (the
        runtime reads ``RankRun.reach`` actions ahead). Until the last part, a version some unread
        forward may still use (the one the reading has switched forwards to, or newer) is kept."""
        if self._reading is None:  # a fresh read (a new segment)
            self._reading = _Reading()
            self.expected, self.future, self.direct_ok = {}, Counter(), set()
        r = self._reading
        future = self.future if self.future is not None else Counter()
        self.future = future
        opened, crossed = r.open, r.crossed
        for a in actions:
            if a.kind is Kind.WEIGHT_VERSION:
                r.version = a.wv
            elif a.kind is Kind.FORWARD:
                self.expected[a.mb] = r.version
                future[r.version] += 1
                opened.add(a.mb)
            elif a.kind is Kind.STEP:
                crossed |= opened
            elif a.kind is Kind.BACKWARD and a.microbatch in opened:
                opened.discard(a.mb)
                if a.microbatch in crossed:
                    crossed.discard(a.mb)
                else:
                    self.direct_ok.add(a.mb)
        self.horizon = r.version if more else None
        if not more:
            self.direct_ok |= opened - crossed  # a forward without a backward on this rank
            self._reading = None

    def set_forward_version(self, version: int) -> None:
        if not self.forward_version <= version <= self.newest:
            raise RuntimeError(f"WV{version}: forwards use version {self.forward_version} and the newest is "
                               f"{self.newest}; a schedule may only switch forward to an existing, later version")
        self.forward_version = version
        self._release()

    # executor hooks ----------------------------------------------------------------------------
    def params_for_forward(self, microbatch: int) -> dict[str, torch.Tensor] | None:
        v = self.forward_version
        if self.expected and self.expected.pop(microbatch, None) != v:
            raise RuntimeError(f"forward of microbatch {microbatch} would use weight version {v}, the schedule "
                               f"says otherwise (or was not read this far ahead)")
        self.inflight[microbatch] = v
        if self.future is not None:
            self.future[v] -= 1
            if self.future[v] <= 0:
                del self.future[v]
        direct = microbatch in self.direct_ok
        self.direct_ok.discard(microbatch)
        if v == self.newest and direct and self.predict is None:
            return None
        self.cloned.add(microbatch)
        return self._materialize(v)

    def after_backward(self, microbatch: int) -> None:
        v = self.inflight.pop(microbatch)
        if microbatch in self.cloned:
            self.cloned.discard(microbatch)
            with torch.no_grad():
                for name, t in self.clones[v].items():
                    if t.grad is None:
                        continue
                    p = self.params[name]
                    if p.grad is None:
                        p.grad = t.grad
                    else:
                        p.grad += t.grad
                    t.grad = None
        if self.split:  # tensor parallelism: each split parameter's gradient as its shard
            tensor_parallel.place_grads(self.split)
        self._release()

    def before_step(self) -> None:
        # The live parameters are about to change: keep the newest version if anyone still needs it.
        if self._needed(self.newest):
            self._materialize(self.newest)

    def after_step(self) -> None:
        self.newest += 1
        self._release()

    def observe(self) -> None:
        for v in [v for v, r in self.refs.items() if r() is None]:
            del self.refs[v]
        self.peak = max(self.peak, len({self.newest, *self.refs}))

    def live_versions(self) -> int:
        self.observe()
        return len({self.newest, *self.refs})

    def peak_versions(self) -> int:
        return self.peak

    # internals ---------------------------------------------------------------------------------
    def _materialize(self, v: int) -> dict[str, torch.Tensor]:
        if v not in self.clones:
            if v != self.newest:
                raise RuntimeError(f"weight version {v} was freed but is used again (newest is {self.newest}); "
                                   f"call expect() with the whole action list, or report this as a bug")
            made = self.predict() if self.predict is not None else \
                {n: p.detach().clone() for n, p in self.params.items()}
            self.clones[v] = {n: made[n].requires_grad_(p.requires_grad) for n, p in self.params.items()}
            for n, t in self.clones[v].items():  # a fused backward adds into the live .grad (runtime/fused_grads.py)
                fused_grads.accumulate_into(t, self.params[n])
            first = next(iter(self.clones[v].values()), None)
            if first is not None:
                self.refs[v] = weakref.ref(first)
        return self.clones[v]

    def _needed(self, v: int) -> bool:
        if any(self.inflight[k] == v for k in self.cloned):
            return True
        if self.future is None:
            return v >= self.forward_version
        return self.future[v] > 0 or (self.horizon is not None and v >= self.horizon)

    def _release(self) -> None:
        for v in list(self.clones):
            if not self._needed(v):
                del self.clones[v]
