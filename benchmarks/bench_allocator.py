"""Keeping freed memory (train.py's CPU default) against glibc's defaults: page faults and step time.

    python benchmarks/bench_allocator.py            # ~4 minutes on 2 cores
    python benchmarks/bench_allocator.py --quick    # tiny models, one round, nothing written

The benchmark programs of bench_vs_pipelining (GPT-style and VGG-style, 2 stages, Flush, minibatch
32 = 4 x 8) run through the emitted ``train.py`` on 2 CPU processes, with ``--keep-freed-memory``
(``runtime/allocator.py``: glibc's mmap and trim thresholds raised, so what a step frees is reused
by the next) and with ``--no-keep-freed-memory`` (glibc's own adaptive thresholds, which hand large
freed blocks back to the system and fault them in again). The allocator is process-wide and glibc's
adaptive default cannot be restored by hand, so the two cannot share a launch: they run as separate
launches, back to back, who goes first alternating per round; the ratio is per round.

Columns: page faults per step (``getrusage`` minor faults over the training loop / steps: each is a
page zero-filled afresh; the busier rank), peak RSS (the larger rank's), median step time (slowest
rank, first 5 steps dropped), and default/kept step time per round (> 1: keeping is faster).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import bench_model, bootstrap_median, compile_bench, load_note, median, ms, run_ours, step_times
from benchmarks._results import publish

FLAGS = {"kept": "--keep-freed-memory", "default": "--no-keep-freed-memory"}


def measure(model: str, *, rounds: int, steps: int, size: str = "bench", batch_size: int = 32) -> dict[str, object]:
    """Paired launches of one emitted program with each setting; per setting the medians over rounds."""
    program = compile_bench(bench_model(model, batch_size=batch_size, size=size), 2, "flush", 4).emit(
        Path(tempfile.mkdtemp(prefix=f"pd-bench-alloc-{model}-")) / "program")
    got: dict[str, dict[str, list[float]]] = {k: {"faults": [], "rss": [], "step": []} for k in FLAGS}
    for i in range(rounds):
        for which in (("kept", "default") if i % 2 == 0 else ("default", "kept")):
            ranks = run_ours(program, 2, steps, schedule="flush", extra=[FLAGS[which]])
            got[which]["faults"].append(max(r["page_faults_per_step"] for r in ranks))
            got[which]["rss"].append(max(r["peak_rss_mb"] for r in ranks))
            got[which]["step"].append(median(step_times([r["step_times_s"] for r in ranks], 5)))
    ratios = [d / k for d, k in zip(got["default"]["step"], got["kept"]["step"], strict=True)]
    return {"model": model, **{f"{k}_{m}": median(v) for k, d in got.items() for m, v in d.items()},
            "ratio": median(ratios), "interval": bootstrap_median(ratios), "rounds": rounds}


def table(rows: list[dict[str, object]]) -> str:
    lines = ["| model | page faults / step, default | kept | peak RSS MB, default | kept | step ms, default | kept "
             "| default / kept step time (median of rounds) | 90% interval (bootstrap over rounds) | rounds |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lo, hi = r["interval"]  # type: ignore[misc]
        lines.append(f"| {r['model']} | {r['default_faults']:.0f} | {r['kept_faults']:.0f} | {r['default_rss']:.0f} | "
                     f"{r['kept_rss']:.0f} | {ms(r['default_step'])} | {ms(r['kept_step'])} | {r['ratio']:.2f} | "  # type: ignore[arg-type]
                     f"{lo:.2f} - {hi:.2f} | {r['rounds']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--models", default="gpt,vgg")
    p.add_argument("--quick", action="store_true", help="tiny models, one round, nothing written")
    args = p.parse_args(argv)
    before = load_note()
    rows = []
    for m in args.models.split(","):
        if args.quick:
            rows.append(measure(m, rounds=1, steps=8, size="tiny", batch_size=8))
        else:
            rows.append(measure(m, rounds=args.rounds, steps=args.steps))
        print(table(rows), flush=True)
    body = (f"The emitted 2-stage Flush programs of bench_vs_pipelining (minibatch 32 = 4 x 8) through train.py on 2 "
            f"CPU processes, {args.steps} steps per launch, with --keep-freed-memory (train.py's default on CPU) and "
            f"--no-keep-freed-memory, as separate launches back to back ({args.rounds} rounds, who goes first "
            f"alternating). Page faults per step: minor faults over the training loop / steps, the busier rank; step: "
            f"slowest rank's median, first 5 steps dropped; ratio > 1: keeping freed memory is faster.\n"
            f"Load: {before} at the start, {load_note()} at the end.\n\n" + table(rows))
    publish("Allocator: keeping freed memory (bench_allocator)", body,
            "python benchmarks/bench_allocator.py", write=not args.quick)


if __name__ == "__main__":
    main()
