"""Benchmark: how far measured per-node costs can be trusted, and PipeDream's profiles imported.

1. For every zoo model (small config): profile it twice in measured mode and compare each heavy
   node's forward+backward time (nodes above 1% of the total; target: within 20%); and compare the
   sum of per-node forward+backward times with the measured time of a whole training step
   (forward, loss, backward; median of many steps; target: within 25%).
2. For each of the fourteen PipeDream profiles: layers, totals (checked against the file's own
   numbers, summed straight from the text) and the linearized chain's widest cut.

Usage: python benchmarks/bench_profile.py [--batch-size 32] [--repeats 15] [--steps 30]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from benchmarks._results import write_section  # noqa: E402
from pdcompile.passes.annotate_costs import profile_model  # noqa: E402
from pdcompile.profiler_check import cross_check_model, summary  # noqa: E402
from pdcompile.passes.linearize import linearize, order_layers  # noqa: E402
from pdcompile.profile import PIPEDREAM_DIR, load  # noqa: E402
from pdcompile.zoo import get, names  # noqa: E402

PIPEDREAM = PIPEDREAM_DIR  # PipeDream's fourteen profiles, shipped in the package (pipedream:NAME)


def robust(times: list[float], visits: int = 3) -> float:
    """The estimator the profile uses (``_visit_medians``): the smallest median of ``visits``
    consecutive runs of samples, so a burst of load covering one run doesn't count (here it is
    applied to a whole step, so both sides of the comparison are measured alike)."""
    n = max(1, len(times) // visits)
    return min(statistics.median(times[i:i + n]) for i in range(0, n * visits, n))


def step_time_samples(z, steps: int) -> list[float]:
    """``steps`` wall times of forward + loss + backward on the example batch (after 5 untimed)."""
    model, inputs, target, loss_fn = z.model, z.example_inputs, z.target, z.loss_fn
    times = []
    for k in range(steps + 5):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        loss = loss_fn(model(*inputs), target)
        loss.backward()
        dt = time.perf_counter() - t0
        if k >= 5:
            times.append(dt)
    model.zero_grad(set_to_none=True)
    return times


def loss_time(z, repeats: int) -> float:
    """Seconds of the loss's forward + backward on the model's output (:func:`robust`; a step computes it;
    the traced graph, and so the profile, ends at the model's output)."""
    with torch.no_grad():
        out = z.model(*z.example_inputs)
    times = []
    for k in range(repeats + 3):
        x = out.detach().requires_grad_(True)
        t0 = time.perf_counter()
        z.loss_fn(x, z.target).backward()
        if k >= 3:
            times.append(time.perf_counter() - t0)
    return robust(times)


def trust_rows(batch_size: int, repeats: int, steps: int) -> list[str]:
    rows = [
        "| model | nodes | heavy nodes (>1%) | heavy within 20% | max heavy diff | "
        "sum fwd+bwd (ms) | + loss (ms) | step (ms) | (sum + loss) / step | within 25% | "
        "torch.profiler: sum ours / theirs | heavy within 25% of torch.profiler |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in names():
        z = get(name, size="small", batch_size=batch_size)
        kw = dict(mode="measured", leaf_modules=z.leaf_modules, repeats=repeats, warmup=3,
                  symbolic=False, progress=False)
        # the whole step is timed in three visits spread over the profiling, as the nodes are
        visits = [step_time_samples(z, steps // 3 or 1)]
        a = profile_model(z.model, z.example_inputs, **kw)
        visits.append(step_time_samples(z, steps // 3 or 1))
        b = profile_model(z.model, z.example_inputs, **kw)
        visits.append(step_time_samples(z, steps // 3 or 1))
        total = a.compute_s
        heavy = [l for l in a.layers if l.compute_s > 0.01 * total]
        diffs = [abs(l.compute_s - b.layer(l.name).compute_s) / l.compute_s for l in heavy]
        within = sum(d <= 0.20 for d in diffs)
        step = min(statistics.median(v) for v in visits)
        loss = loss_time(z, steps)
        ratio = (total + loss) / step
        check = summary(cross_check_model(z.model, z.example_inputs, a, leaf_modules=z.leaf_modules,
                                          loss_fn=z.loss_fn, target=z.target))
        rows.append(
            f"| {name} | {len(a.layers)} | {len(heavy)} | {within}/{len(heavy)} | "
            f"{max(diffs, default=0.0):.1%} | {total * 1e3:.3f} | {loss * 1e3:.3f} | {step * 1e3:.3f} | "
            f"{ratio:.2f} | {'yes' if abs(ratio - 1) <= 0.25 else 'no'} | {check['ratio']:.2f} | "
            f"{check['heavy_within']}/{check['heavy']} |"
        )
        print(rows[-1], flush=True)
    return rows


def file_totals(path: Path) -> tuple[float, float]:
    """(fwd+bwd seconds over non-input nodes, parameter bytes), straight from the text."""
    comp = params = 0.0
    for line in path.read_text().splitlines():
        m = re.match(r"node\S+ -- (.*) -- forward_compute_time=([\d.]+), "
                     r"backward_compute_time=([\d.]+),.*parameter_size=([\d.]+)", line)
        if m and not re.fullmatch(r"Input\d*", m.group(1)):
            comp += (float(m.group(2)) + float(m.group(3))) / 1e3
            params += float(m.group(4))
    return comp, params


def pipedream_rows() -> list[str]:
    rows = [
        "| profile | layers | inputs | fwd+bwd (ms) | = file | params (MB) | = file | "
        "widest cut (MB) | in profile order (MB) | rule | linearize (ms) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for path in sorted(PIPEDREAM.glob("*.txt")):
        prof = load(path)
        comp, params = file_totals(path)
        t0 = time.perf_counter()
        chain = linearize(prof)
        dt = time.perf_counter() - t0
        _, _, rule = order_layers(prof)
        plain = linearize(prof, rule="profile")
        ok_t = "yes" if abs(prof.compute_s - comp) <= 1e-9 * max(comp, 1) else "NO"
        ok_p = "yes" if prof.param_bytes == params else "NO"
        rows.append(
            f"| {path.stem} | {len(chain)} | {len(prof.inputs)} | {prof.compute_s * 1e3:.3f} | "
            f"{ok_t} | {prof.param_bytes / 1e6:.2f} | {ok_p} | {chain.widest_cut / 1e6:.2f} | "
            f"{plain.widest_cut / 1e6:.2f} | {rule} | {dt * 1e3:.1f} |"
        )
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: least noise)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    trust = trust_rows(args.batch_size, args.repeats, args.steps)
    body = (
        f"Zoo models, small config, batch {args.batch_size}, CPU, {args.threads} thread(s); "
        f"per node {args.repeats} samples in 3 warm visits, the smallest visit median; step = forward + loss "
        f"+ backward, {args.steps} steps in 3 visits (before, between and after the two profiles), the smallest "
        f"visit median (the same estimator). Targets: heavy nodes of two profiles within 20%; per-node sum within 25% "
        f"of the step. The step computes the loss, which the traced graph (so the profile) does not "
        f"hold: it is measured alone and added. Each node's backward is measured as its own "
        f"`autograd.grad` call less that call's fixed cost (measured once; a step pays it once). "
        f"Cross-check: the same nodes timed inside one whole step by `torch.profiler` "
        f"(`pdcompile.profiler_check`: forward = the operators in the node's `record_function` range, "
        f"backward = the autograd functions with their sequence numbers; the profiler's own per-operator "
        f"overhead inflates small nodes).\n\n"
        + "\n".join(trust)
    )
    write_section("Measured-cost trust (bench_profile)", body)

    pd = pipedream_rows()
    body = (
        "The fourteen PipeDream graph.txt profiles imported. Totals exclude the InputN nodes "
        "(data loading; PipeDream's optimizer zeroes them) and are compared with sums taken "
        "straight from the file text. Widest cut: bytes live across the widest cut of the "
        "linearized chain (model inputs included), against the profile's own topological "
        "order.\n\n" + "\n".join(pd)
    )
    write_section("PipeDream profile import (bench_profile)", body)


if __name__ == "__main__":
    main()
