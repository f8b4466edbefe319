"""The training loop users expect (issue 27 items 1-4), through the emitted program's ranks, against
single-process PyTorch on the same stages: epochs over a DataLoader that each input replica reads its
share of, LR schedules (warm-up + cosine, OneCycleLR, 1F1B's per-update stepping), validation forward
only through the pipeline, and the logs (metrics.jsonl, TensorBoard's event files)."""

from __future__ import annotations

import copy
import functools
import itertools
import json
import os
import shutil
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from _ranks import run_ranks
from pdcompile.api import pdcompile
from pdcompile.runtime import checkpoint, logs, schedules
from pdcompile.runtime.program import Program, build
from pdcompile.runtime.schedules.spec import ScheduleSpec
from pdcompile.runtime.trainer import steps_of
from pdcompile import reference

ROOT = Path(__file__).resolve().parent.parent
M, B = 2, 4  # microbatches per minibatch, samples per microbatch
STEPS_PER_EPOCH = 100 // (M * B)  # 12 full minibatches of the 100 samples; the short 13th is dropped

# What a user writes: a data module (a map-style Dataset, shuffled with a seeded generator, no drop_last),
# LR schedules as functions of the optimizer. FETCH_LOG makes the dataset note each index a rank fetches.
DATA_MODULE = '''
import os
import torch
from torch.utils.data import DataLoader, Dataset

D, C = 6, 3


class Points(Dataset):
    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, D, generator=g)
        self.y = (self.x[:, 0] > 0).long() + (self.x[:, 1] > 0.5).long()

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        if os.environ.get("FETCH_LOG"):
            with open(os.environ["FETCH_LOG"] + "." + os.environ.get("RANK", "ref"), "a") as f:
                f.write(f"{i}\\n")
        return self.x[i], self.y[i]


def train(batch_size):
    return DataLoader(Points(100, 0), batch_size=batch_size, shuffle=True, generator=torch.Generator().manual_seed(1))


def val(batch_size):
    return DataLoader(Points(24, 2), batch_size=batch_size)


def warmup_cosine(optimizer):
    warm = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: (s + 1) / 4)
    cos = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=20)
    return torch.optim.lr_scheduler.SequentialLR(optimizer, [warm, cos], milestones=[4])


def one_cycle(optimizer):
    return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.2, total_steps=30)


def decay(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.8 ** s)


def train_indices(batch_size):  # the sample indices of train()'s minibatches, in order
    from torch.utils.data import TensorDataset
    return DataLoader(TensorDataset(torch.zeros(100), torch.arange(100)), batch_size=batch_size, shuffle=True,
                      generator=torch.Generator().manual_seed(1))


def train_list(batch_size):  # the same minibatches as a list: read whole by every rank, its share kept
    return list(train(batch_size))


def margin(output, target):  # a metric of one microbatch: the mean score of the true class
    return output.gather(1, target[:, None]).mean()
'''


@pytest.fixture
def user(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The user's data module, importable here and by the ranks (PYTHONPATH)."""
    folder = tmp_path / "user"
    folder.mkdir()
    (folder / "loopdata.py").write_text(textwrap.dedent(DATA_MODULE))
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(folder), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    sys.modules.pop("loopdata", None)
    import loopdata  # type: ignore[import-not-found]
    return loopdata


def _emit(tmp: Path, user: Any, schedule: str, replicas: list[int] | None = None) -> Path:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(user.D, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16),
                                torch.nn.ReLU(), torch.nn.Linear(16, user.C))
    pipe = pdcompile(model, example_inputs=(torch.randn(M * B, user.D),), example_target=torch.zeros(M * B, dtype=torch.long),
                     loss_fn=torch.nn.CrossEntropyLoss(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
                     stages=2, replicas=replicas, schedule=schedule, num_microbatches=M)
    return pipe.emit(tmp / f"prog_{schedule}")


def _launch(tmp: Path, prog: Path, args: list[str], env: dict[str, str] | None = None) -> tuple[dict[int, Any], dict[int, Any]]:
    """Run the program's ranks; each rank's metrics JSON and final weights, by rank."""
    n = Program.load(prog).world_size
    rc, log = run_ranks(prog, n, [*args, "--metrics", str(tmp / "metrics"), "--save-final", str(tmp / "final"),
                                  "--timeout", "60"], timeout=180, env=env)
    assert rc == 0, log[-4000:]
    metrics = {json.loads(p.read_text())["rank"]: json.loads(p.read_text()) for p in (tmp / "metrics").glob("rank_*.json")}
    weights = {int(p.name.split("rank_")[1].split(".")[0]): torch.load(p, weights_only=True)
               for p in (tmp / "final").glob("stage_*.rank_*.pt")}
    assert sorted(metrics) == sorted(weights) == list(range(n))
    return metrics, weights


def _minibatches(user: Any, epochs: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The loader's full minibatches, epoch after epoch, as one process reads them."""
    loader = user.train(M * B)
    for _ in range(epochs):
        yield from itertools.islice(loader, STEPS_PER_EPOCH)


def _evaluate(stages: list[torch.nn.Module], loss_fn: Any, user: Any) -> tuple[float, float]:
    """Single-process validation: the mean over microbatches of the loss and the accuracy."""
    losses, accs = [], []
    with torch.no_grad():
        for x, y in user.val(M * B):
            for xm, ym in zip(x.split(B), y.split(B)):
                out = xm
                for m in stages:
                    m.eval()
                    out = m(out)
                    m.train()
                    out = out[0] if isinstance(out, tuple) and len(out) == 1 else out
                losses.append(float(loss_fn(out, ym)))
                accs.append(float((out.argmax(-1) == ym).float().mean()))
    return sum(losses) / len(losses), sum(accs) / len(accs)


def _reference_sync(prog: Path, user: Any, epochs: int, scheduler: str, evals: list[int]) -> dict[str, Any]:
    """Flush/GPipe in one process: per minibatch the M microbatches' gradients (loss / M), one optimizer
    step, one scheduler step; the LR and mean loss of every step, evaluations after the steps in ``evals``."""
    program = Program.load(prog)
    stages = [program.build_stage(k) for k in range(program.num_stages)]
    params = [p for m in stages for p in m.parameters()]
    opt = build(program.raw["optimizer"], params)
    sched = getattr(user, scheduler)(opt)
    loss_fn = program.build_loss()
    out: dict[str, Any] = {"lr": [], "loss": [], "eval": {}}
    for step, (x, y) in enumerate(_minibatches(user, epochs), 1):
        out["lr"].append(opt.param_groups[0]["lr"])
        losses = []
        for xm, ym in zip(x.split(B), y.split(B)):
            h: Any = xm
            for m in stages:
                h = m(*h) if isinstance(h, tuple) else m(h)
            loss = loss_fn(h, ym)
            (loss / M).backward()
            losses.append(float(loss.detach()))
        out["loss"].append(sum(losses) / M)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        if step in evals:
            out["eval"][step] = _evaluate(stages, loss_fn, user)
    out["weights"] = [{n: p.detach().clone() for n, p in m.named_parameters()} for m in stages]
    return out


def _assert_weights(prog: Path, got: dict[int, Any], want: list[dict[str, torch.Tensor]]) -> None:
    program = Program.load(prog)
    initial = [dict(program.build_stage(k).named_parameters()) for k in range(program.num_stages)]
    for rank, w in got.items():
        s = program.stage_of_rank(rank).index
        for n, ref in want[s].items():
            torch.testing.assert_close(w[n], ref, rtol=1e-5, atol=1e-5, msg=lambda m: f"rank {rank} {n}: {m}")
            assert not torch.equal(ref, initial[s][n])  # it trained


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_epochs_warmup_cosine_validation_jsonl_and_tensorboard(tmp_path: Path, user: Any) -> None:
    """flush, 2 epochs of a shuffled DataLoader with a warm-up + cosine schedule and validation every 10
    steps: the weights, every step's LR and loss, and every evaluation equal single-process training;
    metrics.jsonl and TensorBoard's event files hold them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    prog = _emit(tmp_path, user, "flush")
    tb = tmp_path / "tb"
    metrics, weights = _launch(tmp_path, prog, [
        "--epochs", "2", "--data", "loopdata:train", "--lr-scheduler", "loopdata:warmup_cosine",
        "--eval-data", "loopdata:val", "--eval-every", "10", "--eval-metric", "accuracy", "--tensorboard", str(tb)])
    total = 2 * STEPS_PER_EPOCH
    want = _reference_sync(prog, user, 2, "warmup_cosine", [10, 20, total])
    _assert_weights(prog, weights, want["weights"])

    records = [json.loads(line) for line in (tmp_path / "metrics" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["type"] == "train"]
    assert [r["step"] for r in train] == list(range(1, total + 1))
    assert [r["epoch"] for r in train] == [1] * STEPS_PER_EPOCH + [2] * STEPS_PER_EPOCH
    assert [r["lr"] for r in train] == pytest.approx(want["lr"], rel=1e-6)
    assert len(set(want["lr"])) > 10  # the schedule really moved the LR
    assert [r["loss"] for r in train] == pytest.approx(want["loss"], rel=1e-5, abs=1e-6)
    assert all(r["samples_per_s"] > 0 and r["step_time_s"] > 0 and r["peak_memory_mb"] > 10 for r in train)
    times = [r["time_s"] for r in records]  # wall-clock since the run's start, in order (time to accuracy)
    assert times == sorted(times) and 0 < times[0] and times[-1] > sum(r["step_time_s"] for r in train)
    evals = [r for r in records if r["type"] == "eval"]
    assert [r["step"] for r in evals] == [10, 20, total]
    for r in evals:
        loss, acc = want["eval"][r["step"]]
        assert r["loss"] == pytest.approx(loss, rel=1e-5) and r["accuracy"] == pytest.approx(acc, abs=1e-9)
    assert evals[0]["loss"] != pytest.approx(evals[-1]["loss"], rel=1e-3)  # evaluated different weights
    last = metrics[1]
    assert last["steps_per_epoch"] == STEPS_PER_EPOCH and [e["step"] for e in last["eval"]] == [10, 20, total]

    acc = EventAccumulator(str(tb))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/samples_per_s", "train/step_time_s", "eval/loss", "eval/accuracy"} <= tags
    assert [e.step for e in acc.Scalars("train/loss")] == list(range(1, total + 1))
    assert [e.value for e in acc.Scalars("train/lr")] == pytest.approx(want["lr"], rel=1e-6)
    assert [(e.step, e.value) for e in acc.Scalars("eval/loss")] == [
        (s, pytest.approx(want["eval"][s][0], rel=1e-5)) for s in (10, 20, total)]


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_gpipe_one_cycle_with_input_replicas_reading_their_shares(tmp_path: Path, user: Any) -> None:
    """gpipe with the input stage on 2 replicas and OneCycleLR: each replica fetches only the samples of
    its own microbatches (disjoint, together every sample the epochs use), and training and the final
    validation equal single-process training on the whole minibatches."""
    prog = _emit(tmp_path, user, "gpipe", replicas=[2, 1])
    log = tmp_path / "fetch"
    metrics, weights = _launch(tmp_path, prog, [
        "--epochs", "2", "--data", "loopdata:train", "--lr-scheduler", "loopdata:one_cycle",
        "--eval-data", "loopdata:val", "--eval-metric", "accuracy", "--log-every", "5"], env={"FETCH_LOG": str(log)})
    total = 2 * STEPS_PER_EPOCH
    os.environ["FETCH_LOG"] = str(log)  # the reference's fetches, in order, for the shares' check
    try:
        want = _reference_sync(prog, user, 2, "one_cycle", [total])
    finally:
        del os.environ["FETCH_LOG"]
    _assert_weights(prog, weights, want["weights"])
    ref = [int(i) for i in Path(f"{log}.ref").read_text().split()]
    train_ref, val_ref = ref[:total * M * B], ref[total * M * B:]
    # microbatch k of a minibatch goes to replica k % 2 of stage 0: rank 0 the first B samples, rank 1 the rest
    for rank in (0, 1):
        got = [int(i) for i in Path(f"{log}.{rank}").read_text().split()]
        share = [i for n, i in enumerate(train_ref) if (n // B) % M == rank]
        val_share = [i for n, i in enumerate(val_ref) if (n // B) % M == rank]
        assert got == share + val_share, rank
    assert not Path(f"{log}.2").exists()  # the last stage reads no data: its targets are sent
    records = [json.loads(x) for x in (tmp_path / "metrics" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["type"] == "train"] == [5, 10, 15, 20, total]
    assert [r["lr"] for r in records if r["type"] == "train"] == pytest.approx(
        [want["lr"][s - 1] for s in (5, 10, 15, 20, total)], rel=1e-6)
    (ev,) = [r for r in records if r["type"] == "eval"]
    assert (ev["loss"], ev["accuracy"]) == (pytest.approx(want["eval"][total][0], rel=1e-5),
                                            pytest.approx(want["eval"][total][1], abs=1e-9))
    assert metrics[2]["eval"] == [{"step": total, "loss": ev["loss"], "accuracy": ev["accuracy"]}]


class _Stepping:
    """An optimizer whose step also steps its LR scheduler (for reference.train_versioned)."""

    def __init__(self, opt: torch.optim.Optimizer, sched: Any) -> None:
        self.opt, self.sched = opt, sched

    def step(self) -> None:
        self.opt.step()
        self.sched.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.opt.zero_grad(set_to_none=set_to_none)


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_1f1b_steps_the_schedule_once_per_update(tmp_path: Path, user: Any) -> None:
    """1F1B updates after every microbatch, and each stage's scheduler steps with each update (M per
    minibatch): the weights equal PipeDream's weight-stashing reference with the scheduler stepped per
    update, and the final validation (a drained pipeline, the newest weights) equals single-process eval."""
    prog = _emit(tmp_path, user, "1f1b")
    steps = 5
    metrics, weights = _launch(tmp_path, prog, [
        "--steps", str(steps), "--data", "loopdata:train", "--lr-scheduler", "loopdata:decay",
        "--eval-data", "loopdata:val"])
    program = Program.load(prog)
    stages = [program.build_stage(k) for k in range(program.num_stages)]
    opts = [build(program.raw["optimizer"], m.parameters()) for m in stages]
    scheds = [user.decay(o) for o in opts]
    micro = [((xm,), ym) for x, y in itertools.islice(user.train(M * B), steps)
             for xm, ym in zip(x.split(B), y.split(B))]
    fwd, bwd, group = reference.pipedream_1f1b([1, 1])
    reference.train_versioned(stages, [_Stepping(o, s) for o, s in zip(opts, scheds)],  # type: ignore[misc]
                              program.build_loss(), micro, fwd=fwd, bwd=bwd, group=group)
    assert [s.last_epoch for s in scheds] == [steps * M] * 2  # once per update
    _assert_weights(prog, weights, [{n: p.detach() for n, p in m.named_parameters()} for m in stages])
    loss, _ = _evaluate(stages, program.build_loss(), user)
    assert metrics[1]["eval"][0]["step"] == steps and metrics[1]["eval"][0]["loss"] == pytest.approx(loss, rel=1e-5)
    assert "accuracy" not in metrics[1]["eval"][0]


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_pipedream_1f1b_replicas_take_turns_at_whole_minibatches(tmp_path: Path, user: Any) -> None:
    """PipeDream's own 1F1B: one microbatch per minibatch and an input stage of 2 replicas, which take
    minibatches in turns. Each replica fetches from the DataLoader only its turns' samples, also under
    ``--steps`` (before, the other turns fetched an empty batch and failed, and ``--steps`` read every
    minibatch whole), and training equals the same program reading every minibatch whole from a list and
    keeping its share, bitwise."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(user.D, 16), torch.nn.ReLU(), torch.nn.Linear(16, user.C))
    pipe = pdcompile(model, example_inputs=(torch.randn(B, user.D),), example_target=torch.zeros(B, dtype=torch.long),
                     loss_fn=torch.nn.CrossEntropyLoss(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                     stages=2, replicas=[2, 1], schedule="1f1b", num_microbatches=1)
    prog = pipe.emit(tmp_path / "prog")
    log = tmp_path / "fetch"
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    steps = 24  # --steps, not --epochs: the replicas still fetch only their turns (one pass of the 25)
    _, shared = _launch(tmp_path / "a", prog, ["--steps", str(steps), "--data", "loopdata:train"],
                        env={"FETCH_LOG": str(log)})
    _, whole = _launch(tmp_path / "b", prog, ["--steps", str(steps), "--data", "loopdata:train_list"])
    for rank in shared:
        assert shared[rank].keys() == whole[rank].keys()
        for n in shared[rank]:
            assert torch.equal(shared[rank][n], whole[rank][n]), (rank, n)
    batches = [sorted(int(i) for i in y) for _, y in user.train_indices(B)]  # train()'s minibatches, in order
    assert len(batches) == 25
    for r in (0, 1):  # replica r: minibatches r, r + 2, ... and nothing else
        got = sorted(int(i) for i in Path(f"{log}.{r}").read_text().split())
        assert got == sorted(i for n, mb in enumerate(batches[:steps]) if n % 2 == r for i in mb), r


@pytest.mark.parametrize("name", ["1f1b", "2bw", "flush", "gpipe"])
def test_a_segment_cut_mid_rotation_runs_each_microbatch_on_its_replica(name: str) -> None:
    """A segment starting at global microbatch ``o`` (after an evaluation, a checkpoint, a resume) runs
    microbatch ``k`` on replica ``k % r`` of each stage, as the data shares and the executor's peers
    route it, whatever ``o % r`` is: each rank runs the list of :func:`schedules.segment_rank` shifted by
    ``o``. Before, every segment restarted the rotation at its own microbatch 0."""
    for replicas in ([2, 1], [1, 2], [3, 2]):
        where = schedules.stage_ranks(replicas)
        for m in (1, 2, 3):
            spec = ScheduleSpec(name, tuple(replicas), m)
            for first, n in itertools.product(range(4), (1, 2, 5)):
                o = first * m
                for rank in range(sum(replicas)):
                    acts = [schedules.shift(a, o) for a, _ in spec.rank_run(n, schedules.segment_rank(rank, o, where))]
                    got = sorted((a.stage, a.mb) for a in acts if a.kind is schedules.Kind.FORWARD)
                    want = sorted((s, k) for s in range(len(replicas)) for k in range(o, o + n * m)
                                  if schedules.rank_of(s, k, where) == rank)
                    assert got == want, (replicas, m, first, n, rank)


@pytest.mark.parametrize("name", ["1f1b", "2bw", "flush", "gpipe"])
def test_every_logged_minibatchs_losses_are_on_its_last_stage_replicas_at_its_logging_point(name: str) -> None:
    """What the trainer's logging relies on, for each schedule, last-stage replica count, M (below, equal
    to, above and not a multiple of r) and segment start (mid-rotation or not): the last stage's replicas
    reach the same logging points (the minibatches done, Policy.minibatches_done, after the same number
    of steps), and by each one the forwards of every microbatch of the minibatches it logs have run, each
    on its replica, so the replicas' (sum, count) summed (the trainer's all-reduce) give every minibatch
    its M microbatches' losses once; a forward that runs ahead (2BW's F of the next minibatch before the
    step) is kept for its own minibatch's point."""
    policy = schedules.policy(name)
    for replicas in ([1, 2], [2, 2], [1, 3], [2, 3]):
        where, last = schedules.stage_ranks(replicas), len(replicas) - 1
        r = replicas[last]
        for m in (1, 2, 3, 4):
            spec = ScheduleSpec(name, tuple(replicas), m)
            for first, n in itertools.product(range(4), (1, 2, 5)):
                o = first * m
                points = []  # per replica: [(shown, complete, (sum, count) per minibatch)]
                for rank in where[last]:
                    run = spec.rank_run(n, schedules.segment_rank(rank, o, where))
                    chunks = list(steps_of(run, o))
                    unlogged: dict[int, float] = {}
                    mine, shown = [], 0
                    for taken, (actions, _, _) in enumerate(chunks, 1):
                        unlogged.update({a.mb: float(a.mb) for a in actions
                                         if a.kind is schedules.Kind.FORWARD and a.stage == last})
                        complete = n if taken == len(chunks) else policy.minibatches_done(taken, m, r, n)
                        if complete > shown:
                            mine.append((shown, complete, logs.minibatch_sums(unlogged, first + shown, first + complete, m)))
                            shown = complete
                    assert shown == n and not unlogged, (replicas, m, first, n, rank)
                    points.append(mine)
                case = (name, replicas, m, first, n)
                assert all([p[:2] for p in mine] == [p[:2] for p in points[0]] for mine in points), case
                for i, (shown, complete, _) in enumerate(points[0]):
                    total = [sum(p[i][2][0][j] for p in points) for j in range(complete - shown)]
                    count = [sum(p[i][2][1][j] for p in points) for j in range(complete - shown)]
                    mbs = [range((first + shown + j) * m, (first + shown + j + 1) * m) for j in range(complete - shown)]
                    assert count == [m] * len(mbs) and total == [float(sum(ks)) for ks in mbs], case


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_pipedream_1f1b_cut_and_resumed_mid_rotation(tmp_path: Path, user: Any) -> None:
    """PipeDream's 1F1B (one microbatch a minibatch) with a replicated stage whose copies take turns,
    cut where the turn is the second copy's: [2, 1] run 6 minibatches, evaluated after 3 and
    checkpointed after 5; then [1, 2] resumed from that checkpoint (step 5) to 9, evaluated after 6 and
    checkpointed after 7. Before, a segment from such a cut restarted the turns at its own first
    minibatch while the data shares and the peers kept the run's: [2, 1] failed with 'rank 0 did not
    read microbatch 3', [1, 2] with 'forward of microbatch 3 before its target's receive was posted'.

    Weights and evaluations equal PipeDream's 1F1B reference (pdcompile.reference, weight stashing)
    run segment by segment: a cut is a flush, so the minibatches after it start a fresh warm-up on the
    newest weights (the uncut run's would have used stashed ones): the same run, within 1e-6."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(user.D, 16), torch.nn.ReLU(), torch.nn.Linear(16, user.C))
    progs = {}
    for reps in ([2, 1], [1, 2]):
        pipe = pdcompile(model, example_inputs=(torch.randn(B, user.D),), example_target=torch.zeros(B, dtype=torch.long),
                         loss_fn=torch.nn.CrossEntropyLoss(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
                         stages=2, replicas=reps, schedule="1f1b", num_microbatches=1)
        progs[tuple(reps)] = pipe.emit(tmp_path / f"prog_{reps[0]}{reps[1]}")
    ck, ck2 = tmp_path / "ck", tmp_path / "ck2"
    data = ["--data", "loopdata:train", "--eval-data", "loopdata:val", "--eval-every", "3"]
    m1, w1 = _launch(tmp_path / "a", progs[(2, 1)], ["--steps", "6", *data, "--checkpoint-every", "5",
                                                    "--checkpoint-dir", str(ck)])
    shutil.copytree(checkpoint.step_dir(ck, 5), checkpoint.step_dir(ck2, 5))
    m2, w2 = _launch(tmp_path / "b", progs[(1, 2)], ["--steps", "9", *data, "--checkpoint-every", "7",
                                                    "--checkpoint-dir", str(ck2), "--resume"])
    # the reference: the same minibatches, segment by segment, each PipeDream's 1F1B on its replicas
    program = Program.load(progs[(2, 1)])
    stages = [program.build_stage(k) for k in range(2)]
    opts = [build(program.raw["optimizer"], m.parameters()) for m in stages]
    loss_fn = program.build_loss()
    micro = [((x,), y) for x, y in itertools.islice(user.train(B), 9)]

    def train(models: list[torch.nn.Module], optimizers: list[Any], a: int, b: int, reps: list[int]) -> float:
        fwd, bwd, group = reference.pipedream_1f1b(reps)
        reference.train_versioned(models, optimizers, loss_fn, micro[a:b], fwd=fwd, bwd=bwd, group=group)
        return _evaluate(models, loss_fn, user)[0]

    evals = {3: train(stages, opts, 0, 3, [2, 1]), 5: train(stages, opts, 3, 5, [2, 1])}
    stages_b, opts_b = copy.deepcopy((stages, opts))  # the checkpoint after step 5
    evals[6] = train(stages, opts, 5, 6, [2, 1])
    want = [{n: p.detach() for n, p in m.named_parameters()} for m in stages]
    evals_b = {6: train(stages_b, opts_b, 5, 6, [1, 2]), 7: train(stages_b, opts_b, 6, 7, [1, 2]),
               9: train(stages_b, opts_b, 7, 9, [1, 2])}
    want_b = [{n: p.detach() for n, p in m.named_parameters()} for m in stages_b]
    for prog, got, ref in ((progs[(2, 1)], w1, want), (progs[(1, 2)], w2, want_b)):
        for rank, w in got.items():
            s = Program.load(prog).stage_of_rank(rank).index
            for n, t in ref[s].items():
                torch.testing.assert_close(w[n], t, rtol=0, atol=1e-6, msg=lambda e: f"{prog.name} rank {rank} {n}: {e}")
    for metrics, reporter, expected in ((m1, 2, {k: evals[k] for k in (3, 6)}), (m2, 1, {k: evals_b[k] for k in (6, 9)})):
        assert {e["step"]: pytest.approx(e["loss"], rel=1e-5) for e in metrics[reporter]["eval"]} == expected
    # [1, 2] at M = 1: the reporting replica updates every other minibatch, yet metrics.jsonl has one train
    # record per minibatch, numbered as the minibatches are, each before its step's evaluation (the case
    # M = 1 of test_logged_loss_is_each_minibatchs_mean_over_the_last_stages_replicas, in this launch)
    records = [json.loads(line) for line in (tmp_path / "b" / "metrics" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["type"], r["step"]) for r in records] == [("train", 6), ("eval", 6), ("train", 7), ("train", 8),
                                                         ("train", 9), ("eval", 9)]
    assert all(r["step_time_s"] > 0 for r in records if r["type"] == "train")


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_logged_loss_is_each_minibatchs_mean_over_the_last_stages_replicas(tmp_path: Path, user: Any) -> None:
    """A last stage of 3 replicas at M = 2 (fewer microbatches than replicas, not a multiple): microbatch k
    runs on replica k % 3, so the reporting replica (the last stage's first) holds one of a minibatch's
    two microbatches, or none (minibatches 3 and 6: microbatches 4, 5 and 10, 11). 1F1B for 5 minibatches
    (a replica updates once a round of 3 microbatches: its second update completes minibatches 2 and 3),
    evaluated after 3 and checkpointed after 4, so the last segment starts at microbatch 8 (mid-rotation:
    replica 2 first); then resumed from that checkpoint under flush to step 7, evaluated after 6 and 7.

    metrics.jsonl has one train record per minibatch, numbered as the minibatches are, each before its
    step's evaluation (before an earlier fix: a record per M of the replica's updates, numbered by them),
    each holding its minibatch's mean loss over its 2 microbatches, whichever replicas ran them, and every
    evaluation the mean over the validation microbatches, as PipeDream's 1F1B reference (weight stashing,
    segment by segment: a cut is a flush), then synchronous SGD, compute them in one process. Before, a
    record held the mean of the reporting replica's own microbatches since the last logging point: one
    microbatch's loss for a minibatch of two, one value for both minibatches an update completed (steps 2
    and 3), None where the replica ran none of the minibatch (step 6)."""
    prog = _emit(tmp_path, user, "1f1b", replicas=[1, 3])
    ck = tmp_path / "ck"
    data = ["--data", "loopdata:train", "--eval-data", "loopdata:val", "--eval-every", "3", "--checkpoint-dir", str(ck)]
    metrics_a, _ = _launch(tmp_path / "a", prog, ["--steps", "5", *data, "--checkpoint-every", "4"])
    metrics_b, weights = _launch(tmp_path / "b", prog, ["--steps", "7", *data, "--resume", "--schedule", "flush"])

    # the reference: 1F1B on [1, 3] segment by segment; from step 4's state, synchronous SGD
    program = Program.load(prog)
    stages = [program.build_stage(k) for k in range(2)]
    opts = [build(program.raw["optimizer"], m.parameters()) for m in stages]
    loss_fn = program.build_loss()
    micro = [((xm,), ym) for x, y in itertools.islice(user.train(M * B), 7) for xm, ym in zip(x.split(B), y.split(B))]

    def train(models: list[torch.nn.Module], optimizers: list[Any], segments: list[tuple[int, int]],
              sync: bool) -> tuple[list[float], dict[int, float]]:
        """Each microbatch's loss, and the evaluation after each segment by step."""
        losses, evals = [], {}
        for a, b in segments:
            fwd, bwd, group = reference.synchronous(M) if sync else reference.pipedream_1f1b([1, 3])
            losses += reference.train_versioned(models, optimizers, loss_fn, micro[a * M:b * M], fwd=fwd, bwd=bwd,
                                                group=group, scale=1 / M if sync else 1.0)
            evals[b] = _evaluate(models, loss_fn, user)[0]
        return losses, evals

    micro_a, evals_a = train(stages, opts, [(0, 3), (3, 4)], sync=False)
    stages_b, opts_b = copy.deepcopy((stages, opts))  # the checkpoint of step 4
    more, after = train(stages, opts, [(4, 5)], sync=False)
    micro_a, evals_a = micro_a + more, {**evals_a, **after}
    micro_b, evals_b = train(stages_b, opts_b, [(4, 6), (6, 7)], sync=True)
    _assert_weights(prog, weights, [{n: p.detach() for n, p in m.named_parameters()} for m in stages_b])
    want_a = {s + 1: sum(micro_a[s * M:(s + 1) * M]) / M for s in range(5)}  # by step, 1-based
    want_b = {s + 5: sum(micro_b[s * M:(s + 1) * M]) / M for s in range(3)}
    assert len({round(x, 6) for x in want_a.values()}) == 5  # distinct: no minibatch's value stands for another's
    order = {"a": [("train", 1), ("train", 2), ("train", 3), ("eval", 3), ("train", 4), ("train", 5), ("eval", 5)],
             "b": [("train", 5), ("train", 6), ("eval", 6), ("train", 7), ("eval", 7)]}
    for folder, want, evals in (("a", want_a, {3: evals_a[3], 5: evals_a[5]}), ("b", want_b, evals_b)):
        records = [json.loads(x) for x in (tmp_path / folder / "metrics" / "metrics.jsonl").read_text().splitlines()]
        assert [(r["type"], r["step"]) for r in records] == order[folder]
        assert all(r["step_time_s"] > 0 for r in records if r["type"] == "train")
        train_recs = {r["step"]: r["loss"] for r in records if r["type"] == "train"}
        assert list(train_recs) == sorted(want) and None not in train_recs.values(), (folder, train_recs)
        assert train_recs == pytest.approx(want, rel=1e-5), folder
        assert {r["step"]: r["loss"] for r in records if r["type"] == "eval"} == pytest.approx(evals, rel=1e-5), folder
    # the reporting replica's updates: 1F1B rounds of 3 microbatches (segments of 6, 2, 2), then flush's one a step
    assert (len(metrics_a[1]["step_times_s"]), len(metrics_b[1]["step_times_s"])) == (2 + 1 + 1, 3)
    # rank_N.json: each replica its own microbatches' losses, merged in microbatch order (RunResult.metrics)
    assert logs.last_stage_losses(list(metrics_a.values())) == pytest.approx(micro_a, rel=1e-5)
    assert logs.last_stage_losses(list(metrics_b.values())) == pytest.approx(micro_b, rel=1e-5)


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_run_streams_epochs_with_lr_scheduler_and_validation(tmp_path: Path, user: Any, forked_run: None) -> None:
    """The API: ``pdcompile(lr_scheduler=)`` goes into plan.json; ``run(loader, epochs=, eval_data=,
    eval_every="epoch")`` streams the minibatches to the ranks (no data file) and trains and evaluates as
    single-process PyTorch does."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(user.D, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16),
                                torch.nn.ReLU(), torch.nn.Linear(16, user.C))
    opt = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
    pipe = pdcompile(model, example_inputs=(torch.randn(M * B, user.D),), loss_fn=torch.nn.CrossEntropyLoss(),
                     optimizer=opt, stages=2, schedule="flush", num_microbatches=M, lr_scheduler=user.warmup_cosine)
    result = pipe.run(user.train(M * B), epochs=2, eval_data=user.val(M * B), eval_every="epoch",
                      eval_metric="accuracy", out=tmp_path / "run", timeout=240)
    plan = json.loads((result.program / "plan.json").read_text())
    assert plan["lr_scheduler"] == {"factory": "loopdata:warmup_cosine", "kwargs": {}}
    assert not list((tmp_path / "run").rglob("data.pt"))  # streamed, not saved
    total = 2 * STEPS_PER_EPOCH
    want = _reference_sync(result.program, user, 2, "warmup_cosine", [STEPS_PER_EPOCH, total])
    got, program = result.state_dict(), Program.load(result.program)
    names = [(program.stages[s].param_names[n], ref) for s, w in enumerate(want["weights"]) for n, ref in w.items()]
    assert sorted(n for n, _ in names) == sorted(n for n, _ in model.named_parameters())
    for name, ref in names:  # under the model's own names
        torch.testing.assert_close(got[name], ref, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
    assert [e["step"] for e in result.metrics["eval"]] == [STEPS_PER_EPOCH, total]  # after each epoch
    for e in result.metrics["eval"]:
        assert e["loss"] == pytest.approx(want["eval"][e["step"]][0], rel=1e-5)
        assert e["accuracy"] == pytest.approx(want["eval"][e["step"]][1], abs=1e-9)


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_validation_with_virtual_stages_and_a_metric_function(tmp_path: Path, user: Any) -> None:
    """interleaved-1f1b puts stages 0 and 2 on rank 0, 1 and 3 on rank 1: validation walks each rank's
    stages microbatch by microbatch, the targets sent from stage 0's rank to stage 3's first of their
    messages; its loss and a user's metric function equal single-process evaluation of the final weights."""
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Linear(user.D, 16)]
    for _ in range(3):
        layers += [torch.nn.ReLU(), torch.nn.Linear(16, 16 if len(layers) < 5 else user.C)]
    pipe = pdcompile(torch.nn.Sequential(*layers), example_inputs=(torch.randn(M * B, user.D),),
                     example_target=torch.zeros(M * B, dtype=torch.long), loss_fn=torch.nn.CrossEntropyLoss(),
                     optimizer=lambda p: torch.optim.SGD(p, lr=0.1), stages=4, schedule="interleaved-1f1b",
                     num_microbatches=M, virtual_stages=2)
    prog = pipe.emit(tmp_path / "prog")
    program = Program.load(prog)
    assert [list(s.ranks) for s in program.stages] == [[0], [1], [0], [1]]
    metrics, weights = _launch(tmp_path, prog, ["--steps", "3", "--data", "loopdata:train", "--targets", "send",
                                                "--eval-data", "loopdata:val", "--eval-metric", "loopdata:margin"])
    stages = []
    for k in range(4):
        m = program.build_stage(k)
        m.load_state_dict(torch.load(tmp_path / "final" / f"stage_{k}.rank_{k % 2}.pt", weights_only=True))
        stages.append(m)
    loss_fn = program.build_loss()
    losses, margins = [], []
    with torch.no_grad():
        for x, y in user.val(M * B):
            for xm, ym in zip(x.split(B), y.split(B)):
                h: Any = (xm,)
                for m in stages:
                    h = m(*h) if isinstance(h, tuple) else m(h)
                losses.append(float(loss_fn(h, ym)))
                margins.append(float(user.margin(h, ym)))
    (ev,) = metrics[1]["eval"]
    assert ev["loss"] == pytest.approx(sum(losses) / len(losses), rel=1e-5)
    assert ev["margin"] == pytest.approx(sum(margins) / len(margins), rel=1e-5)


def test_loop_flags_refused_with_cause_and_fix(tmp_path: Path, user: Any) -> None:
    from pdcompile.errors import UsageError
    from pdcompile.runtime import launch

    prog = _emit(tmp_path, user, "flush")
    program = Program.load(prog)

    def check(*argv: str) -> None:
        launch.check_args(launch.parse_args(list(argv), program), program, world=2)

    check("--epochs", "2", "--eval-data", "loopdata:val", "--eval-every", "5")
    for argv, says in [(["--epochs", "2", "--steps", "3"], "both given"), (["--epochs", "0"], "--epochs 0"),
                       (["--eval-every", "5"], "needs --eval-data"),
                       (["--eval-data", "loopdata:val", "--eval-every", "epoch"], "needs --epochs"), (["--lr-scheduler", "loopdata"], "MODULE:FUNCTION"),
                       (["--eval-data", "loopdata:nothing"], "can't import"), (["--log-every", "0"], "--log-every 0")]:
        with pytest.raises(UsageError, match=says):
            check(*argv)


def test_log_records_count_tokens_for_token_inputs(tmp_path: Path) -> None:
    """A record per --log-every steps: the interval's mean loss and step time, samples/s, and tokens/s
    when the first input is token ids (samples x tokens per sample)."""
    import argparse

    from pdcompile.runtime.logs import RunLog, tokens_per_sample
    from pdcompile.runtime.program import TensorSpec

    ids = TensorSpec.from_json({"shape": [4, 16], "dtype": "int64", "requires_grad": False})
    feats = TensorSpec.from_json({"shape": [4, 16], "dtype": "float32", "requires_grad": False})
    assert tokens_per_sample([ids]) == 16 and tokens_per_sample([feats]) is None
    args = argparse.Namespace(metrics=str(tmp_path), tensorboard=None, log_every=2)
    run = RunLog(args, True, total=3, start=0, per_epoch=2, samples_per_step=8, tokens=16, device=torch.device("cpu"))
    for step, (loss, secs) in enumerate([(1.0, 0.5), (3.0, 1.5), (5.0, 1.0)], 1):
        run.step(step, loss, 0.1 * step, secs)
    run.close()
    recs = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["epoch"], r["loss"], r["lr"]) for r in recs] == [(2, 1, 2.0, 0.2), (3, 2, 5.0, pytest.approx(0.3))]
    assert recs[0]["step_time_s"] == 1.0 and recs[0]["samples_per_s"] == 8.0 and recs[0]["tokens_per_s"] == 128.0


@pytest.mark.multiproc
@pytest.mark.timeout(200)
def test_run_says_when_the_streamed_data_runs_out(tmp_path: Path, user: Any, forked_run: None) -> None:
    """run(data, steps=5) over 3 minibatches: the ranks stop and run() names the data as the cause."""
    from pdcompile.errors import UsageError

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(user.D, 8), torch.nn.ReLU(), torch.nn.Linear(8, user.C))
    pipe = pdcompile(model, example_inputs=(torch.randn(M * B, user.D),), loss_fn=torch.nn.CrossEntropyLoss(),
                     stages=2, num_microbatches=M)
    data = [(torch.randn(M * B, user.D), torch.zeros(M * B, dtype=torch.long))] * 3
    with pytest.raises(UsageError, match="the data ran out after 3 minibatches; 5 are needed"):
        pipe.run(data, steps=5, out=tmp_path / "run", timeout=150)
