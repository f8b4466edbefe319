"""``schedule="auto"`` on CPU workers charges the runtime's per-action cost: this runtime's calibration
(``python -m pdcompile.calibrate``'s cache) when it holds for this very runtime, else a built-in
estimate, and then ``pdcompile()``, ``explain()`` and the CLI say so in one line with the fix."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from typing import Any

import pytest

from pdcompile import machine_cache
from pdcompile.errors import UncalibratedWarning

pytestmark = pytest.mark.timeout(120)

FIX = "python -m pdcompile.calibrate"


def _cache(folder: Path, key: str, overhead_s: dict[str, float] | None) -> None:
    d: dict[str, Any] = {"key": key, "latency_s": 1e-4}
    if overhead_s is not None:
        d["overhead_s"] = overhead_s
    (folder / "machine-constants.json").write_text(json.dumps(d))


def _auto(**kw: Any) -> Any:
    from pdcompile.api import pdcompile
    from pdcompile.zoo import get

    z = get("mlp", batch_size=8, seed=0)
    return pdcompile(z.model, kw.pop("cluster", None), example_inputs=z.example_inputs, example_target=z.target,
                     loss_fn=z.loss_fn, stages=2, schedule="auto", **kw)


def _steps(pipe: Any) -> dict[tuple[str, int], float]:
    return {(c.schedule, c.num_microbatches): c.step_s for c in pipe.schedule_choice[0]}


def test_the_cache_read_names_what_is_wrong(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDCOMPILE_CACHE", str(tmp_path))
    key = machine_cache.machine_key()
    builtin = dict.fromkeys(machine_cache.ACTION_KINDS, machine_cache.BUILTIN_ACTION_S)
    got = machine_cache.action_cost()
    assert (got.seconds, got.calibrated) == (builtin, False) and "no calibration at" in got.problem
    (tmp_path / "machine-constants.json").write_text("{not json")
    assert "unreadable" in machine_cache.action_cost().problem
    _cache(tmp_path, key.rsplit("runtime ", 1)[0] + "runtime 000000000000", {"F": 1e-4})  # the runtime changed
    got = machine_cache.action_cost()
    assert not got.calibrated and got.problem.endswith("measured for another runtime")
    other = "|".join(["elsewhere", "64", *key.split("|")[2:]])  # another machine
    assert _problem(tmp_path, other).endswith("measured for another host, core count")
    _cache(tmp_path, key, None)
    assert "holds no per-action cost" in machine_cache.action_cost().problem
    _cache(tmp_path, key, {"F": 1e-4, "SF": 2e-5})
    got = machine_cache.action_cost()
    # and the per-tensor costs, the CPU defaults where the cache has none (roofline.TENSOR_STEP_S, TENSOR_FLATTEN_S)
    from pdcompile.passes.costs.roofline import TENSOR_FLATTEN_S, TENSOR_STEP_S

    assert (got.seconds, got.calibrated, got.warning()) == (
        {"F": 1e-4, "SF": 2e-5, machine_cache.STEP_TENSOR_KEY: TENSOR_STEP_S["cpu"],
         machine_cache.FLATTEN_TENSOR_KEY: TENSOR_FLATTEN_S["cpu"]}, True, "")


def _problem(folder: Path, key: str) -> str:
    _cache(folder, key, {"F": 1e-4})
    return machine_cache.action_cost().problem


def test_uncalibrated_auto_warns_in_one_line_and_charges_the_builtin(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    empty, same = tmp_path / "empty", tmp_path / "same"
    empty.mkdir(), same.mkdir()
    monkeypatch.setenv("PDCOMPILE_CACHE", str(empty))
    with pytest.warns(UncalibratedWarning) as caught:
        pipe = _auto()
    assert len(caught) == 1 and caught[0].filename == __file__  # the warning names the user's line
    line = str(caught[0].message)
    assert "\n" not in line and "not calibrated for this runtime" in line and "microbatch count" in line
    assert line.endswith(f"fix: {FIX}") and str(empty) in line
    assert f"warning: {line}" in pipe.explain()
    assert pipe.action_cost is not None and not pipe.action_cost.calibrated
    # what was charged is the built-in: the same choice as a calibration that measured exactly it ...
    _cache(same, machine_cache.machine_key(), dict.fromkeys(machine_cache.ACTION_KINDS, machine_cache.BUILTIN_ACTION_S))
    monkeypatch.setenv("PDCOMPILE_CACHE", str(same))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UncalibratedWarning)  # a matching cache: no warning
        calibrated = _auto()
    assert _steps(calibrated) == _steps(pipe)
    assert "not calibrated" not in calibrated.explain() and calibrated.action_cost.calibrated
    # ... and slower than free actions (what an uncalibrated choice charged before) at every candidate
    _cache(same, machine_cache.machine_key(), dict.fromkeys(machine_cache.ACTION_KINDS, 0.0))
    free = _steps(_auto())
    assert free.keys() == _steps(pipe).keys() and all(t > free[k] for k, t in _steps(pipe).items())


def test_fixed_microbatches_note_it_without_a_warning_and_gpus_charge_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pdcompile.cluster import flat_cluster

    monkeypatch.setenv("PDCOMPILE_CACHE", str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UncalibratedWarning)
        fixed = _auto(num_microbatches=2)
        gpu = _auto(cluster=flat_cluster(2, 10e9, name="V100-16GB"))
    assert "chose the schedule at the given microbatch count" in fixed.explain()
    assert gpu.action_cost is None and "not calibrated" not in gpu.explain()
    assert "no per-action cost charged" in gpu.explain()


def test_cli_prints_the_warning_as_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    from pdcompile.cli import main

    monkeypatch.setenv("PDCOMPILE_CACHE", str(tmp_path))
    assert main(["emit", "zoo:mlp", "--stages", "2", "--schedule", "auto", "-o", str(tmp_path / "p"), "--json"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pdcompile: warning: the runtime's per-action cost is not calibrated")
    assert err[0].endswith(FIX)


def test_auto_gives_every_replica_a_share_of_every_minibatch(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """With a stage of 2 replicas, auto tries only microbatch counts that 2 divides: fewer microbatches
    per minibatch than replicas would leave a replica without samples (the built-in cost favours few)."""
    from pdcompile.api import pdcompile
    from pdcompile.zoo import get

    monkeypatch.setenv("PDCOMPILE_CACHE", str(tmp_path))
    z = get("mlp", batch_size=8, seed=0)
    with pytest.warns(UncalibratedWarning):
        pipe = pdcompile(z.model, example_inputs=z.example_inputs, example_target=z.target, loss_fn=z.loss_fn,
                         stages=1, replicas=[2], schedule="auto")
    assert {c.num_microbatches for c in pipe.schedule_choice[0]} == {m for m in (1, 2, 4, 8) if m % 2 == 0}
    assert pipe.num_microbatches % 2 == 0


def _small_gpt(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> tuple[Any, Any, Any]:
    """A small GPT, 12 sequences, on 3 CPU processes sharing 2 cores (the cores the cost model charges,
    whatever the machine)."""
    import torch

    from pdcompile.zoo import gpt

    monkeypatch.setenv("PDCOMPILE_CACHE", str(tmp_path))
    monkeypatch.setattr("pdcompile.cluster.host_cores", lambda: 2)
    torch.manual_seed(0)
    model = gpt.GPT(gpt.GPTConfig(vocab_size=65, seq_len=64, d_model=16, n_heads=2, n_layers=3))
    return model, torch.randint(0, 65, (12, 64)), torch.randint(0, 65, (12, 64))


def _spy_compiles(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Any, int, float]]:
    """Each compile of ``pdcompile()`` (auto compiles flush first, then what it chose): the schedule and count
    asked, the count compiled and its headline."""
    from pdcompile.api import CompiledPipeline

    compiled: list[tuple[str, Any, int, float]] = []
    compile_ = CompiledPipeline._compile

    def spy(self: Any, model: Any, inputs: Any, opts: Any, *rest: Any) -> None:
        compile_(self, model, inputs, opts, *rest)
        compiled.append((opts.schedule, opts.num_microbatches, self.num_microbatches, self.plan.seconds_per_minibatch))

    monkeypatch.setattr(CompiledPipeline, "_compile", spy)
    return compiled


def test_the_step_search_never_replicates_a_stage_for_one_microbatch(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPT, 6 sequences, over a 6 MB/s link: the step search (flush) chooses the microbatch count on CPU
    workers too, and a copy with one microbatch is planned without replicas (a second replica would have none
    to run). The planner's steady-state objective replicated the one stage 3 ways at M=1, so the search never
    saw one stage on one worker at M=1 and picked M=2 (9.0 ms), where auto's flush at M=1 on that plan took
    5.6 ms: its pick is now the fastest flush auto rates on it."""
    from pdcompile.api import pdcompile
    from pdcompile.cluster import local_cpu_cluster
    from pdcompile.zoo.losses import SequenceCrossEntropy

    model, x, y = _small_gpt(monkeypatch, tmp_path)
    compiled = _spy_compiles(monkeypatch)
    with pytest.warns(UncalibratedWarning):
        pipe = pdcompile(model, local_cpu_cluster(3, bandwidth=6e6), example_inputs=(x[:6],), example_target=y[:6],
                         loss_fn=SequenceCrossEntropy(), schedule="auto")
    schedule, _, m, step = next(c for c in compiled if c[1] is None)  # the first compile's, as it ended
    assert schedule == "flush" and m != 4  # the step search chose the count (the default is 4)
    flush = {c.num_microbatches: c.step_s for c in pipe.schedule_choice[0] if c.schedule == "flush"}
    assert flush[m] == step and min(flush.values()) >= step * (1 - 1e-9), (m, flush)
    assert all(pipe.num_microbatches % st.replicas == 0 for st in pipe.plan.stages)


def test_a_plan_replicated_when_planned_again_still_gives_every_replica_a_share(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever count auto chooses, its program gives every replica a share of every minibatch: here auto's
    choice is made gpipe with 2 microbatches on the GPT over a 6 MB/s link (flush's own plan: one stage, no
    replicas). Planned again at 2 microbatches of 6 with that plan rated there too, the plan stays unreplicated;
    without it (``_given_plans`` left empty, as before plans were carried over) the DP's plan at 2 is one stage
    on 3 replicas, so auto compiles the fewest microbatches that 3 divides (3), and says so."""
    from pdcompile import autoschedule
    from pdcompile import plan as plan_module
    from pdcompile.api import pdcompile
    from pdcompile.cluster import local_cpu_cluster
    from pdcompile.zoo.losses import SequenceCrossEntropy

    model, x, y = _small_gpt(monkeypatch, tmp_path)
    chosen = autoschedule.best

    def gpipe_at_2(cands: Any) -> Any:
        asked = [c for c in cands if (c.schedule, c.num_microbatches) == ("gpipe", 2)]
        return asked[0] if asked else chosen(cands)

    compiled = _spy_compiles(monkeypatch)
    monkeypatch.setattr(autoschedule, "best", gpipe_at_2)
    with pytest.warns(UncalibratedWarning):
        pipe = pdcompile(model, local_cpu_cluster(3, bandwidth=6e6), example_inputs=(x,), example_target=y,
                         loss_fn=SequenceCrossEntropy(), schedule="auto")
    assert pipe.schedule_choice[1].num_microbatches == 2 and [st.replicas for st in pipe.plan.stages] == [1]
    assert compiled[-1][:3] == ("gpipe", 2, 2)  # the plan rated there kept: no third compile at 3
    assert all(pipe.num_microbatches % st.replicas == 0 for st in pipe.plan.stages)

    compiled.clear()
    monkeypatch.setattr(plan_module, "_given_plans", lambda given, workers: [])
    with pytest.warns(UncalibratedWarning):
        pipe = pdcompile(model, local_cpu_cluster(3, bandwidth=6e6), example_inputs=(x,), example_target=y,
                         loss_fn=SequenceCrossEntropy(), schedule="auto")
    assert [c[:3] for c in compiled[-2:]] == [("gpipe", 2, 2), ("gpipe", 3, 3)]  # planned again at 2, compiled at 3
    assert "planned again at 2 microbatches, a stage has 3 replicas: compiled with 3" in pipe.explain()
    assert all(pipe.num_microbatches % st.replicas == 0 for st in pipe.plan.stages)


# --- one channel: the step search, simulate() and auto charge the same step costs ----------------------------

def _calibration(folder: Path, overhead_s: dict[str, float], step_rate: float) -> None:
    """A synthetic calibration of this machine (never the real cache): the runtime's per-action cost, the
    optimizer step's rate (parameter bytes/s of SGD with momentum) and a cost per op class, so that
    cost_mode="auto" on a local cluster uses this machine's calibration."""
    table = {"source": "synthetic test table", "forward": {"matmul": [2e-5, 2e10], "elementwise": [5e-6, 5e9]},
             "backward": {"matmul": [4e-5, 2e10], "elementwise": [8e-6, 5e9]}, "corun": {}}
    (folder / "machine-constants.json").write_text(json.dumps(
        {"key": machine_cache.machine_key(), "latency_s": 1e-4, "bandwidth": 1e9, "allreduce_latency_s": 1e-4,
         "overhead_s": overhead_s, "step_fixed_s": 0.0, "step_rate": step_rate, "op_costs": table}))


def _spy_search(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Each plan the partition pass's step search returns, before the API replaces its headline."""
    import pdcompile.passes.partition as partition

    found: list[Any] = []
    choose = partition.choose_plan

    def spy(*a: Any, **kw: Any) -> Any:
        found.append(choose(*a, **kw))
        return found[-1]

    monkeypatch.setattr(partition, "choose_plan", spy)
    return found


def test_the_step_search_rates_its_pick_as_simulate_does_with_the_calibrated_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A local CPU cluster with this machine's calibration (synthetic): the flush step search's objective for
    its pick is the compiled pipeline's simulate() step (the runtime's per-action cost and the calibrated
    optimizer step both charged; before, the search charged neither, simulate() the per-action cost), and
    each stage's optimizer step is (3 + 2f) x its weight bytes / the calibrated bandwidth (Adam: f = 2)."""
    import torch

    from pdcompile.api import pdcompile
    from pdcompile.cluster import local_cpu_cluster
    from pdcompile.passes.costs.roofline import optimizer_step_bytes
    from pdcompile.zoo import get

    monkeypatch.setenv("PDCOMPILE_CACHE", str(tmp_path))
    over = {k: 2e-4 for k in machine_cache.ACTION_KINDS} | {"ST": 5e-4}
    _calibration(tmp_path, over, step_rate=3e8)
    found = _spy_search(monkeypatch)
    z = get("mlp", batch_size=8, seed=0)
    pipe = pdcompile(z.model, local_cpu_cluster(2), example_inputs=z.example_inputs, example_target=z.target,
                     loss_fn=z.loss_fn, schedule="flush", optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-3))
    assert pipe.cost_source.table is not None  # the calibration's costs, not the analytic model's
    search = found[-1]
    sim = pipe.simulate()
    assert search.num_microbatches == pipe.num_microbatches
    assert search.seconds_per_minibatch == pytest.approx(float(sim.step_time_s), rel=1e-9)
    # the optimizer step at the calibrated bandwidth: SGD with momentum streams 5 bytes per weight byte
    bw = 3e8 * 5
    assert pipe.update_bandwidth == pytest.approx(bw)
    weights = sum(p.numel() * p.element_size() for p in z.model.parameters())
    chain = pipe.wire_chain
    assert sum(l.param_bytes for l in chain.layers) == weights  # the stages' weights are the model's
    steps = [e for e in sim.events if re.fullmatch(r"\d+ST", e.name)]  # each replica's optimizer step
    assert len(steps) == sum(st.replicas for st in pipe.plan.stages)
    from pdcompile.passes.costs.roofline import TENSOR_STEP_S, tensor_work

    for e in steps:
        st = pipe.plan.stages[sim.stage_of_rank[e.rank]]
        mine = sum(l.param_bytes for l in chain.layers[st.first:st.last + 1])
        # and each parameter tensor (the mlp's Linear weights and biases: no tie), x Adam's work per tensor
        tensors = sum(l.param_tensors for l in chain.layers[st.first:st.last + 1])
        assert tensors > 0 and e.end_s - e.start_s == pytest.approx(
            (3 + 2 * 2.0) * mine / bw + tensors * TENSOR_STEP_S["cpu"] * tensor_work(2.0), rel=1e-9)
    assert sum(l.param_tensors for l in chain.layers) == sum(1 for _ in z.model.parameters())
    assert optimizer_step_bytes(1.0, 2.0) == 7.0
    text = pipe.explain()
    assert "calibrated on this machine" in text and f"{bw / 1e9:.3g} GB/s" in text
    assert "per-action cost (calibrated" in text


def test_the_step_search_chooses_with_the_per_action_cost() -> None:
    """The planner alone: a per-action cost makes more microbatches dearer, so the step search charged it
    picks fewer than the search that ignores it (the old objective); its objective is simulate_plan's step with
    that cost, and the old pick, so rated (as simulate() of the compiled pipeline rates it), is slower."""
    from pdcompile.cluster import local_cpu_cluster
    from pdcompile.ir import Chain, ChainLayer
    from pdcompile.plan import plan
    from pdcompile.simulate import simulate_plan, update_bandwidth_of

    # 6 layers of 5 MB of weights over a 100 MB/s link: two stages beat data parallelism, and without a cost
    # per action the pipeline's bubble shrinks with every microbatch more (16 of 1 sample)
    layers = tuple(ChainLayer(f"l{i}", "op", 1e-3, 2e-3, 1e5, 5e6, (f"l{i}",)) for i in range(6))
    chain = Chain(layers, (1e3,) * 5, batch_size=2, name="six")  # costs per microbatch of 2
    cluster = local_cpu_cluster(2, bandwidth=1e8)
    over = {k: 5e-4 for k in machine_cache.ACTION_KINDS}
    base = dict(schedule="flush", num_microbatches=8, choose_microbatches=True, memory_limit=False)
    free = plan(chain, cluster, **base)
    charged = plan(chain, cluster, **base, action_overhead_s=over)
    assert charged.num_microbatches < free.num_microbatches, (charged.num_microbatches, free.num_microbatches)

    def rated(p: Any) -> float:
        c = chain.at_batch(16 // p.num_microbatches)
        return float(simulate_plan(p, c, cluster, "flush", p.num_microbatches, overhead_s=over,
                                   split_backward=True, update_bandwidth=update_bandwidth_of(cluster)).step_time_s)

    assert charged.seconds_per_minibatch == pytest.approx(rated(charged), rel=1e-9)
    assert rated(free) > charged.seconds_per_minibatch * (1 + 1e-6)
