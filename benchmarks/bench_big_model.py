"""Big models, many ranks: compile, emit and one rank's start-up on the meta device (#28).

    python benchmarks/bench_big_model.py               # both parts, ~15 minutes on 2 shared cores
    python benchmarks/bench_big_model.py --part ranks  # one part
    python benchmarks/bench_big_model.py --quick       # tiny sizes, prints only (the smoke test's)
    python benchmarks/bench_big_model.py --part tensor # Llama-3-70B on 64 H100s, tensor_parallel 1 and auto

*models*: Llama-2-7B and Llama-3-70B shapes (transformers' ``LlamaConfig`` with the real sizes),
built under ``torch.device("meta")``, compiled with ``cost_mode="analytic"`` for 8 and 64 H100s
(8 to a server: NVLink inside, InfiniBand between), the planner choosing stages and replicas;
then emitted (a meta model's program holds no weights: each rank fills its stage). Targets:
7B under 30 s, 70B under 120 s, both under 2 GiB.

*ranks*: one 16-stage plan (a 16-layer Llama on meta) on 64, 256 and 1,024 ranks (each stage
replicated ranks / 16 times, 16 microbatches per pipeline replica and step); compile, emit, and
one rank's start-up up to its first action as train.py does it without a process group:
plan.json read, the schedule checked against plan.json (``run_schedule``), the weight-pass
choice, and the rank's run of 1,000 steps with its sends released and receives posted
(``rank_run``; building the stage's weights is not timed). Target: under 60 s each at 1,024
ranks; the growth per doubling of ranks is reported.

Each configuration runs in its own process; its peak RSS is that process's
``resource.getrusage(RUSAGE_SELF).ru_maxrss`` (Python, torch and transformers included).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import _common  # noqa: E402
from benchmarks._common import llama_config, peak_rss_mib  # noqa: E402
from benchmarks._results import publish  # noqa: E402

GiB = 2.0**30

def h100_cluster(gpus: int) -> Any:
    """``gpus`` H100 SXM (80 GiB, 3.35 TB/s) 8 to a server: NVLink 450 GB/s per direction inside,
    400 Gbit/s InfiniBand per GPU between servers."""
    from pdcompile.cluster import ClusterSpec, Device, Level

    device = Device("H100-80GB", memory=80 * GiB, peak_flops=494e12, memory_bandwidth=3.35e12,
                    peak_flops_bf16=989e12)
    inner = min(gpus, 8)
    levels = [Level("gpus-in-server", inner, 450e9)]
    if gpus > inner:
        levels.append(Level("servers", gpus // inner, 400e9 / 8))
    return ClusterSpec(device, tuple(levels))


# --- one configuration, in its own process -----------------------------------------------------------------------

def _peak_rss_gib() -> float:
    return peak_rss_mib() / 1024


def child(cfg: dict[str, Any]) -> dict[str, Any]:
    """Compile (and emit, and start one rank) as ``cfg`` says; the figures as a dict."""
    import torch
    import transformers

    from pdcompile.api import pdcompile
    from pdcompile.zoo.losses import SequenceCrossEntropy

    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(llama_config(cfg["model"]))
    with torch.device("cpu" if cfg.get("real_data") else "meta"):  # real data: the model alone on meta
        x = torch.randint(0, 100, (cfg["batch"], cfg["seq"]))
        t = torch.randint(0, 100, (cfg["batch"], cfg["seq"]))
    out["params_b"] = sum(p.numel() for p in model.parameters()) / 1e9
    out["build_s"] = time.perf_counter() - t0
    kw: dict[str, Any] = {"stages": cfg["stages"], "replicas": cfg.get("replicas")} if cfg.get("stages") else {}
    if cfg.get("microbatches") is not None:
        kw["num_microbatches"] = cfg["microbatches"]
    if cfg.get("adamw"):
        kw["optimizer"] = adamw
    if cfg.get("tensor_parallel") is not None:
        kw["tensor_parallel"] = cfg["tensor_parallel"]
    t0, c0 = time.perf_counter(), time.process_time()
    pipe = pdcompile(model, h100_cluster(cfg["gpus"]), example_inputs=(x,), example_target=t,
                     loss_fn=SequenceCrossEntropy(), cost_mode="analytic", precision=cfg.get("precision", "fp32"),
                     schedule=cfg.get("schedule", "flush"), **kw)
    out["compile_s"] = time.perf_counter() - t0
    out["compile_cpu_s"] = time.process_time() - c0  # on a shared machine, what the compile itself costs
    out["passes_s"] = sum(r.seconds for r in pipe.records)
    out["slowest_passes"] = ", ".join(f"{r.name} {r.seconds:.1f}"
                                      for r in sorted(pipe.records, key=lambda r: -r.seconds)[:3])
    out["stages"] = len(pipe.plan.stages)
    out["t"] = pipe.plan.stages[0].tensor_parallel
    out["why"] = "; ".join(f"stage {s.index}: {s.tensor_why}" for s in pipe.plan.stages[:1] if s.tensor_why)
    out["tp_note"] = next((n for n in pipe.plan.notes if n.startswith("tensor parallelism")), "")
    out["per_stage_note"] = next((n for n in pipe.plan.notes if n.startswith("a degree per stage")), "")
    out["degrees"] = "/".join(str(s.tensor_parallel) for s in pipe.plan.stages)
    reps = [len(s.ranks) for s in pipe.plan.stages]
    out["replicas"] = f"{reps[0]} each" if len(reps) > 8 and len(set(reps)) == 1 else "-".join(map(str, reps))
    out["compile_rss_gib"] = _peak_rss_gib()
    out["schedule"] = pipe.options.schedule
    out["microbatches"] = f"{pipe.num_microbatches} x {pipe.microbatch_size}"
    out["headline_s"] = pipe.plan.seconds_per_minibatch
    sim = pipe.simulate()
    out["simulate_s"], out["bubble"] = float(sim.step_time_s), float(sim.bubble_fraction)
    if cfg.get("no_emit"):
        out["peak_rss_gib"] = _peak_rss_gib()
        return out
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        try:
            prog = pipe.emit(Path(tmp) / "prog")
        except Exception as e:  # noqa: BLE001 - reported in the table, not hidden
            out["emit_error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:160]
        else:
            out["emit_s"] = time.perf_counter() - t0
            out["plan_json_kib"] = (prog / "plan.json").stat().st_size / 1024
            if cfg.get("startup_rank") is not None:
                out.update(startup(prog, cfg["startup_rank"], cfg.get("steps", 1000)))
    out["peak_rss_gib"] = _peak_rss_gib()
    return out


def startup(prog: Path, rank: int, steps: int) -> dict[str, Any]:
    """Rank ``rank``'s start-up up to its first action, as train.py runs it, without a process group:
    plan.json read, the compiled schedule checked against it, the weight-pass choice, the rank's
    run of ``steps`` steps (sends released, receives posted) and its first action."""
    from pdcompile.runtime import schedules
    from pdcompile.runtime.launch import parse_args
    from pdcompile.runtime.program import Program
    from pdcompile.runtime.run_schedule import run_schedule, weight_pass

    schedules.periodic.clear_cache()  # a process starts cold
    c0 = time.process_time()
    t0 = time.perf_counter()
    program = Program.load(prog)
    args = parse_args(["--steps", str(steps)], program)
    t1 = time.perf_counter()
    spec = run_schedule(program, args, rank)
    t2 = time.perf_counter()
    weight_pass(args.weight_pass, spec, rank)
    run = spec.rank_run(steps, rank)
    first = next(iter(run.steps()))
    t3 = time.perf_counter()
    return {"startup_s": t3 - t0, "startup_cpu_s": time.process_time() - c0, "load_s": t1 - t0, "check_s": t2 - t1, "run_s": t3 - t2,
            "first_action": str(first[0]), "run_actions": len(run)}


def adamw(params: Any) -> Any:
    import torch

    return torch.optim.AdamW(params, lr=1e-4)


def run_child(cfg: dict[str, Any], timeout: float) -> dict[str, Any]:
    return _common.run_child(__file__, cfg, timeout)


# --- the two parts ------------------------------------------------------------------------------------------------

def _f(x: Any, fmt: str = ".1f") -> str:
    return "-" if x is None else format(x, fmt)


def models_part(quick: bool, timeout: float) -> str:
    rows = ["| model (params) | H100s | plan: stages (replicas of each) | compile (s) | its CPU time (s) | "
            "of which passes (s) | slowest passes (s) | emit (s) | peak RSS (GiB) | target |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    names = ["tiny"] if quick else ["llama-2-7b", "llama-3-70b"]
    for name in names:
        for gpus in ((2,) if quick else (8, 64)):
            seq = 16 if quick else 4096
            cfg = {"model": name, "gpus": gpus, "batch": 32 if not quick else 4, "seq": seq,
                   "microbatches": 32 if not quick else 4}
            r = run_child(cfg, timeout)
            target = "-" if quick else f"< {30 if '7b' in name else 120} s, < 2 GiB"
            if "error" in r:
                rows.append(f"| {name} | {gpus} | {r['error']} | - | - | - | - | - | - | {target} |")
                continue
            emit = _f(r.get("emit_s"), ".1f") if "emit_error" not in r else f"failed: {r['emit_error']}"
            rows.append(f"| {name} ({r['params_b']:.2f} B) | {gpus} | {r['stages']} ({r['replicas']}) | "
                        f"{r['compile_s']:.1f} | {r['compile_cpu_s']:.1f} | {r['passes_s']:.1f} | {r['slowest_passes']} | "
                        f"{emit} | {r['peak_rss_gib']:.2f} | {target} |")
            print(rows[-1], flush=True)
    return "\n".join(rows)


def ranks_part(quick: bool, timeout: float, counts: list[int]) -> str:
    rows = ["| ranks | stages (replicas of each) | microbatches per step | compile (s) | emit (s) | plan.json (KiB) | "
            "start-up of one rank (s) | its CPU time (s) | of which: check vs plan.json (s) | its run of 1000 steps (s) | "
            "peak RSS (GiB) | start-up growth per doubling |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    stages = 4 if quick else 16
    prev: tuple[int, float] | None = None
    for n in counts:
        reps = n // stages
        cfg = {"model": "tiny-16-layers" if quick else "llama-16-layers", "gpus": n, "batch": 16 * reps,
               "seq": 16 if quick else 512, "microbatches": 16 * reps, "stages": stages, "replicas": [reps] * stages,
               "startup_rank": n // 2 + 1, "steps": 1000}
        r = run_child(cfg, timeout)
        if "error" in r:
            rows.append(f"| {n} | {stages} x {reps} | {16 * reps} | {r['error']} | - | - | - | - | - | - | - | - |")
            continue
        growth = "-"
        if prev is not None and "startup_s" in r:
            growth = f"{(r['startup_s'] / prev[1]) ** (1 / math.log2(n / prev[0])):.2f}x"
        if "startup_s" in r:
            prev = (n, r["startup_s"])
        emit = _f(r.get("emit_s"), ".3g") if "emit_error" not in r else f"failed: {r['emit_error']}"
        rows.append(f"| {n} | {r['stages']} ({r['replicas']}) | {16 * reps} | {r['compile_s']:.1f} | {emit} | "
                    f"{_f(r.get('plan_json_kib'))} | {_f(r.get('startup_s'), '.3g')} | {_f(r.get('startup_cpu_s'), '.3g')} | "
                    f"{_f(r.get('check_s'), '.2f')} | "
                    f"{_f(r.get('run_s'), '.3g')} | {r['peak_rss_gib']:.2f} | {growth} |")
        print(rows[-1], flush=True)
    return "\n".join(rows)


def objective_part(quick: bool, timeout: float) -> str:
    """Llama-3-70B on 64 H100s (8 a server, 450 GB/s inside, 50 GB/s between), 32 x 4096 tokens, bf16, AdamW,
    the data real and the model on meta: the plan's headline against simulate() of the compiled program,
    compile time and peak RSS, flush (the microbatch count chosen with the depth) and auto (issue 36 item 0)."""
    rows = ["| schedule asked | compiled | stages (replicas of each) | microbatches | headline (s) | simulate() (s) | "
            "bubble | compile (s) | its CPU time (s) | peak RSS (GiB) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for schedule in ("flush", "auto"):
        cfg = {"model": "tiny" if quick else "llama-3-70b", "gpus": 2 if quick else 64, "batch": 4 if quick else 32,
               "seq": 16 if quick else 4096, "microbatches": None, "schedule": schedule, "real_data": True,
               "adamw": True, "precision": "bf16", "no_emit": True}
        r = run_child(cfg, timeout)
        if "error" in r:
            rows.append(f"| {schedule} | {r['error']} | - | - | - | - | - | {r['wall_s']:.0f} | - | - |")
            continue
        rows.append(f"| {schedule} | {r['schedule']} | {r['stages']} ({r['replicas']}) | {r['microbatches']} | "
                    f"{r['headline_s']:.4g} | {r['simulate_s']:.4g} | {r['bubble']:.1%} | {r['compile_s']:.1f} | "
                    f"{r['compile_cpu_s']:.1f} | {r['peak_rss_gib']:.2f} |")
        print(rows[-1], flush=True)
    return "\n".join(rows)


def tensor_part(quick: bool, timeout: float) -> str:
    """Llama-3-70B on 64 H100s (8 a server), 32 x 4096 tokens, bf16, AdamW, on meta, 32 microbatches: the plan
    with ``tensor_parallel=1`` and with ``"auto"`` (issue 35: t chosen inside the server, and why)."""
    rows = ["| tensor_parallel | t | stages (replicas of each) | microbatches | headline (s) | simulate() (s) | bubble | "
            "compile (s) | its CPU time (s) | peak RSS (GiB) |", "|---|---|---|---|---|---|---|---|---|---|"]
    whys = []
    for tp in (1, "auto"):
        cfg = {"model": "tiny" if quick else "llama-3-70b", "gpus": 2 if quick else 64, "batch": 4 if quick else 32,
               "seq": 16 if quick else 4096, "microbatches": 4 if quick else 32, "adamw": True, "precision": "bf16",
               "no_emit": True, "tensor_parallel": tp}
        r = run_child(cfg, timeout)
        if "error" in r:
            rows.append(f"| {tp} | {r['error']} | - | - | - | - | - | {r['wall_s']:.0f} | - | - |")
            continue
        rows.append(f"| {tp} | {r['t']} | {r['stages']} ({r['replicas']}) | {r['microbatches']} | {r['headline_s']:.4g} | "
                    f"{r['simulate_s']:.4g} | {r['bubble']:.1%} | {r['compile_s']:.1f} | {r['compile_cpu_s']:.1f} | "
                    f"{r['peak_rss_gib']:.2f} |")
        if r.get("why") or r.get("tp_note"):
            whys += [f"- `{tp}`: {r['why']}", f"  note: {r['tp_note']}"]
        print(rows[-1], flush=True)
    return "\n".join(rows + [""] + whys)


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=["models", "ranks", "objective", "tensor", "all"], default="all")
    ap.add_argument("--ranks", type=int, nargs="+", default=None, help="rank counts of the ranks part")
    ap.add_argument("--quick", action="store_true", help="tiny sizes; print only")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per configuration")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(child(json.loads(a.child))), flush=True)
        return ""
    bodies = []
    for part in (["models", "ranks"] if a.part == "all" else [a.part]):
        with open("/proc/loadavg") as f:
            load = f.read().strip()
        if part == "tensor":
            name, command = "Big model: tensor parallelism planned", "python benchmarks/bench_big_model.py --part tensor"
            table = ("Llama-3-70B on meta, 64 H100s (8 a server: 450 GB/s inside, 50 GB/s between), bf16, AdamW, "
                     "analytic costs, tensor parallelism given 1 and planned (`auto`):\n\n" + tensor_part(a.quick, a.timeout))
        elif part == "objective":
            name, command = "Big model: the plan's step", "python benchmarks/bench_big_model.py --part objective"
            table = ("Llama-3-70B on meta, real data, 64 H100s, bf16, AdamW: the plan's headline is simulate():\n\n"
                     + objective_part(a.quick, a.timeout))
        elif part == "models":
            name, command = "Big model: compile on meta", "python benchmarks/bench_big_model.py --part models"
            table = ("Llama shapes built on meta, analytic costs, the planner choosing stages and replicas:\n\n"
                     + models_part(a.quick, a.timeout))
        else:
            counts = a.ranks or ([4, 8] if a.quick else [64, 256, 1024])
            name, command = "Big model: 16 stages on many ranks", "python benchmarks/bench_big_model.py --part ranks"
            table = ("One 16-stage plan on many ranks: compile, emit, one rank's start-up up to its first action:\n\n"
                     + ranks_part(a.quick, a.timeout, counts))
        body = (f"{table}\n\nLoad before the run (`cat /proc/loadavg`): {load}; machine: 2-core CPU, shared.\n"
                "Each configuration ran in its own process; peak RSS is that process's ru_maxrss (Python, torch and "
                "transformers included).\n")
        publish(name, body, command, write=not a.quick)
        bodies.append(body)
    return "\n".join(bodies)


if __name__ == "__main__":
    main()
