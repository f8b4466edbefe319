"""benchmarks/gpu_check.py --dry-run: the GPU check's CPU part, as CI runs it (from an empty folder)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.timeout(600), pytest.mark.multiproc, pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
RESULTS = ROOT / "benchmarks" / "RESULTS.md"


def _section() -> str | None:
    """The GPU check's section of RESULTS.md, if there is one."""
    text = RESULTS.read_text() if RESULTS.exists() else ""
    m = re.search(r"^## GPU check\n.*?(?=^## |\Z)", text, re.S | re.M)
    return m.group(0) if m else None


def test_gpu_check_dry_run(tmp_path: Path) -> None:
    before = _section()
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # the CPU part, whatever machine CI runs on
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=540)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert "dry run: RESULTS.md is not written" in out
    rows = {line.split(" | ")[0].lstrip("| "): line for line in out.splitlines() if line.startswith("| ")}
    profile = next(line for name, line in rows.items() if name.startswith("profile: gpt (small)"))
    assert re.search(r"measured \d+\.\d+ ms, torch\.profiler \d+\.\d+ ms", profile), profile
    chain = next(line for name, line in rows.items() if name.startswith("2 stages (tied embedding in both)"))
    runtime = next(line for name, line in rows.items() if name.startswith("runtime: 1 stage through torchrun, gloo"))
    for line in (chain, runtime):  # each equality checked, and it held, with training really moving the weights
        assert line.endswith("| yes |"), line
        diff = float(re.search(r"training (\S+) \(tolerance", line).group(1))  # type: ignore[union-attr]
        assert diff <= 1e-5, line
        trained, total = map(int, re.search(r"(\d+)/(\d+) parameters trained", line).groups())  # type: ignore[union-attr]
        assert total > 10 and trained > total // 2, line
    split = next(line for name, line in rows.items() if name.startswith("split backward's weight pass"))
    assert "trusted by its check (bitwise): yes" in split and split.endswith("| yes |"), split
    step = next(line for name, line in rows.items() if name.startswith("step time on cpu"))
    predicted, measured = (float(x) for x in re.search(r"predicted (\S+) ms .* measured median (\S+) ms", step).groups())  # type: ignore[union-attr]
    assert predicted > 0 and measured > 0, step
    memory = next(line for name, line in rows.items() if name.startswith("stage memory on cpu"))
    plan_mib, counted_mib = (float(x) for x in re.search(r"predicted (\S+) MiB, runtime's accounting (\S+) MiB",
                                                         memory).groups())  # type: ignore[union-attr]
    assert plan_mib > 0 and counted_mib > 0, memory
    # part 5: every layer's forward and backward beside the analytic model, summed per op class
    for model, classes in (("zoo gpt (small)", ("matmul/linear", "normalisation", "embedding/gather", "attention")),
                           ("Llama decoder layer", ("matmul/linear", "normalisation", "embedding/gather", "attention"))):
        mine = {name.rsplit(": ", 1)[1]: line for name, line in rows.items()
                if name.startswith("layers vs analytic (cpu): " + model)}
        assert set(classes) <= set(mine), (model, sorted(mine))
        for cls, line in mine.items():
            got = re.search(r"(\d+) nodes, forward \+ backward measured (\S+) ms \((\S+) \+ (\S+)\), analytic (\S+) ms "
                            r"\((\S+) \+ (\S+)\): error ([+-]\d+)%", line)
            assert got is not None, line
            n, meas, mf, mb, pred, pf, pb, err = (float(x) for x in got.groups())
            assert n >= 1 and meas > 0 and pred >= 0, line
            assert meas == pytest.approx(mf + mb, rel=1e-3) and pred == pytest.approx(pf + pb, rel=1e-3, abs=1e-6), line
            assert err == pytest.approx(100 * (pred / meas - 1), abs=1.5), line  # the error is the two columns'
    per_node = [line for line in out.splitlines() if re.match(r"\s+\S+\s+matmul/linear\s+measured", line)]
    assert len(per_node) >= 8, "each node printed with its measured and analytic times"
    assert "All equalities hold: yes." in out
    assert list(tmp_path.iterdir()) == []  # nothing left in the working folder
    assert _section() == before  # --dry-run never writes RESULTS.md


def test_gpu_check_without_a_gpu_says_so(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """In this process (the script ends with ``sys.exit(main())``): no process start, no second torch import."""
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("gpu_check_script", SCRIPT)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, script)  # its dataclasses look their module up
    spec.loader.exec_module(script)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert script.main([]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and "no GPU here" in err[0] and "--dry-run" in err[0], captured.err
    assert captured.out == ""
