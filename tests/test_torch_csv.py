"""torch.distributed.pipelining's schedule CSV: ours written and read back unchanged, torch's own
orders (its schedule classes' ``_dump_csv``) read, validated and equal to ours where we have the
schedule, and broken CSVs refused naming the rule and the cell."""

from __future__ import annotations

import csv
import io
from pathlib import Path

import pytest
from pdcompile.torch_orders import torch_csv

from pdcompile.errors import ScheduleError, UsageError
from pdcompile.runtime.schedules import POLICIES, Kind, make_schedule, validate
from pdcompile.runtime.schedules.torch_csv import csv_policy, parse_cells, read_csv, write_csv

SYNCHRONOUS = [n for n, p in POLICIES.items() if p.synchronous]  # one update per step: what a torch CSV is


def _cells(text: str) -> dict[int, list[str]]:
    """The non-empty cells per row, as torch's reader sees them."""
    return {r: [c for c in row if c.strip()] for r, row in enumerate(csv.reader(io.StringIO(text)))}


@pytest.mark.parametrize("name", SYNCHRONOUS)
def test_round_trip_ours(name: str) -> None:
    virtual = POLICIES[name].placement is not None
    n = 0
    for p in (1, 2, 3, 4):
        for m in (1, 2, 3, 4, 6, 8, 12):
            stages = 2 * p if virtual else p
            try:
                sched = make_schedule(name, [1] * stages, m, virtual_stages=2 if virtual else 1)
            except UsageError:  # e.g. interleaved with m not a multiple of p
                continue
            text = write_csv(sched)
            assert read_csv(text, schedule=name) == sched, (name, p, m)
            assert read_csv(text) == sched  # and under the CSV's own policy
            n += 1
    assert n >= 12


def test_write_refuses_what_torch_cannot_hold() -> None:
    with pytest.raises(UsageError, match="one step"):
        write_csv(make_schedule("1f1b", [1, 1], 4))  # a step per microbatch
    with pytest.raises(UsageError, match="replicated"):
        write_csv(make_schedule("flush", [2, 1], 4))
    with pytest.raises(UsageError, match="one step"):
        write_csv(make_schedule("flush", [1, 1], 2, num_steps=2))


def test_write_is_torchs_format() -> None:
    """Our ZB-V and interleaved 1F1B written are torch's own _dump_csv, cell for cell, bubbles
    (torch's empty cells) aside."""
    for p, m in [(2, 4), (3, 6), (4, 8)]:
        ours = write_csv(make_schedule("zb-v", [1] * (2 * p), m, virtual_stages=2))
        assert _cells(ours) == _cells(torch_csv("zb-v", p, m, path=_tmp()))
        ours = write_csv(make_schedule("interleaved-1f1b", [1] * (2 * p), m, virtual_stages=2))
        assert _cells(ours) == _cells(torch_csv("interleaved-1f1b", p, m, path=_tmp()))
    assert write_csv(make_schedule("flush", [1, 1], 2)) == "0F0,0F1,0B0,0B1\r\n1F0,1B0,1F1,1I1,1W1\r\n"


_TMP: list[Path] = []


def _tmp() -> Path:
    return _TMP[0] / "order.csv"


@pytest.fixture(autouse=True)
def _tmpdir(tmp_path: Path) -> None:
    _TMP[:] = [tmp_path]


@pytest.mark.parametrize("which", ["interleaved-1f1b", "interleaved-zb", "zb-v", "dualpipe-v"])
def test_torchs_orders_read_and_validate(which: str) -> None:
    """torch's generated orders (with its bubbles, I/W splits, overlapped F&B) read from its own
    CSV files, with our transfers and updates added, pass every rule (NCCL's transfer order too)."""
    for p, m in [(2, 4), (2, 6), (3, 6), (4, 8), (4, 12)]:
        text = torch_csv(which, p, m, path=_tmp())
        sched = read_csv(_tmp())
        assert read_csv(text) == sched
        assert sum(a.kind is Kind.FORWARD for acts in sched.values() for a in acts) == 2 * p * m
        validate(sched, [1] * (2 * p), m, csv_policy(_placement(sched)), virtual_stages=2)
        if which in ("zb-v", "interleaved-1f1b", "dualpipe-v"):  # ours: the same schedule
            assert read_csv(text, schedule=which) == make_schedule(which, [1] * (2 * p), m, virtual_stages=2)


def _placement(sched: dict) -> list[list[int]]:
    where = {a.stage: r for r, acts in sched.items() for a in acts}
    return [[where[s]] for s in range(len(where))]


def test_overlapped_pairs_run_forward_then_backward() -> None:
    text = torch_csv("dualpipe-v", 2, 4, path=_tmp())
    assert "(0F3;3B1)OVERLAP_F_B" in text
    cells = [str(a) for a in read_csv(text)[0] if a.kind in (Kind.FORWARD, Kind.BACKWARD)]
    i = cells.index("0F3")
    assert cells[i:i + 2] == ["0F3", "3B1"]


def _csv(rows: list[list[str]]) -> str:
    return "".join(",".join(r) + "\r\n" for r in rows)


FLUSH = [["0F0", "0F1", "", "0B0", "0B1"], ["", "1F0", "1B0", "1F1", "1I1", "1W1"]]


def test_broken_csvs_refused_naming_rule_and_cell() -> None:
    assert read_csv(_csv(FLUSH)) == make_schedule("flush", [1, 1], 2)
    cases = [
        # forwards out of order on rank 0 (column 2 holds 0F0 now)
        ([["0F1", "0F0", "", "0B0", "0B1"], FLUSH[1]], "forward order", "row 1 (rank 0), column 2 ('0F0')"),
        # rank 1 backs up microbatch 0 before rank 0 sent it: its receive waits forever
        ([FLUSH[0], ["1B0", "1F0", "1F1", "1I1", "1W1"]], "backward after forward", "row 2 (rank 1), column 1 ('1B0')"),
        # an I without its W, a W of a full backward
        ([FLUSH[0], ["", "1F0", "1B0", "1F1", "1I1"]], "split backward", "column 5 ('1I1')"),
        ([FLUSH[0], ["", "1F0", "1B0", "1F1", "1B1", "1W1"]], "split backward", "column 6 ('1W1')"),
        # a stage on two ranks, a missing backward
        ([FLUSH[0] + ["1F2"], FLUSH[1]], "ranks", "column 6 ('1F2')"),
        ([["0F0", "0F1", "", "0B0"], FLUSH[1]], "each forward and backward once", "row 1 (rank 0)"),
        # a deadlock: rank 0 waits for 1B1's gradients before it sends 0F1's activations
        ([["0F0", "0B0", "0B1", "0F1"], FLUSH[1]], "backward after forward", "row 1 (rank 0), column 3 ('0B1')"),
        ([["0F0", "0B0", "0F1", "0B1"], ["1F1", "1F0", "1B0", "1B1"]], "forward order", "row 2 (rank 1), column 2"),
    ]
    for rows, rule, where in cases:
        with pytest.raises(ScheduleError) as err:
            read_csv(_csv(rows))
        msg = str(err.value)
        assert f"rule '{rule}'" in msg and where in msg, (rows, msg[:400])


def test_a_deadlock_names_the_waiting_cell() -> None:
    # stage 1 waits for 0F1 (its receive of activations) before it returns 1B0's gradients, which
    # stage 0 waits for before its 0F1: each rank's row is fine alone
    rows = [["0F0", "0B0", "0F1", "0B1"], ["1F0", "1F1", "1B0", "1B1"]]
    with pytest.raises(ScheduleError) as err:
        read_csv(_csv(rows))
    assert "rule 'no deadlock'" in str(err.value) and "torch CSV row" in str(err.value)


def test_refuses_cells_it_does_not_read() -> None:
    with pytest.raises(ScheduleError, match="not a compute action"):
        read_csv(_csv([["0F0", "0SEND_F0", "0B0"], ["1RECV_F0", "1F0", "1B0"]]))
    assert parse_cells("0F0,,(1F0;2B3)OVERLAP_F_B\r\n")[0][1][0] == "1F0"


def test_schedule_named_must_fit() -> None:
    text = torch_csv("interleaved-1f1b", 2, 4, path=_tmp())  # stage s on rank s % 2
    with pytest.raises(ScheduleError, match="rule 'ranks'"):
        read_csv(text, schedule="zb-v")  # stage 2 belongs on rank 1 there
