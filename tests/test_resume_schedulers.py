"""An LR scheduler (and the optimizer's own step counts) resumed under another plan continues at each
stage's own position. Under PipeDream's 1F1B a stage of r replicas updates once per round of r
microbatches, so stages of one run sit at different scheduler steps; a resumed stage takes the
position of the writing plan's stage that held its parameters (before: that of the writing rank
with its rank number, which under another plan may have run another stage), and a stage holding
parameters of writing stages at different positions is refused (one scheduler can't continue both)."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from _ranks import run_ranks
from test_checkpoint import ONE_STAGE
from test_checkpoint import PLAN as PLAN_12
from pdcompile import reference
from pdcompile.api import pdcompile
from pdcompile.errors import CheckpointError
from pdcompile.runtime import checkpoint, loop
from pdcompile.runtime.program import Program, build
from pdcompile.zoo import batches, get

pytestmark = pytest.mark.timeout(300)

M, LR, GAMMA = 2, 0.01, 0.8
SCHED = {"class": "torch.optim.lr_scheduler.StepLR", "kwargs": {"step_size": 1, "gamma": GAMMA}}


def _adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=LR)


def _emit(folder: Path, replicas: list[int]) -> Path:
    z = get("mlp", batch_size=8, seed=0)
    pipe = pdcompile(z.model, example_inputs=z.example_inputs, example_target=z.target, loss_fn=z.loss_fn,
                     optimizer=_adam, stages=2, schedule="1f1b", num_microbatches=M, replicas=replicas)
    prog = pipe.emit(folder, data={"factory": "pdcompile.zoo:batches", "kwargs": {"name": "mlp"}})
    plan = json.loads((prog / "plan.json").read_text())
    plan["lr_scheduler"] = SCHED  # stepped after every optimizer step of each stage
    (prog / "plan.json").write_text(json.dumps(plan, indent=1))
    return prog


def _updates(microbatches: int, replicas: int) -> int:
    """A stage's optimizer steps in a segment of 1F1B: a round of ``replicas`` microbatches each (the
    last round partial)."""
    return -(-microbatches // replicas)


@pytest.mark.multiproc
def test_1f1b_resumed_under_other_replicas_continues_each_stages_schedule(tmp_path: Path) -> None:
    """[2, 1] under 1F1B (M = 2) for 3 minibatches, checkpointed: stage 0 took 3 steps, stage 1 took 6.
    Resumed as [1, 2] to minibatch 5: stage 0 takes 4 more, stage 1 (now two replicas) 2 more. Every
    rank's learning rate after the run is StepLR's closed form at its stage's own step count, and the
    final weights (Adam: its step counts are per parameter) equal PipeDream's 1F1B reference run
    segment by segment with a scheduler stepped after each stage's update, within 1e-6. Before, rank 1
    (stage 0 in the writing plan, stage 1 now) resumed stage 0's scheduler: its LR was LR * 0.8^5, not
    LR * 0.8^8, and the two replicas of stage 1 trained with different rates."""
    a, b = _emit(tmp_path / "a", [2, 1]), _emit(tmp_path / "b", [1, 2])
    pa, pb = Program.load(a), Program.load(b)
    assert [s.param_names for s in pa.stages] == [s.param_names for s in pb.stages]  # the same cut
    ck = tmp_path / "ck"
    common = ["--timeout", "60", "--checkpoint-dir", str(ck)]
    rc, out = run_ranks(a, 3, [*common, "--steps", "3", "--checkpoint-every", "3"], timeout=150)
    assert rc == 0, out[-3000:]
    rc, out = run_ranks(b, 3, [*common, "--steps", "5", "--checkpoint-every", "5", "--resume",
                               "--save-final", str(tmp_path / "final")], timeout=150)
    assert rc == 0, out[-3000:]
    assert "step 3, 3 minibatches consumed" in out

    # the reference: each segment PipeDream's 1F1B on its plan's replicas, each stage's scheduler per update
    stages = [pa.build_stage(k) for k in range(2)]
    opts = [build(pa.raw["optimizer"], m.parameters()) for m in stages]
    for opt in opts:
        sched = loop.build_scheduler(SCHED, opt)
        opt.register_step_post_hook(lambda *_, s=sched: s.step())
    loss_fn = pa.build_loss()
    data = batches(8, "mlp")  # the program's data hook: minibatch i, cut into M microbatches
    micro = [((x,), y) for _ in range(5) for (xs,), ys in [next(data)] for x, y in zip(xs.chunk(M), ys.chunk(M))]
    for first, end, reps in ((0, 3, [2, 1]), (3, 5, [1, 2])):
        fwd, bwd, group = reference.pipedream_1f1b(reps)
        reference.train_versioned(stages, opts, loss_fn, micro[first * M:end * M], fwd=fwd, bwd=bwd, group=group)
    counts = [_updates(3 * M, ra) + _updates(2 * M, rb) for ra, rb in zip([2, 1], [1, 2])]
    assert counts == [7, 8]
    for s, opt in enumerate(opts):  # the reference agrees with the closed form
        assert opt.param_groups[0]["lr"] == pytest.approx(LR * GAMMA ** counts[s], rel=1e-12)

    five = checkpoint.step_dir(ck, 5)
    manifest = checkpoint.verify(five, None)
    saved = {rank: checkpoint.load_tensors(five / checkpoint.state_name(rank)) for rank in range(3)}
    at = {rank: (pb.stage_of_rank(rank).index, s["lr_scheduler"]["last_epoch"]) for rank, s in saved.items()}
    assert at == {0: (0, 7), 1: (1, 8), 2: (1, 8)}  # (stage, its scheduler's step) of each rank
    for rank in range(3):
        stage = pb.stage_of_rank(rank).index
        lr = saved[rank]["param_groups"][0]["lr"]
        assert math.isclose(lr, LR * GAMMA ** counts[stage], rel_tol=1e-12), (rank, stage, lr)
        weights = torch.load(tmp_path / "final" / f"stage_{stage}.rank_{rank}.pt", weights_only=True)
        for n, p in stages[stage].named_parameters():
            torch.testing.assert_close(weights[n], p.detach(), rtol=0, atol=1e-6,
                                       msg=lambda e, r=rank, n=n: f"rank {r} {n}: {e}")
    assert manifest["step"] == 5


# --- without a launch: which writing stage's state a resuming stage takes ---------------------------

# PLAN_12: [1, 2] replicas of the 2-stage model; ONE_STAGE: the same model as one stage (test_checkpoint's)

PLAN_21: dict[str, Any] = {
    "world_size": 3,
    "stages": [
        {"index": 0, "ranks": [0, 1], "param_names": {"fc.weight": "net.0.weight", "fc.bias": "net.0.bias"}},
        {"index": 1, "ranks": [2], "param_names": {"out.weight": "net.2.weight"}},
    ],
}
SHAPES = {"net.0.weight": (3, 4), "net.0.bias": (3,), "net.2.weight": (2, 3)}


def _stage(plan: dict[str, Any], index: int) -> checkpoint.StagePart:
    """A fresh stage of ``plan`` (zeros, fresh Adam and StepLR) named as plan.json names it."""
    names = plan["stages"][index]["param_names"]
    m = torch.nn.Module()
    for local, orig in names.items():
        mod, leaf = local.split(".")
        if not hasattr(m, mod):
            m.add_module(mod, torch.nn.Module())
        getattr(m, mod).register_parameter(leaf, torch.nn.Parameter(torch.zeros(SHAPES[orig])))
    opt = _adam(m.parameters())
    return checkpoint.StagePart(m, opt, names, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=GAMMA), index)


def _stepped(part: checkpoint.StagePart, steps: int) -> checkpoint.StagePart:
    for _ in range(steps):
        for p in part.module.parameters():
            p.grad = torch.ones_like(p)
        part.optimizer.step()
        part.lr_scheduler.step()
    return part


def _write_21(root: Path, steps: tuple[int, int]) -> Path:
    """A checkpoint as the [2, 1] plan's ranks write it, stage 0 ``steps[0]`` updates in, stage 1 ``steps[1]``."""
    parts = [_stepped(_stage(PLAN_21, k), n) for k, n in enumerate(steps)]
    state = checkpoint.rank_state(parts, 3, 3)  # one state for every rank: each stage's entry under its index
    return checkpoint.write_offline(root, PLAN_21, 3, checkpoint.state_dict_of(parts), state, world_size=3)


def test_each_resumed_stage_takes_the_schedule_of_the_writing_stage_of_its_parameters(tmp_path: Path) -> None:
    folder = _write_21(tmp_path, (3, 6))
    for plan, rank, index, want in [(PLAN_21, 0, 0, 3), (PLAN_21, 1, 0, 3), (PLAN_21, 2, 1, 6),
                                    (PLAN_12, 0, 0, 3), (PLAN_12, 1, 1, 6), (PLAN_12, 2, 1, 6)]:
        part = _stage(plan, index)
        checkpoint.load_rank(folder, plan, rank, [part])
        assert part.lr_scheduler.last_epoch == want, (rank, index)
        assert part.optimizer.param_groups[0]["lr"] == pytest.approx(LR * GAMMA ** want, rel=1e-12)
        for p in part.module.parameters():  # Adam's own step count, per parameter
            assert float(part.optimizer.state[p]["step"]) == want
        # and the next update continues it as uninterrupted training would
        ref = _stepped(copy.deepcopy(part), 1)
        assert ref.lr_scheduler.last_epoch == want + 1


def test_a_stage_mixing_writing_stages_at_different_positions_is_refused(tmp_path: Path) -> None:
    folder = _write_21(tmp_path, (3, 6))
    with pytest.raises(CheckpointError, match=r"stage 0 holds parameters of the writing plan's stages 0 and 1, "
                                              r"whose LR schedulers are at different steps \(3 and 6: "):
        checkpoint.load_rank(folder, ONE_STAGE, 0, [_stage(ONE_STAGE, 0)])
    # at the same position (a synchronous schedule: every stage steps once a minibatch) it resumes
    same = _write_21(tmp_path / "same", (4, 4))
    part = _stage(ONE_STAGE, 0)
    checkpoint.load_rank(same, ONE_STAGE, 0, [part])
    assert part.lr_scheduler.last_epoch == 4
