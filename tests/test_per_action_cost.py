"""``schedule="auto"`` on CPU workers charges the runtime's per-action cost: this runtime's calibration
(``python -m pdcompile.calibrate``'s cache) when it holds for this very runtime, else a built-in
estimate, and then ``pdcompile()``, ``explain()`` and the CLI say so in one line with the fix."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest

from pdcompile import machine_cache
from pdcompile.errors import UncalibratedWarning

pytestmark = pytest.mark.timeout(120)

FIX = "python -m pdcompile.calibrate"


def _cache(folder: Path, key: str, overhead_s: dict[str, float] | None) -> None:
    d: dict[str, Any] = {"key": key, "latency_s": 1e-4}
    if overhead_s is not None:
        d["overhead_s"] = overhead_s
    (folder / "machine-constants.json").write_text(json.dumps(d))


def _auto(**kw: Any) -> Any:
    from pdcompile.api import pdcompile
    from pdcompile.zoo import get

    z = get("mlp", batch_size=8, seed=0)
    return pdcompile(z.model, kw.pop("cluster", None), example_inputs=z.example_inputs, example_target=z.target,
                     loss_fn=z.loss_fn, stages=2, schedule="auto", **kw)


def _steps(pipe: Any) -> dict[tuple[str, int], float]:
    return {(c.schedule, c.num_microbatches): c.step_s for c in pipe.schedule_choice[0]}


def test_the_cache_read_names_what_is_wrong(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDCOMPILE_CACHE", str(tmp_path))
    key = machine_cache.machine_key()
    builtin = dict.fromkeys(machine_cache.ACTION_KINDS, machine_cache.BUILTIN_ACTION_S)
    got = machine_cache.action_cost()
    assert (got.seconds, got.calibrated) == (builtin, False) and "no calibration at" in got.problem
    (tmp_path / "machine-constants.json").write_text("{not json")
    assert "unreadable" in machine_cache.action_cost().problem
    _cache(tmp_path, key.rsplit("runtime ", 1)[0] + "runtime 000000000000", {"F": 1e-4})  # the runtime changed
    got = machine_cache.action_cost()
    assert not got.calibrated and got.problem.endswith("measured for another runtime")
    other = "|".join(["elsewhere", "64", *key.split("|")[2:]])  # another machine
    assert _problem(tmp_path, other).endswith("measured for another host, core count")
    _cache(tmp_path, key, None)
    assert "holds no per-action cost" in machine_cache.action_cost().problem
    _cache(tmp_path, key, {"F": 1e-4, "SF": 2e-5})
    got = machine_cache.action_cost()
    assert (got.seconds, got.calibrated, got.warning()) == ({"F": 1e-4, "SF": 2e-5}, True, "")


def _problem(folder: Path, key: str) -> str:
    _cache(folder, key, {"F": 1e-4})
    return machine_cache.action_cost().problem


def test_uncalibrated_auto_warns_in_one_line_and_charges_the_builtin(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    empty, same = tmp_path / "empty", tmp_path / "same"
    empty.mkdir(), same.mkdir()
    monkeypatch.setenv("PDCOMPILE_CACHE", str(empty))
    with pytest.warns(UncalibratedWarning) as caught:
        pipe = _auto()
    assert len(caught) == 1 and caught[0].filename == __file__  # the warning names the user's line
    line = str(caught[0].message)
    assert "\n" not in line and "not calibrated for this runtime" in line and "microbatch count" in line
    assert line.endswith(f"fix: {FIX}") and str(empty) in line
    assert f"warning: {line}" in pipe.explain()
    assert pipe.action_cost is not None and not pipe.action_cost.calibrated
    # what was charged is the built-in: the same choice as a calibration that measured exactly it ...
    _cache(same, machine_cache.machine_key(), dict.fromkeys(machine_cache.ACTION_KINDS, machine_cache.BUILTIN_ACTION_S))
    monkeypatch.setenv("PDCOMPILE_CACHE", str(same))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UncalibratedWarning)  # a matching cache: no warning
        calibrated = _auto()
    assert _steps(calibrated) == _steps(pipe)
    assert "not calibrated" not in calibrated.explain() and calibrated.action_cost.calibrated
    # ... and slower than free actions (what an uncalibrated choice charged before) at every candidate
    _cache(same, machine_cache.machine_key(), dict.fromkeys(machine_cache.ACTION_KINDS, 0.0))
    free = _steps(_auto())
    assert free.keys() == _steps(pipe).keys() and all(t > free[k] for k, t in _steps(pipe).items())


def test_fixed_microbatches_note_it_without_a_warning_and_gpus_charge_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pdcompile.cluster import flat_cluster

    monkeypatch.setenv("PDCOMPILE_CACHE", str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UncalibratedWarning)
        fixed = _auto(num_microbatches=2)
        gpu = _auto(cluster=flat_cluster(2, 10e9, name="V100-16GB"))
    assert "chose the schedule at the given microbatch count" in fixed.explain()
    assert gpu.action_cost is None and "not calibrated" not in gpu.explain()
    assert "no per-action cost charged" in gpu.explain()


def test_cli_prints_the_warning_as_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    from pdcompile.cli import main

    monkeypatch.setenv("PDCOMPILE_CACHE", str(tmp_path))
    assert main(["emit", "zoo:mlp", "--stages", "2", "--schedule", "auto", "-o", str(tmp_path / "p"), "--json"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pdcompile: warning: the runtime's per-action cost is not calibrated")
    assert err[0].endswith(FIX)


def test_auto_gives_every_replica_a_share_of_every_minibatch(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """With a stage of 2 replicas, auto tries only microbatch counts that 2 divides: fewer microbatches
    per minibatch than replicas would leave a replica without samples (the built-in cost favours few)."""
    from pdcompile.api import pdcompile
    from pdcompile.zoo import get

    monkeypatch.setenv("PDCOMPILE_CACHE", str(tmp_path))
    z = get("mlp", batch_size=8, seed=0)
    with pytest.warns(UncalibratedWarning):
        pipe = pdcompile(z.model, example_inputs=z.example_inputs, example_target=z.target, loss_fn=z.loss_fn,
                         stages=1, replicas=[2], schedule="auto")
    assert {c.num_microbatches for c in pipe.schedule_choice[0]} == {m for m in (1, 2, 4, 8) if m % 2 == 0}
    assert pipe.num_microbatches % 2 == 0


def test_a_plan_replicated_when_planned_again_still_gives_every_replica_a_share(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A small GPT on 3 CPU processes sharing 2 cores over a 6 MB/s link: auto's first plan (flush, 4 microbatches)
    has no replicas and its choice is 1 microbatch; planned again at the whole minibatch, the plan is
    one stage on 3 replicas, so auto compiles the fewest microbatches that 3 divides, and says so."""
    import torch

    from pdcompile.api import pdcompile
    from pdcompile.cluster import local_cpu_cluster
    from pdcompile.zoo import gpt
    from pdcompile.zoo.losses import SequenceCrossEntropy

    monkeypatch.setenv("PDCOMPILE_CACHE", str(tmp_path))
    monkeypatch.setattr("pdcompile.cluster.host_cores", lambda: 2)  # the cores the cost model charges, any machine
    torch.manual_seed(0)
    model = gpt.GPT(gpt.GPTConfig(vocab_size=65, seq_len=64, d_model=16, n_heads=2, n_layers=3))
    x, y = torch.randint(0, 65, (12, 64)), torch.randint(0, 65, (12, 64))
    with pytest.warns(UncalibratedWarning):
        pipe = pdcompile(model, local_cpu_cluster(3, bandwidth=6e6), example_inputs=(x,), example_target=y,
                         loss_fn=SequenceCrossEntropy(), schedule="auto")
    chosen = pipe.schedule_choice[1]
    assert all(pipe.num_microbatches % st.replicas == 0 for st in pipe.plan.stages)
    assert (chosen.num_microbatches, [st.replicas for st in pipe.plan.stages], pipe.num_microbatches) == (1, [3], 3)
    assert "planned again at 1 microbatches, a stage has 3 replicas: compiled with 3" in pipe.explain()
