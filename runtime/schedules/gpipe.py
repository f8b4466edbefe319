"""GPipe: per step, all forwards, then all backwards in reverse order, then one synchronous update."""

from __future__ import annotations

from collections.abc import Sequence

from pdcompile.runtime.schedules.actions import Action, Schedule
from pdcompile.runtime.schedules.blocks import Updates, backward, forward
from pdcompile.runtime.schedules.policy import Layout


def gpipe_order(lay: Layout, stage: int, replica: int, tied: bool) -> list[Action]:
    """One rank's actions: its microbatches of each step forward, then backward reversed, then the update."""
    S, r = lay.num_stages, lay.replicas[stage]
    local = list(range(replica, lay.total, r))
    acts: list[Action] = []
    updates = Updates(acts, stage, r > 1, tied, lay.split_backward)
    for k in range(lay.num_steps):
        mine = [mb for mb in local if lay.group_of(stage, mb) == k]
        for mb in mine:
            acts += forward(stage, S, mb)
        for mb in reversed(mine):
            acts += backward(stage, S, mb)
        updates.upto(k + 1)
    return acts


def gpipe(num_stages: int, num_microbatches: int, tied: bool = False, *,
          replicas: Sequence[int] | None = None, num_steps: int = 1) -> Schedule:
    """GPipe: per step, all forwards, then all backwards (reverse order), then one synchronous step.

    Each replica of stage s takes the step's microbatches ``k`` with ``k % r_s == replica``: forwards
    in increasing order, backwards in decreasing order, then ``AR`` (if ``r_s > 1``), ``TG`` (if
    ``tied``), ``ST``. Every forward and backward of step ``t`` uses weight version ``t``; ``WV t``
    precedes step ``t``'s first forward: plain synchronous SGD with gradient accumulation over the
    ``M`` microbatches of a minibatch. In flight per replica: all of its microbatches in the step.
    """
    from pdcompile.runtime.schedules.generate import make_schedule, replicas_for

    return make_schedule("gpipe", replicas_for(num_stages, replicas), num_microbatches, tied=tied, num_steps=num_steps)
