"""The ranks of an emitted program started as torchrun starts them, without torchrun's agent.

For the tests whose subject is what a run computes (weights against single-process PyTorch, bitwise
comparisons, metrics): each rank is ``python folder/train.py args`` with the environment torchrun
gives its workers (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...), so train.py runs
the same code. It skips the agent's own start (a Python process importing torch) and its
monitoring interval: 1.3-1.9 s of a 4-4.7 s launch of a 2-rank MLP on this 2-core machine, in a
suite of some hundred launches. As torchrun does, when one rank fails the others are stopped and
the job's status is the first failure's; past ``timeout`` every rank is killed and the status is 124.

What only torchrun does (restarts, its failure summary, the user's command as typed) is tested
through :func:`pdcompile.launcher.launch`: test_newcomer, test_demo, test_cli, test_faults,
test_bad_inputs.

Each rank is forked from a process that has already imported torch (tests/_fork_ranks.py, which says
what makes it the same as a fresh interpreter and where it falls back to one): the 2 s of CPU a rank
spent importing torch and torch._dynamo, some 400 times a suite. ``PDC_FRESH_RANKS=1`` starts every
rank as a fresh ``python script args`` instead.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

import _fork_ranks
from pdcompile.launcher import free_port


class _Forked:
    """A forked rank (tests/_fork_ranks.py) as ``subprocess.Popen``'s poll, wait and pid, its output read
    from its log file as it grows."""

    def __init__(self, proc: Any, log: str) -> None:
        self.proc, self.pid = proc, proc.pid
        self.log = log
        self.stdout: IO[str] | None = self._lines()  # type: ignore[assignment]

    def poll(self) -> int | None:
        return self.proc.exitcode  # type: ignore[no-any-return]

    def wait(self, timeout: float | None = None) -> int:
        self.proc.join(timeout)
        if self.proc.exitcode is None:
            raise subprocess.TimeoutExpired("rank", timeout or 0)
        return self.proc.exitcode  # type: ignore[no-any-return]

    def _lines(self) -> Any:
        """Every line of the log, as written, until the rank has exited and the log is read to its end."""
        from multiprocessing.connection import wait

        with open(self.log, encoding="utf-8", errors="backslashreplace", newline="") as f:
            part = ""
            while True:
                done = bool(wait([self.proc.sentinel], 0))  # exited (the status is poll's to read, not this thread's)
                chunk = f.read()
                if chunk:
                    part += chunk
                    *lines, part = part.split("\n")
                    for line in lines:
                        yield line + "\n"
                elif done:
                    if part:
                        yield part
                    return
                else:
                    time.sleep(0.02)


def _kill(p: Any, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)
    except ProcessLookupError:  # a forked rank that has not yet made its session
        try:
            os.kill(p.pid, sig)
        except ProcessLookupError:
            pass


def run_ranks(folder: str | os.PathLike[str], nproc: int, args: Sequence[str] = (), *, timeout: float = 600,
              env: dict[str, str] | None = None,
              on_line: Callable[[str], None] | None = None) -> tuple[int, str]:
    """Run ``nproc`` ranks of ``folder/train.py args`` on 127.0.0.1: (status, every rank's output,
    rank by rank). The arguments mean what :func:`pdcompile.launcher.launch`'s do."""
    return run_script(Path(folder).resolve() / "train.py", nproc, args, timeout=timeout, env=env, on_line=on_line)


def run_script(script: str | os.PathLike[str], nproc: int, args: Sequence[str] = (), *, timeout: float = 600,
               env: dict[str, str] | None = None, cwd: str | os.PathLike[str] | None = None,
               on_line: Callable[[str], None] | None = None) -> tuple[int, str]:
    """``nproc`` ranks of ``python script args`` with torchrun's worker environment (see the module)."""
    port = str(free_port())
    base = dict(os.environ)
    base.setdefault("OMP_NUM_THREADS", "1")
    base["PYTHONUNBUFFERED"] = "1"
    base.update(env or {})
    procs: list[Any] = []
    forked = _fork_ranks.usable(base)
    logs = tempfile.mkdtemp(prefix="ranks-") if forked else ""
    for r in range(nproc):
        rank_env = {**base, "RANK": str(r), "LOCAL_RANK": str(r), "GROUP_RANK": "0", "ROLE_RANK": str(r),
                    "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), "ROLE_WORLD_SIZE": str(nproc),
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "TORCHELASTIC_RESTART_COUNT": "0",
                    "TORCHELASTIC_MAX_RESTARTS": "0"}
        if forked:
            log = os.path.join(logs, f"rank_{r}.log")
            open(log, "w").close()
            procs.append(_Forked(_fork_ranks.start(str(script), [str(a) for a in args], rank_env,
                                                   str(cwd) if cwd is not None else os.getcwd(), log), log))
        else:
            procs.append(subprocess.Popen([sys.executable, str(script), *args], stdout=subprocess.PIPE, cwd=cwd,
                                          stderr=subprocess.STDOUT, text=True, env=rank_env, start_new_session=True))
    outs: list[list[str]] = [[] for _ in procs]

    def pump(i: int) -> None:
        stream = procs[i].stdout
        assert stream is not None
        for line in stream:
            outs[i].append(line)
            if on_line is not None:
                on_line(line.rstrip("\n"))

    pumps = [threading.Thread(target=pump, args=(i,), daemon=True) for i in range(nproc)]
    for t in pumps:
        t.start()
    deadline = time.monotonic() + timeout
    status = 0
    while True:
        codes = [p.poll() for p in procs]
        failed = [c for c in codes if c not in (None, 0)]
        if failed or all(c == 0 for c in codes):
            status = failed[0] if failed else 0
            break
        if time.monotonic() > deadline:
            status = 124
            break
        time.sleep(0.05)
    for p in procs:  # a failure or the timeout: stop the rest (torchrun stops the workers too)
        if p.poll() is None:
            _kill(p, signal.SIGTERM if status != 124 else signal.SIGKILL)
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            _kill(p, signal.SIGKILL)
            p.wait()
    for t in pumps:
        t.join(timeout=5)
    if logs:
        import shutil

        # a forked rank's whole output is its log file: read it again, whole, rather than trust a pump thread that
        # a loaded machine may not have let reach its end within the join's timeout
        for i, p in enumerate(procs):
            with open(p.log, encoding="utf-8", errors="backslashreplace", newline="") as f:
                outs[i] = [f.read()]
        shutil.rmtree(logs, ignore_errors=True)
    return status, "".join(line for lines in outs for line in lines)
