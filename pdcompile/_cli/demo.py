"""``pdcompile demo``: the main job on a built-in default, no arguments needed."""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from pathlib import Path
from typing import Any

from pdcompile.errors import UsageError


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "demo", help="compile, plan and train the GPT-style zoo model on this machine",
        description="Profile the GPT-style zoo model, plan it for a 16-GPU cluster like the paper's "
                    "(prediction only) and for this machine, emit the torchrun program, train it on "
                    "CPU processes, and compare predicted with measured step time.",
        epilog="Examples:\n  pdcompile demo\n  pdcompile demo --steps 30 --out /tmp/demo",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt", help="zoo model (default: gpt)")
    p.add_argument("--steps", type=int, default=20, help="training steps (default: 20)")
    p.add_argument("--workers", type=int, default=max(2, min(4, os.cpu_count() or 2)),
                   help="local processes (default: one per core, at least 2)")
    p.add_argument("--schedule", default="flush", help="gpipe, flush, 1f1b, 2bw (default: flush)")
    p.add_argument("--out", default="pdcompile-out/demo", help="output folder (default: pdcompile-out/demo)")
    p.add_argument("--json", action="store_true", help="print a JSON summary at the end")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from pdcompile.api import pdcompile
    from pdcompile.launcher import launch
    from pdcompile.zoo import get, names

    if args.model not in names():
        raise UsageError(f"demo: unknown zoo model {args.model!r}; choose one of {names()}")
    if args.steps < 1 or args.workers < 1:
        raise UsageError("demo: --steps and --workers must be at least 1")
    console = Console()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    z = get(args.model, batch_size=16, seed=0)
    pipe = pdcompile(z.model, example_inputs=z.example_inputs, example_target=z.target, loss_fn=z.loss_fn,
                     optimizer=lambda p: torch.optim.Adam(p, lr=3e-3), stages=args.workers,
                     schedule=args.schedule, num_microbatches=4, leaf_modules=z.leaf_modules)
    console.print(f"[bold]pdcompile demo[/bold]: {args.model} ({sum(p.numel() for p in z.model.parameters()):,} "
                  f"parameters) as a {len(pipe.split.stages)}-stage pipeline on {pipe.world_size} CPU processes")
    for st in pipe.split.stages:
        console.print(f"  stage {st.index}: {len(st.nodes)} nodes ({st.nodes[0]} .. {st.nodes[-1]}), "
                      f"receives {len(st.inputs)} tensor(s), sends {len(st.outputs)}")
    pipe.dump_ir(out / "ir")
    prog = pipe.emit(out / "program", data={"factory": "pdcompile.zoo:batches", "kwargs": {"name": args.model, "cycle": 2}})
    console.print(f"emitted the program to {prog} (run it yourself: cd {prog} && "
                  f"torchrun --nproc-per-node={pipe.world_size} train.py --steps {args.steps})")
    losses: list[float] = []
    pat = re.compile(r"step (\d+)\b.*? loss ([0-9.eE+-]+)")
    with Progress(TextColumn("training"), BarColumn(), TextColumn("{task.completed}/{task.total} steps"),
                  TextColumn("loss {task.fields[loss]}"), TimeElapsedColumn(), console=console) as bar:
        task = bar.add_task("train", total=args.steps, loss="-")

        def on_line(line: str) -> None:
            m = pat.search(line)
            if m:
                losses.append(float(m.group(2)))
                bar.update(task, completed=int(m.group(1)), loss=f"{losses[-1]:.4f}")

        rc, log = launch(prog, pipe.world_size, ["--steps", str(args.steps), "--metrics", str(out / "metrics"),
                                                 "--trace", str(out / "trace"), "--timeout", "60"],
                         timeout=300, on_line=on_line)
    (out / "train.log").write_text(log)
    if rc != 0:
        console.print(log[-3000:])
        console.print(f"[red]training failed (exit {rc}); full log in {out / 'train.log'}[/red]")
        return 1
    console.print(f"loss: {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps")
    summary = {"out": str(out), "stages": len(pipe.split.stages), "loss_first": losses[0], "loss_last": losses[-1],
               "seconds": time.perf_counter() - t_start}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    console.print(f"done in {summary['seconds']:.1f} s; everything is in {out}/")
    if args.json:
        print(json.dumps(summary))
    return 0
