"""``pdcompile demo``: what PipeDream is for, in three parts, no arguments needed.

(a) The paper's headline case, ``pipedream:vgg16`` on its Cluster A (4 servers x 4 V100): the plan
    ``pdcompile plan`` prints for it (its own parser and code), its predicted speedup over data
    parallelism beside the paper's measured one; then each cost model's answer, marked where it does
    not fit the device's memory; bytes moved, a timeline PNG.
(b) The same story measured here: a VGG-shaped model emitted for two CPU processes on an emulated
    slow link (:mod:`pdcompile.slowlink`), trained beside DDP: step times, their ratio, both losses.
(c) That pipeline's step predicted before it ran (:mod:`pdcompile.calibrate`) against the measured
    median, category by category.
Everything lands in ``--out`` (default ``pdcompile-out/demo``); ``summary.json`` holds every number.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pdcompile.errors import UsageError

# SOSP'19 Table 1, Cluster A: the configuration PipeDream chose and its measured speedup over data parallelism.
PAPER_A = {"pipedream:vgg16": ("15-1", 5.28), "pipedream:alexnet": ("15-1", 4.92), "pipedream:resnet50": ("16", 1.0)}
PAPER_COMM_REDUCTION = 0.95  # SOSP'19: "up to 95%" less communication than data parallelism
TOLERANCE = 0.25  # (c): predicted within 25% of measured
JUDGED_SHARE = 0.05  # (c): categories smaller than this share of the measured step are shown, not judged
WARMUP = 4  # steps of each local run left out of medians
NUM_MICROBATCHES = 4
BATCH = 32
# The runs are timed as a user runs them: the test suite's NCCL-rules mode (runtime/comm.py) moves
# every transfer onto a per-peer thread, another timing than the one predicted.
NO_NCCL_RULES = {"PDCOMPILE_NCCL_RULES": "0"}


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "demo", help="PipeDream's VGG-16 case on its Cluster A, then a pipeline beating DDP here on a slow link",
        description="(a) plan VGG-16 from PipeDream's own profile for the paper's Cluster A and compare with the "
                    "paper's 5.28x; (b) train a 2-stage pipeline and DistributedDataParallel here on an emulated "
                    "slow link and measure both; (c) compare that pipeline's predicted step with the measured one, "
                    "category by category. Writes everything into --out.",
        epilog="Examples:\n  pdcompile demo\n  pdcompile demo --link-mbps 50 --steps 30 --out /tmp/demo",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=16, help=f"training steps of each local run (default: 16; the "
                                                         f"first {WARMUP} are warm-up)")
    p.add_argument("--link-mbps", type=float, default=20.0,
                   help="emulated link between the two processes, MB/s (default: 20, i.e. 160 Mbit/s)")
    p.add_argument("--profile", default="pipedream:vgg16", help="profile for part (a) (default: pipedream:vgg16)")
    p.add_argument("--cost-model", default=None,
                   help="cost model of part (a)'s first plan (default: pdcompile plan's, the one with memory)")
    p.add_argument("--refresh-constants", action="store_true",
                   help="measure this machine's constants again instead of reading the cache")
    p.add_argument("--skip-cluster", action="store_true", help="skip part (a)")
    p.add_argument("--out", default="pdcompile-out/demo", help="output folder (default: pdcompile-out/demo)")
    p.add_argument("--json", action="store_true", help="print the JSON summary at the end")
    p.set_defaults(func=run)


# ---------------------------------------------------------------------------------------------
# (a) VGG-16 on Cluster A, from PipeDream's profile


def comm_bytes_per_minibatch(plan: Any, chain: Any) -> float:
    """Bytes all workers together move per minibatch under ``plan``: each boundary's activations
    forward and gradients back, and each replicated stage's ring all-reduce (``2 (r-1)/r`` of its
    weights per minibatch, as ``r`` replicas sync once per ``r`` minibatches)."""
    scale = plan.microbatch_size / chain.batch_size
    total = 0.0
    for st in plan.stages:
        if st.index < len(plan.stages) - 1:
            total += 2 * chain.cut_bytes[st.last] * scale
        if st.replicas > 1:
            w = sum(l.param_bytes for l in chain.layers[st.first:st.last + 1])
            total += 2 * (st.replicas - 1) / st.replicas * w
    return total


def data_parallel_bytes_per_minibatch(chain: Any, workers: int) -> float:
    """Bytes data parallelism on ``workers`` moves per minibatch: its ring all-reduce of every weight."""
    return 2 * (workers - 1) / workers * sum(l.param_bytes for l in chain.layers) if workers > 1 else 0.0


def _load_profile(name: str) -> Any:
    from pdcompile.profile import load

    return load(name)


def plan_argv(profile: str, cost_model: str | None = None) -> list[str]:
    """The ``pdcompile plan`` command line part (a) shows (``cost_model`` None: the command's default)."""
    return ["plan", "--profile", profile, "--cluster", "paper:A",
            *(["--cost-model", cost_model] if cost_model is not None else [])]


def cli_plan(argv: Sequence[str]) -> Any:
    """The plan ``pdcompile ARGV`` prints: the plan command's own parser, defaults and code."""
    from pdcompile._cli import plan as plan_cmd

    parser = argparse.ArgumentParser(prog="pdcompile")
    plan_cmd.register(parser.add_subparsers())
    return plan_cmd.plan_for(parser.parse_args(list(argv)))


def memory_verdict(plan: Any, device_memory: float | None) -> tuple[bool, str]:
    """Whether every worker of ``plan`` fits ``device_memory``, and a line that says so (naming the
    stage over it)."""
    from pdcompile.cluster import format_quantity

    worst = max(plan.stages, key=lambda st: st.memory_bytes)
    need = format_quantity(worst.memory_bytes, "memory")
    if device_memory is None:
        return True, f"memory: at most {need} per worker (the device's memory is not given)"
    cap = format_quantity(device_memory, "memory")
    if worst.memory_bytes <= device_memory:
        return True, f"memory: fits, at most {need} per worker of the device's {cap}"
    return False, (f"memory: EXCEEDS DEVICE MEMORY, stage {worst.index} needs {need} per worker, over the "
                   f"device's {cap}")


def _plain(console: Any, text: str) -> None:
    """Print ``text`` as it is: no markup, no highlighting, no wrapping (plan lines equal the CLI's)."""
    console.print(text, markup=False, highlight=False, soft_wrap=True)


def part_a(args: argparse.Namespace, out: Path, console: Any) -> dict[str, Any]:
    """The plan ``pdcompile plan --profile PROFILE --cluster paper:A`` prints, beside the paper's
    measured speedup; then each cost model's answer, as ``--cost-model X`` prints it, each marked by
    whether it fits the device's memory."""
    from pdcompile.cluster import format_quantity, paper_cluster
    from pdcompile.passes.linearize import linearize
    from pdcompile.passes.partition_dp import COST_MODELS
    from pdcompile.simulate import simulate_plan
    from pdcompile.timeline import plot_timeline, write_chrome_trace

    if args.cost_model is not None and args.cost_model not in COST_MODELS:
        raise UsageError(f"demo: unknown cost model {args.cost_model!r}; the planner has {', '.join(COST_MODELS)}")
    cluster = paper_cluster("A")
    chain = linearize(_load_profile(args.profile))
    console.rule(f"[bold](a) {args.profile} on the paper's Cluster A: 4 servers x 4 V100, 10 GB/s inside, "
                 f"10 Gbit/s between")
    argv = plan_argv(args.profile, args.cost_model)
    p = cli_plan(argv)
    cost_model = p.cost_model
    _plain(console, "$ pdcompile " + " ".join(argv))
    _plain(console, p.table())
    fits, verdict = memory_verdict(p, cluster.device.memory)
    x = p.speedup_vs_data_parallel
    console.print(f"[bold]predicted speedup over data parallelism: {x:.2f}x[/bold] with {p.configuration} "
                  f"(cost model `{cost_model}`)")
    console.print(verdict if fits else f"[bold red]{verdict}[/bold red]", highlight=False)
    paper_config, paper_x = PAPER_A.get(args.profile, (None, None))
    if paper_x is not None:
        console.print(f"[bold]the paper measured {paper_x:.2f}x[/bold] with {paper_config} (SOSP'19 Table 1): "
                      f"predicted / measured = {x / paper_x:.2f}")
    console.print("each cost model's answer for the same profile and cluster:")
    answers: dict[str, dict[str, Any]] = {}
    for m in COST_MODELS:
        q = p if m == cost_model else cli_plan(plan_argv(args.profile, m))
        ok, line = memory_verdict(q, cluster.device.memory)
        _plain(console, f"  cost model `{m}` (pdcompile {' '.join(plan_argv(args.profile, m))}):")
        for text in plan_lines(q):
            _plain(console, "    " + text)
        console.print("    " + (line if ok else f"[bold red]{line}[/bold red]"), highlight=False)
        answers[m] = {"configuration": q.configuration, "speedup_vs_data_parallel": q.speedup_vs_data_parallel,
                      "peak_memory_bytes": max(st.memory_bytes for st in q.stages), "fits": ok}
    pipe_b = comm_bytes_per_minibatch(p, chain)
    dp_b = data_parallel_bytes_per_minibatch(chain, cluster.num_workers)
    less = 1 - pipe_b / dp_b if dp_b else 0.0
    console.print(f"communication per minibatch, all workers together: {format_quantity(pipe_b, 'memory')} "
                  f"(activations and gradients at the cuts, all-reduce of replicated stages) against data "
                  f"parallelism's {format_quantity(dp_b, 'memory')} (all-reduce of all "
                  f"{format_quantity(sum(l.param_bytes for l in chain.layers), 'memory')} of weights): "
                  f"[bold]{abs(less):.0%} {'less' if less >= 0 else 'more'}[/bold] (the paper: up to "
                  f"{PAPER_COMM_REDUCTION:.0%} less)")
    M = 4 * max(st.replicas for st in p.stages)
    sim = simulate_plan(p, chain, cluster, "1f1b", M)
    png = out / "cluster_a_timeline.png"
    plot_timeline(sim.events, None, png, title=f"VGG-16 on Cluster A, {p.configuration} "
                                               f"(predicted, 1F1B, {M} minibatches)")
    write_chrome_trace(sim.events, out / "cluster_a_trace.json", process_name="VGG-16 on Cluster A (predicted)")
    (out / "cluster_a_plan.json").write_text(p.to_json(indent=1))
    console.print(f"timeline: {png}")
    return {"profile": args.profile, "cost_model": cost_model, "configuration": p.configuration,
            "speedup_vs_data_parallel": x, "fits": fits, "paper_speedup": paper_x,
            "paper_configuration": paper_config, "cost_models": answers,
            "other_cost_models": {m: a for m, a in answers.items() if m != cost_model},
            "comm_bytes_per_minibatch": pipe_b, "data_parallel_comm_bytes_per_minibatch": dp_b,
            "comm_reduction": less, "timeline": str(png)}


def plan_lines(plan: Any) -> list[str]:
    """The lines of ``plan``'s table that give its answer: what it is, its predicted time, its speedup."""
    return [ln for ln in plan.table().splitlines()
            if ln.startswith(("plan for ", "predicted: ", "data parallel on "))]


# ---------------------------------------------------------------------------------------------
# (b) a pipeline against DDP here, on an emulated slow link


def run_module(module: str, nproc: int, args: Sequence[str], *, env: dict[str, str], timeout: float,
               on_line: Callable[[str], None] | None = None) -> tuple[int, str]:
    """``torchrun -m module args`` on 127.0.0.1; (exit status, output); ``on_line`` sees each line."""
    from pdcompile.launcher import free_port, run_streaming

    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", "--max-restarts=0", "--monitor-interval=0.5", "-m", module, *args]
    return run_streaming(cmd, env={**NO_NCCL_RULES, **env}, timeout=timeout, on_line=on_line)


def _train(console: Any, label: str, module: str, args: Sequence[str], env: dict[str, str], steps: int,
           pattern: str, log_path: Path) -> None:
    """Run a training job with a progress bar; raise with the log's tail if it fails."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    pat = re.compile(pattern)
    with Progress(TextColumn(f"{label:<9}"), BarColumn(), TextColumn("{task.completed}/{task.total} steps"),
                  TimeElapsedColumn(), console=console, transient=False) as bar:
        task = bar.add_task(label, total=steps)

        def on_line(line: str) -> None:
            m = pat.search(line)
            if m:
                bar.update(task, completed=int(m.group(1)))

        rc, log = run_module(module, 2, args, env=env, timeout=300, on_line=on_line)
        bar.update(task, completed=steps if rc == 0 else bar.tasks[0].completed)
    log_path.write_text(log)
    if rc != 0:
        raise RuntimeError(f"{label} failed (exit {rc}); log in {log_path}:\n{log[-3000:]}")


def steady_steps(per_rank: Sequence[Sequence[float]], warmup: int = WARMUP) -> list[float]:
    """Per step the slowest rank's time, the first ``warmup`` steps left out."""
    return [max(ts) for ts in list(zip(*per_rank))[warmup:]]


def part_b(args: argparse.Namespace, out: Path, console: Any) -> dict[str, Any]:
    """Plan, emit and train the demo model as a pipeline on the slow link, then DDP on the same link."""
    import torch

    from pdcompile import slowlink
    from pdcompile._cli import _demo_model as dm
    from pdcompile.api import pdcompile
    from pdcompile.cluster import local_cpu_cluster
    from pdcompile.runtime.logs import last_stage_losses

    bps = args.link_mbps * 1e6
    console.rule(f"[bold](b) here: 2 CPU processes joined by an emulated {args.link_mbps:g} MB/s link "
                 f"({args.link_mbps * 8:g} Mbit/s)")
    torch.set_num_threads(1)  # profile as each runtime process runs (OMP_NUM_THREADS=1)
    d = dm.build(BATCH)
    pipe = pdcompile(d.model, local_cpu_cluster(2, bandwidth=bps), example_inputs=d.example_inputs,
                     example_target=d.target, loss_fn=d.loss_fn, optimizer=dm.optimizer, schedule="flush",
                     num_microbatches=NUM_MICROBATCHES, leaf_modules=d.leaf_modules, cost_mode="measured")
    if len(pipe.plan.stages) < 2:  # the story needs a pipeline; say so when the planner would not pick one
        console.print(f"the planner chose {pipe.plan.configuration} (no pipeline); forcing 2 stages")
        pipe = pdcompile(d.model, local_cpu_cluster(2, bandwidth=bps), example_inputs=d.example_inputs,
                         example_target=d.target, loss_fn=d.loss_fn, optimizer=dm.optimizer, schedule="flush",
                         num_microbatches=NUM_MICROBATCHES, stages=2, leaf_modules=d.leaf_modules,
                         cost_mode="measured")
    params = sum(p.numel() * p.element_size() for p in d.model.parameters())
    console.print(f"model: {dm.__doc__.splitlines()[0].rstrip('.')}; {params / 4e6:.1f}M parameters, minibatch "
                  f"{BATCH}, SGD with momentum")
    console.print(pipe.explain())
    pipe.dump_ir(out / "ir")
    (out / "plan.json").write_text(pipe.plan.to_json(indent=1))
    prog = pipe.emit(out / "program", data={"factory": "pdcompile._cli._demo_model:batches", "kwargs": {}})
    env = {slowlink.ENV: str(bps)}
    steps = str(args.steps)
    console.print(f"emitted {prog}; run it yourself: {slowlink.ENV}={bps:g} torchrun --nproc-per-node=2 "
                  f"-m pdcompile.slowlink {prog} --steps {steps}")
    _train(console, "pipeline", "pdcompile.slowlink",
           [str(prog), "--steps", steps, "--metrics", str(out / "metrics"), "--trace", str(out / "runtime_events"),
            "--timeout", "60"], env, args.steps, r"step (\d+)\b.*? loss ", out / "train.log")
    _train(console, "DDP", "pdcompile.ddp_worker",
           ["--model", "pdcompile._cli._demo_model:build", "--model-kwargs", json.dumps({"batch_size": BATCH}),
            "--data", "pdcompile._cli._demo_model:batches", "--optimizer", "pdcompile._cli._demo_model:optimizer",
            "--batch", str(BATCH), "--steps", steps, "--out", str(out / "ddp.json")],
           env, args.steps, r"ddp step (\d+)\b", out / "ddp.log")
    metrics = [json.loads(p.read_text()) for p in sorted((out / "metrics").glob("rank_*.json"))]
    losses, M = last_stage_losses(metrics), NUM_MICROBATCHES  # every replica's of the last stage, in order
    pipe_losses = [statistics.fmean(losses[i * M:(i + 1) * M]) for i in range(len(losses) // M)]
    ddp = json.loads((out / "ddp.json").read_text())
    pipe_s = statistics.median(steady_steps([m["step_times_s"] for m in metrics]))
    ddp_s = statistics.median(steady_steps(ddp["step_times_s"]))
    chain, plan = pipe.state.chain, pipe.plan
    cut_b = comm_bytes_per_minibatch(plan, chain) * M  # per step of M microbatches
    ddp_b = data_parallel_bytes_per_minibatch(chain, 2) / 2  # per rank, as each rank's link carries its own
    _print_b(console, pipe, pipe_s, ddp_s, pipe_losses, ddp["losses"], cut_b, ddp_b, args)
    _plot_losses(pipe_losses, ddp["losses"], out / "losses.png")
    return {"pipe": pipe, "program": str(prog), "link_bytes_per_s": bps, "stages": len(plan.stages),
            "configuration": plan.configuration, "pipeline_step_s": pipe_s, "ddp_step_s": ddp_s,
            "pipeline_over_ddp": ddp_s / pipe_s, "pipeline_losses": pipe_losses, "ddp_losses": ddp["losses"],
            "pipeline_bytes_per_step": cut_b, "ddp_bytes_per_step_per_rank": ddp_b,
            "planner_speedup_vs_data_parallel": plan.speedup_vs_data_parallel}


def _print_b(console: Any, pipe: Any, pipe_s: float, ddp_s: float, pipe_losses: list[float],
             ddp_losses: list[float], cut_b: float, ddp_b: float, args: argparse.Namespace) -> None:
    from rich.table import Table

    from pdcompile.cluster import format_quantity

    t = Table(title=f"measured on this machine, {args.link_mbps:g} MB/s emulated link, median of steps "
                    f"{WARMUP + 1}-{args.steps}", title_justify="left")
    for col in ("", "step (ms)", "bytes over the link per step", "loss: first -> last"):
        t.add_column(col, justify="right" if col else "left")
    t.add_row(f"pipeline {pipe.plan.configuration} (flush, {NUM_MICROBATCHES} microbatches)",
              f"{pipe_s * 1e3:.1f}", f"{format_quantity(cut_b, 'memory')} (the cut)",
              f"{pipe_losses[0]:.4f} -> {pipe_losses[-1]:.4f}")
    t.add_row("DistributedDataParallel x2", f"{ddp_s * 1e3:.1f}", f"{format_quantity(ddp_b, 'memory')} per rank "
              f"(all-reduce)", f"{ddp_losses[0]:.4f} -> {ddp_losses[-1]:.4f}")
    console.print(t)
    console.print(f"[bold]measured: the pipeline is {ddp_s / pipe_s:.2f}x as fast as DDP[/bold]")
    console.print("(DDP step / pipeline step; above 1: the pipeline wins). Same model, data, optimizer and "
                  "synchronous updates, so the losses agree up to float rounding:")
    every = max(1, len(pipe_losses) // 8)
    shown = list(range(0, len(pipe_losses), every))
    if shown[-1] != len(pipe_losses) - 1:
        shown.append(len(pipe_losses) - 1)
    console.print("  step     " + "".join(f"{i + 1:>8d}" for i in shown))
    console.print("  pipeline " + "".join(f"{pipe_losses[i]:8.4f}" for i in shown))
    console.print("  DDP      " + "".join(f"{ddp_losses[i]:8.4f}" for i in shown if i < len(ddp_losses)))


def _plot_losses(pipe_losses: list[float], ddp_losses: list[float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), layout="constrained")
    ax.plot(range(1, len(pipe_losses) + 1), pipe_losses, marker="o", label="pipeline (pdcompile)")
    ax.plot(range(1, len(ddp_losses) + 1), ddp_losses, marker="x", linestyle="--", label="DDP")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# (c) predicted vs measured


CATEGORIES = ("forward", "backward", "send", "recv", "step")
_LABELS = {"forward": "forward", "backward": "backward (incl. weight-gradient passes)", "send": "posting sends",
           "recv": "waiting to receive (transfer, bubble)", "step": "optimizer step"}


def steps_by_rank(events: Sequence[Any]) -> dict[int, list[list[Any]]]:
    """Each rank's events cut into optimizer steps (a step ends with its ``ST``)."""
    by_rank: dict[int, list[Any]] = {}
    for e in sorted(events, key=lambda e: e.start_s):
        by_rank.setdefault(e.rank, []).append(e)
    out: dict[int, list[list[Any]]] = {}
    for rank, evs in by_rank.items():
        chunks, cur = [], []
        for e in evs:
            cur.append(e)
            if e.name.endswith("ST"):
                chunks.append(cur)
                cur = []
        out[rank] = chunks
    return out


def _kind(name: str) -> str:
    return name.lstrip("0123456789").rstrip("0123456789")


def category_times(step_events: dict[int, list[Any]], overhead_s: dict[str, float] | None = None) -> dict[str, float]:
    """Per category, the busiest rank's seconds in one step. ``overhead_s``: the simulator's fixed cost per
    action kind, which it charges before an action without drawing it, added back to each action."""
    per: dict[str, float] = {}
    for evs in step_events.values():
        mine: dict[str, float] = {}
        for e in evs:
            if e.category not in CATEGORIES:
                continue
            extra = (overhead_s or {}).get(_kind(e.name), 0.0)
            mine[e.category] = mine.get(e.category, 0.0) + e.end_s - e.start_s + extra
        for c, v in mine.items():
            per[c] = max(per.get(c, 0.0), v)
    return per


def scaled_chain(chain: Any, forward_factor: float, backward_factor: float) -> Any:
    """``chain`` with every layer's forward and backward times multiplied by the factors."""
    import dataclasses

    layers = tuple(dataclasses.replace(l, forward_s=l.forward_s * forward_factor,
                                       backward_s=l.backward_s * backward_factor) for l in chain.layers)
    return dataclasses.replace(chain, layers=layers)


def part_c(args: argparse.Namespace, out: Path, console: Any, b: dict[str, Any]) -> dict[str, Any]:
    """Predict the pipeline's step from its profile and the cached machine constants; compare."""
    from rich.table import Table

    from pdcompile import calibrate
    from pdcompile.cluster import flat_cluster, format_quantity
    from pdcompile.simulate import simulate_plan
    from pdcompile.timeline import plot_timeline, write_chrome_trace
    from pdcompile.trace_convert import read_runtime_events

    console.rule("[bold](c) the pipeline's step: predicted before it ran, against the measured median")
    const, cached = calibrate.load_or_measure(refresh=args.refresh_constants, log=console.print)
    console.print(f"this machine's constants ({'cached' if cached else 'measured now and cached'} in "
                  f"{calibrate.cache_path()}, {const.measured_at}): loopback latency {const.latency_s * 1e6:.0f} us, "
                  f"bandwidth {format_quantity(const.bandwidth, 'bandwidth')}; optimizer step "
                  f"{const.step_fixed_s * 1e6:.0f} us + {format_quantity(const.step_rate, 'bandwidth')} of "
                  f"parameters; runtime cost per action (us): "
                  + ", ".join(f"{k} {v * 1e6:.0f}" for k, v in const.overhead_s.items())
                  + f"; compute in a run x{const.compute_factor:.2f} its profile")
    pipe = b["pipe"]
    plan, profiled = pipe.plan, pipe.state.chain
    chain = scaled_chain(profiled, const.compute_factor, const.compute_factor)
    # The emulated link in series with loopback: a message waits for both.
    bw = 1.0 / (1.0 / b["link_bytes_per_s"] + 1.0 / const.bandwidth)
    params = [sum(p.numel() * p.element_size() for p in st.gm.parameters()) for st in pipe.split.stages]

    def sim(n: int) -> Any:
        # The emulated link moves a message from its send, in the background, one at a time per
        # direction (recv_progress "background", slowlink's model); the sender is not held
        # (overlap_comm). The runtime splits the last backward of a step on 2 processes and 2 cores
        # or more (its default).
        return simulate_plan(plan, chain, flat_cluster(len(plan.stages), bw), "flush", NUM_MICROBATCHES,
                             num_steps=n, step_s=[const.step_s(x) for x in params], latency_s=const.latency_s,
                             overhead_s=const.overhead_s, recv_progress="background", overlap_comm=True,
                             split_backward=len(plan.stages) <= (os.cpu_count() or 1))

    s2, s4 = sim(2), sim(4)
    predicted_step = (float(s4.makespan_s) - float(s2.makespan_s)) / 2  # steady state: growth per step
    pred_steps = steps_by_rank(s4.events)
    predicted = category_times({r: ch[2] for r, ch in pred_steps.items()}, const.overhead_s)
    measured_events = read_runtime_events(out / "runtime_events")
    meas_steps = steps_by_rank(measured_events)
    n = min(len(ch) for ch in meas_steps.values())
    per_step = [category_times({r: ch[i] for r, ch in meas_steps.items()}) for i in range(WARMUP, n)]
    measured = {c: statistics.median(s.get(c, 0.0) for s in per_step) for c in CATEGORIES}
    measured_step = b["pipeline_step_s"]
    rows = []
    for c in CATEGORIES:
        p, m = predicted.get(c, 0.0), measured[c]
        if p == 0 and m == 0:
            continue
        judged = m >= JUDGED_SHARE * measured_step
        err = p / m - 1 if m else float("inf")
        rows.append({"category": c, "predicted_s": p, "measured_s": m, "error": err, "judged": judged,
                     "within": abs(err) <= TOLERANCE})
    step_err = predicted_step / measured_step - 1
    rows.append({"category": "whole step", "predicted_s": predicted_step, "measured_s": measured_step,
                 "error": step_err, "judged": True, "within": abs(step_err) <= TOLERANCE})
    t = Table(title=f"one step of the pipeline, the busiest rank per category (ms); measured: median of steps "
                    f"{WARMUP + 1}-{args.steps}", title_justify="left")
    for col in ("category", "predicted", "measured", "error", f"within {TOLERANCE:.0%}"):
        t.add_column(col, justify="left" if col == "category" else "right")
    for r in rows:
        verdict = ("yes" if r["within"] else "[red]no[/red]") if r["judged"] else \
            f"(under {JUDGED_SHARE:.0%} of the step: not judged)"
        t.add_row(_LABELS.get(r["category"], r["category"]), f"{r['predicted_s'] * 1e3:.2f}",
                  f"{r['measured_s'] * 1e3:.2f}", f"{r['error']:+.0%}", verdict)
    console.print(t)
    judged = [r for r in rows if r["judged"]]
    ok = sum(r["within"] for r in judged)
    console.print(f"[bold]{ok} of {len(judged)} judged rows within {TOLERANCE:.0%}[/bold]")
    console.print("(compute: the profile taken in this process before the run, times this machine's run/profile "
                  "factor; link, per-action cost and optimizer step: the constants; nothing is read from the run "
                  "it predicts)")
    one = [e for r, ch in meas_steps.items() for e in ch[min(n - 1, WARMUP + 1)]]
    t0 = min(e.start_s for e in one)
    one = [e._replace(start_s=e.start_s - t0, end_s=e.end_s - t0) for e in one]
    p_one = [e for ch in pred_steps.values() for e in ch[2]]
    t1 = min(e.start_s for e in p_one)
    p_one = [e._replace(start_s=e.start_s - t1, end_s=e.end_s - t1) for e in p_one]
    png = out / "timeline.png"
    plot_timeline(p_one, one, png, title=f"the pipeline here: one step, {args.link_mbps:g} MB/s emulated link")
    write_chrome_trace(one, out / "trace.json", process_name="pdcompile (measured)")
    write_chrome_trace(p_one, out / "trace_predicted.json", process_name="pdcompile (predicted)")
    console.print(f"timeline (predicted above measured): {png}; Chrome traces: {out / 'trace.json'}, "
                  f"{out / 'trace_predicted.json'} (open in https://ui.perfetto.dev)")
    return {"constants": const.to_dict(), "constants_cached": cached, "constants_path": str(calibrate.cache_path()),
            "rows": rows, "tolerance": TOLERANCE, "judged_share": JUDGED_SHARE,
            "within": ok, "judged": len(judged), "timeline": str(png)}


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    if args.steps < WARMUP + 2:
        raise UsageError(f"demo: --steps must be at least {WARMUP + 2} (the first {WARMUP} are warm-up)")
    if not args.link_mbps > 0:
        raise UsageError("demo: --link-mbps must be positive (MB/s of the emulated link)")
    # Piped output (no terminal) gets 120 columns rather than rich's 80, so tables and key lines don't wrap.
    console = Console(width=None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 120)
    out = Path(args.out).resolve()  # the runs below start in other working directories
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    load_start = os.getloadavg()[0]
    summary: dict[str, Any] = {"out": str(out)}
    if not args.skip_cluster:
        summary["cluster_a"] = part_a(args, out, console)
    try:
        b = part_b(args, out, console)
    except RuntimeError as e:
        console.print(f"[red]{e}[/red]")
        return 1
    summary["local"] = {k: v for k, v in b.items() if k != "pipe"}
    summary["prediction"] = part_c(args, out, console, b)
    summary["seconds"] = time.perf_counter() - t_start
    summary["load_average"] = {"start": load_start, "end": os.getloadavg()[0], "cores": os.cpu_count()}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    console.rule()
    console.print(f"done in {summary['seconds']:.0f} s (load average {load_start:.1f} at the start, "
                  f"{summary['load_average']['end']:.1f} at the end, {os.cpu_count()} cores); everything is in "
                  f"{args.out}/ (summary.json, plans, IR dumps in ir/, the emitted program/, timelines, traces, "
                  f"losses.png)")
    if args.json:
        print(json.dumps(summary))
    return 0
