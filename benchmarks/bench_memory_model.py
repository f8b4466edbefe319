"""Benchmark: the planner's predicted peak memory per stage against what each stage measured in a run.

A GPT (``pdcompile.zoo.gpt``) and the zoo's small VGG (``pdcompile.zoo.get("vgg")``) are each
compiled into a 2-stage pipeline, with and without activation recomputation, and trained through torchrun (gloo, CPU) under every schedule. The prediction is
the partitioner's stage memory (weights x versions, gradients, optimizer state, saved activations
per microbatch in flight from annotate-costs' saved-tensor hooks, inputs and outputs); the
measurement is the stage's own accounting (runtime/memory.py) in the metrics JSON.

Usage: python benchmarks/bench_memory_model.py [--steps 3]
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import tempfile  # noqa: E402

import torch  # noqa: E402

from benchmarks._results import write_section  # noqa: E402
from pdcompile.api import pdcompile  # noqa: E402
from pdcompile.launcher import launch  # noqa: E402
from pdcompile.passes.partition_dp import plan_from_assignment  # noqa: E402
from pdcompile.zoo import get, gpt, vgg  # noqa: E402

CFG = dict(vocab_size=2048, seq_len=64, d_model=128, n_heads=4, n_layers=4)
SCHEDULES = ("gpipe", "flush", "1f1b", "2bw")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--microbatch-size", type=int, default=2)
    args = ap.parse_args()
    cfg = gpt.GPTConfig(**CFG)
    M = args.microbatches
    batch = M * args.microbatch_size
    (x,), y = gpt.make_batch(cfg, torch.device("cpu"), 0, batch)
    env = {"PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    rows = []
    worst = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for model_name in ("gpt", "vgg"):
            for recompute in ("none", "full"):
                if model_name == "gpt":
                    torch.manual_seed(0)
                    model, inputs, target, loss_fn = gpt.GPT(cfg), (x,), y, gpt.SequenceCrossEntropy()
                    leaf: tuple[type[torch.nn.Module], ...] = ()
                    data = {"factory": "benchmarks.bench_runtime_memory:batches", "kwargs": CFG}
                else:
                    z = get("vgg", batch_size=batch, seed=0)
                    model, inputs, target, loss_fn, leaf = z.model, z.example_inputs, z.target, z.loss_fn, z.leaf_modules
                    data = {"factory": "pdcompile.zoo:batches", "kwargs": {"name": "vgg"}}
                pipe = pdcompile(model, example_inputs=inputs, example_target=target, loss_fn=loss_fn,
                                 optimizer=lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9), stages=2,
                                 schedule="flush", num_microbatches=M, recompute=recompute, leaf_modules=leaf)
                prog = pipe.emit(Path(tmp) / f"prog_{model_name}_{recompute}", data=data)
                assign = [(s.first, s.last, s.replicas, s.ranks) for s in pipe.plan.stages]
                for name in SCHEDULES:
                    plan = plan_from_assignment(pipe.state.chain, pipe.state.cluster, assign, schedule=name,
                                                memory_limit=False, num_microbatches=M, recompute=recompute)
                    out = Path(tmp) / f"m_{model_name}_{recompute}_{name}"
                    rc, log = launch(prog, pipe.world_size, ["--schedule", name, "--steps", str(args.steps),
                                                             "--metrics", str(out), "--timeout", "120"],
                                     timeout=600, env=env)
                    if rc != 0:
                        raise SystemExit(f"{model_name} {name} failed (exit {rc}):\n{log[-3000:]}")
                    for p in sorted(out.glob("rank_*.json")):
                        m = json.loads(p.read_text())
                        s, meas = m["stage"], m["memory"]
                        pred = plan.stages[s].memory_bytes
                        err = pred / meas["total"] - 1
                        worst = max(worst, abs(err))
                        rows.append(f"| {model_name} | {name} | {recompute} | {s} | {plan.stages[s].in_flight} | "
                                    f"{pred / 2**20:.3f} | {meas['total'] / 2**20:.3f} | {err * 100:+.1f}% | "
                                    f"{meas['weights'] / 2**20:.3f} | {meas['gradients'] / 2**20:.3f} | "
                                    f"{meas['optimizer_state'] / 2**20:.3f} | {meas['activations'] / 2**20:.3f} | "
                                    f"{meas['recompute'] / 2**20:.3f} | {meas['receive_buffers'] / 2**20:.3f} |")
                        print(rows[-1], flush=True)
    load = os.getloadavg()[0]
    lines = [
        f"GPT {CFG} and the zoo's small VGG ({vgg.CONFIGS['small']}), 2 stages, {M} microbatches of "
        f"{args.microbatch_size}, SGD with momentum, {args.steps} steps, "
        f"gloo on CPU; load average at the end {load:.2f} (bytes do not depend on load). Predicted: the "
        f"partitioner's stage memory for that schedule; measured: the stage's peak at its measuring points "
        f"(runtime/memory.py), parts at that peak, MiB.",
        "",
        "| model | schedule | recompute | stage | in flight | predicted | measured | error | weights | grads "
        "| opt state | activations | rebuilt | posted receives |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        *rows, "", f"Largest error: {worst * 100:.1f}%.", "",
        "What is counted: the first stage's data are views of the minibatch; the prediction (annotate-costs "
        "runs on a microbatch with its own storage) and the measurement (the bytes a view spans) charge each "
        "microbatch in flight its own bytes, not the minibatch's storage, which the data path holds for the "
        "step in every schedule and neither counts. With recomputation the first stage keeps its data inputs "
        "(its first layer's saved input bytes in the chain). What the model leaves out: posted receive "
        "buffers (the column above: the gradients a stage has posted receives for); they are most of the "
        "remaining under-prediction of stage 0 with recomputation, where its other parts are small.",
    ]
    write_section("Memory model: predicted vs measured per stage (bench_memory_model)", "\n".join(lines))
    print("\n".join(lines[-1:]))


if __name__ == "__main__":
    main()
