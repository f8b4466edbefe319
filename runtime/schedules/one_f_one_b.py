"""The 1F1B family: after a warm-up, one forward and one backward in turn. PipeDream-Flush
(synchronous), PipeDream 1F1B with weight stashing (and vertical sync), PipeDream-2BW."""

from __future__ import annotations

from pdcompile.errors import ScheduleError
from pdcompile.runtime.schedules.actions import Action
from pdcompile.runtime.schedules.blocks import Updates, backward, forward
from pdcompile.runtime.schedules.policy import Layout


def one_f_one_b_order(lay: Layout, stage: int, replica: int, tied: bool) -> list[Action]:
    """One rank's actions in 1F1B order: forward while fewer than the in-flight bound are in flight
    and the forward's weight version can exist, else backward the oldest. A group's update comes
    right after its last local backward; a group with no local microbatch (fewer microbatches in a
    step than replicas) is updated (zero gradients) as late as possible: before the next backward
    or the forward that needs it."""
    S, r = lay.num_stages, lay.replicas[stage]
    local = list(range(replica, lay.total, r))
    acts: list[Action] = []
    updates = Updates(acts, stage, r > 1, tied, lay.split_backward)

    def all_backwarded_before(group: int) -> bool:
        return i_b >= len(local) or lay.group_of(stage, local[i_b]) >= group

    bound = lay.in_flight_bound(stage)
    i_f = i_b = 0
    while i_b < len(local):
        need = lay.required_steps(stage, local[i_f]) if i_f < len(local) else 0
        if i_f < len(local) and i_f - i_b < bound and (updates.done >= need or all_backwarded_before(need)):
            updates.upto(need)
            acts += forward(stage, S, local[i_f])
            i_f += 1
        else:
            if i_b == i_f:  # pragma: no cover - the step rule above makes this impossible
                raise ScheduleError(f"internal: {lay.name} stalls on stage {stage} at microbatch {local[i_f]}")
            g = lay.group_of(stage, local[i_b])
            updates.upto(g)
            acts += backward(stage, S, local[i_b])
            i_b += 1
            if i_b == len(local) or lay.group_of(stage, local[i_b]) > g:
                updates.upto(g + 1)
    updates.upto(lay.num_groups(stage))
    return acts
