"""Shared test helpers: build, emit and launch small pipelines."""

from __future__ import annotations

import itertools
import os
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

os.environ.setdefault("OMP_NUM_THREADS", "1")
# Every launched program runs its point-to-point transfers under NCCL's rules (runtime/comm.py): an
# order that would hang on GPUs fails here; tests/test_nccl_rules.py compares with plain gloo.
os.environ.setdefault("PDCOMPILE_NCCL_RULES", "1")

# Property tests draw the same examples on every run (CI must not fail on an example no earlier run
# saw); PDC_HYPOTHESIS_EXPLORE=1 draws fresh ones, to hunt for new counterexamples (a new find goes
# into the test as an @example, as in test_partition_ilp.py).
from hypothesis import settings as _hypothesis_settings  # noqa: E402

_hypothesis_settings.register_profile("pdcompile", derandomize=not os.environ.get("PDC_HYPOTHESIS_EXPLORE"))
_hypothesis_settings.load_profile("pdcompile")

_caches = itertools.count()


# The suite runs on two pytest-xdist workers (pyproject: ``-n 2 --dist loadgroup``), each test dispatched to
# whichever worker is free, ``multiproc`` tests (several processes, gloo on 127.0.0.1, a timeout on every
# collective) beside each other and beside single-process tests: the two cores stay busy. (Until
# 2026-12-06 a hook here marked every multiproc test ``xdist_group("multiproc")`` to run them one at a time on
# one worker; it ran after xdist had read the groups, so it never took effect, and every CI time recorded
# since 4819f98 is of this arrangement. Taking effect, it would leave one worker most of the suite.)
# Their ranks are forked from a process that has already imported torch (tests/_fork_ranks.py).
#
# ``xdist_group("NAME")`` puts the tests it marks on one worker, one after another, so that what they share (a
# module- or session-scoped fixture, a cache of compiles) is made once: without it each test goes to whichever
# worker is free and a module fixture is built on both. pytest-xdist 3.8 marks a grouped test by appending
# ``@NAME`` to its ``item._nodeid``, which pytest 9.2's node ids (``Node._id``, a structured ``NodeId``) no longer
# read, so the mark silently does nothing (pytest-dev/pytest-xdist#1386, fix pending in #1388): the hook below
# gives the id its suffix where xdist's could not, and does nothing where xdist's took effect.


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not getattr(config.option, "loadgroup", False):  # set on an xdist worker under --dist loadgroup
        return
    try:
        from _pytest.nodeid import NodeId
    except ImportError:  # pytest before 9.2: xdist's own suffix works
        return
    for item in items:
        names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                        for m in item.iter_markers("xdist_group")})
        if names and isinstance(getattr(item, "_id", None), NodeId):
            suffix = "@" + "_".join(names)
            if not item.nodeid.endswith(suffix):
                item._id = NodeId.parse(item.nodeid + suffix)


@pytest.fixture(autouse=True)
def pdcompile_cache(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every test reads and writes pdcompile's machine cache (``python -m pdcompile.calibrate``'s constants,
    whose per-action cost ``schedule="auto"`` charges) in a folder of its own, empty until written, never
    ``~/.cache/pdcompile``: no result depends on whether, or for which runtime, this machine was calibrated.
    Launched processes inherit it. A test that needs a calibration writes one here (or sets its own)."""
    folder = tmp_path_factory.getbasetemp() / "pdcompile-cache" / str(next(_caches))
    monkeypatch.setenv("PDCOMPILE_CACHE", str(folder))
    return folder


@pytest.fixture
def forked_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """``CompiledPipeline.run`` in this test starts its ranks as tests/_ranks.py does (forked from a process that
    has imported torch, torchrun's worker environment, no agent) instead of through torchrun: for tests whose
    subject is what a run computes, not the launch. The run is otherwise ``run()``'s own (its checks, its data
    streamed to the ranks, its merge); test_api, test_callables, test_docs and test_keyword_inputs run it through
    torchrun."""
    import pdcompile.launcher
    from _ranks import run_ranks

    def launch(folder: str | os.PathLike[str], nproc: int, args: Any = (), *, timeout: float = 600,
               max_restarts: int = 0, on_line: Any = None, env: dict[str, str] | None = None) -> tuple[int, str]:
        assert max_restarts == 0, "forked ranks are not restarted: leave this test on torchrun"
        return run_ranks(folder, nproc, args, timeout=timeout, env=env, on_line=on_line)

    monkeypatch.setattr(pdcompile.launcher, "launch", launch)
