"""Benchmark: the PipeDream paper's table, predicted — speedup over data parallelism from PipeDream's own profiles.

For VGG-16, ResNet-50, AlexNet and GNMT-16 (``gnmt_large.txt``: 8 + 8 LSTM layers) on the paper's
clusters A (4 servers x 4 V100, PCIe inside, 10 Gbit/s between) and B (2 x 8 V100, NVLink inside,
25 Gbit/s between), the planner (DP solver, 1F1B with weight stashing) is run under both cost models
(``paper``: the paper's formulas; ``pipedream``: PipeDream's released optimizer, reproduced;
``default``: ours, with ring all-reduce overlapped with the backward pass, optimizer step and the
memory limit) and its predicted speedup over data parallelism on all
16 workers is put beside the figure the paper reports (SOSP'19, Table 1). Beside it, the same cost
model's prediction for the *paper's own configuration shape* ("15-1": the best cut with the first
stage replicated 15 times; "straight": the best pipeline without replication; "16": data
parallelism), which separates "the planner chose another configuration" from "the cost model rates
the configurations differently". Every row more than 30% away from the paper gets a note, written
from the numbers.

Then GPT-2 small (the zoo's ``full`` GPT), traced and costed by our own passes, planned on Cluster A
at several per-worker minibatches.

Usage: python benchmarks/bench_paper_table.py [--no-gpt]   (prediction only; under a minute, 8 GB)
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402

from benchmarks._results import write_section  # noqa: E402
from pdcompile.cluster import ClusterSpec, flat_cluster, format_quantity, paper_cluster  # noqa: E402
from pdcompile.errors import PdcompileError  # noqa: E402
from pdcompile.ir import Chain  # noqa: E402
from pdcompile.passes.linearize import linearize  # noqa: E402
from pdcompile.passes.partition_dp import data_parallel_time, evaluate  # noqa: E402
from pdcompile.plan import Plan, plan  # noqa: E402
from pdcompile.profile import load  # noqa: E402

MODELS = [("VGG-16", "vgg16"), ("ResNet-50", "resnet50"), ("AlexNet", "alexnet"), ("GNMT-16", "gnmt_large")]
#: (model, cluster) -> (the paper's configuration, its reported speedup over data parallelism); SOSP'19 Table 1.
PAPER: dict[tuple[str, str], tuple[str, float]] = {
    ("VGG-16", "A"): ("15-1", 5.28),
    ("VGG-16", "B"): ("15-1", 2.98),
    ("AlexNet", "A"): ("15-1", 4.92),
    ("GNMT-16", "B"): ("straight", 3.14),
    ("ResNet-50", "A"): ("16", 1.0),
    ("ResNet-50", "B"): ("16", 1.0),
}
COST_MODELS = ("paper", "pipedream", "default")
THRESHOLD = 0.30


@dataclass(frozen=True)
class Row:
    """One (model, cluster, cost model) prediction and the numbers that explain it."""

    model: str
    cluster: str
    cost_model: str
    paper_config: str | None
    paper_speedup: float | None
    plan: Plan
    paper_shape_speedup: float | None  # this cost model's speedup for the paper's configuration shape
    paper_shape_config: str | None
    dp_s: float  # data parallelism, seconds per minibatch
    dp_compute_s: float  # its compute part: total compute / workers
    weights_bytes: float
    slow_bw: float  # the slowest level's bandwidth (bytes/s)
    no_memory_plan: Plan  # the same planner with the memory limit off

    @property
    def speedup(self) -> float:
        return self.plan.speedup_vs_data_parallel

    @property
    def off_by(self) -> float | None:
        """predicted / paper - 1."""
        return None if not self.paper_speedup else self.speedup / self.paper_speedup - 1


def _shape_speedup(chain: Chain, cluster: ClusterSpec, shape: str, cost_model: str,
                   dp_s: float) -> tuple[float, str]:
    """The cost model's best speedup with the paper's configuration shape, and that configuration."""
    n, W = len(chain), cluster.num_workers
    if shape == "16":
        return 1.0, str(W)
    if shape == "straight":
        p = plan(chain, cluster, cost_model=cost_model, schedule="1f1b", allow_replication=False)
        return dp_s / p.seconds_per_minibatch, f"{p.configuration} (straight, {len(p.stages)} stages)"
    # A stage over 3 3/4 servers does not nest in the cluster's levels, so the shape is evaluated on
    # a flat cluster of all workers at the slowest (between-server) bandwidth: the replicas' ring
    # and the traffic into the last stage cross servers anyway (pessimistic for the rest).
    first, second = (int(x) for x in shape.split("-"))
    flat = flat_cluster(W, min(lv.bandwidth for lv in cluster.levels), cluster.device.memory)
    best, where = math.inf, -1
    for k in range(1, n):  # the first stage is layers 0..k-1
        try:
            ev = evaluate(chain, flat, [(0, k - 1, first), (k, n - 1, second)], cost_model=cost_model,
                          schedule="1f1b", memory_limit=False)
        except PdcompileError:
            continue
        if ev.seconds < best:
            best, where = ev.seconds, k
    if where < 0:
        return math.nan, f"{shape} (no valid cut)"
    return dp_s / best, f"{shape}, first stage layers 0..{where - 1} of {n}, flat at the slowest link"


def collect() -> list[Row]:
    """Plan every (model, cluster, cost model)."""
    rows = []
    for label, fname in MODELS:
        chain = linearize(load(f"pipedream:{fname}"))
        for cname in ("A", "B"):
            cluster = paper_cluster(cname)
            paper_cfg, paper_x = PAPER.get((label, cname), (None, None))
            for cm in COST_MODELS:
                # the CLI's defaults with the DP: recomputation where memory needs it, pooled workers
                opts: dict[str, object] = {} if cm == "pipedream" else {"recompute": "auto", "pool": True}
                p = plan(chain, cluster, cost_model=cm, schedule="1f1b", **opts)
                dp = data_parallel_time(chain, cluster, cost_model=cm)
                shape_x, shape_cfg = (_shape_speedup(chain, cluster, paper_cfg, cm, dp) if paper_cfg
                                      else (None, None))
                rows.append(Row(label, cname, cm, paper_cfg, paper_x, p, shape_x, shape_cfg, dp,
                                sum(l.forward_s + l.backward_s for l in chain.layers) / cluster.num_workers,
                                sum(l.param_bytes for l in chain.layers),
                                min(lv.bandwidth for lv in cluster.levels),
                                p if cm != "default" else plan(chain, cluster, cost_model=cm, schedule="1f1b",
                                                               memory_limit=False, **opts)))
    return rows


def explain(r: Row) -> str:
    """Why the prediction differs from the paper's figure, from the row's own numbers."""
    parts = []
    dp_comm = max(0.0, 1 - r.dp_compute_s / r.dp_s) if r.dp_s > 0 else 0.0
    bw = format_quantity(r.slow_bw, "bandwidth")
    parts.append(f"under the `{r.cost_model}` model data parallelism takes {r.dp_s * 1e3:.1f} ms per minibatch, "
                 f"{dp_comm:.0%} of it weight synchronisation ({format_quantity(r.weights_bytes, 'memory')} of "
                 f"weights over {bw} between servers; compute alone {r.dp_compute_s * 1e3:.1f} ms)")
    parts.append(f"the planner's {r.plan.configuration} takes {r.plan.seconds_per_minibatch * 1e3:.1f} ms, "
                 f"limited by {r.plan.bottleneck}")
    if r.paper_shape_speedup is not None and r.paper_speedup:
        if r.plan.configuration == r.paper_config:
            verdict = (" — the planner chose the paper's configuration; the gap is how the model rates it "
                       "within the memory limit")
        elif abs(r.paper_shape_speedup / r.paper_speedup - 1) <= THRESHOLD:
            verdict = " — within 30% of the paper, so the gap is the configuration the planner chose"
            if r.paper_config not in ("16", "straight"):
                verdict += " (the shape is rated without the memory limit)"
        elif abs(r.paper_shape_speedup / r.speedup - 1) <= THRESHOLD:
            verdict = " — so the gap is the cost model, not the configuration"
        else:
            verdict = " — both the configuration and the cost model differ"
        parts.append(f"the paper's configuration, best of its shape {r.paper_shape_config}, is rated "
                     f"{r.paper_shape_speedup:.2f}x{verdict}")
    nomem = r.no_memory_plan.speedup_vs_data_parallel
    if r.no_memory_plan is not r.plan and abs(nomem / r.speedup - 1) > 0.1:
        mem = format_quantity(r.plan.memory_limit_bytes or 0, "memory")
        parts.append(f"the memory limit ({mem} per worker) rules out the faster {r.no_memory_plan.configuration} "
                     f"({nomem:.2f}x without the limit"
                     + (", within 30% of the paper" if abs(nomem / r.paper_speedup - 1) <= THRESHOLD else "")
                     + ")")  # type: ignore[operator]
    if r.speedup > r.paper_speedup:  # type: ignore[operator]
        if dp_comm > 0.5:
            how = {"paper": "without overlap (max of compute and communication, no concurrency across levels)",
                   "pipedream": "added to compute (a sum, 4 (m-1)/m of the weights per level)",
                   "default": "(overlapped only with the backward pass)"}[r.cost_model]
            parts.append("the model charges data parallelism its full all-reduce " + how
                         + ", at the link's nominal bandwidth; the paper's figure is measured, and real "
                           "pipelines also pay imbalance, stalls and their own communication that the "
                           "bottleneck formula hides")
        else:
            parts.append("the bottleneck formula assumes a perfectly steady pipeline; measured pipelines lose "
                         "time to imbalance and communication stalls")
    else:
        if r.cost_model == "default" and dp_comm < 0.5:
            parts.append("with the all-reduce overlapped with the backward pass data parallelism is nearly "
                         "compute-bound in this model, leaving a pipeline little to win")
        elif r.speedup <= 1.0 + 1e-9:
            parts.append("the planner finds no pipeline faster than data parallelism within its constraints")
    return "; ".join(parts) + "."


def _memory_cell(p: Plan) -> str:
    """The plan's largest stage memory, whether it fits a 16 GiB V100, and where it recomputes or pools."""
    peak = max(s.memory_bytes for s in p.stages)
    fits = "fits" if peak <= 16 * 2**30 * (1 + 1e-9) else "**over 16 GiB**"
    extra = [f"stage {s.index} recomputes {_recompute(s)}" for s in p.stages if s.recompute != "none"]
    if any(n.startswith("pooled:") for n in p.notes):
        extra.append("pooled (stages span servers)")
    return f"{format_quantity(peak, 'memory')} ({fits}{'; ' + ', '.join(extra) if extra else ''})"


def table(rows: list[Row]) -> str:
    head = ("| model | cluster | cost model | planner's configuration | predicted speedup | paper (config) | "
            "paper's shape under this model | no memory limit | predicted / paper | peak memory | bottleneck |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    notes = []
    for r in rows:
        paper = f"{r.paper_speedup:.2f}x ({r.paper_config})" if r.paper_speedup else "—"
        shape = f"{r.paper_shape_speedup:.2f}x" if r.paper_shape_speedup is not None else "—"
        ratio = f"{r.speedup / r.paper_speedup:.2f}" if r.paper_speedup else "—"
        flag = ""
        if r.off_by is not None and abs(r.off_by) > THRESHOLD:
            notes.append(r)
            flag = f" [{len(notes)}]"
        lines.append(f"| {r.model} | {r.cluster} | {r.cost_model} | {r.plan.configuration} | {r.speedup:.2f}x | "
                     f"{paper} | {shape} | "
                     f"{r.no_memory_plan.configuration}: {r.no_memory_plan.speedup_vs_data_parallel:.2f}x | "
                     f"{ratio}{flag} | {_memory_cell(r.plan)} | "
                     f"{r.plan.bottleneck} |")
    within = [r for r in rows if r.off_by is not None and abs(r.off_by) <= THRESHOLD]
    compared = [r for r in rows if r.off_by is not None]
    out = "\n".join(lines)
    out += (f"\n\n{len(within)} of {len(compared)} rows with a paper figure are within 30% of it ("
            + ", ".join(f"{sum(1 for r in within if r.cost_model == cm)} under `{cm}`" for cm in COST_MODELS)
            + ").\n")
    if notes:
        out += "\nNotes (rows more than 30% from the paper):\n\n"
        for i, r in enumerate(notes, 1):
            out += (f"{i}. {r.model} on {r.cluster}, `{r.cost_model}`: predicted {r.speedup:.2f}x vs the paper's "
                    f"{r.paper_speedup:.2f}x ({r.off_by:+.0%}): {explain(r)}\n")
    return out


def chain_batch_note(chain: Chain) -> str:
    """The images per minibatch PipeDream's VGG-16 profile implies: its input's bytes over one fp32
    224x224 RGB image (the file does not record a batch size)."""
    first = load("pipedream:vgg16").inputs[0].output_bytes
    return f"{first / (3 * 224 * 224 * 4):.0f} images per minibatch (its input's {first:.0f} B / one fp32 224x224 image)"


def vgg16_on_a(rows: list[Row]) -> str:
    """VGG-16 on Cluster A under each cost model against the paper's 15-1 and 5.28x, and what the
    paper's 15-1 costs in memory with and without recomputation (default model, pooled)."""
    chain = linearize(load("pipedream:vgg16"))
    cluster = paper_cluster("A")
    dp = data_parallel_time(chain, cluster, cost_model="default")
    out = ["\nVGG-16 on Cluster A (paper: 15-1, 5.28x):\n"]
    for r in rows:
        if (r.model, r.cluster) == ("VGG-16", "A"):
            out.append(f"- `{r.cost_model}`: {r.plan.configuration} at {r.speedup:.2f}x, {_memory_cell(r.plan)}")
    for rc in ("none", "full", "auto"):
        ev = min((evaluate(chain, cluster, [(0, k - 1, 15), (k, len(chain) - 1, 1)], recompute=rc, pool=True,
                           memory_limit=rc == "auto") for k in range(1, len(chain))),
                 key=lambda e: (rc == "auto" and e.peak_memory > 16 * 2**30, e.seconds))
        mem = ", ".join(f"stage {i} {format_quantity(sc.memory_bytes, 'memory')} ({sc.in_flight} in flight, "
                        f"{sc.weight_versions} versions" + (f", recomputes {_recompute(sc)}" if sc.recompute != "none"
                                                            else "") + ")" for i, sc in enumerate(ev.stages))
        what = "auto (the fewest first layers that fit 16 GiB)" if rc == "auto" else rc
        out.append(f"- the paper's 15-1 under `default`, pooled, recompute {what}: {dp / ev.seconds:.2f}x; {mem}")
    pooled_dp = evaluate(chain, cluster, [(0, len(chain) - 1, 16)], pool=True, memory_limit=False).seconds
    best = [r.plan for r in rows if (r.model, r.cluster, r.cost_model) == ("VGG-16", "A", "default")]
    if best:
        out.append(f"- the baseline: data parallelism as the hierarchy runs it, {dp * 1e3:.1f} ms per minibatch "
                   f"(`default` charges the all-reduce between servers once per server's minibatch, as the "
                   f"paper's T^k = max(A^(k-1), sync) / m does); the same data parallelism rated as one ring "
                   f"over the pooled 16 workers, each on its own 1.25 GB/s link (the rating every pooled plan "
                   f"gets, this 15-1 too), takes {pooled_dp * 1e3:.1f} ms: against that, the plan is "
                   f"{pooled_dp / best[0].seconds_per_minibatch:.2f}x (the paper measured 5.28x over its own "
                   f"data parallelism)")
    # what stage 0 of the best 15-1 keeps per microbatch: autograd's saved bytes as estimated from the
    # layer descriptions (profile.estimate_saved) against the old convention, every layer's output
    k = min(range(1, len(chain)), key=lambda k: evaluate(chain, cluster, [(0, k - 1, 15), (k, len(chain) - 1, 1)],
                                                          pool=True, memory_limit=False).seconds)
    saved = sum(l.saved_bytes or 0.0 for l in chain.layers[:k])
    outputs = sum(l.output_bytes for l in chain.layers[:k])
    top = max(chain.layers[:k], key=lambda l: l.saved_bytes or 0.0)
    out.append(f"- stage 0 of that 15-1 (layers 0..{k - 1}) keeps per microbatch "
               f"{format_quantity(saved, 'memory')} that autograd saves (estimated from the layer descriptions: "
               f"an in-place ReLU's output is its conv's storage, counted once; a max-pool adds its int64 "
               f"indices; `pdcompile.profile.estimate_saved`, checked against saved-tensor hooks in "
               f"tests/test_saved_estimate.py), against {format_quantity(outputs, 'memory')} counted as layer "
               f"outputs before; 1F1B keeps 2 microbatches in flight on each of its 15 replicas, so "
               f"{format_quantity(2 * saved, 'memory')} of activations alone (largest layer: {top.name} "
               f"{top.op} {format_quantity(top.saved_bytes or 0.0, 'memory')}); the profile is "
               f"at {chain_batch_note(chain)}; full recomputation keeps the inputs and charges the forward "
               f"again, the gap between the first two rows above; partial recomputation rebuilds only the "
               f"first layers, the largest activations (224x224) for the least forward time, enough to fit")
    return "\n".join(out) + "\n"


def _recompute(sc: object) -> str:
    mode, n = getattr(sc, "recompute"), getattr(sc, "recompute_layers")
    layers = getattr(sc, "last") - getattr(sc, "first") + 1
    return f"its first {n} of {layers} layers" if mode == "partial" else mode


GPT_BATCHES = (4, 8, 16, 32)


def gpt2_on_a() -> str:
    """GPT-2 small (``pdcompile.zoo.gpt`` ``full``: 12 layers, d=768, 1024 tokens, tied embedding,
    124M parameters) on Cluster A: traced and costed by our own passes (analytic costs: each node's
    FLOPs at the V100's fp32 peak, saved bytes from saved-tensor hooks) at one sample, then planned
    under `default` (memory limit, recompute auto, pooled) at each per-worker minibatch."""
    import torch

    from pdcompile.api import pdcompile
    from pdcompile.passes.partition_dp import partition_dp
    from pdcompile.zoo import gpt

    cfg = gpt.CONFIGS["full"]
    torch.manual_seed(0)
    (x,), y = gpt.make_batch(cfg, torch.device("cpu"), 0, 1)
    t0 = time.perf_counter()
    pipe = pdcompile(gpt.GPT(cfg), paper_cluster("A"), example_inputs=(x,), example_target=y,
                     loss_fn=gpt.SequenceCrossEntropy(), cost_mode="analytic", recompute="none")
    profile = pipe.state.profile
    traced = time.perf_counter() - t0
    out = ["\nGPT-2 small on Cluster A (`pdcompile.zoo.gpt` `full`, 124M parameters; traced and costed by our "
           f"passes at one sample in {traced:.0f} s, analytic costs at the V100's fp32 peak; fp32, so no bf16; "
           "`default`, memory limit 16 GiB, recompute auto, pooled; \"DP fits\": whether data parallelism itself "
           "fits 16 GiB):\n",
           "| samples per worker | configuration | speedup over data parallelism | DP fits | peak memory | "
           "recomputation | planning |", "|---|---|---|---|---|---|---|"]
    notes: list[str] = []
    for b in GPT_BATCHES:
        chain = linearize(profile.at_batch_size(b))
        t = time.perf_counter()
        p = partition_dp(chain, paper_cluster("A"), recompute="auto", pool=True)
        took = time.perf_counter() - t
        dp_fits = not any(n.startswith("data parallelism does not fit") for n in p.notes)
        rc = "; ".join(f"stage {s.index}: {s.recompute_text}" for s in p.stages if s.recompute != "none") or "none"
        out.append(f"| {b} | {p.configuration} | {p.speedup_vs_data_parallel:.2f}x | {'yes' if dp_fits else 'no'} | "
                   f"{format_quantity(max(s.memory_bytes for s in p.stages), 'memory')} | {rc} | {took:.2f} s |")
        if len(p.stages) == 1:
            dp_s = p.microbatch_size / p.data_parallel_samples_per_second
            notes.append(f"at {b} samples the plan is data parallelism itself as one ring over all 16 workers "
                         f"(pooled): {p.seconds_per_minibatch * 1e3:.1f} ms per minibatch against the "
                         f"{dp_s * 1e3:.1f} ms the model gives hierarchical data parallelism, the baseline "
                         f"(bottleneck: {p.bottleneck})")
    return "\n".join(out) + "\n" + "".join(f"\n- {n}" for n in notes) + ("\n" if notes else "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md alone")
    ap.add_argument("--no-gpt", action="store_true", help="leave out GPT-2 small on Cluster A (30 s, 8 GB to trace)")
    args = ap.parse_args(argv)
    load_avg = os.getloadavg()[0]
    t0 = time.perf_counter()
    rows = collect()
    rows_s = time.perf_counter() - t0
    body = ("Predicted speedup over data parallelism on all 16 workers, from PipeDream's own profiles "
            "(`pipedream:NAME`, shipped in `pdcompile/profiles/pipedream/`; GNMT-16 = `pipedream:gnmt_large`), planner = DP solver, schedule "
            "1F1B with weight stashing, memory limit as each cost model's default (on for `default`, off for "
            "`paper` and `pipedream`); for `default` and `paper` the CLI's DP defaults: `recompute=\"auto\"` "
            "(where memory needs it a stage recomputes, charged what it runs again: selective, its fewest first "
            "layers that fit, or its whole forward) and "
            "`pool=True` (also plan the 16 workers as one pool at the between-server link, so a stage may span "
            "servers without nesting, as the paper's 15-1; kept when strictly faster). `pipedream` is PipeDream's released optimizer (msr-fiddle/pipedream "
            "`optimizer_graph_hierarchical.py --activation_compression_ratio 1`) as `passes/partition_dp.py` "
            "reproduces it: on VGG-16 and AlexNet its times and speedups equal the released code's, run on these "
            "profiles (tests/test_partition_dp.py); on ResNet-50 and GNMT-16 the chain's cuts are not the released "
            "code's antichain states. Paper figures: SOSP'19 Table 1 (measured on the clusters; — where the paper's figure is "
            "not quoted here). \"Paper's shape\": this cost model's prediction for the best configuration of the "
            "paper's shape (15-1: first stage replicated 15x, best cut, evaluated on a flat 16-worker cluster at "
            "the between-server bandwidth because a stage over 3.75 servers does not nest in the hierarchy; "
            "straight: the planner without replication; both without the memory limit) against hierarchical "
            "data parallelism.\n\n")
    body += table(rows)
    body += vgg16_on_a(rows)
    if not args.no_gpt:
        body += gpt2_on_a()
    body += (f"\nPlanning all {len(rows)} rows of the first table took {rows_s:.1f} s (1-minute load average "
             f"{load_avg:.2f} at the start, on cores shared with other work; the predictions do not depend on it).\n")
    print(body)
    if not args.no_write:
        write_section("PipeDream's table, predicted (bench_paper_table)", body,
                      command="python benchmarks/bench_paper_table.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
