"""pdcompile's runtime against ``torch.distributed.pipelining`` on the same stages: throughput ratio.

    python benchmarks/bench_vs_pipelining.py            # 3-5 minutes on 2 cores
    python benchmarks/bench_vs_pipelining.py --quick    # a smaller run, nothing written
    python benchmarks/bench_vs_pipelining.py --time-compute  # where the gap is: compute or the rest

Setup. For each model (GPT-style: 4 pre-LN blocks, d=96, T=32, tied embeddings; VGG-style: six 3x3
convolutions and three Linear layers on 32x32 images), pdcompile compiles ONE two-stage program
(minibatch 32, 4 microbatches of 8, SGD lr 0.01) and emits it. Both systems then train exactly that
program's stage modules (``stage_K.py`` + ``stage_K.pt``: the same split, the same weights) on two
CPU processes over gloo, with random data of the same shapes:

* ours: the emitted ``train.py``'s own ``Trainer`` (``--schedule gpipe`` or ``flush``), as users run
  it: the last backward of each step on stage 1 is split (input gradients sent first, weight
  gradients after: the runtime's default, ``--no-split-backward`` turns it off), which shortens the
  drain that both schedules end every minibatch with; the rest of the schedule is torch's, action for
  action. A third row per model runs ours with ``--no-split-backward``: what the split contributes;
* theirs: ``PipelineStage`` around a second copy of each stage module, stepped by torch's
  ``ScheduleGPipe`` or ``Schedule1F1B`` (which *is* 1F1B with a flush per minibatch: what we call
  ``flush``), with ``return_outputs=False`` (ours keeps no outputs either). GPT's tied embedding
  gets its gradient all-reduced between the two stages before the
  step on their side too (our runtime's ``TG``), so both do the same work.

Both run in ONE torchrun launch per model and schedule pair (``benchmarks/_ab_worker.py``), taking
turns in blocks of ``--block-steps`` minibatches (ours, theirs, theirs, ours, ...: who goes first
alternates, so a trend in the machine's load favours neither). Pairing neighbouring blocks is what
makes the ratio trustworthy on this shared machine: separate launches differ by ±15% among
themselves (process placement, other jobs), blocks a second apart do not. A step is the slowest
rank's time for one minibatch (reading it on the first and last rank, forwards, backwards, sends,
optimizer step); the first step of every block and the first block of each side are dropped.

Reading the table: ``ours/theirs`` is throughput ours over theirs (their median step time over ours
in each pair of neighbouring blocks, then the median over pairs); above 1.0 means pdcompile's
runtime is faster on the same pipeline. The interval is a bootstrap over the block pairs.
``bound`` is what no runtime can beat on these actions: after the timed blocks the same (warmed-up)
runtime of ours records its actions, as ``train.py --trace`` does, for ``trace_blocks`` more blocks,
and the schedule is replayed (:func:`compute_bound`) on their median F, B, I, W and ST times per
stage with free transfers and no overhead between actions;
``ceiling`` is their step over it, the most any runtime could gain on theirs there. Where the
ceiling is near 1.05 or under, a row's 1.05 is out of reach for lack of overhead left to remove.

``--time-compute`` runs the same rows with each side's stage forwards and autograd engine calls
timed (``_ab_worker --time-compute``) and writes its own section: per rank, each side's compute per
step and the rest of its step (waits, transfers, the runtime's own code), so a row's gap is split
into the two. The timers cost both sides alike, so those steps are a little slower than the main
table's.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._ab_worker import TORCH_SCHEDULES
from benchmarks._common import (ab_blocks, ab_launch, action_times, bench_model, bootstrap_median, compile_bench,
                                compute_bound, load_note, median, ms)
from benchmarks._results import publish

# (ours: train.py's --schedule and flags, torch's schedule of the same kind). The unsplit row is the
# ablation: the same runtime without the split backward, to show what the split contributes.
PAIRS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("gpipe", (), "gpipe"), ("flush", (), "1f1b"), ("flush", ("--no-split-backward",), "1f1b"))
# virtual stages: 4 stages on the 2 processes, placed as each schedule says (interleaved: stage s on
# rank s % 2; V: stages 0 and 3 on rank 0), ours and torch's of the same schedule on the same program
# "csv:NAME": ours runs torch's own order of that schedule, read from its CSV (schedule="csv:PATH"),
# for the torch schedules that have no policy of ours
VIRTUAL_PAIRS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("interleaved-1f1b", (), "interleaved-1f1b"), ("looped-bfs", (), "looped-bfs"), ("zb-v", (), "zbv"),
    ("csv:interleaved-zb", (), "interleaved-zb"), ("dualpipe-v", (), "dualpipev"))
THEIR_NAME = TORCH_SCHEDULES


@dataclass
class Row:
    """One model x schedule comparison: medians of the slowest rank's step time, and per pair of
    neighbouring blocks the ratio of their medians (what load changes over the run cannot bias)."""

    model: str
    ours: str
    theirs: str
    ours_s: float
    theirs_s: float
    samples: int
    round_ratios: tuple[float, ...] = ()
    bound_s: float = math.nan  # the schedule on ours' traced actions' times, nothing else (compute_bound)
    # the last stage's backward whole and split (I, then W), median seconds, where ours' trace has both
    last_b: tuple[float, float, float] | None = None
    failed: str = ""  # the launch failed: its root error (e.g. torch's runtime split on this model)
    # --time-compute: per rank, {"ours"/"theirs": {"F": s, "B": s}} per timed step (forward calls, engine calls)
    compute: tuple[dict[str, dict[str, float]], ...] = ()

    def interval(self, level: float = 0.9) -> tuple[float, float]:
        """A bootstrap ``level`` interval of :attr:`ratio` (the block pairs resampled with replacement):
        how far this machine's noise leaves the median uncertain."""
        return bootstrap_median(self.round_ratios, level) if self.round_ratios else (self.ratio, self.ratio)

    @property
    def ceiling(self) -> float:
        """Their step over :attr:`bound_s`: the most any runtime could gain on theirs here, running
        these actions at these times with free transfers and no overhead of its own."""
        return self.theirs_s / self.bound_s

    @property
    def ratio(self) -> float:
        """Throughput ours / theirs: the median of the per-round paired ratios (pooled medians when
        there are none)."""
        if self.round_ratios:
            return median(list(self.round_ratios))
        return self.theirs_s / self.ours_s


def compare(model: str, *, size: str = "bench", batch_size: int = 32, num_microbatches: int = 4,
            stages: int = 2, blocks: int = 24, block_steps: int = 6, warmup: int = 1, skip_blocks: int = 1,
            pairs: tuple[tuple[str, tuple[str, ...], str], ...] = PAIRS, virtual: int = 1,
            trace_blocks: int = 3, time_compute: bool = False) -> list[Row]:
    """Compile ``model`` once (``virtual`` > 1: ``stages * virtual`` stages for each pair's schedule,
    whose placement differs), then for every schedule pair one launch where ours and theirs take
    turns; the first ``skip_blocks`` blocks of each side (the process warming up) are dropped. Then
    ours runs ``trace_blocks`` more blocks traced (untimed), which give each row's :func:`compute_bound`."""
    from pdcompile import torch_orders

    b = bench_model(model, batch_size=batch_size, size=size)
    programs: dict[str, tuple[Path, str]] = {}

    def program_for(schedule: str) -> tuple[Path, str]:
        """The program for ``schedule`` and the name train.py runs it by."""
        key = schedule if virtual > 1 else "flush"
        if key not in programs:
            folder = Path(tempfile.mkdtemp(prefix=f"pd-bench-{model}-"))
            if key.startswith("csv:"):
                path = folder / "schedule.csv"
                torch_orders.torch_csv(key[len("csv:"):], stages, num_microbatches, virtual, path=path)
                pipe = compile_bench(b, stages * virtual, f"csv:{path}", num_microbatches)
            else:
                pipe = compile_bench(b, stages * virtual, key, num_microbatches,
                                     **({"virtual_stages": virtual} if virtual > 1 else {}))
            programs[key] = (pipe.emit(folder / "program"), pipe.state.schedule_spec.name)
        return programs[key]

    rows = []
    for ours, flags, theirs in pairs:
        program, name = program_for(ours)
        label = (f"torch's {THEIR_NAME[theirs]} order (CSV)" if ours.startswith("csv:") else ours) + \
            ("" if not flags else " " + " ".join(flags))
        try:
            got = ab_launch(program, name if ours.startswith("csv:") else ours, theirs, blocks=blocks,
                            block_steps=block_steps, flags=(*flags, *(("--time-compute",) if time_compute else ())),
                            trace_blocks=trace_blocks)
        except RuntimeError as e:
            rows.append(Row(model, label, theirs, math.nan, math.nan, 0, failed=root_error(str(e))))
            continue
        mine, other = ab_blocks(got, "ours", warmup)[skip_blocks:], ab_blocks(got, "theirs", warmup)[skip_blocks:]
        ratios = tuple(median(t) / median(o) for o, t in zip(mine, other))
        took = action_times(got["events"]) if trace_blocks else {}
        last = max((s for s, _ in took), default=0)
        whole, inputs, weights = (took.get((last, k)) for k in ("B", "I", "W"))
        rows.append(Row(model, label, theirs, median([x for blk in mine for x in blk]),
                        median([x for blk in other for x in blk]), sum(map(len, mine)), ratios,
                        compute_bound(got["schedule"], took) if trace_blocks else math.nan,
                        (whole, inputs, weights) if whole and inputs and weights else None,
                        compute=per_step(got.get("compute"), (blocks - 1) * block_steps)))
    return rows


def root_error(log: str) -> str:
    """The first error a failed launch's log names, not the follow-ups (peers losing their connection,
    torchrun's summary)."""
    follow = ("Connection closed", "Connection reset", "ChildFailedError", "_ab_worker failed")
    for line in log.splitlines():
        text = line.split("]: ", 1)[-1].strip()
        if "Error:" in text and not any(f in text for f in follow):
            return text[:200]
    return "failed (no error line in the log)"


def table(rows: list[Row]) -> str:
    lines = ["| model | ours | theirs | ours step (ms) | theirs step (ms) | ours/theirs throughput (median of block pairs) "
             "| 90% interval (bootstrap over block pairs) | block pairs | steps timed per side "
             "| bound: the schedule on ours' traced action times, no transfers, no overhead (ms) "
             "| ceiling: theirs step / bound |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.failed:
            lines.append(f"| {r.model} | {r.ours} | {THEIR_NAME[r.theirs]} | - | - | theirs failed: {r.failed} | - | 0 | 0 "
                         f"| - | - |")
            continue
        lo, hi = r.interval()
        lines.append(f"| {r.model} | {r.ours} | {THEIR_NAME[r.theirs]} | {ms(r.ours_s)} | {ms(r.theirs_s)} | "
                     f"{r.ratio:.2f} | {lo:.2f} - {hi:.2f} | {len(r.round_ratios)} | {r.samples} | "
                     f"{ms(r.bound_s)} | {r.ceiling:.2f} |")
    return "\n".join(lines)


def per_step(compute: list[Any] | None, steps: int) -> tuple[dict[str, dict[str, float]], ...]:
    """The worker's compute seconds per rank (summed over a side's timed steps) per step."""
    if not compute or any(c is None for c in compute):
        return ()
    return tuple({side: {k: v / steps for k, v in c[side].items()} for side in ("ours", "theirs")} for c in compute)


def compute_table(rows: list[Row]) -> str:
    """Per row and rank: each side's compute per step (forwards, autograd) and the rest of its step."""
    lines = ["| model | ours | theirs | ours/theirs throughput | rank | ours F / B (ms per step) | theirs F / B "
             "(ms per step) | compute, ours over theirs | step less compute, ours (ms) | step less compute, theirs (ms) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.failed or not r.compute:
            continue
        for rank, c in enumerate(r.compute):
            o, t = c["ours"], c["theirs"]
            oc, tc = o["F"] + o["B"], t["F"] + t["B"]
            lines.append(f"| {r.model} | {r.ours} | {THEIR_NAME[r.theirs]} | {r.ratio:.2f} | {rank} | "
                         f"{ms(o['F'])} / {ms(o['B'])} | {ms(t['F'])} / {ms(t['B'])} | {oc / tc:.3f} | "
                         f"{ms(r.ours_s - oc)} | {ms(r.theirs_s - tc)} |")
    return "\n".join(lines)


def split_lines(rows: list[Row]) -> list[str]:
    """Per row whose last stage ran both a whole and a split backward (gpipe, flush: the drain's last
    one split), what the split takes off the drain: the whole B less its I."""
    out = []
    for r in rows:
        if r.last_b is not None and r.ours in ("gpipe", "flush"):
            b, i, w = r.last_b
            out.append(f"- {r.model} {r.ours}: the last stage's backward takes {b * 1e3:.2f} ms whole, {i * 1e3:.2f} ms "
                       f"split (input gradients, sent at once; the weight gradients' {w * 1e3:.2f} ms after): the split "
                       f"takes {(b - i) * 1e3:.2f} ms, {(b - i) / r.ours_s:.1%} of ours' step, off the drain")
    return out


def auto_choice(model: str, *, size: str, batch_size: int, num_microbatches: int = 4, stages: int = 2) -> str:
    """What ``schedule="auto"`` picks for the benchmark model on these ``stages`` CPU processes (at the
    rows' microbatch count), as ``schedule[ vN]``."""
    b = bench_model(model, batch_size=batch_size, size=size)
    spec = compile_bench(b, stages, "auto", num_microbatches).state.schedule_spec
    return spec.name + (f" v{spec.virtual_stages}" if spec.virtual_stages > 1 else "")


def auto_line(model: str, choice: str, rows: list[Row]) -> str:
    """Ours with ``auto`` against torch's fastest schedule on this model: auto's choice's measured
    step (its own row) over torch's best row's step; the two come from different launches."""
    mine = [r for r in rows if r.model == model and not r.failed]
    theirs = min(mine, key=lambda r: r.theirs_s, default=None)
    ours = next((r for r in mine if r.ours == choice.split(" ")[0]), None)
    if theirs is None or ours is None:
        return f"- {model}: auto chose {choice}; no measured row to compare"
    return (f"- {model}: auto chose {choice} ({ms(ours.ours_s)} ms per step, measured in its row); torch's fastest "
            f"here is {THEIR_NAME[theirs.theirs]} ({ms(theirs.theirs_s)} ms): ours/theirs throughput "
            f"{theirs.theirs_s / ours.ours_s:.2f} (medians from different launches, so only as good as the "
            f"launch-to-launch noise, about +-15% here)")


def sizes(args: argparse.Namespace) -> tuple[str, int, int, int]:
    """(model size, batch size, blocks per side, minibatches per block) of a run: --quick's tiny ones,
    else the benchmark's."""
    return ("tiny", 8, 3, 3) if args.quick else ("bench", 32, args.blocks, args.block_steps)


def model_rows(model: str, args: argparse.Namespace, **kw: Any) -> list[Row]:
    """Every row of ``model``: one stage per process (PAIRS), then 2 per process (VIRTUAL_PAIRS)."""
    size, batch, blocks, steps = sizes(args)
    common = dict(size=size, batch_size=batch, blocks=blocks, block_steps=steps, **kw)
    return compare(model, **common) + compare(model, pairs=VIRTUAL_PAIRS, virtual=2, **common)


def time_compute_main(args: argparse.Namespace) -> None:
    """``--time-compute``: the rows again, each side's compute timed; its own RESULTS section."""
    rows: list[Row] = []
    before = load_note()
    blocks, steps = sizes(args)[2:]
    for m in args.models.split(","):
        rows += model_rows(m, args, trace_blocks=0, time_compute=True)
        print(compute_table(rows), flush=True)
    body = (f"The rows of the section above, each in its own launch again, with each side's compute timed per "
            f"rank: F = its stage modules' forward calls, B = autograd's engine calls (every backward, input- and "
            f"weight-gradient pass), per timed step ({blocks} blocks of {steps} minibatches per side, the first block left out). 'Step less "
            f"compute' is the side's median step (slowest rank) less that rank's compute: waits, transfers, the "
            f"loss, the optimizer step, the runtime's own code. The timers cost both sides alike, so steps here "
            f"are a little slower than in the main table; the throughput column is this launch's.\n"
            f"Load: {before} at the start, {load_note()} at the end.\n\n" + compute_table(rows))
    publish("Against torch.distributed.pipelining, compute apart (bench_vs_pipelining --time-compute)", body,
            "python benchmarks/bench_vs_pipelining.py --time-compute", write=not args.quick)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--blocks", type=int, default=24, help="blocks per side in each launch")
    p.add_argument("--block-steps", type=int, default=6, help="minibatches per block")
    p.add_argument("--models", default="gpt,vgg")
    p.add_argument("--quick", action="store_true", help="tiny models, a few blocks, nothing written")
    p.add_argument("--time-compute", action="store_true",
                   help="time each side's compute per rank (its own section; the main table is left alone)")
    args = p.parse_args(argv)
    if args.time_compute:
        return time_compute_main(args)
    rows: list[Row] = []
    autos: list[str] = []
    before = load_note()
    for m in args.models.split(","):
        rows += model_rows(m, args)
        size, batch = sizes(args)[:2]
        autos.append(auto_line(m, auto_choice(m, size=size, batch_size=batch), rows))
        print(table(rows), flush=True)
        print(autos[-1], flush=True)
    body = (f"Same emitted 2-stage program (minibatch 32 = 4 microbatches of 8, SGD) trained by pdcompile's "
            f"runtime and by torch.distributed.pipelining on 2 CPU processes (gloo), both in one torchrun launch "
            f"per row, taking turns in blocks of {args.block_steps} minibatches ({args.blocks} blocks each, who goes "
            f"first alternating; the first step of each block and the first block of each side dropped). Step = "
            f"slowest rank, reading its random minibatch included on both sides; theirs steps with return_outputs=False "
            f"(ours keeps no outputs either). Throughput ratio = their median "
            f"step / ours in each pair of neighbouring blocks, and the median over pairs; > 1: ours faster. The "
            f"interval is a bootstrap over the block pairs. Ours splits stage 1's last backward of each step "
            f"(input gradients sent first, weight gradients after; the runtime's default); the "
            f"'--no-split-backward' row is the same runtime without it. Both sides run with train.py's CPU "
            f"malloc setting (runtime/allocator.py, process-wide; see the Allocator section). GPT: 4 blocks, d=96, "
            f"T=32, vocab 256, tied embedding summed on both sides; VGG: convs 16-16-M-32-32-M-64-64-M on 32x32, "
            f"hidden 256. Virtual-stage rows: 4 stages of the same model on the 2 processes, placed as each schedule "
            f"says, the same for both sides; 'torch's ... order (CSV)': ours runs the torch schedule's own order, "
            f"read from its CSV (schedule='csv:PATH'). 'theirs failed': torch's run raised (its error shown). "
            f"bound: after the timed blocks, ours' runtime records its actions as train.py --trace does for 3 "
            f"more blocks, and the schedule is replayed on their median F, B, I, W and ST times per stage with "
            f"free transfers, no waits but the schedule's own and no overhead "
            f"between actions (each traced time is the action's compute plus our runtime's own code around it); "
            f"ceiling: their step over the bound, the most any runtime could gain on theirs here.\n"
            f"Load: {before} at the start, {load_note()} at the end.\n\n" + table(rows)
            + "\n\nWhat the drain's split saves (medians of ours' traced blocks):\n" + "\n".join(split_lines(rows))
            + "\n\nschedule='auto' (on 2 CPU processes it leaves out the schedules that split every backward, "
              "see bench_zero_bubble):\n" + "\n".join(autos))
    publish("Against torch.distributed.pipelining (bench_vs_pipelining)", body,
            "python benchmarks/bench_vs_pipelining.py", write=not args.quick)


if __name__ == "__main__":
    main()
