"""Timelines of a pipeline step: Chrome/Perfetto traces and a PNG, predicted above measured.

Both the simulator (predicted) and the runtime (measured) describe a run as a list of
:class:`Event` ``(rank, name, start_s, end_s, category)``: one per action, named like the action
(``1F3``), times in seconds from any origin. :func:`write_chrome_trace` writes ``trace.json`` for
``chrome://tracing`` or https://ui.perfetto.dev (one row per rank, plus a ``comm`` row under it
for transfers that overlap compute); :func:`plot_timeline` draws the predicted and the measured
timeline one above the other (matplotlib, imported only there).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple


class Event(NamedTuple):
    """One slice of a timeline: ``rank`` ran ``name`` from ``start_s`` to ``end_s`` (seconds).

    ``category`` is one of :data:`CATEGORIES` (others are drawn grey). ``transfer`` slices are
    time on a link (a send in flight), drawn on the rank's ``comm`` row, not its compute row.
    """

    rank: int
    name: str
    start_s: float
    end_s: float
    category: str


# category -> (colour, label); the order is the legend's.
CATEGORIES: dict[str, tuple[str, str]] = {
    "forward": ("#4C72B0", "forward"),
    "backward": ("#55A868", "backward"),
    "step": ("#8172B2", "optimizer step"),
    "allreduce": ("#C44E52", "all-reduce (replicas)"),
    "tied": ("#DA8BC3", "tied gradients"),
    "send": ("#CCB974", "send"),
    "recv": ("#BBBBBB", "waiting to receive"),
    "transfer": ("#DD8452", "transfer on link"),
}
COMM_CATEGORIES = frozenset({"transfer"})
_US = 1e6
_KIND_CATEGORY = {"F": "forward", "B": "backward", "ST": "step", "AR": "allreduce", "TG": "tied", "SF": "send",
                  "SB": "send", "RF": "recv", "RB": "recv", "WV": "version", "W": "backward"}
_NAME_RE = re.compile(r"^\d+(SF|RF|SB|RB|AR|TG|ST|WV|F|B|W)\d*$")


def category_of(name: str) -> str:
    """The category of an action named like ``1F3`` / ``0SB2`` / ``0AR`` (``"other"`` if not one)."""
    m = _NAME_RE.match(name)
    return _KIND_CATEGORY[m.group(1)] if m else "other"


def _as_events(events: Iterable[Any]) -> list[Event]:
    """Events from ``Event``s or plain tuples ``(rank, name, start_s, end_s[, category])``."""
    out = []
    for e in events:
        if not isinstance(e, Event):
            t = tuple(e)
            e = Event(*t) if len(t) == 5 else Event(t[0], t[1], t[2], t[3], category_of(t[1]))
        out.append(e)
    return out


def chrome_trace(events: Iterable[Event | tuple], *, process_name: str = "pdcompile",
                 metadata: dict[str, Any] | None = None) -> dict[str, Any]:
    """The Chrome trace-event JSON object for ``events`` (see :func:`write_chrome_trace`)."""
    events = _as_events(events)
    t0 = min((e.start_s for e in events), default=0.0)
    out: list[dict[str, Any]] = []
    ranks = sorted({e.rank for e in events})
    comm_ranks = sorted({e.rank for e in events if e.category in COMM_CATEGORIES})
    for r in ranks:
        out.append({"ph": "M", "name": "process_name", "pid": r, "tid": 0, "args": {"name": f"rank {r}"}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": r, "tid": 0, "args": {"sort_index": r}})
        out.append({"ph": "M", "name": "thread_name", "pid": r, "tid": 0, "args": {"name": "compute"}})
    for r in comm_ranks:
        out.append({"ph": "M", "name": "thread_name", "pid": r, "tid": 1, "args": {"name": "comm"}})
    for e in sorted(events, key=lambda e: (e.rank, e.start_s, e.end_s)):
        out.append({
            "name": e.name, "cat": e.category, "ph": "X", "pid": e.rank,
            "tid": 1 if e.category in COMM_CATEGORIES else 0,
            "ts": round((e.start_s - t0) * _US, 3), "dur": round(max(0.0, e.end_s - e.start_s) * _US, 3),
        })
    other = {"generator": process_name, **(metadata or {})}
    return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": other}


def write_chrome_trace(events: Iterable[Event | tuple], path: str | os.PathLike[str], *, process_name: str = "pdcompile",
                       metadata: dict[str, Any] | None = None) -> None:
    """Write ``events`` as a Chrome/Perfetto trace: one process row per rank, one slice per action.

    Times are shifted so the earliest event starts at 0. ``metadata`` lands in ``otherData``
    (e.g. the schedule and the predicted step time). Events may be plain tuples
    ``(rank, name, start_s, end_s[, category])``; without a category it comes from the name
    (:func:`category_of`).
    """
    with open(path, "w") as f:
        json.dump(chrome_trace(events, process_name=process_name, metadata=metadata), f, indent=0)
        f.write("\n")


def read_chrome_trace(path: str | os.PathLike[str]) -> list[Event]:
    """Read back what :func:`write_chrome_trace` wrote (times relative to the first event)."""
    with open(path) as f:
        data = json.load(f)
    return [Event(int(e["pid"]), e["name"], e["ts"] / _US, (e["ts"] + e["dur"]) / _US, e.get("cat", ""))
            for e in data["traceEvents"] if e.get("ph") == "X"]


def time_by_category(events: Iterable[Event | tuple]) -> dict[int, dict[str, float]]:
    """Rank -> category -> seconds its actions took (link time, ``transfer``, is not a rank's).

    >>> time_by_category([(0, "0F0", 0.0, 1.0), (0, "0B0", 1.0, 3.0), (1, "1RF0", 0.0, 0.5)])
    {0: {'forward': 1.0, 'backward': 2.0}, 1: {'recv': 0.5}}
    """
    out: dict[int, dict[str, float]] = {}
    for e in _as_events(events):
        if e.category in COMM_CATEGORIES:
            continue
        per = out.setdefault(e.rank, {})
        per[e.category] = per.get(e.category, 0.0) + float(e.end_s - e.start_s)
    return out


def _time_unit(span_s: float) -> tuple[float, str]:
    if span_s >= 10:
        return 1.0, "s"
    if span_s >= 10e-3:
        return 1e3, "ms"
    return 1e6, "µs"


def plot_timeline(predicted_events: Sequence[Event | tuple], measured_events: Sequence[Event | tuple] | None,
                  path: str | os.PathLike[str], *, title: str | None = None,
                  labels: tuple[str, str] = ("predicted", "measured")) -> None:
    """Draw the predicted timeline (and the measured one below it, on the same time axis) to a PNG.

    Ranks are rows (rank 0 on top), each action a bar coloured by category and labelled with its
    name when wide enough; transfers are thin bars under the rank's row. Each timeline starts at
    its own first event.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    panels = [(labels[0], _as_events(predicted_events))]
    if measured_events is not None:
        panels.append((labels[1], _as_events(measured_events)))
    spans = []
    for _, evs in panels:
        t0 = min((e.start_s for e in evs), default=0.0)
        spans.append(max((e.end_s for e in evs), default=0.0) - t0)
    scale, unit = _time_unit(max(spans, default=0.0) or 1.0)
    heights = [max(1, len({e.rank for e in evs})) + 1 for _, evs in panels]
    fig, axes = plt.subplots(len(panels), 1, figsize=(14, 1.4 + 0.5 * sum(heights)), sharex=True, squeeze=False,
                             gridspec_kw={"height_ratios": heights}, layout="constrained")
    used: set[str] = set()
    xmax = max(spans, default=0.0) * scale or 1.0
    char = xmax * 0.0042  # width of one label character at fontsize 7 on a 14-inch axis
    for ax, (label, evs), span in zip(axes[:, 0], panels, spans):
        t0 = min((e.start_s for e in evs), default=0.0)
        ranks = sorted({e.rank for e in evs})
        row = {r: i for i, r in enumerate(ranks)}
        for e in evs:
            x0, w = (e.start_s - t0) * scale, (e.end_s - e.start_s) * scale
            if w <= 0:
                continue
            colour = CATEGORIES.get(e.category, ("#999999", e.category))[0]
            used.add(e.category)
            if e.category in COMM_CATEGORIES:
                ax.barh(row[e.rank] + 0.42, w, left=x0, height=0.14, color=colour, edgecolor="none")
            elif e.category == "recv":  # waiting: a thin light bar, so compute stands out
                ax.barh(row[e.rank], w, left=x0, height=0.2, color=colour, edgecolor="none")
            else:
                ax.barh(row[e.rank], w, left=x0, height=0.66, color=colour, edgecolor="white", linewidth=0.5)
                if w >= char * (len(e.name) + 0.5):
                    ax.text(x0 + w / 2, row[e.rank], e.name, ha="center", va="center", fontsize=7,
                            color="white", clip_on=True)
        ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
        ax.set_ylim(len(ranks) - 0.4, -0.6)
        ax.set_title(f"{label}: {span * scale:.4g} {unit}", loc="left", fontsize=10)
        ax.grid(axis="x", alpha=0.3)
        ax.set_axisbelow(True)
    axes[-1, 0].set_xlabel(f"time ({unit})")
    axes[-1, 0].set_xlim(0, xmax * 1.01)
    handles = [Patch(color=CATEGORIES[c][0], label=CATEGORIES[c][1]) for c in CATEGORIES if c in used]
    handles += [Patch(color="#999999", label=c) for c in sorted(used - set(CATEGORIES))]
    if handles:
        fig.legend(handles=handles, loc="outside lower center", ncol=min(len(handles), 8), fontsize=8,
                   frameon=False)
    if title:
        fig.suptitle(title, fontsize=12)
    fig.savefig(path, dpi=120)
    plt.close(fig)
