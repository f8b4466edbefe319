"""Benchmark: how late gloo delivers one message when both CPU processes compute.

bench_predicted_vs_measured models gloo on a machine with as many processes as cores by
``recv_progress="on_wait"``: a message moves once its receiver waits for it. Traces of runs with two
stages per process show some messages arriving milliseconds after that, once the sender blocks.
This isolates one transfer between two processes on 127.0.0.1, the sender computing (a conv's
forward and backward, 20 ms) while the receiver posts and waits, and asks whether the lateness is a
rule of gloo on busy cores. Per case, the receiver's wait past the later of its wait's start and
the send's call ("late"), over 20 tries:

* ``after_send_then_wait``: the receive is posted after the send (gloo queues the send until the
  receiver's notice reaches the sender's I/O thread), and the receiver waits at once;
* ``after_send_compute_3ms``: as above, but the receiver computes 3 ms between posting and waiting
  (both processes compute when the notice arrives);
* ``before_send``: the receive is posted and waited for before the send's call;
* ``after_send_reverse_traffic``: as the second, with a message the other way in flight.

Usage: python benchmarks/bench_gloo_progress.py [--tries 20] [--no-write]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

CASES = ("after_send_then_wait", "after_send_compute_3ms", "before_send", "after_send_reverse_traffic")
SENDER_COMPUTE_S = 0.020
POST_AT_S = 0.004  # when the receiver posts (after_send cases) or the sender sends (before_send)
MESSAGE_FLOATS = 128 * 1024  # 512 KiB, a VGG boundary's size


def worker(out: str, tries: int) -> None:
    """One rank (torchrun's environment): rank 1 sends to rank 0 in every case; times on the shared
    monotonic clock (``time.perf_counter`` is CLOCK_MONOTONIC on Linux, one clock for all processes)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    conv = torch.nn.Conv2d(16, 16, 3, padding=1)
    inp = torch.randn(8, 16, 32, 32)
    msg, back = torch.randn(MESSAGE_FLOATS), torch.randn(MESSAGE_FLOATS)
    buf, back_buf = torch.empty(MESSAGE_FLOATS), torch.empty(MESSAGE_FLOATS)

    def compute(seconds: float) -> None:
        t = time.perf_counter()
        while time.perf_counter() - t < seconds:
            conv(inp).sum().backward()

    got: dict[str, list[dict[str, float]]] = {c: [] for c in CASES}
    for case in CASES:
        for _ in range(tries + 2):  # two warm-up tries
            dist.barrier()
            rec: dict[str, float] = {}
            if rank == 1:  # the sender
                reverse = dist.irecv(back_buf, 0) if case == "after_send_reverse_traffic" else None
                if case == "before_send":
                    compute(POST_AT_S)
                rec["send"] = time.perf_counter()
                w = dist.isend(msg, 0)
                compute(SENDER_COMPUTE_S)
                rec["blocked"] = time.perf_counter()
                w.wait()
                if reverse is not None:
                    reverse.wait()
            else:  # the receiver
                sent_back = dist.isend(back, 1) if case == "after_send_reverse_traffic" else None
                if case != "before_send":
                    compute(POST_AT_S)
                w = dist.irecv(buf, 1)
                rec["post"] = time.perf_counter()
                if case in ("after_send_compute_3ms", "after_send_reverse_traffic"):
                    compute(0.003)
                rec["wait"] = time.perf_counter()
                w.wait()
                rec["arrived"] = time.perf_counter()
                if sent_back is not None:
                    sent_back.wait()
            got[case].append(rec)
    Path(out, f"rank_{rank}.json").write_text(json.dumps(got))
    dist.destroy_process_group()


def summarize(r0: dict[str, list[dict[str, float]]], r1: dict[str, list[dict[str, float]]]) -> list[dict[str, Any]]:
    """Per case, the receiver's lateness (ms) past ``max(wait start, send call)``, warm-up dropped."""
    rows = []
    for case in CASES:
        late = [(a["arrived"] - max(a["wait"], b["send"])) * 1e3 for a, b in zip(r0[case][2:], r1[case][2:])]
        blocked = [(b["blocked"] - a["arrived"]) * 1e3 for a, b in zip(r0[case][2:], r1[case][2:])]
        rows.append(dict(case=case, median=statistics.median(late), max=max(late),
                         over_1ms=sum(x > 1 for x in late), tries=len(late),
                         before_sender_blocks=statistics.median(blocked)))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tries", type=int, default=20)
    ap.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md alone")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.worker, args.tries)
        return 0
    from benchmarks._common import load_note, torchrun
    from benchmarks._results import write_section

    before = load_note()
    out = tempfile.mkdtemp(prefix="pd-gloo-progress-")
    rc, log = torchrun("benchmarks.bench_gloo_progress", 2, ["--worker", out, "--tries", str(args.tries)],
                       timeout=300)
    if rc != 0:
        print(log[-3000:], file=sys.stderr)
        return 1
    r0, r1 = (json.loads(Path(out, f"rank_{r}.json").read_text()) for r in (0, 1))
    rows = summarize(r0, r1)
    body = "\n".join([
        f"One {MESSAGE_FLOATS * 4 // 1024} KiB message from rank 1 to rank 0 over gloo on 127.0.0.1, {args.tries} "
        f"tries per case (2 warm-up dropped), both processes one thread on {os.cpu_count()} cores; the sender "
        f"computes {SENDER_COMPUTE_S * 1e3:.0f} ms (conv forward and backward) after its send's call. Late: how long "
        f"the receiver waited past the later of its wait's start and the send's call.",
        f"Load before: {before}; after: {load_note()}.", "",
        "| case | late, median (ms) | late, max (ms) | tries late by over 1 ms | the sender's own wait began, ms after the arrival (median) |",
        "|---|---|---|---|---|",
        *[f"| {r['case']} | {r['median']:.2f} | {r['max']:.2f} | {r['over_1ms']} of {r['tries']} | "
          f"{r['before_sender_blocks']:.1f} |" for r in rows],
    ]) + "\n"
    print(body)
    if not args.no_write:
        write_section("Gloo transfer progress on busy cores (bench_gloo_progress)", body,
                      command="python benchmarks/bench_gloo_progress.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
