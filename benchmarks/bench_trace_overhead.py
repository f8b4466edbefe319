"""Benchmark: what the runtime's action tracing (``train.py --trace``) costs per step, on and off.

One emitted program (the GPT-style model, 2 stages, 2 CPU processes) runs with ``--trace`` on and
off *side by side*: both runs at once (4 processes), so both see the same load from the other jobs
on these shared cores; the pairs alternate which one is launched first. Each run's median step (per
step the mean over ranks, warm-up dropped) is taken; the overhead is the median over pairs of
on/off - 1. Run-to-run noise on shared cores is still larger than the effect, so the cost is also
measured directly, in this process:
what the executor does per action when tracing is on (format the action's name, read the clock,
append to a list) and when it is off (read the clock, test for a recorder), times the actions per
step, against the measured step. Target: under 2% on, nothing (well under 0.1%) off.

Usage: python benchmarks/bench_trace_overhead.py [--pairs 4] [--steps 14]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

from benchmarks._results import write_section  # noqa: E402

M = 4
WARMUP = 4
SCHEDULE = "flush"


def run_median(prog: Path, steps: int, trace: bool) -> float:
    """One run's median step time (seconds)."""
    from benchmarks._common import run_ours

    extra = ["--trace", tempfile.mkdtemp(prefix="pd-trace-ovh-")] if trace else []
    metrics = run_ours(prog, 2, steps, extra=extra, timeout=240)
    ranks = [m["step_times_s"] for m in metrics]
    n = min(len(r) for r in ranks)
    return statistics.median(statistics.fmean(r[i] for r in ranks) for i in range(WARMUP, n))


def per_action_cost(repeats: int = 200_000) -> tuple[float, float]:
    """(seconds per action with tracing on, off), as the executor's loop does it."""
    from pdcompile.runtime.schedules import Action

    actions = [Action.from_str(s) for s in ("1F3", "0SB12", "2B7", "0ST")]
    events: list[tuple[str, float, float]] = []
    recorder = lambda n, s, e: events.append((n, s, e))  # noqa: E731 - the runtime's recorder
    off_recorder = None

    def loop(rec: Any) -> float:
        t0 = time.perf_counter()
        for i in range(repeats):
            a = actions[i & 3]
            start = time.perf_counter()
            if rec is not None:
                rec(str(a), start, time.perf_counter())
        return (time.perf_counter() - t0) / repeats

    def empty() -> float:
        t0 = time.perf_counter()
        for i in range(repeats):
            _ = actions[i & 3]
        return (time.perf_counter() - t0) / repeats

    on, off, base = [], [], []
    for _ in range(5):  # interleaved, medians
        base.append(empty())
        on.append(loop(recorder))
        events.clear()
        off.append(loop(off_recorder))
    b = statistics.median(base)
    return max(0.0, statistics.median(on) - b), max(0.0, statistics.median(off) - b)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=4, help="off/on run pairs (default 4)")
    ap.add_argument("--steps", type=int, default=14, help="minibatches per run (default 14; 4 warm-up)")
    ap.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md alone")
    args = ap.parse_args(argv)

    import torch

    from benchmarks._common import bench_model, compile_bench, load_note
    from pdcompile.runtime.schedules import make_schedule

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    load_before = load_note()
    b = bench_model("gpt", batch_size=32)
    pipe = compile_bench(b, 2, SCHEDULE, M)
    prog = pipe.emit(Path(tempfile.mkdtemp(prefix="pd-trace-ovh-")) / "program")
    pairs = []
    from concurrent.futures import ThreadPoolExecutor

    for i in range(args.pairs):
        order = (False, True) if i % 2 == 0 else (True, False)
        with ThreadPoolExecutor(2) as pool:
            futs = {}
            for flag in order:
                futs[flag] = pool.submit(run_median, prog, args.steps, flag)
                time.sleep(0.2)
            res = {flag: f.result() for flag, f in futs.items()}
        pairs.append((res[False], res[True]))
        print(f"pair {i + 1}: off {res[False] * 1e3:.2f} ms, on {res[True] * 1e3:.2f} ms "
              f"({res[True] / res[False] - 1:+.1%})", flush=True)
    on_s, off_s = per_action_cost()
    sched = make_schedule(SCHEDULE, [1, 1], M)
    actions_per_step = max(len(a) for a in sched.values())
    step = statistics.median(off for off, _ in pairs)
    ratios = [on / off - 1 for off, on in pairs]
    direct_on = on_s * actions_per_step / step
    direct_off = off_s * actions_per_step / step

    rows = ["| pair | off (ms) | on (ms) | on / off - 1 |", "|---|---|---|---|"]
    for i, ((off, on), r) in enumerate(zip(pairs, ratios), 1):
        rows.append(f"| {i} | {off * 1e3:.2f} | {on * 1e3:.2f} | {r:+.1%} |")
    body = (
        f"The GPT-style benchmark model (batch 32), 2 stages on 2 CPU processes, {SCHEDULE}, {M} microbatches; "
        f"{args.steps} minibatches per run ({WARMUP} warm-up), median step per run (mean over ranks); each pair "
        f"runs off and on side by side (4 processes at once), alternating which starts first. Load before: "
        f"{load_before}; after: {load_note()}.\n\n"
        + "\n".join(rows)
        + f"\n\nEnd to end: median on/off - 1 over {len(pairs)} pairs {statistics.median(ratios):+.1%} "
          f"(pairs range {min(ratios):+.1%} .. {max(ratios):+.1%}). "
          + (f"The pairs disagree in sign or favour tracing, so the end-to-end difference is run-to-run noise on "
             f"the shared cores, far above the effect; it cannot resolve 2% here, and the direct figure below "
             f"is the measurement." if min(ratios) < 0 else
             f"Every pair was slower with tracing; compare with the direct figure below, which excludes "
             f"run-to-run noise.")
        + "\n\n"
          f"Direct (in-process, {actions_per_step} actions per rank per step): tracing on costs "
          f"{on_s * 1e9:.0f} ns per action = {direct_on:.3%} of the {step * 1e3:.1f} ms step (target < 2%: "
          f"{'met' if direct_on < 0.02 else 'NOT met'}); off, the executor's clock read and recorder test cost "
          f"{off_s * 1e9:.0f} ns per action = {direct_off:.4%} of the step "
          f"({'nothing measurable' if direct_off < 1e-3 else 'measurable'}). "
          f"The events are written to JSON once, after training, outside the timed steps.\n"
          f"Run time {time.perf_counter() - t0:.0f} s.\n"
    )
    print(body)
    if not args.no_write:
        write_section("Trace overhead (bench_trace_overhead)", body,
                      command="python benchmarks/bench_trace_overhead.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
