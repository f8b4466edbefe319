"""The planner's split against naive partitions: uniform layers, balanced parameters, balanced time.

    python benchmarks/bench_partitions.py            # ~8-10 minutes on 2 cores
    python benchmarks/bench_partitions.py --quick    # tiny models, predicted part only on vgg16, nothing written

Strategies (each a contiguous split of the linearized chain into S stages, cutting only where
tensors alone are live):

* ``uniform``: equal numbers of layers with parameters per stage (DeepSpeed's ``partition_method="uniform"``);
* ``parameters``: the split minimizing the largest stage's parameter bytes (DeepSpeed's ``"parameters"``);
* ``time``: the split minimizing the largest stage's forward+backward time (torchgpipe's
  ``balance_by_time``: its block partition over per-layer times), communication ignored;
* ``planner``: ``passes/partition_dp.partition_dp`` on the same chain and cluster, straight pipelines
  only (``allow_replication=False``), one rank per stage; it prices the cut's transfer as well as
  compute, and may use fewer than S stages (then fewer processes run) when that is faster.

Measured (CPU). The GPT- and VGG-style benchmark models (heterogeneous layers: attention vs MLP
blocks, wide early convolutions vs parameter-heavy Linear layers), compiled with
``cost_mode="measured"`` (per-node times on this machine: what balance_by_time profiles), split
each way into 2 stages, emitted with that split and trained with the ``flush`` schedule (minibatch 32,
4 microbatches) on 2 CPU processes. Splits that coincide are run once. Step = slowest rank, median
after warm-up; all strategies of a model are launched in one run, alternately for ``--rounds``.
How a split is run: pdcompile's API has no ``assignment=`` option yet, so the benchmark builds the
CompiledPipeline, then replaces its split with ``split_stages(gm, assignment, model)``.

Predicted (PipeDream's own profiles, ``pipedream:NAME``, shipped in the package). VGG-16, AlexNet,
ResNet-50 and GNMT-16 profiles, linearized, split each way into 4 stages, priced by the planner's
cost model (``partition_dp.pipeline_time``) on 4 workers at 10 Gbit/s; plus the planner with
replication allowed, for reference.

Reading the tables: ``vs planner`` is throughput relative to the planner's split (planner step /
this step): below 1.0 the naive split is slower.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import bench_model, compile_bench, load_note, median, ms, run_ours, step_times

STRATEGIES = ("uniform", "parameters", "time", "planner")


# --- splits on a chain ---------------------------------------------------------------------------

def minmax_bounds(weights: Sequence[float], stages: int, allowed: Sequence[bool]) -> list[int]:
    """First positions of stages 1..S-1 minimizing the largest stage's weight sum (contiguous parts;
    a stage may start at ``i`` only if ``allowed[i-1]``): the compiler's one balanced split,
    :func:`pdcompile.passes.partition.balanced_split`, with cut bytes ignored (ties: earliest cuts).
    The block partition torchgpipe's balance_by_time and DeepSpeed's ``parameters`` both solve."""
    from pdcompile.passes.partition import balanced_split

    return balanced_split(weights, stages, [0.0 if ok else math.inf for ok in allowed])


def uniform_bounds(chain: Any, stages: int, allowed: Sequence[bool]) -> list[int]:
    """Equal counts of parametric layers per stage, each cut moved to the next legal position."""
    layered = [i for i, layer in enumerate(chain.layers) if layer.param_bytes > 0] or list(range(len(chain)))
    bounds: list[int] = []
    for k in range(1, stages):
        want = layered[k * len(layered) // stages]
        want = max(want, (bounds[-1] + 1) if bounds else 1)
        b = next((i for i in range(want, len(chain)) if allowed[i - 1]), None)
        if b is None:
            b = next(i for i in range(want - 1, bounds[-1] if bounds else 0, -1) if allowed[i - 1])
        bounds.append(b)
    return bounds


def strategy_bounds(chain: Any, cluster: Any, stages: int) -> dict[str, list[int]]:
    """Every strategy's split of ``chain`` (stage first positions 1..S-1)."""
    allowed = [math.isfinite(c) for c in chain.cut_bytes]
    out = {
        "uniform": uniform_bounds(chain, stages, allowed),
        "parameters": minmax_bounds([layer.param_bytes for layer in chain.layers], stages, allowed),
        "time": minmax_bounds([layer.compute_s for layer in chain.layers], stages, allowed),
    }
    try:
        from pdcompile.passes.partition_dp import partition_dp
    except ImportError:  # the planner is not in this checkout yet
        return out
    plan = partition_dp(chain, cluster, allow_replication=False, memory_limit=False)
    out["planner"] = sorted(s.first for s in plan.stages)[1:]
    return out


def predicted_seconds(chain: Any, cluster: Any, bounds: Sequence[int]) -> float:
    """Seconds per minibatch of a straight pipeline with these bounds, by the planner's cost model."""
    from pdcompile.passes.partition_dp import pipeline_time

    edges = [0, *bounds, len(chain)]
    return pipeline_time(chain, cluster, [(a, b - 1, 1) for a, b in zip(edges, edges[1:])], memory_limit=False)


# --- measured on CPU ---------------------------------------------------------------------------

def assignment_from_bounds(pipe: Any, bounds: Sequence[int]) -> dict[str, int]:
    """fx node -> stage for a chain split: chain layer ``i``'s member nodes go to its stage; compute
    nodes outside the chain follow the node before them in graph order."""
    chain = pipe.state.chain
    edges = [0, *bounds, len(chain)]
    stage_of_layer = {}
    for k, (a, b) in enumerate(zip(edges, edges[1:])):
        for i in range(a, b):
            for name in (chain.layers[i].members or (chain.layers[i].name,)):
                stage_of_layer[name] = k
    out: dict[str, int] = {}
    last = 0
    for n in pipe.state.gm.graph.nodes:
        if n.op in ("placeholder", "get_attr", "output"):
            continue
        last = stage_of_layer.get(n.name, last)
        out[n.name] = last
    return out


def with_split(pipe: Any, assignment: dict[str, int]) -> Any:
    """The CompiledPipeline with its split replaced (no ``assignment=`` option in the API yet)."""
    from pdcompile.passes.split_stages import split_stages

    s = pipe.state
    n = max(assignment.values()) + 1  # the planner may choose fewer stages than workers
    pipe.state = s.replace(stages=split_stages(s.gm, assignment, s.model), assignment=assignment,
                           stage_ranks=tuple((k,) for k in range(n)))
    return pipe


@dataclass
class Measured:
    model: str
    strategy: str
    bounds: list[int]
    stage_ms: list[float]  # the chain's profiled fwd+bwd per stage (ms per microbatch, from compiling)
    step_s: float
    predicted_s: float
    chain_batch: int = 0  # the samples the chain's costs are for (the microbatch)
    round_s: tuple[float, ...] = ()  # the median step of each round (launch to launch spread)


def measure(model: str, *, size: str = "bench", stages: int = 2, steps: int = 15, warmup: int = 3,
            rounds: int = 1, batch: int = 32, num_microbatches: int = 4) -> list[Measured]:
    """Run every strategy's split of ``model`` through the runtime (flush) and time it."""
    from pdcompile.cluster import local_cpu_cluster

    b = bench_model(model, batch_size=batch, size=size)
    pipe = compile_bench(b, stages, "flush", num_microbatches, cost_mode="measured")
    chain = pipe.state.chain
    cluster = local_cpu_cluster(stages)
    splits = strategy_bounds(chain, cluster, stages)
    programs: dict[tuple[int, ...], Path] = {}
    for bounds in splits.values():
        key = tuple(bounds)
        if key not in programs:
            with_split(pipe, assignment_from_bounds(pipe, bounds))
            programs[key] = pipe.emit(Path(tempfile.mkdtemp(prefix=f"pd-part-{model}-")) / "program")
    times: dict[tuple[int, ...], list[float]] = {k: [] for k in programs}
    per_round: dict[tuple[int, ...], list[float]] = {k: [] for k in programs}
    for _ in range(rounds):
        for key, prog in programs.items():
            ranks = run_ours(prog, len(key) + 1, steps)
            got = step_times([r["step_times_s"] for r in ranks], warmup)
            times[key].extend(got)
            per_round[key].append(median(got))
    rows = []
    for name, bounds in splits.items():
        edges = [0, *bounds, len(chain)]
        stage_ms = [sum(chain.layers[i].compute_s for i in range(a, b)) * 1e3 for a, b in zip(edges, edges[1:])]
        try:
            pred = predicted_seconds(chain, cluster, bounds)
        except ImportError:
            pred = math.nan
        rows.append(Measured(model, name, list(bounds), stage_ms, median(times[tuple(bounds)]), pred,
                             chain.batch_size, tuple(per_round[tuple(bounds)])))
    return rows


def measured_table(rows: list[Measured]) -> str:
    b = sorted({r.chain_batch for r in rows})
    lines = [f"| model | strategy | cut before chain layer | profiled fwd+bwd per stage (ms per microbatch of "
             f"{'/'.join(map(str, b))}) | measured step of 4 microbatches (ms, median) | rounds' medians (ms, "
             f"min-max) | vs planner (measured) | predicted bottleneck for this split (ms per microbatch) |",
             "|---|---|---|---|---|---|---|---|"]
    ref = {r.model: r.step_s for r in rows if r.strategy == "planner"}
    for r in rows:
        rel = ref.get(r.model, math.nan) / r.step_s
        lines.append(f"| {r.model} | {r.strategy} | {', '.join(map(str, r.bounds))} | "
                     f"{' / '.join(f'{x:.2f}' for x in r.stage_ms)} | {ms(r.step_s)} | "
                     f"{ms(min(r.round_s, default=math.nan))}-{ms(max(r.round_s, default=math.nan))} | {rel:.2f} | "
                     f"{ms(r.predicted_s)} |")
    return "\n".join(lines)


# --- predicted on PipeDream's profiles ------------------------------------------------------------

def predicted(names: Sequence[str] = ("vgg16", "alexnet", "resnet50", "gnmt"), stages: int = 4,
              bandwidth: float = 10e9 / 8) -> list[tuple[str, str, list[int], float]]:
    """(profile, strategy, bounds, seconds per minibatch) on ``stages`` workers at ``bandwidth``."""
    from pdcompile.cluster import flat_cluster
    from pdcompile.passes.linearize import linearize
    from pdcompile.passes.partition_dp import partition_dp
    from pdcompile.profile import load_pipedream

    cluster = flat_cluster(stages, bandwidth)
    out = []
    for name in names:
        chain = linearize(load_pipedream(f"pipedream:{name}"))
        for strat, bounds in strategy_bounds(chain, cluster, stages).items():
            out.append((name, strat, bounds, predicted_seconds(chain, cluster, bounds)))
        plan = partition_dp(chain, cluster, memory_limit=False)
        rep = "+".join(str(len(s.ranks)) for s in plan.stages)
        out.append((name, f"planner, replication allowed ({rep})", [s.first for s in plan.stages][1:],
                    _plan_seconds(chain, cluster, plan)))
    return out


def _plan_seconds(chain: Any, cluster: Any, plan: Any) -> float:
    from pdcompile.passes.partition_dp import pipeline_time

    return pipeline_time(chain, cluster, plan, memory_limit=False)


def predicted_table(rows: list[tuple[str, str, list[int], float]]) -> str:
    ref = {p: s for p, st, _, s in rows if st == "planner"}
    lines = ["| profile | strategy | stage starts (chain layer) | predicted s / minibatch | vs planner |",
             "|---|---|---|---|---|"]
    for p, st, bounds, s in rows:
        lines.append(f"| {p} | {st} | {', '.join(map(str, [0, *bounds]))} | {s:.4f} | {ref[p] / s:.2f} |")
    return "\n".join(lines)


def wins(rows: list[Measured], pred: list[tuple[str, str, list[int], float]]) -> str:
    """Where a naive split beats the planner's: measured (a different split, faster median step; clear
    when its slowest round beats the planner's fastest) and predicted."""
    ref = {r.model: r for r in rows if r.strategy == "planner"}
    out = []
    for r in rows:
        p = ref.get(r.model)
        if p is not None and r.strategy != "planner" and r.bounds != p.bounds and r.step_s < p.step_s:
            clear = bool(r.round_s and p.round_s and max(r.round_s) < min(p.round_s))
            out.append(f"{r.model} {r.strategy} ({p.step_s / r.step_s:.2f}x the planner's throughput, "
                       + ("every round faster" if clear else "rounds overlap: within launch-to-launch noise")
                       + f"; predicted {ms(r.predicted_s)} vs the planner's {ms(p.predicted_s)} ms)")
    text = ("Measured, a naive split faster than the planner's: " + ("; ".join(out) if out else "none") + ". ")
    pref = {n: s for n, st, _, s in pred if st == "planner"}
    pw = [f"{n} {st}" for n, st, _, s in pred if st in ("uniform", "parameters", "time") and s < pref[n] * (1 - 1e-9)]
    text += ("Predicted, a naive straight split faster than the planner's: " + (", ".join(pw) if pw else "none")
             + " (the planner's straight split is optimal under the cost model; equal rows found the same split).")
    return text


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    before = load_note()
    rows: list[Measured] = []
    for m in ("gpt", "vgg"):
        if args.quick:
            rows += measure(m, size="tiny", batch=8, steps=4, warmup=1, rounds=1)
        else:
            rows += measure(m, steps=args.steps, rounds=args.rounds)
        print(measured_table(rows), flush=True)
    pred = predicted(("vgg16",) if args.quick else ("vgg16", "alexnet", "resnet50", "gnmt"))
    body = (f"Measured: benchmark GPT (4 blocks, d=96, T=32) and VGG-style (convs 16-16-M-32-32-M-64-64-M, hidden 256) "
            f"models, per-node costs measured on this CPU, 2 stages on 2 processes, flush, minibatch 32 = 4 x 8, "
            f"{args.rounds} alternating rounds x {args.steps} steps; step = slowest rank, median after warm-up. "
            f"Splits that coincide share one run. Profiled fwd+bwd: the per-node costs pdcompile measured while "
            f"compiling (cost_mode='measured'), summed per stage, for one microbatch of 8 (the chain is profiled "
            f"at the microbatch size: what the planner balances). Measured step: one flush step of 4 microbatches, "
            f"slowest rank, median. 'vs planner' = planner step / this step (< 1: slower than the planner's "
            f"split). Predicted: the `default` cost model's bottleneck for this split on 2 local workers, per "
            f"microbatch (the slowest stage or link; no fill, drain or per-step costs)."
            f"\nLoad: {before} at the start, {load_note()} at the end.\n\n"
            + measured_table(rows) + "\n\n" + wins(rows, pred)
            + "\n\nPredicted on PipeDream's profiles: straight pipelines of up to 4 stages on 4 workers at 10 Gbit/s "
              "(naive splits use all 4; the planner may use fewer when faster), the planner's cost model "
              "(partition_dp.pipeline_time, memory limit off); last row per profile: the planner with replication "
              "allowed (replicas per stage in brackets).\n\n" + predicted_table(pred))
    from benchmarks._results import publish

    publish("Against naive partitions (bench_partitions)", body, command="python benchmarks/bench_partitions.py",
            write=not args.quick)


if __name__ == "__main__":
    main()
