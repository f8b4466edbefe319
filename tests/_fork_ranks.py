"""A rank of tests/_ranks.py forked from a process that has already imported torch (a forkserver).

A fresh ``python train.py`` spends about 2 s of CPU importing torch (1 s) and torch._dynamo (1 s: the
first optimizer built imports it, ``torch.optim.Optimizer.add_param_group`` is ``_disable_dynamo``'s),
before it runs a line of the program: on this 2-core machine, where the suite starts some 400 ranks,
most of the CPU a launch of a small model costs. Here one server per test process imports them once
and each rank is forked from it, then made what a fresh interpreter running ``python script args``
would be: the caller's environment (``os.environ`` whole, torchrun's variables included), its working
folder, ``sys.argv``, ``sys.path`` as a fresh interpreter builds it (the script's folder, then
``PYTHONPATH``, then the interpreter's own), stdout and stderr to a file (unbuffered, both), a session
of its own, fresh seeds for ``random`` and numpy; the script runs as ``__main__``; at its end the
interpreter's exit (non-daemon threads joined, atexit handlers run, an uncaught exception printed by
``sys.excepthook``, status 1; ``SystemExit``'s code). Nothing of pdcompile is imported before that.

What the server imported was imported under its own environment: a launch whose environment differs
in a variable torch reads at import (``TORCH*``, ``OMP_*``, ``MKL_*``, ...), or any launch under
``PDC_FRESH_RANKS=1``, starts fresh processes instead (:func:`usable`). One thing no fork gives: every
rank shares the server's string hash seed (``PYTHONHASHSEED``), where fresh interpreters draw one
each; the torchrun-launched tests (test_newcomer, test_demo, test_cli, test_faults, test_bad_inputs,
``CompiledPipeline.run``, except in the tests that ask for conftest's ``forked_run``) still start fresh
interpreters.

This module imports only the standard library: the forked rank imports it before anything else.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import Any

PRELOAD = ["torch", "torch._dynamo"]
# variables read when torch (or what it imports) is imported, not when a program runs
_IMPORT_TIME = ("TORCH", "PYTORCH", "OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS", "CUDA", "LD_", "PYTHON")
_ALLOWED = {"PYTHONPATH", "PYTHONUNBUFFERED"}  # PYTHONPATH is applied to sys.path in the rank

_server_env: dict[str, str] | None = None
_fresh_path: list[str] | None = None
_ctx: Any = None


def _sensitive(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(_IMPORT_TIME) and k not in _ALLOWED}


def usable(env: Mapping[str, str]) -> bool:
    """Whether a rank with environment ``env`` may be forked from the server (else: a fresh process)."""
    if os.environ.get("PDC_FRESH_RANKS") or sys.platform != "linux":
        return False
    server = _server_env if _server_env is not None else os.environ  # a server not yet started: os.environ's
    return _sensitive(env) == _sensitive(server)


def _interpreter_path() -> list[str]:
    """``sys.path[1:]`` of a fresh interpreter without PYTHONPATH (site-packages, the editable install)."""
    global _fresh_path
    if _fresh_path is None:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        out = subprocess.run([sys.executable, "-c", "import sys, json; print(json.dumps(sys.path[1:]))"],
                             env=env, capture_output=True, text=True, check=True, timeout=60).stdout
        import json

        _fresh_path = list(json.loads(out))
    return _fresh_path


def start(script: str, args: Sequence[str], env: Mapping[str, str], cwd: str, log: str) -> Any:
    """Start one rank (a ``multiprocessing`` process of the forkserver context), its output to ``log``."""
    global _ctx, _server_env
    if _ctx is None:
        import multiprocessing

        _ctx = multiprocessing.get_context("forkserver")
        _ctx.set_forkserver_preload(PRELOAD)
        _server_env = dict(os.environ)
    p = _ctx.Process(target=_rank, args=(script, list(args), dict(env), cwd, log, _interpreter_path()), daemon=False)
    p.start()
    return p


def _rank(script: str, args: list[str], env: dict[str, str], cwd: str, log: str, base_path: list[str]) -> None:
    """In the forked process: become ``python script args`` (see the module), run it, exit as it would."""
    os.setsid()
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    import io

    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True, line_buffering=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True, line_buffering=True,
                                  errors="backslashreplace")
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [os.path.dirname(os.path.abspath(script)), *extra, *base_path]
    sys.argv = [script, *args]
    import random

    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    code = 0
    try:
        import runpy

        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - what the interpreter does with an uncaught exception
        sys.excepthook(*sys.exc_info())
        code = 1
    try:
        import threading

        shutdown = getattr(threading, "_shutdown", None)  # the interpreter's own wait for non-daemon threads
        if shutdown is not None:
            shutdown()
        import atexit

        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code & 0xFF if code >= 0 else 1)
