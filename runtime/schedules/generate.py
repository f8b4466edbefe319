"""Building a schedule: a policy's action order per rank, then the weight-version switches (``WV``)
placed as early as possible, so each forward runs with the version its policy defines; and the
schedules by name as functions (:func:`gpipe`, :func:`flush`, :func:`one_f_one_b`, :func:`two_bw`)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Sequence

from pdcompile.errors import ScheduleError, UsageError
from pdcompile.runtime.schedules.actions import Action, Kind, Schedule, stages_of_rank
from pdcompile.runtime.schedules.policy import Layout
from pdcompile.runtime.schedules.registry import layout


def expected_versions(lay: Layout, sched: Schedule) -> dict[tuple[int, int], int]:
    """(stage, microbatch) -> the weight version the schedule's definition says ``F`` uses.

    Counts ``ST`` actions in ``sched`` (``WV`` actions are ignored), so it works on generated and
    on given schedules alike.
    """
    steps_before: dict[tuple[int, int], int] = {}  # (stage, mb) -> STs on its rank before its F
    for rank, acts in sched.items():
        n = 0
        for a in acts:
            if a.kind is Kind.STEP:
                n += 1
            elif a.kind is Kind.FORWARD:
                steps_before[(a.stage, a.mb)] = n
    out: dict[tuple[int, int], int] = {}
    lag = lay.policy.version_lag
    for (stage, mb), n in steps_before.items():
        if lag is not None:
            v = max(0, lay.group_of(stage, mb) - lag)
        elif lay.vertical_sync:
            c0 = steps_before.get((0, mb), 0)  # updates the input stage had applied when mb entered
            v = (c0 * lay.replicas[0]) // lay.replicas[stage]
        else:
            v = n
        out[(stage, mb)] = v
    return out


def insert_versions(acts: list[Action], version_of: Callable[[int], int], stage: int | None = None) -> list[Action]:
    """Insert ``WV`` actions as early as possible so each ``F`` runs with ``version_of(mb)``
    (``stage``: only that stage's ``ST`` and ``F``, on a rank with virtual stages)."""
    st_pos = [i for i, a in enumerate(acts) if a.kind is Kind.STEP and stage in (None, a.stage)]
    inserts: dict[int, Action] = {}  # insert after this index (-1: at the start)
    current, last_f_end = 0, -1
    for i, a in enumerate(acts):
        if a.kind is not Kind.FORWARD or stage not in (None, a.stage):
            continue
        v = version_of(a.mb)
        if v != current:
            if v < current or v > len(st_pos) or st_pos[v - 1] > i:
                raise ScheduleError(f"internal: {a} needs weight version {v}, which does not exist yet")
            inserts[max(last_f_end, st_pos[v - 1])] = Action(a.stage, Kind.WEIGHT_VERSION, version=v)
            current = v
        nxt = acts[i + 1] if i + 1 < len(acts) else None
        last_f_end = i + 1 if nxt is not None and nxt.kind is Kind.SEND_ACT and nxt.microbatch == a.microbatch else i
    out = [inserts[-1]] if -1 in inserts else []
    for i, a in enumerate(acts):
        out.append(a)
        if i in inserts:
            out.append(inserts[i])
    return out


def make_schedule(name: str, replicas: Sequence[int], num_microbatches: int, *, tied: bool = False,
                  vertical_sync: bool = False, num_steps: int = 1, split_backward: bool = True,
                  virtual_stages: int = 1, ranks: Collection[int] | None = None) -> Schedule:
    """Build the named schedule (:data:`SCHEDULES`) for a pipeline with ``replicas[s]`` replicas of stage s.

    ``virtual_stages``: stages per rank, for a schedule with a placement (interleaved-1f1b,
    looped-bfs: ``len(replicas) = virtual_stages * p`` stages on ``p`` ranks, see :mod:`.interleaved`).

    ``num_microbatches`` (``M``) is the number of microbatches per optimizer step for ``gpipe``,
    ``flush`` and ``2bw``; ``num_steps`` such steps are laid out (microbatches ``0 .. M*num_steps-1``).
    For ``1f1b`` every microbatch is one PipeDream minibatch with its own step, and the run covers
    ``M * num_steps`` of them. ``tied``: a ``TG`` before every ``ST`` on every rank. ``vertical_sync``
    changes ``1f1b``'s weight versions (see :func:`one_f_one_b`); ``gpipe``, ``flush`` and ``2bw``
    already use one version per microbatch across stages, so it changes nothing there.
    ``split_backward`` (gpipe and flush; ignored by the others): every stage but the first splits
    its last backward of each step into ``B`` (input gradients, sent at once) and ``W`` (weight
    gradients) — see the package docstring.

    ``ranks``: only these ranks' lists (default every rank's), each equal to the whole schedule's:
    a rank's order depends only on its stage and replica, and its weight versions on its own steps
    (or, with vertical sync, on the input stage's ranks', which are then built too but not returned).
    """
    only = None if ranks is None else set(ranks)
    lay = layout(name, replicas, num_microbatches, num_steps, vertical_sync, split_backward, virtual_stages)
    if tied and lay.policy.update_per_microbatch and len(set(lay.replicas)) > 1:
        raise UsageError(
            f"1F1B steps every r_s microbatches on a stage with r_s replicas, so with replicas "
            f"{list(lay.replicas)} the stages' steps don't line up and tied gradients can't be summed "
            f"step by step; use equal replica counts, or flush/gpipe/2bw")
    where = lay.stage_ranks
    wanted = None if only is None else set(only)
    if wanted is not None and lay.vertical_sync:  # versions read the input stage's steps
        wanted |= set(where[0])
    base: Schedule = {}
    for s, rs in enumerate(where):
        for i, rank in enumerate(rs):
            if rank not in base and (wanted is None or rank in wanted):
                base[rank] = lay.policy.order(lay, s, i, tied)  # its first stage's: with virtual stages, all of them
    versions = expected_versions(lay, base)
    out: Schedule = {}
    for rank, acts in base.items():
        if only is not None and rank not in only:
            continue
        stages = stages_of_rank(rank, where)
        for s in stages:
            acts = insert_versions(acts, functools.partial(_version_of, versions, s),
                                   stage=s if len(stages) > 1 else None)
        out[rank] = acts
    return out


def replicas_for(num_stages: int, replicas: Sequence[int] | None) -> list[int]:
    if replicas is None:
        return [1] * num_stages
    if len(replicas) != num_stages:
        raise UsageError(f"replicas {list(replicas)} has {len(replicas)} stages, num_stages is {num_stages}")
    return list(replicas)


def _version_of(versions: dict[tuple[int, int], int], stage: int, mb: int) -> int:
    return versions[(stage, mb)]


# -- the schedules by name, as functions ------------------------------------------------------


def gpipe(num_stages: int, num_microbatches: int, tied: bool = False, *,
          replicas: Sequence[int] | None = None, num_steps: int = 1) -> Schedule:
    """GPipe: per step, all forwards, then all backwards (reverse order), then one synchronous step.

    Each replica of stage s takes the step's microbatches ``k`` with ``k % r_s == replica``: forwards
    in increasing order, backwards in decreasing order, then ``AR`` (if ``r_s > 1``), ``TG`` (if
    ``tied``), ``ST``. Every forward and backward of step ``t`` uses weight version ``t``; ``WV t``
    precedes step ``t``'s first forward: plain synchronous SGD with gradient accumulation over the
    ``M`` microbatches of a minibatch. In flight per replica: all of its microbatches in the step.
    """
    return make_schedule("gpipe", replicas_for(num_stages, replicas), num_microbatches, tied=tied, num_steps=num_steps)


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
    return make_schedule("2bw", replicas, num_microbatches, tied=tied, num_steps=num_steps)
