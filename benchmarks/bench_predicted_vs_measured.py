"""Benchmark: the simulator's predicted step time against the runtime's measured median, per schedule.

For zoo-family models in configurations where compute dominates (an MLP, a VGG-, a ResNet- and a
GPT-style network; a step is tens of milliseconds on one CPU core), on 2 and 3 CPU processes:

1. compile with ``cost_mode="measured"`` (per-node costs profiled in this process, one thread, as
   every runtime process runs) into a straight pipeline (``stages=S``, balanced by compute time);
2. measure this machine's constants once: the loopback link (a gloo send/recv ping-pong and a
   2-rank all-reduce: latency from the smallest message, bandwidth from the largest), the
   runtime's fixed cost per action kind (:func:`measure_overheads`: a traced 2-stage run of a model
   too small to compute), each stage's SGD step, and the speed of cloning weights;
3. predict the steady-state step with :func:`pdcompile.simulate.simulate_plan`: the plan's chain
   costs, the link, the overheads, the tied embedding's ``TG`` among the stages that own it, and
   weight stashing's copies. When there are as many processes as cores (this machine: 2), a
   transfer runs only while its receiver waits and the sender is busy while it sends
   (``recv_progress="on_wait"``, ``overlap_comm=False``): gloo moves data on the processes' own
   threads, and no core is free while both compute — traces show an activation sent during the
   receiver's compute arriving only once the receiver blocks. Beside it, the same calibrated
   prediction with ``recv_progress="both_wait"`` (bytes move only while sender and receiver both
   wait), the stricter rule traces of virtual-stage runs suggested (a send posted while its sender
   goes on computing arriving only once the sender waits); RESULTS.md says which fits;
4. run the emitted program (``train.py --metrics --trace``) and take the measured median step (per
   step the mean over ranks of the time between optimizer steps; 1F1B groups its per-minibatch
   steps by M).

This machine is shared and noisy, and two processes computing at once slow each other down (memory
bandwidth), so the table gives, beside the raw prediction (the profiled costs as they are), a
*compute-calibrated* one: the runtime records each forward and backward from the end of its
receive's wait, so each stage's mean forward and backward in the run (less the per-action overhead
and stashing copies) against its profile scales that stage's compute. Everything else — waits,
bubbles, transfers, collectives, overheads, copies — remains predicted, so the calibrated error tests
the simulator's model of the schedule on the machine as it was.

``--user`` measures instead the prediction a user gets before any run: ``pdcompile(...)`` with the default
``cost_mode`` (``auto``: this machine's cost per op class when ``python -m pdcompile.calibrate`` cached one)
on ``local_cpu_cluster(S)``, then ``simulate()``; beside it, on the same plan, the model before issue 36
(the roofline without a fixed cost per op, no core contention) and ``cost_mode="measured"`` (every node
timed here), each against the emitted program's measured median step (:func:`user_main`).

Usage: python benchmarks/bench_predicted_vs_measured.py [--all] [--steps 12] [--repeats 3]
  default (a subset, to stay under 10 minutes on the loaded 2-core machine): gpt with gpipe, flush,
  1f1b, 2bw and the new schedules (zb-h1, interleaved-1f1b, looped-bfs, zb-v, dualpipe-v) on 2 processes and flush/1f1b on 3; vgg with flush, 1f1b and every new schedule;
  mlp and resnet with flush and 1f1b on 2 processes (22 cases). --all: every schedule, every model,
  2 and 3 processes. --repeats: runs per case (default 3, a model's cases taken in turn, so that a
  row's error is a median over launches minutes apart: one launch's error moves by up to 15 points
  with the load). The schedules with several stages per process run 2 stages per process
  (``V``), compiled once per placement; their actions are a stage's by name, whichever rank ran them.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks._results import write_section  # noqa: E402
from pdcompile.calibrate import split_names  # noqa: E402

SCHEDULES = ("gpipe", "flush", "1f1b", "2bw")
# split backwards and several stages per rank: ZB-H1 on the same S stages; the others on V*S stages of
# the model on S processes, compiled once per placement (stage s on rank s % S: interleaved 1F1B and
# looped BFS; a V, stage s on rank min(s, 2S-1-s): ZB-V and DualPipeV, which needs M >= 2S)
NEW_SCHEDULES = ("zb-h1", "interleaved-1f1b", "looped-bfs", "zb-v", "dualpipe-v")
PLACED_BY = {"interleaved-1f1b": "interleaved-1f1b", "looped-bfs": "interleaved-1f1b", "zb-v": "zb-v",
             "dualpipe-v": "zb-v"}
V = 2
M = 4  # microbatches per minibatch
WARMUP = 4  # steps dropped from each run's measurement
TARGET = 0.15
HERE = Path(__file__).resolve()
ROOT = HERE.parent.parent


# ---------------------------------------------------------------------------------------------
# models: zoo families at sizes where compute dominates launch and per-action overhead


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    model: nn.Module
    inputs: tuple[torch.Tensor, ...]
    target: torch.Tensor
    loss_fn: nn.Module
    leaf_modules: tuple[type[nn.Module], ...]
    description: str


def build(name: str, seed: int = 0) -> Case:
    """A zoo-family model at a benchmark size (see the module doc), with one minibatch."""
    from pdcompile.zoo import gpt, mlp, resnet, vgg

    torch.manual_seed(seed)
    if name == "mlp":
        fam, cfg, batch = mlp.FAMILY, mlp.MLPConfig(in_features=256, hidden=(512,) * 6, num_classes=10), 64
        desc = "MLP 256-6x512-10, batch 64"
    elif name == "vgg":
        fam, batch = vgg.FAMILY, 32
        cfg = vgg.VGGConfig(layers=(16, 16, vgg.M, 32, 32, vgg.M, 64, 64, vgg.M), image_size=32, hidden=256,
                            num_classes=10)
        desc = "VGG 2x16,2x32,2x64 conv, 32x32 images, batch 32"
    elif name == "resnet":
        fam, batch = resnet.FAMILY, 32
        cfg = resnet.ResNetConfig(block="basic", depths=(2, 2), widths=(16, 32), stem="small", norm="group",
                                  image_size=32, num_classes=10)
        desc = "ResNet basic 2+2 blocks, widths 16/32, 32x32 images, batch 32"
    elif name == "gpt":
        fam, batch = gpt.FAMILY, 32
        cfg = gpt.GPTConfig(vocab_size=256, seq_len=32, d_model=96, n_heads=4, n_layers=4)
        desc = "GPT 4 layers d=96, 32 tokens, batch 32"
    else:
        raise ValueError(f"unknown model {name!r}")
    model = fam.build(cfg)
    inputs, target = fam.make_batch(cfg, torch.device("cpu"), seed, batch)
    return Case(name, model, inputs, target, fam.loss(), fam.leaf_modules, desc)


# ---------------------------------------------------------------------------------------------
# measured inputs of the prediction: the loopback link, the optimizer step, CPU contention


@dataclasses.dataclass(frozen=True)
class Link:
    """The CPU loopback between two local processes, fitted through the smallest and largest message:
    send/recv one way ``latency_s + bytes / bandwidth``; a 2-rank all-reduce
    ``allreduce_latency_s + ring bytes / bandwidth``."""

    latency_s: float
    bandwidth: float
    allreduce_latency_s: float
    samples: dict[str, list[tuple[int, float]]]


def measure_link() -> Link:
    """:class:`Link`, measured as the demo's calibration measures it (:mod:`pdcompile.calibrate`)."""
    from pdcompile.calibrate import fit_link, measure_link_samples

    samples = measure_link_samples()
    return Link(*fit_link(samples), samples)


OVERHEAD_KINDS = ("F", "B", "SF", "SB", "RF", "RB", "ST", "WV")


def measure_overheads(steps: int = 12) -> dict[str, float]:
    """The runtime's fixed cost per action kind on this machine, measured once (like the link), as
    the demo's calibration measures it (:func:`pdcompile.calibrate.measure_overheads`: a traced
    2-stage Flush run of a model too small to compute)."""
    from pdcompile.calibrate import measure_overheads as measure

    got = measure(steps)
    return {k: v for k, v in got.items() if k in OVERHEAD_KINDS}


def step_seconds(stage_modules: list[nn.Module], repeats: int = 30) -> list[float]:
    """Measured SGD step (with zero_grad) of each stage's parameters."""
    out = []
    for mod in stage_modules:
        params = [p for p in mod.parameters() if p.requires_grad]
        if not params:
            out.append(0.0)
            continue
        for p in params:
            p.grad = torch.zeros_like(p)
        opt = torch.optim.SGD(params, lr=0.0)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            opt.step()
            for p in params:
                p.grad.zero_()
            times.append(time.perf_counter() - t0)
        for p in params:
            p.grad = None
        out.append(statistics.median(times))
    return out


def copy_bandwidth(stage_modules: list[nn.Module], repeats: int = 20) -> float:
    """Bytes per second of cloning the stages' parameters (what weight stashing does per version)."""
    params = [p for mod in stage_modules for p in mod.parameters()]
    nbytes = sum(p.numel() * p.element_size() for p in params)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        clones = [p.detach().clone() for p in params]
        times.append(time.perf_counter() - t0)
        del clones
    return nbytes / max(statistics.median(times), 1e-9)


# ---------------------------------------------------------------------------------------------
# prediction and measurement


def scaled_chain(chain: Any, plan: Any, factors: list[tuple[float, float]]) -> Any:
    """The chain with stage ``s``'s forward costs multiplied by ``factors[s][0]`` and backward costs by
    ``factors[s][1]`` (the contention adjustment)."""
    stage = {i: s for s, st in enumerate(plan.stages) for i in range(st.first, st.last + 1)}
    def times(x: float | None, f: float) -> float | None:
        return None if x is None else x * f

    layers = tuple(dataclasses.replace(l, forward_s=l.forward_s * factors[stage[i]][0],
                                       backward_s=l.backward_s * factors[stage[i]][1],
                                       input_grad_s=times(l.input_grad_s, factors[stage[i]][1]),
                                       weight_grad_s=times(l.weight_grad_s, factors[stage[i]][1]))
                   for i, l in enumerate(chain.layers))
    return dataclasses.replace(chain, layers=layers)


@dataclasses.dataclass(frozen=True)
class Setup:
    """What the simulation needs besides the plan: link, optimizer step, tied weights, overheads."""

    cluster: Any
    latency_s: float
    collective_latency_s: float
    step_s: list[float]
    tied_bytes: float  # parameters tied across stages (the GPT's embedding); 0: none
    tied_stages: tuple[int, ...]
    overhead_s: dict[str, float]
    recv_progress: str  # "on_wait" when every core runs a stage (gloo's I/O thread waits for a core)
    copy_bandwidth: float  # bytes/s of cloning weights (weight stashing's copies)
    split_backward: bool = True  # as the runtime decides (off with more processes than cores)
    input_grad_share: float | None = None  # a split backward's parts (None: simulate_plan's defaults)
    weight_grad_share: float | None = None
    virtual_stages: int = 1  # stages per process (the plan's stages placed as the schedule's policy says)


def simulate(plan: Any, chain: Any, setup: Setup, schedule: str, num_steps: int) -> Any:
    """:func:`pdcompile.simulate.simulate_plan` with the measured link, step, tied weights and overheads."""
    from pdcompile.simulate import simulate_plan

    shares = {k: v for k, v in (("input_grad_share", setup.input_grad_share),
                                ("weight_grad_share", setup.weight_grad_share)) if v is not None}
    return simulate_plan(plan, chain, setup.cluster, schedule, M, num_steps=num_steps, step_s=setup.step_s, **shares,
                         split_backward=setup.split_backward,
                         tied_bytes=setup.tied_bytes, tied_stages=setup.tied_stages, latency_s=setup.latency_s,
                         collective_latency_s=setup.collective_latency_s, overhead_s=setup.overhead_s,
                         recv_progress=setup.recv_progress, copy_bandwidth=setup.copy_bandwidth,
                         overlap_comm=setup.recv_progress != "on_wait", virtual_stages=setup.virtual_stages)


def predict(plan: Any, chain: Any, setup: Setup, schedule: str) -> float:
    """Steady-state step time: the simulated makespan's growth per step from 2 to 4 steps."""
    r2 = simulate(plan, chain, setup, schedule, 2)
    r4 = simulate(plan, chain, setup, schedule, 4)
    return (float(r4.makespan_s) - float(r2.makespan_s)) / 2


def measured_step(metrics: list[dict[str, Any]], schedule: str) -> tuple[float, float]:
    """(median, spread as (p75 - p25) / median) of the per-step time, mean over ranks, warm-up dropped."""
    per = M if schedule == "1f1b" else 1
    ranks = [m["step_times_s"] for m in metrics]
    n = min(len(r) for r in ranks) // per
    steps = [statistics.fmean(sum(r[i * per:(i + 1) * per]) for r in ranks) for i in range(WARMUP, n)]
    q = statistics.quantiles(steps, n=4) if len(steps) >= 4 else [math.nan] * 3
    med = statistics.median(steps)
    return med, (q[2] - q[0]) / med


def run_program(prog: Path, nproc: int, schedule: str, steps: int, trace: Path | None = None) -> list[dict[str, Any]]:
    from benchmarks._common import run_ours

    extra = ["--trace", str(trace)] if trace else []
    return run_ours(prog, nproc, steps, schedule=schedule, extra=extra, timeout=240)


# ---------------------------------------------------------------------------------------------


def copies_by_action(schedule: str, num_stages: int, steps: int, tied: bool) -> dict[str, int]:
    """Action name (``0B17``) -> weight-sized copies the runtime makes in it (weight stashing)."""
    from pdcompile.runtime.schedules import Kind, make_schedule, version_copies

    if schedule in PLACED_BY:  # synchronous: one weight version, no copies
        return {}
    sched = make_schedule(schedule, [1] * num_stages, M, tied=tied, num_steps=steps)
    return {str(a): n for acts in sched.values() for a, n in zip(acts, version_copies(acts))
            if a.kind is Kind.BACKWARD}


def compute_slowdown(events: list[Any], chain: Any, plan: Any, overhead: dict[str, float],
                     copy_s: list[float] | None = None, copies: dict[str, int] | None = None) -> list[tuple[float, float]]:
    """How much slower each stage's compute ran in the traced run than profiled: per stage, (mean
    forward / profiled forward, mean backward / profiled backward) — the mean, not the median, as a
    step is the sum of its actions, slow ones included — each action less its measured
    per-action overhead (and, for a backward that hands a stashed version's gradients over, its copy:
    ``copy_s[stage]`` times ``copies[name]``), warm-up minibatches excluded. The runtime records a
    forward or backward from the end of its receive's wait, so these are compute only. Split
    backwards (``B`` followed by ``W``) are left out here (:func:`split_shares` measures them),
    unless a stage split every backward (zb-h1, zb-v): its backward factor is then its mean ``B`` +
    ``W`` (less two per-action overheads) against the profiled parts (``input_grad_s`` +
    ``weight_grad_s``; where not profiled, the simulator's shares of the backward). Actions are
    a stage's by their name (``2F7``: stage 2), whichever rank ran them."""
    from pdcompile.simulate import INPUT_GRAD_SHARE, WEIGHT_GRAD_SHARE
    from pdcompile.trace_convert import microbatch_of

    scale = plan.microbatch_size / chain.batch_size
    split = split_names(events)
    steady = [e for e in events if (microbatch_of(e.name) or 0) >= WARMUP * M]
    out = []
    for s, st in enumerate(plan.stages):
        mine = chain.layers[st.first:st.last + 1]
        ratios = []
        for kind, attr in (("forward", "forward_s"), ("backward", "backward_s")):
            prof = sum(getattr(l, attr) for l in mine) * scale
            d = [e.end_s - e.start_s - (copy_s[s] * copies.get(e.name, 0) if copy_s and copies else 0.0)
                 for e in steady if stage_of(e.name) == s and e.category == kind and e.name not in split]
            if not d and kind == "backward":  # every backward split: B + W against the profiled parts
                part = {k: [e.end_s - e.start_s - overhead.get("B", 0.0) for e in steady if stage_of(e.name) == s
                            and e.category == kind and e.name in split and k in e.name] for k in "BW"}
                prof = sum((l.input_grad_s if l.input_grad_s is not None else l.backward_s * INPUT_GRAD_SHARE)
                           + (l.weight_grad_s if l.weight_grad_s is not None else l.backward_s * WEIGHT_GRAD_SHARE)
                           for l in mine) * scale
                ratios.append(max(statistics.fmean(part["B"]) + statistics.fmean(part["W"]), 0.0) / prof)
                continue
            ratios.append(max(statistics.fmean(d) - overhead.get(kind[0].upper(), 0.0), 0.0) / prof)
        out.append((ratios[0], ratios[1]))
    return out


def stage_of(name: str) -> int:
    """The stage an action belongs to: its name's leading number (``12B3`` -> 12)."""
    digits = name[:len(name) - len(name.lstrip("0123456789"))]
    return int(digits) if digits else -1


def split_shares(events: list[Any], chain: Any, plan: Any, overhead: dict[str, float]) -> tuple[float, float] | None:
    """A split backward's measured parts as shares of the stage's backward in the same run (the mean
    unsplit ``B`` of the stage): (input gradients ``B``, weight gradients ``W``), averaged over the
    stages that split; None when none did. Warm-up minibatches excluded."""
    from pdcompile.trace_convert import microbatch_of

    split = split_names(events)
    ins, ws = [], []
    for s in range(1, len(plan.stages)):
        def mean(pred: Any) -> float | None:
            d = [e.end_s - e.start_s - overhead.get("B", 0.0) for e in events if stage_of(e.name) == s
                 and e.category == "backward" and (microbatch_of(e.name) or 0) >= WARMUP * M and pred(e.name)]
            return statistics.fmean(d) if d else None
        whole = mean(lambda n: n not in split)
        b_in = mean(lambda n: n in split and "B" in n)
        w = mean(lambda n: n in split and "W" in n)
        if whole and b_in is not None and w is not None:
            ins.append(max(b_in, 0.0) / whole)
            ws.append(max(w, 0.0) / whole)
    return (statistics.fmean(ins), statistics.fmean(ws)) if ins else None


def geomean(xs: list[float]) -> float:
    return math.exp(statistics.fmean(math.log(max(x, 1e-9)) for x in xs))


def comm_per_step(events: list[Any], steps: int) -> float:
    """Seconds per minibatch the busiest rank spent inside send/receive actions (posting, blocking),
    warm-up excluded; the simulator charges senders nothing for an asynchronous send."""
    from pdcompile.trace_convert import microbatch_of

    per_rank: dict[int, float] = {}
    for e in events:
        if e.category in ("send", "recv") and (microbatch_of(e.name) or 0) >= WARMUP * M:
            per_rank[e.rank] = per_rank.get(e.rank, 0.0) + e.end_s - e.start_s
    return max(per_rank.values(), default=0.0) / max(1, steps - WARMUP)


def plan_cases(full: bool) -> list[tuple[str, int, tuple[str, ...]]]:
    if full:
        return [(m, s, SCHEDULES + NEW_SCHEDULES) for m in ("mlp", "vgg", "resnet", "gpt") for s in (2, 3)]
    few = ("flush", "1f1b")
    return [("gpt", 2, SCHEDULES + NEW_SCHEDULES), ("gpt", 3, few), ("vgg", 2, few + NEW_SCHEDULES), ("mlp", 2, few),
            ("resnet", 2, few)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--all", action="store_true", help="every schedule for every model, 2 and 3 processes (32 runs)")
    ap.add_argument("--steps", type=int, default=12, help="minibatches per run (default 12; 4 are warm-up)")
    ap.add_argument("--only", help="comma-separated models (smoke runs)")
    ap.add_argument("--schedules", help="comma-separated schedules (smoke runs)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="runs per case, a model's cases taken in turn (default 3): the table gives the median "
                         "error and its range")
    ap.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md alone")
    ap.add_argument("--png", default=str(HERE.parent / "timeline_example.png"), help="timeline example output")
    ap.add_argument("--user", help="the prediction a user gets before the run, for cases MODEL:S:SCHEDULE,... "
                                   "(e.g. gpt:2:flush,vgg:3:flush); see user_main")
    args = ap.parse_args(argv)
    if args.user:
        return user_main(args)
    from benchmarks._common import load_note, sgd
    from pdcompile.api import pdcompile
    from pdcompile.cluster import flat_cluster, format_quantity
    from pdcompile.timeline import plot_timeline
    from pdcompile.trace_convert import read_runtime_events, select_microbatches

    torch.set_num_threads(1)  # as each runtime process runs (OMP_NUM_THREADS=1)
    t_start = time.perf_counter()
    load_before = load_note()
    link = measure_link()
    lat, bw = link.latency_s, link.bandwidth
    print(f"loopback: latency {lat * 1e6:.1f} us, bandwidth {format_quantity(bw, 'bandwidth')}, all-reduce latency "
          f"{link.allreduce_latency_s * 1e6:.1f} us; samples (bytes, us) "
          f"{ {k: [(n, round(t * 1e6, 1)) for n, t in v] for k, v in link.samples.items()} }", flush=True)
    overhead = measure_overheads()
    print("runtime overhead per action (us): " + ", ".join(f"{k} {v * 1e6:.0f}" for k, v in overhead.items()),
          flush=True)
    cases = plan_cases(args.all)
    if args.only:
        keep = set(args.only.split(","))
        cases = [c for c in cases if c[0] in keep]
    if args.schedules:
        keep_s = args.schedules.split(",")
        cases = [(n, S_, tuple(x for x in sc if x in keep_s)) for n, S_, sc in cases]
        cases = [c for c in cases if c[2]]
    runs: list[dict[str, Any]] = []
    skipped: set[str] = set()
    png_done = False
    for name, S, scheds in cases:
        case = build(name)
        prepared: dict[str | None, tuple[Any, Path, Setup]] = {}

        def prepare(placed: str | None) -> tuple[Any, Path, Setup]:
            """The program for a placement (None: one stage per process), compiled once per case."""
            if placed in prepared:
                return prepared[placed]
            v = V if placed else 1
            model = build(name).model if placed else case.model  # the same weights (seeded)
            pipe = pdcompile(model, example_inputs=case.inputs, example_target=case.target, loss_fn=case.loss_fn,
                             optimizer=sgd, stages=v * S, schedule=placed or "flush", num_microbatches=M,
                             leaf_modules=case.leaf_modules, cost_mode="measured",
                             **({"virtual_stages": v} if placed else {}))
            prog = pipe.emit(Path(tempfile.mkdtemp(prefix=f"pd-pvm-{name}{S}-")) / "program")
            chain, plan = pipe.state.chain, pipe.plan
            cuts = [chain.cut_bytes[st.last] for st in plan.stages[:-1]]
            cut = statistics.fmean(cuts) if cuts else 0.0
            cluster = flat_cluster(S, bw, name="cpu")
            step_s = step_seconds([st.gm for st in pipe.split.stages])
            stage_params = [dict(st.gm.named_parameters()) for st in pipe.split.stages]
            tied_bytes = float(sum(stage_params[g[0][0]][g[0][1]].numel()
                                   * stage_params[g[0][0]][g[0][1]].element_size() for g in pipe.split.tied))
            tied_stages = tuple(sorted({s_ for g in pipe.split.tied for s_, _ in g}))
            progress = "on_wait" if S >= (os.cpu_count() or 1) else "background"
            setup = Setup(cluster, lat, link.allreduce_latency_s, step_s, tied_bytes, tied_stages, overhead, progress,
                          copy_bandwidth([st.gm for st in pipe.split.stages]),
                          split_backward=S <= (os.cpu_count() or 1),  # the runtime's --split-backward default
                          virtual_stages=v)
            print(f"{name} S={S}{f' ({v * S} stages, placed as {placed})' if placed else ''}: stages "
                  f"{[(st.first, st.last) for st in plan.stages]} of {len(chain)} layers, boundary "
                  f"{format_quantity(cut, 'memory')}", flush=True)
            prepared[placed] = (pipe, prog, setup)
            return prepared[placed]

        raws: dict[str, float] = {}
        for sched in [x for _ in range(max(1, args.repeats)) for x in scheds]:  # a model's cases in turn
            if sched == "dualpipe-v" and M < 2 * S:
                continue
            pipe, prog, setup = prepare(PLACED_BY.get(sched))
            chain, plan, step_s = pipe.state.chain, pipe.plan, setup.step_s
            if sched not in raws:  # the idle prediction is the same for every run of the case
                raws[sched] = predict(plan, chain, setup, sched)
            raw = raws[sched]
            trace = Path(tempfile.mkdtemp(prefix="pd-pvm-trace-"))
            metrics = run_program(prog, S, sched, args.steps, trace)
            meas, spread = measured_step(metrics, sched)
            events = read_runtime_events(trace)
            copy_s = [sum(p.numel() * p.element_size() for p in st.gm.parameters()) / setup.copy_bandwidth
                      for st in pipe.split.stages]
            factors = compute_slowdown(events, chain, plan, overhead, copy_s,
                                       copies_by_action(sched, len(plan.stages), args.steps, bool(pipe.split.tied)))
            slow = geomean([x for fb in factors for x in fb])
            cal_chain = scaled_chain(chain, plan, factors)
            shares = split_shares(events, chain, plan, overhead) or (None, None)
            cal_setup = dataclasses.replace(setup, step_s=[x * geomean(list(fb)) for x, fb in zip(step_s, factors)],
                                            input_grad_share=shares[0], weight_grad_share=shares[1])
            cal = predict(plan, cal_chain, cal_setup, sched)
            # the same calibrated prediction with transfers moving only while both ends wait, on the same run
            cal_bw = (predict(plan, cal_chain, dataclasses.replace(cal_setup, recv_progress="both_wait"), sched)
                      if setup.recv_progress == "on_wait" else None)
            runs.append(dict(model=name, S=S, schedule=sched, raw=raw, adj=cal, adj_bw=cal_bw, meas=meas,
                             spread=spread, slow=slow,
                             comm=comm_per_step(events, args.steps), load=os.getloadavg()[0]))
            print(f"  {sched:6s} predicted {raw * 1e3:7.2f} ms, calibrated x{slow:.2f} {cal * 1e3:7.2f} ms, measured "
                  f"{meas * 1e3:7.2f} ms ({spread:.0%} IQR): error {cal / meas - 1:+.0%} calibrated, "
                  f"{raw / meas - 1:+.0%} raw", flush=True)
            if not png_done and name == "gpt" and S == 2 and sched == "1f1b":
                first = WARMUP * M  # two steady-state minibatches, measured and simulated
                measured = select_microbatches(events, first, first + 2 * M - 1)
                pred2 = simulate(plan, cal_chain, cal_setup, sched, 2)
                plot_timeline(pred2.events, measured, args.png,
                              title=f"{case.description}: {S} stages, {sched}, {M} microbatches x 2 minibatches "
                                    f"(compute calibrated x{slow:.2f})",
                              labels=("predicted (simulate_plan)", f"measured (train.py --trace, minibatches "
                                                                   f"{WARMUP + 1}-{WARMUP + 2})"))
                png_done = True
                print(f"  wrote {args.png}", flush=True)
    elapsed = time.perf_counter() - t_start
    body = table(combine(runs), link, overhead, load_before, elapsed, args)
    if skipped:
        body += f"- not run: {'; '.join(sorted(skipped))}.\n"
    print(body)
    if not args.no_write:
        write_section("Predicted vs measured step time (bench_predicted_vs_measured)", body,
                      command="python benchmarks/bench_predicted_vs_measured.py" + (" --all" if args.all else ""))
    return 0


def combine(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per case from its repeated runs: each figure's median over the runs, and the calibrated
    error's median (``err``, of the runs' own errors) and range (``err_lo``, ``err_hi``)."""
    cases: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    for r in runs:
        cases.setdefault((r["model"], r["S"], r["schedule"]), []).append(r)
    rows = []
    for (model, S, sched), rs in cases.items():
        errs = [r["adj"] / r["meas"] - 1 for r in rs]
        bw = [r["adj_bw"] / r["meas"] - 1 for r in rs if r["adj_bw"] is not None]
        row: dict[str, Any] = dict(model=model, S=S, schedule=sched, n=len(rs), err=statistics.median(errs),
                                   err_lo=min(errs), err_hi=max(errs), err_bw=statistics.median(bw) if bw else None)
        for k in ("raw", "adj", "meas", "spread", "slow", "comm", "load"):
            row[k] = statistics.median(r[k] for r in rs)
        rows.append(row)
    return rows


def table(rows: list[dict[str, Any]], link: Link, overhead: dict[str, float], load_before: str,
          elapsed: float, args: argparse.Namespace) -> str:
    from benchmarks._common import load_note
    from pdcompile.cluster import format_quantity

    models = dict.fromkeys(r["model"] for r in rows)
    runs = max(r["n"] for r in rows) if rows else 0
    out = [f"Straight pipelines on CPU processes, {M} microbatches per minibatch, {args.steps} minibatches per "
           f"run ({WARMUP} warm-up), every run traced; {runs} runs per case, a model's cases taken in turn, each "
           f"figure the median over its runs (the calibrated error: the median of the runs' own errors, its range "
           f"beside). Models: " + "; ".join(f"{n}: {build(n).description}"
                                                                           for n in models) + ".",
           f"Loopback link (gloo send/recv ping-pong and all-reduce, fitted once): latency "
           f"{link.latency_s * 1e6:.1f} us, bandwidth {format_quantity(link.bandwidth, 'bandwidth')}, all-reduce "
           f"latency {link.allreduce_latency_s * 1e6:.1f} us. Runtime overhead per action (measured once on a 2-stage run "
           f"of a model too small to compute, see `measure_overheads`), us: "
           + ", ".join(f"{k} {v * 1e6:.0f}" for k, v in overhead.items()) + ". "
           f"Costs: `cost_mode=\"measured\"`, one thread; optimizer step measured per stage; tied embedding "
           f"gradients (gpt) summed by the owning stages only, as the runtime does; weight stashing's clones "
           f"and gradient hand-overs at the measured copy speed; with as many processes as cores, transfers "
           f"progress only while the receiver waits and occupy the sender (see the module doc). Calibration: each stage's "
           f"forward and backward as they ran (the runtime records them from the end of the receive's wait, less "
           f"the per-action overhead) against their profiled cost scale that stage's compute (and optimizer step); "
           f"the column shows the geometric mean; all else (waits, bubbles, transfers, overheads) is predicted.",
           f"Load before: {load_before}; after: {load_note()}.", "",
           "| model | S | schedule | predicted, idle (ms) | compute slowdown in the run | calibrated prediction (ms) "
           "| measured median (ms) | IQR | posting or waiting for transfers, busiest rank (ms/step) "
           "| error, calibrated (median of the runs) | its range over the runs | error, idle "
           "| within 15% (calibrated) | error, calibrated, both_wait | load (1 min) |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ea, er = r["err"], r["raw"] / r["meas"] - 1
        out.append(f"| {r['model']} | {r['S']} | {r['schedule']} | {r['raw'] * 1e3:.2f} | x{r['slow']:.2f} | "
                   f"{r['adj'] * 1e3:.2f} | {r['meas'] * 1e3:.2f} | {r['spread']:.0%} | {r['comm'] * 1e3:.2f} | "
                   f"{ea:+.1%} | {r['err_lo']:+.1%} to {r['err_hi']:+.1%} | {er:+.1%} | "
                   f"{'yes' if abs(ea) <= TARGET else 'no'} | "
                   f"{'' if r['err_bw'] is None else format(r['err_bw'], '+.1%')} | {r['load']:.1f} |")
    ok = [r for r in rows if abs(r["err"]) <= TARGET]
    raw_ok = [r for r in rows if abs(r["raw"] / r["meas"] - 1) <= TARGET]
    out += ["", f"{len(ok)} of {len(rows)} cases within 15% calibrated, {len(raw_ok)} of {len(rows)} with the idle "
                f"prediction. Run time {elapsed:.0f} s.", "", "Notes (from the numbers above):"]
    out.append(f"- the idle prediction is off by the compute slowdown (median x"
               f"{statistics.median(r['slow'] for r in rows):.2f}): the profile ran alone in one process, the runs "
               f"shared {os.cpu_count()} cores with each other and with other jobs (load column); the profile "
               f"itself is taken on the same loaded cores, so the idle figures move between invocations too.")
    for S in sorted({r["S"] for r in rows}):
        sub = [r for r in rows if r["S"] == S]
        out.append(f"- {S} processes: median calibrated error "
                   f"{statistics.median(r['err'] for r in sub):+.1%}"
                   + ("; more processes than cores, so stages also wait for a core between actions, which the "
                      "simulator does not model" if S > (os.cpu_count() or 1) else "") + ".")
    by_sched: dict[str, list[float]] = {}
    for r in rows:
        by_sched.setdefault(r["schedule"], []).append(r["err"])
    out.append("- median calibrated error per schedule: " + ", ".join(
        f"{s} {statistics.median(v):+.1%}" for s, v in by_sched.items()) + ".")
    under = [r for r in rows if r["err"] < -TARGET]
    if under:
        share = statistics.median(r["comm"] / r["meas"] for r in under)
        out.append(f"- {len(under)} case(s) ran slower than predicted by more than 15% "
                   f"({', '.join(r['model'] + ' ' + str(r['S']) + ' ' + r['schedule'] for r in under)}): in them "
                   f"the busiest rank spent a median {share:.0%} of the measured step posting or waiting for "
                   f"transfers; look at their traces for waits the model does not explain.")
    over = [r for r in rows if r["err"] > TARGET]
    if over:
        out.append(f"- {len(over)} case(s) ran faster than predicted by more than 15% "
                   f"({', '.join(r['model'] + ' ' + str(r['S']) + ' ' + r['schedule'] for r in over)}): the "
                   f"calibrating actions were slowed more than the rest of the run (load changes within a run).")
    virt = [r for r in rows if r["schedule"] in PLACED_BY]
    if virt:
        flat = [r for r in rows if r["schedule"] not in PLACED_BY and r["S"] <= (os.cpu_count() or 1)]
        share = lambda rs: statistics.median(r["comm"] / r["meas"] for r in rs)  # noqa: E731
        out.append(f"- {V} stages per process ({', '.join(dict.fromkeys(r['schedule'] for r in virt))}; "
                   f"{V * max(r['S'] for r in virt)} stages on {max(r['S'] for r in virt)} processes): median "
                   f"calibrated error {statistics.median(r['err'] for r in virt):+.1%}, the busiest "
                   f"rank posting or waiting for transfers a median {share(virt):.0%} of the measured step (one "
                   f"stage per process: {share(flat) if flat else math.nan:.0%}). Every boundary of these "
                   f"placements but a V's turn crosses processes, so a step sends {V}x-{2 * V - 1}x the messages "
                   f"of one stage per process, and a process often runs several forwards in a row (looped BFS: "
                   f"all of a stage's).")
    both = [r for r in rows if r["err_bw"] is not None]
    if both:
        err = lambda rs, k: statistics.median(r[k] for r in rs)  # noqa: E731
        parts = [f"{label} {err(rs, 'err'):+.1%} (`on_wait`) vs {err(rs, 'err_bw'):+.1%} (`both_wait`)"
                 for label, rs in (("virtual-stage rows", [r for r in both if r["schedule"] in PLACED_BY]),
                                   ("the others", [r for r in both if r["schedule"] not in PLACED_BY])) if rs]
        out.append(f"- `recv_progress=\"both_wait\"` (bytes move only while sender and receiver both wait; the "
                   f"column beside): median calibrated error " + ", ".join(parts) + ".")
    noisy = [r for r in rows if r["spread"] > 0.3]
    if noisy:
        out.append(f"- {len(noisy)} run(s) had step times spread more than 30% (IQR/median): other jobs on the "
                   f"shared cores; their errors mean little.")
    return "\n".join(out) + "\n"


def _before_issue_36() -> Any:
    """A context in which annotate-costs is the analytic model as it was before issue 36: the CPU roofline
    with no fixed cost per op and no core contention (the benchmark's baseline, not an option)."""
    import contextlib
    from unittest import mock

    from pdcompile.passes.costs.roofline import DeviceSpec

    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch("pdcompile.passes.annotate_costs.device_spec_for",
                                   lambda cluster, precision="fp32": DeviceSpec("cpu", 100e9, 20e9)))
    stack.enter_context(mock.patch("pdcompile.passes.annotate_costs.contention", lambda cluster: 1.0))
    return stack


def user_main(args: argparse.Namespace) -> int:
    """Per case (model, S processes, schedule, M=4): compile on ``local_cpu_cluster(S)`` with
    ``stages=S`` three ways (the default ``cost_mode``; the model before issue 36, with the analytic
    default of then; ``cost_mode="measured"``), predict the emitted program's step with ``simulate()``
    of each on the default compile's plan, run the program ``--repeats`` times (cases interleaved),
    and report each prediction's error against the measured median; the median |error| per model."""
    import copy

    from benchmarks._common import load_note, sgd
    from pdcompile import machine_cache
    from pdcompile.api import pdcompile
    from pdcompile.cluster import host_cores, local_cpu_cluster

    torch.set_num_threads(1)
    load_before = load_note()
    cases = [(m, int(S_), sch) for m, S_, sch in (c.split(":") for c in args.user.split(","))]
    rows: list[dict[str, Any]] = []
    for name, S_, sched in cases:
        case = build(name)
        kw = dict(example_inputs=case.inputs, example_target=case.target, loss_fn=case.loss_fn, optimizer=sgd,
                  stages=S_, schedule=sched, num_microbatches=M, leaf_modules=case.leaf_modules)
        cluster = local_cpu_cluster(S_)
        pipe = pdcompile(case.model, cluster, **kw)
        with _before_issue_36():
            old = pdcompile(case.model, cluster, cost_mode="analytic", **kw)
        measured = pdcompile(case.model, cluster, cost_mode="measured", **kw)
        preds = {"default": float(pipe.simulate().step_time_s)}
        for label, other in (("before", old), ("measured mode", measured)):
            same = copy.copy(pipe)  # the default compile's plan, the other's costs
            same.state = pipe.state.replace(chain=other.state.chain)
            preds[label] = float(same.simulate().step_time_s) \
                if len(other.state.chain.layers) == len(pipe.state.chain.layers) else math.nan
        prog = pipe.emit(Path(tempfile.mkdtemp(prefix="pd-bench-user-")) / "program")
        rows.append({"model": name, "S": S_, "schedule": sched, "pred": preds, "meas": [],
                     "source": pipe.cost_source.line, "loads": []})
        print(f"{name} S={S_} {sched}: predicted (ms) " + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in preds.items())
              + f"; {pipe.cost_source.line}", flush=True)
        rows[-1]["prog"] = prog
    for rep in range(args.repeats):
        for r in rows:
            from benchmarks._common import run_ours

            # timed without the memory meter (a hook per saved tensor), which the prediction does not charge
            metrics = run_ours(r["prog"], r["S"], args.steps, schedule=r["schedule"], extra=["--no-memory-meter"],
                               timeout=240)
            r["meas"].append(measured_step(metrics, r["schedule"])[0])
            r["loads"].append(os.getloadavg()[0])
            print(f"  run {rep + 1}: {r['model']} S={r['S']} {r['schedule']} measured {r['meas'][-1] * 1e3:.2f} ms "
                  f"(load {r['loads'][-1]:.1f})", flush=True)
    labels = ("before", "default", "measured mode")
    out = [f"The prediction made before any run against the measured median step (`train.py --metrics "
           f"--no-memory-meter`, "
           f"{args.steps} minibatches, {WARMUP} dropped, {args.repeats} runs per case, cases interleaved), M={M}, "
           f"SGD, `local_cpu_cluster(S)` on {host_cores()} cores. \"before\": the analytic model before issue 36 (CPU "
           f"roofline, no fixed cost per op, no core contention), on the same plan; \"default\": `pdcompile()`'s "
           f"default now (`cost_mode=\"auto\"`: {rows[0]['source'] if rows else ''}); \"measured mode\": every node "
           f"timed in this process. All three charge the runtime's per-action cost "
           f"({'calibrated' if machine_cache.action_cost().calibrated else 'built-in'}). Load before: {load_before}; "
           f"after: {load_note()}.", "",
           "| model | S | schedule | measured median (ms) | " + " | ".join(f"{k} (ms) | error" for k in labels)
           + " | load (1 min) |", "|---|---|---|---|" + "---|---|" * len(labels) + "---|"]
    errs: dict[str, list[float]] = {k: [] for k in labels}
    for r in rows:
        meas = statistics.median(r["meas"])
        cells = []
        for k in labels:
            e = r["pred"][k] / meas - 1
            errs[k].append(abs(e))
            cells.append(f"{r['pred'][k] * 1e3:.2f} | {e:+.1%}")
        out.append(f"| {r['model']} | {r['S']} | {r['schedule']} | {meas * 1e3:.2f} | " + " | ".join(cells)
                   + f" | {statistics.median(r['loads']):.1f} |")
    out += ["", "Median |error|: " + ", ".join(f"{k} {statistics.median(v):.0%}" for k, v in errs.items()
                                               if not any(math.isnan(x) for x in v)) + "."]
    table, _ = machine_cache.op_costs()
    if table is not None:  # the fit the default read: alpha (us) and rate (GFLOP/s or GB/s) per class
        def fmt(d: Any) -> str:
            return ", ".join(f"{k} {v.alpha_s * 1e6:.1f} us + work / {v.rate / 1e9:.3g} G/s" for k, v in sorted(d.items()))
        out += ["", f"Calibration read ({table.source}), forward: {fmt(table.forward)}; backward: "
                    f"{fmt(table.backward)} (work: FLOPs for matmul, conv, attention; bytes otherwise)."]
    text = "\n".join(out) + "\n"
    print(text)
    if not args.no_write:
        write_section("Prediction before the run (issue 36: per-op fixed cost, calibration, cores)", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
