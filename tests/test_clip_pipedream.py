"""Global-norm gradient clipping for PipeDream 1F1B (weight stashing) and 2BW (issue 17 item 4).

Defined per update: at a stage's k-th optimizer step the gradient it is about to apply is scaled by
``min(1, max_norm / (norm_k + 1e-6))``, ``norm_k`` the L2 norm over every stage's gradient of its
k-th update (which holds the same microbatches on every stage), each stage counted once, each
tied parameter once. So every ``ST`` is a collective over all ranks: the schedule checks below show
it cannot deadlock where it is allowed, and the runs through torchrun equal
:func:`pdcompile.reference.train_versioned` with ``max_norm``, computed in one process.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
from _emitted import stages_and_microbatches
import torch

from pdcompile import reference
from pdcompile.api import pdcompile
from pdcompile.errors import ScheduleError, UsageError
from _ranks import run_ranks
from pdcompile.runtime import launch as runtime_launch
from pdcompile.runtime import schedules
from pdcompile.runtime.program import Program
from pdcompile.runtime.schedules import Action, Kind
from pdcompile.zoo import get

STEPS = 4
MICRO = 2
BATCH = 8
LR = 0.05

# the 1f1b/2bw configurations the schedule and runtime tests use
REPLICAS = [[1], [1, 1], [1, 1, 1], [2, 1], [1, 2], [2, 1, 1], [2, 2], [1, 1, 1, 1], [3, 1], [2, 2, 2]]


def _opt(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


# -- the schedules: ST as a collective over all ranks ------------------------------------------------

@pytest.mark.parametrize("name", ["1f1b", "2bw", "flush", "gpipe", "zb-h1"])
def test_every_step_a_collective_does_not_deadlock(name: str) -> None:
    """Where every stage's k-th update holds the same microbatches (every schedule but 1f1b with
    different replica counts), replay and the NCCL transfer-order check complete with ``ST`` a
    collective over all ranks, the receives posted where the transfer plan puts them; elsewhere
    the stages step different numbers of times, which deadlocks, and clipping is refused."""
    checked = 0
    for reps in REPLICAS:
        for m in (1, 2, 3, 4):
            for tied in (False, True):
                for vs in ((False, True) if name == "1f1b" else (False,)):
                    for sb in ((False, True) if name in ("flush", "gpipe") else (name == "zb-h1",)):
                        same = name != "1f1b" or len(set(reps)) == 1
                        if same:
                            schedules.check_global_steps(name, reps, m, tied=tied, vertical_sync=vs, split_backward=sb)
                            checked += 1
                            continue
                        with pytest.raises(UsageError, match="different numbers of steps.*same number of replicas"):
                            schedules.check_global_steps(name, reps, m, tied=tied, vertical_sync=vs, split_backward=sb)
                        if tied:  # make_schedule refuses it too (TG could not sum step by step)
                            continue
                        sched = schedules.make_schedule(name, reps, m, num_steps=3, tied=tied, vertical_sync=vs)
                        schedules.replay(sched, reps)  # fine as it is,
                        with pytest.raises(ScheduleError, match="no deadlock"):  # not with ST a collective
                            schedules.replay(sched, reps, step_collective=True)
    assert checked >= 40


def test_step_collective_in_the_models() -> None:
    """A schedule that completes only while ``ST`` is local: replay and check_transfers name the
    deadlock with ``step_collective``; send_release may use the ST meetings (never later releases)."""
    F, B, ST, SF, RF, SB, RB = (Kind.FORWARD, Kind.BACKWARD, Kind.STEP, Kind.SEND_ACT, Kind.RECV_ACT,
                                Kind.SEND_GRAD, Kind.RECV_GRAD)
    sched = {0: [Action(0, ST), Action(0, F, 0), Action(0, SF, 0), Action(0, RB, 0), Action(0, B, 0)],
             1: [Action(1, RF, 0), Action(1, F, 0), Action(1, B, 0), Action(1, SB, 0), Action(1, ST)]}
    schedules.replay(sched, [1, 1])
    schedules.check_transfers(sched, [1, 1])
    with pytest.raises(ScheduleError, match="rank 0 waits at 0ST.*rank 1 waits at 1RF0"):
        schedules.replay(sched, [1, 1], step_collective=True)
    with pytest.raises(ScheduleError, match="transfer order.*stuck: rank 0 at 0ST"):
        schedules.check_transfers(sched, [1, 1], step_collective=True)
    for name, reps in (("1f1b", [1, 1, 1]), ("2bw", [2, 1, 1]), ("1f1b", [2, 2])):
        sched = schedules.make_schedule(name, reps, MICRO, num_steps=4)
        plain, meet = schedules.send_release(sched, reps), schedules.send_release(sched, reps, step_collective=True)
        for r in sched:
            at = {b: i for i, bs in plain[r].items() for b in bs}
            at_meet = {b: i for i, bs in meet[r].items() for b in bs}
            assert all(b in at_meet and at_meet[b] <= i for b, i in at.items()), (name, reps, r)
        assert sum(map(len, meet[0].values())) >= sum(map(len, plain[0].values()))


# -- the API and train.py flags ----------------------------------------------------------------------

def test_clipping_allowed_and_refused(tmp_path: Path) -> None:
    z = get("mlp", batch_size=BATCH, seed=0)
    kw: dict[str, Any] = dict(example_inputs=z.example_inputs, example_target=z.target, loss_fn=z.loss_fn,
                              optimizer=_opt, num_microbatches=MICRO)
    for schedule, replicas in (("1f1b", None), ("1f1b", [2, 2]), ("2bw", [2, 1])):
        pipe = pdcompile(z.model, stages=2, replicas=replicas, schedule=schedule, clip_grad_norm=1.0, **kw)
        assert pipe.options.clip_grad_norm == 1.0
    with pytest.raises(UsageError, match="clip_grad_norm= with schedule='1f1b'.*stage 0 updates once per 2.*"
                                         "stage 1 once per 1.*same number of replicas.*drop clip_grad_norm="):
        pdcompile(z.model, stages=2, replicas=[2, 1], schedule="1f1b", clip_grad_norm=1.0, **kw)
    prog = pdcompile(z.model, stages=2, replicas=[2, 1], schedule="flush", clip_grad_norm=1.0, **kw).emit(
        tmp_path / "prog", data={"factory": "pdcompile.zoo:batches", "kwargs": {"name": "mlp"}})
    program = Program.load(prog)
    runtime_launch.check_args(runtime_launch.parse_args(["--schedule", "2bw"], program), program, world=3)
    args = runtime_launch.parse_args(["--schedule", "1f1b"], program)
    assert args.clip_grad_norm == 1.0
    with pytest.raises(UsageError, match="--clip-grad-norm with --schedule 1f1b: 1f1b on replicas \\[2, 1\\].*"
                                         "same number of replicas"):
        runtime_launch.check_args(args, program, world=3)
    runtime_launch.check_args(argparse.Namespace(**{**vars(args), "clip_grad_norm": None}), program, world=3)


# -- through torchrun, against the single-process reference ------------------------------------------

def _emit(tmp: Path, name: str, stages: int, replicas: list[int] | None) -> Path:
    z = get(name, batch_size=BATCH, seed=0)
    pipe = pdcompile(z.model, example_inputs=z.example_inputs, example_target=z.target, loss_fn=z.loss_fn,
                     optimizer=_opt, stages=stages, schedule="flush", num_microbatches=MICRO,
                     leaf_modules=z.leaf_modules, replicas=replicas)
    return pipe.emit(tmp / "prog", data={"factory": "pdcompile.zoo:batches", "kwargs": {"name": name}})


def _reference(prog: Path, name: str, schedule: str, replicas: list[int], vertical_sync: bool,
               max_norm: float | None) -> tuple[list[dict[str, torch.Tensor]], list[float]]:
    """Each stage's final parameters, and each update's unclipped global norm, in one process."""
    program, stages, optimizers, micro = stages_and_microbatches(prog, name, STEPS, MICRO)
    if schedule == "1f1b":
        fwd, bwd, group = reference.pipedream_1f1b(replicas, vertical_sync=vertical_sync)
        scale = 1.0
    else:
        fwd, bwd, group = reference.pipedream_2bw(MICRO)
        scale = 1.0 / MICRO
    tied = [[(s, n) for s, n in grp] for grp in program.raw.get("tied", [])]
    norms: list[float] = []
    reference.train_versioned(stages, optimizers, program.build_loss(), micro, fwd=fwd, bwd=bwd, group=group,
                              scale=scale, tied=tied, max_norm=max_norm if max_norm is not None else float("inf"),
                              norms=norms)
    return [{k: p.detach() for k, p in m.named_parameters()} for m in stages], norms


def _rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / (b.abs().max() + 1e-12))


CASES = [  # (model, stages, schedule, replicas, vertical sync)
    ("mlp", 3, "2bw", [2, 1, 1], False),
    ("mlp", 3, "1f1b", [1, 1, 1], True),
    ("mlp", 2, "1f1b", [2, 2], False),
    ("gpt", 3, "1f1b", [1, 1, 1], False),  # the tied embedding: stage 0 and stage 2
    ("gpt", 3, "2bw", [1, 1, 1], False),
]


@pytest.mark.multiproc
@pytest.mark.timeout(400)
@pytest.mark.parametrize("name,stages,schedule,replicas,vs", CASES, ids=[
    f"{n}-{sch}-{'x'.join(map(str, r))}{'-vsync' if v else ''}" for n, _, sch, r, v in CASES])
def test_clipped_pipedream_equals_reference(tmp_path: Path, name: str, stages: int, schedule: str,
                                            replicas: list[int], vs: bool) -> None:
    prog = _emit(tmp_path, name, stages, replicas)
    program = Program.load(prog)
    if name == "gpt":
        assert program.raw.get("tied"), "the GPT zoo model ties its embedding across stages"
    # a threshold under most updates' norms, so clipping happens (and changes the result)
    unclipped, free_norms = _reference(prog, name, schedule, replicas, vs, None)
    max_norm = 0.8 * sorted(free_norms)[len(free_norms) // 2]
    want, norms = _reference(prog, name, schedule, replicas, vs, max_norm)
    groups = STEPS * MICRO // replicas[0] if schedule == "1f1b" else STEPS
    assert len(norms) == groups and sum(n > max_norm for n in norms) >= 2, (norms, max_norm)
    extra = ["--vertical-sync"] if vs else []
    rc, log = run_ranks(prog, program.world_size, ["--schedule", schedule, "--steps", str(STEPS), "--clip-grad-norm",
                                                   repr(max_norm), "--save-final", str(tmp_path / "final"),
                                                   "--metrics", str(tmp_path / "metrics"), "--timeout", "60", *extra],
                        timeout=300)
    assert rc == 0, log[-4000:]
    got = {int(p.name.split("rank_")[1].split(".")[0]): torch.load(p, weights_only=True)
           for p in (tmp_path / "final").glob("stage_*.rank_*.pt")}
    metrics = {int(p.stem.split("_")[1]): json.loads(p.read_text()) for p in (tmp_path / "metrics").glob("rank_*.json")}
    assert sorted(got) == sorted(metrics) == list(range(program.world_size))
    for rank, m in metrics.items():  # every rank met every update's global norm, the reference's
        assert m["grad_norms"] == pytest.approx(norms, rel=1e-5), (rank, m["grad_norms"], norms)
    worst = 0.0
    for rank, w in got.items():
        s = program.stage_of_rank(rank).index
        for k, ref in want[s].items():
            d = _rel_diff(w[k], ref)
            worst = max(worst, d)
            assert d <= 1e-6, f"rank {rank} {k}: relative difference {d:.2e} from the reference"
    # clipping changed the result: the unclipped reference ends elsewhere
    moved = max(_rel_diff(unclipped[s][k], want[s][k]) for s in range(stages) for k in want[s])
    assert moved > 1e3 * max(worst, 1e-9), (moved, worst)
