"""Zero bubble (Qi et al., ICLR'24): every backward split into ``B`` (input gradients, sent at
once) and ``W`` (weight gradients), the ``W`` passes placed to fill the bubbles. ZB-H1 is the
paper's handcrafted schedule at 1F1B's memory: F and B in 1F1B order, W delayed."""

from __future__ import annotations

from collections import deque

from pdcompile.runtime.schedules.actions import Action, Kind
from pdcompile.runtime.schedules.blocks import Updates, backward, forward
from pdcompile.runtime.schedules.policy import Layout


def zb_h1_order(lay: Layout, stage: int, replica: int, tied: bool) -> list[Action]:
    """One rank's actions in ZB-H1 order.

    F and B in 1F1B order (at most ``warmup_depth`` microbatches between F and B); after each B the
    oldest pending W's run while more than ``delay = held - warmup_depth`` are pending
    (:meth:`~.policy.Policy.held`; stage ``s`` of ``S`` unreplicated ones delays ``s``), so no
    forward makes more than ``held`` microbatches held; a step's pending W's run right before its
    update, after the step's last B. On equal stages and ``m >= S`` a step takes the paper's
    ``m (F + B + W) + (S - 1)(F + B - W)`` (1F1B: ``(m + S - 1)(F + B + W)``).
    """
    S, r = lay.num_stages, lay.replicas[stage]
    local = list(range(replica, lay.total, r))
    acts: list[Action] = []
    updates = Updates(acts, stage, r > 1, tied, split=False)
    bound = lay.in_flight_bound(stage)
    delay = lay.held_bound(stage) - bound
    pending: deque[int] = deque()

    def weight_grads(keep: int) -> None:
        while len(pending) > keep:
            acts.append(Action(stage, Kind.WEIGHT_GRAD, pending.popleft()))

    i_f = i_b = 0
    while i_b < len(local):
        if i_f < len(local) and i_f - i_b < bound:
            g_next = lay.group_of(stage, local[i_f])
            if g_next > updates.done and i_b == i_f:  # steps with no local microbatch: zero gradients
                updates.upto(g_next)
            if g_next <= updates.done:
                acts += forward(stage, S, local[i_f])
                i_f += 1
                continue
        mb = local[i_b]
        acts += backward(stage, S, mb)
        pending.append(mb)
        i_b += 1
        g = lay.group_of(stage, mb)
        if i_b == len(local) or lay.group_of(stage, local[i_b]) > g:
            weight_grads(0)  # the step needs every weight gradient of its group
            updates.upto(g + 1)
        else:
            weight_grads(delay)
    updates.upto(lay.num_groups(stage))
    return acts
