"""tests/_ranks.py starts ranks as torchrun does: its environment, the others stopped when one
fails, a timeout. A helper that hung or hid a failure would hang CI or pass a broken run."""

from __future__ import annotations

import textwrap
import time
from pathlib import Path

import pytest

from _ranks import run_script

SCRIPT = textwrap.dedent("""
    import os, sys, time
    rank = int(os.environ["RANK"])
    print(f"rank {rank} of {os.environ['WORLD_SIZE']} at {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
          flush=True)
    open(os.path.join(sys.argv[2], str(rank)), "w").close()
    if sys.argv[1] == "fail" and rank == 1:  # fail once every rank has started, so each printed its line
        deadline = time.monotonic() + 30
        while len(os.listdir(sys.argv[2])) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        sys.exit(3)
    if sys.argv[1] != "ok":
        time.sleep(60)
""")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode,status", [("ok", 0), ("fail", 3), ("hang", 124)])
def test_run_script_reports_the_first_failure_and_stops_the_rest(tmp_path: Path, mode: str, status: int) -> None:
    script = tmp_path / "ranks.py"
    script.write_text(SCRIPT)
    t0 = time.monotonic()
    started = tmp_path / "started"
    started.mkdir()
    rc, out = run_script(script, 3, [mode, str(started)], timeout=5)
    took = time.monotonic() - t0
    assert rc == status, out
    assert all(f"rank {r} of 3 at 127.0.0.1:" in out for r in range(3)), out
    assert took < 20, f"{mode}: took {took:.1f} s (a rank sleeping 60 s was not stopped)"
