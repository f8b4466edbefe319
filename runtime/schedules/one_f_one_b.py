"""The 1F1B family: after a warm-up, one forward and one backward in turn. PipeDream-Flush
(synchronous), PipeDream 1F1B with weight stashing (and vertical sync), PipeDream-2BW."""

from __future__ import annotations

from collections.abc import Sequence

from pdcompile.errors import ScheduleError
from pdcompile.runtime.schedules.actions import Action, Schedule
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


def flush(num_stages: int, num_microbatches: int, tied: bool = False, *,
          replicas: Sequence[int] | None = None, num_steps: int = 1) -> Schedule:
    """PipeDream-Flush: 1F1B order within a minibatch, gradients accumulated, one step at the flush.

    Each replica of stage s warms up with ``min(warmup_depth(replicas, s), its microbatches)``
    forwards (``S - s`` with one replica per stage), then alternates backward/forward, then drains
    its remaining backwards; then ``AR`` (if ``r_s > 1``), ``TG`` (if ``tied``), ``ST``. No forward of
    step ``t + 1`` starts before the step ``t`` ``ST`` (the flush). Weight versions, semantics and
    memory as for GPipe (synchronous SGD with gradient accumulation, one version); in flight per
    replica at most ``warmup_depth``.
    """
    from pdcompile.runtime.schedules.generate import make_schedule, replicas_for

    return make_schedule("flush", replicas_for(num_stages, replicas), num_microbatches, tied=tied, num_steps=num_steps)


def one_f_one_b(replicas: Sequence[int], num_microbatches: int, *, tied: bool = False,
                vertical_sync: bool = False, num_steps: int = 1) -> Schedule:
    """PipeDream 1F1B with weight stashing (1F1B-RR when a stage is replicated).

    Every microbatch index ``n`` is one PipeDream minibatch; the run covers ``N = M * num_steps``.
    Replica ``i`` of stage ``s`` handles ``n`` with ``n % r_s == i``. It forwards its first
    ``w_s = warmup_depth(replicas, s)`` microbatches (NOAM = ``ceil(workers / r_0)`` at the input
    stage, ``S - s`` without replicas), then alternates one backward, one forward, then drains.
    After each backward: ``SB`` (not on stage 0), then the step of that microbatch's group: ``AR``
    among the stage's replicas (if ``r_s > 1``; groups are microbatches ``g*r_s .. g*r_s + r_s - 1``,
    one per replica, so all replicas step together with the summed gradient of ``r_s`` minibatches;
    a replica without a microbatch in the last, partial group joins with zeros at the end), ``TG``
    (if ``tied``), ``ST``. Version ``v`` of stage ``s`` holds the updates of groups ``0 .. v-1``.

    * Without vertical sync, ``F n`` uses the stage's newest version at the time it starts, and
      ``B n`` the same stashed version. Without replicas, on stage ``s`` minibatch ``n`` uses
      version ``max(0, n - w_s + 1)``.
    * With vertical sync, ``F n`` on every stage uses the version reflecting the updates the input
      stage had applied when ``n`` entered: if ``c`` steps preceded ``F n`` on ``rank_of(0, n)``,
      stage ``s`` uses version ``floor(c * r_0 / r_s)``; without replicas ``max(0, n - NOAM + 1)``.
      Only the ``WV`` actions move.

    ``ST`` applies the gradient of each group to the newest version
    (``W(v+1) = W(v) - lr * grad(W_stashed)``).
    """
    from pdcompile.runtime.schedules.generate import make_schedule

    return make_schedule("1f1b", replicas, num_microbatches, tied=tied, vertical_sync=vertical_sync,
                         num_steps=num_steps)


def two_bw(replicas: Sequence[int], num_microbatches: int, *, tied: bool = False, num_steps: int = 1) -> Schedule:
    """PipeDream-2BW: 1F1B order without flushes, double-buffered weights, one-step-delayed updates.

    Step ``t`` holds microbatches ``t*M .. t*M + M - 1``. Each rank runs the 1F1B order without a
    flush between steps and, right after its last backward of step ``t``, ``AR`` / ``TG`` / ``ST``:
    the accumulated gradient of step ``t`` creates version ``t + 1``. Forwards and backwards of step
    ``t`` use version ``max(0, t - 1)``: ``W(t+1) = W(t) - lr * grad f_t(W(t-1))``, the 2BW paper's
    update. A forward of step ``t`` waits until version ``t - 1`` exists; with ``M >= S - 1`` this
    never delays the 1F1B order. Exactly two versions are alive once steps overlap.
    """
    from pdcompile.runtime.schedules.generate import make_schedule

    return make_schedule("2bw", replicas, num_microbatches, tied=tied, num_steps=num_steps)
