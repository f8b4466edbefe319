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


# -- no import circles, no file too long to read ----------------------------------------------------

INSTALLED = {"pdcompile": "pdcompile", "passes": "pdcompile.passes", "runtime": "pdcompile.runtime"}
MAX_LINES = 800


def _module_files() -> dict[str, Path]:
    """Every module of the package by its installed name (``passes/x.py`` is ``pdcompile.passes.x``;
    a package by its ``__init__.py``)."""
    out: dict[str, Path] = {}
    for folder, dotted in INSTALLED.items():
        for p in (ROOT / folder).rglob("*.py"):
            if "__pycache__" in p.parts:
                continue
            parts = list(p.relative_to(ROOT / folder).with_suffix("").parts)
            out[".".join([dotted, *(parts[:-1] if parts[-1] == "__init__" else parts)])] = p
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return isinstance(test, ast.Name) and test.id == "TYPE_CHECKING" or \
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


def _imported_modules(name: str, source: str, known: set[str], is_package: bool = False) -> set[str]:
    """The modules of ``known`` that module ``name`` imports, at any depth (inside functions too), not
    counting those under ``if TYPE_CHECKING:``. ``from a import b`` is ``a.b`` where that is a module,
    else ``a``; relative imports are resolved."""
    here = name if is_package else name.rpartition(".")[0]
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for n in node.orelse:
                visit(n)
            return
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = here.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            out.update(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source))
    return {m for m in out if m in known and m != name}


def _import_graph() -> dict[str, set[str]]:
    files = _module_files()
    return {m: _imported_modules(m, p.read_text(), set(files), p.name == "__init__.py") for m, p in files.items()}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle per group of modules that reach each other (a strongly connected component): the
    shortest one through the group's first module, as the list of modules in import order."""
    reach = {v: _reachable(graph, v) for v in graph}
    groups: list[list[str]] = []
    seen: set[str] = set()
    for v in sorted(graph):
        if v in seen or v not in reach[v]:
            continue
        group = sorted(w for w in reach[v] if v in reach[w])
        seen.update(group)
        groups.append(group)
    return [_shortest_circle(graph, g[0]) for g in groups]


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    out: set[str] = set()
    todo = list(graph[start])
    while todo:
        v = todo.pop()
        if v not in out:
            out.add(v)
            todo.extend(graph.get(v, ()))
    return out


def _shortest_circle(graph: dict[str, set[str]], start: str) -> list[str]:
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph.get(v, ())):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [*reversed(path), start]
                if w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{start} is on no circle")


def test_the_circle_finder_counts_lazy_imports_and_not_type_checking_ones() -> None:
    known = {"p", "p.a", "p.b", "p.c", "p.d"}
    src_a = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p import d\n\ndef f():\n    from .b import x\n"
    assert _imported_modules("p.a", src_a, known) == {"p.b"}
    assert _imported_modules("p", "from . import c\nimport p.a\n", known, is_package=True) == {"p.c", "p.a"}
    graph = {"p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.a", "p.d"}, "p.d": set(), "p": {"p.d"}}
    assert _circles(graph) == [["p.a", "p.b", "p.c", "p.a"]]
    assert _circles({**graph, "p.c": {"p.d"}}) == []


def test_no_import_circles() -> None:
    """Each module can be read and changed from the bottom up: no two import each other, through
    however many others, even lazily inside a function (which only hides a circle)."""
    circles = _circles(_import_graph())
    assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles)


def test_no_source_file_over_800_lines() -> None:
    long = {p.relative_to(ROOT).as_posix(): n for p in _module_files().values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines (split them by concern): {long}"
