"""``pdcompile demo`` as a newcomer runs it, measured: each run from a fresh folder with a fresh
constants cache (the first-run path), its (a), (b) and (c) figures read from ``summary.json``.

    python benchmarks/bench_demo.py             # 3 runs, ~4 minutes on 2 cores; writes RESULTS.md
    python benchmarks/bench_demo.py --runs 1 --quick
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._results import publish  # noqa: E402

ENTRY = Path(sys.executable).parent / "pdcompile"


def run_once() -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as cwd, tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "PDCOMPILE_CACHE": cache}
        env.pop("PDCOMPILE_NCCL_RULES", None)
        cmd = [str(ENTRY), "demo"] if ENTRY.is_file() else [sys.executable, "-m", "pdcompile.cli", "demo"]
        p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
        if p.returncode != 0:
            raise RuntimeError(f"pdcompile demo exited {p.returncode}:\n{p.stdout[-3000:]}{p.stderr[-3000:]}")
        return json.loads((Path(cwd) / "pdcompile-out" / "demo" / "summary.json").read_text())


def table(runs: list[dict[str, Any]]) -> str:
    a = runs[0]["cluster_a"]
    lines = [
        f"(a) PipeDream's VGG-16 profile on Cluster A (prediction, the same every run): {a['configuration']} under "
        f"the `{a['cost_model']}` cost model, {a['speedup_vs_data_parallel']:.2f}x over data parallelism predicted "
        f"(the paper measured {a['paper_speedup']}x with 15-1); communication per minibatch "
        f"{a['comm_bytes_per_minibatch'] / 2**20:.1f} MiB against data parallelism's "
        f"{a['data_parallel_comm_bytes_per_minibatch'] / 2**20:.1f} MiB ({a['comm_reduction']:.0%} less).",
        "",
        "| run | demo time (s) | load at start -> end | (b) pipeline step (ms) | (b) DDP step (ms) | (b) DDP step / pipeline "
        "step | (c) judged rows within 25% | (c) error per judged category (predicted / measured - 1) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i, s in enumerate(runs, 1):
        b, c, load = s["local"], s["prediction"], s["load_average"]
        errs = ", ".join(f"{r['category']} {r['error']:+.0%}" for r in c["rows"] if r["judged"])
        lines.append(f"| {i} | {s['seconds']:.0f} | {load['start']:.1f} -> {load['end']:.1f} | "
                     f"{b['pipeline_step_s'] * 1e3:.1f} | {b['ddp_step_s'] * 1e3:.1f} | {b['pipeline_over_ddp']:.2f}x | "
                     f"{c['within']} of {c['judged']} | {errs} |")
    lines += ["", "(b): a 2-stage pipeline and DistributedDataParallel on 2 CPU processes over an emulated 20 MB/s "
              "link, same model, data and optimizer, median step of steps 5-16. (c): the pipeline's step simulated "
              "before it runs from its profile and this machine's constants (measured in the run, cached), against "
              "the measured median, per category; categories under 5% of the step are shown but not judged."]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="print only, write nothing")
    args = p.parse_args()
    runs = [run_once() for _ in range(args.runs)]
    publish("The demo, as a newcomer runs it (bench_demo)", table(runs),
            "python benchmarks/bench_demo.py" + (f" --runs {args.runs}" if args.runs != 3 else ""),
            write=not args.quick)


if __name__ == "__main__":
    main()
