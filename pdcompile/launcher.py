"""Launch an emitted program locally through torchrun (one machine, gloo on 127.0.0.1)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun_command(folder: str | os.PathLike[str], nproc: int, args: Sequence[str] = (),
                     max_restarts: int = 0) -> list[str]:
    """The torchrun command line for ``folder``'s train.py (an absolute path: it runs from any cwd)."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
            "--master-addr=127.0.0.1", f"--master-port={free_port()}", f"--max-restarts={max_restarts}",
            "--monitor-interval=0.5", str(Path(folder).resolve() / "train.py"), *args]


def check_train_args(folder: str | os.PathLike[str], args: Sequence[str], world: int) -> None:
    """``args`` as train.py's ranks will parse and check them, before torchrun starts any: a flag it does not
    take, or a value it refuses, is a :class:`UsageError` here (one line) instead of every rank's usage text
    and torchrun's failure summary. ``--help`` prints train.py's help and exits."""
    import contextlib
    import io

    from pdcompile.errors import UsageError
    from pdcompile.runtime.launch import check_args, parse_args
    from pdcompile.runtime.program import Program

    program = Program.load(Path(folder))
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            parsed = parse_args(list(args), program)
    except SystemExit as e:
        if not e.code:
            raise
        lines = [line for line in said.getvalue().splitlines() if line.strip()]
        raise UsageError(f"{lines[-1] if lines else 'train.py refused its arguments'}. Fix: give train.py's flags "
                         f"(python {Path(folder) / 'train.py'} --help lists them)") from None
    check_args(parsed, program, world)


def launch(folder: str | os.PathLike[str], nproc: int, args: Sequence[str] = (), *, timeout: float = 600,
           max_restarts: int = 0, on_line: Callable[[str], None] | None = None,
           env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run ``torchrun folder/train.py args``; return (exit status, combined output).

    The job runs in the caller's working directory, so relative paths in ``args`` (``--save-final``,
    ``--metrics``, ``--trace``, ``--checkpoint-dir``) mean what they mean to the caller, as when the
    user types the torchrun command; train.py finds its program folder from its own path.
    ``on_line`` sees each output line as it arrives (progress). The whole run is bounded by
    ``timeout`` seconds: past it the job is killed and the status is 124.
    """
    return run_streaming(torchrun_command(folder, nproc, args, max_restarts), env=env, timeout=timeout,
                         on_line=on_line)


def run_streaming(cmd: Sequence[str], *, env: dict[str, str] | None = None, timeout: float = 600,
                  on_line: Callable[[str], None] | None = None) -> tuple[int, str]:
    """Run ``cmd`` (a torchrun launch) in a session of its own, its output streamed to ``on_line``;
    (exit status, combined output); past ``timeout`` seconds the whole session is killed and the
    status is 124."""
    import threading

    full_env = dict(os.environ)
    full_env.setdefault("OMP_NUM_THREADS", "1")
    full_env["PYTHONUNBUFFERED"] = "1"
    full_env.update(env or {})
    proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env,
                            start_new_session=True)
    lines: list[str] = []

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if on_line is not None:
                on_line(line.rstrip("\n"))

    t = threading.Thread(target=pump, daemon=True)
    t.start()
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()
        rc = 124
    t.join(timeout=5)
    return rc, "".join(lines)
