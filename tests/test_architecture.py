"""ARCHITECTURE.md matches the tree: every module is on the map, every pass's file is where its name
says, and the boundaries it states hold (read from the imports, not from the text)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAP = (ROOT / "ARCHITECTURE.md").read_text()
PACKAGES = ("pdcompile", "passes", "runtime")


def _modules() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")
                  if "__pycache__" not in p.parts and p.name != "__init__.py")


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth of the file (lazy imports count)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
    return out


def test_every_module_is_on_the_map() -> None:
    missing = []
    for p in _modules():
        rel = p.relative_to(ROOT).as_posix()
        named = rel in MAP or (p.parent.name in ("_cli", "schedules", "zoo") and f"`{p.name}`" in MAP)
        if not named:
            missing.append(rel)
    assert not missing, f"modules not in ARCHITECTURE.md: {missing}"


def test_every_module_on_the_map_exists() -> None:
    for rel in re.findall(r"`((?:pdcompile|passes|runtime)/[\w/]+\.py)`", MAP):
        assert (ROOT / rel).exists(), f"ARCHITECTURE.md names {rel}, which does not exist"


def test_each_pass_lives_in_the_file_its_name_says() -> None:
    """The map's pass table is the compiler's pass list, and each pass name in an IR dump leads to
    ``run`` in the file the table names."""
    import importlib

    import torch

    from pdcompile.api import pdcompile

    rows = re.findall(r"^\| \d+ \| ([\w-]+) \| `passes/(\w+)\.py`", MAP, re.M)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    pipe = pdcompile(model, example_inputs=(torch.randn(4, 4),), example_target=torch.randint(0, 2, (4,)),
                     loss_fn=torch.nn.CrossEntropyLoss(), stages=2, num_microbatches=2)
    assert [r.name for r in pipe.records] == [name for name, _ in rows]
    for name, file in rows:
        assert file == name.replace("-", "_")
        assert callable(importlib.import_module(f"pdcompile.passes.{file}").run), name


def _allowed_in_runtime(mod: str) -> bool:
    top = mod.split(".")[0]
    if top in ("torch", "pdcompile"):
        return not mod.startswith("pdcompile.") or mod.startswith(("pdcompile.runtime", "pdcompile.errors"))
    if top == "safetensors":  # runtime/sources.py reads init_from checkpoints lazily (setup.cfg requires it)
        return True
    import sys

    return top in sys.stdlib_module_names or top == "__future__"


@pytest.mark.parametrize("path", sorted((ROOT / "runtime").rglob("*.py")), ids=lambda p: p.name)
def test_the_runtime_imports_only_torch_and_itself(path: Path) -> None:
    bad = sorted(m for m in _imports(path) if not _allowed_in_runtime(m))
    assert not bad, f"{path.relative_to(ROOT)} imports {bad}: emitted programs import runtime/, torch only"


PURE = [*sorted((ROOT / "runtime" / "schedules").glob("*.py")), *sorted((ROOT / "passes" / "planner").glob("*.py")),
        *(ROOT / f for f in ("passes/partition_dp.py", "passes/partition_ilp.py", "pdcompile/plan.py",
                             "pdcompile/plan_data.py", "pdcompile/cluster.py", "pdcompile/simulate.py"))]


@pytest.mark.parametrize("path", PURE, ids=lambda p: p.name)
def test_pure_data_modules_import_no_torch(path: Path) -> None:
    torchy = sorted(m for m in _imports(path) if m.split(".")[0] == "torch")
    assert not torchy, f"{path.relative_to(ROOT)} imports {torchy}; ARCHITECTURE.md lists it as pure data"


def test_the_package_and_tests_do_not_import_benchmarks() -> None:
    allowed = {ROOT / "tests" / "test_benchmarks_smoke.py"}
    for p in [*_modules(), *(ROOT / "tests").glob("*.py")]:
        if p not in allowed:
            assert not any(m.split(".")[0] == "benchmarks" for m in _imports(p)), p
