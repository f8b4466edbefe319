"""Time to accuracy on a real data set: DDP, Flush, 1F1B with and without weight stashing, and 2BW.

    python benchmarks/bench_time_to_accuracy.py          # ~5-8 minutes on 2 cores (needs the bench extra:
                                                         # scikit-learn, matplotlib)

Setup. scikit-learn's 8x8 digits (1437 training / 360 test images, seeded split, standardised;
``benchmarks/_digits.py``), the zoo's MLP 64-128-128-128-10, SGD lr 0.05 momentum 0.9, minibatches
of 32 (44 per epoch, the same minibatches in the same order for every system), 3 CPU processes:

* DDP: 3 replicas of the whole model; each takes its share of every minibatch (32 // 3 = 10 samples:
  the one system with a slightly smaller effective batch, 30).
* Flush and 2BW: pdcompile's 3-stage program, 4 microbatches of 8 per minibatch, one update per
  minibatch (2BW: gradients of minibatch t applied to the weights 2 versions on, as PipeDream-2BW).
* 1F1B (PipeDream, weight stashing): a 3-stage program compiled with microbatch = minibatch = 32,
  so every update sees 32 samples like the others; stages use weights up to 2 updates stale.
* 1F1B without stashing: the runtime has no such switch (it would be wrong on purpose), so it is
  computed by ``pdcompile/reference.py``'s ``train_versioned`` with ``pipedream_1f1b(stash=False)``
  in one process on the same stage modules and data: the same numbers the schedule would produce
  (backward at the newest weights, forward at the stale ones), but no wall time. The same reference
  with ``stash=True`` is run beside it as the control for that comparison.

Evaluation design: the runtime saves a checkpoint after every epoch (``--checkpoint-every 44``;
1F1B and 2BW drain their pipeline there, once per 44 minibatches); after the run each checkpoint is
merged (``pdcompile.merge.merge_weights``) into the full model and its test accuracy measured. Wall
time to an epoch is the sum of the slowest rank's step times up to it (training only: launch,
checkpoint writing and evaluation excluded); DDP is timed the same way.

Reading the table: ``epochs to target`` is statistical efficiency (does stashing keep it, as the
paper reports? does dropping it hurt?), ``time to target`` adds hardware efficiency on this machine.
The curves are in ``benchmarks/time_to_accuracy.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from torch import nn

from benchmarks import _digits
from benchmarks._common import ROOT, load_note, run_ours, torchrun

PNG = Path(__file__).resolve().parent / "time_to_accuracy.png"


def _optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


@dataclass
class Curve:
    """Test accuracy after each epoch and training seconds up to it (NaN: not measured)."""

    system: str
    accuracy: list[float] = field(default_factory=list)
    train_s: list[float] = field(default_factory=list)
    note: str = ""

    def epochs_to(self, target: float) -> int | None:
        return next((i + 1 for i, a in enumerate(self.accuracy) if a >= target), None)

    def time_to(self, target: float) -> float:
        e = self.epochs_to(target)
        return self.train_s[e - 1] if e is not None else math.nan


def _compile(stages: int, schedule: str, num_microbatches: int, batch: int) -> Path:
    from pdcompile.api import pdcompile

    x, y = next(_digits.train_batches(batch))
    model = _digits.build_model()
    pipe = pdcompile(model, example_inputs=x, example_target=y, loss_fn=nn.CrossEntropyLoss(),
                     optimizer=_optimizer, stages=stages, schedule=schedule, num_microbatches=num_microbatches)
    out = Path(tempfile.mkdtemp(prefix=f"pd-tta-{schedule}-")) / "program"
    return pipe.emit(out, data={"factory": "benchmarks._digits:train_batches", "kwargs": {}})


def run_pipeline(program: Path, schedule: str, nproc: int, epochs: int, batch: int, label: str) -> Curve:
    """Train ``epochs`` epochs with a checkpoint per epoch; evaluate every checkpoint."""
    from pdcompile.merge import merge_weights

    spe = _digits.steps_per_epoch(batch)
    ckpt = Path(tempfile.mkdtemp(prefix="pd-tta-ckpt-"))
    ranks = run_ours(program, nproc, epochs * spe, schedule=schedule, timeout=900,
                     extra=["--checkpoint-dir", str(ckpt), "--checkpoint-every", str(spe),
                            "--keep-checkpoints", str(epochs + 1)],
                     env={"PYTHONPATH": str(ROOT)})
    curve = Curve(label)
    per_rank = [r["step_times_s"] for r in ranks]
    for e in range(1, epochs + 1):
        folder = ckpt / f"step_{e * spe:08d}"
        model = _digits.build_model()
        model.load_state_dict(merge_weights(program, folder))
        curve.accuracy.append(_digits.accuracy(model))
        curve.train_s.append(max(sum(r[:e * spe]) for r in per_rank))
    return curve


def run_ddp(nproc: int, epochs: int, batch: int) -> Curve:
    out = Path(tempfile.mkdtemp(prefix="pd-tta-ddp-")) / "curve.json"
    rc, log = torchrun("benchmarks._digits", nproc, ["ddp", "--epochs", str(epochs), "--batch", str(batch),
                                                     "--out", str(out)], timeout=900)
    if rc != 0:
        raise RuntimeError(f"DDP failed ({rc}):\n{log[-3000:]}")
    pts = json.loads(out.read_text())
    return Curve("DDP", [p["accuracy"] for p in pts], [p["train_s"] for p in pts])


def run_reference(program: Path, epochs: int, batch: int, stash: bool) -> Curve:
    """1F1B's weight versions (with or without stashing) in one process, one drain per epoch."""
    from pdcompile import reference
    from pdcompile.runtime.program import Program

    prog = Program.load(program)

    class Chain(nn.Module):  # stage k of the chain, its outputs always a tuple (train_versioned's contract)
        def __init__(self, m: nn.Module, last: bool) -> None:
            super().__init__()
            self.m, self.last = m, last

        def forward(self, *x: torch.Tensor) -> Any:
            out = self.m(*x)
            return out if self.last or isinstance(out, tuple) else (out,)

    stages = [Chain(prog.build_stage(k), k == prog.num_stages - 1) for k in range(prog.num_stages)]
    opts = [_optimizer(s.parameters()) for s in stages]
    fwd, bwd, group = reference.pipedream_1f1b([1] * len(stages), stash=stash)
    data = _digits.train_batches(batch)
    spe = _digits.steps_per_epoch(batch)
    curve = Curve(f"1F1B {'with' if stash else 'without'} stashing (reference, 1 process)")
    t = 0.0
    for _ in range(epochs):
        mbs = [next(data) for _ in range(spe)]
        t0 = time.perf_counter()
        reference.train_versioned(stages, opts, nn.CrossEntropyLoss(), mbs, fwd=fwd, bwd=bwd, group=group)
        t += time.perf_counter() - t0
        full = _digits.build_model()
        state: dict[str, torch.Tensor] = {}
        for k, s in enumerate(stages):
            names = prog.stages[k].param_names
            for n, p in s.m.named_parameters():
                state[names.get(n, n)] = p.detach()
        full.load_state_dict(state)
        curve.accuracy.append(_digits.accuracy(full))
        curve.train_s.append(math.nan)
    curve.note = f"single-process reference: {t:.1f} s of computation, not comparable"
    return curve


def measure(*, stages: int = 3, epochs: int = 10, batch: int = 32, reference_runs: bool = True) -> list[Curve]:
    """All systems' curves (the pipelines share one compiled program per microbatch shape)."""
    flush_prog = _compile(stages, "flush", 4, batch)
    one_prog = _compile(stages, "1f1b", 1, batch)
    curves = [run_ddp(stages, epochs, batch),
              run_pipeline(flush_prog, "flush", stages, epochs, batch, "Flush"),
              run_pipeline(one_prog, "1f1b", stages, epochs, batch, "1F1B + weight stashing"),
              run_pipeline(flush_prog, "2bw", stages, epochs, batch, "2BW")]
    if reference_runs:
        curves += [run_reference(one_prog, epochs, batch, stash=False),
                   run_reference(one_prog, epochs, batch, stash=True)]
    return curves


def table(curves: list[Curve], target: float) -> str:
    lines = [f"| system | epochs to {target:.0%} | time to {target:.0%} (s) | best accuracy | accuracy per epoch |",
             "|---|---|---|---|---|"]
    for c in curves:
        e = c.epochs_to(target)
        t = c.time_to(target)
        lines.append(f"| {c.system} | {e if e is not None else 'not reached'} | "
                     f"{'n/a' if math.isnan(t) else f'{t:.2f}'} | {max(c.accuracy):.3f} | "
                     f"{' '.join(f'{a:.3f}' for a in c.accuracy)} |")
    return "\n".join(lines)


def plot(curves: list[Curve], target: float, path: Path = PNG) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for c in curves:
        ep = list(range(1, len(c.accuracy) + 1))
        style = "--" if "reference" in c.system else "-"
        a.plot(ep, c.accuracy, style, marker="o", ms=3, label=c.system)
        if not any(math.isnan(t) for t in c.train_s):
            b.plot(c.train_s, c.accuracy, style, marker="o", ms=3, label=c.system)
    for ax, xl in ((a, "epoch"), (b, "training time (s, slowest rank, this machine)")):
        ax.axhline(target, color="grey", lw=0.8, ls=":")
        ax.set_xlabel(xl)
        ax.set_ylabel("test accuracy")
        ax.set_ylim(max(0.0, min(min(c.accuracy) for c in curves) - 0.02), 1.0)
        ax.grid(alpha=0.3)
    a.set_title("Statistical efficiency: accuracy per epoch")
    b.set_title("Time to accuracy (measured systems)")
    a.legend(fontsize=8, loc="lower right")
    fig.suptitle("8x8 digits, MLP 64-128-128-128-10, 3 processes, minibatch 32")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--target", type=float, default=0.95)
    p.add_argument("--stages", type=int, default=3)
    args = p.parse_args(argv)
    before = load_note()
    curves = measure(stages=args.stages, epochs=args.epochs)
    png = plot(curves, args.target)
    notes = "".join(f"\n- {c.system}: {c.note}" for c in curves if c.note)
    body = (f"8x8 digits (sklearn, 1437 train / 360 test), MLP 64-128-128-128-10, SGD lr 0.05 momentum 0.9, "
            f"minibatch 32 (44 per epoch, same order for all), {args.stages} CPU processes, {args.epochs} epochs, "
            f"target test accuracy {args.target:.0%}. Accuracy from each epoch's checkpoint merged into the full "
            f"model; time = sum of the slowest rank's step times (training only). 1F1B: one microbatch of 32 per "
            f"update; Flush/2BW: 4 microbatches of 8 per update; DDP: 10 samples per rank (30 per update)."
            f"{notes}\nLoad: {before} at the start, {load_note()} at the end. Curves: `{png.name}`.\n\n"
            + table(curves, args.target))
    from benchmarks._results import write_section

    write_section("Time to accuracy (bench_time_to_accuracy)", body,
                  command="python benchmarks/bench_time_to_accuracy.py")
    print(body)


if __name__ == "__main__":
    main()
