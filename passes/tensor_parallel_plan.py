"""The ``tensor-parallel`` pass's plain data: the option (:func:`degrees_of`: one degree, one per stage, or
``"auto"``), each stage's split (:class:`StageTP`) and the plan of every stage's (:class:`TensorParallelPlan`),
as plan.json and the IR dump show them; passes/tensor_parallel.py decides them. Stages may have degrees of
their own: each pipeline rank is then a block of its stage's ``t`` processes (``runtime/tensor_parallel.py``
``RankLayout``), which :func:`rank_degrees` checks a plan's ranks can be.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pdcompile.errors import UsageError


@dataclass(frozen=True)
class TensorParallelOptions:
    degrees: tuple[int, ...] | int | str = 1  # one degree for every stage, one per stage, or "auto": the plan's


@dataclass(frozen=True)
class StageTP:
    """One stage's split: its degree, the modules ``ColwiseParallel`` and ``RowwiseParallel`` take,
    the column linears whose rows are interleaved per chunk, what stays whole and why, and the graph
    nodes whose sizes became local."""

    degree: int
    colwise: tuple[str, ...] = ()
    rowwise: tuple[str, ...] = ()
    fused: tuple[tuple[str, int], ...] = ()  # column module -> equal chunks its output is split into
    whole: tuple[str, ...] = ()  # "name: why" of each linear left whole
    rewritten: tuple[str, ...] = ()  # "node: old -> new" of each size made local
    embeddings: tuple[str, ...] = ()  # embeddings split by vocabulary (RowwiseParallel)
    head: str | None = None  # the LM head split by vocabulary, into a loss-parallel cross-entropy

    def to_json(self) -> dict[str, Any]:
        return {"degree": self.degree, "colwise": list(self.colwise), "rowwise": list(self.rowwise),
                "fused": {m: k for m, k in self.fused}, "whole": list(self.whole),
                "embeddings": list(self.embeddings), "head": self.head}

    def __str__(self) -> str:
        lines = [f"tensor parallel t={self.degree}: {len(self.colwise)} column and {len(self.rowwise)} row linears"]
        lines += [f"  column {m}" + (f" (fused: {dict(self.fused)[m]} chunks)" if m in dict(self.fused) else "")
                  for m in self.colwise]
        lines += [f"  row    {m}" for m in self.rowwise]
        lines += [f"  vocab  {m} (embedding: rows split by vocabulary)" for m in self.embeddings]
        if self.head is not None:
            lines.append(f"  vocab  {self.head} (LM head: split by vocabulary into a loss-parallel cross-entropy)")
        lines += [f"  whole  {w}" for w in self.whole]
        lines += [f"  local  {r}" for r in self.rewritten]
        return "\n".join(lines)


@dataclass(frozen=True)
class TensorParallelPlan:
    """Every stage's :class:`StageTP` (degree 1: nothing split)."""

    stages: tuple[StageTP, ...]

    @property
    def degrees(self) -> tuple[int, ...]:
        return tuple(s.degree for s in self.stages)

    def to_json(self) -> dict[str, Any]:
        return {"stages": [s.to_json() for s in self.stages]}

    def __str__(self) -> str:
        return "\n".join(f"stage {k}: {s}" for k, s in enumerate(self.stages))


def degrees_of(option: Any, num_stages: int | None) -> tuple[int, ...] | int | str:
    """The checked ``tensor_parallel=`` option: an int for every stage, one per stage (with ``stages=`` as many),
    or ``"auto"`` (the planner chooses one degree for every stage, where it chooses the stages)."""
    if option == "auto":
        if num_stages is not None:
            raise UsageError(f"tensor_parallel='auto' is the planner's choice, which stages={num_stages} leaves out; "
                             f"give the degree (e.g. tensor_parallel=2, or one per stage), or leave stages= to the "
                             f"planner")
        return "auto"
    if isinstance(option, int) and not isinstance(option, bool):
        if option < 1:
            raise UsageError(f"tensor_parallel={option}: must be a positive int, e.g. 2")
        return option
    if isinstance(option, (list, tuple)) and option and all(isinstance(d, int) and not isinstance(d, bool)
                                                            and d >= 1 for d in option):
        if num_stages is None:
            raise UsageError(f"tensor_parallel={list(option)} gives a degree per stage, which needs stages= as "
                             f"many (stages={len(option)}); or give one degree for all")
        if len(option) != num_stages:
            raise UsageError(f"tensor_parallel={list(option)} names {len(option)} stages, but stages={num_stages}; "
                             f"give one degree per stage")
        return option[0] if len(set(option)) == 1 else tuple(option)
    raise UsageError(f"tensor_parallel={option!r}: give a positive int (every stage), or a list of one per stage")


def rank_degrees(stage_ranks: Sequence[Sequence[int]], degrees: Sequence[int]) -> None:
    """Refuses degrees a rank layout can't run (``runtime/tensor_parallel.py`` ``RankLayout``): a pipeline rank
    holding several stages (virtual stages) runs them all at one degree."""
    held: dict[int, tuple[int, int]] = {}
    for s, (ranks, t) in enumerate(zip(stage_ranks, degrees)):
        for q in ranks:
            if q in held and held[q][1] != t:
                raise UsageError(f"tensor_parallel={list(degrees)}: rank {q} runs stages {held[q][0]} and {s}, "
                                 f"whose degrees differ ({held[q][1]} and {t}); with virtual stages give one degree "
                                 f"for all")
            held.setdefault(q, (s, t))
