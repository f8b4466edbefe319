"""Fault injection for the tests of fault tolerance (``--fail-at-step``, ``--fail-rank``,
``--fail-mode``, ``--fail-while-checkpointing``): a rank is killed or hangs where the flags say,
on torchrun's first attempt only, so a restarted job can finish."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time

from pdcompile.runtime import schedules

log = logging.getLogger("pdcompile.runtime")


def flush_output() -> None:
    """Flush this rank's log handlers and standard streams (before it ends abruptly)."""
    for h in logging.getLogger().handlers:
        h.flush()
    sys.stdout.flush()
    sys.stderr.flush()


def inject_fault(args: argparse.Namespace, rank: int, where: str) -> None:
    """SIGKILL (or hang) this rank; only on torchrun's first attempt, so a restarted job can finish."""
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return
    log.warning("fault injection: rank %d %s %s", rank, "hangs" if args.fail_mode == "hang" else "is killed", where)
    flush_output()
    if args.fail_mode == "hang":
        while True:
            time.sleep(3600)
    os.kill(os.getpid(), signal.SIGKILL)


def maybe_fail(args: argparse.Namespace, rank: int, chunk: list[schedules.Action], M: int) -> None:
    """--fail-at-step K: fault before the first action chunk that touches minibatch K (1-based)."""
    if args.fail_at_step is None or args.fail_while_checkpointing or rank != args.fail_rank:
        return
    if any(a.microbatch is not None and a.kind is not schedules.Kind.WEIGHT_VERSION
           and a.microbatch // M == args.fail_at_step - 1 for a in chunk):
        inject_fault(args, rank, f"at step {args.fail_at_step}")
