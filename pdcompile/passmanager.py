"""The pass runner: runs passes in order, lints after each, names the failing pass, dumps the IR.

With ``dump_dir`` (or the environment variable ``PDCOMPILE_DUMP=dir``) it writes
``NN_<pass>.txt`` after every pass: a header naming the pass that made it and how long it took,
then the pass's view of the IR (the graph with annotations, the chain, the plan, the stages...).
Without either, no dump is formatted during the compile: each :class:`PassRecord` keeps the state
the pass made and formats its dump the first time it is read (``dump_ir``). Some dumps cost far more
than their pass (the schedule's lays out every rank's run), so a compile never pays for one it does
not print.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from pdcompile.errors import PassError, PdcompileError
from pdcompile.ir import CompileState


@dataclass(frozen=True)
class Pass:
    """A named function from one CompileState to the next, and how to print its result."""

    name: str  # spelled like the file: "split-stages" <-> passes/split_stages.py
    run: Callable[[CompileState], CompileState]
    dump: Callable[[CompileState], str]


@dataclass(frozen=True)
class PassRecord:
    """What one pass did: its name, its time, and its IR dump, formatted on first read (``dump``)
    from the state it made."""

    name: str
    seconds: float
    state: CompileState = field(repr=False, compare=False)
    formatter: Callable[[CompileState], str] = field(repr=False, compare=False)

    @cached_property
    def dump(self) -> str:
        """The pass's view of the IR, as ``NN_<pass>.txt`` shows it below its header."""
        return self.formatter(self.state)


def lint(state: CompileState) -> None:
    """Structural checks after every pass (fx's graph lint on every graph present)."""
    if state.gm is not None:
        state.gm.graph.lint()
    if state.stages is not None:
        for st in state.stages.stages:
            st.gm.graph.lint()


def run_passes(passes: Sequence[Pass], state: CompileState, dump_dir: str | os.PathLike[str] | None = None,
               start_index: int = 0) -> tuple[CompileState, list[PassRecord]]:
    """Run ``passes`` in order; return the final state and a record (time, dump) per pass. Dumps are
    formatted here only for ``dump_dir`` (or ``PDCOMPILE_DUMP``); otherwise when a record's ``dump`` is read."""
    dump_dir = dump_dir or os.environ.get("PDCOMPILE_DUMP") or None
    records: list[PassRecord] = []
    for i, p in enumerate(passes):
        t0 = time.perf_counter()
        try:
            state = p.run(state)
            lint(state)
        except PdcompileError as e:
            raise type(e)(f"[{p.name} pass] {e}") from e
        except Exception as e:  # noqa: BLE001 - name the pass and those before it
            before = [q.name for q in passes[:i]]
            raise PassError(
                f"An error occurred when running the {p.name!r} pass after the following passes: "
                f"{before}: {_cause(e)}"
            ) from e
        dt = time.perf_counter() - t0
        record = PassRecord(p.name, dt, state, p.dump)
        records.append(record)
        if dump_dir:  # formatted now, from the state as this pass left it
            write_dump(dump_dir, start_index + i, p.name, dt, record.dump)
    return state, records


def _cause(e: BaseException) -> str:
    """The innermost cause of ``e`` (fx and ShapeProp wrap the user's error) as one line."""
    while e.__cause__ is not None:
        e = e.__cause__
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def dump_header(name: str, seconds: float) -> str:
    return f"# Constructed by {name} (took {seconds * 1000:.0f} ms)\n"


def write_dump(dump_dir: str | os.PathLike[str], index: int, name: str, seconds: float, text: str) -> Path:
    d = Path(dump_dir)
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{index:02d}_{name}.txt"
    path.write_text(dump_header(name, seconds) + text.rstrip() + "\n")
    return path
