"""Virtual stages: ``S = v * p`` stages on ``p`` ranks, stage ``s`` on rank ``s % p`` (chunk
``s // p`` of that rank). Interleaved 1F1B (Narayanan et al., SC'21; Megatron's depth-first
order) and looped BFS (all of a chunk's forwards before the next chunk's), both with one
synchronous update per step. One replica per stage."""

from __future__ import annotations

from pdcompile.errors import UsageError
from pdcompile.runtime.schedules.actions import Action
from pdcompile.runtime.schedules.blocks import backward, forward, update
from pdcompile.runtime.schedules.policy import Layout


def interleaved_placement(num_stages: int, virtual_stages: int) -> list[list[int]]:
    """Stage ``s`` on rank ``s % p`` with ``p = num_stages / virtual_stages``."""
    if virtual_stages < 1 or num_stages % virtual_stages:
        raise UsageError(f"{num_stages} stages do not split into {virtual_stages} virtual stages per rank")
    p = num_stages // virtual_stages
    return [[s % p] for s in range(num_stages)]


def _shape(lay: Layout) -> tuple[int, int, int]:
    """(p, v, microbatches per round): forwards go in rounds of ``mpr`` microbatches per chunk,
    ``mpr = M / max(1, M // p)`` (``p`` when ``p`` divides ``M``)."""
    v = lay.virtual_stages
    p, M = lay.num_stages // v, lay.num_microbatches
    rounds = max(1, M // p)
    if M % rounds:
        raise UsageError(f"interleaved schedules need M divisible by max(1, M // p) = {rounds} "
                         f"(M={M}, p={p} ranks); use M a multiple of p, or M < p")
    return p, v, M // rounds


def _warmup(lay: Layout, rank: int) -> int:
    """Forwards a rank runs before its first backward (Megatron's ``(v-1) * mpr + 2 (p-1-rank)``)."""
    p, v, mpr = _shape(lay)
    return min(lay.num_microbatches * v, (v - 1) * mpr + 2 * (p - 1 - rank))


def interleaved_in_flight(lay: Layout, rank: int) -> int:
    """The most microbatches (summed over its chunks) in flight on ``rank``: its warm-up plus the
    steady state's one forward before each backward."""
    return min(lay.num_microbatches * lay.virtual_stages, _warmup(lay, rank) + 1)


def looped_bfs_in_flight(lay: Layout, rank: int) -> int:
    """Every chunk keeps all of a step's microbatches until its backwards start."""
    return lay.num_microbatches * lay.virtual_stages


def _virtual(lay: Layout, rank: int, i: int, backwards: bool) -> tuple[int, int]:
    """(stage, microbatch within the step) of the rank's ``i``-th forward (or backward)."""
    p, v, mpr = _shape(lay)
    chunk = (i // mpr) % v
    return (v - 1 - chunk if backwards else chunk) * p + rank, (i // (mpr * v)) * mpr + i % mpr


def interleaved_1f1b_order(lay: Layout, stage: int, replica: int, tied: bool) -> list[Action]:
    """One rank's actions (``stage``: its first, i.e. the rank) in depth-first interleaved order.

    Per step: the warm-up's forwards (:func:`_warmup`), then one forward and one backward in turn,
    then the remaining backwards; forward ``i`` of the step is on chunk ``(i // mpr) % v``,
    microbatch ``(i // (mpr v)) mpr + i % mpr``, backwards likewise with the chunks reversed. Each
    stage's update right after its last backward of the step; with ``tied`` weights every stage's
    update at the end of the step (:func:`_updates`)."""
    rank, S, M = stage, lay.num_stages, lay.num_microbatches
    n = M * lay.virtual_stages
    acts: list[Action] = []
    for t in range(lay.num_steps):
        done = dict.fromkeys(range(S), 0)

        def fwd(i: int) -> None:
            s, k = _virtual(lay, rank, i, False)
            acts.extend(forward(s, S, t * M + k))

        def bwd(i: int) -> None:
            s, k = _virtual(lay, rank, i, True)
            acts.extend(backward(s, S, t * M + k))
            done[s] += 1
            if done[s] == M and not tied:
                acts.extend(update(s, False, False))

        w = _warmup(lay, rank)
        for i in range(w):
            fwd(i)
        for j in range(n - w):
            fwd(w + j)
            bwd(j)
        for j in range(n - w, n):
            bwd(j)
        if tied:
            acts += _updates(lay, rank)
    return acts


def _updates(lay: Layout, rank: int) -> list[Action]:
    """With tied weights, the rank's stages update together at the end of the step, each ``TG``
    then ``ST``: the runtime sums tied gradients once per step over all the rank's stages (a rank
    may hold both ends of a tie), which needs every stage's backwards done."""
    p = lay.num_stages // lay.virtual_stages
    return [a for c in range(lay.virtual_stages) for a in update(c * p + rank, False, True)]


def looped_bfs_order(lay: Layout, stage: int, replica: int, tied: bool) -> list[Action]:
    """One rank's actions (``stage``: its first, i.e. the rank): per step, chunk by chunk all the
    step's forwards in order; then chunk by chunk in reverse all its backwards in reverse order,
    each stage's update right after its last backward (with ``tied``: :func:`_updates`)."""
    rank, S, M, v = stage, lay.num_stages, lay.num_microbatches, lay.virtual_stages
    p = S // v
    acts: list[Action] = []
    for t in range(lay.num_steps):
        for c in range(v):
            for k in range(M):
                acts += forward(c * p + rank, S, t * M + k)
        for c in reversed(range(v)):
            for k in reversed(range(M)):
                acts += backward(c * p + rank, S, t * M + k)
            if not tied:
                acts += update(c * p + rank, False, False)
        if tied:
            acts += _updates(lay, rank)
    return acts
