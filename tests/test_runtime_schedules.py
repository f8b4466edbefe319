"""Every schedule, run through torchrun, trains what its paper defines (single-process reference).

Each launch checks several things at once (a launch costs seconds): every rank's final weights
against :mod:`pdcompile.reference`, and the weight versions each rank measured alive
against what the schedule promises.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from _emitted import stages_and_microbatches
import torch

from pdcompile.api import pdcompile
from _ranks import run_ranks
from pdcompile import reference
from pdcompile.runtime import schedules
from pdcompile.runtime.program import Program
from pdcompile.zoo import get

# one worker for the file (tests/conftest.py): ``emit``'s programs, shared by its tests, are compiled once
pytestmark = [pytest.mark.timeout(120), pytest.mark.multiproc, pytest.mark.xdist_group("runtime_schedules")]

STEPS = 10  # past rank_run's layout-whole threshold: the runtime runs the repeating period
MICRO = 2
BATCH = 8
LR = 0.05


def _opt(params):  # noqa: ANN001, ANN202
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


_PROGRAMS: dict[tuple[str, int, tuple[int, ...] | None], Path] = {}


@pytest.fixture(scope="module")
def emit(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Compile and emit each (model, stages, replicas) once; the schedule is chosen at launch."""
    def get_program(name: str, stages: int, replicas: list[int] | None = None) -> Path:
        key = (name, stages, tuple(replicas) if replicas else None)
        if key not in _PROGRAMS:
            z = get(name, batch_size=BATCH, seed=0)
            pipe = pdcompile(z.model, example_inputs=z.example_inputs, example_target=z.target, loss_fn=z.loss_fn,
                             optimizer=_opt, stages=stages, schedule="flush", num_microbatches=MICRO,
                             leaf_modules=z.leaf_modules, replicas=replicas)
            _PROGRAMS[key] = pipe.emit(tmp_path_factory.mktemp(f"{name}{stages}") / "prog",
                                       data={"factory": "pdcompile.zoo:batches", "kwargs": {"name": name}})
        return _PROGRAMS[key]
    return get_program


def _run(tmp: Path, prog: Path, schedule: str,
         extra: list[str] = ()) -> tuple[dict[int, dict[str, torch.Tensor]], dict[int, Any]]:
    """Launch ``schedule``; return each rank's final weights and metrics."""
    nproc = Program.load(prog).world_size
    rc, log = run_ranks(prog, nproc, ["--schedule", schedule, "--steps", str(STEPS), "--save-final",
                                      str(tmp / "final"), "--metrics", str(tmp / "metrics"), "--timeout", "60", *extra],
                        timeout=100)
    assert rc == 0, log[-4000:]
    weights = {int(p.name.split("rank_")[1].split(".")[0]): torch.load(p, weights_only=True)
               for p in (tmp / "final").glob("stage_*.rank_*.pt")}
    metrics = {int(p.stem.split("_")[1]): json.loads(p.read_text()) for p in (tmp / "metrics").glob("rank_*.json")}
    assert sorted(weights) == sorted(metrics) == list(range(nproc))
    # sends are let go once their receivers took them (schedules.send_release): a rank holds about
    # one step's worth, however long the run (it held all STEPS * MICRO of them before)
    assert all(m["sends_in_flight"] <= MICRO + 2 for m in metrics.values()), {r: m["sends_in_flight"] for r, m in metrics.items()}
    return weights, metrics


def _reference(prog: Path, name: str, versions: tuple[Any, Any, Any], scale: float) -> list[dict[str, torch.Tensor]]:
    """Each stage's final parameters under ``versions`` = (fwd, bwd, group), from the initial weights."""
    program, stages, optimizers, micro = stages_and_microbatches(prog, name, STEPS, MICRO)
    fwd, bwd, group = versions
    tied = [[(s, n) for s, n in grp] for grp in program.raw.get("tied", [])]
    reference.train_versioned(stages, optimizers, program.build_loss(), micro, fwd=fwd, bwd=bwd,
                              group=group, scale=scale, tied=tied)
    return [{k: p.detach() for k, p in m.named_parameters()} for m in stages]


def _assert_matches(prog: Path, got: dict[int, dict[str, torch.Tensor]], want: list[dict[str, torch.Tensor]],
                    what: str) -> None:
    program = Program.load(prog)
    initial = [dict(program.build_stage(k).named_parameters()) for k in range(program.num_stages)]
    for rank, tensors in got.items():
        s = program.stage_of_rank(rank).index
        for k, w in want[s].items():
            torch.testing.assert_close(tensors[k], w, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what} rank {rank} {k}: {m}")
        assert any(not torch.equal(want[s][k], initial[s][k]) for k in want[s]), f"{what}: stage {s} never trained"


def _max_rel_diff(got: dict[int, dict[str, torch.Tensor]], want: list[dict[str, torch.Tensor]], prog: Path) -> float:
    program = Program.load(prog)
    worst = 0.0
    for rank, tensors in got.items():
        s = program.stage_of_rank(rank).index
        for k, w in want[s].items():
            worst = max(worst, float((tensors[k] - w).abs().max() / (w.abs().max() + 1e-12)))
    return worst


def _versions_promised(metrics: dict[int, Any], schedule: str, replicas: list[int], vertical_sync: bool = False) -> None:
    sched = schedules.make_schedule(schedule, replicas, MICRO, num_steps=STEPS, vertical_sync=vertical_sync)
    promised = schedules.peak_weight_versions(sched)
    measured = {r: m["weight_versions"] for r, m in metrics.items()}
    assert measured == promised, f"measured live weight versions {measured}, {schedule} promises {promised}"
    assert all(m["peak_rss_mb"] > 10 for m in metrics.values())


def _scale(schedule: str) -> float:
    return 1.0 if schedule.startswith("1f1b") else 1.0 / MICRO


def _versions(schedule: str, replicas: list[int], vertical_sync: bool = False) -> tuple[Any, Any, Any]:
    if schedule == "1f1b":
        return reference.pipedream_1f1b(replicas, vertical_sync=vertical_sync)
    if schedule == "2bw":
        return reference.pipedream_2bw(MICRO)
    return reference.synchronous(MICRO)


# gpipe and flush on mlp, resnet and gpt: tests/test_e2e_foundation.py (same reference semantics).
# 2bw's replicated stage and skip connection in one launch (resnet, [2, 1, 1]; an mlp [2, 1] row before)
CASES = [
    ("resnet", 2, "1f1b", [2, 1]), ("resnet", 3, "2bw", [2, 1, 1]),
    ("gpt", 3, "1f1b", None), ("gpt", 3, "2bw", None),
]


@pytest.mark.parametrize("name,stages,schedule,replicas", CASES, ids=[
    f"{n}-{s}-{sch}-{'x'.join(map(str, r)) if r else 'r1'}" for n, s, sch, r in CASES])
def test_schedule_trains_its_reference(emit: Any, tmp_path: Path, name: str, stages: int, schedule: str,
                                       replicas: list[int] | None) -> None:
    reps = replicas or [1] * stages
    prog = emit(name, stages, replicas)
    tied = bool(Program.load(prog).raw.get("tied"))
    # every rank's actions come step by step from a repeating period (schedules.rank_run), not laid out whole
    assert all(schedules.rank_run(schedule, reps, MICRO, STEPS, r, tied=tied).repeats > 0 for r in range(sum(reps)))
    got, metrics = _run(tmp_path, prog, schedule)
    _assert_matches(prog, got, _reference(prog, name, _versions(schedule, reps), _scale(schedule)), schedule)
    _versions_promised(metrics, schedule, reps)


def test_1f1b_stashing_is_real(emit: Any, tmp_path: Path) -> None:
    """1F1B's result equals the stashed reference; without stashing the gradients differ (PipeDream §3.3)."""
    prog = emit("mlp", 3)
    got, metrics = _run(tmp_path, prog, "1f1b")
    stashed = _reference(prog, "mlp", reference.pipedream_1f1b([1, 1, 1]), 1.0)
    unstashed = _reference(prog, "mlp", reference.pipedream_1f1b([1, 1, 1], stash=False), 1.0)
    _assert_matches(prog, got, stashed, "1f1b")
    assert _max_rel_diff(got, unstashed, prog) > 1e-3  # far beyond the 1e-5 tolerance
    _versions_promised(metrics, "1f1b", [1, 1, 1])
    # PipeDream keeps one version per minibatch in flight: S - s on stage s.
    assert [metrics[r]["weight_versions"] for r in range(3)] == [3, 2, 1]


def test_1f1b_vertical_sync(emit: Any, tmp_path: Path) -> None:
    prog = emit("mlp", 3)
    got, metrics = _run(tmp_path, prog, "1f1b", ["--vertical-sync"])
    want = _reference(prog, "mlp", reference.pipedream_1f1b([1, 1, 1], vertical_sync=True), 1.0)
    _assert_matches(prog, got, want, "1f1b vertical sync")
    plain = _reference(prog, "mlp", reference.pipedream_1f1b([1, 1, 1]), 1.0)
    assert _max_rel_diff(got, plain, prog) > 1e-4  # vertical sync really changed which weights were used
    _versions_promised(metrics, "1f1b", [1, 1, 1], vertical_sync=True)
    # every stage uses the input stage's version: the last stage must keep S versions, not 1
    assert metrics[2]["weight_versions"] == 3


def test_failing_rank_ends_the_job(emit: Any) -> None:
    prog = emit("mlp", 3)
    seen: dict[str, float] = {}

    def watch(line: str) -> None:
        if "failed in action" in line:
            seen.setdefault("failed", time.monotonic())

    # forked ranks (tests/_ranks.py): on a rank's failure the others are stopped as torchrun stops them
    rc, log = run_ranks(prog, 3, ["--schedule", "1f1b", "--steps", str(STEPS), "--timeout", "60",
                               "--fail-at", "1:1B3"], timeout=90, on_line=watch)
    end = time.monotonic()
    assert rc != 0, log[-3000:]
    assert "rank 1 (stage 1) failed in action 1B3" in log, log[-3000:]
    assert end - seen["failed"] < 30, f"the job took {end - seen['failed']:.1f} s to exit after rank 1 failed"


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_1f1b_on_nccl(emit: Any, tmp_path: Path) -> None:
    prog = emit("mlp", 2)
    got, metrics = _run(tmp_path, prog, "1f1b")
    got = {r: {k: v.cpu() for k, v in t.items()} for r, t in got.items()}
    _assert_matches(prog, got, _reference(prog, "mlp", reference.pipedream_1f1b([1, 1]), 1.0), "1f1b nccl")


def test_boundary_tensors_are_packed_one_message_per_dtype() -> None:
    import torch

    from pdcompile.runtime import comm

    ts = [torch.zeros(2, 3), torch.zeros(4, dtype=torch.int64), torch.zeros(5), torch.zeros(1, dtype=torch.int64)]
    assert comm._groups(ts) == [[0, 2], [1, 3]]
    assert comm._groups(ts[:1]) == [[0]]


def test_split_backward_is_bitwise_the_unsplit_one(emit: Any, tmp_path: Path) -> None:
    """Flush splits every later stage's last backward of a step (B: input gradients, sent at once;
    W: weight gradients): the weights it trains are bitwise those of unsplit backwards, and the
    trace shows the W actions where the schedule puts them."""
    prog = emit("gpt", 3)
    split, _ = _run(tmp_path / "split", prog, "flush", ["--split-backward", "--trace", str(tmp_path / "trace")])
    plain, _ = _run(tmp_path / "plain", prog, "flush", ["--no-split-backward"])
    for rank in plain:
        assert plain[rank].keys() == split[rank].keys()
        for k in plain[rank]:
            assert torch.equal(plain[rank][k], split[rank][k]), f"rank {rank} {k} differs with a split backward"
    names = {r: [e["name"] for e in json.loads((tmp_path / "trace" / f"rank_{r}.events.json").read_text())]
             for r in range(3)}
    want = {r: [str(a) for a in schedules.make_schedule("flush", [1, 1, 1], MICRO, num_steps=STEPS)[r]
                if a.kind is schedules.Kind.WEIGHT_GRAD] for r in range(3)}
    assert want[0] == [] and len(want[1]) == len(want[2]) == STEPS
    for r in range(3):
        assert [n for n in names[r] if "W" in n and "WV" not in n] == want[r]


def test_split_backward_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """--split-backward as given; by default on, except for more CPU ranks than cores on this machine."""
    from pdcompile.runtime.run_schedule import split_backward

    cpu, gpu = torch.device("cpu"), torch.device("meta")  # any non-CPU device
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    for flag in (True, False):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
        assert split_backward(flag, cpu) is flag and split_backward(flag, gpu) is flag
    for local, want in (("1", True), ("2", True), ("3", False), ("8", False)):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
        assert split_backward(None, cpu) is want
        assert split_backward(None, gpu) is True  # one device per rank: the weight pass has its own
