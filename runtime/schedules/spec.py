"""A schedule as the compiler made it: the policy's name and every parameter, enough to rebuild
the exact action lists. plan.json carries it, with a check of a short run that the runtime must
rebuild exactly: a digest of every rank's action list, and the lists themselves for the first
few ranks (to read, and as older plan.json files carried them all). Its size grows by one short
digest per rank, so at a thousand ranks a rank's start-up reads and checks kilobytes, not every
rank's actions. train.py runs it."""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from pdcompile.errors import UsageError
from pdcompile.runtime.schedules.actions import Action, Schedule, stage_ranks
from pdcompile.runtime.schedules.generate import make_schedule
from pdcompile.runtime.schedules.periodic import RankRun, rank_run
from pdcompile.runtime.schedules.registry import layout, policy
from pdcompile.runtime.schedules.torch_csv import csv_name, register_csv
from pdcompile.runtime.schedules.versions import update_delays

CHECK_STEPS = 2  # the run whose action lists plan.json checks
CHECK_TEXT_RANKS = 16  # plan.json spells out the check run's action lists of ranks 0 .. this - 1


@dataclass(frozen=True)
class ScheduleSpec:
    """Policy ``name`` on ``replicas`` with ``num_microbatches`` per step and its options."""

    name: str
    replicas: tuple[int, ...]
    num_microbatches: int
    tied: bool = False
    vertical_sync: bool = False
    split_backward: bool = True
    virtual_stages: int = 1  # stages per rank (a schedule with a placement: interleaved, V-shapes)
    csv: str | None = None  # a torch CSV's text, for a schedule read from one (its name: torch_csv.csv_name)

    def __post_init__(self) -> None:
        if self.csv is not None and register_csv(self.csv) != self.name:
            raise UsageError(f"schedule {self.name!r} is not the torch CSV it carries ({csv_name(self.csv)})")
        pol = policy(self.name)  # checks the name
        layout(self.name, self.replicas, self.num_microbatches, 1, virtual_stages=self.virtual_stages)
        object.__setattr__(self, "vertical_sync", self.vertical_sync and pol.vertical_sync)
        object.__setattr__(self, "split_backward", self.split_backward and pol.split_backward)

    def __str__(self) -> str:
        opts = [o for o, on in (("tied", self.tied), ("vertical sync", self.vertical_sync),
                                ("split backward", self.split_backward),
                                (f"{self.virtual_stages} stages per rank", self.virtual_stages > 1)) if on]
        return (f"{self.name} on replicas {list(self.replicas)}, {self.num_microbatches} microbatches per step"
                + (f" ({', '.join(opts)})" if opts else ""))

    def make(self, num_steps: int, ranks: Collection[int] | None = None) -> Schedule:
        """Every rank's actions for ``num_steps`` steps (``ranks``: only those ranks', built alone)."""
        return make_schedule(self.name, self.replicas, self.num_microbatches, tied=self.tied,
                             vertical_sync=self.vertical_sync, num_steps=num_steps, split_backward=self.split_backward,
                             virtual_stages=self.virtual_stages, ranks=ranks)

    @property
    def stage_ranks(self) -> list[list[int]]:
        """Ranks of each stage (the policy's placement with virtual stages)."""
        return layout(self.name, self.replicas, self.num_microbatches, 1,
                      virtual_stages=self.virtual_stages).stage_ranks

    @property
    def world_size(self) -> int:
        return 1 + max(q for rs in self.stage_ranks for q in rs)

    def rank_run(self, num_steps: int, rank: int) -> RankRun:
        """One rank's actions for a run of any length (:func:`~.periodic.rank_run`)."""
        return rank_run(self.name, self.replicas, self.num_microbatches, num_steps, rank, tied=self.tied,
                        vertical_sync=self.vertical_sync, split_backward=self.split_backward,
                        virtual_stages=self.virtual_stages)

    def to_json(self) -> dict[str, Any]:
        check = self.make(CHECK_STEPS)
        texts = {r: actions_text(acts) for r, acts in sorted(check.items())}
        return {"policy": self.name, "replicas": list(self.replicas), "num_microbatches": self.num_microbatches,
                "tied": self.tied, "vertical_sync": self.vertical_sync, "split_backward": self.split_backward,
                "virtual_stages": self.virtual_stages, **({"csv": self.csv} if self.csv is not None else {}),
                "check": {"steps": CHECK_STEPS,
                          "digests": {str(r): digest(t) for r, t in texts.items()},
                          "ranks": {str(r): t for r, t in texts.items() if r < CHECK_TEXT_RANKS}}}

    @staticmethod
    def from_json(raw: dict[str, Any]) -> ScheduleSpec:
        try:
            return ScheduleSpec(str(raw["policy"]), tuple(int(r) for r in raw["replicas"]),
                                int(raw["num_microbatches"]), bool(raw.get("tied", False)),
                                bool(raw.get("vertical_sync", False)), bool(raw.get("split_backward", True)),
                                int(raw.get("virtual_stages", 1)), raw.get("csv"))
        except (KeyError, TypeError, ValueError) as e:
            raise UsageError(f"plan.json: the schedule entry is malformed ({type(e).__name__}: {e}); "
                             f"re-emit the program with this pdcompile") from None


def stage_delays(spec: ScheduleSpec, ranks: Collection[int] | None = None) -> dict[int, int]:
    """Stage -> its delay in optimizer steps, read off the compiled schedule itself
    (:func:`~.versions.update_delays`, the steady state's): of every stage, or of the stages ``ranks``
    hold. Enough steps are built for every replica's warm-up to end (one rank's list alone where a
    rank holds one stage; the first replica of each stage stands for its others)."""
    lay = layout(spec.name, spec.replicas, spec.num_microbatches, 1, virtual_stages=spec.virtual_stages)
    placed = lay.stage_ranks
    wanted = {s for s, rs in enumerate(placed) if ranks is None or set(rs) & set(ranks)}
    readers = {s: (rs[0] if ranks is None else min(set(rs) & set(ranks))) for s, rs in enumerate(placed) if s in wanted}
    depth = max(lay.rank_in_flight_bound(r) for r in set(readers.values()))
    steps = max(2, -(-(3 * depth + 2 * lay.num_ranks) // spec.num_microbatches) + 1)
    built = spec.make(steps, ranks=None if spec.virtual_stages > 1 else sorted(set(readers.values())))
    return {s: max(update_delays(built[r], s if spec.virtual_stages > 1 else None), default=0)
            for s, r in sorted(readers.items())}


def actions_text(acts: Sequence[Action]) -> str:
    """A rank's action list as plan.json spells it: the actions' text forms, space-separated."""
    return " ".join(map(str, acts))


def digest(text: str) -> str:
    """plan.json's digest of one rank's :func:`actions_text` (the first 16 hex digits of its SHA-256)."""
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def checked_lists(raw: dict[str, Any]) -> dict[int, list[Action]]:
    """The action lists plan.json spells out for its check run (the first ranks'; an older plan.json's
    every rank's), parsed."""
    return {int(r): [Action.from_str(x) for x in text.split()] for r, text in raw["check"].get("ranks", {}).items()}


def agrees(spec: ScheduleSpec, raw: dict[str, Any], rank: int) -> bool:
    """Whether this runtime rebuilds, for ``rank``, the very actions the compiler wrote: the rank's
    list for the check run equals the text plan.json spells out for it, where it does, and has the
    digest plan.json gives it, where it gives one (an older plan.json has every rank's text and no
    digests). Only this rank's list is built (``make_schedule(ranks=...)``) and read."""
    check = raw["check"]
    text, want = check.get("ranks", {}).get(str(rank)), check.get("digests", {}).get(str(rank))
    if text is None and want is None:
        return False
    mine = actions_text(spec.make(int(check["steps"]), ranks=(rank,))[rank])
    return (text is None or mine == text) and (want is None or digest(mine) == want)


def default_split_backward(device_type: str, processes: int, cores: int) -> bool:
    """Whether to split the drain's backwards: yes, unless CPU workers share cores. A split
    backward's weight pass overlaps the stage before's backward only on a free core (and the
    simulator, which gives every rank its own core, then predicts it too fast)."""
    return device_type != "cpu" or processes <= cores
