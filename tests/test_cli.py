"""The pdcompile command: every subcommand's success path and its main failure path."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pdcompile.cli import main

pytestmark = pytest.mark.timeout(180)

BAD_MODEL = '''
import torch
class Bad(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l = torch.nn.Linear(4, 4)
    def forward(self, x):
        if x.sum() > 0:
            x = x * 2
        return self.l(x) * x.mean().item()
def make():
    return Bad()
'''


@pytest.fixture()
def bad_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "badmod.py").write_text(BAD_MODEL)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "badmod:make"


def test_help_lists_every_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for cmd in ("demo", "check", "profile", "emit", "run"):
        assert cmd in out


def test_check_ok_and_check_lists_every_construct(bad_model: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "zoo:gpt"]) == 0
    assert "nothing to fix" in capsys.readouterr().out
    assert main(["check", bad_model, "--input", "2x4", "--json"]) == 2
    found = json.loads(capsys.readouterr().out)
    assert [c["kind"] for c in found["constructs"]] == ["data-dependent control flow", "host sync"]


def test_emit_writes_a_program_and_bad_input_exits_2(tmp_path: Path, bad_model: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["emit", "zoo:mlp", "--stages", "2", "-o", str(tmp_path / "out"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["stages"] == 2
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "plan.json", "stage_0.pt", "stage_0.py", "stage_1.pt", "stage_1.py", "train.py"]
    rc = main(["emit", bad_model, "--input", "2x4", "--target", "2:int64:4", "-o", str(tmp_path / "bad")])
    err = capsys.readouterr().err
    assert rc == 2 and "UnsupportedModelError" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) >= 1 and "Fix:" in err
    # arguments after '--' are train.py's: only `run` takes them, elsewhere they are refused, not dropped
    rc = main(["emit", "zoo:mlp", "--stages", "2", "-o", str(tmp_path / "out2"), "--", "--precision", "bf16"])
    err = capsys.readouterr().err
    assert rc == 2 and "only `pdcompile run`" in err and not (tmp_path / "out2").exists()
    # run: what follows '--' is checked as train.py parses and checks it, before any rank starts
    for extra, said in ((["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
                        (["--clip-grad-norm", "-1"], "--clip-grad-norm -1.0: must be a positive number")):
        rc = main(["run", "zoo:mlp", "--stages", "2", "--steps", "2", "--out", str(tmp_path / "r"), "--", *extra])
        err = capsys.readouterr().err
        assert rc == 2 and said in err and len(err.strip().splitlines()) == 1, err
        assert not (tmp_path / "r" / "train.log").exists()  # nothing was launched


def test_errors_print_one_line_without_traceback_unless_debug(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "pdcompile.cli", "emit", "zoo:nosuchmodel", "-o", str(tmp_path)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "unknown zoo model 'nosuchmodel'" in p.stderr and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1
    p = subprocess.run(cmd[:3] + ["--debug"] + cmd[3:], capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "Traceback" in p.stderr


@pytest.mark.multiproc
def test_run_trains_and_a_failing_job_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # --grad-accumulation, --malloc, and train.py's own flags after '--', reach every rank
    assert main(["run", "zoo:mlp", "--stages", "2", "--steps", "3", "--out", str(tmp_path / "r"), "--json",
                 "--grad-accumulation", "fused", "--malloc", "release", "--", "--clip-grad-norm", "100"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    metrics = [json.loads(p.read_text()) for p in (tmp_path / "r" / "metrics").glob("rank_*.json")]
    assert summary["status"] == 0 and len(metrics) == 2
    assert max(len(m["losses"]) for m in metrics) == 3 * 4
    assert all(len(m["grad_norms"]) == 3 for m in metrics)  # one per step, only under --clip-grad-norm
    assert all(m["fused_grads"]["linear"] > 0 for m in metrics)  # zoo:mlp's small weights: not fused under auto
    prog = tmp_path / "r" / "program"
    src = (prog / "stage_1.py").read_text().replace("    def forward(self, ", "    def forward(self, *a):\n        raise RuntimeError('x')\n    def _unused(self, ")
    (prog / "stage_1.py").write_text(src)
    assert main(["run", str(prog), "--steps", "2", "--json"]) == 1


