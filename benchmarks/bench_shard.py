"""Benchmark: a 2x-replicated stage under each shard mode (``none``, ``optimizer``, ``full``): step
time, and each replica's peak memory, measured (runtime/memory.py) against the planner's prediction.

A wide MLP (``pdcompile.zoo.mlp``, untied: ``full`` refuses a stage with a parameter tied to another)
compiled into 2 stages with replicas [2, 1] (3 ranks, flush, SGD with momentum),
its stage 0 given each mode in plan.json, trained through torchrun (gloo, CPU). Step time: the median
over the steps after the first (the reporting rank's). Memory: stage 0's replicas' own accounting
(weights, or under ``full`` the replica's shard plus the gathered working copy while held;
gradients; optimizer state; activations; receive buffers). Predicted: the planner's stage memory
for the same stages under the mode (``plan_from_assignment(..., shard=mode)``), where it has one.

Usage: python benchmarks/bench_shard.py [--steps 6] [--write]
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
from collections.abc import Iterator  # noqa: E402

import torch  # noqa: E402

from benchmarks._results import write_section  # noqa: E402
from pdcompile.api import pdcompile  # noqa: E402
from pdcompile.launcher import launch  # noqa: E402
from pdcompile.passes.partition_dp import plan_from_assignment  # noqa: E402
from pdcompile.zoo import mlp  # noqa: E402

CFG = dict(in_features=512, hidden=[1024, 1024, 1024], num_classes=256)
MODES = ("none", "optimizer", "full")
PARTS = ("weights", "gathered", "gradients", "optimizer_state", "activations", "receive_buffers")


def _mib(x: float) -> str:
    return f"{x / 2**20:.2f}"


def _config(**cfg: object) -> mlp.MLPConfig:
    return mlp.MLPConfig(cfg["in_features"], tuple(cfg["hidden"]), cfg["num_classes"])  # type: ignore[arg-type]


def batches(batch_size: int, seed: int = 0, **cfg: object) -> Iterator[tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
    """The emitted program's data hook: seeded batches for the benchmark's MLP."""
    c = _config(**cfg)
    i = 0
    while True:
        yield mlp.make_batch(c, torch.device("cpu"), seed + i, batch_size)
        i += 1


def _predicted(pipe, mode: str, M: int) -> float | None:  # type: ignore[no-untyped-def]
    """The planner's memory of stage 0 under ``mode`` (None where this planner has no ``shard``)."""
    assign = [(s.first, s.last, s.replicas, s.ranks) for s in pipe.plan.stages]
    try:
        plan = plan_from_assignment(pipe.state.chain, pipe.state.cluster, assign, schedule="flush",
                                    memory_limit=False, num_microbatches=M, recompute="none", shard=mode)
    except TypeError:
        return None
    return float(plan.stages[0].memory_bytes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--microbatch-size", type=int, default=2)
    ap.add_argument("--write", action="store_true", help="write the section of benchmarks/RESULTS.md")
    args = ap.parse_args()
    load_start = os.getloadavg()[0]
    cfg = _config(**CFG)
    M = args.microbatches
    (x,), y = mlp.make_batch(cfg, torch.device("cpu"), 0, M * args.microbatch_size)
    torch.manual_seed(0)
    pipe = pdcompile(mlp.MLP(cfg), example_inputs=(x,), example_target=y, loss_fn=torch.nn.CrossEntropyLoss(),
                     optimizer=lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9), stages=2, replicas=[2, 1], schedule="flush",
                     num_microbatches=M, recompute="none", shard="none")
    env = {"PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        base = pipe.emit(Path(tmp) / "base", data={"factory": "benchmarks.bench_shard:batches", "kwargs": CFG})
        for mode in MODES:
            prog = Path(tmp) / mode
            shutil.copytree(base, prog)
            plan = json.loads((prog / "plan.json").read_text())
            plan["stages"][0]["shard"] = mode
            (prog / "plan.json").write_text(json.dumps(plan, indent=1))
            out = Path(tmp) / f"m_{mode}"
            rc, log = launch(prog, 3, ["--steps", str(args.steps), "--metrics", str(out), "--timeout", "120"],
                             timeout=900, env=env)
            if rc != 0:
                raise SystemExit(f"{mode} failed (exit {rc}):\n{log[-3000:]}")
            ms = [json.loads(p.read_text()) for p in sorted(out.glob("rank_*.json"))]
            times = next(m for m in ms if m["stage"] == 1)["step_times_s"][1:]
            pred = _predicted(pipe, mode, M)
            for m in ms:
                if m["stage"] != 0:
                    continue
                meas = m["memory"]
                err = f"{(pred / meas['total'] - 1) * 100:+.1f}%" if pred else "—"
                rows.append(f"| {mode} | {m['rank']} | {statistics.median(times) * 1e3:.1f} | "
                            f"{_mib(pred) if pred else '—'} | {_mib(meas['total'])} | {err} | "
                            + " | ".join(_mib(meas.get(k, 0)) for k in PARTS) + f" | {m['peak_rss_mb']:.0f} |")
                print(rows[-1], flush=True)
    load_end = os.getloadavg()[0]
    body = (
        f"MLP {CFG} in 2 stages, replicas [2, 1] (3 ranks, gloo on CPU), flush, {M} microbatches of "
        f"{args.microbatch_size}, SGD with momentum, fp32; stage 0's mode set in plan.json; {args.steps} steps, the median step "
        f"time over steps 2..{args.steps} (the reporting rank's). Memory in MiB: the planner's prediction for stage 0 "
        f"under the mode (`plan_from_assignment(..., shard=mode)`), the replica's measured peak "
        f"(runtime/memory.py) and its parts at the peak, and the process's peak RSS. Load average "
        f"{load_start:.1f} at the start, {load_end:.1f} at the end (2 cores shared with other jobs: step times "
        f"are noisy).\n\n"
        "| mode | rank | step ms | predicted | measured | error | " + " | ".join(PARTS) + " | peak RSS MiB |\n"
        "|---|---|---|---|---|---|" + "---|" * len(PARTS) + "---|\n" + "\n".join(rows) + "\n"
    )
    print(body)
    if args.write:
        write_section("Sharded replicas: step time and memory per shard mode (bench_shard)", body)


if __name__ == "__main__":
    main()
