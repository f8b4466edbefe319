"""A newcomer's first hour: every folder-taking command works with relative paths from any working
directory, and PipeDream's fourteen profiles ship in the package as ``pipedream:NAME``.

Each command runs as a subprocess whose cwd is a fresh, empty folder (``tmp_path / "cwd"``), as a
user would type it; the outputs must land relative to that folder (the bug these tests guard
against: ``launch`` ran torchrun with ``cwd=folder`` *and* the relative path ``folder/train.py``).
"""

from __future__ import annotations

import configparser
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from pdcompile.launcher import free_port, launch
from pdcompile.profile import PIPEDREAM_DIR, load, load_pipedream, pipedream_profiles

# one worker for the file (tests/conftest.py): ``emitted`` is compiled once
pytestmark = [pytest.mark.timeout(300), pytest.mark.xdist_group("newcomer")]

ROOT = Path(__file__).resolve().parent.parent
ENTRY = Path(sys.executable).parent / "pdcompile"  # the console script a user runs
PDCOMPILE = [str(ENTRY)] if ENTRY.is_file() else [sys.executable, "-m", "pdcompile.cli"]
NAMES = ["alexnet", "densenet121", "gnmt", "gnmt_large", "inception_v3", "nasnetalarge", "nasnetamobile",
         "resnet101", "resnet18", "resnet50", "resnext101", "resnext50", "squeezenet1_0", "vgg16"]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def _run(cwd: Path, *argv: str, timeout: float = 240, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    p = subprocess.run(list(argv), cwd=cwd, env=env or _env(), capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{' '.join(argv)}: exit {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}"
    return p


def _pdcompile(cwd: Path, *argv: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return _run(cwd, *PDCOMPILE, *argv, timeout=timeout)


@pytest.fixture
def cwd(tmp_path: Path) -> Path:
    """A fresh, empty working directory (not the repo, not the program folder)."""
    d = tmp_path / "cwd"
    d.mkdir()
    return d


@pytest.fixture(scope="module")
def emitted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``pdcompile emit zoo:mlp --stages 2 -o rel`` typed in a fresh, empty folder, once for the module:
    the program lands relative to that folder; each test copies it into its own cwd as ``rel``."""
    d = tmp_path_factory.mktemp("emit") / "cwd"
    d.mkdir()
    _pdcompile(d, "emit", "zoo:mlp", "--stages", "2", "-o", "rel")
    assert sorted(p.name for p in d.iterdir()) == ["rel"]
    assert (d / "rel" / "plan.json").is_file() and (d / "rel" / "train.py").is_file()
    assert json.loads((d / "rel" / "plan.json").read_text())["world_size"] == 2
    return d / "rel"


def _stage_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("stage_*.rank_*.pt"))


# --- paths -----------------------------------------------------------------------------------

@pytest.mark.multiproc
def test_emit_run_merge_with_relative_paths(cwd: Path, emitted: Path) -> None:
    """``emit -o rel`` (the fixture), ``run rel --out res``, ``merge res/final --program rel -o merged/model.pt``."""
    shutil.copytree(emitted, cwd / "rel")
    _pdcompile(cwd, "run", "rel", "--steps", "2", "--out", "res")
    assert _stage_files(cwd / "res" / "final") == ["stage_0.rank_0.pt", "stage_1.rank_1.pt"]
    assert sorted(p.name for p in (cwd / "res" / "metrics").glob("*.json")), "no metrics under res/metrics"
    assert "step 2" in (cwd / "res" / "train.log").read_text()
    assert not (cwd / "rel" / "res").exists(), "outputs landed under the program folder"
    _pdcompile(cwd, "merge", "res/final", "--program", "rel", "-o", "merged/model.pt")
    merged = torch.load(cwd / "merged" / "model.pt", weights_only=True)
    from pdcompile.zoo import get

    assert set(merged) == set(get("mlp").model.state_dict())


@pytest.mark.multiproc
def test_torchrun_train_py_with_relative_output_flags(cwd: Path, emitted: Path) -> None:
    """``torchrun rel/train.py --save-final fin --metrics met --trace tr --checkpoint-dir ck``, typed in
    ``cwd``: every folder is made under ``cwd`` (not under rel/), and ``merge ck`` reads it back."""
    shutil.copytree(emitted, cwd / "rel")
    _run(cwd, sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
         f"--master-port={free_port()}", "rel/train.py", "--steps", "2", "--timeout", "60",
         "--save-final", "fin", "--metrics", "met", "--trace", "tr", "--checkpoint-dir", "ck", "--checkpoint-every", "1")
    assert _stage_files(cwd / "fin") == ["stage_0.rank_0.pt", "stage_1.rank_1.pt"]
    assert any((cwd / "met").iterdir()) and any((cwd / "tr").iterdir())
    assert (cwd / "ck" / "step_00000002" / "manifest.json").is_file()
    assert sorted(p.name for p in cwd.iterdir()) == ["ck", "fin", "met", "rel", "tr"]
    assert not any((cwd / "rel" / d).exists() for d in ("fin", "met", "tr", "ck"))
    _pdcompile(cwd, "merge", "ck", "-o", "m.pt")
    assert (cwd / "m.pt").is_file()


@pytest.mark.multiproc
def test_launch_takes_a_relative_folder_and_relative_flags(cwd: Path, emitted: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The launcher itself (used by ``run``, ``demo`` and the API): a relative program folder and
    relative ``--save-final``/``--metrics``, resolved against the caller's cwd."""
    shutil.copytree(emitted, cwd / "rel")
    monkeypatch.chdir(cwd)
    rc, log = launch("rel", 2, ["--steps", "1", "--timeout", "60", "--save-final", "out/final",
                                "--metrics", "out/metrics"], timeout=240)
    assert rc == 0, log[-3000:]
    assert _stage_files(cwd / "out" / "final") == ["stage_0.rank_0.pt", "stage_1.rank_1.pt"]
    assert any((cwd / "out" / "metrics").iterdir())
    assert not (cwd / "rel" / "out").exists()


# The README's first Quick start command, `pdcompile demo`, verbatim from an empty folder on a fresh
# cache: tests/test_demo.py::test_demo_from_a_fresh_folder_shows_a_b_and_c (one demo run for both).


# --- PipeDream's profiles, inside the package ------------------------------------------------

def test_the_fourteen_profiles_ship_with_their_license() -> None:
    assert pipedream_profiles() == NAMES
    assert PIPEDREAM_DIR == ROOT / "pdcompile" / "profiles" / "pipedream"  # inside the package, not beside the repo
    license_text = (PIPEDREAM_DIR / "LICENSE").read_text()
    assert "MIT License" in license_text and "Copyright (c) Microsoft Corporation" in license_text
    assert "pipedream:NAME" in (PIPEDREAM_DIR / "README.md").read_text()


def test_pipedream_name_loads_the_shipped_file() -> None:
    by_name = load("pipedream:vgg16")
    by_path = load_pipedream(PIPEDREAM_DIR / "vgg16.txt")
    assert by_name.layers == by_path.layers and by_name.inputs == by_path.inputs
    assert by_name.name == "vgg16" and by_name.mode == "pipedream" and len(by_name.layers) > 30
    assert load_pipedream("pipedream:gnmt.txt").layers == load("pipedream:gnmt").layers


def test_plan_and_simulate_a_pipedream_profile_from_a_fresh_folder(cwd: Path) -> None:
    out = _pdcompile(cwd, "plan", "--profile", "pipedream:vgg16", "--cluster", "paper:A").stdout
    assert out.startswith("plan for vgg16 on 16 workers"), out[:500]
    sim = json.loads(_pdcompile(cwd, "simulate", "pipedream:alexnet", "--cluster", "paper:A", "--json").stdout)
    assert sim["predicted_step_time_s"] > 0 and sim["source"] == "pipedream:alexnet"
    show = json.loads(_pdcompile(cwd, "profile", "--show", "pipedream:gnmt", "--json").stdout)
    assert show["name"] == "gnmt" and show["layers"] == len(load("pipedream:gnmt").layers)
    assert list(cwd.iterdir()) == []


def _tracked_text_files() -> list[Path]:
    skip = {".git", ".venv", "venv", "__pycache__", ".pytest_cache", ".hypothesis", "build", "dist",
            "pdcompile-out", "emitted"}
    files = []
    for p in ROOT.rglob("*"):
        rel = p.relative_to(ROOT)
        if any(part in skip or part.endswith(".egg-info") for part in rel.parts) or not p.is_file():
            continue
        if p.suffix in (".py", ".md", ".cfg", ".toml", ".txt", ".json", ".sh", ".yml", ".yaml"):
            files.append(p)
    return files


def test_nothing_names_the_development_machine_or_shared() -> None:
    """No code, test, benchmark or help text refers to the shared folder beside the repo or to an
    absolute path of the development machine (a fresh clone has neither)."""
    needles = [re.escape("shared" + "/profiles"), re.escape(".." + "/shared"), r"(?<![\w.])/" + "work/"]
    pattern = re.compile("|".join(needles))
    found = [f"{p.relative_to(ROOT)}:{n}: {line.strip()[:100]}" for p in _tracked_text_files()
             for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if pattern.search(line)]
    assert found == [], "\n".join(found)


def test_extras_ask_for_the_same_transformers() -> None:
    """setup.cfg's ``test`` and ``hf`` extras agree, and the installed transformers satisfies them."""
    from packaging.requirements import Requirement

    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    extras = cfg["options.extras_require"]
    specs = {name: [Requirement(r) for r in extras[name].split("\n") if r.strip().startswith("transformers")]
             for name in ("test", "hf")}
    assert len(specs["test"]) == len(specs["hf"]) == 1
    assert specs["test"][0].specifier == specs["hf"][0].specifier
    import transformers  # the test extra installs it
    assert specs["hf"][0].specifier.contains(transformers.__version__), transformers.__version__
    data = cfg["options.package_data"]["pdcompile"].split()
    assert "profiles/pipedream/*.txt" in data and "profiles/pipedream/LICENSE" in data


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_non_editable_install_ships_the_profiles(tmp_path: Path, cwd: Path) -> None:
    """Build a wheel from a copy of the tree, install it into a folder, and plan ``pipedream:vgg16``
    with that copy (not the editable checkout) from a fresh folder."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in ("pdcompile", "passes", "runtime"):
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    _run(tmp_path, sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
         str(tmp_path / "dist"), str(src), timeout=400)
    (wheel,) = (tmp_path / "dist").glob("pdcompile-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    shipped = sorted(Path(n).stem for n in names if re.fullmatch(r"pdcompile/profiles/pipedream/\w+\.txt", n))
    assert shipped == NAMES
    assert {"pdcompile/profiles/pipedream/LICENSE", "pdcompile/profiles/pipedream/README.md"} <= set(names)
    site = tmp_path / "site"
    _run(tmp_path, sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel),
         timeout=300)
    env = {**_env(), "PYTHONPATH": str(site)}
    code = ("import sys, pdcompile; from pdcompile.cli import main; print(pdcompile.__file__); "
            "sys.exit(main(['plan', '--profile', 'pipedream:vgg16', '--cluster', 'paper:A']))")
    out = _run(cwd, sys.executable, "-c", code, env=env).stdout
    assert out.splitlines()[0].startswith(str(site)), out[:300]
    assert "plan for vgg16 on 16 workers" in out
