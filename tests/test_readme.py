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
