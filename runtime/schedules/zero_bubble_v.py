"""ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR'24, section 6): ``2p`` stages on
``p`` ranks in a V (stage ``s`` on rank ``s`` for ``s < p``, on rank ``2p-1-s`` after), every
backward split into ``B`` (input gradients) and ``W`` (weight gradients), the handcrafted order
at 1F1B's activation memory. The V puts the hand-over of stages ``p-1`` and ``p`` on one rank
and the last stage on the first stage's rank. One synchronous update per step."""

from __future__ import annotations

from collections import deque

from pdcompile.errors import UsageError
from pdcompile.runtime.schedules.actions import Action, Kind, shift
from pdcompile.runtime.schedules.blocks import expand_compute
from pdcompile.runtime.schedules.policy import Layout


def v_placement(num_stages: int, virtual_stages: int) -> list[list[int]]:
    """Two stages per rank in a V: stage ``s`` on rank ``min(s, 2p-1-s)``, ``p = num_stages / 2``."""
    if virtual_stages != 2 or num_stages % 2:
        raise UsageError(f"a V placement puts exactly 2 stages on each rank: {num_stages} stages with "
                         f"virtual_stages={virtual_stages} do not fit (use virtual_stages=2 and an even stage count)")
    return [[min(s, num_stages - 1 - s)] for s in range(num_stages)]


def v_ranks(lay: Layout) -> int:
    """``p``, the number of ranks of a V layout."""
    return lay.num_stages // 2


def zbv_compute(p: int, m: int, rank: int) -> list[Action]:
    """One step's compute order (``F``, ``B``, ``W``; microbatches ``0..m-1``) of ``rank``, its
    stages ``c0 = rank`` (going down the V) and ``c1 = 2p-1-rank`` (coming back).

    Built for ``n = max(m, 2p-1)`` microbatches (enough to fill the V), then those ``>= m`` dropped:
    warm-up ``2(p-rank)-1`` F(c0); ``rank`` times F(c1) F(c0); ``p-rank`` times F(c1) B(c1) W(c1);
    steady state, while c1 lags c0 or c0 has forwards left: [F(c0)] B(c0) W(c0) F(c1) B(c1) W(c1);
    cool-down ``rank`` times B(c0) B(c1) with their W's held back, then ``p-rank`` times B(c0) and
    the oldest held W(c0), then the held W(c1)'s, then the held W(c0)'s.
    """
    n = max(m, 2 * p - 1)
    c = (rank, 2 * p - 1 - rank)
    count = {(x, k): 0 for x in c for k in (Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT_GRAD)}
    ops: list[Action] = []

    def do(chunk: int, kind: Kind) -> None:
        ops.append(Action(chunk, kind, count[(chunk, kind)]))
        count[(chunk, kind)] += 1

    for _ in range(2 * (p - rank) - 1):
        do(c[0], Kind.FORWARD)
    for _ in range(rank):
        do(c[1], Kind.FORWARD)
        do(c[0], Kind.FORWARD)
    for _ in range(p - rank):
        for kind in (Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT_GRAD):
            do(c[1], kind)
    while count[(c[1], Kind.FORWARD)] < count[(c[0], Kind.FORWARD)] or count[(c[0], Kind.FORWARD)] < n:
        if count[(c[0], Kind.FORWARD)] < n:
            do(c[0], Kind.FORWARD)
        do(c[0], Kind.BACKWARD)
        do(c[0], Kind.WEIGHT_GRAD)
        for kind in (Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT_GRAD):
            do(c[1], kind)
    held: dict[int, deque[int]] = {x: deque(range(count[(x, Kind.WEIGHT_GRAD)], n)) for x in c}
    for _ in range(rank):
        do(c[0], Kind.BACKWARD)
        do(c[1], Kind.BACKWARD)
    for _ in range(p - rank):
        do(c[0], Kind.BACKWARD)
        ops.append(Action(c[0], Kind.WEIGHT_GRAD, held[c[0]].popleft()))
    ops += [Action(x, Kind.WEIGHT_GRAD, k) for x in (c[1], c[0]) for k in held[x]]
    return [a for a in ops if a.mb < m]


def zbv_order(lay: Layout, stage: int, replica: int, tied: bool) -> list[Action]:
    """One rank's actions (``stage``: its first, i.e. the rank), :func:`zbv_compute` step by step
    with each F/B in its transfers and each stage's update after its last W of the step (with
    ``tied`` weights, both stages' at the end of the step)."""
    p, m = v_ranks(lay), lay.num_microbatches
    step = expand_compute(zbv_compute(p, m, stage), lay.num_stages, tied)
    return [shift(a, t * m) for t in range(lay.num_steps) for a in step]


def zbv_in_flight(lay: Layout, rank: int) -> int:
    """Microbatches in flight (F done, B not) on a rank over both its stages: ``min(2p, 2m)``, 1F1B's
    peak on the first rank counted in half-rank stages (the paper's ZB-V memory)."""
    return min(2 * v_ranks(lay), 2 * lay.num_microbatches)


def zbv_held(lay: Layout, rank: int) -> int:
    """Microbatches held (F done, W not) on a rank: the same ``min(2p, 2m)``; a W comes right after
    its B until the cool-down, which starts no forward."""
    return zbv_in_flight(lay, rank)
