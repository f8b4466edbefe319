"""``pdcompile demo``: the main job on a built-in default, no arguments needed.

1. Plans the full-size GPT-style model for a 16-GPU cluster like the paper's Cluster A
   (prediction only: plan, speedup over data parallelism, simulated timeline).
2. Profiles the small GPT-style model here (measured costs) and plans it for this machine (one
   worker per core, at least 2), explaining the choice.
3. Emits the torchrun program, trains it on CPU processes with a progress bar, and compares the
   predicted step time with the measured one.
4. Leaves everything in one folder: plans, IR dumps, emitted program, Chrome traces, timeline PNGs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import time
from pathlib import Path
from typing import Any

from pdcompile.errors import UsageError


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "demo", help="plan GPT for a 16-GPU cluster and for this machine, then train it here",
        description="Plan the GPT-style zoo model for a 16-GPU cluster like the paper's (prediction "
                    "only) and for this machine, emit the torchrun program, train it on CPU processes, "
                    "and compare predicted with measured step time. Writes everything into --out.",
        epilog="Examples:\n  pdcompile demo\n  pdcompile demo --steps 40 --schedule 1f1b --out /tmp/demo",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt", help="zoo model (default: gpt)")
    p.add_argument("--steps", type=int, default=20, help="training steps (default: 20)")
    p.add_argument("--workers", type=int, default=max(2, os.cpu_count() or 2),
                   help="local processes (default: one per core, at least 2)")
    p.add_argument("--schedule", default="flush", help="gpipe, flush, 1f1b, 2bw (default: flush)")
    p.add_argument("--stages", type=int, default=None,
                   help="force this many pipeline stages here instead of the planner's choice")
    p.add_argument("--skip-cluster", action="store_true", help="skip planning for the 16-GPU cluster")
    p.add_argument("--out", default="pdcompile-out/demo", help="output folder (default: pdcompile-out/demo)")
    p.add_argument("--json", action="store_true", help="print a JSON summary at the end")
    p.set_defaults(func=run)


def _one_step(events: list[Any], step: int, steps: int) -> list[Any]:
    """The measured events of one step (the ``step``-th optimizer step of each rank), shifted to 0."""
    from pdcompile.timeline import Event

    by_rank: dict[int, list[Any]] = {}
    for e in sorted(events, key=lambda e: e.start_s):
        by_rank.setdefault(e.rank, []).append(e)
    out = []
    starts = []
    for rank, evs in by_rank.items():
        chunks, cur = [], []
        for e in evs:
            cur.append(e)
            if e.name.endswith("ST"):
                chunks.append(cur)
                cur = []
        if len(chunks) > step:
            out += chunks[step]
            starts.append(chunks[step][0].start_s)
    t0 = min(starts, default=0.0)
    return [Event(e.rank, e.name, e.start_s - t0, e.end_s - t0, e.category) for e in out]


def _where_the_time_goes(predicted: list[Any], measured: list[Any]) -> str:
    """Per category, the busiest rank's time in one step, predicted beside measured: says which
    part of the step the cost model misses (on CPU: gloo's per-message latency, the optimizer)."""
    from pdcompile.timeline import time_by_category

    p, m = time_by_category(predicted), time_by_category(measured)
    cats = [c for c in ("forward", "backward", "recv", "send", "allreduce", "tied", "step")
            if any(c in d for d in (*p.values(), *m.values()))]
    rows = ["where the time goes (one step, the busiest rank, ms):   predicted   measured"]
    for c in cats:
        pv = max((d.get(c, 0.0) for d in p.values()), default=0.0)
        mv = max((d.get(c, 0.0) for d in m.values()), default=0.0)
        rows.append(f"  {c:<12} {pv * 1e3:41.2f} {mv * 1e3:10.2f}")
    rows.append("  (the cost model charges compute and bandwidth; a gloo message's fixed latency and the "
                "optimizer step are measured by benchmarks/bench_predicted_vs_measured.py, not here)")
    return "\n".join(rows)


def run(args: argparse.Namespace) -> int:
    import torch
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from pdcompile.api import pdcompile
    from pdcompile.cluster import local_cpu_cluster, paper_cluster
    from pdcompile.launcher import launch
    from pdcompile.timeline import plot_timeline, write_chrome_trace
    from pdcompile.trace_convert import read_runtime_events
    from pdcompile.zoo import get, names

    if args.model not in names():
        raise UsageError(f"demo: unknown zoo model {args.model!r}; choose one of {names()}")
    if args.steps < 2 or args.workers < 1:
        raise UsageError("demo: --steps must be at least 2 and --workers at least 1")
    console = Console()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    summary: dict[str, Any] = {"out": str(out)}

    # 1. The paper's kind of cluster: prediction only.
    if not args.skip_cluster:
        cluster = paper_cluster("A")
        big = get(args.model, size="full", batch_size=8, device="meta")
        console.rule(f"[bold]1. {args.model} (full size) on a 16-GPU cluster like the paper's Cluster A")
        pipe_a = pdcompile(big.model, cluster, example_inputs=big.example_inputs, loss_fn=big.loss_fn,
                           num_microbatches=1, schedule="flush", leaf_modules=big.leaf_modules)
        console.print(str(pipe_a.plan))
        sim_a = pipe_a.simulate(num_microbatches=32)
        write_chrome_trace(sim_a.events, out / "cluster_a_trace.json")
        plot_timeline(sim_a.events, None, out / "cluster_a_timeline.png",
                      title=f"{args.model} on 16 V100s (predicted, 32 microbatches)")
        (out / "cluster_a_plan.json").write_text(pipe_a.plan.to_json())
        summary["cluster_a"] = {"configuration": "-".join(str(s.replicas) for s in pipe_a.plan.stages),
                                "speedup_vs_data_parallel": pipe_a.plan.speedup_vs_data_parallel}
        console.print(f"predicted speedup over data parallelism: {pipe_a.plan.speedup_vs_data_parallel:.2f}x; "
                      f"timeline: {out / 'cluster_a_timeline.png'}")

    # 2. This machine: measured costs, planned for one worker per core.
    console.rule(f"[bold]2. {args.model} (small) on this machine: {args.workers} CPU processes")
    z = get(args.model, batch_size=16, seed=0)
    local = local_cpu_cluster(args.workers)
    pipe = pdcompile(z.model, local, example_inputs=z.example_inputs, example_target=z.target, loss_fn=z.loss_fn,
                     optimizer=lambda p: torch.optim.Adam(p, lr=3e-3), schedule=args.schedule,
                     num_microbatches=4, stages=args.stages, leaf_modules=z.leaf_modules, cost_mode="measured")
    console.print(pipe.explain())
    pipe.dump_ir(out / "ir")
    (out / "plan.json").write_text(pipe.plan.to_json())
    prog = pipe.emit(out / "program", data={"factory": "pdcompile.zoo:batches",
                                            "kwargs": {"name": args.model, "cycle": 2}})
    console.print(f"emitted {prog} (run it yourself: cd {prog} && "
                  f"torchrun --nproc-per-node={pipe.world_size} train.py --steps {args.steps})")

    # 3. Train it.
    console.rule("[bold]3. training through torchrun")
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
                                                 "--trace", str(out / "runtime_events"), "--timeout", "60"],
                         timeout=300, on_line=on_line)
    (out / "train.log").write_text(log)
    if rc != 0 or not losses:
        console.print(log[-3000:])
        console.print(f"[red]training failed (exit {rc}); full log in {out / 'train.log'}[/red]")
        return 1
    console.print(f"loss: {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps")

    # 4. Predicted vs measured.
    console.rule("[bold]4. predicted vs measured")
    sim = pipe.simulate()
    metrics = [json.loads(p.read_text()) for p in sorted((out / "metrics").glob("rank_*.json"))]
    steady = [max(ts) for ts in zip(*[m["step_times_s"][1:] for m in metrics])]
    measured = statistics.median(steady) if steady else float("nan")
    predicted = float(sim.step_time_s)
    console.print(f"step time: predicted {predicted * 1e3:.2f} ms, measured median {measured * 1e3:.2f} ms "
                  f"({measured / predicted:.2f}x the prediction; bubble predicted {float(sim.bubble_fraction):.0%})")
    measured_events = _one_step(read_runtime_events(out / "runtime_events"), step=args.steps // 2, steps=args.steps)
    console.print(_where_the_time_goes(sim.events, measured_events))
    write_chrome_trace(measured_events, out / "trace.json", process_name="pdcompile (measured)")
    write_chrome_trace(sim.events, out / "trace_predicted.json", process_name="pdcompile (predicted)")
    plot_timeline(sim.events, measured_events, out / "timeline.png",
                  title=f"{args.model}: one step on {pipe.world_size} CPU processes ({args.schedule})")
    summary.update({"stages": len(pipe.split.stages), "world_size": pipe.world_size,
                    "configuration": "-".join(str(s.replicas) for s in pipe.plan.stages),
                    "loss_first": losses[0], "loss_last": losses[-1],
                    "predicted_step_s": predicted, "measured_step_s": measured,
                    "seconds": time.perf_counter() - t_start})
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    console.print(f"timeline: {out / 'timeline.png'}; Chrome trace: {out / 'trace.json'} "
                  f"(open in https://ui.perfetto.dev); IR dumps: {out / 'ir'}")
    console.print(f"done in {summary['seconds']:.1f} s; everything is in {out}/")
    if args.json:
        print(json.dumps(summary))
    return 0
