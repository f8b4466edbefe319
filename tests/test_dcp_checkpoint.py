"""Checkpoints under the model's own names resume under another plan: a 2-stage flush run checkpointed
at step 2, resumed as a 3-stage GPipe run to step 4 (checkpointed again), resumed as a 2-stage plan
with a replicated first stage to step 6, then as interleaved 1F1B (two stages per rank) to step 8,
ends where single-process PyTorch training ends (SGD with momentum and a StepLR schedule); a
checkpoint of another model is refused with exit 2."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from _ranks import run_ranks
from pdcompile.api import pdcompile
from pdcompile.merge import merge_weights
from pdcompile.reference import train_sync
from pdcompile.runtime import checkpoint
from pdcompile.zoo import batches, get

pytestmark = [pytest.mark.timeout(300), pytest.mark.multiproc]

MICRO, LR, GAMMA = 2, 0.05, 0.7
SCHED = {"class": "torch.optim.lr_scheduler.StepLR", "kwargs": {"step_size": 1, "gamma": GAMMA}}


def _opt(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def _emit(folder: Path, name: str, stages: int, schedule: str, replicas: list[int] | None = None) -> Path:
    z = get(name, batch_size=8, seed=0)
    pipe = pdcompile(z.model, example_inputs=z.example_inputs, example_target=z.target, loss_fn=z.loss_fn,
                     optimizer=_opt, stages=stages, schedule=schedule, num_microbatches=MICRO,
                     leaf_modules=z.leaf_modules, replicas=replicas)
    prog = pipe.emit(folder, data={"factory": "pdcompile.zoo:batches", "kwargs": {"name": name}})
    plan = json.loads((prog / "plan.json").read_text())
    plan["lr_scheduler"] = SCHED  # stepped after every optimizer step, as train_sync steps it
    (prog / "plan.json").write_text(json.dumps(plan, indent=1))
    return prog


def _reference(steps: int) -> dict[str, torch.Tensor]:
    z = get("mlp", batch_size=8, seed=0)
    opt = _opt(z.model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=GAMMA)
    train_sync(z.model, z.loss_fn, opt, batches(8, "mlp"), steps=steps, num_microbatches=MICRO, lr_scheduler=sched)
    return {k: v.detach() for k, v in z.model.state_dict().items()}


def _run(prog: Path, nproc: int, *args: str) -> tuple[int, str]:
    return run_ranks(prog, nproc, ["--timeout", "60", *args], timeout=150)


def test_resume_under_other_plans_equals_uninterrupted_training(tmp_path: Path) -> None:
    two = _emit(tmp_path / "two", "mlp", 2, "flush")
    three = _emit(tmp_path / "three", "mlp", 3, "gpipe")
    replicated = _emit(tmp_path / "replicated", "mlp", 2, "flush", replicas=[2, 1])
    assert [len(s["ranks"]) for s in json.loads((replicated / "plan.json").read_text())["stages"]] == [2, 1]
    ck = tmp_path / "ck"
    every = ["--checkpoint-dir", str(ck), "--checkpoint-every", "2"]

    rc, out = _run(two, 2, "--steps", "2", *every)
    assert rc == 0, out[-3000:]
    two_step = checkpoint.step_dir(ck, 2)
    manifest = checkpoint.verify(two_step, None)
    assert set(manifest["model"]) == set(get("mlp").model.state_dict())  # the model's own names
    assert manifest["data_consumed"] == 2 and manifest["world_size"] == 2

    rc, out = _run(three, 3, "--steps", "4", *every, "--resume", "--save-final", str(tmp_path / "f3"))
    assert rc == 0, out[-3000:]
    assert "resumed from" in out and "step 2, 2 minibatches consumed" in out
    assert "written by fewer ranks" in out  # rank 2 of the 3-stage plan had no RNG state to restore
    want4 = _reference(4)
    got4 = merge_weights(three, tmp_path / "f3")
    assert set(got4) == set(want4)
    for k in want4:
        torch.testing.assert_close(got4[k], want4[k], rtol=0, atol=1e-5, msg=k)
    assert any(not torch.equal(got4[k], _reference(2)[k]) for k in want4)  # steps 3-4 trained

    # the 3-stage run's checkpoint at step 4, resumed by a plan with two replicas of its first stage
    rc, out = _run(replicated, 3, "--steps", "6", *every, "--resume", "--save-final", str(tmp_path / "f6"))
    assert rc == 0, out[-3000:]
    assert "step 4, 4 minibatches consumed" in out
    want6 = _reference(6)
    got6 = merge_weights(replicated, tmp_path / "f6")
    for k in want6:
        torch.testing.assert_close(got6[k], want6[k], rtol=0, atol=1e-5, msg=k)
    # the replicas' copies of stage 0 were written once
    six = checkpoint.verify(checkpoint.step_dir(ck, 6), None)
    assert six["world_size"] == 3 and [s for s, _, done in checkpoint.checkpoints(ck) if done] == [4, 6]

    # and by interleaved 1F1B: two stages on each of two ranks
    z = get("mlp", batch_size=8, seed=0)
    pipe = pdcompile(z.model, example_inputs=z.example_inputs, example_target=z.target, loss_fn=z.loss_fn,
                     optimizer=_opt, stages=4, virtual_stages=2, schedule="interleaved-1f1b", num_microbatches=MICRO,
                     leaf_modules=z.leaf_modules)
    virtual = pipe.emit(tmp_path / "virtual", data={"factory": "pdcompile.zoo:batches", "kwargs": {"name": "mlp"}})
    plan = json.loads((virtual / "plan.json").read_text())
    assert [s["ranks"] for s in plan["stages"]] == [[0], [1], [0], [1]]
    plan["lr_scheduler"] = SCHED
    (virtual / "plan.json").write_text(json.dumps(plan, indent=1))
    rc, out = _run(virtual, 2, "--steps", "8", *every, "--resume", "--save-final", str(tmp_path / "f8"))
    assert rc == 0, out[-3000:]
    assert "step 6, 6 minibatches consumed" in out
    want8 = _reference(8)
    got8 = merge_weights(virtual, tmp_path / "f8")
    for k in want8:
        torch.testing.assert_close(got8[k], want8[k], rtol=0, atol=1e-5, msg=k)
    eight = checkpoint.verify(checkpoint.step_dir(ck, 8), None)  # both stages of each rank saved
    assert set(eight["model"]) == set(want8)

    # a checkpoint of another model: every rank refuses, exit 2, one line naming the cause
    other = _emit(tmp_path / "other", "gpt", 2, "flush")
    shutil.copytree(checkpoint.step_dir(ck, 6), tmp_path / "ck_other" / "step_00000006")
    rc, out = _run(other, 2, "--steps", "8", "--checkpoint-dir", str(tmp_path / "ck_other"), "--resume")
    assert rc == 2, out[-3000:]
    errors = [ln for ln in out.splitlines() if "CheckpointError" in ln]
    assert errors and all("a checkpoint of another model" in ln or "another rank refused" in ln for ln in errors)
    assert "Traceback" not in out


def test_load_rank_reads_another_plans_checkpoint_by_names(tmp_path: Path) -> None:
    """No launch: a checkpoint written by one process under the model's names is read back by the
    stages of a 3-stage plan, tensors and SGD momentum, each stage reading only the files it needs."""
    prog = _emit(tmp_path / "three", "mlp", 3, "gpipe")
    plan = json.loads((prog / "plan.json").read_text())
    z = get("mlp", batch_size=8, seed=0)
    opt = _opt(z.model.parameters())
    (x,), y = next(batches(8, "mlp"))
    z.loss_fn(z.model(x), y).backward()
    opt.step()
    names = dict(z.model.named_parameters())
    tensors: dict[str, torch.Tensor] = dict(z.model.state_dict())
    for n, p in names.items():
        tensors[checkpoint.optim_key(n, "momentum_buffer")] = opt.state[p]["momentum_buffer"]
    state = checkpoint.RankState(step=1, data_consumed=1, lr_scheduler=None,
                                 param_groups=[{k: v for k, v in opt.param_groups[0].items() if k != "params"}],
                                 rng=checkpoint.rng_state())
    folder = checkpoint.write_offline(tmp_path / "ck", plan, 1, tensors, state)
    from pdcompile.runtime.program import Program

    program = Program.load(prog)
    for st in program.stages:
        module = program.build_stage(st.index)
        with torch.no_grad():
            for p in module.parameters():
                p.zero_()
        sopt = _opt(list(module.parameters()))
        part = checkpoint.StagePart(module, sopt, st.param_names, None, st.index)
        got = checkpoint.load_rank(folder, plan, st.ranks[0], [part])
        assert got.step == 1 and got.data_consumed == 1
        for local, p in module.named_parameters():
            orig = st.param_names[local]
            assert torch.equal(p, names[orig]), orig
            assert torch.equal(sopt.state[p]["momentum_buffer"], opt.state[names[orig]]["momentum_buffer"]), orig
