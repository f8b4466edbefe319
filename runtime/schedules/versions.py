"""Weight versions and in-flight microbatches, read off one rank's actions: what a schedule makes
the executor keep in memory. The rules (identical for every schedule): ``WV v`` switches later
forwards to version ``v``; ``F k`` records its version for ``B k`` (stashing); ``ST`` creates the
next version from the newest; a version lives while it is the newest, in use by a microbatch in
flight, or needed by a later forward."""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Sequence

from pdcompile.runtime.schedules.actions import Action, Kind, Schedule


def forward_versions(actions: Sequence[Action]) -> dict[int, int]:
    """Microbatch -> the weight version its ``F`` uses on this rank (the last ``WV`` before it)."""
    out: dict[int, int] = {}
    current = 0
    for a in actions:
        if a.kind is Kind.WEIGHT_VERSION:
            current = a.wv
        elif a.kind is Kind.FORWARD:
            out[a.mb] = current
    return out


def live_versions(actions: Sequence[Action]) -> list[frozenset[int]]:
    """The weight versions that must be alive after each action of one rank (see the module doc).

    A version is alive while it is the newest (``#ST`` so far), or a microbatch in flight was
    forwarded with it, or a later ``F`` on this rank will use it.
    """
    fv = forward_versions(actions)
    future = Counter(fv.values())  # versions of the forwards still to come
    future_sorted = sorted(future)
    newest = 0
    inflight: dict[int, int] = {}
    out: list[frozenset[int]] = []
    for a in actions:
        if a.kind is Kind.STEP:
            newest += 1
        elif a.kind is Kind.FORWARD:
            v = fv[a.mb]
            inflight[a.mb] = v
            future[v] -= 1
            if future[v] == 0:
                del future[v]
                future_sorted.pop(bisect.bisect_left(future_sorted, v))
        elif a.kind is Kind.BACKWARD:
            inflight.pop(a.mb, None)
        live = {newest, *inflight.values()}
        for v in future_sorted:
            if v > newest:
                break
            live.add(v)
        out.append(frozenset(live))
    return out


def version_copies(actions: Sequence[Action]) -> list[int]:
    """Per action of one rank, the weight-sized copies weight stashing makes there (0 or 1), as
    :class:`pdcompile.runtime.weights.VersionedStore` does: an ``ST`` whose newest version must
    outlive it is preceded by a clone of the weights; the ``B`` of a microbatch that ran on a clone
    (its version was not the newest, or an ``ST`` came between its ``F`` and ``B``) adds the clone's
    gradients into the live parameters' — a copy only when an earlier ``B`` since the last ``ST``
    left gradients there (``ST`` sets them to None, and the first is handed over, not added).
    GPipe and Flush copy nothing.

    >>> acts = [Action.from_str(x) for x in "0F0 0F1 0F2 0B0 0ST 0WV1 0F3 0B1 0B2 0B3 0ST".split()]
    >>> version_copies(acts)
    [0, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0]
    """
    live = live_versions(actions)
    fv = forward_versions(actions)
    newest = 0
    open_f: set[int] = set()
    on_clone: set[int] = set()
    grads = False  # the live parameters hold gradients (a B since the last ST)
    out = []
    for a, alive in zip(actions, live):
        n = 0
        if a.kind is Kind.FORWARD:
            open_f.add(a.mb)
            if fv[a.mb] != newest:
                on_clone.add(a.mb)
        elif a.kind is Kind.STEP:
            on_clone |= open_f
            n = int(newest in alive)
            newest += 1
            grads = False
        elif a.kind is Kind.BACKWARD:
            open_f.discard(a.mb)
            n = int(a.mb in on_clone and grads)
            grads = True
        out.append(n)
    return out


def peak_weight_versions(sched: Schedule) -> dict[int, int]:
    """Rank -> the most weight versions alive at once (what the executor must keep in memory)."""
    return {rank: max((len(s) for s in live_versions(acts)), default=1) for rank, acts in sched.items()}


def peak_in_flight(sched: Schedule) -> dict[int, int]:
    """Rank -> the most microbatches in flight at once (F done, B not yet): stashed activations."""
    out = {}
    for rank, acts in sched.items():
        n = peak = 0
        for a in acts:
            if a.kind is Kind.FORWARD:
                n += 1
                peak = max(peak, n)
            elif a.kind is Kind.BACKWARD:
                n -= 1
        out[rank] = peak
    return out


def update_delays(actions: Sequence[Action], stage: int | None = None) -> Counter[int]:
    """How stale each gradient of one rank is (of ``stage``'s actions, where a rank holds several):
    per microbatch, the optimizer steps taken between the version its ``F`` used and the ``ST`` that
    applies its gradient (the first ``ST`` after its ``B``), counted: delay -> microbatches. The
    stage's delay is the largest (the steady state; warm-up's are smaller): 1F1B ``w - 1`` with
    ``w`` the replica's in-flight count, 2BW 1, the synchronous schedules 0.

    >>> acts = [Action.from_str(x) for x in "0F0 0F1 0B0 0ST 0WV1 0F2 0B1 0ST 0B2 0ST".split()]
    >>> dict(update_delays(acts))
    {0: 1, 1: 2}
    """
    fv: dict[int, int] = {}
    version = newest = 0
    pending: list[int] = []
    out: Counter[int] = Counter()
    for a in actions:
        if stage is not None and a.stage != stage:
            continue
        if a.kind is Kind.WEIGHT_VERSION:
            version = a.wv
        elif a.kind is Kind.FORWARD:
            fv[a.mb] = version
        elif a.kind is Kind.BACKWARD and a.mb in fv:
            pending.append(a.mb)
        elif a.kind is Kind.STEP:
            for k in pending:
                out[newest - fv.pop(k)] += 1
            pending = []
            newest += 1
    return out
