"""The schedule IR: an action per step of a rank, its compact text form, and rank routing.

An action prints as ``{stage}{kind}{number}``: ``1F3`` (stage 1, forward of microbatch 3), ``0SF1``
/ ``1RF1`` (activations of microbatch 1 sent / received), ``1SB1`` / ``0RB1`` (gradients back),
``0AR`` (all-reduce among the stage's replicas), ``0TG`` (sum gradients of tied parameters),
``0ST`` (optimizer step), ``0WV2`` (later forwards use weight version 2), ``1W3`` (weight gradients
of a split backward). :meth:`Action.from_str` and :func:`parse_grid` read every printed form back.
Microbatch ``k`` of stage ``s`` runs on replica ``k % r_s`` (:func:`rank_of`), on both sides of
every transfer, so transfers name no peer. Ranks per stage are consecutive unless a placement
(ranks per stage, :func:`stage_ranks`) puts several stages on one rank (virtual stages).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from pdcompile.errors import ScheduleError, UsageError


class Kind(str, Enum):
    FORWARD = "F"
    BACKWARD = "B"
    SEND_ACT = "SF"
    RECV_ACT = "RF"
    SEND_GRAD = "SB"
    RECV_GRAD = "RB"
    ALLREDUCE = "AR"
    TIED_GRADS = "TG"
    STEP = "ST"
    WEIGHT_VERSION = "WV"
    WEIGHT_GRAD = "W"

    def __str__(self) -> str:
        return self.value


NEEDS_MICROBATCH = frozenset({Kind.FORWARD, Kind.BACKWARD, Kind.SEND_ACT, Kind.RECV_ACT, Kind.SEND_GRAD,
                              Kind.RECV_GRAD, Kind.WEIGHT_GRAD})
COMPUTE = (Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT_GRAD, Kind.STEP)
_ACTION_RE = re.compile(r"^(\d+)(SF|RF|SB|RB|AR|TG|ST|WV|F|B|W)(\d+)?$")


@dataclass(frozen=True)
class Action:
    """One step of one rank: ``stage`` is the pipeline stage, ``microbatch`` the global index (for
    F, B, W and transfers), ``version`` the weight version (for ``WV`` only)."""

    stage: int
    kind: Kind
    microbatch: int | None = None
    version: int | None = None

    def __post_init__(self) -> None:
        if (self.kind in NEEDS_MICROBATCH) != (self.microbatch is not None):
            raise ValueError(f"action {self.kind.value} {'needs' if self.kind in NEEDS_MICROBATCH else 'takes no'} "
                             f"microbatch")
        if (self.kind is Kind.WEIGHT_VERSION) != (self.version is not None):
            raise ValueError(f"action {self.kind.value} {'needs' if self.kind is Kind.WEIGHT_VERSION else 'takes no'} "
                             f"version")

    @property
    def mb(self) -> int:
        """The microbatch, for actions that have one (a typed accessor: raises otherwise)."""
        if self.microbatch is None:
            raise ValueError(f"{self} has no microbatch")
        return self.microbatch

    @property
    def wv(self) -> int:
        """The weight version of a ``WV`` (a typed accessor: raises for other actions)."""
        if self.version is None:
            raise ValueError(f"{self} is not a weight-version action")
        return self.version

    def __str__(self) -> str:
        n = self.microbatch if self.version is None else self.version
        return f"{self.stage}{self.kind.value}{'' if n is None else n}"

    @staticmethod
    def from_str(text: str) -> Action:
        m = _ACTION_RE.match(text.strip())
        if not m:
            raise ValueError(f"not an action: {text!r} (expected e.g. '1F3', '0SB2', '0ST', '0WV1')")
        stage, kind, n = m.groups()
        try:
            k = Kind(kind)
            number = None if n is None else int(n)
            if k is Kind.WEIGHT_VERSION:
                return Action(int(stage), k, version=number)
            return Action(int(stage), k, number)
        except ValueError as e:
            raise ValueError(f"not an action: {text!r} ({e})") from None


Schedule = dict[int, list[Action]]  # rank -> ordered actions


def shift(a: Action, microbatches: int, versions: int = 0) -> Action:
    """``a`` renumbered ``microbatches`` later (a ``WV`` moves ``versions`` later instead): a later
    copy of a repeating period, or a segment's actions in the run's global numbering.

    >>> [str(shift(Action.from_str(x), 4)) for x in ("0WV1", "0F0", "0ST")]
    ['0WV1', '0F4', '0ST']
    """
    if a.version is not None:
        return Action(a.stage, a.kind, version=a.version + versions) if versions else a
    if a.microbatch is None or not microbatches:
        return a
    return Action(a.stage, a.kind, a.microbatch + microbatches)


# ------------------------------------------------------------------------------------------------
# ranks and routing


Placement = Sequence[Sequence[int]]  # stage -> its ranks (replica i of stage s on placement[s][i])


def stage_ranks(replicas: Sequence[int], placement: Placement | None = None) -> list[list[int]]:
    """Ranks of each stage: ``placement`` when given (checked against ``replicas``: ``r_s`` distinct
    ranks for stage ``s``, together ranks ``0 .. n-1``; a rank may hold several stages), else
    consecutive, stage by stage (``[2, 1]`` -> ``[[0, 1], [2]]``)."""
    out: list[list[int]] = []
    nxt = 0
    for s, r in enumerate(replicas):
        if int(r) != r or r < 1:
            raise UsageError(f"replicas of stage {s} must be a positive integer, got {r!r}")
        out.append(list(range(nxt, nxt + int(r))))
        nxt += int(r)
    if not out:
        raise UsageError("a schedule needs at least one stage (replicas is empty)")
    if placement is None:
        return out
    placed = [[int(q) for q in rs] for rs in placement]
    used = {q for rs in placed for q in rs}
    if (len(placed) != len(out) or any(len(rs) != len(set(rs)) or len(rs) != len(o) for rs, o in zip(placed, out))
            or used != set(range(len(used)))):
        raise UsageError(f"placement {placed} does not fit replicas {list(replicas)}: stage s needs r_s distinct "
                         f"ranks, all ranks 0..n-1 used")
    return placed


def stages_of_rank(rank: int, stage_ranks: Sequence[Sequence[int]]) -> list[int]:
    """The stages that ``rank`` runs, in increasing order (one unless stages are virtual)."""
    return [s for s, ranks in enumerate(stage_ranks) if rank in ranks]


def rank_of(stage: int, microbatch: int, stage_ranks: Sequence[Sequence[int]]) -> int:
    """The rank that processes ``microbatch`` on ``stage``: replica ``microbatch % r`` (round-robin)."""
    ranks = stage_ranks[stage]
    return ranks[microbatch % len(ranks)]


def segment_rank(rank: int, first_microbatch: int, stage_ranks: Sequence[Sequence[int]]) -> int:
    """The rank whose list, in a schedule numbered from microbatch 0, ``rank`` runs in a segment of a
    run that starts at global microbatch ``first_microbatch`` (after a flush: an evaluation, a
    checkpoint, a resume). Microbatch ``k`` runs on replica ``k % r`` across the whole run (the data
    shares, the executor's peers), so where ``first_microbatch % r != 0`` the rotation continues:
    replica ``i`` takes the list of replica ``(i - first_microbatch) % r``, whose local microbatch
    ``j`` is global ``first_microbatch + j`` on replica ``i``. Every rank renumbering alike, the
    segment is the schedule from 0 with each stage's ranks rotated: the same transfers, pair by pair.

    >>> [segment_rank(q, 3, [[0, 1], [2]]) for q in (0, 1, 2)]
    [1, 0, 2]
    """
    mine = [rs for rs in stage_ranks if rank in rs]
    if all(len(rs) == 1 for rs in mine):
        return rank
    if len(mine) > 1:  # a placement holds one replica per stage (registry.layout refuses others)
        raise ValueError(f"rank {rank} holds several stages, some replicated: {list(map(list, stage_ranks))}")
    ranks = list(mine[0])
    return ranks[(ranks.index(rank) - first_microbatch) % len(ranks)]


def stage_of_rank(rank: int, stage_ranks: Sequence[Sequence[int]]) -> int:
    """The stage that ``rank`` runs (its first, with virtual stages)."""
    for s, ranks in enumerate(stage_ranks):
        if rank in ranks:
            return s
    raise UsageError(f"rank {rank} is in no stage (ranks per stage: {list(map(list, stage_ranks))})")


# ------------------------------------------------------------------------------------------------
# printing and parsing


def format_grid(sched: Schedule, compute_only: bool = True) -> str:
    """A rank x step grid (one row per rank); with ``compute_only`` only F/B/W/ST are shown."""
    rows = {}
    for rank, acts in sorted(sched.items()):
        shown = [a for a in acts if not compute_only or a.kind in COMPUTE]
        rows[rank] = [str(a) for a in shown]
    width = max((len(c) for r in rows.values() for c in r), default=2)
    return "\n".join(f"rank {rank}: {' '.join(c.ljust(width) for c in cells)}".rstrip() for rank, cells in rows.items())


_ROW_RE = re.compile(r"^rank (\d+):(.*)$")


def parse_grid(text: str) -> Schedule:
    """Parse :func:`format_grid`'s output back into a schedule.

    Blank lines and lines starting with whitespace (annotations such as ``<-- ERROR HERE``) are
    skipped; any other line must be ``rank N: action action ...``.
    """
    sched: Schedule = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line[0].isspace():
            continue
        m = _ROW_RE.match(line.rstrip())
        if not m:
            raise ValueError(f"line {lineno}: expected 'rank N: actions...', got {line!r}")
        rank = int(m.group(1))
        if rank in sched:
            raise ValueError(f"line {lineno}: rank {rank} appears twice")
        try:
            sched[rank] = [Action.from_str(c) for c in m.group(2).split()]
        except ValueError as e:
            raise ValueError(f"line {lineno}: {e}") from None
    return sched


def grid_with_marker(sched: Schedule, rank: int | None, step: int | None) -> str:
    """The full grid; below ``rank``'s row a caret under action ``step`` and ``<-- ERROR HERE``."""
    ranks = sorted(sched)
    cells = {r: [str(a) for a in sched[r]] for r in ranks}
    width = max((len(c) for cs in cells.values() for c in cs), default=2)
    lines = []
    for r in ranks:
        prefix = f"rank {r}: "
        lines.append((prefix + " ".join(c.ljust(width) for c in cells[r])).rstrip())
        if r == rank and step is not None:
            col = len(prefix) + step * (width + 1)
            lines.append(" " * col + "^" * width + f" <-- ERROR HERE (rank {r}, step {step})")
    return "\n".join(lines)


def schedule_error(sched: Schedule, name: str, rule: str, rank: int | None, step: int | None,
                   detail: str) -> ScheduleError:
    """A :class:`ScheduleError` naming the rule, where, and the grid with the place marked."""
    where = "" if rank is None else f" at rank {rank}" + ("" if step is None else f", step {step}")
    err = ScheduleError(f"schedule {name!r} breaks rule '{rule}'{where}: {detail}\n"
                        f"{grid_with_marker(sched, rank, step)}")
    err.rule, err.rank, err.step = rule, rank, step
    return err
