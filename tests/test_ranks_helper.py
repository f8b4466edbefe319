"""tests/_ranks.py starts ranks as torchrun does: its environment, the others stopped when one
fails, a timeout. A helper that hung or hid a failure would hang CI or pass a broken run."""

from __future__ import annotations

import os
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


FACTS = textwrap.dedent("""
    import atexit, json, os, random, sys, threading, time
    import helper_mod  # from PYTHONPATH
    print("to stdout", flush=False)
    print("to stderr", file=sys.stderr)
    os.write(2, b"from C\\n")
    facts = {"name": __name__, "file": os.path.basename(__file__), "argv": sys.argv[1:], "cwd": os.getcwd(),
             "path0": sys.path[0], "helper": helper_mod.WHERE, "tests_on_path": any(p.endswith("tests") for p in sys.path),
             "env": {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "MARK", "PYTHONUNBUFFERED")},
             "pdcompile_imported": any(m.startswith("pdcompile") for m in sys.modules), "random": random.random()}
    print("FACTS " + json.dumps(facts, sort_keys=True))
    def at_exit():
        print("atexit ran", flush=True)
        if os.environ["RANK"] == "0":
            open("rank0_done", "w").close()
    atexit.register(at_exit)
    def late():
        time.sleep(0.3)
        print("thread finished", flush=True)
    threading.Thread(target=late).start()  # not a daemon: the interpreter waits for it
    how = sys.argv[1]
    if how != "ok" and os.environ["RANK"] == "1":  # fail once rank 0 has exited: a failure stops the others
        deadline = time.monotonic() + 30
        while not os.path.exists("rank0_done") and time.monotonic() < deadline:
            time.sleep(0.01)
    if how == "raise" and os.environ["RANK"] == "1":
        raise ValueError("boom")
    if how == "exit-text" and os.environ["RANK"] == "1":
        sys.exit("a message")
    if how == "exit-3" and os.environ["RANK"] == "1":
        sys.exit(3)
""")


@pytest.mark.timeout(120)
def test_a_forked_rank_is_what_a_fresh_interpreter_is(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """tests/_fork_ranks.py against fresh ``python script args`` (PDC_FRESH_RANKS=1): the same __name__,
    argv, working folder, sys.path (the script's folder first, PYTHONPATH, no test folder), environment,
    output of both streams (and of C), atexit and non-daemon threads at exit, exit status of an uncaught
    exception, sys.exit("text") and sys.exit(3); nothing of pdcompile imported first; each rank its own
    ``random`` seed. And a variable torch reads at import starts fresh processes."""
    import json

    import _fork_ranks

    (tmp_path / "prog").mkdir()
    script = tmp_path / "prog" / "facts.py"
    script.write_text(FACTS)
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "helper_mod.py").write_text("WHERE = 'lib'\n")
    (tmp_path / "cwd").mkdir()
    env = {"PYTHONPATH": str(tmp_path / "lib"), "MARK": "m"}

    def run(how: str) -> tuple[int, str, list[dict]]:
        (tmp_path / "cwd" / "rank0_done").unlink(missing_ok=True)
        rc, out = run_script(script, 2, [how], timeout=60, env=env, cwd=tmp_path / "cwd")
        facts = [json.loads(ln.split("FACTS ", 1)[1]) for ln in out.splitlines() if ln.startswith("FACTS ")]
        return rc, out, sorted(facts, key=lambda f: f["env"]["RANK"])

    monkeypatch.delenv("PDC_FRESH_RANKS", raising=False)
    got = {how: run(how) for how in ("ok", "raise", "exit-text", "exit-3")}
    monkeypatch.setenv("PDC_FRESH_RANKS", "1")
    want = {how: run(how) for how in ("ok", "raise", "exit-text", "exit-3")}
    for how in got:
        (rc, out, facts), (rc_w, out_w, facts_w) = got[how], want[how]
        assert rc == rc_w == {"ok": 0, "raise": 1, "exit-text": 1, "exit-3": 3}[how], (how, out, out_w)
        assert len(facts) == 2 and [{**f, "random": 0} for f in facts] == [{**f, "random": 0} for f in facts_w], how
        assert facts[0]["random"] != facts[1]["random"]  # seeded per process, as a fresh interpreter is
        assert facts[0]["path0"] == str(script.parent) and facts[0]["helper"] == "lib"
        assert not facts[0]["tests_on_path"] and not facts[0]["pdcompile_imported"]
        assert facts[0]["cwd"] == str(tmp_path / "cwd") and facts[0]["argv"] == [how]
        for line in ("to stdout", "to stderr", "from C", "atexit ran", "thread finished"):
            assert out.count(line) == out_w.count(line) == 2, (how, line, out)
        for text in ("Traceback (most recent call last)", "ValueError: boom", "a message"):
            assert out.count(text) == out_w.count(text), (how, text, out, out_w)
    assert "ValueError: boom" in got["raise"][1] and "a message" in got["exit-text"][1]

    monkeypatch.delenv("PDC_FRESH_RANKS")
    assert _fork_ranks._server_env is not None  # "got" was forked
    assert _fork_ranks.usable({**os.environ, "OMP_NUM_THREADS": "1"})
    assert not _fork_ranks.usable({**os.environ, "OMP_NUM_THREADS": "1", "TORCH_LOGS": "dynamo"})
