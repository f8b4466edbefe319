"""The plan's headline is the step the compiled schedule runs (issue 36 item 0): ``simulate()`` of
the compiled program, fill and drain included; a synchronous schedule's plan is chosen by that step
(microbatch count with the depth); ``schedule="auto"``'s virtual-stage candidates are planned on the
user's cluster; a model on meta never runs its loss on full-size values."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import torch

from pdcompile.cluster import ClusterSpec, Device, Level
from pdcompile.passes.linearize import linearize
from pdcompile.passes.partition_dp import partition_dp
from pdcompile.plan import Plan, plan, step_objective
from pdcompile.profile import load
from pdcompile.simulate import simulate_plan

pytestmark = pytest.mark.timeout(300)

GiB = 2.0**30


def gpu_cluster(inner: int = 2, outer: int = 2, memory: float = 16 * GiB) -> ClusterSpec:
    """A small two-level cluster of accelerators: ``inner`` per server at 100 GB/s, ``outer`` servers at 1 GB/s."""
    return ClusterSpec(Device("gpu", memory=memory, peak_flops=1e13, memory_bandwidth=1e12),
                       (Level("gpus", inner, 100e9), Level("servers", outer, 1e9)))


def _compile(schedule: str, cluster: ClusterSpec, model: str = "mlp", **kw: Any) -> Any:
    from pdcompile.api import pdcompile
    from pdcompile.zoo import get

    z = get(model, batch_size=8, seed=0)
    return pdcompile(z.model, cluster, example_inputs=z.example_inputs, example_target=z.target,
                     loss_fn=z.loss_fn, schedule=schedule, **kw)


@pytest.mark.parametrize("schedule", ["flush", "gpipe", "zb-h1", "1f1b", "2bw", "interleaved-1f1b", "zb-v"])
def test_the_plans_headline_is_simulate_of_the_compiled_program(schedule: str) -> None:
    cluster = gpu_cluster()
    # virtual stages: 2 per rank on 4 ranks, 8 stages, more than the MLP's 7 layers: the GPT's 59
    pipe = _compile(schedule, cluster, "gpt" if schedule in ("interleaved-1f1b", "zb-v") else "mlp",
                    num_microbatches=4)
    sim = pipe.simulate()
    step = float(sim.step_time_s)
    assert pipe.plan.seconds_per_minibatch == step
    # plan.json carries the same number, and the microbatches it covers
    carried = Plan.from_json(json.dumps(pipe.program_fields()["plan"]))
    assert carried.seconds_per_minibatch == step and carried.num_microbatches == pipe.num_microbatches == 4
    assert carried.samples_per_second == pytest.approx(8 / step)
    # a step is every microbatch through the pipeline: at least the busiest rank's compute (the steady-state
    # bottleneck per microbatch, the old headline, is less)
    assert step >= max(sim.busy.values()) * (1 - 1e-12)
    assert "simulate() of the compiled" in str(pipe.plan) and pipe.plan.predicted_by


def test_flush_chooses_depth_and_microbatches_by_the_simulated_step() -> None:
    """No microbatch count given, on accelerators: the count is chosen with the depth, and the choice is
    no slower (simulated) than the steady-state planner's plan at the default count."""
    cluster = gpu_cluster()
    pipe = _compile("flush", cluster)
    chosen = float(pipe.simulate().step_time_s)
    assert pipe.plan.seconds_per_minibatch == chosen
    # the steady-state planner's choice (today's) at the default count of 4, simulated the same way
    chain = pipe.wire_chain.at_batch(2)
    old = partition_dp(chain, pipe.cluster, schedule="flush", num_microbatches=4)
    old_step = float(simulate_plan(old, chain, pipe.cluster, "flush", 4, split_backward=True).step_time_s)
    assert chosen <= old_step * (1 + 1e-9)
    assert pipe.num_microbatches * pipe.microbatch_size == 8


def test_profile_only_plan_step_equals_simulate_and_beats_the_bottleneck_plan() -> None:
    """Without torch: ``plan()`` of a PipeDream profile under flush is its simulated step, as ``simulate_plan``
    of the plan computes it, and never slower than the bottleneck-optimal plan's step (today's choice);
    1F1B keeps PipeDream's steady-state objective (the same plan as ``partition_dp``)."""
    chain = linearize(load("pipedream:vgg16"))
    cluster = gpu_cluster(4, 4)
    for schedule in ("flush", "gpipe"):
        assert step_objective(schedule)
        p = plan(chain, cluster, schedule=schedule, num_microbatches=8)
        m = p.num_microbatches
        assert m == 8 and p.microbatch_size == 1
        res = simulate_plan(p, chain, cluster, schedule, m, split_backward=True)
        assert p.seconds_per_minibatch == pytest.approx(float(res.step_time_s), rel=1e-9)
        steady = partition_dp(chain, cluster, schedule=schedule, num_microbatches=8)
        steady_step = float(simulate_plan(steady, chain, cluster, schedule, 8, split_backward=True).step_time_s)
        assert p.seconds_per_minibatch <= steady_step * (1 + 1e-9)
        assert steady.seconds_per_minibatch < steady_step  # the steady-state number leaves fill and drain out
    assert not step_objective("1f1b")
    assert plan(chain, cluster, schedule="1f1b").to_json() != "" and \
        plan(chain, cluster, schedule="1f1b").stage_bounds == partition_dp(chain, cluster, schedule="1f1b").stage_bounds


def test_deep_flush_pipeline_trades_depth_for_microbatches() -> None:
    """The issue's 70B case in miniature: many workers, few microbatches. The steady-state planner spreads the
    chain over every worker (a deep pipeline mostly idle in fill and drain); the step search instead
    chooses copies and a microbatch count whose simulated step is shorter."""
    chain = linearize(load("pipedream:vgg16"))
    cluster = gpu_cluster(8, 4, memory=64 * GiB)
    p = plan(chain, cluster, schedule="flush", num_microbatches=4, choose_microbatches=True)
    steady = partition_dp(chain, cluster, schedule="flush", num_microbatches=4)
    steady_step = float(simulate_plan(steady, chain, cluster, "flush", 4, split_backward=True).step_time_s)
    assert p.seconds_per_minibatch < steady_step
    res = simulate_plan(p, chain.at_batch(p.microbatch_size), cluster, "flush", p.num_microbatches,
                        split_backward=True)
    assert p.seconds_per_minibatch == pytest.approx(float(res.step_time_s), rel=1e-9)
    assert p.microbatch_size * p.num_microbatches == 4 and p.cluster == str(cluster)


def test_virtual_stages_are_planned_on_the_users_cluster() -> None:
    from pdcompile.passes.partition import virtual_plan

    cluster = gpu_cluster()
    pipe = _compile("zb-v", cluster, "gpt", num_microbatches=4)
    assert pipe.plan.cluster == str(cluster)
    assert pipe.plan.memory_limit_bytes in (None, 16 * GiB)
    assert "cpu" not in pipe.plan.cluster and "processes" not in pipe.plan.bottleneck
    # the candidates schedule="auto" simulates are built the same way: on the user's device and links
    chain = pipe.wire_chain
    p, on = virtual_plan(chain, cluster, "zb-v", 2, 8)
    assert on == cluster and p.cluster == str(cluster) and p.num_workers == 4
    assert not any("over the device" in n and "MiB" in n for n in p.notes)


def test_auto_on_a_two_level_gpu_cluster_plans_on_it() -> None:
    cluster = gpu_cluster()
    pipe = _compile("auto", cluster, "gpt")
    assert pipe.cluster == cluster and pipe.plan.cluster == str(cluster)
    assert pipe.plan.seconds_per_minibatch == float(pipe.simulate().step_time_s)
    cands, chosen, _ = pipe.schedule_choice
    assert any(c.virtual_stages > 1 for c in cands)  # virtual candidates were considered (accelerators)
    # every candidate's memory was judged against the user's device (16 GiB), not a stand-in's
    assert all(c.fits == (c.peak_memory_bytes <= 16 * GiB) for c in cands)


def test_a_meta_model_with_a_real_target_traces_its_loss_on_meta() -> None:
    """The model on meta, the data real: the loss never sees full-size values (it would have run on real
    logits of the whole microbatch), and the traced loss is what the program runs."""
    transformers = pytest.importorskip("transformers")
    from pdcompile.api import pdcompile

    seen: list[torch.device] = []

    def loss_fn(out: Any, target: torch.Tensor) -> torch.Tensor:
        seen.append(out.logits.device)
        return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), target.flatten())

    cfg = transformers.LlamaConfig(vocab_size=50000, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                                   use_cache=False)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    x = torch.randint(0, 50000, (8, 64))
    t = torch.randint(0, 50000, (8, 64))  # real: on the CPU
    pipe = pdcompile(model, example_inputs=(x,), example_target=t, loss_fn=loss_fn, stages=2, num_microbatches=2)
    assert seen and all(d.type == "meta" for d in seen)
    assert pipe.loss() is not None and "cross_entropy" in pipe.loss().gm.code.replace("nll_loss", "cross_entropy")
    assert not math.isnan(pipe.plan.seconds_per_minibatch)
