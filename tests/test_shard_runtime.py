"""Sharded stage replicas in the runtime (issue 26; runtime/shard.py), through launched ranks under
the NCCL-rules mode, against single-process PyTorch training (Adam, global-norm clipping):

* ``full`` (FSDP2) on a stage of 2 replicas, plan [2, 1], 3 ranks, flush, 4 microbatches (a replica
  accumulates 2 before its one reduce-scatter), clipping; a DCP checkpoint at step 2;
* that checkpoint resumed as ``optimizer`` (ZeRO-1) on both stages of a [2, 2] plan, 4 ranks, gpipe;
* that run's checkpoint (each replica saved its share of Adam's state) resumed as ``full`` under zb-h1;
* ``optimizer`` under 1F1B (weight stashing: the optimizer state alone is sharded) against PipeDream's
  1F1B in one process;
* ``full`` under 1F1B refused by train.py's ``main``: exit 2 and one line;
* ``--precision bf16``: the ``full`` program's plan run as ``full``, ``optimizer`` and ``none`` (the same
  stages, plan.json's ``shard`` alone changed), 3 ranks, 2 steps: sharded ends bitwise where ``none`` ends.

Every run ends where one process training the whole model on the same minibatches ends (1e-5)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from _emitted import stages_and_microbatches
from _ranks import run_ranks
from pdcompile.api import pdcompile
from pdcompile.errors import UsageError
from pdcompile import reference
from pdcompile.merge import merge_weights
from pdcompile.runtime import checkpoint, shard
from pdcompile.runtime import launch as runtime_launch
from pdcompile.zoo import batches, get

# one worker for the file (tests/conftest.py): the ``full`` program, read by three tests, is compiled once
pytestmark = [pytest.mark.timeout(300), pytest.mark.multiproc, pytest.mark.xdist_group("shard_runtime")]

MICRO, BATCH, LR, MAX_NORM = 4, 8, 0.01, 0.3


def _opt(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=LR)


def _emit(folder: Path, replicas: list[int], modes: list[str], schedule: str, recompute: str = "none") -> Path:
    """The MLP in 2 stages with ``replicas``, compiled with ``shard=modes`` (one per stage) and ``recompute``."""
    z = get("mlp", batch_size=BATCH, seed=0)
    pipe = pdcompile(z.model, example_inputs=z.example_inputs, example_target=z.target, loss_fn=z.loss_fn,
                     optimizer=_opt, stages=2, replicas=replicas, schedule=schedule, num_microbatches=MICRO,
                     leaf_modules=z.leaf_modules, shard=modes, recompute=recompute)
    prog = pipe.emit(folder, data={"factory": "pdcompile.zoo:batches", "kwargs": {"name": "mlp"}})
    plan = json.loads((prog / "plan.json").read_text())
    assert [len(s["ranks"]) for s in plan["stages"]] == replicas
    assert shard.stage_modes(plan) == modes  # what the runtime reads: each stage's "shard"
    return prog


def _reference(steps: int, max_norm: float = MAX_NORM) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process: the whole MLP, the same minibatches cut into MICRO microbatches, Adam, the
    gradient's global norm clipped to ``max_norm`` before each step (inf: not clipped); final weights,
    unclipped norms."""
    z = get("mlp", batch_size=BATCH, seed=0)
    opt = _opt(z.model.parameters())
    data = batches(BATCH, "mlp")
    norms = []
    for _ in range(steps):
        (x,), y = next(data)
        opt.zero_grad(set_to_none=True)
        for xs, ys in zip(x.chunk(MICRO), y.chunk(MICRO)):
            (z.loss_fn(z.model(xs), ys) / MICRO).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(z.model.parameters(), max_norm)))
        opt.step()
    return {k: v.detach().clone() for k, v in z.model.state_dict().items()}, norms


def _run(prog: Path, nproc: int, *args: str) -> str:
    rc, out = run_ranks(prog, nproc, ["--timeout", "60", "--clip-grad-norm", str(MAX_NORM), *args], timeout=150)
    assert rc == 0, out[-4000:]
    return out


def _close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], also_differs: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-5, msg=k)
    assert any(not torch.allclose(got[k], also_differs[k], atol=1e-4) for k in want)  # it trained


def _norms(folder: Path) -> list[float]:
    """The unclipped global norms of the reporting rank (every rank computes the same)."""
    found = {tuple(json.loads(p.read_text())["grad_norms"]) for p in folder.glob("rank_*.json")}
    assert len(found) == 1, found  # every rank clipped with the same norm
    return list(found.pop())


@pytest.fixture(scope="module")
def full(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Stage 0 of two replicas under ``full``, stage 1 unreplicated (3 ranks), compiled for flush, every
    stage's forward run again in its backward (recompute="full": FSDP2's hooks under torch.utils.checkpoint)."""
    prog = _emit(tmp_path_factory.mktemp("full") / "prog", [2, 1], ["full", "none"], "flush", recompute="full")
    assert all(s.get("recompute") == "full" for s in json.loads((prog / "plan.json").read_text())["plan"]["stages"])
    return prog


@pytest.fixture(scope="module")
def zero(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Both stages of two replicas under ``optimizer`` (ZeRO-1, 4 ranks), compiled for gpipe."""
    return _emit(tmp_path_factory.mktemp("zero") / "prog", [2, 2], ["optimizer", "optimizer"], "gpipe")


def test_sharded_replicas_train_like_one_process_and_resume_across_modes(tmp_path: Path, full: Path,
                                                                          zero: Path) -> None:
    want2, norms = _reference(2)
    want4, _ = _reference(4)
    want6, norms6 = _reference(6)
    assert all(n > MAX_NORM for n in norms6)  # clipping really scales every step

    # full (FSDP2) over stage 0's two replicas: 3 ranks, flush, checkpoints at steps 2 and 4
    ck = tmp_path / "ck"
    _run(full, 3, "--steps", "4", "--checkpoint-dir", str(ck), "--checkpoint-every", "2",
         "--save-final", str(tmp_path / "w_full"), "--metrics", str(tmp_path / "m_full"))
    _close(merge_weights(full, tmp_path / "w_full"), want4, want2)
    assert _norms(tmp_path / "m_full") == pytest.approx(_reference(4)[1], rel=1e-5)
    # each replica saved its half of stage 0's weights and Adam state: DCP's index holds two chunks
    md = checkpoint.read_metadata(checkpoint.step_dir(ck, 2))
    w0 = next(k for k in md.state_dict_metadata if k.endswith("weight") and not k.startswith("optim/"))
    assert len(md.state_dict_metadata[w0].chunks) == 2  # type: ignore[union-attr]
    assert len(md.state_dict_metadata[f"optim/{w0}/exp_avg"].chunks) == 2  # type: ignore[union-attr]

    # the full run's step 2, resumed as ZeRO-1 on both stages of a [2, 2] plan (4 ranks, gpipe) to step 4
    ck2 = tmp_path / "ck2"
    out = _run(zero, 4, "--steps", "4", "--resume", str(checkpoint.step_dir(ck, 2)), "--checkpoint-dir", str(ck2),
               "--checkpoint-every", "4", "--save-final", str(tmp_path / "w_zero"),
               "--metrics", str(tmp_path / "m_zero"))
    assert "step 2, 2 minibatches consumed" in out
    _close(merge_weights(zero, tmp_path / "w_zero"), want4, want2)
    assert _norms(tmp_path / "m_zero") == pytest.approx(norms6[2:4], rel=1e-5)
    # ZeRO-1: each replica held (and saved) Adam's state of its share of the stage's parameters only
    states = [json.loads(p.read_text())["memory"]["optimizer_state"] for p in sorted((tmp_path / "m_zero").glob("rank_*.json"))]
    params = [json.loads(p.read_text())["memory"]["weights"] for p in sorted((tmp_path / "m_zero").glob("rank_*.json"))]
    for s in range(2):
        pair = states[2 * s:2 * s + 2]
        assert 0 < min(pair) and sum(pair) < 2 * params[2 * s] + 64, (states, params)  # 2 x weights, once

    # that checkpoint (Adam's state written in shares by the ZeRO replicas) resumed as full under zb-h1
    _run(full, 3, "--steps", "6", "--schedule", "zb-h1", "--resume", str(checkpoint.step_dir(ck2, 4)),
         "--save-final", str(tmp_path / "w_zb"))
    _close(merge_weights(full, tmp_path / "w_zb"), want6, want4)


def test_zero1_under_1f1b_shards_the_optimizer_state_only(tmp_path: Path, zero: Path) -> None:
    """1F1B with weight stashing keeps whole weight versions; ZeRO-1 shards the optimizer state there
    as everywhere: the run equals PipeDream's 1F1B on [2, 2] computed in one process (the stashed
    versions of pdcompile.reference), with clipping per update."""
    program, stages, optimizers, micro = stages_and_microbatches(zero, "mlp", 2, MICRO)
    fwd, bwd, group = reference.pipedream_1f1b([2, 2])
    norms: list[float] = []
    reference.train_versioned(stages, optimizers, program.build_loss(), micro, fwd=fwd, bwd=bwd, group=group,
                              scale=1.0, max_norm=MAX_NORM, norms=norms)
    assert any(n > MAX_NORM for n in norms)
    _run(zero, 4, "--steps", "2", "--schedule", "1f1b", "--save-final", str(tmp_path / "w"))
    for st, module in zip(program.stages, stages):
        want = dict(module.named_parameters())
        for r in st.ranks:  # every replica ends with the same whole weights
            got = torch.load(tmp_path / "w" / f"stage_{st.index}.rank_{r}.pt", weights_only=True)
            for n, p in want.items():
                torch.testing.assert_close(got[n], p.detach(), rtol=0, atol=1e-5, msg=f"stage {st.index} {n}")


def test_full_refused_where_a_schedule_cannot_honour_it(full: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """Weight stashing keeps full copies: ``full`` under 1F1B is refused by train.py's ``main`` before
    any process group, exit 2, one line naming the cause and the fix (the plain-data check below)."""
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as exc:
        runtime_launch.main(full, ["--steps", "1", "--schedule", "1f1b"])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1, err
    assert "shard 'full' under --schedule 1f1b" in err and "Fix:" in err and "Traceback" not in err
    # the same check, as plain data: tied parameters, fewer microbatches than replicas; a one-replica stage is none
    kw: dict[str, Any] = dict(schedule="flush", version_lag=0)
    with pytest.raises(UsageError, match="stage 0 has shard 'full' and a parameter tied"):
        shard.refuse(["full", "none", "none"], [2, 1, 1], tied={0, 2}, microbatches=4, **kw)
    shard.refuse(["full", "none", "none"], [2, 1, 1], tied={1, 2}, microbatches=4, **kw)  # the tie is elsewhere
    with pytest.raises(UsageError, match="--microbatches 2"):
        shard.refuse(["full", "none"], [2, 1], tied=(), microbatches=1, **kw)
    shard.refuse(["none", "full"], [2, 1], tied={0, 1}, microbatches=1, **kw)  # stage 1 has one replica: nothing
    shard.refuse(["optimizer", "none"], [2, 1], schedule="1f1b", version_lag=None, tied={0, 1}, microbatches=1)
    with pytest.raises(UsageError, match="shard 'sharded'"):
        shard.stage_modes({"stages": [{"shard": "sharded"}]})
    assert shard.stage_modes({"stages": [{}, {}], "plan": {"stages": [{"shard": "full"}, {}]}}) == ["full", "none"]


def _as_mode(prog: Path, mode: str, dest: Path) -> Path:
    """A copy of the program ``prog`` whose replicated stage 0 runs under ``mode`` (plan.json's
    ``shard``, in ``stages`` and in ``plan.stages``, the only change: the same stages and weights)."""
    shutil.copytree(prog, dest)
    plan = json.loads((dest / "plan.json").read_text())
    for entry in (plan["stages"][0], plan["plan"]["stages"][0]):
        entry["shard"] = mode
    (dest / "plan.json").write_text(json.dumps(plan))
    assert shard.stage_modes(plan) == [mode, "none"]
    return dest


def test_sharded_replicas_under_bf16_train_bitwise_as_unsharded(tmp_path: Path, full: Path) -> None:
    """bf16 (autocast forward and loss, fp32 master weights, fp32 gradients reduced in fp32) under
    sharding: plan [2, 1], flush, 4 microbatches, Adam, 2 steps, no clipping, stage 0 as ``full``,
    ``optimizer`` and ``none``. Bitwise, not within a tolerance: with 2 replicas FSDP2's reduce-scatter and
    ``AR``'s all-reduce add the same two fp32 numbers, Adam's update is element-wise (a shard's is the
    whole tensor's restricted to it) and ZeRO-1's broadcast copies its owner's fp32 update. A reduction
    in bf16, or bf16 master weights, would round gradients or weights (relative 4e-3): a difference. The
    runs are bf16: they differ from one process's fp32 training, by what bf16's rounding moves Adam."""
    final = {}
    for mode in ("none", "full", "optimizer"):
        prog = full if mode == "full" else _as_mode(full, mode, tmp_path / f"prog_{mode}")
        rc, out = run_ranks(prog, 3, ["--timeout", "60", "--steps", "2", "--precision", "bf16",
                                      "--save-final", str(tmp_path / f"w_{mode}")], timeout=150)
        assert rc == 0, out[-4000:]
        final[mode] = merge_weights(prog, tmp_path / f"w_{mode}")
    fp32, _ = _reference(2, math.inf)
    start = {k: v.detach() for k, v in get("mlp", batch_size=BATCH, seed=0).model.state_dict().items()}
    for mode in ("full", "optimizer"):
        assert set(final[mode]) == set(final["none"])
        for k, v in final["none"].items():
            assert torch.equal(final[mode][k], v), (mode, k, float((final[mode][k] - v).abs().max()))
    none = final["none"]
    assert all(none[k].dtype == torch.float32 for k in none)  # fp32 master weights
    assert any(not torch.equal(none[k], fp32[k]) for k in none)  # bf16 was in effect ...
    # ... and trained as fp32 does up to bf16's rounding: Adam's first updates are about +-lr an element, so
    # an element whose gradient bf16 rounds across 0 moves 2 lr the other way (measured: at most 0.02 an
    # element, 0.085 of the update's norm); compared by norm, against the update fp32 made
    for k in none:
        assert float((none[k] - fp32[k]).norm()) <= 0.25 * float((fp32[k] - start[k]).norm()), k
    assert any(not torch.allclose(none[k], start[k], atol=1e-4) for k in none)  # it trained
