"""Benchmark: every candidate the planner considers, run; the planner's pick judged against the best measured.

Per scenario (workload x link x workers), the candidates are what the planner chooses among:

* data parallelism (one stage, every worker a replica);
* on 2 workers, 2 stages at every cut the planner allows (at most ``--cuts``, default 10, spread
  evenly); on 3 workers, 3 stages balanced by compute;
* each pipeline under flush, gpipe, 1f1b and zb-h1 (data parallelism under flush: one stage has no
  schedule to choose), at M = 1, 2, 4, 8 microbatches where the minibatch divides (and, for
  replicas, where M shares out evenly);
* the planner's own pick (``pdcompile(cluster=...)``, its default schedule) and ``schedule="auto"``'s,
  measured as candidates too where they are none of the above.

For each candidate: the prediction made before any run (``CompiledPipeline.simulate()`` as a user
calls it: the compile's own costs and whatever this machine's cached calibration holds, nothing from
the run being predicted; the steady state is the makespan's growth per minibatch from 2 to 4
minibatches), the measured time per minibatch (the emitted program under torchrun through
``python -m pdcompile.slowlink``, which emulates the link when ``PDCOMPILE_LINK_BPS`` is set; per
minibatch the slowest rank, 1F1B and 2BW's per-update times summed per minibatch, the memory meter off;
``--warmup`` dropped,
the median of ``--steps``), and the error. Candidates are interleaved: every repeat runs each once, in
turn, and a candidate's figure is the median over repeats. Per scenario: Kendall's tau between the
predicted and measured orders, and the regret of the planner's pick and of auto's (its measured step
over the best measured).

A 2-stage cut other than the balanced one is compiled through ``stages=2`` with the partition pass's
balanced split replaced for that compile by the cut asked (:func:`cut_at`): the public API names no
cut, and what a user gets from ``stages=2`` is the balanced one.

Usage:
  python benchmarks/bench_plan_regret.py                       # every scenario (hours; a quiet machine)
  python benchmarks/bench_plan_regret.py --workloads gpt --links loopback --workers 2 \\
      --max-candidates 4 --repeats 1 --steps 6 --smoke         # a smoke run (minutes)
Flags: --workloads gpt,vgg,fashion,shakespeare,llama --links loopback,100MB,20MB --workers 2,3
--repeats 3 --steps 20 --warmup 4 --max-candidates N --cuts 10 --png FILE --json FILE --no-write --smoke
--with-json FILE... (table another run's --json rows with this run's: one section over several sittings;
``--workloads ''`` runs nothing new);
--repredict FILE... (predictions only: every row of another run's --json compiled and predicted again with the
current code and calibration, its measurements kept; a table of the errors before and after).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Iterator, Sequence  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

NAME = "Plan regret (bench_plan_regret)"
HERE = Path(__file__).resolve()
WORKLOADS = ("gpt", "vgg", "fashion", "shakespeare", "llama")
LINKS = {"loopback": 0.0, "100MB": 100e6, "20MB": 20e6}  # bytes/s of the emulated link (0: loopback as is)
SCHEDULES = ("flush", "gpipe", "1f1b", "zb-h1")
COUNTS = (1, 2, 4, 8)
PER_UPDATE = ("1f1b", "2bw")  # schedules whose metrics hold a time per update, not per minibatch
GOALS = dict(median_error=0.10, p90_error=0.25, tau=0.8, regret=1.10, regret_share=0.9, regret_max=1.25)
EPS = 1e-9  # a goal met exactly counts (5 candidates with one discordant pair: tau = 0.8 in floating point)


# ---------------------------------------------------------------------------------------------
# workloads: (model, one minibatch, loss, optimizer, leaf modules)


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    description: str
    model: nn.Module
    inputs: tuple[torch.Tensor, ...]
    target: torch.Tensor
    loss_fn: nn.Module
    optimizer: Any
    leaf_modules: tuple[type[nn.Module], ...] = ()


def workload(name: str, seed: int = 0) -> Workload:
    """The named workload: the zoo GPT and VGG of bench_predicted_vs_measured, bench_time_to_accuracy's
    Fashion-MNIST CNN and Shakespeare character GPT (on generated batches of their shapes: a step's time
    does not depend on the values), and a small Hugging Face Llama."""
    from benchmarks import _tta
    from benchmarks._common import llama_config, sgd
    from benchmarks.bench_predicted_vs_measured import build

    g = torch.Generator().manual_seed(seed)
    if name in ("gpt", "vgg"):
        c = build(name, seed)
        return Workload(name, c.description, c.model, c.inputs, c.target, c.loss_fn, sgd, c.leaf_modules)
    if name in ("fashion", "shakespeare"):
        w = _tta.workload(name)
        spec = dict(w.model)
        if name == "fashion":
            model = _tta.build_model(spec, seed)
            x = torch.randn((w.batch, 1, 28, 28), generator=g)
            target = torch.randint(0, 10, (w.batch,), generator=g)
        else:
            vocab = _shakespeare_vocab()
            torch.manual_seed(seed)
            from pdcompile.zoo import gpt

            model = gpt.GPT(gpt.GPTConfig(vocab_size=vocab, seq_len=_tta.BLOCK, d_model=spec["d_model"],
                                          n_heads=spec["n_heads"], n_layers=spec["n_layers"]))
            tokens = torch.randint(0, vocab, (w.batch, _tta.BLOCK + 1), generator=g)
            x, target = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        return Workload(name, f"{w.title}, batch {w.batch}", model, (x,), target, _tta.loss_fn(w),
                        _tta.import_object(w.optimizer))
    if name == "llama":
        import transformers

        from pdcompile.zoo.losses import SequenceCrossEntropy

        torch.manual_seed(seed)
        cfg = llama_config("tiny")
        model = transformers.LlamaForCausalLM(cfg)
        tokens = torch.randint(0, cfg.vocab_size, (16, 33), generator=g)
        return Workload(name, "Hugging Face Llama (tiny: 4 layers, hidden 32), 16 x 32 tokens", model,
                        (tokens[:, :-1].contiguous(),), tokens[:, 1:].contiguous(), SequenceCrossEntropy(), sgd)
    raise SystemExit(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")


def _shakespeare_vocab() -> int:
    """The character model's vocabulary (65 characters) from the corpus where it is cached, else 65."""
    from pdcompile import datasets

    try:
        return datasets.shakespeare_vocab_size()
    except Exception:  # noqa: BLE001 - no corpus here: the corpus's count
        return 65


# ---------------------------------------------------------------------------------------------
# candidates


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One configuration: the stages' layer spans and replicas, the schedule and the microbatch count."""

    layout: tuple[tuple[int, int, int], ...]  # per stage (first layer, last layer, replicas)
    schedule: str
    num_microbatches: int
    source: str = "grid"  # "grid", or who picked it where it is off the grid: "planner", "auto"

    def __str__(self) -> str:
        if len(self.layout) == 1:
            shape = f"data parallel x{self.layout[0][2]}"
        else:
            shape = "layers " + " / ".join(f"{a}-{b}" + (f" x{r}" if r > 1 else "") for a, b, r in self.layout)
        return f"{shape}, {self.schedule}, M={self.num_microbatches}"

    @property
    def cuts(self) -> tuple[int, ...]:
        return tuple(a for a, _, _ in self.layout[1:])

    @property
    def replicas(self) -> tuple[int, ...]:
        return tuple(r for _, _, r in self.layout)


def layout_of(plan: Any) -> tuple[tuple[int, int, int], ...]:
    return tuple((st.first, st.last, st.replicas) for st in plan.stages)


def allowed_cuts(chain: Any) -> list[int]:
    """The first layers a second stage may start at: after every layer whose output is one tensor
    (the chain's finite ``cut_bytes``), as the partition pass allows."""
    return [j for j in range(1, len(chain)) if math.isfinite(chain.cut_bytes[j - 1])]


def spread(items: Sequence[Any], n: int) -> list[Any]:
    """At most ``n`` of ``items``, evenly spaced, first and last kept."""
    if n <= 0 or len(items) <= n:
        return list(items)
    if n == 1:
        return [items[len(items) // 2]]
    return [items[round(i * (len(items) - 1) / (n - 1))] for i in range(n)]


def grid(chain: Any, workers: int, batch: int, max_cuts: int) -> list[Candidate]:
    """The candidates of a scenario (see the module doc), in a fixed order."""
    from pdcompile.passes.partition import balanced_bounds

    n = len(chain)
    counts = [m for m in COUNTS if batch % m == 0]
    out = [Candidate(((0, n - 1, workers),), "flush", m) for m in counts if m % workers == 0]
    if workers == 2:
        shapes = [((0, c - 1, 1), (c, n - 1, 1)) for c in spread(allowed_cuts(chain), max_cuts)]
    else:
        bounds = [0, *balanced_bounds(chain, workers), n]
        shapes = [tuple((a, b - 1, 1) for a, b in zip(bounds, bounds[1:]))]
    out += [Candidate(shape, s, m) for shape in shapes for m in counts for s in SCHEDULES]
    return out


@contextlib.contextmanager
def cut_at(cuts: Sequence[int]) -> Iterator[None]:
    """The partition pass's balanced split replaced by ``cuts`` (first layers of stages 1..) while a
    ``stages=len(cuts)+1`` compile runs; the pass reads the function from its module."""
    from pdcompile.passes import partition

    original = partition.balanced_bounds
    partition.balanced_bounds = lambda chain, k: list(cuts)  # type: ignore[assignment]
    try:
        yield
    finally:
        partition.balanced_bounds = original  # type: ignore[assignment]


def cluster_for(workers: int, bps: float) -> Any:
    """This machine's local cluster of ``workers`` processes, its link the emulated one where there is one."""
    from pdcompile.cluster import local_cpu_cluster

    return local_cpu_cluster(workers, bps) if bps else local_cpu_cluster(workers)


def compile_candidate(w: Workload, cluster: Any, cand: Candidate) -> Any:
    """``pdcompile`` of ``cand``'s layout at its microbatch count (the schedule is chosen at run time)."""
    from pdcompile.api import pdcompile

    kw = dict(example_inputs=w.inputs, example_target=w.target, loss_fn=w.loss_fn, optimizer=w.optimizer,
              leaf_modules=w.leaf_modules, num_microbatches=cand.num_microbatches, schedule="flush")
    stages = len(cand.layout)
    with cut_at(cand.cuts):
        pipe = pdcompile(w.model, cluster, stages=stages, replicas=list(cand.replicas), **kw)
    got = layout_of(pipe.plan)
    if got != tuple((a, got[-1][1] if b < 0 else b, r) for a, b, r in cand.layout):  # -1: the last layer
        raise RuntimeError(f"compiled {got}, asked {cand.layout}")
    return pipe


def predict(pipe: Any, schedule: str) -> float:
    """The steady state of ``pipe.simulate()`` under ``schedule``: seconds per minibatch, the makespan's
    growth from 2 to 4 minibatches (a synchronous schedule's fill and drain in each)."""
    m2 = float(pipe.simulate(schedule=schedule, num_steps=2).makespan_s)
    m4 = float(pipe.simulate(schedule=schedule, num_steps=4).makespan_s)
    return (m4 - m2) / 2


def launch_metrics(program: Path, nproc: int, schedule: str, bps: float, steps: int, warmup: int,
                   timeout: float = 600, extra: Sequence[str] = (), env: dict[str, str] | None = None) -> list[Any]:
    """Every rank's metrics (its ``--metrics`` JSON) of one launch of ``program`` for ``warmup + steps``
    minibatches under ``schedule``, through ``python -m pdcompile.slowlink`` (the link emulated at ``bps``
    bytes/s where it is not 0), with train.py flags ``extra`` and environment ``env`` added."""
    from benchmarks._common import torchrun
    from pdcompile import slowlink

    metrics = Path(tempfile.mkdtemp(prefix="pd-regret-metrics-"))
    # the memory meter off (--no-memory-meter): its hook per saved tensor is an instrument the user turns on with
    # --metrics, not the training step the prediction is of
    args = [str(program), "--steps", str(warmup + steps), "--metrics", str(metrics), "--no-memory-meter",
            "--timeout", "300", "--schedule", schedule, *extra]
    rc, log = torchrun("pdcompile.slowlink", nproc, args, timeout=timeout,
                       env={slowlink.ENV: str(bps), "PDCOMPILE_NCCL_RULES": "0", **(env or {})})
    if rc != 0:
        raise RuntimeError(f"run of {program} ({schedule}) failed ({rc}):\n{log[-2000:]}")
    return [json.loads(p.read_text()) for p in sorted(metrics.glob("rank_*.json"))]


def slowest_steps(ranks: Sequence[Any], schedule: str, steps: int, warmup: int) -> list[float]:
    """Seconds per minibatch of a launch's measured minibatches (``warmup`` dropped), the slowest rank's
    (1F1B and 2BW: the per-update times of a minibatch summed)."""
    from benchmarks._common import step_times

    times = [r["step_times_s"] for r in ranks]
    per = max(1, round(min(len(t) for t in times) / (warmup + steps))) if schedule in PER_UPDATE else 1
    return step_times(times, warmup, per)


def measure_with_load(program: Path, nproc: int, schedule: str, bps: float, steps: int, warmup: int,
                      timeout: float = 600) -> tuple[float, float]:
    """Median seconds per minibatch of one launch of ``program`` (the slowest rank per minibatch), and the share
    of the machine's CPU time that niced processes (other work lowered beside
    a timed run) took during the launch: what slows the ranks' compute itself on the 2-core VM, up to 1.6x per
    process (benchmarks/RESULTS.md, "Launch-to-launch noise")."""
    before = cpu_ticks()
    ranks = launch_metrics(program, nproc, schedule, bps, steps, warmup, timeout)
    after = cpu_ticks()
    d = [b - a for a, b in zip(before, after)]
    return statistics.median(slowest_steps(ranks, schedule, steps, warmup)), (d[1] / sum(d) if sum(d) > 0 else math.nan)


def cpu_ticks() -> list[int]:
    """/proc/stat's CPU time of the whole machine so far (user, nice, system, idle, ...), or zeros."""
    try:
        with open("/proc/stat") as f:
            return [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return [0] * 10


def kendall_tau(x: Sequence[float], y: Sequence[float]) -> float:
    """Kendall's tau-b of two orders (scipy's where installed)."""
    if len(x) < 2:
        return math.nan
    try:
        from scipy.stats import kendalltau

        return float(kendalltau(x, y).statistic)
    except ImportError:
        pass
    conc = disc = tx = ty = 0
    for i in range(len(x)):
        for j in range(i + 1, len(x)):
            a, b = (x[i] > x[j]) - (x[i] < x[j]), (y[i] > y[j]) - (y[i] < y[j])
            if a and b:
                conc, disc = conc + (a == b), disc + (a != b)
            else:
                tx, ty = tx + (not a and b != 0), ty + (not b and a != 0)
    den = math.sqrt((conc + disc + tx) * (conc + disc + ty))
    return (conc - disc) / den if den else math.nan


def run_key(pipe: Any, schedule: str, num_steps: int = 2) -> tuple[Any, ...]:
    """What a launch of ``pipe``'s program under ``--schedule schedule`` runs, as the runtime builds it
    (runtime/run_schedule.py ``run_schedule``: the compiled schedule's replicas, microbatches, tied weights,
    vertical sync and split backward under the policy asked): every rank's actions over ``num_steps`` steps, from
    the schedule pass's ``ScheduleSpec``, and the policy's rules the actions do not spell (an update per microbatch,
    the weight version's lag). Two candidates of one program with equal keys are one launch (data parallelism with
    a microbatch per replica: ``F B`` on every rank under flush and gpipe alike)."""
    from pdcompile.runtime.schedules import policy
    from pdcompile.runtime.schedules.spec import ScheduleSpec, actions_text

    c = pipe.state.schedule_spec
    spec = ScheduleSpec(schedule, c.replicas, c.num_microbatches, c.tied, c.vertical_sync, c.split_backward,
                        c.virtual_stages, c.csv if schedule == c.name else None)
    acts = spec.make(num_steps)
    pol = policy(schedule)
    return (pol.update_per_microbatch, pol.version_lag, tuple(actions_text(acts[r]) for r in sorted(acts)))


def calibration_used() -> dict[str, Any]:
    """The constants of this machine's cached calibration (``pdcompile.machine_cache``) that ``simulate()`` charges
    on a local CPU cluster: the runtime's per-action seconds (or the built-in ones, and why), the all-reduce's
    fixed seconds and bytes/s, the per-node (forward, backward) seconds, the weights' (forward, backward) bytes/s,
    a split backward's weight pass per parameter tensor, the side-by-side (corun) factors; when and for which key
    it was measured."""
    from pdcompile import machine_cache

    cost = machine_cache.action_cost()
    table, problem = machine_cache.op_costs()
    entry = machine_cache._machine_entry()[0] or {}
    out: dict[str, Any] = {
        "measured_at": entry.get("measured_at", ""), "key": entry.get("key", ""),
        "action_s": dict(cost.seconds) if cost.calibrated else f"built-in {machine_cache.BUILTIN_ACTION_S:g} s "
                                                                f"({cost.problem})",
        "allreduce": list(cost.collective) if cost.collective else None,
    }
    if table is None:
        out["op_costs"] = f"none ({problem})"
        return out
    out.update(node_s=list(table.node_s), weight_rate=list(table.weight_rate), weight_pass_s=table.w_param_s,
               corun={str(k): v for k, v in dict(table.corun).items()}, op_costs=table.source)
    return out


def calibration_note(cal: dict[str, Any]) -> str:
    """:func:`calibration_used` in one line for the table's header."""
    def num(x: Any, unit: str = "") -> str:
        return f"{x:.3g}{unit}" if isinstance(x, (int, float)) else str(x)

    acts = cal.get("action_s")
    acts_text = ", ".join(f"{k} {v * 1e6:.0f} us" for k, v in acts.items()) if isinstance(acts, dict) else str(acts)
    ar = cal.get("allreduce")
    parts = [f"measured {cal.get('measured_at') or '?'}", f"per action: {acts_text}",
             f"all-reduce: {num(ar[0] * 1e6)} us + bytes / {num(ar[1] / 1e6)} MB/s" if ar else "all-reduce: none"]
    if "node_s" in cal:
        (nf, nb), (wf, wb) = cal["node_s"], cal["weight_rate"]
        parts += [f"per node: {nf * 1e6:.2f} / {nb * 1e6:.2f} us (forward / backward)",
                  f"weight rate: {num(wf / 1e9)} / {num(wb / 1e9)} GB/s",
                  f"weight pass: {cal['weight_pass_s'] * 1e6:.1f} us per parameter tensor",
                  "corun: " + (", ".join(f"{k} processes x{v:.3f}" for k, v in cal["corun"].items()) or "none")]
    else:
        parts.append(f"cost per op class: {cal.get('op_costs')}")
    return "; ".join(parts)


# ---------------------------------------------------------------------------------------------
# a scenario


@dataclasses.dataclass
class Row:
    scenario: str
    candidate: str
    source: str
    predicted: float
    measured: list[float] = dataclasses.field(default_factory=list)
    picked_by: list[str] = dataclasses.field(default_factory=list)
    # what --repredict compiles again (empty in files written before they were saved: parsed from the names)
    workload: str = ""
    link: str = ""
    workers: int = 0
    layout: list[list[int]] = dataclasses.field(default_factory=list)
    schedule: str = ""
    num_microbatches: int = 0
    # other candidates whose launch is this one's (the same program, every rank the same actions: run_key),
    # measured once under this row
    same_as: list[str] = dataclasses.field(default_factory=list)
    # the calibration constants the prediction was made with (calibration_used)
    calibration: dict[str, Any] = dataclasses.field(default_factory=dict)
    # per launch (as measured), the share of the machine's CPU time niced processes took meanwhile
    niced: list[float] = dataclasses.field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.measured) if self.measured else math.nan

    @property
    def error(self) -> float:
        return self.predicted / self.median - 1 if self.measured else math.nan


def scenario(wname: str, link: str, workers: int, args: argparse.Namespace) -> tuple[list[Row], list[str]]:
    """Every candidate of one scenario compiled, predicted and run; its rows and its notes."""
    from pdcompile.api import pdcompile

    bps = LINKS[link]
    name = f"{wname}, {link}, {workers} workers"
    w = workload(wname)
    cluster = cluster_for(workers, bps)
    batch = int(w.inputs[0].shape[0])
    common = dict(example_inputs=w.inputs, example_target=w.target, loss_fn=w.loss_fn, optimizer=w.optimizer,
                  leaf_modules=w.leaf_modules)
    notes: list[str] = []
    picks: dict[str, tuple[Candidate, Any]] = {}
    for who, sched in (("planner", "flush"), ("auto", "auto")):
        t0 = time.perf_counter()
        pipe = pdcompile(w.model, cluster, schedule=sched, **common)
        chosen = pipe.options.schedule
        picks[who] = (Candidate(layout_of(pipe.plan), chosen, pipe.num_microbatches, who), pipe)
        print(f"[{name}] {who}: {picks[who][0]} (compiled in {time.perf_counter() - t0:.1f} s)", flush=True)
    chain = picks["planner"][1].state.chain
    cands = grid(chain, workers, batch, args.cuts)
    if args.max_candidates:
        cands = spread(cands, args.max_candidates)
    keyed = {(c.layout, c.schedule, c.num_microbatches): c for c in cands}
    for who, (c, _) in picks.items():
        keyed.setdefault((c.layout, c.schedule, c.num_microbatches), c)
    compiled: dict[tuple[Any, int], tuple[Any, Path]] = {}
    for who, (c, pipe) in picks.items():
        compiled.setdefault((c.layout, c.num_microbatches), (pipe, Path()))
    rows: dict[tuple[Any, str, int], Row] = {}
    cal = calibration_used()
    for key, c in keyed.items():
        k2 = (c.layout, c.num_microbatches)
        try:
            if k2 not in compiled:
                compiled[k2] = (compile_candidate(w, cluster, c), Path())
            pipe, prog = compiled[k2]
            if prog == Path():
                prog = pipe.emit(Path(tempfile.mkdtemp(prefix=f"pd-regret-{wname}-")) / "program")
                compiled[k2] = (pipe, prog)
            rows[key] = Row(name, str(c), c.source, predict(pipe, c.schedule), workload=wname, link=link,
                            workers=workers, layout=[list(st) for st in c.layout], schedule=c.schedule,
                            num_microbatches=c.num_microbatches, calibration=cal)
        except Exception as e:  # noqa: BLE001 - a candidate that cannot compile is named, not fatal
            notes.append(f"{c}: not compiled ({type(e).__name__}: {str(e).splitlines()[0][:160]})")
    for who, (c, _) in picks.items():
        key = (c.layout, c.schedule, c.num_microbatches)
        if key in rows:
            rows[key].picked_by.append(who)
    rows = merge_same_runs(rows, keyed, compiled, notes)
    print(f"[{name}] {len(rows)} candidates; running {args.repeats} x {len(rows)} launches", flush=True)
    for rep in range(args.repeats):  # interleaved: each candidate once per repeat
        for key, row in rows.items():
            c = keyed[key]
            prog = compiled[(c.layout, c.num_microbatches)][1]
            try:
                # the plan's processes: a plan may leave workers idle (one process for the whole model on a slow link)
                step, niced = measure_with_load(prog, sum(c.replicas), c.schedule, bps, args.steps, args.warmup)
                row.measured.append(step)
                row.niced.append(niced)
            except Exception as e:  # noqa: BLE001 - one failed launch is noted, the rest go on
                notes.append(f"{c} repeat {rep + 1}: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
                continue
            print(f"[{name}] rep {rep + 1}: {row.candidate:<40} predicted {row.predicted * 1e3:8.2f} ms, measured "
                  f"{row.measured[-1] * 1e3:8.2f} ms{'  (' + ', '.join(row.picked_by) + ')' if row.picked_by else ''}",
                  flush=True)
    return list(rows.values()), notes


def merge_same_runs(rows: dict[tuple[Any, str, int], Row], keyed: dict[tuple[Any, str, int], Candidate],
                    compiled: dict[tuple[Any, int], tuple[Any, Path]],
                    notes: list[str]) -> dict[tuple[Any, str, int], Row]:
    """``rows`` with the candidates that launch the same run (one program, :func:`run_key` equal) made one row: the
    first one's, the others named in its ``same_as`` and their picks added to its ``picked_by``, so that one program
    launched twice is not two candidates (nor its noise a regret)."""
    out: dict[tuple[Any, str, int], Row] = {}
    first: dict[tuple[Any, ...], tuple[Any, str, int]] = {}
    for key, row in rows.items():
        c = keyed[key]
        k2 = (c.layout, c.num_microbatches)
        run = (k2, run_key(compiled[k2][0], c.schedule))
        if run not in first:
            first[run] = key
            out[key] = row
            continue
        kept = out[first[run]]
        kept.same_as.append(row.candidate)
        kept.picked_by += [who for who in row.picked_by if who not in kept.picked_by]
        if not math.isclose(row.predicted, kept.predicted, rel_tol=1e-3):
            notes.append(f"{row.candidate} runs as {kept.candidate} (the same actions on every rank) but was "
                         f"predicted {row.predicted * 1e3:.2f} ms, not {kept.predicted * 1e3:.2f}: measured once, "
                         f"under {kept.candidate}'s prediction")
    return out


# ---------------------------------------------------------------------------------------------
# predictions only: an earlier sitting's candidates compiled and predicted again


def candidate_of(row: Row) -> tuple[str, str, int, Candidate]:
    """``(workload, link, workers, candidate)`` of a saved row: its saved fields, or (a file written before they
    were) parsed from its scenario (``"gpt, loopback, 2 workers"``) and candidate (``"layers 0-3 / 4-9 x2, 1f1b,
    M=4"``, ``"data parallel x2, flush, M=2"``: its one stage's last layer -1, the model's last, resolved on
    compiling)."""
    if row.workload and row.layout:
        layout = tuple((int(a), int(b), int(r)) for a, b, r in row.layout)
        return row.workload, row.link, row.workers, Candidate(layout, row.schedule, row.num_microbatches, row.source)
    try:
        wname, link, workers = (x.strip() for x in row.scenario.split(","))
        shape, schedule, m = (x.strip() for x in row.candidate.rsplit(",", 2))
        nworkers, nmb = int(workers.split()[0]), int(m.removeprefix("M="))
        if shape.startswith("data parallel x"):
            layout: tuple[tuple[int, int, int], ...] = ((0, -1, int(shape.removeprefix("data parallel x"))),)
        else:
            stages = []
            for st in shape.removeprefix("layers ").split(" / "):
                span, _, reps = st.partition(" x")
                a, b = span.split("-")
                stages.append((int(a), int(b), int(reps or 1)))
            layout = tuple(stages)
    except ValueError as e:
        raise SystemExit(f"--repredict: cannot read the row {row.scenario!r} / {row.candidate!r} ({e}); "
                         f"re-run that sitting with this version's --json, which saves what to compile") from e
    return wname, link, nworkers, Candidate(layout, schedule, nmb, row.source)


def repredict(rows: Sequence[Row]) -> tuple[list[Row], list[str]]:
    """``rows`` with their predictions made again (each candidate compiled as its sitting compiled it, under the
    current code and this machine's cached calibration), every measured figure and pick kept; and notes on the
    candidates that no longer compile (kept with their old prediction: said so)."""
    out: list[Row] = []
    notes: list[str] = []
    built: dict[tuple[str, str, int], tuple[Workload, Any]] = {}
    compiled: dict[tuple[Any, ...], Any] = {}
    cal = calibration_used()
    for row in rows:
        wname, link, workers, c = candidate_of(row)
        if (wname, link, workers) not in built:
            built[(wname, link, workers)] = (workload(wname), cluster_for(workers, LINKS[link]))
        w, cluster = built[(wname, link, workers)]
        key = (wname, link, workers, c.layout, c.num_microbatches)
        try:
            if key not in compiled:
                compiled[key] = compile_candidate(w, cluster, c)
            pred = predict(compiled[key], c.schedule)
        except Exception as e:  # noqa: BLE001 - a candidate that no longer compiles is named, not fatal
            notes.append(f"{row.scenario}: {row.candidate}: not re-predicted ({type(e).__name__}: "
                         f"{str(e).splitlines()[0][:160]}); its earlier prediction kept")
            out.append(row)
            continue
        layout = layout_of(compiled[key].plan)
        out.append(dataclasses.replace(row, predicted=pred, workload=wname, link=link, workers=workers,
                                       layout=[list(st) for st in layout], schedule=c.schedule,
                                       num_microbatches=c.num_microbatches, calibration=cal))
    return out, notes


def before_after(before: Sequence[Row], after: Sequence[Row]) -> str:
    """Per scenario and over all: median and p90 |error| and Kendall's tau of the earlier predictions and of the
    re-made ones, against the same measurements."""
    def stats(rows: Sequence[Row]) -> tuple[float, float, float]:
        errs = sorted(abs(r.error) for r in rows if r.measured)
        if not errs:
            return math.nan, math.nan, math.nan
        p90 = errs[min(len(errs) - 1, math.ceil(0.9 * len(errs)) - 1)]
        return statistics.median(errs), p90, summary(rows)["tau"]

    out = ["| scenario | median abs error, before | after | p90, before | after | tau, before | after |",
           "|---|---|---|---|---|---|---|"]
    groups = {s: ([r for r in before if r.scenario == s], [r for r in after if r.scenario == s])
              for s in dict.fromkeys(r.scenario for r in before)}
    for s, (b, a) in [*groups.items(), ("all", (list(before), list(after)))]:
        (mb, pb, tb), (ma, pa, ta) = stats(b), stats(a)
        tau = ("-", "-") if s == "all" else (f"{tb:.2f}", f"{ta:.2f}")
        out.append(f"| {s} | {mb:.1%} | {ma:.1%} | {pb:.1%} | {pa:.1%} | {tau[0]} | {tau[1]} |")
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------
# tables and figure


def summary(rows: Sequence[Row]) -> dict[str, Any]:
    """Kendall's tau and the picks' regrets of one scenario's measured rows."""
    ok = [r for r in rows if r.measured]
    if not ok:
        return dict(tau=math.nan, best=math.nan, planner=math.nan, auto=math.nan, n=0)
    best = min(r.median for r in ok)
    regret = {who: next((r.median / best for r in ok if who in r.picked_by), math.nan) for who in ("planner", "auto")}
    return dict(tau=kendall_tau([r.predicted for r in ok], [r.median for r in ok]), best=best, n=len(ok), **regret)


def tables(rows: Sequence[Row], notes: Sequence[str], args: argparse.Namespace, load_before: str,
           elapsed: float) -> str:
    from benchmarks._common import load_note

    by: dict[str, list[Row]] = {}
    for r in rows:
        by.setdefault(r.scenario, []).append(r)
    out = []
    if args.smoke:
        out.append("**SMOKE RUN** (a subset, to show the benchmark works; its figures judge nothing): "
                   "the full run is `python benchmarks/bench_plan_regret.py` on a quiet machine.\n")
    out += [f"Predictions: `CompiledPipeline.simulate()` as compiled (API defaults, this machine's cached "
            f"calibration if any, nothing from the runs), steady state per minibatch. Measured: the emitted "
            f"program through `python -m pdcompile.slowlink` (links: loopback as is, or the emulated link at "
            f"100 MB/s or 20 MB/s), {args.steps} minibatches after {args.warmup} of warm-up, slowest rank per "
            f"minibatch, median, the memory meter off (`--no-memory-meter`); {args.repeats} repeat(s), candidates "
            f"interleaved, the median over repeats.",
            f"The runtime's per-action cost in the predictions: {action_cost_note()}.",
            *[f"Calibration the predictions used ({n} row(s); `--json` rows' `calibration`): {calibration_note(c)}."
              for c, n in calibrations(rows)],
            "Candidates that launch the same run (one program, every rank's actions equal: `run_key`) are measured "
            "once and listed as one row (`= ...`); a pick of either points at it.",
            f"Load before: {load_before}; after: {load_note()}. Run time {elapsed:.0f} s.", "",
            "| scenario | candidates | Kendall's tau | best measured (ms) | regret, planner's pick | regret, auto's pick "
            "| median abs error | p90 abs error |", "|---|---|---|---|---|---|---|---|"]
    errs_all: list[float] = []
    sums = {}
    for scen, rs in by.items():
        s = sums[scen] = summary(rs)
        errs = sorted(abs(r.error) for r in rs if r.measured)
        errs_all += errs
        p90 = errs[min(len(errs) - 1, math.ceil(0.9 * len(errs)) - 1)] if errs else math.nan
        out.append(f"| {scen} | {s['n']} | {s['tau']:.2f} | {s['best'] * 1e3:.2f} | {s['planner']:.2f} | "
                   f"{s['auto']:.2f} | {statistics.median(errs) if errs else math.nan:.1%} | {p90:.1%} |")
    if errs_all:
        errs_all.sort()
        p90 = errs_all[min(len(errs_all) - 1, math.ceil(0.9 * len(errs_all)) - 1)]
        regrets = [s["planner"] for s in sums.values() if math.isfinite(s["planner"])]
        taus = [s["tau"] for s in sums.values() if math.isfinite(s["tau"])]
        out += ["", f"Goals (issue 36): median |error| {statistics.median(errs_all):.1%} (goal <= 10%), p90 {p90:.1%} "
                    f"(<= 25%); Kendall's tau >= 0.8 in {sum(t >= GOALS['tau'] - EPS for t in taus)} of {len(taus)} "
                    f"scenarios; planner's regret <= 1.10 in {sum(r <= GOALS['regret'] + EPS for r in regrets)} of "
                    f"{len(regrets)} (goal: 90%), <= 1.25 in {sum(r <= GOALS['regret_max'] + EPS for r in regrets)} "
                    f"(goal: all)."]
    for scen, rs in by.items():
        out += ["", f"**{scen}**", "", "| candidate | picked by | predicted (ms) | measured (ms) | runs | error |",
                "|---|---|---|---|---|---|"]
        for r in sorted(rs, key=lambda r: (math.isnan(r.median), r.median)):
            meas = ", ".join(f"{x * 1e3:.2f}" for x in r.measured)
            name = " = ".join([r.candidate, *r.same_as])
            out.append(f"| {name} | {', '.join(r.picked_by) or '-'} | {r.predicted * 1e3:.2f} | "
                       f"{r.median * 1e3:.2f} | {meas or 'failed'} | {'-' if math.isnan(r.error) else format(r.error, '+.1%')} |")
    shares = [x for r in rows for x in r.niced if math.isfinite(x)]
    if shares:
        out += ["", f"Other work during the launches: niced processes took more than 10% of the machine's CPU time in "
                    f"{sum(x > 0.10 for x in shares)} of {len(shares)} launches (median {statistics.median(shares):.0%}; this run's own "
                    f"ranks count too where it was itself niced); "
                    f"beside such work a rank's compute runs up to 1.6x slower (RESULTS.md, \"Launch-to-launch noise\")."]
    if notes:
        out += ["", "Notes:"] + [f"- {n}" for n in notes]
    return "\n".join(out) + "\n"


def calibrations(rows: Sequence[Row]) -> list[tuple[dict[str, Any], int]]:
    """The distinct calibrations ``rows`` were predicted with, in order, and how many rows used each (rows of an
    older ``--json`` without one left out)."""
    seen: dict[str, tuple[dict[str, Any], int]] = {}
    for r in rows:
        if r.calibration:
            k = json.dumps(r.calibration, sort_keys=True)
            c, n = seen.get(k, (r.calibration, 0))
            seen[k] = (c, n + 1)
    return list(seen.values())


def action_cost_note() -> str:
    """Which per-action cost ``simulate()`` charged on these CPU workers: this machine's calibration, or the built-in one."""
    from pdcompile import machine_cache

    cost = machine_cache.action_cost()
    if getattr(cost, "calibrated", False):
        return f"calibrated by `python -m pdcompile.calibrate` ({getattr(cost, 'measured_at', '') or 'cached'})"
    return "built-in (no calibration cached for this runtime)"


def plot(rows: Sequence[Row], path: Path, title: str) -> None:
    """Predicted against measured, per scenario a colour, the picks marked, y = x drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 6))
    scen = list(dict.fromkeys(r.scenario for r in rows))
    ok = [r for r in rows if r.measured and r.predicted > 0]
    for i, s in enumerate(scen):
        rs = [r for r in ok if r.scenario == s]
        ax.scatter([r.median * 1e3 for r in rs], [r.predicted * 1e3 for r in rs], s=18, label=s, color=f"C{i % 10}")
        for r in rs:
            if r.picked_by:
                ax.scatter([r.median * 1e3], [r.predicted * 1e3], s=90, facecolors="none", edgecolors="k")
    if ok:
        lo = min(min(r.median, r.predicted) for r in ok) * 1e3 * 0.8
        hi = max(max(r.median, r.predicted) for r in ok) * 1e3 * 1.25
        ax.plot([lo, hi], [lo, hi], "k--", lw=0.8, label="predicted = measured")
        ax.set_xscale("log")
        ax.set_yscale("log")
    ax.set_xlabel("measured ms per minibatch")
    ax.set_ylabel("predicted ms per minibatch (before any run)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--links", default=",".join(LINKS))
    ap.add_argument("--workers", default="2,3")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20, help="measured minibatches per launch (after --warmup)")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--max-candidates", type=int, default=0,
                    help="at most this many grid candidates per scenario, evenly spread (the picks are added)")
    ap.add_argument("--cuts", type=int, default=10, help="2-stage cuts per scenario, evenly spread")
    ap.add_argument("--png", default=str(HERE.parent / "plan_regret.png"))
    ap.add_argument("--json", default="", help="also write every row here")
    ap.add_argument("--with-json", nargs="+", default=[], metavar="FILE",
                    help="also table the rows another run wrote with --json (its scenarios named as from FILE)")
    ap.add_argument("--repredict", nargs="+", default=[], metavar="FILE",
                    help="predictions only: compile every row of these --json files again and predict it with the "
                         "current code and calibration, keeping the files' measurements (nothing launched)")
    ap.add_argument("--smoke", action="store_true", help="label the section a smoke run")
    ap.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md and the PNG alone")
    args = ap.parse_args(argv)
    from benchmarks._common import load_note
    from benchmarks._results import publish

    torch.set_num_threads(1)  # as each runtime process runs (OMP_NUM_THREADS=1)
    unknown = [x for x in args.links.split(",") if x not in LINKS]
    if unknown:
        raise SystemExit(f"unknown link {unknown[0]!r}; choose from {', '.join(LINKS)}")
    t0, load_before = time.perf_counter(), load_note()
    rows: list[Row] = []
    notes: list[str] = []
    for wname in filter(None, args.workloads.split(",")):
        for link in args.links.split(","):
            for workers in (int(x) for x in args.workers.split(",")):
                got, why = scenario(wname, link, workers, args)
                rows += got
                notes += [f"{wname}, {link}, {workers} workers: {n}" for n in why]
    earlier: list[Row] = []
    for f in args.with_json:  # earlier sittings' rows, in the files' order: their scenarios' notes say where from
        got = [Row(**r) for r in json.loads(Path(f).read_text())]
        earlier += got
        notes += [f"{s}: rows from an earlier run's `--json {Path(f).name}` (its own load)"
                  for s in dict.fromkeys(r.scenario for r in got)]
    rows = earlier + rows
    compared = ""
    if args.repredict:
        saved = [Row(**r) for f in args.repredict for r in json.loads(Path(f).read_text())]
        again, why = repredict(saved)
        notes += why + [f"predictions re-made now by `--repredict` (the current code and cached calibration); "
                        f"measured figures and picks from {', '.join(Path(f).name for f in args.repredict)} "
                        f"(their own sittings and load)"]
        compared = ("\nPredictions before (as saved) and after (re-made), against the same measurements:\n\n"
                    + before_after(saved, again))
        rows = rows + again
    body = tables(rows, notes, args, load_before, time.perf_counter() - t0) + compared
    if args.json:
        Path(args.json).write_text(json.dumps([dataclasses.asdict(r) for r in rows], indent=1))
    if not args.no_write:
        plot(rows, Path(args.png), ("SMOKE RUN: " if args.smoke else "") + "bench_plan_regret: predicted before the "
             "run against measured")
        body += f"\nFigure: `{os.path.relpath(args.png, HERE.parent)}` (predicted against measured; circles: picks).\n"
    command = "python benchmarks/bench_plan_regret.py " + " ".join(argv if argv is not None else sys.argv[1:])
    publish(NAME, body, command.strip(), write=not args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
