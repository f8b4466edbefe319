"""torch.distributed.pipelining's schedule CSV, compute only: one row per rank, one cell per action
(``0F0``: stage 0 forwards microbatch 0; ``1I2``/``1W2``: input and weight halves of a split
backward; ``3B0``: a full backward; ``(0F3;3B1)OVERLAP_F_B``: a forward and a backward overlapped,
run here one after the other; an empty cell: a bubble). :func:`read_csv` turns one into our
schedule (transfers and updates added, validated), :func:`write_csv` ours into one. Pure data."""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import io
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pdcompile.errors import ScheduleError, UsageError
from pdcompile.runtime.schedules.actions import Action, Kind, Schedule, shift, stages_of_rank
from pdcompile.runtime.schedules.blocks import expand_compute
from pdcompile.runtime.schedules.policy import Layout, Policy
from pdcompile.runtime.schedules.validate import validate

_CELL = re.compile(r"^(\d+)([FIWB])(\d+)$")
_OVERLAP = re.compile(r"^\((.*)\)OVERLAP_F_B$")


@dataclass(frozen=True)
class Cell:
    """Where a compute action stands in the CSV: ``rank`` (its row, 0-based) and ``column`` (0-based,
    empty cells counted), with the cell's text."""

    rank: int
    column: int
    text: str

    def __str__(self) -> str:
        return f"row {self.rank + 1} (rank {self.rank}), column {self.column + 1} ({self.text!r})"


def _text(source: str | os.PathLike[str]) -> str:
    """A CSV's text: ``source`` itself, or the file it names (a path, or a string naming a file)."""
    if isinstance(source, os.PathLike) or ("\n" not in source and "," not in source and os.path.isfile(source)):
        return Path(source).read_text()
    return source


def parse_cells(text: str) -> dict[int, list[tuple[str, Cell]]]:
    """Per rank (row), its compute actions in torch's notation (``'0F0'``, ``'1I2'``; an overlapped
    pair as its two parts, forward first), each with its :class:`Cell`; empty cells left out."""
    out: dict[int, list[tuple[str, Cell]]] = {}
    for r, row in enumerate(csv.reader(io.StringIO(text))):
        out[r] = []
        for c, raw in enumerate(row):
            cell = Cell(r, c, raw.strip())
            m = _OVERLAP.match(cell.text)
            parts = [x.strip() for x in m.group(1).split(";")] if m else [cell.text] if cell.text else []
            for part in parts:
                if not _CELL.match(part):
                    raise ScheduleError(f"torch CSV {cell}: {part!r} is not a compute action (stage, F/I/W/B, "
                                        f"microbatch, e.g. '0F0'); only compute-only CSVs are read")
                out[r].append((part, cell))
    return out


def _ops(cells: dict[int, list[tuple[str, Cell]]]) -> dict[int, list[tuple[Action, Cell]]]:
    """Our compute actions per rank: F -> F, I -> B (split: its W follows), B -> B (unsplit), W -> W;
    an I with no W, or a W of a full backward, refused (rule 'split backward')."""
    out: dict[int, list[tuple[Action, Cell]]] = {}
    for r, items in cells.items():
        kinds: dict[tuple[int, int], str] = {}
        for text, cell in items:
            m = _CELL.match(text)
            assert m is not None  # parse_cells checked it
            s, kind, k = int(m.group(1)), m.group(2), int(m.group(3))
            if kind == "W" and kinds.get((s, k)) != "I":
                raise ScheduleError(f"torch CSV {cell}: rule 'split backward' broken: {text} has no {s}I{k} before "
                                    f"it on rank {r} (a W follows the input half I of its backward)")
            kinds[(s, k)] = kind
            out.setdefault(r, []).append((Action(s, {"F": Kind.FORWARD, "I": Kind.BACKWARD, "B": Kind.BACKWARD,
                                                     "W": Kind.WEIGHT_GRAD}[kind], k), cell))
        for (s, k), kind in kinds.items():
            if kind == "I":
                cell = next(c for t, c in items if t == f"{s}I{k}")
                raise ScheduleError(f"torch CSV {cell}: rule 'split backward' broken: {s}I{k} has no {s}W{k} after "
                                    f"it on rank {r} (its weight gradients would never be computed)")
    return out


def csv_placement(ops: dict[int, list[tuple[Action, Cell]]]) -> list[list[int]]:
    """Ranks of each stage, read off the rows (torch infers it likewise): every stage on one rank,
    stages ``0 .. S-1`` all present."""
    where: dict[int, tuple[int, Cell]] = {}
    for r, items in ops.items():
        for a, cell in items:
            if where.setdefault(a.stage, (r, cell))[0] != r:
                raise ScheduleError(f"torch CSV {cell}: rule 'ranks' broken: stage {a.stage} is on rank "
                                    f"{where[a.stage][0]} too ({where[a.stage][1]}); a stage runs on one rank")
    missing = sorted(set(range(max(where, default=-1) + 1)) - set(where))
    if not where or missing:
        raise ScheduleError(f"torch CSV: rule 'ranks' broken: no actions of stage{'s' if len(missing) > 1 else ''} "
                            f"{', '.join(map(str, missing)) or '0'}")
    return [[where[s][0]] for s in range(len(where))]


def _no_order(lay: Layout, stage: int, replica: int, tied: bool) -> list[Action]:
    raise UsageError("a torch CSV's schedule is read (read_csv), not generated")


def csv_policy(placement: Sequence[Sequence[int]]) -> Policy:
    """The policy a CSV's schedule is validated by when it names no registered one: synchronous (one
    update per step), stages placed as the CSV puts them, any backward split where the CSV splits
    it, at most a step's microbatches in flight (the CSV's own memory, whatever it is)."""
    fixed = [list(rs) for rs in placement]

    def place(num_stages: int, virtual_stages: int) -> list[list[int]]:
        if num_stages != len(fixed):
            raise UsageError(f"the CSV has {len(fixed)} stages, not {num_stages}")
        return [list(rs) for rs in fixed]

    return Policy("torch-csv", _no_order, update_per_microbatch=False, version_lag=0, holds_step=True,
                  split_backward=True, vertical_sync=False, synchronous=True, order_splits=True, placement=place,
                  summary="a schedule read from torch.distributed.pipelining's CSV (compute only)")


def _origins(acts: list[Action], cells: list[Cell]) -> list[Cell]:
    """For each of a rank's actions, the CSV cell it comes from: a compute action's own, a receive
    the next compute's, a send or an update the compute before it."""
    computes = [i for i, a in enumerate(acts) if a.kind in (Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT_GRAD)]
    own = dict(zip(computes, cells))
    out: list[Cell] = []
    for i, a in enumerate(acts):
        if i in own:
            out.append(own[i])
        elif a.kind in (Kind.RECV_ACT, Kind.RECV_GRAD):
            out.append(own[min(j for j in computes if j > i)])
        else:
            out.append(own[max(j for j in computes if j < i)])
    return out


def read_csv(source: str | os.PathLike[str], *, schedule: str | None = None) -> Schedule:
    """Our schedule (one step) from torch's compute-only CSV (text, or a file): per rank its actions,
    each F/B in its transfers (``RF``/``SF``, ``RB``/``SB``), an ``I`` as our ``B`` with its ``W``
    where the CSV puts it, a ``B`` unsplit, an overlapped F&B as the F then the B, each stage's
    ``ST`` after its last B/W. Validated as ``schedule`` (a registered name; stages must be where it
    places them) or else by :func:`csv_policy`; a broken rule raises :class:`ScheduleError` naming
    the rule and the CSV cell (row, column) it concerns."""
    ops = _ops(parse_cells(_text(source)))
    placement = csv_placement(ops)
    S, R = len(placement), len(ops)
    if S % R or any(len(stages_of_rank(r, placement)) != S // R for r in range(R)):
        raise ScheduleError(f"torch CSV: rule 'ranks' broken: {S} stages on {R} ranks, not the same number on each "
                            f"(stages per rank: {[len(stages_of_rank(r, placement)) for r in range(R)]})")
    sched = {r: expand_compute([a for a, _ in items], S) for r, items in ops.items()}
    m = len({a.mb for a, _ in ops[placement[0][0]] if a.stage == 0 and a.kind is Kind.FORWARD})
    try:
        validate(sched, [1] * S, m, schedule if schedule is not None else csv_policy(placement),
                 virtual_stages=S // R)
    except ScheduleError as e:
        if e.rank is None or e.step is None or e.rank not in sched:
            raise
        cell = _origins(sched[e.rank], [c for _, c in ops[e.rank]])[e.step]
        err = ScheduleError(f"torch CSV {cell}: rule '{e.rule}' broken ({sched[e.rank][e.step]} in our "
                            f"actions for it): {e}")
        err.rule, err.rank, err.step = e.rule, e.rank, e.step
        raise err from None
    except UsageError as e:
        raise ScheduleError(f"torch CSV: does not fit schedule {schedule!r}: {e}") from None
    return sched


def _torch_cell(a: Action, split: set[tuple[int, int]]) -> str:
    if a.kind is Kind.BACKWARD:
        return f"{a.stage}{'I' if (a.stage, a.mb) in split else 'B'}{a.mb}"
    return str(a)


def write_csv(sched: Schedule) -> str:
    """torch's compute-only CSV of ``sched`` (one step, one replica per stage, untied): per rank its
    F, B (``I`` where a W of it follows, else ``B``) and W in order, as torch's ``_dump_csv`` writes
    rows (``csv.writer``, ``\\r\\n``)."""
    buf = io.StringIO()
    writer = csv.writer(buf)
    for r in sorted(sched):
        acts = sched[r]
        steps = [a.stage for a in acts if a.kind is Kind.STEP]
        if len(steps) != len(set(steps)):
            raise UsageError(f"rank {r} steps a stage more than once: torch's CSV holds one step")
        for a in acts:
            if a.kind in (Kind.ALLREDUCE, Kind.TIED_GRADS, Kind.WEIGHT_VERSION):
                raise UsageError(f"rank {r}'s {a}: torch's CSV has no replicated stages, tied weights or weight "
                                 f"versions (it holds one synchronous step)")
        split = {(a.stage, a.mb) for a in acts if a.kind is Kind.WEIGHT_GRAD}
        writer.writerow([_torch_cell(a, split) for a in acts
                         if a.kind in (Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT_GRAD)])
    return buf.getvalue()


CSV_PREFIX = "torch-csv-"  # a registered CSV's schedule name: the prefix and its text's hash


def csv_name(text: str) -> str:
    """The schedule name a CSV's text is registered under (:func:`register_csv`): stable across
    processes, so the compiler and train.py agree on it."""
    return CSV_PREFIX + hashlib.sha1(text.encode()).hexdigest()[:10]


def register_csv(source: str | os.PathLike[str]) -> str:
    """Make a torch CSV a schedule like the built-in ones (validated once, then generated by name
    for any number of steps: its one step repeated, microbatches shifted), registered in
    :data:`~.registry.POLICIES` as :func:`csv_name`; returns the name. Its stages per rank and
    microbatches per step are the CSV's (:func:`csv_shape`)."""
    from pdcompile.runtime.schedules.registry import POLICIES

    text = _text(source)
    name = csv_name(text)
    if name in POLICIES:
        return name
    read_csv(text)  # refuses a CSV that does not validate, naming the rule and the cell
    cells = _ops(parse_cells(text))
    ops = {r: [a for a, _ in items] for r, items in cells.items()}
    placement = csv_placement(cells)
    S, m = len(placement), _microbatches(ops, placement)
    rank_of_first = {min(stages_of_rank(r, placement)): r for r in ops}

    def order(lay: Layout, stage: int, replica: int, tied: bool) -> list[Action]:
        if lay.num_microbatches != m or lay.num_stages != S:
            raise UsageError(f"the torch CSV {name} runs {S} stages and {m} microbatches per step, not "
                             f"{lay.num_stages} and {lay.num_microbatches}")
        step = expand_compute(ops[rank_of_first[stage]], S, tied)
        return [shift(a, t * m) for t in range(lay.num_steps) for a in step]

    base = csv_policy(placement)
    POLICIES[name] = dataclasses.replace(base, name=name, order=order, planner_model="flush",
                                         placement=base.placement if S > len(ops) else None,
                                         summary=f"torch CSV ({S} stages on {len(ops)} ranks, {m} microbatches "
                                                 f"per step), run as written, one update per step")
    return name


def csv_shape(source: str | os.PathLike[str]) -> tuple[int, int, int]:
    """(stages, ranks, microbatches per step) of a torch CSV."""
    ops = _ops(parse_cells(_text(source)))
    placement = csv_placement(ops)
    return len(placement), len(ops), _microbatches({r: [a for a, _ in it] for r, it in ops.items()}, placement)


def _microbatches(ops: dict[int, list[Action]], placement: Sequence[Sequence[int]]) -> int:
    return len({a.mb for a in ops[placement[0][0]] if a.stage == 0 and a.kind is Kind.FORWARD})
