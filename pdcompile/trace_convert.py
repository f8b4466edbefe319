"""Read the runtime's measured action timeline (``--trace DIR``) into timeline Events.

The emitted program's ``train.py --trace DIR`` writes ``DIR/rank_R.events.json`` on every rank: a
list of ``{"rank", "name", "start_s", "end_s"[, "origin_s"]}``, one per action (``1F3``), times in
seconds from that rank's start of training (``origin_s``: that start on the machine's monotonic
clock; without it ranks are read from 0 each). The runtime imports only torch and the standard
library, so it writes these plain events; this module turns them into
:class:`pdcompile.timeline.Event` s for :func:`~pdcompile.timeline.write_chrome_trace` and
:func:`~pdcompile.timeline.plot_timeline` (measured under predicted).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from pdcompile.errors import UsageError
from pdcompile.timeline import Event, category_of, write_chrome_trace

__all__ = ["read_runtime_events", "runtime_trace_to_chrome", "microbatch_of", "select_microbatches"]

_MB_RE = re.compile(r"^\d+(SF|RF|SB|RB|F|B|W)(\d+)$")


def _files(source: str | os.PathLike[str] | Iterable[str | os.PathLike[str]]) -> list[Path]:
    if isinstance(source, (str, os.PathLike)):
        p = Path(source)
        if p.is_dir():
            files = sorted(p.glob("rank_*.events.json"), key=lambda f: int(re.sub(r"\D", "", f.name) or 0))
            if not files:
                raise UsageError(f"{p}: no rank_R.events.json files; run the program with --trace {p}")
            return files
        if not p.exists():
            raise UsageError(f"{p}: no such file or folder; give the folder passed to train.py --trace")
        return [p]
    return [Path(f) for f in source]


def read_runtime_events(source: str | os.PathLike[str] | Iterable[str | os.PathLike[str]], *,
                        drop_versions: bool = True) -> list[Event]:
    """The measured events of a run: ``source`` is the ``--trace`` folder or ``rank_R.events.json`` files.

    Ranks are aligned on the shared monotonic clock when every file records ``origin_s``; the
    earliest event then starts at 0. ``WV`` (weight-version switches, bookkeeping) are dropped unless
    ``drop_versions=False``. Raises :class:`~pdcompile.errors.UsageError` naming the file when one
    is not a runtime events file.
    """
    rows: list[tuple[int, str, float, float, float]] = []
    for f in _files(source):
        try:
            data = json.loads(f.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise UsageError(f"{f}: not a runtime events file ({e}); expected train.py --trace output") from None
        if not isinstance(data, list):
            raise UsageError(f"{f}: expected a JSON list of events (train.py --trace output)")
        for i, d in enumerate(data):
            try:
                rows.append((int(d["rank"]), str(d["name"]), float(d["start_s"]), float(d["end_s"]),
                             float(d["origin_s"]) if "origin_s" in d else float("nan")))
            except (KeyError, TypeError, ValueError) as e:
                raise UsageError(f"{f}: event {i} lacks rank/name/start_s/end_s ({e!r})") from None
    aligned = bool(rows) and all(r[4] == r[4] for r in rows)  # no NaN: every event has an origin
    base = min(r[4] for r in rows) if aligned else 0.0
    out = []
    for rank, name, s, end, origin in rows:
        cat = category_of(name)
        if drop_versions and cat == "version":
            continue
        off = origin - base if aligned else 0.0
        out.append(Event(rank, name, s + off, end + off, cat))
    t0 = min((e.start_s for e in out), default=0.0)
    return sorted((e._replace(start_s=e.start_s - t0, end_s=e.end_s - t0) for e in out),
                  key=lambda e: (e.start_s, e.rank, e.end_s))


def microbatch_of(name: str) -> int | None:
    """The microbatch an action works on (``1F3`` -> 3), or None (``0ST``, ``0AR``, ``0WV2``)."""
    m = _MB_RE.match(name)
    return int(m.group(2)) if m else None


def select_microbatches(events: Sequence[Event], first: int, last: int) -> list[Event]:
    """The events of microbatches ``first..last`` and, per rank, the step/all-reduce actions between them.

    Used to cut one or two steps out of a long measured run to lay beside a simulated one. Times
    are shifted so the selection starts at 0.
    """
    picked: list[Event] = []
    by_rank: dict[int, list[Event]] = {}
    for e in sorted(events, key=lambda e: (e.start_s, e.end_s)):
        by_rank.setdefault(e.rank, []).append(e)
    for evs in by_rank.values():
        inside = False
        for e in evs:
            mb = microbatch_of(e.name)
            if mb is not None:
                if first <= mb <= last:
                    inside = True
                    picked.append(e)
                elif mb > last:
                    inside = False
            elif inside:
                picked.append(e)
    t0 = min((e.start_s for e in picked), default=0.0)
    return [e._replace(start_s=e.start_s - t0, end_s=e.end_s - t0) for e in picked]


def runtime_trace_to_chrome(source: str | os.PathLike[str], out: str | os.PathLike[str], *,
                            metadata: dict[str, Any] | None = None) -> list[Event]:
    """Write the run's ``--trace`` folder as one Chrome/Perfetto ``trace.json``; return its events."""
    events = read_runtime_events(source)
    write_chrome_trace(events, out, process_name="pdcompile runtime (measured)", metadata=metadata)
    return events
