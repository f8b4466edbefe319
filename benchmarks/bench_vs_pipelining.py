"""pdcompile's runtime against ``torch.distributed.pipelining`` on the same stages: throughput ratio.

    python benchmarks/bench_vs_pipelining.py            # ~5-7 minutes on 2 cores
    python benchmarks/bench_vs_pipelining.py --quick    # a smaller run, nothing written

Setup. For each model (GPT-style: 4 pre-LN blocks, d=96, T=32, tied embeddings; VGG-style: six 3x3
convolutions and three Linear layers on 32x32 images), pdcompile compiles ONE two-stage program
(minibatch 32, 4 microbatches of 8, SGD lr 0.01) and emits it. Both systems then train exactly that
program's stage modules (``stage_K.py`` + ``stage_K.pt``: the same split, the same weights) on two
CPU processes over gloo, with random data of the same shapes:

* ours: the emitted ``train.py`` (``--schedule gpipe`` or ``flush``), as users run it: the last
  backward of each step on stage 1 is split (input gradients sent first, weight gradients after: the
  runtime's default, ``--no-split-backward`` turns it off), which shortens the drain that both
  schedules end every minibatch with; the rest of the schedule is torch's, action for action;
* theirs: ``benchmarks/_pipelining_worker.py``, which wraps each stage module in ``PipelineStage``
  and steps torch's ``ScheduleGPipe`` or ``Schedule1F1B`` (which *is* 1F1B with a flush per
  minibatch: what we call ``flush``). GPT's tied embedding gets its gradient all-reduced between the
  two stages before the step on their side too (our runtime's ``TG``), so both do the same work.

The two are launched alternately by this one script (``--rounds`` rounds of ours-then-theirs, so
load from other jobs on this shared machine hits both alike). A step is the slowest rank's time
for one minibatch (forwards, backwards, sends, optimizer step); the first ``--warmup`` steps of
every launch are dropped; the table gives the median over all rounds.

Reading the table: ``ours/theirs`` is throughput ours over theirs (= their median step time over
ours); above 1.0 means pdcompile's runtime is faster on the same pipeline. The load average is
printed with the table: with other jobs on the two cores, absolute times are inflated, ratios less so.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import bench_model, compile_bench, load_note, median, ms, run_ours, step_times, torchrun

PAIRS = (("gpipe", "gpipe"), ("flush", "1f1b"))  # (ours, torch's schedule of the same kind)
THEIR_NAME = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}


@dataclass
class Row:
    """One model x schedule comparison: medians of the slowest rank's step time, and per round the
    ratio of the two launches made back to back (what load changes between rounds cannot bias)."""

    model: str
    ours: str
    theirs: str
    ours_s: float
    theirs_s: float
    samples: int
    round_ratios: tuple[float, ...] = ()

    def interval(self, level: float = 0.9, resamples: int = 2000) -> tuple[float, float]:
        """A bootstrap ``level`` interval of :attr:`ratio` (the rounds resampled with replacement):
        how far launch-to-launch noise on this machine leaves the median uncertain."""
        rs = list(self.round_ratios)
        if len(rs) < 2:
            return (self.ratio, self.ratio)
        rng = random.Random(0)
        meds = sorted(median(rng.choices(rs, k=len(rs))) for _ in range(resamples))
        return meds[int((1 - level) / 2 * resamples)], meds[int((1 + level) / 2 * resamples) - 1]

    @property
    def ratio(self) -> float:
        """Throughput ours / theirs: the median of the per-round paired ratios (pooled medians when
        there are none)."""
        if self.round_ratios:
            return median(list(self.round_ratios))
        return self.theirs_s / self.ours_s


def run_theirs(program: Path, schedule: str, steps: int, timeout: float = 300) -> list[list[float]]:
    """Launch the torch.distributed.pipelining worker on ``program``; per-rank step times."""
    out = Path(tempfile.mkdtemp(prefix="pd-bench-theirs-")) / "times.json"
    nproc = len(json.loads((program / "plan.json").read_text())["stages"])
    rc, log = torchrun("benchmarks._pipelining_worker", nproc,
                       ["--program", str(program), "--schedule", schedule, "--steps", str(steps), "--out", str(out),
                        "--watchdog", str(timeout - 10)], timeout=timeout)
    if rc != 0:
        raise RuntimeError(f"torch.distributed.pipelining worker failed ({rc}):\n{log[-3000:]}")
    return json.loads(out.read_text())["step_times_s"]


def compare(model: str, *, size: str = "bench", batch_size: int = 32, num_microbatches: int = 4,
            stages: int = 2, steps: int = 20, warmup: int = 4, rounds: int = 2,
            pairs: tuple[tuple[str, str], ...] = PAIRS) -> list[Row]:
    """Compile ``model`` once, then time ours and theirs alternately for every schedule pair."""
    b = bench_model(model, batch_size=batch_size, size=size)
    pipe = compile_bench(b, stages, "flush", num_microbatches)
    program = pipe.emit(Path(tempfile.mkdtemp(prefix=f"pd-bench-{model}-")) / "program")
    samples: dict[tuple[str, str], tuple[list[float], list[float]]] = {p: ([], []) for p in pairs}
    ratios: dict[tuple[str, str], list[float]] = {p: [] for p in pairs}
    for i in range(rounds):
        for ours, theirs in pairs:
            # alternate who goes first, so a trend in the machine's load favours neither
            got: dict[str, list[float]] = {}
            for who in (("ours", "theirs") if i % 2 == 0 else ("theirs", "ours")):
                if who == "ours":
                    mine = run_ours(program, stages, steps, schedule=ours)
                    got[who] = step_times([r["step_times_s"] for r in mine], warmup)
                else:
                    got[who] = step_times(run_theirs(program, theirs, steps), warmup)
            samples[(ours, theirs)][0].extend(got["ours"])
            samples[(ours, theirs)][1].extend(got["theirs"])
            ratios[(ours, theirs)].append(median(got["theirs"]) / median(got["ours"]))
    return [Row(model, o, t, median(samples[(o, t)][0]), median(samples[(o, t)][1]), len(samples[(o, t)][0]),
                tuple(ratios[(o, t)])) for o, t in pairs]


def table(rows: list[Row]) -> str:
    lines = ["| model | ours | theirs | ours step (ms) | theirs step (ms) | ours/theirs throughput (median of rounds) "
             "| 90% interval (bootstrap over rounds) | per round | steps timed |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        per = " ".join(f"{x:.2f}" for x in r.round_ratios) or "-"
        lo, hi = r.interval()
        lines.append(f"| {r.model} | {r.ours} | {THEIR_NAME[r.theirs]} | {ms(r.ours_s)} | {ms(r.theirs_s)} | "
                     f"{r.ratio:.2f} | {lo:.2f} - {hi:.2f} | {per} | {r.samples} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=16, help="minibatches per launch")
    p.add_argument("--warmup", type=int, default=4, help="steps dropped at the start of each launch")
    p.add_argument("--rounds", type=int, default=6, help="rounds of back-to-back launches of ours and theirs")
    p.add_argument("--models", default="gpt,vgg")
    p.add_argument("--quick", action="store_true", help="tiny models, one round, nothing written")
    args = p.parse_args(argv)
    rows: list[Row] = []
    before = load_note()
    for m in args.models.split(","):
        if args.quick:
            rows += compare(m, size="tiny", batch_size=8, steps=6, warmup=2, rounds=1)
        else:
            rows += compare(m, steps=args.steps, warmup=args.warmup, rounds=args.rounds)
        print(table(rows), flush=True)
    body = (f"Same emitted 2-stage program (minibatch 32 = 4 microbatches of 8, SGD) trained by pdcompile's "
            f"runtime and by torch.distributed.pipelining on 2 CPU processes (gloo), launched back to back "
            f"({args.rounds} rounds, who goes first alternating; {args.steps} steps per launch, first {args.warmup} "
            f"dropped). Step = slowest rank, reading its random minibatch included on both sides. Throughput ratio = their median step / ours, per round, and the "
            f"median over rounds; > 1: ours faster. The interval is a bootstrap over the rounds: where it holds "
            f"1.0, this machine's launch-to-launch noise (±15% per launch) cannot tell the two apart. Ours splits stage 1's last backward of each step (input "
            f"gradients sent first, weight gradients after; the runtime's default). GPT: 4 blocks, d=96, T=32, vocab 256, "
            f"tied embedding summed on both sides; VGG: convs 16-16-M-32-32-M-64-64-M on 32x32, hidden 256.\n"
            f"Load: {before} at the start, {load_note()} at the end.\n\n" + table(rows))
    if not args.quick:
        from benchmarks._results import write_section

        write_section("Against torch.distributed.pipelining (bench_vs_pipelining)", body,
                      command="python benchmarks/bench_vs_pipelining.py")
    print(body)


if __name__ == "__main__":
    main()
