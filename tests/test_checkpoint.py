"""Checkpoint files without torchrun: atomic writes, the manifest, and every refusal on resume."""

from __future__ import annotations

import copy
import json
import os
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from pdcompile.errors import CheckpointError
from pdcompile.runtime import checkpoint
from pdcompile.runtime.resume import segments as _segments
from pdcompile.runtime.schedules import shift
from pdcompile.runtime.schedules import Action, Kind

pytestmark = pytest.mark.timeout(60)

PLAN: dict[str, Any] = {
    "world_size": 3,
    "stages": [
        {"index": 0, "ranks": [0], "param_names": {"fc.weight": "net.0.weight", "fc.bias": "net.0.bias"}},
        {"index": 1, "ranks": [1, 2], "param_names": {"out.weight": "net.2.weight"}},
    ],
}


def _module(stage: int) -> torch.nn.Module:
    torch.manual_seed(stage)
    m = torch.nn.Module()
    if stage == 0:
        m.fc = torch.nn.Linear(4, 3)
    else:
        m.out = torch.nn.Linear(3, 2, bias=False)
    return m


def _state(step: int, module: torch.nn.Module) -> checkpoint.RankState:
    opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    sum(p.sum() for p in module.parameters()).backward()
    opt.step()
    return checkpoint.RankState(step=step, next_microbatch=step * 2, data_consumed=step, optimizer=opt.state_dict(),
                                lr_scheduler=None, weight_store=None, rng=checkpoint.rng_state())


def _write(root: Path, step: int, plan: dict[str, Any] = PLAN, manifest: bool = True) -> Path:
    files: dict[str, tuple[str, int]] = {}
    for st in plan["stages"]:
        for r in st["ranks"]:
            m = _module(st["index"])
            files.update(checkpoint.write_rank(root, plan, st["index"], r, dict(m.named_parameters()), _state(step, m)))
    if manifest:
        checkpoint.write_manifest(root, plan, step, files)
    return checkpoint.step_dir(root, step)


def test_atomic_write_replaces_whole_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "f.bin"
    sha = checkpoint.atomic_write(path, b"one")
    assert path.read_bytes() == b"one" and sha == checkpoint.sha256_file(path)
    checkpoint.atomic_write(path, b"two two")
    assert path.read_bytes() == b"two two"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.bin"]


def test_atomic_write_failing_rename_keeps_old_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "f.bin"
    checkpoint.atomic_write(path, b"old")

    def boom(*_: Any) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint.os, "replace", boom)
    with pytest.raises(OSError):
        checkpoint.atomic_write(path, b"new")
    assert path.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.bin"]  # the temporary is gone


def test_roundtrip_restores_weights_optimizer_and_position(tmp_path: Path) -> None:
    folder = _write(tmp_path, 4)
    manifest = checkpoint.verify(folder, PLAN)
    assert manifest["step"] == 4
    assert set(manifest["files"]) == set(checkpoint.expected_files(PLAN))
    weights, state = checkpoint.load_rank(folder, PLAN, 1, 2)
    m = _module(1)
    want = _state(4, m)
    assert (state.step, state.next_microbatch, state.data_consumed) == (4, 8, 4)
    assert torch.equal(state.optimizer["state"][0]["momentum_buffer"], want.optimizer["state"][0]["momentum_buffer"])
    fresh = torch.nn.Module()
    fresh.out = torch.nn.Linear(3, 2, bias=False)
    checkpoint.restore_module(fresh, weights, str(folder))
    assert torch.equal(fresh.out.weight, m.out.weight)
    # the weights file is the --save-final format: {local name: tensor}
    assert set(torch.load(folder / "stage_0.rank_0.pt", weights_only=True)) == {"fc.weight", "fc.bias"}


def test_rng_state_roundtrip() -> None:
    saved = checkpoint.rng_state()
    a = (torch.rand(3), random.random())
    torch.rand(5)
    random.random()
    checkpoint.set_rng_state(saved)
    b = (torch.rand(3), random.random())
    assert torch.equal(a[0], b[0]) and a[1] == b[1]


def test_folder_without_manifest_is_incomplete(tmp_path: Path) -> None:
    _write(tmp_path, 2)
    folder = _write(tmp_path, 4, manifest=False)
    assert checkpoint.latest(tmp_path) == checkpoint.step_dir(tmp_path, 2)  # the crash left 2 usable
    with pytest.raises(CheckpointError, match="no manifest.json, so the checkpoint is incomplete"):
        checkpoint.verify(folder, PLAN)


def test_truncated_manifest_refused(tmp_path: Path) -> None:
    folder = _write(tmp_path, 2)
    text = (folder / "manifest.json").read_text()
    (folder / "manifest.json").write_text(text[: len(text) // 2])
    with pytest.raises(CheckpointError, match="not valid JSON.*truncated"):
        checkpoint.load_rank(folder, PLAN, 0, 0)


def test_manifest_missing_a_rank_refused(tmp_path: Path) -> None:
    folder = _write(tmp_path, 2)
    manifest = json.loads((folder / "manifest.json").read_text())
    del manifest["files"]["stage_1.rank_2.state.pt"]
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"incomplete manifest, missing \['stage_1.rank_2.state.pt'\]"):
        checkpoint.load_rank(folder, PLAN, 0, 0)


def test_write_manifest_refuses_missing_files(tmp_path: Path) -> None:
    m = _module(0)
    files = checkpoint.write_rank(tmp_path, PLAN, 0, 0, dict(m.named_parameters()), _state(1, m))
    with pytest.raises(CheckpointError, match="stage_1.rank_1.pt"):
        checkpoint.write_manifest(tmp_path, PLAN, 1, files)
    assert checkpoint.latest(tmp_path) is None


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_damaged_file_refused(tmp_path: Path, damage: str) -> None:
    folder = _write(tmp_path, 2)
    f = folder / "stage_1.rank_1.pt"
    data = bytearray(f.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
        f.write_bytes(bytes(data))
        match = "stage_1.rank_1.pt: checksum mismatch"
    elif damage == "truncate":
        f.write_bytes(bytes(data[:-10]))
        match = "stage_1.rank_1.pt: checksum mismatch"
    else:
        f.unlink()
        match = "stage_1.rank_1.pt: listed in the manifest but missing"
    with pytest.raises(CheckpointError, match=match):
        checkpoint.load_rank(folder, PLAN, 1, 1)
    checkpoint.load_rank(folder, PLAN, 1, 2)  # the other replica's files are fine
    with pytest.raises(CheckpointError, match=match):
        checkpoint.verify(folder, PLAN)  # checking every file finds it too


@pytest.mark.parametrize("change,match", [
    (lambda p: p["stages"][1].update(ranks=[1]), r"stage 1 runs on ranks \[1, 2\] in the checkpoint, \[1\]"),
    (lambda p: p["stages"].append({"index": 2, "ranks": [3], "param_names": {}}),
     "the checkpoint has 2 stages, the program 3"),
    (lambda p: p["stages"][0]["param_names"].update({"fc2.weight": "x"}), "stage 0 has different parameters"),
])
def test_other_plan_refused(tmp_path: Path, change: Any, match: str) -> None:
    folder = _write(tmp_path, 2)
    other = copy.deepcopy(PLAN)
    change(other)
    assert checkpoint.plan_hash(other) != checkpoint.plan_hash(PLAN)
    with pytest.raises(CheckpointError, match=f"made by another plan \\({match}"):
        checkpoint.load_rank(folder, other, 0, 0)


class _Evil:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("touch pwned",))


def test_arbitrary_objects_are_never_unpickled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    folder = _write(tmp_path, 2)
    evil = folder / "stage_0.rank_0.state.pt"
    torch.save({"step": 2, "payload": _Evil()}, evil)
    manifest = json.loads((folder / "manifest.json").read_text())  # a consistent manifest for it
    manifest["files"][evil.name] = {"sha256": checkpoint.sha256_file(evil), "bytes": evil.stat().st_size}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="can't be loaded with weights_only=True"):
        checkpoint.load_rank(folder, PLAN, 0, 0)
    assert not (tmp_path / "pwned").exists()


def test_prune_keeps_newest_complete(tmp_path: Path) -> None:
    for s in (1, 2, 3):
        _write(tmp_path, s)
    stale = _write(tmp_path, 0, manifest=False)
    newer_partial = _write(tmp_path, 5, manifest=False)
    removed = checkpoint.prune(tmp_path, keep=2)
    assert sorted(removed) == sorted([checkpoint.step_dir(tmp_path, 1), stale])
    assert [s for s, _, done in checkpoint.checkpoints(tmp_path) if done] == [2, 3]
    assert newer_partial.is_dir()  # may be rewritten by the resumed run; never resumed from
    assert checkpoint.latest(tmp_path) == checkpoint.step_dir(tmp_path, 3)


def test_segments_cut_at_checkpoints() -> None:
    assert _segments(0, 10, 0) == [(0, 10)]
    assert _segments(0, 10, 3) == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert _segments(6, 10, 3) == [(6, 9), (9, 10)]
    assert _segments(10, 10, 5) == []


def test_shift_renumbers_microbatches_not_versions() -> None:
    acts = [Action(0, Kind.WEIGHT_VERSION, version=1), Action(0, Kind.FORWARD, 0), Action(0, Kind.STEP)]
    assert [str(shift(a, 4)) for a in acts] == [str(acts[0]), str(Action(0, Kind.FORWARD, 4)), str(acts[2])]


@pytest.fixture(scope="module")
def emitted_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, torch.Tensor]]:
    """An emitted 2-stage mlp and a complete checkpoint of its initial weights (written as ranks would)."""
    from pdcompile.api import pdcompile
    from pdcompile.zoo import get

    root = tmp_path_factory.mktemp("merge")
    z = get("mlp", batch_size=8, seed=0)
    pipe = pdcompile(z.model, example_inputs=z.example_inputs, example_target=z.target, loss_fn=z.loss_fn,
                     stages=2, schedule="flush", num_microbatches=2, leaf_modules=z.leaf_modules)
    prog = pipe.emit(root / "prog")
    plan = json.loads((prog / "plan.json").read_text())
    files: dict[str, tuple[str, int]] = {}
    for st in plan["stages"]:
        weights = torch.load(prog / st["weights"], weights_only=True)
        for r in st["ranks"]:
            state = checkpoint.RankState(step=3, next_microbatch=6, data_consumed=3, optimizer={}, lr_scheduler=None,
                                         weight_store=None, rng=checkpoint.rng_state())
            files.update(checkpoint.write_rank(root / "ck", plan, st["index"], r, weights, state))
    checkpoint.write_manifest(root / "ck", plan, 3, files)
    want = {k: v.detach() for k, v in z.model.state_dict().items()}
    return prog, root / "ck", want


def test_merge_cli_writes_original_names(tmp_path: Path, emitted_checkpoint, capsys: pytest.CaptureFixture) -> None:  # noqa: ANN001
    from pdcompile.cli import main

    _, ck, want = emitted_checkpoint
    assert main(["merge", str(ck), "-o", str(tmp_path / "model.pt")]) == 0
    assert "step 3" in capsys.readouterr().out
    got = torch.load(tmp_path / "model.pt", weights_only=True)
    assert set(got) == set(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    from safetensors.torch import load_file
    side = load_file(str(tmp_path / "model.safetensors"))
    assert all(torch.equal(side[k], want[k]) for k in want)


def test_merge_cli_refuses_corrupt_checkpoint(tmp_path: Path, emitted_checkpoint,  # noqa: ANN001
                                              capsys: pytest.CaptureFixture) -> None:
    import shutil

    from pdcompile.cli import main

    _, ck, _ = emitted_checkpoint
    bad = tmp_path / "ck"
    shutil.copytree(ck, bad)
    f = checkpoint.step_dir(bad, 3) / "stage_1.rank_1.pt"
    f.write_bytes(f.read_bytes()[:-7])  # truncated
    assert main(["merge", str(bad), "-o", str(tmp_path / "model.pt")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "CheckpointError" in err[0] and "stage_1.rank_1.pt: checksum mismatch" in err[0]
    assert not (tmp_path / "model.pt").exists()
    assert main(["merge", str(tmp_path / "nothing"), "-o", str(tmp_path / "model.pt")]) == 2
