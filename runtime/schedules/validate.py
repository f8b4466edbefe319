"""Checking a schedule against its policy's rules (:func:`validate`): each broken rule is named,
with the rank, the step and the grid marked."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from pdcompile.errors import ScheduleError, UsageError
from pdcompile.runtime.schedules.actions import Kind, Schedule, rank_of, schedule_error
from pdcompile.runtime.schedules.generate import expected_versions, make_schedule
from pdcompile.runtime.schedules.policy import Policy
from pdcompile.runtime.schedules.registry import SPLIT_BACKWARD_SCHEDULES, layout
from pdcompile.runtime.schedules.replay import replay
from pdcompile.runtime.schedules.transfers import check_transfers, transfer_plan


def _check_split(sched: Schedule, pol: Policy, r: int, s: int, k: int, b: int, sb: int, w: int,
                 fail: Callable[[str, int | None, int | None, str], ScheduleError]) -> None:
    """Rule 'split backward' for ``W k`` at index ``w`` of rank ``r`` (``B k`` at ``b``, ``SB k`` at ``sb``)."""
    a = sched[r][w]
    name = pol.name
    if not pol.split_backward:
        raise fail("split backward", r, w, f"{a}: only {' and '.join(SPLIT_BACKWARD_SCHEDULES)} split a backward "
                   f"({name} keeps weight versions, which W does not)")
    if s == 0 and not (pol.splits_every_backward or pol.order_splits):
        raise fail("split backward", r, w, f"{a}: stage 0 sends no input gradients, so it has no backward to split")
    if w < max(b, sb):
        raise fail("split backward", r, w, f"{a} must come after {sched[r][max(b, sb)]} (step {max(b, sb)})")
    between = [i for i in range(b + 1, w) if sched[r][i].kind in (Kind.ALLREDUCE, Kind.TIED_GRADS, Kind.STEP)
               and sched[r][i].stage == s]  # the stage's own update (another stage of the rank may step)
    if between:
        raise fail("split backward", r, w, f"{a} comes after {sched[r][between[0]]} (step {between[0]}): the "
                   f"weight gradients of {s}B{k} must be complete before the stage's gradients are reduced or stepped")


def _check_local_hand_overs(sched: Schedule, ranks: list[list[int]],
                            fail: Callable[[str, int | None, int | None, str], ScheduleError]) -> None:
    """Rule 'send/recv pairs matched' for local hand-overs: on a rank that runs both stages of a
    transfer, its send comes before its receive (no message: the receive takes what the send left)."""
    for r, acts in sched.items():
        at = {(a.kind, a.stage, a.microbatch): i for i, a in enumerate(acts)}
        for i, a in enumerate(acts):
            if a.kind not in (Kind.RECV_ACT, Kind.RECV_GRAD):
                continue
            kind, src = (Kind.SEND_ACT, a.stage - 1) if a.kind is Kind.RECV_ACT else (Kind.SEND_GRAD, a.stage + 1)
            if not 0 <= src < len(ranks) or rank_of(src, a.mb, ranks) != r:
                continue
            j = at.get((kind, src, a.microbatch))
            if j is None or j > i:
                raise fail("send/recv pairs matched", r, i, f"{a} is a local hand-over on rank {r} (stages {src} and "
                           f"{a.stage}): {src}{kind.value}{a.mb} must come before it"
                           + ("" if j is None else f", not at step {j}"))


def validate(sched: Schedule, replicas: Sequence[int], num_microbatches: int, name: str | Policy, *,
             num_steps: int = 1, vertical_sync: bool = False, virtual_stages: int = 1) -> None:
    """Check ``sched`` against the rules of schedule ``name``; raise :class:`ScheduleError` on the first broken one.

    ``name``: a registered schedule, or a :class:`Policy` of one that is not (a torch CSV's,
    :func:`~.torch_csv.csv_policy`).

    The message names the rule, the rank and step, and shows the full grid with ``<-- ERROR HERE``
    under the bad action. Rules, in the order checked:

    1. 'ranks': one action list per rank (``0 .. sum(replicas)-1``, or the placement's ranks with
       ``virtual_stages``); every action on a rank is of one of that rank's stages. Rules 3-6, 8
       and 9 hold for each stage of a rank on its own actions; a transfer between two stages of one
       rank keeps its pair (a local hand-over, no message for rule 11).
    2. 'round-robin routing': every action of microbatch ``k`` on stage ``s`` (F, B, and both sides
       of every transfer) is on ``rank_of(s, k)``.
    3. 'each forward and backward once': microbatches ``0 .. M*num_steps-1`` each have exactly one
       ``F`` and one ``B`` on every stage, and no other microbatch appears.
    4. 'send/recv pairs matched': ``RF k`` on every stage but the first and ``SF k`` on every stage
       but the last, ``SB``/``RB`` likewise, exactly once each; each receive before the compute that
       uses it, each send after the compute that produces it. A transfer whose sender and receiver
       are one rank (virtual stages: a local hand-over, e.g. the V's stages ``p-1`` and ``p``) has
       its ``SF``/``SB`` before its ``RF``/``RB`` in that rank's list.
    5. 'backward after forward': ``B k`` after ``F k`` on the same rank. 'split backward': a ``W k``
       comes once, after ``B k`` and its ``SB k``, before the rank's next ``AR``/``TG``/``ST``, in a
       policy that splits backwards; optional and on a stage after the first (gpipe, flush), or on
       every microbatch of every stage (``splits_every_backward``: zb-h1).
    6. 'forward order': every rank forwards its microbatches in increasing order (so every stage
       sees them in the order the stage before sent them).
    7. 'in-flight bound': microbatches in flight on a replica (F done, B not; over all its stages)
       never exceed the schedule's bound (``warmup_depth``; for gpipe the replica's share of a step); where every
       backward is split, those held (F done, W not) never exceed :meth:`~.policy.Policy.held`.
    8. 'steps': each rank has one ``ST`` per group the schedule defines (per step for gpipe, flush,
       2bw; per ``r_s`` microbatches for 1f1b), placed after the group's last local backward and
       before the next forward or backward; ``AR`` before each ``ST`` exactly on replicated stages;
       ``TG`` before each ``ST`` on every rank or on none.
    9. 'weight versions': ``WV`` names an existing version, never goes back, and every ``F`` uses the
       version the schedule defines (see the schedule's function docstring).
    10. 'no deadlock': replaying with blocking receives and collectives (:func:`replay`) completes.
    11. 'transfer order': with its receives posted as
        :func:`~pdcompile.runtime.transfers.transfer_plan` says, the schedule completes under NCCL's
        rules (:func:`~pdcompile.runtime.transfers.check_transfers`), with targets sent or not (with
        virtual stages a step's targets go together at its first forward:
        :func:`~pdcompile.runtime.schedules.transfers.target_window`).
    """
    lay = layout(name, replicas, num_microbatches, num_steps, vertical_sync, virtual_stages=virtual_stages)
    name = lay.name
    ranks = lay.stage_ranks
    placement = ranks if lay.policy.placement is not None else None
    S, T = lay.num_stages, lay.total

    def fail(rule: str, rank: int | None, step: int | None, detail: str) -> ScheduleError:
        return schedule_error(sched, name, rule, rank, step, detail)

    # 1. ranks
    want = set(range(lay.num_ranks))
    if set(sched) != want:
        extra, missing = sorted(set(sched) - want), sorted(want - set(sched))
        raise fail("ranks", None, None, f"expected ranks {sorted(want)} for replicas {list(lay.replicas)}; "
                   f"missing {missing}, unexpected {extra}")
    stages_of = {r: lay.stages_of(r) for r in sched}
    for r in sorted(sched):
        for i, a in enumerate(sched[r]):
            if a.stage not in stages_of[r]:
                raise fail("ranks", r, i, f"{a} is an action of stage {a.stage}, but rank {r} runs stage"
                           f"{'s' if len(stages_of[r]) > 1 else ''} {', '.join(map(str, stages_of[r]))}")
    # each (rank, stage): the indices of its actions on the rank
    views = [(r, s, [i for i, a in enumerate(sched[r]) if a.stage == s]) for r in sorted(sched) for s in stages_of[r]]

    # 2. routing
    for r in sorted(sched):
        for i, a in enumerate(sched[r]):
            if a.microbatch is not None and a.kind is not Kind.WEIGHT_VERSION:
                if not 0 <= a.microbatch < T:
                    raise fail("each forward and backward once", r, i,
                               f"{a}: microbatch {a.microbatch} is outside 0..{T - 1}")
                owner = rank_of(a.stage, a.microbatch, ranks)
                if owner != r:
                    raise fail("round-robin routing", r, i, f"{a} belongs on rank {owner} "
                               f"(replica {a.microbatch} % {lay.replicas[a.stage]} of stage {a.stage})")

    # 3-6. per rank and stage, positions of each microbatch's actions
    for r, s, idx in views:
        pos: dict[tuple[Kind, int], int] = {}
        for i in idx:
            a = sched[r][i]
            if a.microbatch is None or a.kind is Kind.WEIGHT_VERSION:
                continue
            key = (a.kind, a.microbatch)
            if key in pos:
                rule = "each forward and backward once" if a.kind in (Kind.FORWARD, Kind.BACKWARD) \
                    else "send/recv pairs matched"
                raise fail(rule, r, i, f"{a} appears twice (first at step {pos[key]})")
            pos[key] = i
        end = idx[-1] + 1 if idx else 0
        for k in range(T):
            if rank_of(s, k, ranks) != r:
                continue
            for kind in (Kind.FORWARD, Kind.BACKWARD):
                if (kind, k) not in pos:
                    raise fail("each forward and backward once", r, end - 1 if end else None,
                               f"{s}{kind.value}{k} is missing on rank {r}")
            f, b = pos[(Kind.FORWARD, k)], pos[(Kind.BACKWARD, k)]
            pairs = [(Kind.RECV_ACT, s > 0, "before", f), (Kind.SEND_ACT, s < S - 1, "after", f),
                     (Kind.RECV_GRAD, s < S - 1, "before", b), (Kind.SEND_GRAD, s > 0, "after", b)]
            for kind, needed, rel, anchor in pairs:
                at = pos.get((kind, k))
                if needed and at is None:
                    raise fail("send/recv pairs matched", r, anchor, f"{s}{kind.value}{k} is missing on rank {r}")
                if not needed and at is not None:
                    raise fail("send/recv pairs matched", r, at,
                               f"{sched[r][at]} has no peer (stage {s} is the {'first' if s == 0 else 'last'})")
                if at is not None and (at > anchor if rel == "before" else at < anchor):
                    raise fail("send/recv pairs matched", r, at,
                               f"{sched[r][at]} must come {rel} {sched[r][anchor]} (step {anchor})")
            if b < f:
                raise fail("backward after forward", r, b, f"{sched[r][b]} comes before {sched[r][f]} (step {f})")
            w = pos.get((Kind.WEIGHT_GRAD, k))
            if w is None and lay.policy.splits_every_backward:
                raise fail("split backward", r, b, f"{s}W{k} is missing on rank {r}: {name} splits every backward")
            if w is not None:
                _check_split(sched, lay.policy, r, s, k, b, pos.get((Kind.SEND_GRAD, k), b), w, fail)
        last = -1
        for i in idx:
            a = sched[r][i]
            if a.kind is Kind.FORWARD:
                if a.mb < last:
                    raise fail("forward order", r, i, f"{a} after {s}F{last}: forwards must be in increasing order")
                last = a.mb

    _check_local_hand_overs(sched, ranks, fail)

    # 7. in-flight bound
    for r in sorted(sched):
        s, n = stages_of[r][0], 0
        bound = lay.rank_in_flight_bound(r)
        held_bound = lay.rank_held_bound(r)
        split = {(a.stage, a.microbatch) for a in sched[r] if a.kind is Kind.WEIGHT_GRAD}
        held = 0
        for i, a in enumerate(sched[r]):
            n += (a.kind is Kind.FORWARD) - (a.kind is Kind.BACKWARD)
            frees = Kind.WEIGHT_GRAD if (a.stage, a.microbatch) in split else Kind.BACKWARD
            held += (a.kind is Kind.FORWARD) - (a.kind is frees)
            if n > bound:
                raise fail("in-flight bound", r, i, f"{n} microbatches in flight on rank {r}, "
                           f"{name} allows {bound} per replica")
            if lay.policy.splits_every_backward and held > held_bound:
                raise fail("in-flight bound", r, i, f"{held} microbatches' activations held (F done, W not) on "
                           f"stage {s}, {name} allows {held_bound} per replica")

    # 8. steps
    tg_ranks = {r for r in sched if any(a.kind is Kind.TIED_GRADS for a in sched[r])}
    tied = bool(tg_ranks)
    def on(idx: list[int]) -> Callable[[str, int | None, int | None, str], ScheduleError]:
        """``fail`` for a view: its steps are indices into the view's actions ``idx``."""
        return lambda rule, rank, step, detail: fail(rule, rank, None if step is None else idx[step], detail)

    for r, s, idx in views:
        acts, vfail = [sched[r][i] for i in idx], on(idx)
        replicated = lay.replicas[s] > 1
        if tied and r not in tg_ranks:
            raise vfail("steps", r, None, f"rank {r} has no TG but ranks {sorted(tg_ranks)} do")
        n_st, pending = 0, []  # collectives since the last ST
        done_groups_at: list[int] = []
        for i, a in enumerate(acts):
            if a.kind is Kind.ALLREDUCE and not replicated:
                raise vfail("steps", r, i, f"{a}: stage {s} has one replica, nothing to all-reduce")
            if a.kind in (Kind.ALLREDUCE, Kind.TIED_GRADS):
                pending.append(a.kind)
            if a.kind is Kind.STEP:
                wanted = ([Kind.ALLREDUCE] if replicated else []) + ([Kind.TIED_GRADS] if tied else [])
                if pending != wanted:
                    raise vfail("steps", r, i, f"{a} must be preceded by exactly "
                               f"{' '.join(f'{s}{k.value}' for k in wanted) or 'no collective'} since the last step")
                pending = []
                n_st += 1
                done_groups_at.append(i)
            if a.kind is Kind.BACKWARD:
                g = lay.group_of(s, a.mb)
                if n_st != g:
                    raise vfail("steps", r, i, f"{a} belongs to step {g} of stage {s}, but {n_st} steps came before it")
        if pending:
            raise vfail("steps", r, len(acts) - 1, f"{' '.join(k.value for k in pending)} without a following ST")
        if n_st != lay.num_groups(s):
            raise vfail("steps", r, done_groups_at[-1] if done_groups_at else None,
                       f"rank {r} takes {n_st} steps, {name} takes {lay.num_groups(s)}")
        # each ST right after the group's last local backward (only sends/collectives between)
        busy = {lay.group_of(s, a.mb) for a in acts if a.kind is Kind.BACKWARD}
        for g, at in enumerate(done_groups_at):
            if g not in busy:  # a group with no local microbatch: stepped (with zeros) when needed
                continue
            j = at - 1
            while j >= 0 and acts[j].kind in (Kind.SEND_GRAD, Kind.ALLREDUCE, Kind.TIED_GRADS, Kind.STEP,
                                              Kind.WEIGHT_VERSION, Kind.RECV_ACT, Kind.RECV_GRAD,
                                              Kind.WEIGHT_GRAD):
                j -= 1
            if j >= 0 and acts[j].kind is not Kind.BACKWARD:
                raise vfail("steps", r, at, f"step {g} of rank {r} comes after {acts[j]}: a step follows "
                           f"its group's last backward directly")

    # 9. weight versions
    expected = expected_versions(lay, sched)
    for r, s, idx in views:
        acts, vfail = [sched[r][i] for i in idx], on(idx)
        current = n_st = 0
        for i, a in enumerate(acts):
            if a.kind is Kind.STEP:
                n_st += 1
            elif a.kind is Kind.WEIGHT_VERSION:
                if a.wv < current:
                    raise vfail("weight versions", r, i, f"{a} goes back from version {current}")
                if a.wv > n_st:
                    raise vfail("weight versions", r, i, f"{a}: version {a.wv} does not exist yet "
                               f"({n_st} steps so far)")
                current = a.wv
            elif a.kind is Kind.FORWARD:
                want_v = expected[(s, a.mb)]
                if current != want_v:
                    raise vfail("weight versions", r, i, f"{a} uses weight version {current}, {name}"
                               f"{' with vertical sync' if lay.vertical_sync else ''} defines version {want_v}")

    # 10. no deadlock
    replay(sched, lay.replicas, name=name, placement=placement)

    # 11. transfer order
    posts = transfer_plan(sched, lay.replicas, placement)
    for targets in (None, (), range(lay.replicas[-1])):  # all sent, none (--targets local), the first only
        check_transfers(sched, lay.replicas, posts, targets=targets, name=name, placement=placement)


def check_global_steps(name: str, replicas: Sequence[int], num_microbatches: int, *, tied: bool = False,
                       vertical_sync: bool = False, split_backward: bool = False, virtual_stages: int = 1,
                       num_steps: int | None = None) -> None:
    """Whether schedule ``name`` can make every ``ST`` a collective over all ranks, as global-norm
    clipping does (the k-th ``ST`` of every rank all-reduces the squared norms of the gradients each
    stage is about to apply); a :class:`UsageError` saying why not otherwise.

    Two conditions. (1) Every stage's k-th update holds the same microbatches
    (:meth:`~.policy.Layout.group_of` is one function of the microbatch on every stage), so the
    k-th ``ST`` of every rank is one update of the whole model: true of the synchronous schedules
    and 2BW (a step's ``M`` microbatches), and of 1F1B exactly when every stage has the same
    number of replicas (an update per ``r`` microbatches, the replicas' summed); with different
    counts the stages take different numbers of steps. (2) The schedule completes with ``ST`` a
    collective: :func:`replay` and :func:`check_transfers` (with the receives posted where
    :func:`transfer_plan` puts them, targets sent, none or the first only) with
    ``step_collective``. Why (2) holds for 1F1B and 2BW: a rank's actions before its k-th ``ST``
    are forwards admitted by the in-flight bound and backwards of updates ``<= k``; a backward
    waits only for the next stage's backward of the same microbatch, which comes before that
    rank's k-th ``ST``, and a forward only for the previous stage's forward of that microbatch,
    which that stage (admitting at least as many in flight, ``warmup_depth`` non-increasing)
    ran before its own backward of the update's last microbatch; so no rank waits across another
    rank's k-th ``ST``. The replay checks it on ``num_steps`` steps (default: past the warm-up
    and two repeating periods, as :func:`~.periodic.rank_run` reads them)."""
    lay = layout(name, replicas, num_microbatches, 1, vertical_sync, split_backward, virtual_stages)
    if lay.policy.placement is not None:
        raise UsageError(f"{name}: a rank steps each of its stages at its own point of the step, so no one point "
                         f"sees every stage's gradients (global-norm clipping needs one stage per rank)")
    reps = lay.replicas
    if num_steps is None:
        unit = math.lcm(*(r // math.gcd(lay.num_microbatches, r) for r in reps))
        num_steps = 2 + math.ceil(2 * sum(reps) / lay.num_microbatches) + 2 * unit
    lay = layout(name, reps, num_microbatches, num_steps, vertical_sync, split_backward, virtual_stages)
    groups = [[lay.group_of(s, n) for n in range(lay.total)] for s in range(lay.num_stages)]
    for s in range(1, lay.num_stages):
        if groups[s] != groups[0]:
            n = next(n for n in range(lay.total) if groups[s][n] != groups[0][n])
            raise UsageError(
                f"{name} on replicas {list(reps)}: stage 0 updates once per {reps[0]} microbatch(es) (its "
                f"replicas step together) and stage {s} once per {reps[s]}, so the stages take different numbers "
                f"of steps (microbatch {n} is in stage 0's update {groups[0][n]}, stage {s}'s {groups[s][n]}) and "
                f"no update has every stage's gradients for a global norm; give every stage the same number of "
                f"replicas, or use 2bw or a synchronous schedule")
    sched = make_schedule(name, reps, num_microbatches, tied=tied, vertical_sync=vertical_sync, num_steps=num_steps,
                          split_backward=split_backward, virtual_stages=virtual_stages)
    try:
        replay(sched, reps, name=name, step_collective=True)
        posts = transfer_plan(sched, reps)
        for targets in (None, (), range(reps[-1])):
            check_transfers(sched, reps, posts, targets=targets, name=name, step_collective=True)
    except ScheduleError as e:
        raise UsageError(f"{name} on replicas {list(reps)}: with every step a collective over all ranks "
                         f"(global-norm clipping) the schedule would deadlock: {e}") from None
