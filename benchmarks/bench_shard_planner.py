"""Benchmark: what ``shard="auto"`` (issue 26, passes/planner/sharding.py) changes in the planner's plans.

*VGG-16 on Cluster A*: PipeDream's published profile (``pipedream:vgg16``, SGD with momentum: one
byte of optimizer state per weight byte) on ``paper:A`` (4 servers x 4 V100-16GB), as ``pdcompile
plan`` plans it (cost model ``default``, ``recompute="auto"``, pooled workers), under 1F1B and Flush,
with ``shard="none"`` and ``shard="auto"``.

*Llama-2-7B*: the real shape (transformers' ``LlamaConfig``) on the meta device, its chain costed
analytically at an H100's peak (``cost_mode="analytic"``, sequences of 4,096 tokens, microbatches of
one sequence, 32 per step, Adam: two bytes of state per weight byte), planned by the DP as
``pdcompile()`` plans it (flush, ``recompute="auto"``) on 16 and 64 GPUs, 8 to a server (NVLink
450 GB/s inside, 50 GB/s between), with 16 GiB and with 80 GiB each: which plans fit with
``shard="none"`` and with ``shard="auto"``, and their predicted throughput.

Usage: python benchmarks/bench_shard_planner.py [--quick] [--no-write]
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

from benchmarks._results import write_section  # noqa: E402

GiB = 2.0**30


def _row(name: str, plan: Any) -> str:
    """One table row of a plan (or of the error that no plan fits)."""
    if isinstance(plan, str):
        return f"| {name} | no plan fits: {plan} | - | - | - | - |"
    shards = ", ".join(f"{s.index}: {s.shard}" for s in plan.stages if s.replicas > 1) or "-"
    recompute = ", ".join(f"{s.index}: {s.recompute_text}" for s in plan.stages if s.recompute != "none") or "-"
    peak = max(s.memory_bytes for s in plan.stages) / GiB
    limit = plan.memory_limit_bytes
    over = "" if limit is None or peak * GiB <= limit * (1 + 1e-9) else f" (over the {limit / GiB:.0f} GiB limit)"
    return (f"| {name} | {plan.configuration} | {shards} | {recompute} | {peak:.2f}{over} | "
            f"{plan.samples_per_second:.4g} ({plan.speedup_vs_data_parallel:.2f}x DP) |")


HEAD = ("| case | configuration | shard (replicated stages) | recompute | peak per worker (GiB) | "
        "predicted samples/s (speedup vs DP) |\n|---|---|---|---|---|---|")


def _plan(chain: Any, cluster: Any, **kw: Any) -> Any:
    from pdcompile.errors import InfeasiblePlanError
    from pdcompile.passes.partition_dp import partition_dp

    try:
        return partition_dp(chain, cluster, **kw)
    except InfeasiblePlanError as e:
        return str(e).split(";")[0].split(" per worker")[0]


def vgg() -> tuple[str, list[Any]]:
    from pdcompile.cluster import paper_cluster
    from pdcompile.passes.linearize import linearize
    from pdcompile.profile import load, optimizer_state_factor

    prof = load("pipedream:vgg16")
    chain, cluster = linearize(prof), paper_cluster("A")
    rows, plans = [HEAD], []
    for sched in ("1f1b", "flush"):
        for shard in ("none", "auto"):
            p = _plan(chain, cluster, schedule=sched, recompute="auto", pool=True, shard=shard,
                      optimizer_state_factor=optimizer_state_factor(prof.optimizer), microbatches_known=False)
            plans.append(p)
            rows.append(_row(f"VGG-16, paper:A, {sched}, shard={shard}", p))
            print(rows[-1], flush=True)
    return "\n".join(rows), plans


def llama_chain(quick: bool) -> Any:
    """Llama-2-7B's chain (meta device, analytic costs at an H100's peak), as ``pdcompile()`` sees it."""
    import torch
    import transformers

    from benchmarks._common import llama_config
    from benchmarks.bench_big_model import h100_cluster
    from pdcompile.api import pdcompile
    from pdcompile.zoo.losses import SequenceCrossEntropy

    name, seq, batch = ("tiny", 16, 4) if quick else ("llama-2-7b", 4096, 32)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(llama_config(name))
        x = torch.randint(0, 100, (batch, seq))
    pipe = pdcompile(model, h100_cluster(8), example_inputs=(x,), example_target=x, loss_fn=SequenceCrossEntropy(),
                     num_microbatches=batch, cost_mode="analytic", schedule="flush", stages=1, shard="none")
    return pipe.wire_chain, batch


def llama(quick: bool) -> tuple[str, list[Any]]:
    from pdcompile.cluster import ClusterSpec, Device, Level

    chain, M = llama_chain(quick)
    rows, plans, fixed_rows = [HEAD], [], [FIXED_HEAD]
    for gpus in ((2,) if quick else (16, 64)):
        for mem in (16, 80):
            device = Device(f"H100-{mem}GB", memory=mem * GiB, peak_flops=494e12, memory_bandwidth=3.35e12,
                            peak_flops_bf16=989e12)
            inner = min(gpus, 8)
            levels = [Level("gpus-in-server", inner, 450e9)] + ([Level("servers", gpus // inner, 50e9)]
                                                                 if gpus > inner else [])
            cluster = ClusterSpec(device, tuple(levels))
            fixed_rows += fixed(chain, cluster, M, f"{gpus} x {mem} GiB")
            for shard in ("none", "auto"):
                t0 = time.perf_counter()
                p = _plan(chain, cluster, schedule="flush", num_microbatches=M, recompute="auto", shard=shard,
                          optimizer_state_factor=2.0)
                plans.append(p)
                rows.append(_row(f"Llama-2-7B, {gpus} x {mem} GiB, shard={shard} "
                                 f"(planned in {time.perf_counter() - t0:.1f} s)", p))
                print(rows[-1], flush=True)
    return ("\n".join(rows) + "\n\nFixed configurations (flush, recompute auto, one mode for every replicated stage):\n\n"
            + "\n".join(fixed_rows)), plans


FIXED_HEAD = ("| cluster | stages x replicas (balanced split) | per-worker peak: none / optimizer / full (GiB) | "
              "fits: none / optimizer / full | recompute (none's) | predicted samples/s |\n|---|---|---|---|---|---|")


def fixed(chain: Any, cluster: Any, M: int, name: str) -> list[str]:
    """Data parallelism and straight splits of ``S`` stages x ``n / S`` replicas under each mode: which fit."""
    from pdcompile.errors import UsageError
    from pdcompile.passes.partition import balanced_bounds
    from pdcompile.passes.partition_dp import plan_from_assignment

    n = cluster.num_workers
    rows = []
    for S in (1, 2, 4, 8, 16):
        if S > n or n % S:
            continue
        R = n // S
        bounds = [0, *balanced_bounds(chain, S), len(chain)]
        assign = [(a, b - 1, R, tuple(range(k * R, (k + 1) * R))) for k, (a, b) in enumerate(zip(bounds, bounds[1:]))]
        if R > M:  # a replica without a microbatch in a step: no mode runs it
            continue
        plans = []
        for mode in ("none", "optimizer", "full"):
            try:
                plans.append(plan_from_assignment(chain, cluster, assign, schedule="flush", num_microbatches=M,
                                                  recompute="auto", optimizer_state_factor=2.0, shard=mode))
            except UsageError as e:
                plans.append(str(e))
        limit = cluster.device.memory
        peaks = [max(s.memory_bytes for s in p.stages) if not isinstance(p, str) else None for p in plans]
        fits = ["refused" if pk is None else "yes" if pk <= limit * (1 + 1e-9) else "no" for pk in peaks]
        rec = ", ".join(sorted({s.recompute_text for s in plans[0].stages})) or "-"  # type: ignore[union-attr]
        rows.append(f"| {name} | {S} x {R} | {' / '.join('-' if pk is None else f'{pk / GiB:.1f}' for pk in peaks)} | "
                    f"{' / '.join(fits)} | {rec} | "
                    f"{' / '.join('-' if isinstance(p, str) else f'{p.samples_per_second:.4g}' for p in plans)} |")
        print(rows[-1], flush=True)
    return rows


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a tiny Llama on 2 GPUs; print only")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    vt, _ = vgg()
    lt, _ = llama(args.quick)
    body = (f"Command: `python benchmarks/bench_shard_planner.py`; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
            f"{platform.node()} ({os.cpu_count()} CPUs); load average before {', '.join(f'{x:.2f}' for x in load0)}, "
            f"after {', '.join(f'{x:.2f}' for x in os.getloadavg())}; {time.perf_counter() - t0:.0f} s.\n\n"
            f"VGG-16 on Cluster A (PipeDream's profile, SGD with momentum):\n\n{vt}\n\n"
            f"Llama-2-7B (seq 4096, 32 microbatches of 1 sequence, Adam, flush, recompute auto):\n\n{lt}\n")
    print(body)
    if not args.quick and not args.no_write:
        write_section("Sharded replicas in the planner (bench_shard_planner)", body)
    return body


if __name__ == "__main__":
    main()
