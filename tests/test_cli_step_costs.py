"""``pdcompile plan`` and ``pdcompile simulate`` charge what ``pdcompile()`` charges besides the chain's costs
(one channel, :func:`pdcompile.api.step_costs`): the runtime's per-action cost on CPU workers and, where the
costs are this machine's, the calibrated optimizer step; and a model is costed as the API costs it
(``--cost-mode``, the cluster's core contention). So the command, run as a user runs it (a subprocess in a
fresh folder, relative paths), prints the plan and predicted step the API compiles on the same model and
cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pdcompile import machine_cache

pytestmark = pytest.mark.timeout(300)

MODEL = """\
import torch


def make():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(),
                               torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
"""
# per-action cost and optimizer step rate far from the built-in estimate and the analytic bandwidth, so that a
# command that does not read the calibration predicts another step
OVERHEAD = {k: 7e-4 for k in machine_cache.ACTION_KINDS} | {"ST": 2e-3}
STEP_RATE = 2e7


def _calibrate(folder: Path) -> None:
    """A synthetic calibration of this machine in ``folder`` (never the real cache): op costs, the
    per-action cost and the optimizer step's rate."""
    table = {"source": "synthetic test table", "forward": {"matmul": [2e-5, 2e10], "elementwise": [5e-6, 5e9]},
             "backward": {"matmul": [4e-5, 2e10], "elementwise": [8e-6, 5e9]}, "corun": {}}
    (folder / "machine-constants.json").write_text(json.dumps(
        {"key": machine_cache.machine_key(), "latency_s": 1e-4, "bandwidth": 1e9, "allreduce_latency_s": 1e-4,
         "overhead_s": OVERHEAD, "step_fixed_s": 0.0, "step_rate": STEP_RATE, "op_costs": table}))


def _cli(cwd: Path, cache: Path, *argv: str) -> Any:
    env = {**os.environ, "PDCOMPILE_CACHE": str(cache)}
    env.pop("PYTHONPATH", None)  # the command finds the model in its own folder, as a user's would
    p = subprocess.run([sys.executable, "-m", "pdcompile.cli", *argv], cwd=cwd, env=env, capture_output=True,
                       text=True, timeout=240)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def _api(cache: Path, monkeypatch: pytest.MonkeyPatch, cost_mode: str) -> Any:
    import torch

    from pdcompile.api import pdcompile
    from pdcompile.cluster import local_cpu_cluster

    monkeypatch.setenv("PDCOMPILE_CACHE", str(cache))
    ns: dict[str, Any] = {}
    exec(MODEL, ns)  # noqa: S102 - the same factory the command imports
    model = ns["make"]()
    x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
    return pdcompile(model, local_cpu_cluster(2), example_inputs=(x,), example_target=y,
                     loss_fn=torch.nn.CrossEntropyLoss(), schedule="flush", num_microbatches=2,
                     cost_mode=cost_mode, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))


def _layout(plan: Any) -> list[tuple[int, int, int, tuple[int, ...]]]:
    return [(st.first, st.last, st.replicas, tuple(st.ranks)) for st in plan.stages]


def test_cli_plan_and_simulate_charge_the_calibration_as_the_api_does(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """On a calibrated local CPU cluster: ``pdcompile plan MODULE:FACTORY`` (costed by the calibration, as
    cost_mode="auto" costs it) picks the API's stages and predicts the API's headline (simulate() of the
    compiled program, which charges the calibrated per-action cost and optimizer step); ``pdcompile
    simulate`` of the API's own profile (measured costs) plans and predicts what the API compiled with
    cost_mode="measured" did. Before, both commands charged no per-action cost and the device's analytic
    optimizer step, and ``plan`` costed a model by timing it (another plan and step than the API's)."""
    cache, work = tmp_path / "cache", tmp_path / "fresh"
    cache.mkdir()
    work.mkdir()
    _calibrate(cache)
    (work / "mynet.py").write_text(MODEL)
    pipe = _api(cache, monkeypatch, "auto")
    assert pipe.cost_source.table is not None and pipe.action_cost is not None and pipe.action_cost.calibrated
    assert pipe.update_bandwidth == pytest.approx(STEP_RATE * 5)
    got = _cli(work, cache, "plan", "mynet:make", "--input", "4x32", "--cluster", "local:2", "--schedule", "flush",
               "--microbatches", "2", "--json")
    from pdcompile.plan import Plan

    cli = Plan.from_dict(got)
    assert _layout(cli) == _layout(pipe.plan)
    assert cli.num_microbatches == pipe.num_microbatches == 2
    assert cli.seconds_per_minibatch == pytest.approx(pipe.plan.seconds_per_minibatch, rel=1e-6)
    assert any("calibrated on this machine" in n and "per-action cost (calibrated" in n for n in cli.notes)

    # simulate: the API's profile (measured here), planned and replayed by the command
    from pdcompile.profile import save

    measured = _api(cache, monkeypatch, "measured")
    save(measured.state.profile, work / "prof.json")
    sim = _cli(work, cache, "simulate", "prof.json", "--cluster", "local:2", "--schedule", "flush",
               "--microbatches", "2", "--json")
    assert sim["configuration"] == measured.plan.configuration
    assert sim["predicted_step_time_s"] == pytest.approx(float(measured.simulate().step_time_s), rel=1e-6)
    assert sim["predicted_step_time_s"] == pytest.approx(measured.plan.seconds_per_minibatch, rel=1e-6)
    assert any("calibrated on this machine" in n for n in sim["notes"])
