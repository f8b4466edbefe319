"""``schedule="auto"``: the schedule, its stages per rank and the number of microbatches, chosen by
simulating every synchronous schedule (the same training as single-process SGD) at every
microbatch count that divides the minibatch (:func:`~pdcompile.simulate.simulate_plan`): those
with a stage per rank on the plan, those with virtual stages on ``v p`` balanced stages over the
plan's ``p`` ranks; the fastest whose predicted peak memory fits a worker wins. The plan is flush's own
(``pdcompile()`` compiles flush first, with its step search choosing the count where it may), rated at its
compiled headline; a choice that compiles slower than it leaves flush's program (``api.py``), so auto is
never predicted slower than ``schedule="flush"``. Pure Python over plain data (no torch)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pdcompile.runtime.schedules import POLICIES

AUTO = "auto"


@dataclass(frozen=True)
class Candidate:
    """One schedule at one microbatch count, as the simulator predicts it."""

    schedule: str
    num_microbatches: int
    step_s: float  # one minibatch (an optimizer step)
    peak_memory_bytes: float  # the worst rank's (weights x versions + activations held, over its stages)
    fits: bool  # within the worker's memory (always, when the cluster does not say)
    virtual_stages: int = 1  # stages per rank


def split_every_backward_pays(device_name: str, split_backward: bool) -> bool:
    """Whether splitting every backward may pay: on accelerators where a split backward pays at all
    (``split_backward``). Not on CPU workers: there even the graph-level split (runtime/graph_split.py,
    1.00-1.07x an unsplit backward, its forward through the traced graph up to 1.08x eager's) leaves
    ZB-H1 at 0.92-1.08x flush's throughput, no 90% interval clearly above 1 over three launches,
    where the simulator predicts 1.02-1.06x (measured: benchmarks/RESULTS.md, bench_zero_bubble)."""
    return split_backward and device_name != "cpu"


def auto_schedules(split_every: bool, virtual: bool = False) -> list[str]:
    """The schedules ``auto`` considers: the synchronous ones with a stage per rank (``virtual``:
    those with several); those that split backwards (every one, or where their order says) only
    when that may pay (``split_every``: :func:`split_every_backward_pays`)."""
    return [n for n, p in POLICIES.items()
            if p.synchronous and p.virtual_stages == virtual and n in AUTO_NAMES
            and (split_every or not (p.splits_every_backward or p.order_splits))]


AUTO_NAMES = frozenset(POLICIES)  # the built-in schedules (a registered torch CSV is never auto's)


def virtual_stages_pay(device_name: str) -> bool:
    """Whether schedules with several stages per rank may pay: not on CPU workers, where their extra
    transfers progress only while the sender waits too (gloo over loopback), which the simulator
    does not model, so it predicts them 15-33% too fast (measured: benchmarks/RESULTS.md,
    bench_predicted_vs_measured; in bench_vs_pipelining they ran at 0.6-0.8x flush's throughput)."""
    return device_name != "cpu"


VIRTUAL_STAGES = (2,)  # stages per rank auto tries for the schedules with virtual stages


def microbatch_counts(minibatch: int, fixed: int | None = None, most: int = 64) -> list[int]:
    """Every ``M`` dividing ``minibatch`` (at most ``most``), or just ``fixed`` when the user set it."""
    if fixed is not None:
        return [fixed]
    return [m for m in range(1, min(minibatch, most) + 1) if minibatch % m == 0]


def candidates(plan: Any, chain: Any, cluster: Any, minibatch: int, schedules: Sequence[str],
               counts: Sequence[int], recompute: str = "none", **simulate_kw: Any) -> list[Candidate]:
    """Every schedule in ``schedules`` at every count in ``counts``, simulated on ``plan`` (its
    microbatch size set to ``minibatch // M``); ``simulate_kw`` goes to ``simulate_plan``. With
    ``recompute="auto"`` and a device memory, each candidate's stages recompute what that schedule
    and microbatch size need to fit (``simulate_plan``'s ``refit_recompute``), charged in its time."""
    from pdcompile.simulate import simulate_plan

    limit = cluster.device.memory
    if recompute == "auto" and limit:
        simulate_kw = {**simulate_kw, "refit_recompute": float(limit)}
    out = []
    for name in schedules:
        for m in counts:
            res = simulate_plan(dataclasses.replace(plan, microbatch_size=minibatch // m), chain, cluster, name, m,
                                **simulate_kw)
            peak = max(res.peak_memory_bytes or [0.0])
            out.append(Candidate(name, m, float(res.step_time_s), float(peak), limit is None or peak <= limit))
    return out


def virtual_candidates(chain: Any, cluster: Any, ranks: int, minibatch: int, schedules: Sequence[str],
                       counts: Sequence[int], vs: Sequence[int] = VIRTUAL_STAGES,
                       **simulate_kw: Any) -> list[Candidate]:
    """Every schedule with virtual stages at every ``v`` in ``vs`` and count in ``counts``: ``v *
    ranks`` stages of balanced compute (:func:`pdcompile.passes.partition.virtual_plan`) simulated
    on the cluster's first ``ranks`` workers. A rank's memory is its stages' sum. Shapes a
    schedule cannot run (too few layers, ``M`` it does not take) are left out."""
    from pdcompile.errors import UsageError
    from pdcompile.passes.partition import virtual_plan
    from pdcompile.simulate import simulate_plan

    limit = cluster.device.memory
    out = []
    cut: dict[int, Any] = {}  # v -> the balanced stages (one cut per v; each schedule places them its way)
    for name in schedules:
        for v in vs:
            if v * ranks > len(chain.layers) or ranks < 2:
                continue
            try:
                place = POLICIES[name].placement
                assert place is not None
                if v not in cut:
                    cut[v] = virtual_plan(chain, cluster, name, v, v * ranks)[0]
                plan = dataclasses.replace(cut[v], stages=tuple(
                    dataclasses.replace(st, ranks=tuple(r)) for st, r in zip(cut[v].stages, place(v * ranks, v))))
            except UsageError:
                continue
            for m in counts:
                try:
                    res = simulate_plan(dataclasses.replace(plan, microbatch_size=minibatch // m), chain, cluster,
                                        name, m, virtual_stages=v, **simulate_kw)
                except UsageError:
                    continue
                per_rank: dict[int, float] = {}
                for st, mem in zip(plan.stages, res.peak_memory_bytes or []):
                    per_rank[st.ranks[0]] = per_rank.get(st.ranks[0], 0.0) + mem
                peak = max(per_rank.values(), default=0.0)
                out.append(Candidate(name, m, float(res.step_time_s), float(peak), limit is None or peak <= limit, v))
    return out


def best(cands: Sequence[Candidate]) -> Candidate:
    """The fastest that fits (ties: less memory, fewer microbatches, the registry's order); if
    none fits, the one needing the least memory."""
    order = {n: i for i, n in enumerate(POLICIES)}
    fitting = [c for c in cands if c.fits]
    if not fitting:
        return min(cands, key=lambda c: (c.peak_memory_bytes, c.step_s))
    # step times equal to 9 digits tie (floating-point sums in another order)
    return min(fitting, key=lambda c: (float(f"{c.step_s:.9g}"), c.peak_memory_bytes, c.num_microbatches,
                                       order.get(c.schedule, len(order))))


def best_per_schedule(cands: Sequence[Candidate]) -> dict[str, Candidate]:
    """Each schedule's best candidate (by :func:`best` among its own)."""
    names = list(dict.fromkeys(c.schedule for c in cands))
    return {n: best([c for c in cands if c.schedule == n]) for n in names}


def format_choice(cands: Sequence[Candidate], chosen: Candidate, skipped: Sequence[str] = ()) -> str:
    """The lines ``explain()`` shows: each schedule's best plan with its predicted time and memory;
    ``skipped``: notes (schedules left out and why)."""
    lines = [f"schedule (auto): {chosen.schedule} with {chosen.num_microbatches} microbatches, the fastest "
             f"synchronous schedule whose predicted memory fits; each schedule's best:"]
    for name, c in best_per_schedule(cands).items():
        mark = "*" if c == chosen else " "
        v = f" v={c.virtual_stages}" if c.virtual_stages > 1 else ""
        lines.append(f" {mark} {name + v:<20} M={c.num_microbatches:<3} {c.step_s:.4g} s per minibatch "
                     f"({c.step_s / chosen.step_s:.2f}x)  peak {c.peak_memory_bytes / 2**20:.1f} MiB"
                     f"{'' if c.fits else '  (does not fit)'}")
    lines += [f"   {note}" for note in skipped]
    return "\n".join(lines)
