"""README.md and every page of docs/ work as written: each snippet runs, each file parses, each console
block is what its command prints, and every command line and flag a page shows is one that pdcompile,
train.py, torchrun or the benchmark it names takes."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from pdcompile.cluster import ClusterSpec
from pdcompile.profile import from_json

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
PAGES = {"README.md": README, **{f"docs/{p.name}": p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))}}


def _fences(text: str) -> list[tuple[str, str, str | None]]:
    """Every fenced code block of a Markdown text, as (language, body, why it is not run: the reason
    in a ``<!-- not run: REASON -->`` line just before the fence, else None), in order."""
    out: list[tuple[str, str, str | None]] = []
    lang: str | None = None
    body: list[str] = []
    previous = ""
    for line in text.splitlines(keepends=True):
        if line.startswith("```"):
            if lang is None:
                lang, body = line[3:].strip(), []
                note = re.fullmatch(r"<!-- not run: (.+) -->", previous.strip())
                why = note.group(1) if note else None
            else:
                out.append((lang, "".join(body), why))
                lang = None
        elif lang is not None:
            body.append(line)
        if line.strip():
            previous = line
    assert lang is None, "a code block is not closed"
    return out


def _blocks_in(text: str, lang: str) -> list[str]:
    return [body for fence, body, _ in _fences(text) if fence == lang]


def _blocks(lang: str) -> list[tuple[str, str]]:
    """Every ``lang`` block of every page, as (page, block)."""
    return [(page, b) for page, text in PAGES.items() for b in _blocks_in(text, lang)]


def _section(page: str, heading: str) -> str:
    return PAGES[page].split(f"{heading}\n", 1)[1].split("\n## ", 1)[0]


def _ids(items: list[tuple[str, str]]) -> list[str]:
    return [f"{page}#{i}" for i, (page, _) in enumerate(items)]


# -- README -------------------------------------------------------------------------------------


def test_quick_start_has_exactly_two_commands() -> None:
    section = README.split("## Quick start", 1)[1].split("##", 1)[0]
    commands = [ln for ln in _blocks_in(section, "bash")[0].splitlines() if ln.strip()]
    assert len(commands) == 2
    assert "pdcompile demo" in commands[0] and "pytest" in commands[1]
    ci = (Path(__file__).resolve().parent.parent / ".ci" / "run").read_text()
    assert commands[1].split("&&")[-1].strip().replace(".venv/bin/", "") in ci.replace(".venv/bin/", "")


def test_the_readme_is_short_and_leads_to_every_page() -> None:
    """About 150 lines at most, and every docs/ page is reached by following links from it."""
    assert len(README.splitlines()) <= 150
    reached, todo = {"README.md"}, ["README.md"]
    while todo:
        page = todo.pop()
        for target in re.findall(r"\]\(([\w./-]+\.md)(?:#[^)]*)?\)", PAGES[page]):
            linked = (ROOT / page).parent.joinpath(target).resolve().relative_to(ROOT).as_posix()
            if linked in PAGES and linked not in reached:
                reached.add(linked)
                todo.append(linked)
    assert set(PAGES) <= reached, f"pages no link from README leads to: {sorted(set(PAGES) - reached)}"


@pytest.mark.parametrize("page", sorted(PAGES))
def test_every_relative_link_leads_to_a_file(page: str) -> None:
    base = (ROOT / page).parent
    for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", PAGES[page]):
        assert (base / target).exists(), f"{page} links {target}, which does not exist"


# -- files a page shows ---------------------------------------------------------------------------


@pytest.mark.parametrize(("page", "toml"), _blocks("toml"), ids=_ids(_blocks("toml")))
def test_cluster_toml_snippets_parse(page: str, toml: str) -> None:
    spec = ClusterSpec.from_toml(toml)
    if page == "docs/cluster.md":
        assert spec.num_workers == 16 and spec.device.memory == 16 * 2**30


@pytest.mark.parametrize(("page", "js"), _blocks("json"), ids=_ids(_blocks("json")))
def test_profile_json_snippets_parse(page: str, js: str) -> None:
    data = json.loads(js)
    if data.get("format") == "pdcompile-profile":
        prof = from_json(data)
        if page == "docs/profile-format.md":
            assert prof.layers[0].name == "conv1" and prof.batch_size == 64


def test_the_profile_fields_a_page_names_are_the_profiles() -> None:
    from dataclasses import fields

    from pdcompile.profile import Profile, ProfileInput, ProfileLayer

    known = {f.name for cls in (Profile, ProfileLayer, ProfileInput) for f in fields(cls)} | {"format", "version"}
    named = set(re.findall(r"`([a-z]+(?:_[a-z0-9]+)+)`", PAGES["docs/profile-format.md"]))
    assert named and named <= known, f"not fields of a profile: {sorted(named - known)}"



def test_the_options_the_api_page_names_are_pdcompiles() -> None:
    """Each ``name=`` the API page shows is a keyword of ``pdcompile()``, ``run()`` or ``emit()``."""
    import inspect

    from pdcompile.api import CompiledPipeline, option_names, pdcompile

    valid = set(option_names()).union(*(inspect.signature(f).parameters
                                        for f in (pdcompile, CompiledPipeline.run, CompiledPipeline.emit)))
    named = set(re.findall(r"`([a-z_]+)=", PAGES["docs/api.md"]))
    assert {"schedule", "recompute", "init_from"} <= named and named <= valid, sorted(named - valid)


def test_every_option_is_documented() -> None:
    import inspect

    from pdcompile.api import option_names, pdcompile

    options = set(option_names()) | set(inspect.signature(pdcompile).parameters) - {"model", "kw"}
    missing = sorted(o for o in options if not any(f"`{o}" in text for text in PAGES.values()))
    assert not missing, f"options of pdcompile() no page names (docs/api.md lists them): {missing}"

# -- code a page shows ----------------------------------------------------------------------------


RUN_PAGES = sorted(page for page, text in PAGES.items()
                   if any(lang == "python" or lang == "bash" and why is None for lang, _, why in _fences(text)))


@pytest.mark.multiproc
@pytest.mark.timeout(900)
@pytest.mark.parametrize("page", RUN_PAGES)
def test_a_pages_code_runs_as_written(page: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A page's code runs in order in one fresh folder, as a reader would: Python blocks in one
    namespace (one session), except a block whose first line is ``# NAME.py``, which is that file;
    then every bash block, unless a ``<!-- not run: REASON -->`` line before it says why it can't
    (a GPU, two nodes, an install), in which case its flags are checked below."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    # docs/api.md's nanoGPT example runs from a nanoGPT checkout (``from model import GPT``): its model.py,
    # vendored unchanged as a fixture, is that checkout's
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent / "fixtures" / "nanogpt"))
    monkeypatch.delitem(sys.modules, "model", raising=False)
    namespace: dict = {"__name__": "readme_snippet"}
    printed: str | None = None  # what the last bash block printed, until the next block
    for i, (lang, code, why) in enumerate(_fences(PAGES[page])):
        name = re.fullmatch(r"# ([\w.-]+\.py)", code.split("\n", 1)[0].strip())
        if lang == "" and printed is not None:  # the output a page shows for the commands before it
            missing = [ln for ln in code.splitlines() if ln.strip() and not re.search(_shape_of(ln), printed)]
            assert not missing, f"{page}: the commands printed no line like {missing}"
        printed = None
        if lang == "python" and name:
            (tmp_path / name.group(1)).write_text(code)
        elif lang == "python":
            exec(compile(code, f"{page} python block {i}", "exec"), namespace)  # noqa: S102
        elif lang == "bash" and why is None:
            env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
            done = subprocess.run(["bash", "-e", "-c", code], cwd=tmp_path, env=env, capture_output=True,
                                  text=True, timeout=600)
            assert done.returncode == 0, f"{page} bash block {i} failed:\n{code}\n{done.stdout[-2000:]}{done.stderr[-3000:]}"
            printed = done.stdout + done.stderr
    if "pipe" in namespace:
        assert namespace["pipe"].split.stages
    if "result" in namespace:
        assert len(namespace["result"].metrics["losses"]) > 0
        assert (tmp_path / "out" / "plan.json").is_file() and any((tmp_path / "ir").iterdir())


def _shape_of(line: str) -> str:
    """A pattern for a line of shown output: its words as they are, each number any number, each run of
    spaces any run (times, losses and rates differ from run to run)."""
    parts = re.split(r"(\d+(?:[.,]\d+)*(?:e[-+]?\d+)?|\s+)", line.strip())
    return "".join(r"[-+0-9.,e]+" if re.fullmatch(r"\d.*", p) else r"\s+" if p.isspace() else re.escape(p)
                   for p in parts if p)


def _normalise(text: str) -> str:
    """Only the planning time varies between runs of ``pdcompile plan``."""
    return re.sub(r"planned in [0-9.]+ (?:ns|us|ms|s)\b", "planned in <time>", text).rstrip()


@pytest.mark.parametrize(("page", "block"), _blocks("console"), ids=_ids(_blocks("console")))
def test_console_blocks_are_what_the_command_prints(page: str, block: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    from pdcompile.cli import main

    command, expected = block.split("\n", 1)
    assert command.startswith("$ pdcompile "), f"{page}: a console block runs one pdcompile command"
    argv = command[len("$ pdcompile "):].split()
    assert "../" not in command and not any(a.startswith("/") for a in argv)
    assert main(argv) == 0
    assert _normalise(capsys.readouterr().out) == _normalise(expected)


def test_reading_a_plan_prose_figures_are_the_planners() -> None:
    from pdcompile.cluster import paper_cluster
    from pdcompile.passes.linearize import linearize
    from pdcompile.passes.partition_dp import partition_dp
    from pdcompile.profile import load

    section = PAGES["docs/reading-a-plan.md"]
    chain = linearize(load("pipedream:vgg16"))
    claims = re.findall(r"([0-9]+(?:-[0-9]+)*)\s+at\s+([0-9.]+)x\s+under\s+`(\w+)`", section)
    assert {m for _, _, m in claims} == {"default", "pipedream"}
    for config, speedup, model in claims:
        cli = {} if model == "pipedream" else {"recompute": "auto", "pool": True}  # the CLI's defaults with dp
        p = partition_dp(chain, paper_cluster("A"), cost_model=model, **cli)
        assert p.configuration == config
        assert f"{p.speedup_vs_data_parallel:.{len(speedup.split('.')[1])}f}" == speedup


# -- command lines and flags a page shows -----------------------------------------------------------

# flags of programs that are not ours: PipeDream's optimizer (compared with), tensorboard's
FOREIGN_FLAGS = {"--activation_compression_ratio", "--logdir"}


def _pdcompile_flags() -> dict[str, set[str]]:
    """Each subcommand's option strings (and ``""``: the top level's)."""
    import argparse

    from pdcompile.cli import build_parser

    parser = build_parser()
    out = {"": set(parser._option_string_actions)}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            out.update({name: set(sub._option_string_actions) for name, sub in action.choices.items()})
    return out


FLAGS_GROUP = pytest.mark.xdist_group("docs_flags")  # its readers on one worker (tests/conftest.py): emitted once


@pytest.fixture(scope="module")
def train_py_flags(tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    """The flags of an emitted train.py, read from its --help as a user would."""
    import torch

    from pdcompile import pdcompile

    out = tmp_path_factory.mktemp("program")
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    pdcompile(model, example_inputs=(torch.randn(4, 4),), example_target=torch.randint(0, 2, (4,)),
              loss_fn=torch.nn.CrossEntropyLoss(), stages=2, num_microbatches=2).emit(out)
    text = subprocess.run([sys.executable, "train.py", "--help"], cwd=out, capture_output=True, text=True,
                          timeout=120, check=True).stdout
    return set(re.findall(r"(?<![\w-])--[a-z][\w-]*", text))


def _torchrun_flags() -> set[str]:
    from torch.distributed.run import get_args_parser

    return set(get_args_parser()._option_string_actions)


def _commands(text: str) -> list[str]:
    """The command lines a page shows: lines of its code blocks (continuations joined, ``$ `` and
    ``&&`` split off) and inline code that starts with a program's name."""
    lines: list[str] = []
    for block in (body for lang, body, _ in _fences(text) if lang in ("bash", "console", "sh", "")):
        for ln in block.replace("\\\n", " ").splitlines():
            ln = ln.strip().removeprefix("$ ")
            lines += [part.strip() for part in ln.split("&&")]
    lines += re.findall(r"`((?:pdcompile|torchrun|python) [^`]+)`", text)
    programs = ("pdcompile ", "torchrun ", "python train.py", "python benchmarks/")
    return [ln for ln in lines if ln.startswith(programs)]


def _flags(tokens: list[str]) -> list[str]:
    return [t.split("=", 1)[0] for t in tokens if re.fullmatch(r"--[a-z][\w-]*(=.*)?", t)]


@FLAGS_GROUP
@pytest.mark.parametrize("page", sorted(PAGES))
def test_every_command_a_page_shows_takes_its_flags(page: str, train_py_flags: set[str]) -> None:
    """Each ``pdcompile SUB ...`` names a subcommand and only its flags; each ``torchrun ... train.py
    ...`` torchrun's flags, then train.py's; each ``python benchmarks/X.py`` an existing script and
    flags it defines. Placeholders (MODEL, c.toml) are not run: console blocks and snippets are."""
    sub_flags = _pdcompile_flags()
    bad: list[str] = []
    for line in _commands(PAGES[page]):
        try:
            tokens = shlex.split(line.split("#", 1)[0] if " #" in line else line)
        except ValueError:
            tokens = line.split()
        tokens = [t for t in re.split(r"\s+|[\[\]|()]", " ".join(tokens)) if t]
        if tokens[0] == "pdcompile":
            sub = next((t for t in tokens[1:] if not t.startswith("-")), "")
            if sub not in sub_flags:
                bad.append(f"{line!r}: no subcommand {sub!r}")
                continue
            bad += [f"{line!r}: pdcompile {sub} has no {f}" for f in _flags(tokens)
                    if f not in sub_flags[sub] | sub_flags[""]]
        elif tokens[0] == "torchrun" or tokens[:2] == ["python", "train.py"]:
            script = next((i for i, t in enumerate(tokens) if t.endswith(".py")), len(tokens))
            bad += [f"{line!r}: torchrun has no {f}" for f in _flags(tokens[:script]) if f not in _torchrun_flags()]
            if tokens[script:script + 1] == ["train.py"]:
                bad += [f"{line!r}: train.py has no {f}" for f in _flags(tokens[script:]) if f not in train_py_flags]
        else:
            path = ROOT / tokens[1]
            if not path.is_file():
                bad.append(f"{line!r}: no {tokens[1]}")
                continue
            bad += [f"{line!r}: {tokens[1]} has no {f}" for f in _flags(tokens) if f'"{f}"' not in path.read_text()]
    assert not bad, "\n".join(bad)


@FLAGS_GROUP
@pytest.mark.parametrize("page", sorted(PAGES))
def test_every_flag_a_page_names_exists(page: str, train_py_flags: set[str]) -> None:
    """A flag named anywhere in a page (``--resume``, ``--no-split-backward``) is one of pdcompile's,
    train.py's, torchrun's or a benchmark's."""
    known = set().union(*_pdcompile_flags().values()) | train_py_flags | _torchrun_flags() | FOREIGN_FLAGS
    benchmarks = "".join(p.read_text() for p in (ROOT / "benchmarks").glob("*.py"))
    named = set(re.findall(r"(?<![\w-])--[a-z][\w-]*", PAGES[page]))
    unknown = sorted(f for f in named if f not in known and f'"{f}"' not in benchmarks)
    assert not unknown, f"{page} names flags no program takes: {unknown}"


@FLAGS_GROUP
def test_every_train_py_flag_is_documented(train_py_flags: set[str]) -> None:
    named = set(re.findall(r"(?<![\w-])--[a-z][\w-]*", "".join(PAGES.values())))
    missing = sorted(train_py_flags - named - {"--help"})
    assert not missing, f"train.py flags no page names (docs/emitted-program.md lists them): {missing}"
