"""Edits that break a generated schedule on purpose (validate's tests)."""

from __future__ import annotations

from pdcompile.runtime.schedules import Action


def move(acts: list[Action], what: str, before: str | None) -> list[Action]:
    """``acts`` with ``what`` taken out and put before ``before`` (None: dropped)."""
    a = Action.from_str(what)
    out = [x for x in acts if x != a]
    if before is None:
        return out
    i = [str(x) for x in out].index(before)
    return out[:i] + [a] + out[i:]
