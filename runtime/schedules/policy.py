"""What a schedule is, as one object that the generator, validate, the simulator, the planner,
the runtime and the reference all read: its :class:`Policy`. A :class:`Layout` is a policy with
its parameters (replicas, microbatches, steps), answering the questions they share."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pdcompile.runtime.schedules.actions import Action, stage_ranks, stages_of_rank


def warmup_depth(replicas: Sequence[int], stage: int) -> int:
    """PipeDream's in-flight bound per replica of ``stage``: ``ceil(workers from stage on / r_stage)``.

    For the input stage this is NOAM = ``ceil(workers / r_0)``; with one replica per stage it is
    ``S - stage``. (PipeDream's runtime: ``num_warmup_minibatches + 1``.)
    """
    return math.ceil(sum(replicas[stage:]) / replicas[stage])


Order = Callable[["Layout", int, int, bool], list[Action]]  # (layout, stage, replica, tied) -> F/B/... actions
Place = Callable[[int, int], list[list[int]]]  # (num_stages, virtual_stages) -> ranks per stage


@dataclass(frozen=True)
class Policy:
    """One schedule's rules.

    * ``order``: the F/B/transfer/step actions of one rank (no ``WV``; versions are placed after).
    * ``update_per_microbatch``: every microbatch is a minibatch with its own update (PipeDream
      1F1B; a replicated stage's replicas step together per ``r_s`` microbatches); else one update
      per ``M`` microbatches (gradient accumulation).
    * ``version_lag``: a forward of update group ``g`` uses weight version ``g - lag`` (0: the
      synchronous schedules; 1: 2BW's delayed update); None: the newest version when it starts
      (weight stashing).
    * ``holds_step``: a replica keeps all its microbatches of a step in flight (GPipe); else at most
      :func:`warmup_depth`.
    * ``split_backward``: may split a backward into ``B`` (input gradients) and ``W`` (no versions).
    * ``vertical_sync``: has the vertical-sync variant.
    * ``synchronous``: trains exactly single-process SGD with accumulation (the planner's model and
      equality tests rely on it).
    * ``splits_every_backward``: every backward on every stage is split, its ``W`` placed by the
      order (zero bubble); activations are held until the ``W`` (see :meth:`held`).
    * ``planner_model``: the schedule whose memory model the partitioners apply (None: this one).
    * ``placement``: stage -> ranks when a rank holds several (virtual) stages (interleaved: stage
      ``s`` on rank ``s % p``); ``order`` then gets the rank's first stage and builds all its
      stages' actions. None: consecutive ranks, one stage each. The runtime runs each of a rank's
      stages with its own executor (``RankExecutor``).
    * ``rank_in_flight``: the most microbatches in flight on a rank over all its stages (None: the
      sum of its stages' :meth:`in_flight`).
    * ``rank_held``: likewise the most held (F done, W not, where backwards are split; None: the sum
      of its stages' :meth:`held`).
    * ``order_splits``: the order itself splits the backwards it chooses, on any stage (DualPipeV,
      a torch CSV); validate then takes a ``W`` wherever it follows its ``B``.
    """

    name: str
    order: Order
    update_per_microbatch: bool
    version_lag: int | None
    holds_step: bool
    split_backward: bool
    vertical_sync: bool
    synchronous: bool
    summary: str
    splits_every_backward: bool = False
    planner_model: str | None = None
    placement: Place | None = None
    rank_in_flight: Callable[["Layout", int], int] | None = None
    rank_held: Callable[["Layout", int], int] | None = None
    order_splits: bool = False

    @property
    def virtual_stages(self) -> bool:
        """Whether a rank may hold several stages (the runtime runs one executor per stage there)."""
        return self.placement is not None

    def accumulation(self, num_microbatches: int) -> int:
        """Backward passes one update sums (the loss is scaled by 1/this)."""
        return 1 if self.update_per_microbatch else num_microbatches

    def minibatches_done(self, steps: int, num_microbatches: int, replicas: int, minibatches: int) -> int:
        """Of a run of ``minibatches`` minibatches (``M`` microbatches each), how many are complete once a
        replica of a stage of ``replicas`` replicas has taken ``steps`` optimizer steps (the runtime logs
        each minibatch when it is): one step a minibatch, or under an update per microbatch one step a
        round of ``replicas`` microbatches (the replicas' gradients summed), so M / r steps a minibatch,
        or several minibatches a step where r > M."""
        if not self.update_per_microbatch:
            return min(steps, minibatches)
        return min(steps * replicas, minibatches * num_microbatches) // num_microbatches

    def weight_versions(self, replicas: Sequence[int], stage: int) -> int:
        """The most weight versions a replica of ``stage`` keeps (memory: weights x this)."""
        if self.version_lag == 0:
            return 1
        if self.version_lag is not None:
            return self.version_lag + 1
        return warmup_depth(replicas, stage)

    def in_flight(self, replicas: Sequence[int], stage: int, num_microbatches: int) -> int:
        """The most microbatches whose activations a replica of ``stage`` keeps at once."""
        if self.holds_step:
            return -(-num_microbatches // replicas[stage])
        return warmup_depth(replicas, stage)

    def held(self, replicas: Sequence[int], stage: int, num_microbatches: int) -> int:
        """The most microbatches whose activations a replica of ``stage`` holds at once: F done and
        B not, or, when every backward is split, W not (1F1B's peak over all stages, the ZB paper's
        memory bound)."""
        if self.splits_every_backward:
            return max(self.in_flight(replicas, s, num_microbatches) for s in range(len(replicas)))
        return self.in_flight(replicas, stage, num_microbatches)


@dataclass(frozen=True)
class Layout:
    """A policy with its parameters: what one schedule instance promises."""

    policy: Policy
    replicas: tuple[int, ...]
    num_microbatches: int
    num_steps: int
    vertical_sync: bool = False
    split_backward: bool = False
    virtual_stages: int = 1

    @property
    def name(self) -> str:
        return self.policy.name

    @property
    def stage_ranks(self) -> list[list[int]]:
        """Ranks of each stage: the policy's placement, else consecutive."""
        place = self.policy.placement
        return stage_ranks(self.replicas, None if place is None else place(self.num_stages, self.virtual_stages))

    @property
    def num_ranks(self) -> int:
        return 1 + max(q for rs in self.stage_ranks for q in rs)

    def stages_of(self, rank: int) -> list[int]:
        return stages_of_rank(rank, self.stage_ranks)

    def rank_in_flight_bound(self, rank: int) -> int:
        """The most microbatches in flight on ``rank`` over all its stages."""
        if self.policy.rank_in_flight is not None:
            return self.policy.rank_in_flight(self, rank)
        return sum(self.in_flight_bound(s) for s in self.stages_of(rank))

    def rank_held_bound(self, rank: int) -> int:
        """The most microbatches held (F done, W not) on ``rank`` over all its stages."""
        if self.policy.rank_held is not None:
            return self.policy.rank_held(self, rank)
        return sum(self.held_bound(s) for s in self.stages_of(rank))

    @property
    def num_stages(self) -> int:
        return len(self.replicas)

    @property
    def total(self) -> int:
        return self.num_microbatches * self.num_steps

    def group_of(self, stage: int, mb: int) -> int:
        """The update (0-based, per rank) whose gradient ``mb`` contributes to on ``stage``."""
        if self.policy.update_per_microbatch:
            return mb // self.replicas[stage]
        return mb // self.num_microbatches

    def num_groups(self, stage: int) -> int:
        if self.policy.update_per_microbatch:
            return -(-self.total // self.replicas[stage])
        return self.num_steps

    def required_steps(self, stage: int, mb: int) -> int:
        """How many ``ST`` must precede ``F mb`` on its rank (the version it uses must exist)."""
        lag = self.policy.version_lag
        return 0 if lag is None else max(0, self.group_of(stage, mb) - lag)

    def in_flight_bound(self, stage: int) -> int:
        return self.policy.in_flight(self.replicas, stage, self.num_microbatches)

    def held_bound(self, stage: int) -> int:
        return self.policy.held(self.replicas, stage, self.num_microbatches)
