"""Benchmark: how far apart two launches of the same emitted program measure (launch-to-launch noise).

bench_plan_regret judges the planner by launching every candidate's program and taking the median step of
each launch; if one program measures 30% apart from one launch to the next, no prediction can be judged
within 10%. This launches each variant's program ``--launches`` times, interleaved (A B A B ...: every
launch of a round, each variant under each mode, before the next round), as bench_plan_regret's
``measure_with_load()`` does (the emitted train.py under torchrun through ``python -m pdcompile.slowlink``, the memory
meter off, the slowest rank per minibatch, ``--warmup`` minibatches dropped), and reports per variant and
mode: each launch's median step, their spread (max / min and the coefficient of variation of the launch
medians), the mean step over every measured step, the spread within a launch (the median over launches of
each launch's own coefficient of variation), and the cores each rank ran on (the runtime's
``--pin-cores``, read from the metrics).

A mode is a name and the train.py flags (and ``NAME=VALUE`` environment settings) it launches with:
``--mode 'unpinned=--pin-cores off'``; the default modes are the runtime as is (``pinned``: each rank
on its own core where the node has a core per rank) and ``unpinned`` (``--pin-cores off``: where the
kernel puts them), which is the runtime before ``--pin-cores``.

Usage:
  python benchmarks/bench_launch_noise.py                          # llama: dp x2 flush M=2, 2 stages gpipe M=2
  python benchmarks/bench_launch_noise.py --workload gpt --variants pp:zb-h1:8 --launches 6
  python benchmarks/bench_launch_noise.py --launches 2 --steps 4 --warmup 1 --no-write   # a smoke run
Variants: ``dp:SCHEDULE:M`` (one stage, every worker a replica) or ``pp:SCHEDULE:M`` (a stage per worker, the
planner's balanced cut), comma-separated.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import shlex  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from typing import Any  # noqa: E402

NAME = "Launch-to-launch noise (bench_launch_noise)"
DEFAULT_MODES = ("pinned=", "unpinned=--pin-cores off")


@dataclasses.dataclass(frozen=True)
class Variant:
    """One program to launch: its shape (``dp``: one stage replicated on every worker; ``pp``: a stage per worker),
    schedule and microbatch count."""

    shape: str
    schedule: str
    num_microbatches: int

    @classmethod
    def parse(cls, text: str) -> Variant:
        try:
            shape, schedule, m = text.split(":")
            v = cls(shape, schedule, int(m))
        except ValueError:
            raise SystemExit(f"--variants: {text!r} is not SHAPE:SCHEDULE:M (e.g. dp:flush:2, pp:gpipe:2)") from None
        if shape not in ("dp", "pp"):
            raise SystemExit(f"--variants: shape {shape!r}: dp or pp")
        return v

    def __str__(self) -> str:
        return f"{'data parallel' if self.shape == 'dp' else 'a stage per worker'}, {self.schedule}, " \
               f"M={self.num_microbatches}"


@dataclasses.dataclass(frozen=True)
class Mode:
    """A way to launch: train.py flags and environment settings."""

    name: str
    flags: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()

    @classmethod
    def parse(cls, text: str) -> Mode:
        name, _, rest = text.partition("=")
        flags, env = [], []
        for tok in shlex.split(rest):
            key, eq, value = tok.partition("=")
            if eq and key.isupper() and not key.startswith("-"):
                env.append((key, value))
            else:
                flags.append(tok)
        return cls(name.strip() or "as-is", tuple(flags), tuple(env))

    def __str__(self) -> str:
        what = " ".join([*(f"{k}={v}" for k, v in self.env), *self.flags])
        return f"{self.name} ({what or 'no flags'})"


@dataclasses.dataclass
class Launch:
    """One launch's figures."""

    steps_s: list[float]  # per measured minibatch, the slowest rank's
    cores: list[list[int]]  # per rank, the cores it ran on (the metrics' cpu_affinity)
    wall_s: float
    wait_s: list[float] = dataclasses.field(default_factory=list)  # per rank, per minibatch: runnable, no core
    cpu_s: list[float] = dataclasses.field(default_factory=list)  # per rank, per minibatch: on a core
    niced: float = math.nan  # the share of the machine's CPU time that niced processes took during the launch

    @property
    def median(self) -> float:
        return statistics.median(self.steps_s)

    @property
    def cv(self) -> float:
        return cv(self.steps_s)


def cv(xs: Sequence[float]) -> float:
    """Coefficient of variation (population standard deviation / mean); NaN for fewer than 2."""
    return statistics.pstdev(xs) / statistics.fmean(xs) if len(xs) > 1 and statistics.fmean(xs) else math.nan


def compile_variant(wname: str, v: Variant, workers: int) -> Any:
    from benchmarks.bench_plan_regret import cluster_for, workload
    from pdcompile.api import pdcompile

    w = workload(wname)
    stages, replicas = (1, [workers]) if v.shape == "dp" else (workers, [1] * workers)
    return pdcompile(w.model, cluster_for(workers, 0.0), example_inputs=w.inputs, example_target=w.target,
                     loss_fn=w.loss_fn, optimizer=w.optimizer, leaf_modules=w.leaf_modules, stages=stages,
                     replicas=replicas, num_microbatches=v.num_microbatches, schedule=v.schedule)


def launch_once(program: Path, workers: int, v: Variant, mode: Mode, steps: int, warmup: int) -> Launch:
    from benchmarks.bench_plan_regret import launch_metrics, slowest_steps

    t0, before = time.perf_counter(), cpu_times()
    ranks = launch_metrics(program, workers, v.schedule, 0.0, steps, warmup, extra=mode.flags, env=dict(mode.env))
    wall = time.perf_counter() - t0
    ticks = {k: v - before.get(k, 0) for k, v in cpu_times().items()}
    n = steps + warmup
    return Launch(slowest_steps(ranks, v.schedule, steps, warmup), [list(r.get("cpu_affinity") or []) for r in ranks],
                  wall, [float((r.get("sched") or {}).get("wait_s", math.nan)) / n for r in ranks],
                  [float((r.get("sched") or {}).get("run_s", math.nan)) / n for r in ranks],
                  ticks.get("nice", 0) / max(1, sum(ticks.values())))


def cpu_times() -> dict[str, int]:
    """The machine's CPU time so far (/proc/stat's first line, in clock ticks): user, nice (processes of a
    lowered priority: other work niced beside the measurement), system, idle, steal."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return {}
    return dict(user=v[0], nice=v[1], system=v[2], idle=v[3], steal=v[7] if len(v) > 7 else 0)


def table(results: dict[tuple[str, str], list[Launch]], variants: Sequence[Variant], modes: Sequence[Mode]) -> str:
    out = ["| variant | mode | launch medians (ms) | max / min | CV of launch medians | mean step (ms) | "
           "CV within a launch (median) | waiting for a core (ms per minibatch, per launch) | niced work's CPU share, "
           "per launch | cores per rank |", "|---|---|---|---|---|---|---|---|---|---|"]
    for v in variants:
        for m in modes:
            ls = results.get((str(v), m.name), [])
            if not ls:
                out.append(f"| {v} | {m.name} | failed | - | - | - | - | - | - | - |")
                continue
            meds = [launch.median for launch in ls]
            every = [x for launch in ls for x in launch.steps_s]
            cores = sorted({json.dumps(launch.cores) for launch in ls})
            out.append(f"| {v} | {m.name} | {', '.join(f'{x * 1e3:.2f}' for x in meds)} | {max(meds) / min(meds):.2f} | "
                       f"{cv(meds):.1%} | {statistics.fmean(every) * 1e3:.2f} | "
                       f"{statistics.median(launch.cv for launch in ls):.1%} | "
                       f"{', '.join(f'{max(launch.wait_s, default=math.nan) * 1e3:.2f}' for launch in ls)} | "
                       f"{', '.join(f'{launch.niced:.0%}' for launch in ls)} | "
                       f"{'; '.join(cores) or '?'} |")
    return "\n".join(out) + "\n"


def probe(wname: str, seconds: float, window: float = 0.5) -> list[tuple[float, dict[str, float]]]:
    """One process, no launch: the workload's forward and backward of half its batch (a replica's share in data
    parallelism x2)
    timed back to back for ``seconds``; per ``window`` seconds, the median step and the shares of the machine's CPU
    time (/proc/stat) meanwhile. What a rank's compute alone does while the machine's other core is idle, or runs
    other work (niced or not)."""
    import torch

    from benchmarks.bench_plan_regret import workload

    w = workload(wname)
    n = max(1, int(w.inputs[0].shape[0]) // 2)
    x, y = tuple(t[:n] for t in w.inputs), w.target[:n]

    def step() -> None:
        out = w.model(*x)
        w.loss_fn(getattr(out, "logits", out), y).backward()

    torch.set_num_threads(1)
    for _ in range(10):
        step()
    out: list[tuple[float, dict[str, float]]] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        before, times, t0 = cpu_times(), [], time.perf_counter()
        while time.perf_counter() - t0 < window:
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
        d = {k: v - before.get(k, 0) for k, v in cpu_times().items()}
        total = sum(d.values()) or 1
        out.append((statistics.median(times), {k: v / total for k, v in d.items()}))
    return out


def probe_table(windows: Sequence[tuple[float, dict[str, float]]], window: float = 0.5) -> str:
    """The probe's windows by what the rest of the machine did: the other core idle (idle >= 30% of the machine),
    niced work on it (nice >= 20%), or other (un-niced) work."""
    groups: dict[str, list[float]] = {}
    for step, share in windows:
        kind = ("the other core idle" if share.get("idle", 0) >= 0.3 else
                "niced work on the other core" if share.get("nice", 0) >= 0.2 else "other work on the other core")
        groups.setdefault(kind, []).append(step)
    out = [f"One process computing alone (no launch: the workload's forward and backward, back to back, half the "
           f"batch), its median step per {window:g} s window, by what the machine's other core did meanwhile:", "",
           "| the other core | windows | median step (ms) | fastest window | slowest window | slowest / fastest |",
           "|---|---|---|---|---|---|"]
    for kind, steps in groups.items():
        out.append(f"| {kind} | {len(steps)} | {statistics.median(steps) * 1e3:.2f} | {min(steps) * 1e3:.2f} | "
                   f"{max(steps) * 1e3:.2f} | {max(steps) / min(steps):.2f} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", default="llama", help="a bench_plan_regret workload (gpt, vgg, fashion, shakespeare, "
                                                        "llama)")
    ap.add_argument("--variants", default="dp:flush:2,pp:gpipe:2")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--launches", type=int, default=6, help="launches of each variant under each mode")
    ap.add_argument("--steps", type=int, default=20, help="measured minibatches per launch (after --warmup)")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--mode", action="append", default=[], metavar="NAME=FLAGS",
                    help=f"a way to launch: train.py flags and NAME=VALUE environment settings (repeatable; "
                         f"default: {' and '.join(repr(m) for m in DEFAULT_MODES)})")
    ap.add_argument("--probe", type=float, default=0.0, metavar="SECONDS",
                    help="also time one process computing alone (no launch) for this long, per half second beside "
                         "what the machine's other core did (idle, niced work, other work)")
    ap.add_argument("--json", default="", help="also write every launch's step times here")
    ap.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md alone")
    args = ap.parse_args(argv)
    import torch

    from benchmarks._common import load_note
    from benchmarks._results import publish

    torch.set_num_threads(1)
    variants = [Variant.parse(x) for x in args.variants.split(",") if x]
    modes = [Mode.parse(x) for x in (args.mode or DEFAULT_MODES)]
    programs = {}
    for v in variants if args.launches > 0 else ():
        pipe = compile_variant(args.workload, v, args.workers)
        programs[str(v)] = pipe.emit(Path(tempfile.mkdtemp(prefix="pd-noise-")) / "program")
        print(f"compiled {v}: {len(pipe.plan.stages)} stage(s), replicas {[s.replicas for s in pipe.plan.stages]}",
              flush=True)
    load_before, cpu0, t0 = load_note(), cpu_times(), time.perf_counter()
    results: dict[tuple[str, str], list[Launch]] = {}
    notes: list[str] = []
    for i in range(args.launches):
        for v in variants:
            for m in modes:
                try:
                    got = launch_once(programs[str(v)], args.workers, v, m, args.steps, args.warmup)
                except Exception as e:  # noqa: BLE001 - one failed launch is noted, the rest go on
                    notes.append(f"{v}, {m.name}, launch {i + 1}: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
                    continue
                results.setdefault((str(v), m.name), []).append(got)
                print(f"launch {i + 1}: {str(v):<40} {m.name:<10} median {got.median * 1e3:8.2f} ms, within-launch CV "
                      f"{got.cv:.1%}, cores {got.cores}, waiting for a core "
                      f"{', '.join(f'{x * 1e3:.2f}' for x in got.wait_s)} ms/minibatch, on one "
                      f"{', '.join(f'{x * 1e3:.2f}' for x in got.cpu_s)}, niced work {got.niced:.0%} of the CPU, "
                      f"{got.wall_s:.1f} s", flush=True)
    elapsed, cpu1 = time.perf_counter() - t0, cpu_times()
    ticks = {k: cpu1.get(k, 0) - cpu0.get(k, 0) for k in cpu1}
    total = sum(ticks.values()) or 1
    body = (f"Workload: {args.workload}, {args.workers} workers on loopback. Each launch: the emitted train.py under "
            f"torchrun through `python -m pdcompile.slowlink` (as bench_plan_regret measures), the memory meter off, "
            f"{args.steps} minibatches after {args.warmup} of warm-up, per minibatch the slowest rank; {args.launches} "
            f"launches of each variant under each mode, interleaved. Modes: {'; '.join(str(m) for m in modes)}.\n"
            f"Columns: each launch's median step in launch order; max / min and the coefficient of variation (standard "
            f"deviation / mean) of those medians; the mean of every measured step; the median over launches of the "
            f"coefficient of variation of a launch's own steps; per launch, the most any rank's process spent runnable "
            f"but waiting for a core (ms per minibatch, every thread summed: the metrics' `sched`, "
            f"/proc/self/task/*/schedstat); per launch, the share of the machine's CPU time that niced processes (other "
            f"work, lowered beside the timed run) took; the cores each rank was allowed (the metrics' "
            f"`cpu_affinity`).\n"
            f"Load before: {load_before}; after: {load_note()}. CPU time during the launches: "
            f"{', '.join(f'{k} {v / total:.0%}' for k, v in ticks.items())}. Run time {elapsed:.0f} s.\n\n"
            + table(results, variants, modes))
    windows = probe(args.workload, args.probe) if args.probe > 0 else []
    if windows:
        body += "\n" + probe_table(windows)
    if notes:
        body += "\nNotes:\n" + "".join(f"- {n}\n" for n in notes)
    if args.json:
        Path(args.json).write_text(json.dumps({**{f"{v} | {m}": [dataclasses.asdict(x) for x in ls]
                                                  for (v, m), ls in results.items()},
                                               "probe": [dict(step_s=t, **share) for t, share in windows]}, indent=1))
    command = "python benchmarks/bench_launch_noise.py " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    publish(NAME, body, command.strip(), write=not args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
