"""PTD-P's Table 1 against our analytic model and our planner (issue 35 item 5).

    python benchmarks/bench_ptdp_table.py                 # every row; RESULTS.md "PTD-P Table 1"
    python benchmarks/bench_ptdp_table.py --rows 0-3      # some rows
    python benchmarks/bench_ptdp_table.py --quick         # the first two rows, no planner, prints only

Source: Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", SC'21 (arXiv 2104.04473), Table 1 (weak scaling of GPT models, 1.7B to 1T; the same table
is in NVIDIA/Megatron-LM's README): hidden size, heads, layers, tensor- and pipeline-parallel sizes, GPUs,
batch size and achieved teraFLOP/s per GPU. Every model has vocabulary 51,200 and sequence 2,048, trains
in mixed precision with full activation recomputation on A100 80 GB servers of 8 (NVLink and NVSwitch, 8 x
200 Gbit/s InfiniBand), and the paper counts ``96 B s l h^2 (1 + s/(6h) + V/(16 l h))`` FLOPs per step.

For each row: our model's prediction at the paper's (t, p, d) -- one pipeline of ``p`` stages of ``t``-GPU
groups (``passes/planner/tensor.py``'s rule), ``M = B / (d b)`` microbatches of ``b``, PipeDream-Flush
(our ``flush``) simulated with full recomputation (``pdcompile.simulate``), plus the data-parallel
all-reduce of the largest stage's fp32 gradients over InfiniBand after the step (a ring, not overlapped, as
in the paper's runs); then what our planner chooses for the same model, GPU count and batch
(``tensor_parallel="auto"``, the step search of ``pdcompile.plan``, which also cuts the minibatch into any count
of microbatches: ``choose_microbatches``) and its predicted throughput, against the paper's configuration rated by
the same ``simulate()`` (:func:`paper_config_as_planned`).

The chain is analytic (no model is built): per transformer layer a forward of ``24 b s h^2 + 4 b s^2 h``
GEMM FLOPs at 80% of 312 TFLOP/s (``--gemm-efficiency``: what cuBLAS reaches on large bf16 GEMMs on
an A100; the roofline's generic default, 0.5, caps any prediction at 156, below the paper's best rows),
plus its elementwise traffic as Megatron fuses it (norms, bias-dropout-adds whole; bias-GeLU, scale-mask-
softmax and attention dropout split) at 70% of 2,039 GB/s (the roofline's default), plus the op-class
fixed costs (``passes/costs/opclass.py``'s GPU defaults); a backward twice the work. Where our model differs from theirs: the embedding and LM head
stay whole (Megatron splits them over the vocabulary); the interleaved schedule and the scatter/gather of
boundary tensors are not modelled (boundaries send whole activations); kernel efficiency is one constant,
not measured per GEMM shape; the gradient all-reduce is charged once per step, not overlapped.
Microbatch size (not in the table): 1 where ``p > 1``, else 2 (our full recomputation rebuilds a stage's
forward at once, Megatron's a layer at a time: with 8 the one-stage rows would not fit 80 GB in our model).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._results import publish  # noqa: E402
from pdcompile.cluster import ClusterSpec, Device, Level  # noqa: E402
from pdcompile.ir import Chain, ChainLayer  # noqa: E402

GiB = 2.0**30
V, S = 51200, 2048
PEAK, BW = 312e12, 2.039e12  # A100 bf16 dense, HBM2e
GEMM_EFF, BW_EFF = 0.8, 0.7  # large bf16 GEMMs on A100 (cuBLAS: ~80% of peak); roofline's elementwise default
EFF = GEMM_EFF
MATMUL_ALPHA, ELEMENTWISE_ALPHA, BACKWARD_ALPHA = 10e-6, 8e-6, 1.5  # opclass.DEFAULT_ALPHA_S["gpu"]
NVLINK, IB = 300e9, 200e9 / 8  # per direction: 600 GB/s bidirectional per GPU; 200 Gbit/s per GPU
ADAM_MIXED = 6.0  # optimizer bytes per bf16 weight byte: fp32 master, m and v (12 B per 2 B weight)


@dataclass(frozen=True)
class Row:
    params_b: float
    heads: int
    hidden: int
    layers: int
    t: int
    p: int
    gpus: int
    batch: int
    tflops: float  # achieved per GPU, the paper's


TABLE = (  # arXiv 2104.04473 Table 1
    Row(1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    Row(3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    Row(7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    Row(18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    Row(39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    Row(76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    Row(145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    Row(310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    Row(529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    Row(1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
)


def cluster(gpus: int) -> ClusterSpec:
    """A100 80 GB servers of 8: NVLink inside, 8 x 200 Gbit/s InfiniBand (one per GPU) between."""
    dev = Device("A100-80GB", memory=80 * GiB, peak_flops=PEAK, memory_bandwidth=BW, peak_flops_bf16=PEAK)
    levels = [Level("gpus-in-server", min(8, gpus), NVLINK)]
    if gpus > 8:
        levels.append(Level("servers", gpus // 8, IB))
    return ClusterSpec(dev, tuple(levels))


def _time(flops: float, nbytes: float, matmuls: int, elementwise: int, backward: bool) -> tuple[float, float]:
    """(seconds, fixed part) of a pass: roofline parts added (GEMMs and elementwise kernels run one after
    another), plus the fixed cost per kernel."""
    k = 2.0 if backward else 1.0
    fixed = (matmuls * MATMUL_ALPHA + elementwise * ELEMENTWISE_ALPHA) * (BACKWARD_ALPHA if backward else 1.0)
    return k * flops / (PEAK * EFF) + k * nbytes / (BW * BW_EFF) + fixed, fixed


def gpt_chain(row: Row, b: int) -> Chain:
    """The row's GPT as a chain at microbatch ``b``: embedding, ``l`` transformer layers, final norm + LM head."""
    h, a, l = row.hidden, row.heads, row.layers
    act = 2.0 * b * S * h  # one bf16 activation [b, s, h]
    gemm = 24.0 * b * S * h * h + 4.0 * b * S * S * h
    whole_bytes = 6 * 2 * act  # 2 norms, 2 residual adds, 2 dropouts: read + write
    # GeLU on 4h (fused with its bias); on the scores: fused scale-mask-softmax (read + write, 2 B each) and
    # dropout (read, write, a 1 B mask): 9 B per score
    split_bytes = 2 * 4 * act + 9.0 * b * a * S * S
    f, ff = _time(gemm, whole_bytes + split_bytes, 8, 9, False)
    bw, bf = _time(gemm, whole_bytes + split_bytes, 8, 9, True)
    share = (gemm / (PEAK * EFF) + split_bytes / (BW * BW_EFF) + 8 * MATMUL_ALPHA + 3 * ELEMENTWISE_ALPHA) / \
        (gemm / (PEAK * EFF) + (whole_bytes + split_bytes) / (BW * BW_EFF) + 8 * MATMUL_ALPHA + 9 * ELEMENTWISE_ALPHA)
    params = 2.0 * (12 * h * h + 13 * h)
    saved_units = 34 + 5 * a * S / h  # Megatron's s b h (34 + 5 a s / h) bytes per layer, of which 10 whole
    block = [ChainLayer(f"layer{i}", "transformer", f, bw, act, params, saved_bytes=b * S * h * saved_units,
                        forward_fixed_s=ff, backward_fixed_s=bf, tp_share=share, tp_param_share=24 * h * h / params,
                        tp_saved_share=(saved_units - 10) / saved_units, tp_allreduce_bytes=2 * act, tp_allreduces=2,
                        tp_divisor=math.gcd(a, h)) for i in range(l)]
    emb = ChainLayer("embedding", "embedding", 2 * act / (BW * BW_EFF) + ELEMENTWISE_ALPHA,
                     2 * act / (BW * BW_EFF) + ELEMENTWISE_ALPHA, act, 2.0 * (V + S) * h, saved_bytes=act)
    hf, hff = _time(2.0 * b * S * h * V, 2 * act + 2 * 2.0 * b * S * V, 1, 3, False)
    hb, hbf = _time(2.0 * b * S * h * V, 2 * act + 2 * 2.0 * b * S * V, 1, 3, True)
    head = ChainLayer("lm_head", "linear", hf, hb, 4.0 * b, 0.0, saved_bytes=act + 4.0 * b * S * V,
                      forward_fixed_s=hff, backward_fixed_s=hbf)  # its weight is the embedding's (tied)
    layers = (emb, *block, head)
    return Chain(layers, tuple(l.output_bytes for l in layers[:-1]), batch_size=b, name=f"GPT-{row.params_b}B")


def model_flops(row: Row) -> float:
    """The paper's FLOPs per step (with recomputation)."""
    h, l = row.hidden, row.layers
    return 96.0 * row.batch * S * l * h * h * (1 + S / (6 * h) + V / (16 * l * h))


def microbatch(row: Row) -> int:
    d = row.gpus // (row.t * row.p)
    return 1 if row.p > 1 else min(2, row.batch // d)


def predict_paper_config(row: Row) -> dict[str, Any]:
    """Our model's step at the paper's (t, p, d): one pipeline simulated, plus the gradient all-reduce."""
    from pdcompile.passes.partition import balanced_bounds
    from pdcompile.passes.partition_dp import plan_from_assignment
    from pdcompile.passes.planner import tensor
    from pdcompile.simulate import simulate_plan

    b = microbatch(row)
    d = row.gpus // (row.t * row.p)
    m = row.batch // (d * b)
    full = cluster(row.gpus)
    chain = gpt_chain(row, b)
    chain_t, groups = tensor.view(chain, full, row.t)
    pipe = groups.first_workers(row.p)
    assert pipe is not None
    bounds = [0, *balanced_bounds(chain_t, row.p), len(chain_t)] if row.p > 1 else [0, len(chain_t)]
    stages = [(x, y - 1, 1, (k,)) for k, (x, y) in enumerate(zip(bounds, bounds[1:]))]
    plan = plan_from_assignment(chain_t, pipe, stages, schedule="flush", recompute="full", memory_limit=False,
                                optimizer_state_factor=ADAM_MIXED, num_microbatches=m)
    sim = simulate_plan(plan, chain_t, pipe, "flush", m, split_backward=False, optimizer_state_factor=ADAM_MIXED,
                        timeline=False)
    grads = max(sum(l.param_bytes for l in chain_t.layers[st.first:st.last + 1]) for st in plan.stages) * 2  # fp32
    ar = tensor.allreduce_s(grads, d, IB, 1, 0.0) if d > 1 else 0.0
    step = float(sim.step_time_s) + ar
    peak = max(map(float, sim.peak_memory_bytes or [0.0]))
    return {"step": step, "tflops": model_flops(row) / step / row.gpus / 1e12, "ar": ar, "m": m, "b": b,
            "memory": peak}


def paper_config_as_planned(row: Row) -> dict[str, Any]:
    """The paper's (t, p, d, M) rated as the planner's step search rates its own candidates: ``d`` copies of a
    pipeline of ``p`` balanced stages on ``t``-GPU groups (each stage's ``d`` replicas side by side or on
    consecutive groups, the faster), ``B / b`` microbatches of ``b``, the flush step simulated on the groups with
    the gradient all-reduce of each stage's replicas inside it and each stage's optimizer step at the device's
    streamed bandwidth (``update_bandwidth_of``, as ``plan_step`` rates its candidates), a drain's backward
    split only where ``t = 1`` (``tensor.split_backward``): the figure the planner's choice is compared with."""
    from pdcompile.errors import UsageError
    from pdcompile.passes.partition import balanced_bounds
    from pdcompile.passes.partition_dp import plan_from_assignment
    from pdcompile.passes.planner import tensor
    from pdcompile.simulate import simulate_plan, update_bandwidth_of

    b = microbatch(row)
    d = row.gpus // (row.t * row.p)
    m = row.batch // b
    chain_t, groups = tensor.view(gpt_chain(row, b), cluster(row.gpus), row.t)
    bounds = [0, *balanced_bounds(chain_t, row.p), len(chain_t)] if row.p > 1 else [0, len(chain_t)]
    spans = list(zip(bounds, bounds[1:]))
    side = [(x, y - 1, d, tuple(k + j * row.p for j in range(d))) for k, (x, y) in enumerate(spans)]
    grouped = [(x, y - 1, d, tuple(range(k * d, (k + 1) * d))) for k, (x, y) in enumerate(spans)]
    split = tensor.split_backward(row.t)
    best: dict[str, Any] = {}
    for assignment in (side, grouped):
        for pool in (False, True):
            try:
                plan = plan_from_assignment(chain_t, groups, assignment, schedule="flush", recompute="full",
                                            optimizer_state_factor=ADAM_MIXED, num_microbatches=m, pool=pool)
            except UsageError:
                continue
            sim = simulate_plan(plan, chain_t, groups, "flush", m, split_backward=True if split is None else split,
                                optimizer_state_factor=ADAM_MIXED, update_bandwidth=update_bandwidth_of(groups),
                                timeline=False)
            step = float(sim.step_time_s)
            if not best or step < best["step"]:
                best = {"step": step, "tflops": model_flops(row) / step / row.gpus / 1e12, "sim": sim,
                        "memory": max(map(float, sim.peak_memory_bytes or [0.0]))}
            break
    return best


def planner_choice(row: Row) -> dict[str, Any]:
    """What the planner chooses for the row's model, GPUs and batch (the paper's microbatch size given; the
    step search may cut the minibatch into any count), and its figure replayed as ``simulate()`` does."""
    from pdcompile.passes.planner import tensor
    from pdcompile.plan import plan
    from pdcompile.simulate import simulate_plan, update_bandwidth_of

    b = microbatch(row)
    t0, c0 = time.perf_counter(), time.process_time()
    p = plan(gpt_chain(row, b), cluster(row.gpus), schedule="flush", num_microbatches=row.batch // b,
             recompute="full", optimizer_state_factor=ADAM_MIXED, tensor_parallel="auto", choose_microbatches=True)
    took, cpu = time.perf_counter() - t0, time.process_time() - c0
    t = p.stages[0].tensor_parallel
    chain_t, groups = tensor.view(gpt_chain(row, b), cluster(row.gpus), t)  # at b, scaled as the search scales it
    split = tensor.split_backward(t)
    sim = simulate_plan(p, chain_t.at_batch(p.microbatch_size), groups, "flush", p.num_microbatches,
                        split_backward=True if split is None else split, optimizer_state_factor=ADAM_MIXED,
                        update_bandwidth=update_bandwidth_of(groups), timeline=False)
    reps = sorted({st.replicas for st in p.stages})
    return {"step": p.seconds_per_minibatch, "tflops": model_flops(row) / p.seconds_per_minibatch / row.gpus / 1e12,
            "t": t, "stages": len(p.stages), "replicas": "/".join(map(str, reps)), "seconds": took, "cpu": cpu,
            "used": p.workers_used, "m": p.num_microbatches, "b": p.microbatch_size, "sim": sim,
            "note": next((n for n in p.notes if n.startswith("tensor parallelism")), "")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default=None, help="rows to run, e.g. 0-3 or 0,4 (default: all)")
    ap.add_argument("--no-planner", action="store_true", help="only the prediction at the paper's configuration")
    ap.add_argument("--quick", action="store_true", help="rows 0-1, no planner, nothing written")
    ap.add_argument("--section", default=None, help="the RESULTS.md section to write (default: the table's own)")
    ap.add_argument("--gemm-efficiency", type=float, default=GEMM_EFF, help="fraction of peak a GEMM reaches")
    args = ap.parse_args(argv)
    global EFF
    EFF = args.gemm_efficiency
    picked = list(range(len(TABLE)))
    if args.quick:
        picked, args.no_planner = [0, 1], True
    elif args.rows:
        picked = []
        for part in args.rows.split(","):
            lo, _, hi = part.partition("-")
            picked += list(range(int(lo), int(hi or lo) + 1))
    lines = ["| model | t | p | d | GPUs | batch | b x M | paper TFLOP/s | ours at theirs | diff | theirs, as the "
             "search rates it | planner: t, stages, replicas (GPUs, b x M) | planner TFLOP/s | vs theirs | planned in "
             "(CPU) |", "|" + "---|" * 15]
    misses, slower = [], []
    for i in picked:
        row = TABLE[i]
        ours = predict_paper_config(row)
        diff = ours["tflops"] / row.tflops - 1
        if abs(diff) > 0.2:
            misses.append(f"{row.params_b}B: {diff:+.0%}")
        cells = [f"{row.params_b}B", str(row.t), str(row.p), str(row.gpus // (row.t * row.p)), str(row.gpus),
                 str(row.batch), f"{ours['b']} x {ours['m']}", f"{row.tflops:.0f}", f"{ours['tflops']:.1f}",
                 f"{diff:+.1%}"]
        theirs = paper_config_as_planned(row)
        cells.append(f"{theirs['tflops']:.1f}")
        if args.no_planner:
            cells += ["-", "-", "-", "-"]
        else:
            pc = planner_choice(row)
            ratio = theirs["step"] / pc["step"]
            if ratio < 1 - 1e-9:
                slower.append(f"{row.params_b}B: {ratio:.3f}x")
            cells += [f"{pc['t']}, {pc['stages']}, {pc['replicas']} ({pc['used']} GPUs, {pc['b']} x {pc['m']})",
                      f"{pc['tflops']:.1f}", f"{ratio:.3f}x", f"{pc['seconds']:.1f} s ({pc['cpu']:.1f} s)"]
            for name, got in (("theirs", theirs), ("planner", pc)):  # the step's breakdown (stdout only)
                print(f"  {row.params_b}B {name}: " + got["sim"].summary().splitlines()[0], flush=True)
            print(f"  {row.params_b}B planner: {pc['note']}", flush=True)
        lines.append("| " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    load = os.getloadavg()
    body = "\n".join([
        "PTD-P (arXiv 2104.04473) Table 1 against our analytic model (docstring: the chain, the cluster, where the "
        "models differ). `ours at theirs`: our prediction at the paper's (t, p, d) and microbatch (one pipeline "
        "simulated plus the fp32 gradient all-reduce over InfiniBand); `theirs, as the search rates it`: the same "
        "configuration rated as the planner's step search rates its candidates (its d copies simulated together, "
        "each stage's bf16 gradient all-reduce and optimizer step in the step, backwards split only at t = 1); `planner`: what "
        "`tensor_parallel=\"auto\"` with the flush step search (any microbatch count) chooses for the same GPUs and "
        "batch; `vs theirs`: the paper's configuration's step over the planner's, both by that same simulate().",
        "",
        *lines,
        "",
        f"Rows off by more than 20%: {', '.join(misses) if misses else 'none'}.",
        *([] if args.no_planner else [f"Rows where the planner's choice is predicted slower than the paper's configuration "
                                      f"(same simulate()): {', '.join(slower) if slower else 'none'}."]),
        f"Load average: {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}.",
    ])
    name = "PTD-P Table 1: our model at the paper's configurations" if args.no_planner else \
        "PTD-P Table 1: our model and the planner's choice"
    publish(args.section or name, body, "python " + " ".join(
        ["benchmarks/bench_ptdp_table.py", *(argv if argv is not None else sys.argv[1:])]), write=not args.quick)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
