"""Mixed precision (``precision="bf16"``) and global-norm gradient clipping (``clip_grad_norm=``),
through torchrun, against single-process PyTorch training of the same stages (issue 17 items 3-4)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from pdcompile.api import pdcompile
from pdcompile.cluster import ClusterSpec
from pdcompile.errors import UsageError
from _ranks import run_ranks
from pdcompile.passes.annotate_costs import device_spec_for
from pdcompile.runtime import launch as runtime_launch
from pdcompile.runtime.program import Program, build
from pdcompile.zoo import batches, get

STEPS = 3
MICRO = 2
BATCH = 8
LR = 0.05


def _opt(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def _emit(tmp: Path, *, stages: int, replicas: list[int] | None = None, **kw: Any) -> Path:
    z = get("mlp", batch_size=BATCH, seed=0)
    pipe = pdcompile(z.model, example_inputs=z.example_inputs, example_target=z.target, loss_fn=z.loss_fn,
                     optimizer=_opt, stages=stages, replicas=replicas, schedule="flush", num_microbatches=MICRO,
                     **kw)
    return pipe.emit(tmp / "prog", data={"factory": "pdcompile.zoo:batches", "kwargs": {"name": "mlp"}})


def _run(tmp: Path, prog: Path, extra: Sequence[str] = ()) -> tuple[dict[int, dict[str, torch.Tensor]], dict[int, Any]]:
    """Launch the program; each rank's final weights and metrics."""
    nproc = Program.load(prog).world_size
    rc, log = run_ranks(prog, nproc, ["--steps", str(STEPS), "--save-final", str(tmp / "final"),
                                      "--metrics", str(tmp / "metrics"), "--timeout", "60", *extra], timeout=150)
    assert rc == 0, log[-4000:]
    weights = {int(p.name.split("rank_")[1].split(".")[0]): torch.load(p, weights_only=True)
               for p in (tmp / "final").glob("stage_*.rank_*.pt")}
    metrics = {int(p.stem.split("_")[1]): json.loads(p.read_text()) for p in (tmp / "metrics").glob("rank_*.json")}
    assert sorted(weights) == sorted(metrics) == list(range(nproc))
    return weights, metrics


def _reference(prog: Path, *, bf16: bool, max_norm: float | None = None) -> tuple[list[dict[str, torch.Tensor]], list[float]]:
    """Single-process training of the program's stages, one after another: autocast to bf16 around each
    forward and the loss, and each boundary tensor rounded to bf16 and back (``bf16``: what the pipeline
    sends); ``max_norm``: torch.nn.utils.clip_grad_norm_ over every parameter before each step. The final
    parameters per stage, and the unclipped norm of each step."""
    program = Program.load(prog)
    stages = [program.build_stage(k) for k in range(program.num_stages)]
    params = [p for m in stages for p in m.parameters()]
    opt = build(program.raw["optimizer"], params)
    loss_fn = program.build_loss()
    b = program.raw["microbatch_size"]
    data = batches(b * MICRO, "mlp")
    norms: list[float] = []

    def autocast() -> torch.autocast:
        return torch.autocast(device_type="cpu", dtype=torch.bfloat16, enabled=bf16)

    for _ in range(STEPS):
        inputs, target = next(data)
        opt.zero_grad(set_to_none=True)
        for j in range(MICRO):
            xs: list[torch.Tensor] = [x.split(b)[j] for x in inputs]
            for k, m in enumerate(stages):
                with autocast():
                    out = m(*xs)
                if k < len(stages) - 1:
                    specs = program.stages[k].outputs
                    xs = [o.to(s.wire("bf16" if bf16 else "fp32")).to(s.dtype) for o, s in zip(out, specs)]
            with autocast():
                loss = loss_fn(out, target.split(b)[j])
            (loss / MICRO).backward()
        if max_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(params, max_norm)))
        opt.step()
    return [{n: p.detach().clone() for n, p in m.named_parameters()} for m in stages], norms


def _by_stage(prog: Path, got: dict[int, dict[str, torch.Tensor]]) -> list[tuple[int, int, dict[str, torch.Tensor]]]:
    program = Program.load(prog)
    return [(rank, program.stage_of_rank(rank).index, w) for rank, w in sorted(got.items())]


@pytest.mark.multiproc
@pytest.mark.timeout(400)
def test_bf16_pipeline_equals_single_process_autocast(tmp_path: Path) -> None:
    prog = _emit(tmp_path, stages=2, precision="bf16")
    plan = json.loads((prog / "plan.json").read_text())
    assert plan["precision"] == "bf16"
    assert plan["stages"][1]["inputs"][0]["dtype"] == "float32"
    assert plan["stages"][1]["inputs"][0]["wire_dtype"] == "bfloat16"  # receive buffers are sized from this
    got, metrics = _run(tmp_path / "bf16", prog)
    want, _ = _reference(prog, bf16=True)
    fp32, _ = _reference(prog, bf16=False)
    initial = [dict(Program.load(prog).build_stage(k).named_parameters()) for k in range(2)]
    for rank, s, w in _by_stage(prog, got):
        for n, ref in want[s].items():
            torch.testing.assert_close(w[n], ref, rtol=1.6e-2, atol=1e-3, msg=lambda m: f"rank {rank} {n}: {m}")
            assert not torch.equal(ref, initial[s][n])  # it trained
    # the pipeline is far closer to autocast training than autocast training is to fp32 training
    dist_ref = max(float((w[n] - want[s][n]).abs().max()) for _, s, w in _by_stage(prog, got) for n in w)
    dist_fp32 = max(float((want[s][n] - fp32[s][n]).abs().max()) for s in range(2) for n in want[s])
    assert dist_fp32 > 0 and dist_ref < dist_fp32 / 10, (dist_ref, dist_fp32)
    assert all(m["precision"] == "bf16" for m in metrics.values())

    # the messages are bf16: the same run in fp32 sends exactly twice the floating bytes, all fp32
    _, metrics32 = _run(tmp_path / "fp32", prog, ["--precision", "fp32"])
    for rank in metrics:
        sent16, sent32 = metrics[rank]["p2p_bytes_sent"], metrics32[rank]["p2p_bytes_sent"]
        assert sent16.get("float32", 0) == 0 and sent32.get("bfloat16", 0) == 0, (sent16, sent32)
        assert sent32.get("float32", 0) > 0
        assert 2 * sent16["bfloat16"] == sent32["float32"], (rank, sent16, sent32)


@pytest.mark.multiproc
@pytest.mark.timeout(400)
# flush only (gpipe's row dropped: it clips at the same point, after the minibatch's last backward;
# gpipe with a replicated stage trains in tests/test_training_loop.py and tests/test_shard_runtime.py)
@pytest.mark.parametrize("schedule", ["flush"])
def test_clip_grad_norm_equals_single_process(tmp_path: Path, schedule: str) -> None:
    max_norm = 0.05
    prog = _emit(tmp_path, stages=3, replicas=[2, 1, 1], clip_grad_norm=max_norm)
    assert json.loads((prog / "plan.json").read_text())["clip_grad_norm"] == max_norm
    got, metrics = _run(tmp_path / "run", prog, ["--schedule", schedule])
    want, norms = _reference(prog, bf16=False, max_norm=max_norm)
    assert len(norms) == STEPS and all(n > max_norm for n in norms), norms  # clipping really happens
    for rank, m in metrics.items():  # every rank saw the same global norm, the one torch computes
        assert m["grad_norms"] == pytest.approx(norms, rel=1e-5), (rank, m["grad_norms"], norms)
    for rank, s, w in _by_stage(prog, got):
        for n, ref in want[s].items():
            torch.testing.assert_close(w[n], ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank} {n}: {m}")
    # and clipping changed the result: without it, training ends elsewhere
    unclipped, _ = _reference(prog, bf16=False)
    assert any(not torch.allclose(unclipped[s][n], want[s][n], rtol=1e-3, atol=1e-5) for s in range(3) for n in want[s])


def test_clip_grad_norm_options(tmp_path: Path) -> None:
    """Refusals (1F1B and 2BW clip per update: tests/test_clip_pipedream.py)."""
    z = get("mlp", batch_size=BATCH, seed=0)
    with pytest.raises(UsageError, match="same number of replicas"):
        pdcompile(z.model, example_inputs=z.example_inputs, example_target=z.target, loss_fn=z.loss_fn,
                  stages=2, replicas=[2, 1], schedule="1f1b", clip_grad_norm=1.0)
    with pytest.raises(UsageError, match="positive"):
        pdcompile(z.model, example_inputs=z.example_inputs, example_target=z.target, loss_fn=z.loss_fn,
                  stages=2, clip_grad_norm=-1.0)
    with pytest.raises(UsageError, match="precision"):
        pdcompile(z.model, example_inputs=z.example_inputs, example_target=z.target, loss_fn=z.loss_fn,
                  stages=2, precision="fp16")
    prog = _emit(tmp_path, stages=2, clip_grad_norm=1.0)
    program = Program.load(prog)
    args = runtime_launch.parse_args(["--schedule", "2bw"], program)
    assert args.clip_grad_norm == 1.0 and args.precision == "fp32"  # plan.json's defaults
    runtime_launch.check_args(args, program, world=2)  # 2bw clips per update
    runtime_launch.check_args(runtime_launch.parse_args([], program), program, world=2)


def test_bf16_costs() -> None:
    """Analytic costs use the cluster's bf16 peak; the planner and simulator send half the boundary bytes."""
    toml = ('[device]\nname = "gpu"\npeak_flops = "10 TFLOPS"\npeak_flops_bf16 = "40 TFLOPS"\nmemory_bandwidth = "1000 TB/s"\n'
            '[[levels]]\nname = "node"\ncount = 2\nbandwidth = "1 GB/s"\n')
    cluster = ClusterSpec.from_toml(toml)
    assert ClusterSpec.from_toml(cluster.to_toml()).device.peak_flops_bf16 == 40e12
    assert device_spec_for(cluster, "bf16").peak_flops == 40e12
    assert device_spec_for(cluster).peak_flops == 10e12
    z = get("mlp", batch_size=BATCH, seed=0)
    pipes = {p: pdcompile(z.model, cluster, example_inputs=z.example_inputs, example_target=z.target,
                          loss_fn=z.loss_fn, stages=2, precision=p) for p in ("fp32", "bf16")}
    full, half = pipes["fp32"].wire_chain.cut_bytes, pipes["bf16"].wire_chain.cut_bytes
    assert [c / 2 for c in full] == list(half)
    f32, b16 = (pipes[p].plan.stages[0] for p in ("fp32", "bf16"))
    assert b16.compute_s < f32.compute_s and b16.send_s < f32.send_s
    sim32, sim16 = (pipes[p].simulate() for p in ("fp32", "bf16"))
    assert sim16.makespan_s < sim32.makespan_s
