"""Plans under a memory limit fit it as the simulator holds them (pdcompile/simulate.py replays the
schedule and prices each stage at its simulated peak in flight), on chains whose stage memory is not
monotone in the stage's start (a layer that saves little behind a wide cut: Llama's rotary tables and
residual), and flush's in-flight count is a replica's share of the step, never more."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_partition_dp import two_level  # noqa: E402

from pdcompile.errors import InfeasiblePlanError  # noqa: E402
from pdcompile.ir import Chain, ChainLayer  # noqa: E402
from pdcompile.passes.partition_dp import partition_dp  # noqa: E402
from pdcompile.simulate import simulate_plan  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def chain_of(rows: list[tuple[float, float, float, float, float]], cuts: list[float]) -> Chain:
    """(forward s, backward s, output bytes, param bytes, saved bytes) per layer."""
    layers = tuple(ChainLayer(name=f"l{i}", op="Op", forward_s=f, backward_s=b, output_bytes=o, param_bytes=w,
                              members=(f"l{i}",), saved_bytes=s, saved_input_bytes=0.0, saved_output_bytes=0.0)
                   for i, (f, b, o, w, s) in enumerate(rows))
    return Chain(layers=layers, cut_bytes=tuple(cuts), batch_size=8, name="nonmonotone")


def check(chain: Chain, limit: float, M: int, workers: tuple[int, int] = (2, 2), shard: str = "none",
          f: float = 1.0) -> object:
    """The planner's flush plan (or its refusal); a plan's stages, as the simulator runs them, fit
    ``limit``, and its in-flight counts and bytes are the simulator's."""
    cluster = two_level(*workers, 100.0, 10.0, memory=limit)
    try:
        plan = partition_dp(chain, cluster, schedule="flush", num_microbatches=M, recompute="auto",
                            optimizer_state_factor=f, shard=shard)
    except InfeasiblePlanError:
        return None
    res = simulate_plan(plan, chain, cluster, "flush", M, optimizer_state_factor=f)
    assert [s.in_flight for s in plan.stages] == res.peak_in_flight
    for s in plan.stages:
        assert s.in_flight <= -(-M // s.replicas)
        assert math.isclose(s.memory_bytes, res.peak_memory_bytes[s.index], rel_tol=1e-9)
        assert res.peak_memory_bytes[s.index] <= limit * (1 + 1e-9), (plan.configuration, s.index)
    return plan


def test_a_stage_that_starts_behind_a_wide_cut_is_rated_where_it_starts() -> None:
    """Layer 3 saves nothing but receives 60 bytes per microbatch: stages 2..6 fit the limit and 3..6
    do not. The search read "2..6 fits" as "every later start fits" and returned 2-1-1 with a stage
    3..6 at 208 bytes against 196 (before the fix)."""
    chain = chain_of([(1.64, 3.23, 1.0, 0.0, 10.0), (1.98, 3.43, 10.0, 0.0, 0.0), (0.93, 2.42, 40.0, 20.0, 4.0),
                      (1.17, 3.46, 1.0, 20.0, 0.0), (0.98, 2.63, 1.0, 0.0, 4.0), (1.22, 3.98, 10.0, 20.0, 0.0),
                      (0.59, 3.66, 40.0, 20.0, 0.0)], [10.0, 1.0, 60.0, 60.0, 60.0, 1.0])
    assert check(chain, 196.23, 4) is not None


def test_flush_holds_at_most_a_replicas_share_of_the_step() -> None:
    """8 workers, 2 microbatches per step: a first stage 8 deep holds 2 (the generator warms up with
    min(depth, its microbatches)); the planner rated it at 8 before."""
    chain = chain_of([(1.0, 2.0, 10.0, 5.0, 10.0)] * 8, [10.0] * 7)
    plan = check(chain, 1e9, 2, (4, 2))
    assert plan is not None and max(s.in_flight for s in plan.stages) <= 2


def test_random_nonmonotone_chains_fit_as_simulated() -> None:
    rng = np.random.default_rng(7)
    for _ in range(25):
        n = int(rng.integers(4, 9))
        rows = [(float(rng.uniform(0.5, 2)), float(rng.uniform(1, 4)), float(rng.choice([1.0, 10.0, 40.0])),
                 float(rng.choice([0.0, 20.0, 60.0])), float(rng.choice([0.0, 0.0, 4.0, 10.0]))) for _ in range(n)]
        cuts = [float(rng.choice([1.0, 10.0, 60.0])) for _ in range(n - 1)]
        check(chain_of(rows, cuts), float(rng.uniform(150, 600)), int(rng.choice([2, 4, 8])))


def test_the_api_plans_with_its_optimizers_state() -> None:
    """pdcompile() rates a stage's optimizer state from the optimizer passed: Adam keeps exp_avg and
    exp_avg_sq (2 bytes per weight byte), SGD with momentum its buffer (1), plain SGD none (0); a
    stage's planned bytes differ between them by exactly that many times its weight bytes."""
    import torch

    from pdcompile.api import optimizer_state_factor_of, pdcompile

    opts = {"adam": lambda p: torch.optim.Adam(p, lr=1e-3), "momentum": lambda p: torch.optim.SGD(p, 0.1, 0.9),
            "sgd": lambda p: torch.optim.SGD(p, lr=0.1)}
    assert [optimizer_state_factor_of(o) for o in opts.values()] == [2.0, 1.0, 0.0]
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    pipes = {name: pdcompile(model, example_inputs=(x,), example_target=y, loss_fn=torch.nn.MSELoss(), optimizer=o,
                             stages=2, num_microbatches=2, schedule="flush") for name, o in opts.items()}
    chain = pipes["sgd"].wire_chain
    weights = [sum(l.param_bytes for l in chain.layers[s.first:s.last + 1]) for s in pipes["sgd"].plan.stages]
    assert sum(weights) == sum(p.numel() * 4 for p in model.parameters()) and min(weights) > 0
    for k, W in enumerate(weights):
        sgd, mom, adam = (pipes[n].plan.stages[k].memory_bytes for n in ("sgd", "momentum", "adam"))
        assert math.isclose(mom - sgd, W, rel_tol=1e-9) and math.isclose(adam - sgd, 2 * W, rel_tol=1e-9)


def test_forced_full_sharding_with_plain_sgd_fits_as_simulated() -> None:
    """``shard="full"`` with no optimizer state holds more per replica than ``none`` (the gathered copy
    plus a 1/r shard); the search's shortcut (sharded memory is never more) placed such stages where
    only the unsharded one fits (before the fix)."""
    rng = np.random.default_rng(11)
    planned = 0
    for _ in range(25):
        n = int(rng.integers(4, 8))
        rows = [(float(rng.uniform(0.5, 2)), float(rng.uniform(1, 4)), 1.0, float(rng.choice([20.0, 60.0])),
                 float(rng.choice([0.0, 4.0]))) for _ in range(n)]
        plan = check(chain_of(rows, [1.0] * (n - 1)), float(rng.uniform(100, 400)), 4, (2, 2), "full", 0.0)
        planned += plan is not None and any(s.replicas > 1 for s in plan.stages)  # type: ignore[attr-defined]
    assert planned >= 3
