"""Benchmark: the cost model's compute against the same stage measured in one process, pipelining and links apart.

For each bench_plan_regret workload (gpt, vgg, fashion, shakespeare, llama) at the microbatch sizes its candidates
use (minibatch / M, M in 1, 2, 4, 8 where it divides), for the whole model and for 2-stage cuts: the forward and
backward seconds the cost model assigns each stage (``pdcompile(model, local_cpu_cluster(2), ...)`` as
bench_plan_regret compiles a candidate: the compiled chain's layers, sized as ``simulate_plan`` sizes them,
``ChainLayer.scaled``), divided by the 2-process charges the annotate-costs pass multiplied in (``contention`` x
``corun``: what the compute of one process alone is predicted to be), against the stage measured as the runtime
runs it: the emitted program's stage module (``Program.build_stage``), forward on the microbatch (the last stage:
and the loss), then the backward from its output (seeds of ones; the last stage: from the loss), one thread, the
median of ``--repeats`` after warm-up, wall clock. The runtime's per-action cost (plan.json's ``F``/``B``, the
calibrated ``overhead_s``) is not in either column: the measured call includes the module call itself (tens of
microseconds), which the prediction charges as part of that per-action cost instead.

``--corun``: each 2-stage cut's two stages measured again side by side, one process each (both computing at once,
as 2 busy workers do), against each alone: the measured co-running slowdown beside the calibrated ``corun{2}``.

Phases (the compile niced, the timing under a lock on a shared machine):
  python benchmarks/bench_compute_error.py --prepare DIR      # compile, emit and predict every stage (no timing)
  python benchmarks/bench_compute_error.py --measure DIR      # time them, print and write the table
Without either, both in one process. ``--workloads``, ``--counts``, ``--cuts N`` (2-stage cuts per workload,
spread over the allowed ones), ``--repeats``, ``--json FILE``, ``--no-write``, ``--lock FILE`` (held while timing).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from pdcompile.stage_timing import StageRun, time_stage  # noqa: E402 - the stage as the runtime runs it

NAME = "Compute error (bench_compute_error)"
WORKLOADS = ("gpt", "vgg", "fashion", "shakespeare", "llama")
COUNTS = (1, 2, 4, 8)


# ---------------------------------------------------------------------------------------------
# prediction


def stage_mix(pipe: Any, first: int, last: int) -> dict[str, float]:
    """Share of the predicted forward + backward of layers ``first..last`` per op class, and ``node`` for the
    per-node overhead of a whole stage (``OpCostTable.node_s``), from the annotated graph."""
    from pdcompile.passes.costs.opclass import op_class

    gm = pipe.state.gm
    table = pipe.cost_source.table
    by_name = {n.name: n for n in gm.graph.nodes}
    out: dict[str, float] = {}
    for layer in pipe.state.chain.layers[first:last + 1]:
        for m in layer.members or (layer.name,):
            node = by_name.get(m)
            c = None if node is None else node.meta.get("pd.cost")
            if c is None:
                continue
            per = 0.0
            if table is not None:
                per = table.node_s[0] + (table.node_s[1] if c.backward_s else 0.0)
            cls = op_class(node, gm)
            out[cls] = out.get(cls, 0.0) + c.forward_s + c.backward_s - per
            out["node"] = out.get("node", 0.0) + per
    total = sum(out.values()) or 1.0
    return {k: v / total for k, v in sorted(out.items(), key=lambda kv: -kv[1])}


def predicted(pipe: Any, cluster: Any, first: int, last: int) -> tuple[float, float, float]:
    """(forward s, backward s, the 2-process factor divided out) of layers ``first..last`` of ``pipe``'s chain at its
    microbatch size, one process alone."""
    from pdcompile.passes.annotate_costs import corun
    from pdcompile.passes.costs.roofline import contention

    chain = pipe.state.chain
    scale = pipe.plan.microbatch_size / chain.batch_size
    sized = [l.scaled(scale) for l in chain.layers[first:last + 1]]
    factor = contention(cluster) * corun(cluster, pipe.cost_source.table)
    return sum(f for f, _, _ in sized) / factor, sum(b for _, b, _ in sized) / factor, factor


def nodes_of(pipe: Any, first: int, last: int) -> int:
    return sum(len(l.members or (l.name,)) for l in pipe.state.chain.layers[first:last + 1])


def prepare(args: argparse.Namespace, out: Path) -> list[dict[str, Any]]:
    """Every (workload, M, shape) compiled, emitted under ``out`` and predicted; the rows (no measurement)."""
    from benchmarks.bench_plan_regret import Candidate, allowed_cuts, compile_candidate, spread, workload
    from pdcompile.cluster import local_cpu_cluster

    cluster = local_cpu_cluster(2)
    rows: list[dict[str, Any]] = []
    for wname in args.workloads:
        w = workload(wname)
        batch = int(w.inputs[0].shape[0])
        counts = [m for m in args.counts if batch % m == 0]
        cuts: list[int] | None = None
        for m in counts:
            t0 = time.perf_counter()
            whole = compile_candidate(w, cluster, Candidate(((0, -1, 1),), "flush", m))
            n = len(whole.state.chain.layers)
            if cuts is None:
                allowed = allowed_cuts(whole.state.chain)
                cuts = spread(allowed, args.cuts + 2)[1:-1] if len(allowed) > args.cuts else allowed
            shapes: list[tuple[str, Any, tuple[tuple[int, int], ...]]] = [("whole", whole, ((0, n - 1),))]
            for c in cuts:
                pipe = compile_candidate(w, cluster, Candidate(((0, c - 1, 1), (c, n - 1, 1)), "flush", m))
                shapes.append((f"cut {c}", pipe, ((0, c - 1), (c, n - 1))))
            for label, pipe, spans in shapes:
                prog = pipe.emit(out / wname / f"M{m}" / label.replace(" ", "") / "program")
                for s, (a, b) in enumerate(spans):
                    f, bw, factor = predicted(pipe, cluster, a, b)
                    rows.append(dict(workload=wname, M=m, microbatch=pipe.plan.microbatch_size, shape=label, stage=s,
                                     stages=len(spans), layers=[a, b], nodes=nodes_of(pipe, a, b),
                                     program=str(prog), pred_f=f, pred_b=bw, factor=factor,
                                     mix=stage_mix(pipe, a, b)))
            print(f"[{wname}] M={m}: {len(shapes)} shapes compiled in {time.perf_counter() - t0:.1f} s", flush=True)
    (out / "prepared.json").write_text(json.dumps(rows, indent=1))
    return rows


# ---------------------------------------------------------------------------------------------
# measurement


def _microbatch(wname: str, mb: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    from benchmarks.bench_plan_regret import workload

    w = workload(wname)
    return tuple(x[:mb] for x in w.inputs), w.target[:mb]


def _corun_child(program: str, stage: int, wname: str, mb: int, repeats: int, barrier: Any, conn: Any) -> None:
    from pdcompile.runtime import allocator

    torch.set_num_threads(1)
    allocator.set_mode("keep")
    inputs, target = _microbatch(wname, mb)
    run = StageRun(program, stage, inputs, target)
    for _ in range(3):
        run.forward()
        run.backward()
    barrier.wait()
    t_end = time.perf_counter() + 0.0
    f, b = time_stage(run, repeats, warmup=2)
    conn.send((f, b, time.perf_counter() - t_end))
    conn.close()


def measure_corun(program: str, wname: str, mb: int, repeats: int) -> list[tuple[float, float]]:
    """Both stages of a 2-stage program timed at once, one process each (spawned, one thread): [(fwd, bwd)]."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(2)
    pipes, procs = [], []
    for s in range(2):
        a, b = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_corun_child, args=(program, s, wname, mb, repeats, barrier, b))
        p.start()
        pipes.append(a)
        procs.append(p)
    got = [p.recv()[:2] for p in pipes]
    for p in procs:
        p.join(60)
    return got


@contextlib.contextmanager
def locked(path: str | None) -> Iterator[None]:
    if not path:
        yield
        return
    import fcntl

    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def measure(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """Each row's stage timed alone (and with ``--corun``, each cut's two stages side by side), in place; malloc set
    as the runtime sets it on CPU (``keep``: no page faults for what a step frees and allocates again)."""
    from pdcompile.runtime import allocator

    torch.set_num_threads(1)
    allocator.set_mode("keep")
    with locked(args.lock):
        load = Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else []
        t0 = time.perf_counter()
        for r in rows:
            inputs, target = _microbatch(r["workload"], r["microbatch"])
            torch.manual_seed(0)
            r["meas_f"], r["meas_b"] = time_stage(StageRun(r["program"], r["stage"], inputs, target), args.repeats)
        if args.corun:
            for r in rows:
                if r["stages"] == 2 and r["stage"] == 0:
                    got = measure_corun(r["program"], r["workload"], r["microbatch"], args.repeats)
                    for s, (f, b) in enumerate(got):
                        other = next(x for x in rows if x["program"] == r["program"] and x["stage"] == s)
                        other["corun_f"], other["corun_b"] = f, b
        args.timing = dict(load_before=load, seconds=time.perf_counter() - t0,
                           load_after=Path("/proc/loadavg").read_text().split()[:3] if load else [])


# ---------------------------------------------------------------------------------------------
# the table


def _err(p: float, m: float) -> float:
    return p / m - 1 if m > 0 else math.nan


def _mix(mix: dict[str, float]) -> str:
    return ", ".join(f"{k} {v * 100:.0f}%" for k, v in list(mix.items())[:3])


def table(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    corun = any("corun_f" in r for r in rows)
    lines = ["| workload | M (microbatch) | shape | stage (layers, nodes) | predicted mix (share of fwd+bwd) | "
             "fwd pred (ms) | fwd meas | fwd error | bwd pred | bwd meas | bwd error | fwd+bwd error |"
             + (" side by side / alone |" if corun else ""),
             "|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if corun else "")]
    for r in rows:
        if "meas_f" not in r:
            continue
        tot = _err(r["pred_f"] + r["pred_b"], r["meas_f"] + r["meas_b"])
        extra = ""
        if corun:
            extra = (f" {(r['corun_f'] + r['corun_b']) / (r['meas_f'] + r['meas_b']):.2f} |" if "corun_f" in r
                     else " |")
        lines.append(f"| {r['workload']} | {r['M']} ({r['microbatch']}) | {r['shape']} | {r['stage']} "
                     f"({r['layers'][0]}-{r['layers'][1]}, {r['nodes']}) | {_mix(r['mix'])} | "
                     f"{r['pred_f'] * 1e3:.3f} | {r['meas_f'] * 1e3:.3f} | {_err(r['pred_f'], r['meas_f']) * 100:+.1f}% | "
                     f"{r['pred_b'] * 1e3:.3f} | {r['meas_b'] * 1e3:.3f} | {_err(r['pred_b'], r['meas_b']) * 100:+.1f}% | "
                     f"{tot * 100:+.1f}% |{extra}")
    summary = ["", "| workload | stages | median abs fwd+bwd error | max abs | median fwd error | median bwd error |",
               "|---|---|---|---|---|---|"]
    every: list[float] = []
    for wname in dict.fromkeys(r["workload"] for r in rows):
        mine = [r for r in rows if r["workload"] == wname and "meas_f" in r]
        if not mine:
            continue
        tot = [abs(_err(r["pred_f"] + r["pred_b"], r["meas_f"] + r["meas_b"])) for r in mine]
        every += tot
        summary.append(f"| {wname} | {len(mine)} | {statistics.median(tot) * 100:.1f}% | {max(tot) * 100:.1f}% | "
                       f"{statistics.median(_err(r['pred_f'], r['meas_f']) for r in mine) * 100:+.1f}% | "
                       f"{statistics.median(_err(r['pred_b'], r['meas_b']) for r in mine) * 100:+.1f}% |")
    if every:
        summary.append(f"| all | {len(every)} | {statistics.median(every) * 100:.1f}% | {max(every) * 100:.1f}% | | |")
    if corun:
        ratios = [(r["corun_f"] + r["corun_b"]) / (r["meas_f"] + r["meas_b"]) for r in rows if "corun_f" in r]
        factors = {round(r["factor"], 3) for r in rows}
        summary += ["", f"Side by side (2 processes, each one stage of a cut, both computing at once) / alone: median "
                        f"{statistics.median(ratios):.2f}, range {min(ratios):.2f}-{max(ratios):.2f} over {len(ratios)} "
                        f"stages; the calibration's 2-process factor (contention x corun) charged: "
                        f"{', '.join(f'{f:.3f}' for f in sorted(factors))}."]
    return "\n".join(lines + summary)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--counts", default=",".join(map(str, COUNTS)))
    ap.add_argument("--cuts", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--prepare", metavar="DIR")
    ap.add_argument("--measure", metavar="DIR")
    ap.add_argument("--corun", action="store_true")
    ap.add_argument("--lock", metavar="FILE")
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    args.workloads = [w for w in args.workloads.split(",") if w]
    args.counts = [int(m) for m in args.counts.split(",") if m]
    torch.set_num_threads(1)
    if args.prepare:
        prepare(args, Path(args.prepare))
        return 0
    if args.measure:
        rows = json.loads((Path(args.measure) / "prepared.json").read_text())
        rows = [r for r in rows if r["workload"] in args.workloads and r["M"] in args.counts]
    else:
        rows = prepare(args, Path(tempfile.mkdtemp(prefix="pd-compute-error-")))
    measure(rows, args)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    from benchmarks._results import machine, publish
    from pdcompile import machine_cache

    t = args.timing
    d = machine_cache.cached() or {}
    oc = d.get("op_costs", {})
    body = (f"Predicted: the compiled chain's forward and backward of each stage, `pdcompile(model, local_cpu_cluster(2), "
            f"stages=1 or 2, num_microbatches=M)` as bench_plan_regret compiles, sized as `simulate_plan` sizes them, "
            f"divided by the 2-process charge (contention x corun) to give one process alone; this machine's calibration "
            f"({oc.get('source', 'none')}; node {oc.get('node')}, corun {oc.get('corun')}). Measured: the emitted stage "
            f"module forward (the last stage with its loss), then backward from its output, one thread, malloc as the "
            f"runtime sets it (keep), median of {args.repeats} after 5 warm-up, wall clock, in one process (the module call's own cost included, which "
            f"the prediction charges in the per-action cost instead). Mix: the predicted time's share per op class "
            f"(node: the per-node overhead). Load average before {' / '.join(t['load_before'])}, after "
            f"{' / '.join(t['load_after'])} on {os.cpu_count()} cores; timing {t['seconds']:.0f} s. Machine: {machine()}.\n\n"
            + table(rows, args))
    command = "python " + " ".join([os.path.relpath(sys.argv[0])] + (argv if argv is not None else sys.argv[1:]))
    publish(NAME, body, command, write=not args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
