"""Callables the emitted program's ranks run (``lr_scheduler=``, ``eval_metric=``, ``data=``): by name where
they import back, else by value.

A module-level function (or ``functools.partial`` of one with plain keyword arguments) goes into plan.json
as ``MODULE:QUALNAME``, readable, and the ranks import it. A lambda, a closure, a function defined in
``__main__`` (a script, a notebook) or anything else that does not import back to itself is serialized by
value with cloudpickle (as Ray and Dask ship functions) into ``NAME.pkl`` beside plan.json, which then
names that file and says why in one line (``by_value``); the ranks read it with :mod:`pickle`
(``runtime/program.py`` ``load_callable``). What neither way can carry (a callable holding an open file,
a lock, a socket) is a :class:`~pdcompile.errors.UsageError` naming the object and the fix.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

from pdcompile.errors import UsageError
from pdcompile.runtime.program import PICKLED, import_object


@dataclass(frozen=True)
class ForRanks:
    """How the ranks get one callable: ``factory`` is ``MODULE:QUALNAME`` (by name) or ``NAME.pkl`` beside
    plan.json holding ``payload`` (by value), called with ``kwargs`` after its own arguments."""

    factory: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    payload: bytes | None = None  # cloudpickle's bytes, written as ``factory`` in the program folder
    note: str | None = None  # one line: what was serialized by value, and why

    def spec(self) -> dict[str, Any]:
        """plan.json's entry: ``{"factory", "kwargs"}``, and ``"by_value"`` (the note) for a pickled one."""
        out: dict[str, Any] = {"factory": self.factory, "kwargs": dict(self.kwargs)}
        if self.note is not None:
            out["by_value"] = self.note
        return out


def _plain(v: Any) -> bool:
    """A keyword value plan.json can hold as it is: None, bool, int, float, str, or lists/tuples of them."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return True
    return isinstance(v, (list, tuple)) and all(_plain(x) for x in v)


def why_not_by_name(fn: Any) -> str | None:
    """None if ``fn`` imports back to itself as ``MODULE:QUALNAME``; else why it does not (a phrase)."""
    mod, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if not mod or not name:
        return f"a {type(fn).__name__} object has no module-level name"
    if name == "<lambda>" or name.endswith(".<lambda>"):
        return "a lambda has no name to import"
    if "<locals>" in name:
        return "a function defined inside another function has no name to import"
    if mod == "__main__":
        return "a function defined in __main__ (a script or notebook) can't be imported by other processes"
    try:
        same = import_object(f"{mod}:{name}") is fn
    except (ImportError, AttributeError):
        same = False
    return None if same else f"{mod}:{name} does not import back to it"


def label(fn: Any) -> str:
    """A short readable name for messages: ``<lambda> (train.py:12)``, ``warmup``, ``partial(f)``."""
    if isinstance(fn, functools.partial):
        return f"partial({label(fn.func)})"
    code = getattr(fn, "__code__", None)
    name = getattr(fn, "__name__", None) or type(fn).__name__
    if code is not None:
        from pathlib import Path

        return f"{name} ({Path(code.co_filename).name}:{code.co_firstlineno})"
    return str(name)


def for_ranks(fn: Any, what: str, *, keywords: bool = True) -> ForRanks:
    """How the ranks get ``fn`` (the option ``what``, e.g. ``"lr_scheduler"``): by name if it imports back
    (``keywords``: also a ``functools.partial`` of such a function with plain keyword arguments), else by
    value with cloudpickle into ``{what}.pkl``. Neither: a :class:`UsageError` naming why and the fix."""
    if not callable(fn):
        raise UsageError(f"{what}= must be callable, got {type(fn).__name__}")
    target, kwargs = fn, {}
    if keywords and isinstance(fn, functools.partial) and not fn.args and all(_plain(v) for v in fn.keywords.values()):
        target, kwargs = fn.func, dict(fn.keywords)
    why = why_not_by_name(target)
    if why is None:
        return ForRanks(f"{target.__module__}:{target.__qualname__}", kwargs)
    return ForRanks(f"{what}{PICKLED}", {}, pickled(fn, what, why),
                    f"{what}={label(fn)} is serialized by value with cloudpickle into {what}{PICKLED} ({why})")


def pickled(fn: Any, what: str, why: str) -> bytes:
    """cloudpickle's bytes of ``fn`` (by value, with what it closes over); a :class:`UsageError` naming the
    object it can't carry otherwise."""
    import cloudpickle

    try:
        return bytes(cloudpickle.dumps(fn))
    except Exception as e:  # noqa: BLE001 - pickling raises TypeError, PicklingError, AttributeError, ...
        cause = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UsageError(f"{what}={label(fn)}: the emitted program's ranks can't import it ({why}) and cloudpickle "
                         f"can't serialize it by value ({cause}); fix: don't capture that object in it (create it "
                         f"inside the function), or define the function at the top level of an importable "
                         f"module") from None


def check(fn: Any, what: str, *, keywords: bool = True) -> None:
    """Refuse, up front, a callable :func:`for_ranks` can't carry to the ranks (the option ``what``)."""
    for_ranks(fn, what, keywords=keywords)
