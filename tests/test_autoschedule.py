"""``schedule="auto"``: the candidates simulated on the plan, the fastest that fits chosen, the
program compiled with it, and explain() showing each schedule's best."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from pdcompile.autoschedule import Candidate, auto_schedules, best, candidates, format_choice, microbatch_counts
from pdcompile.ir import Chain, ChainLayer

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(autouse=True)
def calibrated(pdcompile_cache: Path) -> dict[str, float]:
    """``schedule="auto"`` as on a machine calibrated for this very runtime, whatever this machine's own
    cache holds: conftest's empty cache of the test's own, given the built-in per-action cost as measured
    (the same choices everywhere, and no UncalibratedWarning); the seconds per action kind."""
    from pdcompile import machine_cache

    seconds = dict.fromkeys(machine_cache.ACTION_KINDS, machine_cache.BUILTIN_ACTION_S)
    pdcompile_cache.mkdir(parents=True)
    machine_cache.cache_path().write_text(json.dumps({"key": machine_cache.machine_key(), "overhead_s": seconds}))
    return seconds


@dataclass(frozen=True)
class _Plan:  # what simulate_plan reads of a Plan
    schedule: str
    microbatch_size: int
    stages: tuple[Any, ...]


def _setup(p: int, memory: float | None = None) -> tuple[_Plan, Chain, SimpleNamespace]:
    """p equal stages of one layer each: F = 1 s, B = 1 s, W = 1 s per minibatch of 12 samples, one
    byte of activations per sample, free links."""
    layers = tuple(ChainLayer(f"l{k}", "x", 1.0, 2.0, 12.0, 0.0, input_grad_s=1.0, weight_grad_s=1.0)
                   for k in range(p))
    chain = Chain(layers=layers, cut_bytes=(0.0,) * (p - 1), batch_size=12)
    plan = _Plan("flush", 12, tuple(SimpleNamespace(first=k, last=k, replicas=1, ranks=[k], recompute="none")
                                    for k in range(p)))
    cluster = SimpleNamespace(device=SimpleNamespace(memory=memory), bandwidth_between=lambda a, b: 1e30)
    return plan, chain, cluster


def test_auto_considers_the_synchronous_schedules() -> None:
    assert auto_schedules(True) == ["gpipe", "flush", "zb-h1"]
    assert auto_schedules(False) == ["gpipe", "flush"]  # workers share cores: no schedule that splits every backward
    assert microbatch_counts(12) == [1, 2, 3, 4, 6, 12] and microbatch_counts(12, 4) == [4]


def test_auto_picks_zb_h1_with_the_most_microbatches_by_its_closed_form() -> None:
    # F = B = W = 1/M per microbatch: ZB-H1 takes M(3/M) + (p-1)(1/M) = 3 + (p-1)/M, GPipe and Flush
    # (M + p - 1)(3/M) (the simulator splits their drain's last backward: a little less); so ZB-H1
    # with the most microbatches wins
    p = 3
    plan, chain, cluster = _setup(p)
    cands = candidates(plan, chain, cluster, 12, auto_schedules(True), microbatch_counts(12))
    zb = {c.num_microbatches: c.step_s for c in cands if c.schedule == "zb-h1"}
    for m, t in zb.items():
        if m >= p:
            assert t == pytest.approx(3 + (p - 1) / m)
    chosen = best(cands)
    assert (chosen.schedule, chosen.num_microbatches) == ("zb-h1", 12)
    assert chosen.step_s == pytest.approx(3 + (p - 1) / 12)
    # without the split (shared cores), gpipe and flush tie; flush holds fewer activations
    plain = candidates(plan, chain, cluster, 12, auto_schedules(False), microbatch_counts(12), split_backward=False)
    chosen = best(plain)
    assert (chosen.schedule, chosen.num_microbatches) == ("flush", 12)
    assert chosen.step_s == pytest.approx((12 + p - 1) * 3 / 12)


def test_auto_respects_the_memory_limit() -> None:
    # GPipe holds the whole minibatch's activations (12 bytes), Flush and ZB-H1 min(p, M)
    # microbatches' of 12/M bytes each: a 10-byte worker fits neither GPipe nor M <= p
    p = 3
    plan, chain, cluster = _setup(p, memory=10.0)
    cands = candidates(plan, chain, cluster, 12, auto_schedules(True), microbatch_counts(12))
    assert not any(c.fits for c in cands if c.schedule == "gpipe")
    for c in cands:
        want = 12.0 if c.schedule == "gpipe" else min(p, c.num_microbatches) * 12.0 / c.num_microbatches
        assert c.peak_memory_bytes == pytest.approx(want) and c.fits == (want <= 10.0)
    chosen = best(cands)
    assert chosen.fits and chosen.schedule == "zb-h1"
    # nothing fits: the one needing the least memory
    assert best([Candidate("gpipe", 1, 1.0, 5.0, False), Candidate("flush", 2, 2.0, 3.0, False)]).schedule == "flush"
    text = format_choice(cands, chosen, ["note: x"])
    assert "gpipe" in text and "(does not fit)" in text and "* zb-h1" in text and "note: x" in text


def test_api_schedule_auto_compiles_the_choice(tmp_path, calibrated: dict[str, float]) -> None:  # noqa: ANN001
    from pdcompile.api import pdcompile
    from pdcompile.zoo import get

    z = get("mlp", batch_size=8, seed=0)
    pipe = pdcompile(z.model, example_inputs=z.example_inputs, example_target=z.target, loss_fn=z.loss_fn,
                     stages=2, schedule="auto")
    # the per-action costs as calibrated, with the per-tensor ones (CPU's defaults: this calibration has none)
    from pdcompile.machine_cache import FLATTEN_TENSOR_KEY, STEP_TENSOR_KEY
    from pdcompile.passes.costs.roofline import TENSOR_FLATTEN_S, TENSOR_STEP_S

    assert pipe.action_cost is not None and (pipe.action_cost.seconds, pipe.action_cost.calibrated) == (
        {**calibrated, STEP_TENSOR_KEY: TENSOR_STEP_S["cpu"], FLATTEN_TENSOR_KEY: TENSOR_FLATTEN_S["cpu"]}, True)
    cands, chosen, _ = pipe.schedule_choice
    assert chosen == best(cands) and chosen.schedule in ("gpipe", "flush")  # CPU workers: no zb-h1
    assert "zb-h1" not in {c.schedule for c in cands}
    assert {c.num_microbatches for c in cands} == {1, 2, 4, 8}
    # the program is compiled with the choice: options, microbatching and the schedule plan.json carries
    assert pipe.options.schedule == chosen.schedule and pipe.num_microbatches == chosen.num_microbatches
    assert pipe.microbatch_size * pipe.num_microbatches == 8
    spec = pipe.program_fields()["schedule"]
    assert spec["policy"] == chosen.schedule and spec["num_microbatches"] == chosen.num_microbatches
    text = pipe.explain()
    assert "schedule (auto)" in text and all(f" {n} " in text for n in ("gpipe", "flush"))
    assert "not considered: zb-h1" in text
    # M given: only the schedule is chosen
    fixed = pdcompile(z.model, example_inputs=z.example_inputs, example_target=z.target, loss_fn=z.loss_fn,
                      stages=2, schedule="auto", num_microbatches=2)
    assert {c.num_microbatches for c in fixed.schedule_choice[0]} == {2} and fixed.num_microbatches == 2


def test_cli_schedule_auto(tmp_path) -> None:  # noqa: ANN001
    from pdcompile.cli import main

    out = tmp_path / "prog"
    assert main(["emit", "zoo:mlp", "--stages", "2", "--schedule", "auto", "-o", str(out), "--json"]) == 0
    plan = json.loads((out / "plan.json").read_text())
    assert plan["schedule"]["policy"] in auto_schedules(True)


def test_auto_on_pipedreams_gnmt_profile_picks_zb_h1_on_gpus_never_on_cpus() -> None:
    """On PipeDream's GNMT-16 profile planned for Cluster A (V100s) the simulator predicts ZB-H1
    fastest, and auto takes it; CPU workers never get it (the measured split cost)."""
    from pdcompile import profile
    from pdcompile._cli.plan import resolve_cluster
    from pdcompile.autoschedule import best_per_schedule, split_every_backward_pays
    from pdcompile.passes.linearize import linearize
    from pdcompile.plan import plan

    chain, cluster = linearize(profile.load("pipedream:gnmt")), resolve_cluster("paper:A")
    pl = plan(chain, cluster, schedule="flush")
    mb = pl.microbatch_size * 8
    assert split_every_backward_pays(cluster.device.name, True)
    cands = candidates(pl, chain, cluster, mb, auto_schedules(True), microbatch_counts(mb, most=16))
    per = best_per_schedule(cands)
    chosen = best(cands)
    assert chosen.schedule == "zb-h1" and chosen.step_s == min(c.step_s for c in per.values())
    assert chosen.step_s < per["flush"].step_s
    assert not split_every_backward_pays("cpu", True) and not split_every_backward_pays("V100-16GB", False)


def test_auto_takes_interleaving_where_the_bubble_dominates() -> None:
    """A straight 2-rank pipeline of 4 equal layers with 2 microbatches: flush idles (p-1)/(m+p-1) of
    the step; interleaved 1F1B (2 stages per rank) halves that bubble, (p-1)/(v m + p - 1), and auto
    takes it (exact times from the closed forms: F=1, B=2 per layer and minibatch, free links)."""
    from pdcompile.autoschedule import best_per_schedule, virtual_candidates
    from pdcompile.cluster import local_cpu_cluster

    layers = tuple(ChainLayer(f"l{k}", "x", 1.0, 2.0, 12.0, 0.0) for k in range(4))
    chain = Chain(layers=layers, cut_bytes=(0.0,) * 3, batch_size=12)
    cluster = local_cpu_cluster(2)
    plan = _Plan("flush", 12, tuple(SimpleNamespace(first=2 * k, last=2 * k + 1, replicas=1, ranks=[k],
                                                    recompute="none") for k in range(2)))
    fixed = candidates(plan, chain, cluster, 12, ["flush"], [2], split_backward=False)
    virt = virtual_candidates(chain, cluster, 2, 12, ["interleaved-1f1b", "looped-bfs"], [2], split_backward=False)
    per = best_per_schedule(fixed + virt)
    # per microbatch of 6: a layer's F = 0.5, B = 1; flush: (m + p - 1) x 2 layers x 1.5 = 9
    assert per["flush"].step_s == pytest.approx(9.0, rel=1e-6)
    # interleaved, v = 2: v m (F+B) per rank + (p - 1)(F+B) of one stage = 2 x 2 x 1.5 + 1 x 1.5 = 7.5
    assert per["interleaved-1f1b"].step_s == pytest.approx(7.5, rel=1e-6)
    assert per["interleaved-1f1b"].virtual_stages == 2
    chosen = best(fixed + virt)
    assert chosen.schedule == "interleaved-1f1b" and chosen.virtual_stages == 2
    assert "interleaved-1f1b v=2" in format_choice(fixed + virt, chosen)


def test_api_auto_compiles_a_virtual_choice(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # noqa: ANN001
    """When auto's choice has virtual stages, the program is compiled with them: v p stages placed
    on the plan's p ranks (the choice forced here; which one wins is the closed-form test above)."""
    import torch

    from pdcompile import autoschedule, pdcompile

    from pdcompile._cli.plan import resolve_cluster

    real_best = autoschedule.best
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(8)])
    kw: dict[str, Any] = dict(example_inputs=(torch.randn(16, 8),), example_target=torch.randn(16, 8),
                              loss_fn=torch.nn.MSELoss(), schedule="auto", stages=2, num_microbatches=2)
    # on CPU workers the schedules with several stages per rank are not considered (virtual_stages_pay)
    assert "not considered: interleaved-1f1b (several stages per rank" in pdcompile(model, **kw).explain()
    with monkeypatch.context() as m:
        m.setattr(autoschedule, "best", lambda cands: real_best([c for c in cands if c.schedule == "interleaved-1f1b"]))
        pipe = pdcompile(model, resolve_cluster("paper:A"), **kw)  # V100s: considered
    spec = pipe.state.schedule_spec
    assert spec.name == "interleaved-1f1b" and spec.virtual_stages == 2 and len(spec.replicas) == 4
    plan = json.loads((pipe.emit(tmp_path / "prog") / "plan.json").read_text())
    assert plan["world_size"] == 2 and [s["ranks"] for s in plan["stages"]] == [[0], [1], [0], [1]]
    assert "* interleaved-1f1b v=2" in pipe.explain()


def _adam(params: Any) -> Any:
    import torch

    return torch.optim.Adam(params, lr=0.01)


def _sgd(params: Any) -> Any:
    import torch

    return torch.optim.SGD(params, lr=0.01)


def test_auto_counts_the_users_optimizer_state_as_simulate_does() -> None:
    """Auto's candidates hold the user's optimizer state (plain SGD none, Adam two weights' bytes), as the
    plan and ``simulate()`` do: with a limit between what auto's fastest choice needs under SGD and under
    Adam, SGD keeps it and Adam takes another, which ``simulate()`` of the compiled program finds within
    the limit; the SGD choice compiled with Adam (no auto) is over it. ``alternatives()`` counts it too."""
    import torch

    from pdcompile import pdcompile
    from pdcompile.cluster import ClusterSpec, Device, Level

    torch.manual_seed(0)
    def block() -> list[torch.nn.Module]:  # small weights, many saved activations per sample
        return [torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Tanh(), torch.nn.Sigmoid(), torch.nn.GELU(),
                torch.nn.SiLU(), torch.nn.Tanh(), torch.nn.Sigmoid()]

    model = torch.nn.Sequential(*block(), *block())
    x, y = torch.randn(64, 16), torch.randn(64, 16)

    def compile_(optimizer: Any, memory: float | None, **kw: Any) -> Any:
        cluster = ClusterSpec(Device("cpu", memory=memory), (Level("processes", 2, 2e9),))
        return pdcompile(model, cluster, example_inputs=(x,), example_target=y, loss_fn=torch.nn.MSELoss(),
                         stages=2, optimizer=optimizer, **kw)

    def peak(pipe: Any) -> float:
        return max(pipe.simulate().peak_memory_bytes)

    free = compile_(_sgd, None, schedule="auto")
    _, first, _ = free.schedule_choice
    assert first.peak_memory_bytes == pytest.approx(peak(free), rel=1e-9)  # plain SGD: no optimizer state
    # and its time: simulate() charges the per-action cost auto charged on these CPU workers
    assert first.step_s == pytest.approx(free.simulate().step_time_s, rel=1e-9)
    adam_first = compile_(_adam, None, schedule=first.schedule, num_microbatches=first.num_microbatches)
    low, high = peak(free), peak(adam_first)
    assert high > low  # Adam's two moments
    # explain()'s alternatives hold it too: data parallelism, one stage of every weight, two weights' bytes more
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    (name, dp_sgd), (_, dp_adam) = free.alternatives()[0], adam_first.alternatives()[0]
    assert name.startswith("data parallel")
    assert dp_adam.stages[0].memory_bytes - dp_sgd.stages[0].memory_bytes == pytest.approx(2 * weights, rel=1e-9)
    limit = (low + high) / 2
    sgd = compile_(_sgd, limit, schedule="auto")
    _, chosen, _ = sgd.schedule_choice
    assert (chosen.schedule, chosen.num_microbatches) == (first.schedule, first.num_microbatches)
    assert chosen.peak_memory_bytes == pytest.approx(peak(sgd), rel=1e-9) and peak(sgd) <= limit
    adam = compile_(_adam, limit, schedule="auto")
    cands, chosen, _ = adam.schedule_choice
    assert (chosen.schedule, chosen.num_microbatches) != (first.schedule, first.num_microbatches)
    assert chosen.fits and chosen.peak_memory_bytes == pytest.approx(peak(adam), rel=1e-9) and peak(adam) <= limit
    taken = next(c for c in cands if (c.schedule, c.num_microbatches) == (first.schedule, first.num_microbatches))
    assert not taken.fits and taken.peak_memory_bytes == pytest.approx(high, rel=1e-9)


def test_auto_gives_virtual_candidates_the_users_optimizer_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where virtual stages are considered (V100s), their candidates are simulated with the user's
    optimizer state too (Adam: 2 bytes per weight byte; the default plain SGD: 0)."""
    import torch

    from pdcompile import autoschedule, pdcompile
    from pdcompile._cli.plan import resolve_cluster

    seen: list[tuple[str, float]] = []
    for fn in ("candidates", "virtual_candidates"):
        real = getattr(autoschedule, fn)

        def record(*a: Any, _real: Any = real, _fn: str = fn, **kw: Any) -> Any:
            seen.append((_fn, kw["optimizer_state_factor"]))
            return _real(*a, **kw)

        monkeypatch.setattr(autoschedule, fn, record)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(8)])
    kw: dict[str, Any] = dict(example_inputs=(torch.randn(16, 8),), example_target=torch.randn(16, 8),
                              loss_fn=torch.nn.MSELoss(), schedule="auto", stages=2, num_microbatches=2)
    pdcompile(model, resolve_cluster("paper:A"), optimizer=_adam, **kw)
    assert seen and {f for f, _ in seen} == {"candidates", "virtual_candidates"} and {v for _, v in seen} == {2.0}
    seen.clear()
    pdcompile(model, resolve_cluster("paper:A"), **kw)
    assert seen and {v for _, v in seen} == {0.0}


def test_simulate_runs_a_ranks_virtual_stages_one_after_another() -> None:
    """``simulate()`` of an interleaved program simulates its stages per rank: a rank runs its two
    stages' forwards and backwards one at a time, so the step takes at least M times their compute
    (it simulated each stage on a worker of its own, faster than the rank can possibly run)."""
    from pdcompile import pdcompile
    from pdcompile.cluster import ClusterSpec, Device, Level
    from pdcompile.zoo import get

    z = get("gpt")
    cluster = ClusterSpec(Device("gpu", peak_flops=1e12), (Level("nodes", 2, 1e11),))
    pipe = pdcompile(z.model, cluster, example_inputs=z.example_inputs, loss_fn=z.loss_fn, example_target=z.target,
                     schedule="interleaved-1f1b", num_microbatches=4, virtual_stages=2, stages=4)
    busy = [4 * sum(st.compute_s for st in pipe.plan.stages if st.ranks == (r,)) for r in (0, 1)]
    assert [st.ranks for st in pipe.plan.stages] == [(0,), (1,), (0,), (1,)]
    assert pipe.simulate().step_time_s >= max(busy)
