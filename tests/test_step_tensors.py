"""The per-parameter-tensor cost of the optimizer step and of the data-parallel all-reduce's flatten and copy back
(issue 36): the calibration's fit recovers a synthetic ground truth, the simulator charges a stage of many small
tensors more than one of the same bytes in one tensor (on CPU; on GPUs nothing per tensor), and the count of
tensors per stage the planner reads is the emitted stage's own ``parameters()``."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from pdcompile.cluster import ClusterSpec, Device, Level
from pdcompile.ir import Chain, ChainLayer
from pdcompile.machine_cache import FLATTEN_TENSOR_KEY, STEP_TENSOR_KEY


def test_fit_recovers_fixed_per_tensor_and_rate_from_synthetic_timings() -> None:
    from pdcompile.calibrate import STEP_PROBES, fit_tensor_cost

    fixed, per, rate = 30e-6, 6e-6, 5e9
    rng = random.Random(0)
    samples = [(n, 4.0 * n * numel, (fixed + n * per + 4.0 * n * numel / rate) * (1 + rng.uniform(-0.01, 0.01)))
               for _ in range(2) for n, numel in STEP_PROBES]
    f, p, r = fit_tensor_cost(samples)
    assert f == pytest.approx(fixed, rel=0.1)
    assert p == pytest.approx(per, rel=0.05)
    assert r == pytest.approx(rate, rel=0.05)
    # no fixed part in the truth: a negative fit is refitted as 0, the rest still recovered
    exact = [(n, b, n * per + b / rate) for n, b, _ in samples]
    f, p, r = fit_tensor_cost(exact)
    assert f == pytest.approx(0.0, abs=1e-9) and p == pytest.approx(per, rel=1e-6) and r == pytest.approx(rate, rel=1e-6)


def _single(tensors: int, replicas: int, device: str = "cpu") -> tuple[Any, Chain, ClusterSpec]:
    """One stage of 3 layers (1 ms forward, 2 ms backward, 4 MB of weights in all, ``tensors`` tensors, all in
    the first layer) on ``replicas`` workers of ``device``."""
    from pdcompile.passes.partition_dp import plan_from_assignment

    layers = tuple(ChainLayer(f"l{i}", "linear", 1e-3, 2e-3, 0.0, 4e6 if i == 0 else 0.0,
                              param_tensors=tensors if i == 0 else 0) for i in range(3))
    chain = Chain(layers, (0.0, 0.0), batch_size=replicas)
    cluster = ClusterSpec(Device(device), (Level("processes", replicas, 1e9),))
    plan = plan_from_assignment(chain, cluster, [(0, 2, replicas, tuple(range(replicas)))], schedule="flush",
                                num_microbatches=replicas)
    return plan, chain, cluster


def _step(tensors: int, replicas: int, device: str = "cpu", **kw: Any) -> float:
    from pdcompile.simulate import simulate_plan

    plan, chain, cluster = _single(tensors, replicas, device)
    return float(simulate_plan(plan, chain, cluster, "flush", replicas, split_backward=False,
                               update_bandwidth=1e10, **{"optimizer_state_factor": 1.0, **kw}).step_time_s)


def test_many_small_tensors_cost_more_than_one_of_the_same_bytes() -> None:
    """The step ends with the stage's all-reduce and optimizer step, neither overlapped: 100 tensors cost 99 x the
    per-tensor costs more than 1 tensor of the same bytes; the step alone on one worker, step and flatten on 2."""
    over = {"ST": 0.0, STEP_TENSOR_KEY: 5e-6, FLATTEN_TENSOR_KEY: 3e-6}
    assert _step(100, 1, overhead_s=over) - _step(1, 1, overhead_s=over) == pytest.approx(99 * 5e-6, rel=1e-6)
    assert _step(100, 2, overhead_s=over) - _step(1, 2, overhead_s=over) == pytest.approx(99 * 8e-6, rel=1e-6)
    # Adam's step does more per tensor than SGD with momentum's (3.3 x), plain SGD less (0.3 x)
    for factor, work in ((2.0, 3.3), (0.0, 0.3), (0.5, 0.65)):
        more = _step(100, 1, overhead_s=over, optimizer_state_factor=factor) - \
            _step(1, 1, overhead_s=over, optimizer_state_factor=factor)
        assert more == pytest.approx(99 * 5e-6 * work, rel=1e-6)
    # with no calibration: CPU's documented defaults; a GPU steps every tensor at once (nothing per tensor)
    from pdcompile.passes.costs.roofline import TENSOR_STEP_S

    assert _step(100, 1) - _step(1, 1) == pytest.approx(99 * TENSOR_STEP_S["cpu"], rel=1e-6)
    assert _step(100, 2, "h100") == pytest.approx(_step(1, 2, "h100"), rel=1e-12)


def test_plan_lower_bound_charges_the_tensors_and_stays_below_the_simulated_step() -> None:
    from pdcompile.plan import _plan_lower_bound
    from pdcompile.simulate import simulate_plan

    over = {"ST": 0.0, STEP_TENSOR_KEY: 5e-4, FLATTEN_TENSOR_KEY: 3e-4}
    for replicas in (1, 2):
        plan, chain, cluster = _single(100, replicas)
        sim = float(simulate_plan(plan, chain, cluster, "flush", replicas, split_backward=False,
                                  update_bandwidth=1e10, overhead_s=over).step_time_s)
        low = _plan_lower_bound(plan, chain, cluster, replicas, False, 1e10, 1.0, "flush", False, over)
        without = _plan_lower_bound(plan, chain, cluster, replicas, False, 1e10, 1.0, "flush", False,
                                    {STEP_TENSOR_KEY: 0.0, FLATTEN_TENSOR_KEY: 0.0})
        assert low <= sim * (1 + 1e-9)
        assert low - without == pytest.approx(100 * (5e-4 + (3e-4 if replicas > 1 else 0.0)), rel=1e-6)


def test_an_older_cache_reads_the_defaults_and_a_new_one_its_own(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from pdcompile import machine_cache
    from pdcompile.passes.costs.roofline import TENSOR_FLATTEN_S, TENSOR_STEP_S

    monkeypatch.setenv("PDCOMPILE_CACHE", str(tmp_path))
    d = {"key": machine_cache.machine_key(), "overhead_s": {"ST": 1e-4}, "collective_fixed_s": 4e-4,
         "collective_rate": 1e9}
    machine_cache.cache_path().write_text(json.dumps(d))
    old = machine_cache.action_cost()
    assert old.seconds[STEP_TENSOR_KEY] == TENSOR_STEP_S["cpu"]
    assert old.seconds[FLATTEN_TENSOR_KEY] == TENSOR_FLATTEN_S["cpu"]
    # the collective probe's gradients are charged per tensor now, not in its fixed part
    assert old.collective == pytest.approx((4e-4 - machine_cache.COLLECTIVE_PROBE_TENSORS * TENSOR_FLATTEN_S["cpu"],
                                            1e9))
    machine_cache.cache_path().write_text(json.dumps({**d, "step_tensor_s": 7e-6, "collective_tensor_s": 2e-6}))
    new = machine_cache.action_cost()
    assert (new.seconds[STEP_TENSOR_KEY], new.seconds[FLATTEN_TENSOR_KEY]) == (7e-6, 2e-6)
    assert new.collective == pytest.approx((4e-4 - machine_cache.COLLECTIVE_PROBE_TENSORS * 2e-6, 1e9))


@pytest.mark.parametrize("name", ["resnet", "gpt"])
def test_tensors_per_stage_are_the_emitted_stages_parameters(tmp_path: Path, name: str) -> None:
    """Each stage's count (the chain's ``param_tensors`` over its layers) against the parameters of the stage
    module the runtime builds from the emitted program."""
    from pdcompile import zoo
    from pdcompile.api import pdcompile
    from pdcompile.runtime.program import Program
    from pdcompile.simulate import stage_param_tensors

    z = zoo.get(name, size="small", batch_size=4, seed=0)
    pipe = pdcompile(z.model, example_inputs=z.example_inputs, example_target=z.target, loss_fn=z.loss_fn,
                     stages=3, schedule="flush", num_microbatches=2, leaf_modules=z.leaf_modules)
    prog = Program.load(pipe.emit(tmp_path / name))
    chain = pipe.state.chain
    counted = [stage_param_tensors(chain.layers[st.first:st.last + 1]) for st in pipe.plan.stages]
    built = [sum(1 for p in prog.build_stage(k).parameters() if p.requires_grad) for k in range(prog.num_stages)]
    assert len(built) == 3 and all(n > 0 for n in built)
    assert counted == built
