"""Schedules that run the same actions are predicted the same memory: a stage that holds its whole step
in flight (flush at M <= its warm-up depth, GPipe always) runs every forward before its first backward,
so its gradients never meet a forward (``MemoryModel.whole_step``). Checked against a brute force over
the runtime's own action lists, and against the memory a 3-stage flush run measures."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _ranks import run_ranks  # noqa: E402

from pdcompile.cluster import flat_cluster  # noqa: E402
from pdcompile.ir import Chain, ChainLayer  # noqa: E402
from pdcompile.passes.partition_dp import plan_from_assignment  # noqa: E402
from pdcompile.runtime.schedules import make_schedule, stage_ranks  # noqa: E402
from pdcompile.simulate import simulate_plan  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
F = 2.0  # Adam: two weights' bytes of optimizer state


def _chain(weights: list[float], saved: list[float]) -> Chain:
    """One layer a stage: its weights and what it saves per microbatch (no boundary tensors)."""
    layers = tuple(ChainLayer(name=f"l{i}", op="Op", forward_s=1.0, backward_s=2.0, output_bytes=0.0, param_bytes=w,
                              members=(f"l{i}",), saved_bytes=x, saved_input_bytes=0.0, saved_output_bytes=0.0)
                   for i, (w, x) in enumerate(zip(weights, saved)))
    return Chain(layers=layers, cut_bytes=(0.0,) * (len(layers) - 1), batch_size=8, name="brute")


def _brute(acts: list[Any], W: float, X: float) -> float:
    """A rank's peak, walking its actions: after every forward and every weight gradient (an unsplit B,
    or W), weights and optimizer state, the gradients from the step's first weight gradient to its ST,
    and X per microbatch from its F to its unsplit B or its W."""
    kinds = [(a.kind.value, a.mb if a.kind.value in ("F", "B", "W") else -1) for a in acts]
    split = {mb for k, mb in kinds if k == "W"}
    live: set[int] = set()
    grads = False
    peak = 0.0
    for kind, mb in kinds:
        if kind == "F":
            live.add(mb)
            peak = max(peak, W * (1 + F + grads) + X * len(live))
        elif (kind == "B" and mb not in split) or kind == "W":
            live.discard(mb)
            grads = True
            peak = max(peak, W * (1 + F + grads) + X * len(live))
        elif kind == "ST":
            peak = max(peak, W * (1 + F + grads) + X * len(live))
            grads = False
    return peak


@pytest.mark.parametrize("replicas", [[1, 1], [2, 1], [1, 2], [1, 1, 1]])
def test_predicted_memory_is_the_brute_force_over_the_actions(replicas: list[int]) -> None:
    """gpipe and flush, M 1..4, two steps: each stage's simulated peak (and the plan's) is the brute
    force's over its ranks' actions; where the two schedules' actions on a stage's ranks are the same,
    so is the prediction (M=1: flush was rated one weight copy more, its gradients beside a forward
    that never follows them; [2, 1] at M=2: each replica of stage 0 holds its one microbatch)."""
    stages = len(replicas)
    weights, saved = [300.0, 500.0, 200.0][:stages], [200.0, 100.0, 400.0][:stages]
    chain = _chain(weights, saved)
    cluster = flat_cluster(sum(replicas), 10.0, memory=1e15)
    ranks = stage_ranks(replicas)
    for M in range(1, 5):
        peaks = {}
        for name in ("gpipe", "flush"):
            plan = plan_from_assignment(chain, cluster, [(s, s, r) for s, r in enumerate(replicas)], schedule=name,
                                        memory_limit=False, num_microbatches=M, optimizer_state_factor=F)
            res = simulate_plan(plan, chain, cluster, name, M, num_steps=2, optimizer_state_factor=F)
            sched = make_schedule(name, replicas, M, num_steps=2)
            peaks[name] = (res.peak_memory_bytes, sched)
            for s in range(stages):
                assert res.peak_memory_bytes[s] == pytest.approx(plan.stages[s].memory_bytes, rel=1e-12)
                X = saved[s] * plan.microbatch_size / chain.batch_size
                brute = max(_brute(sched[r], weights[s], X) for r in ranks[s])
                assert res.peak_memory_bytes[s] == pytest.approx(brute, rel=1e-12), (name, M, s)
        (g, gs), (f, fs) = peaks["gpipe"], peaks["flush"]
        for s in range(stages):
            if all([str(a) for a in gs[r]] == [str(a) for a in fs[r]] for r in ranks[s]):
                assert g[s] == f[s], (M, s)
        if M == 1:
            assert g == f


def _model() -> torch.nn.Module:
    def block() -> list[torch.nn.Module]:  # small weights, many saved activations per sample
        return [torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Tanh(), torch.nn.Sigmoid(), torch.nn.GELU(),
                torch.nn.SiLU(), torch.nn.Tanh(), torch.nn.Sigmoid()]

    torch.manual_seed(0)
    return torch.nn.Sequential(*block(), *block(), *block())


def batches(batch_size: int, seed: int = 0) -> Any:
    """The emitted program's data: seeded (inputs, target) minibatches."""
    i = 0
    while True:
        g = torch.Generator().manual_seed(seed + i)
        yield (torch.randn(batch_size, 16, generator=g),), torch.randn(batch_size, 16, generator=g)
        i += 1


@pytest.mark.multiproc
@pytest.mark.timeout(200)
def test_flush_holding_its_step_is_predicted_what_it_measures(tmp_path: Path) -> None:
    """Three stages of Linear + activations under Adam, flush at M=2: stages 0 and 1 (warm-up depth 3
    and 2) hold both microbatches before their first backward, as GPipe does, and measure what the
    prediction says within 1% (it was one weight copy over: gradients beside a forward); the last
    stage holds one microbatch with gradients. The last stage is not compared: its loss keeps the
    target (MSE), which the memory model does not count."""
    from pdcompile import pdcompile
    from pdcompile.cluster import ClusterSpec, Device, Level

    cluster = ClusterSpec(Device("cpu", memory=None), (Level("processes", 3, 2e9),))
    x, y = torch.randn(64, 16), torch.randn(64, 16)
    pipe = pdcompile(_model(), cluster, example_inputs=(x,), example_target=y, loss_fn=torch.nn.MSELoss(), stages=3,
                     optimizer=lambda p: torch.optim.Adam(p, lr=0.01), schedule="flush", num_microbatches=2)
    assert [s.in_flight for s in pipe.plan.stages] == [2, 2, 1]
    predicted = pipe.simulate().peak_memory_bytes
    assert predicted == pytest.approx([s.memory_bytes for s in pipe.plan.stages], rel=1e-12)
    prog = pipe.emit(tmp_path / "prog", data={"factory": "test_schedule_memory_equal:batches", "kwargs": {}})
    env = {"PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}"}
    rc, log = run_ranks(prog, 3, ["--steps", "2", "--metrics", str(tmp_path / "m"), "--timeout", "60"], timeout=120,
                        env=env)
    assert rc == 0, log[-3000:]
    metrics = {m["stage"]: m["memory"] for m in (json.loads(p.read_text()) for p in (tmp_path / "m").glob("*.json"))}
    for s in (0, 1):
        assert metrics[s]["in_flight"] == 2 and metrics[s]["gradients"] == 0, metrics[s]
        assert predicted[s] == pytest.approx(metrics[s]["total"], rel=0.01), (s, predicted[s], metrics[s])
