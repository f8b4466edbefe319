"""Setting up a run's schedule: laid out whole vs step by step (``schedules.rank_run``), by run length.

    python benchmarks/bench_schedule_setup.py     # ~1 minute

What every process of a run does before its first step: the schedule of its rank with the send
release map (when each send's buffer may be let go). Laid out whole (what the runtime did until
rank_run): ``make_schedule`` for every rank and ``send_release`` over it, time and memory linear in
the steps. Step by step: ``rank_run`` reads the repeating period off a few steps' schedules (and
checks it against two longer ones), so time and memory are constant; iterating its actions costs
about a microsecond each. Flush and 1F1B, 4 stages, 8 microbatches per step, tied parameters; time
with the cyclic GC frozen as train.py runs it; memory = tracemalloc's peak (a separate pass).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pdcompile.runtime import schedules  # noqa: E402

from benchmarks._results import publish  # noqa: E402

REPLICAS, M = [1, 1, 1, 1], 8


def whole(name: str, steps: int) -> object:
    sched = schedules.make_schedule(name, REPLICAS, M, num_steps=steps, tied=True)
    return sched, schedules.send_release(sched, REPLICAS)


def step_by_step(name: str, steps: int) -> object:
    schedules.periodic.clear_cache()  # every process starts cold
    return schedules.rank_run(name, REPLICAS, M, steps, 1, tied=True)


def measure(fn: Callable[[str, int], object], name: str, steps: int) -> tuple[float, float]:
    gc.collect()
    t0 = time.perf_counter()
    out = fn(name, steps)
    dt = time.perf_counter() - t0
    del out
    gc.collect()
    tracemalloc.start()
    out = fn(name, steps)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    del out
    return dt, peak / 1e6


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="short runs only, nothing written")
    args = p.parse_args(argv)
    gc.freeze()
    lines = ["| schedule | steps | laid out whole: s | MB | step by step: s | MB |", "|---|---|---|---|---|---|"]
    whole_steps = (10, 100) if args.quick else (100, 1000, 4000)
    for name in ("flush", "1f1b"):
        for steps in (*whole_steps, 10**5, 10**6):
            w = measure(whole, name, steps) if steps in whole_steps else None
            r = measure(step_by_step, name, steps)
            lines.append(f"| {name} | {steps} | {f'{w[0]:.2f}' if w else '-'} | {f'{w[1]:.0f}' if w else '-'} | "
                         f"{r[0]:.3f} | {r[1]:.1f} |")
            print(lines[-1], flush=True)
    run = schedules.rank_run("1f1b", REPLICAS, M, 10**5, 1, tied=True)
    t0 = time.perf_counter()
    n = sum(1 for _ in itertools.islice(iter(run), 10**6))
    per = (time.perf_counter() - t0) / n
    body = (__doc__.split("\n\n", 2)[2].strip() + "\n\n" + "\n".join(lines) +
            f"\n\nIterating a step-by-step run: {per * 1e6:.2f} us per action (1F1B, rank 1, {n} actions); a "
            f"CPU action here takes 0.1-5 ms. '-': not measured (laid out whole, 10^5 steps would take minutes "
            f"and GBs in every process).")
    publish("Schedule set-up by run length (bench_schedule_setup)", body,
            "python benchmarks/bench_schedule_setup.py", write=not args.quick)


if __name__ == "__main__":
    main()
