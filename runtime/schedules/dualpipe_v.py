"""DualPipeV (DeepSeek-V3's DualPipe cut in half, torch's ``ScheduleDualPipeV``): ``2p`` stages on
``p`` ranks in the V of :mod:`.zero_bubble_v`, a steady state that pairs a forward of one stage with
a full backward of the other, split backwards (``B`` then ``W``) only in the warm-up's turn of the
V and in the cool-down. Our runtime overlaps no forward with a backward, so an F&B pair runs as the
F, then the B. One synchronous update per step; ``m >= 2p`` microbatches."""

from __future__ import annotations

from collections import deque

from pdcompile.errors import UsageError
from pdcompile.runtime.schedules.actions import Action, Kind, shift
from pdcompile.runtime.schedules.blocks import expand_compute
from pdcompile.runtime.schedules.policy import Layout
from pdcompile.runtime.schedules.zero_bubble_v import v_ranks


def _check(p: int, m: int) -> None:
    if m < 2 * p:
        raise UsageError(f"dualpipe-v needs at least as many microbatches as stages: m={m} < {2 * p}")


class _Ops:
    """A rank's compute order being built: per stage the next forward and backward microbatch, and
    the split backwards whose ``W`` is still to come (oldest first)."""

    def __init__(self) -> None:
        self.ops: list[Action] = []
        self.next: dict[tuple[int, Kind], int] = {}
        self.pending: deque[Action] = deque()

    def f(self, stage: int) -> None:
        self._add(stage, Kind.FORWARD)

    def b(self, stage: int, split: bool = False) -> None:
        k = self._add(stage, Kind.BACKWARD)
        if split:
            self.pending.append(Action(stage, Kind.WEIGHT_GRAD, k))

    def w(self) -> None:
        """The oldest pending ``W``, if any."""
        if self.pending:
            self.ops.append(self.pending.popleft())

    def _add(self, stage: int, kind: Kind) -> int:
        k = self.next.get((stage, kind), 0)
        self.next[(stage, kind)] = k + 1
        self.ops.append(Action(stage, kind, k))
        return k


def dualpipe_v_compute(p: int, m: int, rank: int) -> list[Action]:
    """One step's compute order of ``rank`` (stages ``c0 = rank``, ``c1 = 2p-1-rank``); ``B*``: a
    split backward (its W from the queue of pending ones, oldest first, where ``W`` stands).

    ``2(p-rank-1)`` F(c0); ``rank+1`` times F(c0) F(c1); ``p-rank-1`` times B*(c1) W F(c1);
    ``m-2p+rank+1`` times F(c0) B(c1) F(c1) B(c0) (two F&B pairs); ``p-rank-1`` times B(c1) F(c1)
    B(c0); ``rank+1`` times B(c1) B(c0), split from the middle pair on (``i = (rank+1) // 2``: from
    its B(c1) on odd ranks, its B(c0) on even ones); ``p-rank-1`` times W B(c0) (split as the last
    one); ``rank+1`` times W.
    """
    _check(p, m)
    c0, c1 = rank, 2 * p - 1 - rank
    o = _Ops()
    for _ in range(2 * (p - rank - 1)):
        o.f(c0)
    for _ in range(rank + 1):
        o.f(c0)
        o.f(c1)
    for _ in range(p - rank - 1):
        o.b(c1, split=True)
        o.w()
        o.f(c1)
    for _ in range(m - 2 * p + rank + 1):
        o.f(c0)
        o.b(c1)
        o.f(c1)
        o.b(c0)
    for _ in range(p - rank - 1):
        o.b(c1)
        o.f(c1)
        o.b(c0)
    split = False
    for i in range(rank + 1):
        split = split or (i == (rank + 1) // 2 and rank % 2 == 1)
        o.b(c1, split)
        split = split or (i == (rank + 1) // 2 and rank % 2 == 0)
        o.b(c0, split)
    for _ in range(p - rank - 1):
        o.w()
        o.b(c0, split)
    for _ in range(rank + 1):
        o.w()
    return o.ops


def dualpipe_v_order(lay: Layout, stage: int, replica: int, tied: bool) -> list[Action]:
    """One rank's actions (``stage``: its first, i.e. the rank), :func:`dualpipe_v_compute` step by
    step with each F/B in its transfers and each stage's update after its last B/W of the step (with
    ``tied`` weights, both stages' at the end of the step)."""
    p, m = v_ranks(lay), lay.num_microbatches
    step = expand_compute(dualpipe_v_compute(p, m, stage), lay.num_stages, tied)
    return [shift(a, t * m) for t in range(lay.num_steps) for a in step]


def dualpipe_v_in_flight(lay: Layout, rank: int) -> int:
    """Microbatches in flight (F done, B not; also F done, W not) on a rank over its two stages:
    ``2p + 1``, the warm-up's ``2p`` and the F of each F&B pair before its B."""
    _check(v_ranks(lay), lay.num_microbatches)
    return 2 * v_ranks(lay) + 1
