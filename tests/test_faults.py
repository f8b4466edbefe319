"""Fault tolerance: exact resume, SIGKILL under torchrun's --max-restarts, a crash while
checkpointing, a corrupt checkpoint refused, and a hung peer bounded by --timeout (torchrun where
the test is about what it does, else the ranks as it starts them: tests/_ranks.py)."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch

from pdcompile.api import pdcompile
from _ranks import run_ranks
from pdcompile.launcher import launch
from pdcompile.runtime import checkpoint
from pdcompile.zoo import get

# one worker for the file (tests/conftest.py): the fault-free runs of ``straight`` are made once, not on both
pytestmark = [pytest.mark.timeout(300), pytest.mark.multiproc, pytest.mark.xdist_group("faults")]

STEPS = 10
MICRO = 2
RUN_TIMEOUT = 120  # seconds, each torchrun launch (generous: CI machines are loaded)


def _opt(params):  # noqa: ANN001, ANN202
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _emit(folder: Path, stages: int, schedule: str) -> Path:
    z = get("mlp", batch_size=8, seed=0)
    pipe = pdcompile(z.model, example_inputs=z.example_inputs, example_target=z.target, loss_fn=z.loss_fn,
                     optimizer=_opt, stages=stages, schedule=schedule, num_microbatches=MICRO,
                     leaf_modules=z.leaf_modules)
    return pipe.emit(folder, data={"factory": "pdcompile.zoo:batches", "kwargs": {"name": "mlp"}})


def _run(prog: Path, nproc: int, *args: str, max_restarts: int = 0, timeout: float = RUN_TIMEOUT,
         torchrun: bool = False) -> tuple[int, str]:
    """train.py on ``nproc`` ranks: through torchrun where the test is about what it does (restarts,
    its failure summary), else the ranks as torchrun starts them (tests/_ranks.py, faster)."""
    if torchrun or max_restarts:
        return launch(prog, nproc, ["--timeout", "60", *args], timeout=timeout, max_restarts=max_restarts)
    return run_ranks(prog, nproc, ["--timeout", "60", *args], timeout=timeout)


def _weights(folder: Path) -> dict[str, dict[str, torch.Tensor]]:
    files = sorted(folder.glob("stage_*.rank_*.pt"))
    assert files, f"no weights in {folder}"
    return {p.name: torch.load(p, weights_only=True) for p in files}


def _assert_bitwise(got: dict[str, dict[str, torch.Tensor]], want: dict[str, dict[str, torch.Tensor]]) -> None:
    assert set(got) == set(want)
    for f in want:
        assert set(got[f]) == set(want[f]), f
        for name in want[f]:
            assert torch.equal(got[f][name], want[f][name]), f"{f}: {name} differs"


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[int, str], tuple[Path, dict]]:
    """Fault-free 10-step runs (program folder, final weights), made once per (stages, schedule); their
    checkpoints (every 5 steps) are in the program folder's sibling ``ck``."""
    cache: dict[tuple[int, str], tuple[Path, dict]] = {}

    def get_run(stages: int, schedule: str) -> tuple[Path, dict]:
        if (stages, schedule) not in cache:
            root = tmp_path_factory.mktemp(f"straight{stages}{schedule}")
            prog = _emit(root / "prog", stages, schedule)
            rc, out = _run(prog, stages, "--steps", str(STEPS), "--save-final", str(root / "final"),
                           "--checkpoint-dir", str(root / "ck"), "--checkpoint-every", "5")
            assert rc == 0, out[-3000:]
            cache[(stages, schedule)] = (prog, _weights(root / "final"))
        return cache[(stages, schedule)]

    return get_run  # type: ignore[return-value]


def test_resume_is_exact(tmp_path: Path, straight) -> None:  # noqa: ANN001
    """3 stages, gpipe: resumed from the straight run's step-5 checkpoint, the run ends bitwise where the
    straight run ends (2 stages, flush, resume in the two fault tests below)."""
    stages, schedule = 3, "gpipe"
    prog, want = straight(stages, schedule)
    ck = tmp_path / "ck"
    shutil.copytree(checkpoint.step_dir(prog.parent / "ck", 5), checkpoint.step_dir(ck, 5))
    assert checkpoint.latest(ck) == checkpoint.step_dir(ck, 5)
    rc, out = _run(prog, stages, "--steps", str(STEPS), "--checkpoint-dir", str(ck), "--checkpoint-every", "5",
                   "--resume", "--save-final", str(tmp_path / "final"))
    assert rc == 0, out[-3000:]
    assert "resumed from" in out and "step 5" in out
    got = _weights(tmp_path / "final")
    _assert_bitwise(got, want)
    initial = torch.load(prog / "stage_0.pt", weights_only=True)
    assert any(not torch.equal(initial[n], got["stage_0.rank_0.pt"][n]) for n in initial)  # it trained
    # the run kept the newest two complete checkpoints (5 and 10)
    assert [s for s, _, done in checkpoint.checkpoints(ck) if done] == [5, 10]


def test_sigkill_then_restart_equals_fault_free(tmp_path: Path, straight) -> None:  # noqa: ANN001
    prog, want = straight(2, "flush")
    ck = tmp_path / "ck"
    rc, out = _run(prog, 2, "--steps", str(STEPS), "--checkpoint-dir", str(ck), "--checkpoint-every", "3",
                   "--resume", "--fail-at-step", "8", "--fail-rank", "1", "--save-final", str(tmp_path / "final"),
                   max_restarts=1, timeout=2 * RUN_TIMEOUT)
    assert rc == 0, out[-3000:]
    assert "fault injection: rank 1 is killed at step 8" in out
    assert "step_00000006" in out and "resumed from" in out  # restarted from the newest checkpoint
    _assert_bitwise(_weights(tmp_path / "final"), want)


def test_kill_between_files_and_manifest_keeps_previous(tmp_path: Path, straight) -> None:  # noqa: ANN001
    prog, want = straight(2, "flush")
    ck = tmp_path / "ck"
    args = ["--steps", str(STEPS), "--checkpoint-dir", str(ck), "--checkpoint-every", "3", "--resume",
            "--save-final", str(tmp_path / "final")]
    rc, out = _run(prog, 2, *args, "--fail-at-step", "6", "--fail-rank", "1", "--fail-while-checkpointing")
    assert rc != 0
    assert "while writing the checkpoint of step 6" in out
    # step 6's stage files are all there, but no manifest: it is incomplete and not resumed from
    six = checkpoint.step_dir(ck, 6)
    assert (six / "__0_0.distcp").is_file() and (six / "rank_1.state.pt").is_file()
    assert not (six / checkpoint.MANIFEST).exists()
    assert checkpoint.latest(ck) == checkpoint.step_dir(ck, 3)
    plan = json.loads((prog / "plan.json").read_text())
    checkpoint.verify(checkpoint.step_dir(ck, 3), plan)  # the previous one is intact
    rc, out = _run(prog, 2, *args)
    assert rc == 0, out[-3000:]
    assert "step_00000003" in out and "step 3" in out
    _assert_bitwise(_weights(tmp_path / "final"), want)


def test_resume_1f1b_is_exact(tmp_path: Path, straight) -> None:  # noqa: ANN001
    """1F1B drains the pipeline at each checkpoint, so a run resumed from the straight run's step-5
    checkpoint (stash empty there) ends where the straight run (same --checkpoint-every) ends."""
    prog, want = straight(2, "1f1b")  # compiled for 1F1B: train.py runs it without --schedule
    assert json.loads((prog / "plan.json").read_text())["schedule"]["policy"] == "1f1b"
    b = tmp_path / "b"
    shutil.copytree(checkpoint.step_dir(prog.parent / "ck", 5), checkpoint.step_dir(b, 5))
    rc, out = _run(prog, 2, "--steps", str(STEPS), "--checkpoint-every", "5", "--checkpoint-dir", str(b), "--resume",
                   "--save-final", str(tmp_path / "fb"))
    assert rc == 0, out[-3000:]
    assert "resumed from" in out
    got = _weights(tmp_path / "fb")
    for f in want:
        for name in want[f]:
            torch.testing.assert_close(got[f][name], want[f][name], rtol=0, atol=1e-6)


def test_resume_refuses_corrupt_checkpoint(tmp_path: Path, straight) -> None:  # noqa: ANN001
    prog, _ = straight(2, "flush")
    ck = shutil.copytree(prog.parent / "ck", tmp_path / "ck")  # the straight run's checkpoints (5 and 10)
    f = checkpoint.step_dir(ck, 10) / "__1_0.distcp"  # what rank 1 wrote, and reads back
    data = bytearray(f.read_bytes())
    data[-20] ^= 0xFF
    f.write_bytes(bytes(data))
    rc, out = _run(prog, 2, "--steps", "12", "--checkpoint-dir", str(ck), "--resume", torchrun=True)
    assert rc != 0 and "exitcode  : 2" in out, out[-3000:]  # a rank exited 2: bad input
    assert "rank 1: CheckpointError" in out and "__1_0.distcp: checksum mismatch" in out
    assert "rank 0: CheckpointError" in out and "another rank refused" in out  # all ranks refuse


def test_hung_peer_fails_within_timeout(tmp_path: Path, straight) -> None:  # noqa: ANN001
    prog, _ = straight(3, "gpipe")
    seen: dict[str, float] = {}

    def on_line(line: str) -> None:
        now = time.monotonic()
        if "hangs at step 3" in line:
            seen.setdefault("hang", now)
        for rank in (0, 2):
            if f"rank {rank} (stage {rank}) failed in action" in line:
                seen.setdefault(f"rank{rank}", now)

    rc, out = launch(prog, 3, ["--steps", "6", "--timeout", "4", "--fail-at-step", "3", "--fail-rank", "1",
                               "--fail-mode", "hang"], timeout=RUN_TIMEOUT, on_line=on_line)
    end = time.monotonic()
    assert rc not in (0, 124), out[-3000:]  # the job failed, and not by the test's own kill
    assert "hang" in seen, out[-3000:]
    # rank 1 stopped responding; its peers named themselves, their stage and their action, and
    # failed within the 4 s timeout (plus slack for a loaded machine); torchrun then ended the job
    for key in ("rank0", "rank2"):
        assert key in seen, out[-4000:]
        assert seen[key] - seen["hang"] < 4 + 10, f"{key} took {seen[key] - seen['hang']:.1f} s"
    assert end - seen["hang"] < 4 + 30, f"the job took {end - seen['hang']:.1f} s to end after the hang"
    assert "Timed out" in out or "timed out" in out
