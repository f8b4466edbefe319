"""A degree per stage (issue 35 item 3): what ``tensor_parallel="auto"`` chooses on PTD-P's Table 1 rows
(``bench_ptdp_table.py``'s chain, cluster and options) and Llama-3-70B on 64 H100s (``bench_big_model.py``'s
tensor part), with the per-stage search: each stage's degree and replicas, the step against the best one-degree
plan's (the search's note), and the planning time. Prints only (the figures go in RESULTS.md by hand).

    python benchmarks/bench_tp_per_stage.py --rows 0-3      # PTD-P rows
    python benchmarks/bench_tp_per_stage.py --llama         # Llama-3-70B compile on meta, in its own process
"""

from __future__ import annotations

import argparse
import json
import re
import time

from benchmarks import bench_big_model as big
from benchmarks import bench_ptdp_table as ptdp


def ptdp_row(i: int) -> str:
    from pdcompile.plan import plan

    row = ptdp.TABLE[i]
    b = ptdp.microbatch(row)
    t0, c0 = time.perf_counter(), time.process_time()
    p = plan(ptdp.gpt_chain(row, b), ptdp.cluster(row.gpus), schedule="flush", num_microbatches=row.batch // b,
             recompute="full", optimizer_state_factor=ptdp.ADAM_MIXED, tensor_parallel="auto", choose_microbatches=True)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    note = next((n for n in p.notes if n.startswith("a degree per stage")), "")
    uniform = re.search(r"against ([0-9.e+-]+) s at t=(\d+)", note)
    degs = "/".join(f"{st.tensor_parallel}x{st.replicas}" for st in p.stages)
    return (f"| {row.params_b}B | {row.gpus} | {degs} | {p.microbatch_size} x {p.num_microbatches} | "
            f"{p.seconds_per_minibatch:.4g} | "
            f"{(uniform.group(1) + ' (t=' + uniform.group(2) + ')') if uniform else 'same'} | "
            f"{wall:.1f} ({cpu:.1f}) |\n    note: {note}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="0-3")
    ap.add_argument("--llama", action="store_true")
    a = ap.parse_args()
    if a.llama:
        cfg = {"model": "llama-3-70b", "gpus": 64, "batch": 32, "seq": 4096, "microbatches": 32, "adamw": True,
               "precision": "bf16", "no_emit": True, "tensor_parallel": "auto"}
        r = big.run_child(cfg, 1800)
        print(json.dumps({k: r.get(k) for k in ("compile_s", "compile_cpu_s", "t", "stages", "replicas", "headline_s",
                                                "simulate_s", "tp_note", "per_stage_note", "degrees", "error")}, indent=1))
        return
    lo, _, hi = a.rows.partition("-")
    print("| model | GPUs | t x replicas per stage | b x M | step (s) | best one-degree step (s) | planned in s (CPU) |")
    for i in range(int(lo), int(hi or lo) + 1):
        print(ptdp_row(i), flush=True)


if __name__ == "__main__":
    main()
