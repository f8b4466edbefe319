"""Checkpoint folders without torchrun: atomic writes, the manifest, reading by the model's names
under another plan, and every refusal on resume."""

from __future__ import annotations

import copy
import json
import os
import pickle
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

# one worker for the file (tests/conftest.py): ``emitted_checkpoint`` is compiled once
pytestmark = [pytest.mark.timeout(60), pytest.mark.xdist_group("checkpoint")]

PLAN: dict[str, Any] = {
    "world_size": 3,
    "stages": [
        {"index": 0, "ranks": [0], "param_names": {"fc.weight": "net.0.weight", "fc.bias": "net.0.bias"}},
        {"index": 1, "ranks": [1, 2], "param_names": {"out.weight": "net.2.weight"}},
    ],
}
# the same model as one stage (another plan): local names differ, the original names are the same
ONE_STAGE: dict[str, Any] = {
    "world_size": 1,
    "stages": [{"index": 0, "ranks": [0], "param_names": {"a.weight": "net.0.weight", "a.bias": "net.0.bias",
                                                         "b.weight": "net.2.weight"}}],
}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Module()
    m.net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2, bias=False))
    return m


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    """The whole model one SGD-with-momentum step in, and a StepLR one step in."""
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    m.net(torch.randn(5, 4)).pow(2).sum().backward()
    opt.step()
    sched.step()
    return m, opt, sched


def _write(root: Path, step: int, manifest: bool = True, world_size: int = 3) -> Path:
    """A checkpoint of the trained model under its own names, written by one process."""
    m, opt, sched = _trained()
    part = checkpoint.StagePart(m, opt, {n: n for n, _ in m.named_parameters()}, sched)
    state = checkpoint.rank_state([part], step, step)
    folder = checkpoint.write_offline(root, PLAN, step, checkpoint.state_dict_of([part]), state, world_size)
    if not manifest:
        (folder / checkpoint.MANIFEST).unlink()
    return folder


def _stage(plan: dict[str, Any], index: int) -> checkpoint.StagePart:
    """A fresh stage of ``plan`` (zeros, fresh optimizer and scheduler) named as plan.json names it."""
    names = plan["stages"][index]["param_names"]
    m = torch.nn.Module()
    shapes = {"net.0.weight": (3, 4), "net.0.bias": (3,), "net.2.weight": (2, 3)}
    for local, orig in names.items():
        mod, leaf = local.split(".")
        if not hasattr(m, mod):
            m.add_module(mod, torch.nn.Module())
        getattr(m, mod).register_parameter(leaf, torch.nn.Parameter(torch.zeros(shapes[orig])))
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    return checkpoint.StagePart(m, opt, names, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5), index)


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


def test_another_plan_reads_weights_optimizer_and_position(tmp_path: Path) -> None:
    """Written from the whole model; read by the 2-stage plan's stages (and its replicas) and by a
    1-stage plan, each under its own local names."""
    folder = _write(tmp_path, 4)
    manifest = checkpoint.verify(folder, PLAN)
    assert manifest["step"] == 4 and set(manifest["model"]) == {"net.0.weight", "net.0.bias", "net.2.weight"}
    assert set(checkpoint.expected_files(manifest)) <= set(manifest["files"])
    want, want_opt, _ = _trained()
    params = dict(want.named_parameters())
    for plan, rank, index in [(PLAN, 0, 0), (PLAN, 1, 1), (PLAN, 2, 1), (ONE_STAGE, 0, 0)]:
        part = _stage(plan, index)
        state = checkpoint.load_rank(folder, plan, rank, [part])
        assert (state.step, state.data_consumed) == (4, 4)
        for local, p in part.module.named_parameters():
            orig = part.names[local]
            assert torch.equal(p, params[orig]), orig
            assert torch.equal(part.optimizer.state[p]["momentum_buffer"],
                               want_opt.state[params[orig]]["momentum_buffer"]), orig
        assert part.optimizer.param_groups[0]["lr"] == 0.05  # the scheduler's halved rate
        assert part.lr_scheduler.last_epoch == 1
    # the tensors are keyed by the model's names; the optimizer's as optim/NAME/KEY
    shapes = checkpoint.tensor_shapes(checkpoint.read_metadata(folder))
    assert set(shapes) == {"net.0.weight", "net.0.bias", "net.2.weight",
                           *(checkpoint.optim_key(n, "momentum_buffer") for n in manifest["model"])}


def test_rng_state_roundtrip() -> None:
    saved = checkpoint.rng_state()
    a = (torch.rand(3), random.random())
    torch.rand(5)
    random.random()
    checkpoint.set_rng_state(saved)
    b = (torch.rand(3), random.random())
    assert torch.equal(a[0], b[0]) and a[1] == b[1]


def test_rng_of_each_writing_rank_comes_back(tmp_path: Path) -> None:
    folder = _write(tmp_path, 2, world_size=2)
    manifest = checkpoint.read_manifest(folder)
    saved = checkpoint.load_state(folder, manifest, 1)
    torch.rand(4)
    checkpoint.set_rng_state(saved.rng)
    a = torch.rand(3)
    checkpoint.set_rng_state(saved.rng)
    assert torch.equal(a, torch.rand(3))
    assert checkpoint.load_state(folder, manifest, 5).rng == {}  # a rank the writing job did not have


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
        checkpoint.load_rank(folder, PLAN, 0, [_stage(PLAN, 0)])


def test_manifest_missing_a_rank_refused(tmp_path: Path) -> None:
    folder = _write(tmp_path, 2)
    manifest = json.loads((folder / "manifest.json").read_text())
    del manifest["files"]["rank_2.state.pt"]
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"incomplete manifest, missing \['rank_2.state.pt'\]"):
        checkpoint.load_rank(folder, PLAN, 0, [_stage(PLAN, 0)])


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
@pytest.mark.parametrize("name", ["__0_0.distcp", ".metadata", "rank_1.state.pt"])
def test_damaged_file_refused(tmp_path: Path, damage: str, name: str) -> None:
    folder = _write(tmp_path, 2)
    f = folder / name
    data = bytearray(f.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
        f.write_bytes(bytes(data))
        match = f"{name}: checksum mismatch"
    elif damage == "truncate":
        f.write_bytes(bytes(data[:-10]))
        match = f"{name}: checksum mismatch"
    else:
        f.unlink()
        match = f"{name}: listed in the manifest but missing"
    with pytest.raises(CheckpointError, match=match):
        checkpoint.load_rank(folder, PLAN, 1, [_stage(PLAN, 1)])
    with pytest.raises(CheckpointError, match=match):
        checkpoint.verify(folder, PLAN)  # checking every file finds it too


def test_another_model_refused(tmp_path: Path) -> None:
    folder = _write(tmp_path, 2)
    other = copy.deepcopy(PLAN)
    other["stages"][1]["param_names"]["out.bias"] = "net.2.bias"
    with pytest.raises(CheckpointError, match=r"a checkpoint of another model \(1 only in this program's model "
                                              r"\(e.g. \['net.2.bias'\]\)\)"):
        checkpoint.load_rank(folder, other, 1, [_stage(PLAN, 1)])
    wide = _stage(PLAN, 1)  # the same names, another shape
    wide.module.out.weight = torch.nn.Parameter(torch.zeros(2, 5))
    with pytest.raises(CheckpointError, match=r"net.2.weight has shape \[2, 3\] in the checkpoint, \[2, 5\] in "
                                              r"stage 1: a checkpoint of another model"):
        checkpoint.load_rank(folder, PLAN, 1, [wide])


class _Evil:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("touch pwned",))


def _vouch(folder: Path, name: str) -> None:
    """A manifest consistent with a replaced file (checksums can't catch a malicious writer)."""
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"][name] = {"sha256": checkpoint.sha256_file(folder / name), "bytes": (folder / name).stat().st_size}
    (folder / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("name", ["rank_0.state.pt", ".metadata"])
def test_arbitrary_objects_are_never_unpickled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    monkeypatch.chdir(tmp_path)
    folder = _write(tmp_path, 2)
    evil = folder / name
    if name == ".metadata":
        evil.write_bytes(pickle.dumps(_Evil()))
        match = r"\.metadata: not a torch.distributed.checkpoint index \(UnpicklingError: posix.system"
    else:
        torch.save({"step": 2, "payload": _Evil()}, evil)
        match = "can't be loaded with weights_only=True"
    _vouch(folder, name)
    with pytest.raises(CheckpointError, match=match):
        checkpoint.load_rank(folder, PLAN, 0, [_stage(PLAN, 0)])
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
    """An emitted 2-stage mlp and a complete checkpoint of its initial weights (under the model's names)."""
    from pdcompile.api import pdcompile
    from pdcompile.zoo import get

    root = tmp_path_factory.mktemp("merge")
    z = get("mlp", batch_size=8, seed=0)
    pipe = pdcompile(z.model, example_inputs=z.example_inputs, example_target=z.target, loss_fn=z.loss_fn,
                     stages=2, schedule="flush", num_microbatches=2, leaf_modules=z.leaf_modules)
    prog = pipe.emit(root / "prog")
    plan = json.loads((prog / "plan.json").read_text())
    tensors = {}
    for st in plan["stages"]:
        for local, t in torch.load(prog / st["weights"], weights_only=True).items():
            tensors[st["param_names"][local]] = t
    state = checkpoint.RankState(step=3, data_consumed=3, lr_scheduler=None, param_groups=None,
                                 rng=checkpoint.rng_state())
    checkpoint.write_offline(root / "ck", plan, 3, tensors, state, world_size=2)
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
    f = checkpoint.step_dir(bad, 3) / "__0_0.distcp"
    f.write_bytes(f.read_bytes()[:-7])  # truncated
    assert main(["merge", str(bad), "-o", str(tmp_path / "model.pt")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "CheckpointError" in err[0] and "__0_0.distcp: checksum mismatch" in err[0]
    assert not (tmp_path / "model.pt").exists()
    assert main(["merge", str(tmp_path / "nothing"), "-o", str(tmp_path / "model.pt")]) == 2


def test_merge_to_a_folder_streams_shards_and_refuses_bad_options(tmp_path: Path, emitted_checkpoint,  # noqa: ANN001
                                                                  capsys: pytest.CaptureFixture) -> None:
    from safetensors.torch import load_file

    from pdcompile.cli import main

    _, ck, want = emitted_checkpoint
    out = tmp_path / "hf"
    assert main(["merge", str(ck), "-o", str(out), "--max-shard-size", "1kB"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    got: dict[str, torch.Tensor] = {}
    for f in sorted(set(index["weight_map"].values())):
        got.update(load_file(str(out / f)))
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temporary left
    for bad, cause in [(["--max-shard-size", "lots"], "--max-shard-size 'lots'"),
                       (["--like", str(tmp_path)], "no config.json")]:
        capsys.readouterr()
        assert main(["merge", str(ck), "-o", str(tmp_path / "bad"), *bad]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and cause in err[0], err
        assert not (tmp_path / "bad").exists()
