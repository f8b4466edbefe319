"""Chrome traces and the PNG timeline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdcompile.simulate import simulate_schedule
from pdcompile.timeline import Event, chrome_trace, plot_timeline, read_chrome_trace, write_chrome_trace


def _events() -> list[Event]:
    return simulate_schedule("1f1b", [2, 1], 4, forward_s=[0.002, 0.001], backward_s=[0.004, 0.002],
                             send_s=0.0005, allreduce_s=[0.0003, 0], step_s=[0.0001, 0.0001]).events


def test_chrome_trace_rows_and_slices(tmp_path: Path) -> None:
    events = _events()
    path = tmp_path / "trace.json"
    write_chrome_trace(events, path, metadata={"schedule": "1f1b"})
    data = json.loads(path.read_text())
    assert data["otherData"]["schedule"] == "1f1b"
    names = {(e["pid"], e["args"]["name"]) for e in data["traceEvents"] if e["name"] == "process_name"}
    assert names == {(0, "rank 0"), (1, "rank 1"), (2, "rank 2")}
    slices = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert len(slices) == len(events)
    f3 = next(e for e in slices if e["name"] == "0F3" and e["tid"] == 0)
    assert f3["pid"] == 1 and f3["cat"] == "forward" and f3["dur"] == pytest.approx(2000)
    # transfers overlap compute, so they sit on the rank's second row
    assert {e["tid"] for e in slices if e["cat"] == "transfer"} == {1}
    assert {e["tid"] for e in slices if e["cat"] != "transfer"} == {0}
    back = read_chrome_trace(path)
    t0 = min(e.start_s for e in events)
    assert sorted((e.rank, e.name, round(e.start_s - t0, 9), e.category) for e in events) == \
        sorted((e.rank, e.name, round(e.start_s, 9), e.category) for e in back)


def test_chrome_trace_shifts_to_zero() -> None:
    trace = chrome_trace([Event(0, "0F0", 100.0, 100.5, "forward"), Event(1, "1F0", 100.5, 101.0, "forward")])
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [(e["ts"], e["dur"]) for e in xs] == [(0, 500000), (500000, 500000)]


def test_plot_timeline_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    predicted = _events()
    measured = [Event(e.rank, e.name, 7 + e.start_s * 1.1, 7 + e.end_s * 1.1, e.category) for e in predicted
                if e.category != "transfer"]
    for measured_or_none, name in ((measured, "both.png"), (None, "predicted.png")):
        out = tmp_path / name
        plot_timeline(predicted, measured_or_none, out, title="1F1B-RR 2-1")
        assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "both.png").stat().st_size > (tmp_path / "predicted.png").stat().st_size


def test_plain_tuples_and_categories_from_names() -> None:
    from pdcompile.timeline import category_of

    assert [category_of(n) for n in ("1F3", "12B0", "0SF1", "1RB2", "0AR", "2TG", "0ST", "0WV1", "load")] == \
        ["forward", "backward", "send", "recv", "allreduce", "tied", "step", "version", "other"]
    trace = chrome_trace([(0, "0F0", 0.0, 1.0), (1, "1B0", 1.0, 2.0, "backward")])
    assert [e["cat"] for e in trace["traceEvents"] if e["ph"] == "X"] == ["forward", "backward"]


def test_time_by_category() -> None:
    from pdcompile.timeline import Event, time_by_category

    measured = [Event(0, "0F0", 0.0, 0.002, "forward"), Event(0, "0AR", 0.002, 0.005, "allreduce"),
                Event(1, "1F1", 0.0, 0.001, "forward"), Event(0, "0SF0", 0.002, 0.009, "transfer")]
    assert time_by_category(measured) == {0: {"forward": 0.002, "allreduce": 0.003}, 1: {"forward": 0.001}}
