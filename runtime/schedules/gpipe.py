"""GPipe: per step, all forwards, then all backwards in reverse order, then one synchronous update."""

from __future__ import annotations

from pdcompile.runtime.schedules.actions import Action
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
