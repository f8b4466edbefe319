"""Every README code snippet works as written."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pdcompile.cluster import ClusterSpec
from pdcompile.profile import from_json

pytestmark = pytest.mark.timeout(240)

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, re.S)


def test_quick_start_has_exactly_two_commands() -> None:
    section = README.split("## Quick start", 1)[1].split("##", 1)[0]
    commands = [ln for ln in _blocks_in(section, "bash")[0].splitlines() if ln.strip()]
    assert len(commands) == 2
    assert "pdcompile demo" in commands[0] and "pytest" in commands[1]
    ci = (Path(__file__).resolve().parent.parent / ".ci" / "run").read_text()
    assert commands[1].split("&&")[-1].strip().replace(".venv/bin/", "") in ci.replace(".venv/bin/", "")


def _blocks_in(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def test_cluster_toml_snippet_parses() -> None:
    (toml,) = _blocks("toml")
    spec = ClusterSpec.from_toml(toml)
    assert spec.num_workers == 16 and spec.device.memory == 16 * 2**30


def test_profile_json_snippet_parses() -> None:
    (js,) = _blocks("json")
    prof = from_json(json.loads(js))
    assert prof.layers[0].name == "conv1" and prof.batch_size == 64


@pytest.mark.multiproc
@pytest.mark.parametrize("index", range(len(_blocks("python"))))
def test_python_snippets_run(index: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    code = _blocks("python")[index]
    namespace: dict = {"__name__": "readme_snippet"}
    exec(compile(code, f"README.md python block {index}", "exec"), namespace)  # noqa: S102
    if "pipe" in namespace:
        assert namespace["pipe"].split.stages
    if "result" in namespace:
        assert len(namespace["result"].metrics["losses"]) > 0
        assert (tmp_path / "out" / "plan.json").is_file() and any((tmp_path / "ir").iterdir())


def _normalise(text: str) -> str:
    """Only the planning time varies between runs of ``pdcompile plan``."""
    return re.sub(r"planned in [0-9.]+ (?:ns|us|ms|s)\b", "planned in <time>", text).rstrip()


def test_reading_a_plan_is_what_the_cli_prints(capsys: pytest.CaptureFixture[str]) -> None:
    from pdcompile.cli import main

    section = README.split("## Reading a plan", 1)[1].split("\n## ", 1)[0]
    (block,) = _blocks_in(section, "console")
    command, expected = block.split("\n", 1)
    assert command.startswith("$ pdcompile plan ")
    argv = command[len("$ pdcompile "):].split()
    assert "../" not in command and not any(a.startswith("/") for a in argv)
    assert main(argv) == 0
    assert _normalise(capsys.readouterr().out) == _normalise(expected)


def test_reading_a_plan_prose_figures_are_the_planners() -> None:
    from pdcompile.cluster import paper_cluster
    from pdcompile.passes.linearize import linearize
    from pdcompile.passes.partition_dp import partition_dp
    from pdcompile.profile import load

    section = README.split("## Reading a plan", 1)[1].split("\n## ", 1)[0]
    chain = linearize(load("pipedream:vgg16"))
    claims = re.findall(r"([0-9]+(?:-[0-9]+)*)\s+at\s+([0-9.]+)x\s+under\s+`(\w+)`", section)
    assert {m for _, _, m in claims} == {"default", "pipedream"}
    for config, speedup, model in claims:
        cli = {} if model == "pipedream" else {"recompute": "auto", "pool": True}  # the CLI's defaults with dp
        p = partition_dp(chain, paper_cluster("A"), cost_model=model, **cli)
        assert p.configuration == config
        assert f"{p.speedup_vs_data_parallel:.{len(speedup.split('.')[1])}f}" == speedup
