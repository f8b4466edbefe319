"""Benchmark: a 2x-replicated stage under each shard mode (``none``, ``optimizer``, ``full``): step
time, and each replica's peak memory, measured (runtime/memory.py) against the planner's prediction.

A wide MLP (``pdcompile.zoo.mlp``, untied: ``full`` refuses a stage with a parameter tied to another)
compiled into 2 stages with replicas [2, 1] (3 ranks, flush, SGD with momentum),
its stage 0 given each mode in plan.json, trained through torchrun (gloo, CPU). Step time: the median
over the steps after the first (the reporting rank's). Memory: stage 0's replicas' own accounting
(weights, or under ``full`` the replica's shard plus the gathered working copy while held;
gradients; optimizer state; activations; receive buffers). Predicted: the planner's stage memory
for the same stages under the mode (``plan_from_assignment(..., shard=mode)``), where it has one.

``--variants``: instead, what the suite does not run: a stage of 2 replicas under a mode against
the same program under ``none`` (3 steps, Adam, final weights' largest difference), with ``--precision
bf16``, with ``recompute="full"``, with validation passes (``--eval-data``, their losses too), under
2BW (``optimizer``), and the GPT whose embedding is tied across stages (``optimizer``; ``full`` is
refused there).

Usage: python benchmarks/bench_shard.py [--steps 6] [--variants] [--write]
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
from pdcompile.merge import merge_weights  # noqa: E402
from pdcompile.zoo import batches as zoo_batches  # noqa: E402
from pdcompile.zoo import get, mlp  # noqa: E402

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


def eval_batches(batch_size: int) -> list[tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
    """``--variants``' validation data (``--eval-data benchmarks.bench_shard:eval_batches``): 2 minibatches."""
    it = zoo_batches(batch_size, "mlp", seed=1000)
    return [next(it) for _ in range(2)]


VARIANTS = (  # (name, zoo model, replicas, mode, compile options, train.py flags)
    ("bf16", "mlp", [2, 1], "full", {}, ["--precision", "bf16"]),
    ("recompute full", "mlp", [2, 1], "full", {"recompute": "full"}, []),
    ("validation", "mlp", [2, 1], "full", {}, ["--eval-data", "benchmarks.bench_shard:eval_batches", "--eval-every", "1"]),
    ("2bw", "mlp", [2, 1], "optimizer", {}, ["--schedule", "2bw"]),
    ("tied embedding (GPT)", "gpt", [2, 1, 1], "optimizer", {}, []),
)


def variants(tmp: Path, env: dict[str, str]) -> list[str]:
    """Each variant under its mode and under ``none``: the final weights' largest difference, and the
    validation losses' where there are some."""
    rows = []
    for name, model, reps, mode, kw, flags in VARIANTS:
        got: dict[str, tuple[dict[str, torch.Tensor], list[float]]] = {}
        for m in ("none", mode):
            z = get(model, batch_size=8, seed=0)
            pipe = pdcompile(z.model, example_inputs=z.example_inputs, example_target=z.target, loss_fn=z.loss_fn,
                             optimizer=lambda p: torch.optim.Adam(p, lr=0.01), stages=len(reps), replicas=reps,
                             schedule="flush", num_microbatches=4, leaf_modules=z.leaf_modules,
                             shard=[m] + ["none"] * (len(reps) - 1), **kw)
            d = tmp / f"{name.split()[0]}_{m}"
            prog = pipe.emit(d / "prog", data={"factory": "pdcompile.zoo:batches", "kwargs": {"name": model}})
            rc, log = launch(prog, sum(reps), ["--steps", "3", "--save-final", str(d / "w"), "--metrics", str(d / "m"),
                                               "--timeout", "120", *flags], timeout=900, env=env)
            if rc != 0:
                raise SystemExit(f"{name} {m} failed (exit {rc}):\n{log[-3000:]}")
            evals = [e["loss"] for p in sorted((d / "m").glob("rank_*.json")) for e in json.loads(p.read_text())["eval"]]
            got[m] = (merge_weights(prog, d / "w"), evals)
        (a, ea), (b, eb) = got["none"], got[mode]
        diff = max(float((a[k].double() - b[k].double()).abs().max()) for k in a)
        ediff = max((abs(x - y) for x, y in zip(ea, eb)), default=None)
        rows.append(f"| {name} | {mode} | {'x'.join(map(str, reps))} | {diff:.3g} | "
                    f"{'—' if ediff is None else f'{ediff:.3g} ({len(eb)} losses)'} |")
        print(rows[-1], flush=True)
    return rows


def _predicted(pipe, mode: str, M: int) -> tuple[float, float] | None:  # type: ignore[no-untyped-def]
    """The planner's (memory, time per minibatch) of stage 0 under ``mode`` (None where this planner has
    no ``shard``)."""
    assign = [(s.first, s.last, s.replicas, s.ranks) for s in pipe.plan.stages]
    try:
        plan = plan_from_assignment(pipe.state.chain, pipe.state.cluster, assign, schedule="flush",
                                    memory_limit=False, num_microbatches=M, recompute="none", shard=mode)
    except TypeError:
        return None
    return float(plan.stages[0].memory_bytes), float(plan.stages[0].time_s)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--microbatch-size", type=int, default=2)
    ap.add_argument("--variants", action="store_true", help="each mode against none under other options")
    ap.add_argument("--write", action="store_true", help="write the section of benchmarks/RESULTS.md")
    args = ap.parse_args()
    load_start = os.getloadavg()[0]
    env = {"PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    if args.variants:
        with tempfile.TemporaryDirectory() as tmp:
            vrows = variants(Path(tmp), env)
        body = (f"Each variant trains 3 steps (Adam, 4 microbatches of 2, flush unless named) with its first stage's "
                f"2 replicas under the mode, and again under `none`; the largest difference of the final weights, "
                f"and of the validation losses where the run has some. Load average {load_start:.1f} at the start, "
                f"{os.getloadavg()[0]:.1f} at the end.\n\n"
                "| variant | mode | replicas | weights: largest difference | validation losses: largest difference |\n"
                "|---|---|---|---|---|\n" + "\n".join(vrows) + "\n")
        print(body)
        if args.write:
            write_section("Sharded replicas against none under other options (bench_shard --variants)", body)
        return
    cfg = _config(**CFG)
    M = args.microbatches
    (x,), y = mlp.make_batch(cfg, torch.device("cpu"), 0, M * args.microbatch_size)
    torch.manual_seed(0)
    pipe = pdcompile(mlp.MLP(cfg), example_inputs=(x,), example_target=y, loss_fn=torch.nn.CrossEntropyLoss(),
                     optimizer=lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9), stages=2, replicas=[2, 1], schedule="flush",
                     num_microbatches=M, recompute="none", shard="none")
    rows = []
    step: dict[str, tuple[float, float | None]] = {}  # mode: (measured median step s, stage 0's predicted s)
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
            got = _predicted(pipe, mode, M)
            pred, secs = got if got else (None, None)
            step[mode] = (statistics.median(times), secs)
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
    t0, p0 = step["none"]
    trows = [f"| {m} | {t * 1e3:.1f} | {(t - t0) * 1e3:+.1f} | "
             + (f"{p * 1e3:.2f} | {(p - p0) * 1e3:+.2f} | +0.00 |" if p is not None and p0 is not None else "— | — | — |")
             for m, (t, p) in step.items()]
    cl = pipe.state.cluster
    body = (
        f"MLP {CFG} in 2 stages, replicas [2, 1] (3 ranks, gloo on CPU), flush, {M} microbatches of "
        f"{args.microbatch_size}, SGD with momentum, fp32; stage 0's mode set in plan.json; {args.steps} steps, the median step "
        f"time over steps 2..{args.steps} (the reporting rank's). Memory in MiB: the planner's prediction for stage 0 "
        f"under the mode (`plan_from_assignment(..., shard=mode)`), the replica's measured peak "
        f"(runtime/memory.py) and its parts at the peak, and the process's peak RSS. Load average "
        f"{load_start:.1f} at the start, {load_end:.1f} at the end (2 cores shared with other jobs: step times "
        f"are noisy).\n\n"
        "| mode | rank | step ms | predicted | measured | error | " + " | ".join(PARTS) + " | peak RSS MiB |\n"
        "|---|---|---|---|---|---|" + "---|" * len(PARTS) + "---|\n" + "\n".join(rows) + "\n\n"
        f"Step time per mode against `none`: measured (the median above) and the planner's time per minibatch "
        f"of the replicated stage 0 (`time_s` of the same plan under the mode, on the compiled cluster: "
        f"{cl.levels[0].count} workers at {cl.levels[0].bandwidth / 1e9:.3g} GB/s), under the charge of "
        f"`sharding.comm_factors` and under the charge before it (every mode `none`'s all-reduce: +0).\n\n"
        "| mode | measured step ms | measured vs none | stage 0 predicted ms | predicted vs none | before: vs none |\n"
        "|---|---|---|---|---|---|\n" + "\n".join(trows) + "\n"
    )
    print(body)
    if args.write:
        write_section("Sharded replicas: step time and memory per shard mode (bench_shard)", body)


if __name__ == "__main__":
    main()
