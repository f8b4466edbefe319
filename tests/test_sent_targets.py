"""``--targets send`` with virtual stages on more than 2 ranks (issue 16): the targets from the first
stage's rank to the last stage's share that pair of ranks with chunk hand-overs (stage p-1 -> p and
its gradients back), and NCCL pairs a pair's transfers in issue order. A step's targets go as one
block at its start on both sides (``TargetPosts``' window), which both executors derive from the
same action lists; checked without torch, then trained through torchrun under the NCCL-rules mode
(tests/conftest.py) to the weights ``--targets local`` gives."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdcompile.errors import ScheduleError, UsageError
from pdcompile.runtime.schedules import layout, make_schedule
from pdcompile.runtime.schedules.transfers import TargetPosts, check_transfers, target_window

INTERLEAVED = ("interleaved-1f1b", "looped-bfs")


def _configs(v: int = 2):  # noqa: ANN202
    for name in INTERLEAVED:
        for p in (3, 4):
            for m in range(4, 13):
                if name == "interleaved-1f1b" and m % max(1, m // p):
                    continue  # interleaved 1F1B needs M a multiple of its rounds
                reps = [1] * (p * v)
                yield name, p, m, reps, layout(name, reps, m, 1, virtual_stages=v).stage_ranks


def test_target_posts_window() -> None:
    """Window 1: up to ``k`` (one stage per rank, as before); a window of M: the whole step, once;
    replicas step through their own microbatches; a filter (--targets local's check) keeps its own."""
    t = TargetPosts(0, 1)
    assert (t.upto(0), t.upto(2), t.upto(2)) == ([0], [1, 2], [])
    t = TargetPosts(4, 1, window=4)
    assert (t.upto(4), t.upto(7), t.upto(8)) == ([4, 5, 6, 7], [], [8, 9, 10, 11])
    t = TargetPosts(1, 2, window=6)
    assert (t.upto(1), t.upto(5), t.upto(6)) == ([1, 3, 5], [], [7, 9, 11])
    t = TargetPosts(0, 1, targets={0, 1}, window=4)
    assert (t.upto(0), t.upto(4)) == ([0, 1], [])


def test_sent_targets_order_on_interleaved_placements() -> None:
    """Interleaved 1F1B and looped BFS on 3 and 4 ranks, 2 stages per rank, M 4..12, tied or not,
    1 and 2 steps: every transfer pairs under NCCL's rules with every target sent (and with only
    the first, --targets local's check); the window is the step, read off the actions."""
    n = 0
    for name, p, m, reps, pl in _configs():
        for tied in (False, True):
            for steps in (1, 2):
                sched = make_schedule(name, reps, m, virtual_stages=2, num_steps=steps, tied=tied)
                assert target_window(sched, pl) == m
                for targets in (None, range(1)):
                    check_transfers(sched, reps, targets=targets, name=name, placement=pl)
                n += 1
    assert n > 50


def test_three_stages_per_rank_and_one_stage_per_rank() -> None:
    """v = 3 orders too; one stage per rank keeps the window 1 (the per-microbatch rule)."""
    for name, p, m, reps, pl in _configs(v=3):
        sched = make_schedule(name, reps, m, virtual_stages=3, num_steps=2)
        check_transfers(sched, reps, targets=None, name=name, placement=pl)
    sched = make_schedule("1f1b", [1, 1, 1], 4, num_steps=2)
    assert target_window(sched, [[0], [1], [2]]) == 1


def test_per_microbatch_targets_could_not_be_ordered() -> None:
    """The cause: sent with its ``F k`` and posted with the ``RF k`` of the last stage's rank, ``T k``
    meets that rank's receives of stage p's gradients (posted ahead of the RF carrying T 4, T 5), or
    on 4 ranks its send of stage 3's activations before it posts T 2: no order both sides issue."""
    sched = make_schedule("interleaved-1f1b", [1] * 6, 6, virtual_stages=2, num_steps=2)
    pl = [[s % 3] for s in range(6)]
    with pytest.raises(ScheduleError, match="send 0T4, but rank 2's is to receive 3G0"):
        check_transfers(sched, [1] * 6, targets=None, placement=pl, target_step=1)
    sched = make_schedule("looped-bfs", [1] * 8, 4, virtual_stages=2, num_steps=2)
    with pytest.raises(ScheduleError, match="stuck"):
        check_transfers(sched, [1] * 8, targets=None, placement=[[s % 4] for s in range(8)], target_step=1)
    check_transfers(sched, [1] * 8, targets=None, placement=[[s % 4] for s in range(8)])


def test_refuse_sent_targets_lets_interleaved_on_more_ranks_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """train.py no longer refuses these; a schedule whose targets still cannot be ordered is refused
    before anything starts, with the way out."""
    from pdcompile.runtime import run_schedule as launch
    from pdcompile.runtime.schedules.spec import ScheduleSpec

    for name, p, m in (("interleaved-1f1b", 3, 6), ("interleaved-1f1b", 4, 8), ("looped-bfs", 4, 4),
                       ("looped-bfs", 3, 3)):
        launch.refuse_sent_targets(ScheduleSpec(name, (1,) * (2 * p), m, virtual_stages=2))

    def broken(*args: object, **kw: object) -> None:
        raise ScheduleError("stuck")

    monkeypatch.setattr(launch, "check_transfers", broken)
    with pytest.raises(UsageError, match="--targets local"):
        launch.refuse_sent_targets(ScheduleSpec("interleaved-1f1b", (1,) * 6, 6, virtual_stages=2))


STEPS, MICRO, BATCH = 2, 6, 12  # M = 6 on 3 ranks: per-microbatch targets could not be ordered (above)


def _opt(params):  # noqa: ANN001, ANN202
    import torch

    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


@pytest.mark.multiproc
@pytest.mark.timeout(300)
# each model and each schedule once (the suite's time budget; check_transfers covers every placement)
@pytest.mark.parametrize("name,schedule", [("mlp", "looped-bfs"), ("gpt", "interleaved-1f1b")])
def test_sent_targets_train_as_local_ones_on_three_ranks(tmp_path: Path, name: str, schedule: str) -> None:
    """6 stages on 3 ranks (GPT: the embedding on rank 0 tied to the head on rank 2): the same weights,
    bitwise, with the targets sent as read locally; rank 0 sent every target (more bytes)."""
    import torch

    from pdcompile.api import pdcompile
    from _ranks import run_ranks
    from pdcompile.merge import merge_weights
    from pdcompile.zoo import get

    z = get(name, batch_size=BATCH, seed=0)
    initial = {k: v.detach().clone() for k, v in z.model.named_parameters()}
    pipe = pdcompile(z.model, example_inputs=z.example_inputs, example_target=z.target, loss_fn=z.loss_fn,
                     optimizer=_opt, stages=6, virtual_stages=2, schedule=schedule, num_microbatches=MICRO,
                     leaf_modules=z.leaf_modules)
    prog = pipe.emit(tmp_path / "prog", data={"factory": "pdcompile.zoo:batches", "kwargs": {"name": name}})
    plan = json.loads((prog / "plan.json").read_text())
    assert plan["world_size"] == 3 and [s["ranks"] for s in plan["stages"]] == [[s % 3] for s in range(6)]
    got, sent = {}, {}
    for targets in ("send", "local"):
        out = tmp_path / targets
        rc, log = run_ranks(prog, 3, ["--steps", str(STEPS), "--save-final", str(out), "--timeout", "60",
                                      "--metrics", str(out / "metrics"), "--targets", targets], timeout=120)
        assert rc == 0, log[-3000:]
        got[targets] = merge_weights(prog, out)
        sent[targets] = sum(json.loads((out / "metrics" / "rank_0.json").read_text())["p2p_bytes_sent"].values())
    assert set(initial) <= set(got["send"])
    for k in got["send"]:
        assert torch.equal(got["send"][k], got["local"][k]), f"{name} {schedule}: {k}"
    assert sum(not torch.equal(got["send"][k], initial[k]) for k in initial) > len(initial) // 2
    assert sent["send"] > sent["local"]
