"""Tests of ``pdcompile profile``: profiling a factory into a file, --show, bad input."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from pdcompile.cli import main
from pdcompile.profile import load

pytestmark = pytest.mark.timeout(120)

VGG = "pipedream:vgg16"  # shipped in the package

FACTORY = textwrap.dedent("""
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self, width):
            super().__init__()
            self.emb = nn.Embedding(10, width)
            self.fc = nn.Linear(width, 3)

        def forward(self, tokens, scale):
            return self.fc(self.emb(tokens)) * scale

    def make(width=4):
        return Net(width)
""")


@pytest.fixture
def factory_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "cli_models_for_test.py").write_text(FACTORY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("cli_models_for_test", None)


def test_profile_factory_to_file(factory_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = factory_dir / "p.json"
    rc = main(["profile", "cli_models_for_test:make", "--arg", "width=6",
               "--input", "5x7:int64,5x7x3", "--mode", "analytic", "-o", str(out)])
    assert rc == 0
    prof = load(out)
    assert [i.name for i in prof.inputs] == ["tokens", "scale"]
    assert prof.batch_size == 5
    assert prof.layer("emb").output_bytes == 5 * 7 * 6 * 4
    assert prof.layer("emb").param_bytes == 10 * 6 * 4
    assert prof.layer("fc").forward_flops == 2 * 5 * 7 * 6 * 3
    assert prof.outputs == ("mul",)
    assert "wrote" in capsys.readouterr().out


def test_show_pipedream_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profile", "--show", VGG, "--top", "4", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    prof = load(VGG)
    assert data["layers"] == len(prof.layers)
    assert data["forward_s"] + data["backward_s"] == pytest.approx(prof.compute_s)
    assert data["param_bytes"] == prof.param_bytes
    times = [r["forward_s"] + r["backward_s"] for r in data["top_by_time"]]
    assert len(times) == 4 and times == sorted(times, reverse=True)
    assert times[0] == max(l.compute_s for l in prof.layers)
    assert data["top_by_params"][0]["param_bytes"] == max(l.param_bytes for l in prof.layers)


def test_show_text(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profile", "--show", VGG, "--top", "2"]) == 0
    text = capsys.readouterr().out
    for title in ("top 2 by time", "top 2 by activation bytes", "top 2 by parameter bytes"):
        assert title in text
    assert "layers 40" in text


@pytest.mark.parametrize(
    "argv, message",
    [
        (["profile"], "nothing to do"),
        (["profile", "no_such_module_xyz:make", "--input", "2x3"], "cannot import"),
        (["profile", "justaname"], "MODULE:FACTORY"),
        (["profile", "cli_models_for_test:make", "--input", "2xq"], "dims joined by 'x'"),
        (["profile", "cli_models_for_test:make", "--input", "2x3:floaty"], "unknown dtype"),
        (["profile", "cli_models_for_test:make"], "--input"),
        (["profile", "--show", "/nonexistent/p.json"], "cannot read profile"),
        (["profile", "cli_models_for_test:make", "--input", "5x7:int64,5x7x3", "--mode", "analytic",
          "--cross-check"], "use --mode measured"),
        (["profile", "zoo:nope"], "unknown zoo model 'nope'"),
    ],
)
def test_bad_input_exit_2(factory_dir: Path, capsys: pytest.CaptureFixture[str], argv: list[str],
                          message: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_profile_cross_check_with_torch_profiler(factory_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["profile", "cli_models_for_test:make", "--input", "5x7:int64,5x7x3", "--no-symbolic",
               "--repeats", "3", "--cross-check", "--json"])
    assert rc == 0
    check = json.loads(capsys.readouterr().out)["cross_check"]
    # every node's operators ran inside the profiled step: both sums are real times
    assert check["profiler_sum_s"] > 0 and check["measured_sum_s"] > 0
    assert check["heavy"] >= 2 and 0 <= check["heavy_within"] <= check["heavy"]
    assert check["step_under_profiler_s"] > check["profiler_sum_s"] * 0.5


def test_profile_a_zoo_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profile", "zoo:mlp", "--mode", "analytic", "--no-symbolic", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [l["name"] for l in data["layers"]][:2] == ["layers_0", "layers_1"]
