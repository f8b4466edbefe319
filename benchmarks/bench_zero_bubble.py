"""ZB-H1 against flush, both pdcompile's runtime, on the same emitted program in one launch.

    python benchmarks/bench_zero_bubble.py            # a few minutes on 2 cores
    python benchmarks/bench_zero_bubble.py --quick    # tiny models, nothing written
    python benchmarks/bench_zero_bubble.py --profiles # auto on PipeDream's profiles (simulated, seconds)

Per model (bench_vs_pipelining's GPT and VGG), one 2-stage program; one torchrun launch per row (and
``--weight-pass``: the graph split or the submodules') runs ``--schedule zb-h1`` and ``--schedule
flush`` in alternating blocks (``_ab_worker.py --theirs ours``); the ratio (flush's step over ZB-H1's
per block pair) beside the simulator's; and the split's cost per stage, both ways.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import bench_model, bootstrap_median, compile_bench, load_note, median, ms, run_pair
from benchmarks._results import publish


def compare(model: str, m: int, *, size: str, batch_size: int, blocks: int, block_steps: int,
            weight_pass: str) -> list[str]:
    b = bench_model(model, batch_size=batch_size, size=size)
    pipe = compile_bench(b, 2, "zb-h1", m)
    program = pipe.emit(Path(tempfile.mkdtemp(prefix=f"pd-bench-zb-{model}-")) / "program")
    zb, fl = run_pair(program, "zb-h1", "ours", blocks=blocks, block_steps=block_steps, warmup=1,
                      flags=("--weight-pass", weight_pass), theirs_flags="--schedule flush")
    zb, fl = zb[1:], fl[1:]  # the first block of each side: the process warming up
    ratios = [median(f) / median(z) for z, f in zip(zb, fl)]
    lo, hi = bootstrap_median(ratios)
    predicted = float(pipe.simulate(schedule="flush").step_time_s / pipe.simulate(schedule="zb-h1").step_time_s)
    return [model, str(m), weight_pass, ms(median([x for blk in zb for x in blk])),
            ms(median([x for blk in fl for x in blk])), f"{median(ratios):.3f}", f"{lo:.3f} - {hi:.3f}",
            f"{predicted:.3f}", str(len(ratios))]


def split_cost(model: str, *, size: str, batch_size: int, m: int, repeats: int = 15) -> list[list[str]]:
    """Per stage of the 2-stage program, in this process on one thread, the best of ``repeats``: a
    microbatch's backward unsplit; split as :class:`~pdcompile.runtime.weight_grads.WeightPass` splits
    it (B to the inputs and the noted submodule outputs, W per submodule); split by
    :class:`~pdcompile.runtime.graph_split.GraphSplit` (I and W of the traced backward graph); and the
    forward, eager and through the traced graph."""
    import time

    import torch

    from pdcompile.runtime.graph_split import GraphSplit
    from pdcompile.runtime.weight_grads import WeightPass

    torch.set_num_threads(1)
    b = bench_model(model, batch_size=batch_size, size=size)
    pipe = compile_bench(b, 2, "flush", m)
    micro = [x[: batch_size // m] for x in b.inputs]
    rows = []
    for s, st in enumerate(pipe.split.stages):
        mod = st.gm
        if s == 0:
            ins = micro
        else:
            outs = pipe.split.stages[0].gm(*micro)
            outs = outs if isinstance(outs, tuple) else (outs,)
            ins = [o.detach().requires_grad_(o.is_floating_point()) for o in outs]
        wp = WeightPass(mod)
        gs = GraphSplit(mod, ins)
        assert gs.check(ins), f"{model} stage {s}: the graph split is not exact"
        grad_ins = [x for x in ins if x.requires_grad]

        def best(route: str) -> tuple[float, float, float]:
            """(forward, B or I, W) of ``route``: eager, submodules or graph."""
            times = []
            for _ in range(repeats + 3):
                t0 = time.perf_counter()
                handles, notes = (wp.capture() if route == "submodules" else gs.capture() if route == "graph"
                                  else ([], {}))
                out = gs.forward(notes, ins) if route == "graph" else mod(*ins)
                for h in handles:
                    h.remove()
                roots = [o for o in (out if isinstance(out, tuple) else (out,)) if o.requires_grad]
                seeds = [torch.ones_like(o) for o in roots]
                t1 = time.perf_counter()
                if route == "eager":
                    torch.autograd.backward(roots, seeds)
                    t2 = time.perf_counter()
                else:
                    pass_ = wp if route == "submodules" else gs
                    work = pass_.input_grads(roots, seeds, grad_ins, notes)[1]  # type: ignore[arg-type]
                    t2 = time.perf_counter()
                    pass_.weight_grads(work)
                times.append((t1 - t0, t2 - t1, time.perf_counter() - t2))
                mod.zero_grad(set_to_none=True)
            kept = times[3:]
            return tuple(min(t[i] for t in kept) for i in range(3))  # type: ignore[return-value]

        (fe, plain, _), (_, b_sub, w_sub), (fg, i_gr, w_gr) = best("eager"), best("submodules"), best("graph")

        def cell(x: float, y: float) -> str:
            return f"{x * 1e3:.2f} + {y * 1e3:.2f} = {(x + y) * 1e3:.2f} ms ({(x + y) / plain:.2f}x)"

        rows.append([model, str(m), str(s), f"{plain * 1e3:.2f}", cell(b_sub, w_sub), cell(i_gr, w_gr),
                     f"{fe * 1e3:.2f} / {fg * 1e3:.2f} ({fg / fe:.2f}x)"])
    return rows


def on_profiles(names: list[str], clusters: list[str]) -> str:
    """``schedule="auto"`` on PipeDream's profiles: the plan (flush's memory model), then every
    synchronous schedule at every M dividing 8 microbatches' worth (up to 16), simulated."""
    import dataclasses
    import time

    from pdcompile import profile
    from pdcompile._cli.plan import resolve_cluster
    from pdcompile.autoschedule import (
        auto_schedules,
        best,
        best_per_schedule,
        candidates,
        microbatch_counts,
        virtual_candidates,
    )
    from pdcompile.passes.linearize import linearize
    from pdcompile.plan import plan
    from pdcompile.simulate import simulate_plan

    lines = ["| profile | cluster | configuration | auto: schedule, M | auto step (s) | flush M=4 step (s) | "
             "auto speedup over flush M=4 | over the best other schedule | best gpipe / flush / zb-h1 (s) | "
             "best with 2 stages per rank on the plan's ranks: schedule, step (s) | planning + choice (s) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name in names:
        for cl in clusters:
            t0 = time.perf_counter()
            chain, cluster = linearize(profile.load(f"pipedream:{name}")), resolve_cluster(cl)
            pl = plan(chain, cluster, schedule="flush")
            mb = pl.microbatch_size * 8
            counts = microbatch_counts(mb, most=16)
            cands = candidates(pl, chain, cluster, mb, auto_schedules(True), counts)
            ranks = len({r for st in pl.stages for r in st.ranks})
            virt = virtual_candidates(chain, cluster, ranks, mb, auto_schedules(True, virtual=True), counts)
            chosen, per = best(cands + virt), best_per_schedule(cands + virt)
            dt = time.perf_counter() - t0
            vbest = best(virt) if virt else None
            vcell = f"{vbest.schedule}, {vbest.step_s:.4g}{'' if vbest.fits else ' (does not fit)'}" if vbest else "-"
            base = float(simulate_plan(dataclasses.replace(pl, microbatch_size=mb // 4), chain, cluster, "flush",
                                       4).step_time_s)
            lines.append(f"| {name} | {cl} | {pl.configuration} | {chosen.schedule}, {chosen.num_microbatches} | "
                         f"{chosen.step_s:.4g} | {base:.4g} | {base / chosen.step_s:.3f} | "
                         f"{min(c.step_s for n, c in per.items() if n != chosen.schedule) / chosen.step_s:.3f} | "
                         + " / ".join(f"{per[n].step_s:.4g}" for n in ("gpipe", "flush", "zb-h1"))
                         + f" | {vcell} | {dt:.2f} |")
    return "\n".join(lines)


def on_straight_pipelines(names: list[str], cluster_name: str, ranks: Sequence[int]) -> str:
    """Straight pipelines of ``p`` balanced stages (one worker each, no replication) on the cluster's
    first ``p`` workers: the best schedule with a stage per rank against auto with the schedules
    that put 2 stages on each rank (``v p`` balanced stages), all simulated. Where the bubble
    matters, interleaving and the V schedules can win; the DP's replicated plans leave none."""
    import time

    from pdcompile import profile
    from pdcompile._cli.plan import resolve_cluster
    from pdcompile.autoschedule import auto_schedules, best, candidates, microbatch_counts, virtual_candidates
    from pdcompile.passes.linearize import linearize
    from pdcompile.passes.partition import balanced_bounds
    from pdcompile.passes.partition_dp import pipeline_plan

    lines = ["| profile | p | best with a stage per rank: schedule, M, step (s) | auto with 2 stages per rank allowed: "
             "schedule, M, step (s) | predicted step ratio (below 1: the fastest one fitting 16 GiB is slower) | "
             "choice (s) |", "|---|---|---|---|---|---|"]
    cluster = resolve_cluster(cluster_name)
    for name in names:
        chain = linearize(profile.load(f"pipedream:{name}"))
        for p in ranks:
            if 2 * p > len(chain.layers):
                continue
            t0 = time.perf_counter()
            pl = pipeline_plan(chain, balanced_bounds(chain, p), cluster, schedule="flush", memory_limit=False)
            mb = pl.microbatch_size * 8
            counts = microbatch_counts(mb, most=16)
            fixed = best(candidates(pl, chain, cluster, mb, auto_schedules(True), counts))
            chosen = best([fixed, *virtual_candidates(chain, cluster, p, mb, auto_schedules(True, virtual=True),
                                                      counts)])
            dt = time.perf_counter() - t0
            v = f" v={chosen.virtual_stages}" if chosen.virtual_stages > 1 else ""

            def fit(c: Any) -> str:
                return "" if c.fits else " (does not fit)"

            lines.append(f"| {name} | {p} | {fixed.schedule}, {fixed.num_microbatches}, {fixed.step_s:.4g}{fit(fixed)} | "
                         f"{chosen.schedule}{v}, {chosen.num_microbatches}, {chosen.step_s:.4g}{fit(chosen)} | "
                         f"{fixed.step_s / chosen.step_s:.3f} | {dt:.2f} |")
    return "\n".join(lines)


PROFILES = ["alexnet", "vgg16", "gnmt", "gnmt_large", "resnet18", "resnet50", "resnet101", "resnext50",
            "resnext101", "inception_v3", "densenet121", "nasnetamobile", "nasnetalarge"]


def table(rows: list[list[str]]) -> str:
    head = ["model", "microbatches", "--weight-pass", "zb-h1 step (ms)", "flush step (ms)",
            "flush/zb-h1 step (median of block pairs)",
            "90% interval", "predicted (simulator)", "block pairs"]
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] +
                     ["| " + " | ".join(r) + " |" for r in rows])


def reading(rows: list[list[str]]) -> str:
    """One line per weight pass: the rows whose ratio's interval lies above 1 (ZB-H1 faster), below 1
    (flush faster) or across it."""
    pays = [f"{r[0]} M={r[1]}" for r in rows if r[2] == "graph" and float(r[6].split(" - ")[0]) > 1]
    lines = [f"Does the graph split make ZB-H1 pay on this machine (its interval above 1)? "
             f"{'Yes, for ' + ', '.join(pays) if pays else 'Not clearly: for no row'}."]
    for wp in dict.fromkeys(r[2] for r in rows):
        sides: dict[str, list[str]] = {"above 1 (zb-h1 faster)": [], "below 1 (flush faster)": [], "across 1": []}
        for r in rows:
            if r[2] == wp:
                lo, hi = (float(x) for x in r[6].split(" - "))
                key = "above 1 (zb-h1 faster)" if lo > 1 else "below 1 (flush faster)" if hi < 1 else "across 1"
                sides[key].append(f"{r[0]} M={r[1]}")
        lines.append(f"Reading, `--weight-pass {wp}`: the 90% interval is " + "; ".join(
            f"{k} for {', '.join(v)}" for k, v in sides.items() if v) + ".")
    ratio = {(r[0], r[1], r[2]): float(r[5]) for r in rows}
    pairs = [(k[:2], ratio[k], ratio.get((*k[:2], "submodules"))) for k in ratio if k[2] == "graph"]
    pairs = [(k, g, s) for k, g, s in pairs if s is not None]
    if pairs:
        better = [f"{k[0]} M={k[1]}" for k, g, s in pairs if g > s]
        lines.append(f"The graph split's ratio is the higher in {len(better)} of {len(pairs)} rows"
                     + (f" ({', '.join(better)})" if better else "") + ".")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--blocks", type=int, default=16, help="blocks per side in each launch")
    p.add_argument("--block-steps", type=int, default=6, help="minibatches per block")
    p.add_argument("--models", default="gpt,vgg")
    p.add_argument("--microbatches", default="4,8")
    p.add_argument("--weight-passes", default="graph,submodules", help="train.py --weight-pass values, a row each")
    p.add_argument("--quick", action="store_true", help="tiny models, a few blocks, nothing written")
    p.add_argument("--profiles", action="store_true", help="only auto on PipeDream's profiles (simulated)")
    args = p.parse_args(argv)
    if args.profiles:
        body = ("`schedule=\"auto\"` on PipeDream's profiles, planned for the paper's clusters (flush's memory "
                "model), minibatch = 8 x the plan's microbatch, every M dividing it up to 16, every synchronous "
                "schedule simulated (simulate_plan); the layers have no profiled split, so B and W cost the fixed "
                "0.6 / 0.6 shares of the backward (what the CPU runtime's split measured). Predicted only.\n\n"
                + on_profiles(PROFILES, ["paper:A", "paper:B"])
                + "\n\nStraight pipelines on Cluster A's first p workers (one stage per worker, balanced; no "
                  "replication), the same candidates plus those with 2 stages per rank (interleaved-1f1b, "
                  "looped-bfs, zb-v, dualpipe-v on 2p balanced stages). Predicted only.\n\n"
                + on_straight_pipelines(PROFILES, "paper:A", (4, 8)))
        publish("schedule=auto on PipeDream's profiles (bench_zero_bubble --profiles)", body,
                "python benchmarks/bench_zero_bubble.py --profiles", write=not args.quick)
        return
    before = load_note()
    rows = []
    for model in args.models.split(","):
        for m in map(int, args.microbatches.split(",")):
            for wp in args.weight_passes.split(","):
                if args.quick:
                    rows.append(compare(model, m, size="tiny", batch_size=8, blocks=3, block_steps=3, weight_pass=wp))
                else:
                    rows.append(compare(model, m, size="bench", batch_size=32, blocks=args.blocks,
                                        block_steps=args.block_steps, weight_pass=wp))
                print(table(rows), flush=True)
    size, batch = ("tiny", 8) if args.quick else ("bench", 32)
    costs = [r for model in args.models.split(",") for r in split_cost(model, size=size, batch_size=batch, m=4)]
    cost_table = "\n".join(["| model | microbatches | stage | backward unsplit (ms) | split by submodules: B + W | "
                            "split by the graph: I + W | forward eager / through the graph (ms) |",
                            "|---|---|---|---|---|---|---|"]
                           + ["| " + " | ".join(r) + " |" for r in costs])
    body = (f"The same emitted 2-stage program (minibatch 32, SGD) trained by pdcompile's runtime with ZB-H1 and "
            f"with flush (its default split of the drain's last backward) on 2 CPU processes (gloo), in one torchrun "
            f"launch per row, taking turns in blocks of {args.block_steps} minibatches ({args.blocks} blocks each, "
            f"who goes first alternating; the first step of each block and the first block of each side dropped). "
            f"Step = slowest rank. Ratio = flush's median step / ZB-H1's in each pair of neighbouring blocks, median "
            f"over pairs; > 1: ZB-H1 faster. 'predicted' is the simulator's flush/zb-h1 step ratio from the compiled "
            f"(analytic) profile. Models as in bench_vs_pipelining.\nLoad: {before} at the start, {load_note()} at "
            f"the end. `--weight-pass`: how both sides split a backward (train.py's flag; ZB-H1 splits every one, "
            f"flush its drain's last).\n\n" + table(rows) + "\n\n" + reading(rows) + "\n\nWhy: a microbatch's "
            f"backward on each stage, in one process on one thread, best of 15 each: unsplit (autograd); split by "
            f"submodules (`WeightPass`; B: input and noted submodule-output gradients, W: one pass per "
            f"parameter-owning submodule); split by the graph (`GraphSplit`; I and W of the stage's aot_autograd "
            f"backward graph, bitwise an unsplit backward's gradients); and the forward, eager and through the "
            f"traced forward graph (what the graph route runs for a split microbatch). Stage 0's inputs need no "
            f"gradient: the graph's I is empty there and its W is the whole backward. Where the split's extra cost "
            f"exceeds the bubble it fills (a ratio below 1 above), the planner must not choose ZB-H1 "
            f"(autoschedule.split_every_backward_pays)."
            f"\n\n" + cost_table)
    publish("ZB-H1 against flush (bench_zero_bubble)", body, "python benchmarks/bench_zero_bubble.py",
            write=not args.quick)


if __name__ == "__main__":
    main()
