"""pdcompile's pipeline against DistributedDataParallel, on loopback and on an emulated slow link.

    python benchmarks/bench_vs_ddp.py            # ~4-6 minutes on 2 cores
    python benchmarks/bench_vs_ddp.py --quick    # tiny model, nothing written

Setup. A VGG-style model whose parameters sit in its classifier as VGG-16's do (six 3x3 convolutions
16-16-M-32-32-M-64-64-M on 32x32 images, then Linear 1024-1024-1024-10: 2.2M parameters, 2.1M of
them in the Linear layers), SGD lr 0.01, a global minibatch of 32, on two CPU processes (gloo):

* DDP: each rank holds the whole model and takes 16 of the 32 samples; gradients are all-reduced
  in DDP's buckets, overlapped with backward (``pdcompile/ddp_worker.py``).
* pdcompile: the model compiled into 2 stages (pdcompile's split), 4 microbatches of 8, the
  ``flush`` schedule (PipeDream-Flush: synchronous SGD, the same semantics as DDP); the emitted
  ``train.py`` unchanged (``python -m pdcompile.slowlink`` only installs the link emulation).

Link. ``loopback``: gloo over 127.0.0.1 as is. ``slow``: the documented emulation of
``pdcompile/slowlink.py`` (``PDCOMPILE_LINK_BPS``, read only by these workers): every byte a rank
sends occupies a serial link of ``--link-mbps`` MB/s per direction, from its send, as a NIC moves it
(the receiver gets the bytes once the link has carried them; an all-reduce costs the ring's 2(p-1)/p
of its bytes). DDP moves its 8.7 MB of
gradients every step; the pipeline moves only the activations and gradients at its cut. This is the
paper's claim (PipeDream section 2: data parallelism's all-reduce of large weight tensors dominates
on slow links; pipelines send only boundary activations): the pipeline should win there.

Both are launched alternately (``--rounds`` rounds) by this one script; step = the slowest rank's
time for one minibatch, the first ``--warmup`` steps of each launch dropped, median over rounds.
``pipeline/DDP`` is throughput (DDP step / pipeline step): above 1.0 the pipeline is faster.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import bench_model, compile_bench, load_note, median, ms, step_times, torchrun
from pdcompile import slowlink


@dataclass
class Row:
    """One link setting: median step times of DDP and of the pipeline, and bytes each moves."""

    link: str
    ddp_s: float
    pipe_s: float
    ddp_mb: float
    pipe_mb: float
    samples: int

    @property
    def ratio(self) -> float:
        return self.ddp_s / self.pipe_s


def run_ddp(model: str, size: str, batch: int, steps: int, nproc: int, bps: float, timeout: float = 300) -> list[list[float]]:
    out = Path(tempfile.mkdtemp(prefix="pd-bench-ddp-")) / "times.json"
    # SGD lr 0.01 (the worker's default) is the benchmarks' optimizer; every step trains the model's one batch
    rc, log = torchrun("pdcompile.ddp_worker", nproc,
                       ["--model", "benchmarks._common:bench_model",
                        "--model-kwargs", json.dumps({"name": model, "batch_size": batch, "size": size}),
                        "--batch", str(batch), "--steps", str(steps), "--out", str(out),
                        "--watchdog", str(timeout - 10)],
                       timeout=timeout, env={slowlink.ENV: str(bps)})
    if rc != 0:
        raise RuntimeError(f"DDP worker failed ({rc}):\n{log[-3000:]}")
    return json.loads(out.read_text())["step_times_s"]


def run_pipeline(program: Path, steps: int, nproc: int, bps: float, timeout: float = 300) -> list[list[float]]:
    metrics = Path(tempfile.mkdtemp(prefix="pd-bench-pipe-"))
    rc, log = torchrun("pdcompile.slowlink", nproc,
                       [str(program), "--steps", str(steps), "--metrics", str(metrics), "--timeout", "120"],
                       timeout=timeout, env={slowlink.ENV: str(bps)})
    if rc != 0:
        raise RuntimeError(f"pipeline failed ({rc}):\n{log[-3000:]}")
    return [json.loads(p.read_text())["step_times_s"] for p in sorted(metrics.glob("rank_*.json"))]


def boundary_mb(program: Path) -> float:
    """MB the pipeline moves per minibatch: every boundary tensor forward and its gradient back."""
    plan = json.loads((program / "plan.json").read_text())
    total = 0.0
    for st in plan["stages"][1:]:
        for t in st["inputs"]:
            n = 1
            for d in t["shape"]:
                n *= d
            size = 8 if t["dtype"] in ("int64", "float64") else 4
            total += n * size * (2 if t.get("requires_grad") else 1)
    return total * plan["num_microbatches"] / 1e6


def compare(*, model: str = "vgg", size: str = "fc", batch: int = 32, num_microbatches: int = 4, nproc: int = 2,
            steps: int = 15, warmup: int = 3, rounds: int = 2, link_mbps: float = 20.0) -> list[Row]:
    """Time DDP and the pipeline alternately on loopback and on the emulated ``link_mbps`` MB/s link."""
    b = bench_model(model, batch_size=batch, size=size)
    params_mb = sum(p.numel() * p.element_size() for p in b.model.parameters()) / 1e6
    pipe = compile_bench(b, nproc, "flush", num_microbatches)
    program = pipe.emit(Path(tempfile.mkdtemp(prefix="pd-bench-ddp-prog-")) / "program")
    links = {"loopback": 0.0, f"slow ({link_mbps:g} MB/s emulated)": link_mbps * 1e6}
    got: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in links}
    for _ in range(rounds):
        for name, bps in links.items():
            got[name][0].extend(step_times(run_ddp(model, size, batch, steps, nproc, bps), warmup))
            got[name][1].extend(step_times(run_pipeline(program, steps, nproc, bps), warmup))
    ring = 2 * (nproc - 1) / nproc * params_mb
    return [Row(name, median(d), median(p), ring, boundary_mb(program), len(p)) for name, (d, p) in got.items()]


def table(rows: list[Row]) -> str:
    lines = ["| link | DDP step (ms) | pipeline step (ms) | pipeline/DDP throughput | MB/step DDP (ring, per rank) | "
             "MB/step pipeline (all cuts) | steps timed |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.link} | {ms(r.ddp_s)} | {ms(r.pipe_s)} | {r.ratio:.2f} | {r.ddp_mb:.2f} | "
                     f"{r.pipe_mb:.2f} | {r.samples} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--link-mbps", type=float, default=20.0, help="emulated link, MB/s (20 MB/s = 160 Mbit/s)")
    p.add_argument("--quick", action="store_true", help="tiny model, one round, nothing written")
    args = p.parse_args(argv)
    before = load_note()
    if args.quick:
        rows = compare(size="tiny", batch=8, steps=5, warmup=1, rounds=1, link_mbps=args.link_mbps)
    else:
        rows = compare(steps=args.steps, warmup=args.warmup, rounds=args.rounds, link_mbps=args.link_mbps)
    body = (f"VGG-style model with VGG's parameter-heavy classifier (2.2M parameters), global minibatch 32, SGD, "
            f"2 CPU processes (gloo). DDP: 16 samples per rank, bucketed all-reduce. Pipeline: pdcompile's "
            f"2-stage split, flush schedule, 4 microbatches of 8. Slow link: a serial link per direction, bytes "
            f"moved from their send (pdcompile/slowlink.py, PDCOMPILE_LINK_BPS; DDP through a comm hook, ours by "
            f"wrapping torch.distributed's sends), not a real NIC. {args.rounds} alternating rounds x {args.steps} steps, "
            f"first {args.warmup} dropped; step = slowest rank, median. Throughput ratio > 1: pipeline faster.\n"
            f"Load: {before} at the start, {load_note()} at the end.\n\n" + table(rows))
    if not args.quick:
        from benchmarks._results import write_section

        write_section("Against data parallelism (bench_vs_ddp)", body, command="python benchmarks/bench_vs_ddp.py")
    print(body)


if __name__ == "__main__":
    main()
