"""The action blocks every schedule is made of: a forward with its transfers, a backward with its
transfers, an update with its collectives."""

from __future__ import annotations

from pdcompile.runtime.schedules.actions import Action, Kind


def forward(stage: int, num_stages: int, mb: int) -> list[Action]:
    acts = []
    if stage > 0:
        acts.append(Action(stage, Kind.RECV_ACT, mb))
    acts.append(Action(stage, Kind.FORWARD, mb))
    if stage < num_stages - 1:
        acts.append(Action(stage, Kind.SEND_ACT, mb))
    return acts


def backward(stage: int, num_stages: int, mb: int) -> list[Action]:
    acts = []
    if stage < num_stages - 1:
        acts.append(Action(stage, Kind.RECV_GRAD, mb))
    acts.append(Action(stage, Kind.BACKWARD, mb))
    if stage > 0:
        acts.append(Action(stage, Kind.SEND_GRAD, mb))
    return acts


def update(stage: int, replicated: bool, tied: bool) -> list[Action]:
    acts = []
    if replicated:
        acts.append(Action(stage, Kind.ALLREDUCE))
    if tied:
        acts.append(Action(stage, Kind.TIED_GRADS))
    acts.append(Action(stage, Kind.STEP))
    return acts


def split_last_backward(acts: list[Action], stage: int) -> None:
    """Append ``W`` for the backward just sent (``SB``), splitting it (the drain's last backward)."""
    if stage > 0 and acts and acts[-1].kind is Kind.SEND_GRAD:
        acts.append(Action(stage, Kind.WEIGHT_GRAD, acts[-1].microbatch))


class Updates:
    """Appends a rank's updates (``AR``/``TG``/``ST``) to ``acts`` up to a number of groups, splitting
    the backward just before each update when the layout splits backwards."""

    def __init__(self, acts: list[Action], stage: int, replicated: bool, tied: bool, split: bool) -> None:
        self.acts, self.stage, self.replicated, self.tied, self.split = acts, stage, replicated, tied, split
        self.done = 0

    def upto(self, groups: int) -> None:
        while self.done < groups:
            if self.split:
                split_last_backward(self.acts, self.stage)
            self.acts.extend(update(self.stage, self.replicated, self.tied))
            self.done += 1


def expand_compute(ops: list[Action], num_stages: int, tied: bool = False) -> list[Action]:
    """One step of one rank from its compute order alone (``F``/``B``/``W``, as torch's CSV gives
    it): each ``F``/``B`` in its block with its transfers (:func:`forward`, :func:`backward`), each
    ``W`` as it stands, and each stage's update (one replica) right after the stage's last
    ``B``/``W`` of the step; with ``tied`` weights every stage's ``TG ST`` at the end of the step
    (the runtime sums a rank's tied gradients once, when all its stages are done)."""
    last = {} if tied else {a.stage: i for i, a in enumerate(ops) if a.kind in (Kind.BACKWARD, Kind.WEIGHT_GRAD)}
    acts: list[Action] = []
    for i, a in enumerate(ops):
        if a.kind is Kind.FORWARD:
            acts += forward(a.stage, num_stages, a.mb)
        elif a.kind is Kind.BACKWARD:
            acts += backward(a.stage, num_stages, a.mb)
        elif a.kind is Kind.WEIGHT_GRAD:
            acts.append(a)
        else:
            raise ValueError(f"{a} is not a compute action (F, B or W)")
        if last.get(a.stage) == i:
            acts += update(a.stage, False, False)
    if tied:
        acts += [b for s in sorted({a.stage for a in ops}) for b in update(s, False, True)]
    return acts
