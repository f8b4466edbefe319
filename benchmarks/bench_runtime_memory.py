"""Benchmark: peak RSS per rank for PipeDream 1F1B (weight stashing) vs PipeDream-Flush vs 2BW.

A GPT-style model (``pdcompile.zoo.gpt``, a mid-size config so weight copies show above the ~0.3 GB
that importing torch costs each process) is compiled into a 4-stage pipeline and trained a few
steps through torchrun (gloo, CPU) with each schedule. Each rank's metrics JSON gives its peak RSS
(``getrusage``), the weight versions it measured alive at once (weak references to the stashed
tensors) and the number the schedule promises (``schedules.peak_weight_versions``).

Expected: 1F1B keeps ``S - s`` versions on stage ``s`` (PipeDream's stash), Flush one, 2BW two, so
1F1B's early stages use the most memory.

Usage: python benchmarks/bench_runtime_memory.py [--stages 4] [--steps 4] [--microbatches 4]
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
from collections.abc import Iterator  # noqa: E402

import torch  # noqa: E402

from benchmarks._results import write_section  # noqa: E402
from pdcompile.api import pdcompile  # noqa: E402
from pdcompile.launcher import launch  # noqa: E402
from pdcompile.zoo import gpt  # noqa: E402

CFG = dict(vocab_size=8192, seq_len=64, d_model=384, n_heads=6, n_layers=8)
SCHEDULES = ("1f1b", "flush", "2bw")


def batches(batch_size: int, seed: int = 0, **cfg: int) -> Iterator[tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
    """The data hook of the emitted program: seeded token batches for the benchmark's GPT config."""
    c = gpt.GPTConfig(**cfg)
    i = 0
    while True:
        yield gpt.make_batch(c, torch.device("cpu"), seed + i, batch_size)
        i += 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--microbatch-size", type=int, default=2)
    args = ap.parse_args()
    cfg = gpt.GPTConfig(**CFG)
    torch.manual_seed(0)
    model = gpt.GPT(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    batch = args.microbatches * args.microbatch_size
    (x,), y = gpt.make_batch(cfg, torch.device("cpu"), 0, batch)
    rows: dict[str, dict[int, dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        pipe = pdcompile(model, example_inputs=(x,), example_target=y, loss_fn=gpt.SequenceCrossEntropy(),
                         optimizer=lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9), stages=args.stages,
                         schedule="flush", num_microbatches=args.microbatches)
        prog = pipe.emit(Path(tmp) / "prog", data={"factory": "benchmarks.bench_runtime_memory:batches",
                                                   "kwargs": CFG})
        stage_mb = {k: sum(t.numel() * t.element_size() for t in torch.load(
            prog / f"stage_{k}.pt", weights_only=True).values()) / 2**20 for k in range(args.stages)}
        env = {"PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        for name in SCHEDULES:
            out = Path(tmp) / f"metrics_{name}"
            rc, log = launch(prog, pipe.world_size, ["--schedule", name, "--steps", str(args.steps),
                                                     "--metrics", str(out), "--timeout", "120"],
                             timeout=900, env=env)
            if rc != 0:
                raise SystemExit(f"{name} failed (exit {rc}):\n{log[-3000:]}")
            rows[name] = {int(p.stem.split("_")[1]): json.loads(p.read_text()) for p in out.glob("rank_*.json")}
            print(name, {r: round(m["peak_rss_mb"]) for r, m in sorted(rows[name].items())}, flush=True)
    lines = [
        f"GPT {CFG} ({n_params / 1e6:.1f}M parameters), {args.stages} stages, one rank each, "
        f"{args.steps} x {args.microbatches} microbatches of {args.microbatch_size} sequences, SGD with momentum, "
        f"gloo on CPU. RSS = peak resident set size of the rank (`getrusage`), including the ~0.3 GB every "
        f"process pays to import torch. Versions: measured alive at once / promised by the schedule.",
        "",
        "| stage | weights (MB) | " + " | ".join(f"{s} versions | {s} peak RSS (MB)" for s in SCHEDULES) + " |",
        "|---|---|" + "---|---|" * len(SCHEDULES),
    ]
    for r in sorted(rows[SCHEDULES[0]]):
        cells = [f"{rows[s][r]['weight_versions']}/{rows[s][r]['weight_versions_promised']} | "
                 f"{rows[s][r]['peak_rss_mb']:.0f}" for s in SCHEDULES]
        lines.append(f"| {rows[SCHEDULES[0]][r]['stage']} | {stage_mb[rows[SCHEDULES[0]][r]['stage']]:.1f} | "
                     + " | ".join(cells) + " |")
    total = {s: sum(m["peak_rss_mb"] for m in rows[s].values()) for s in SCHEDULES}
    lines += ["", "Sum over ranks (MB): " + ", ".join(f"{s} {total[s]:.0f}" for s in SCHEDULES) + "."]
    write_section("Runtime memory: 1F1B vs Flush vs 2BW (bench_runtime_memory)", "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
