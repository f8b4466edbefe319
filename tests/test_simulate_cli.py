"""``pdcompile simulate`` and the runtime's measured timeline as a Chrome trace."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pdcompile.cli import main
from pdcompile.cluster import flat_cluster
from pdcompile.passes.linearize import linearize
from pdcompile.plan import plan
from pdcompile.profile import load
from pdcompile.timeline import read_chrome_trace
from pdcompile.trace_convert import microbatch_of, read_runtime_events, runtime_trace_to_chrome, select_microbatches



def _cluster_toml(tmp_path: Path, workers: int = 4) -> Path:
    p = tmp_path / "cluster.toml"
    p.write_text(flat_cluster(workers, 10e9, 16 * 2.0**30, name="gpu").to_toml())
    return p


def test_simulate_a_pipedream_profile_writes_trace_and_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace, png = tmp_path / "trace.json", tmp_path / "step.png"
    rc = main(["simulate", "pipedream:alexnet", "--cluster", str(_cluster_toml(tmp_path)),
               "--schedule", "flush", "--microbatches", "4", "--trace", str(trace), "--png", str(png), "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["schedule"] == "flush" and out["num_microbatches"] == 4
    assert out["predicted_step_time_s"] > 0 and 0 <= out["bubble_fraction"] < 1
    events = read_chrome_trace(trace)
    assert {e.name for e in events} >= {"0F0", "0B3", "0ST"}
    assert len({e.rank for e in events}) == sum(int(r) for r in out["configuration"].split("-"))
    assert json.loads(trace.read_text())["otherData"]["schedule"] == "flush"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_simulate_a_plan_json_alone_and_with_its_profile(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    chain = linearize(load("pipedream:vgg16"))
    cluster = flat_cluster(4, 10e9, 64 * 2.0**30)
    p = plan(chain, cluster, schedule="1f1b")
    path = tmp_path / "plan.json"
    path.write_text(p.to_json(indent=1))
    assert main(["simulate", str(path), "--json"]) == 0
    alone = json.loads(capsys.readouterr().out)
    assert alone["schedule"] == "1f1b" and alone["configuration"] == p.configuration
    assert any("1:2" in n for n in alone["notes"])
    toml = tmp_path / "c.toml"
    toml.write_text(cluster.to_toml())
    assert main(["simulate", str(path), "--profile", "pipedream:vgg16", "--cluster", str(toml),
                 "--schedule", "2bw", "--json"]) == 0
    exact = json.loads(capsys.readouterr().out)
    # the step costs pdcompile() charges on this cluster (a GPU: no per-action cost; PipeDream's costs are not
    # this machine's: the device's optimizer step), said in one note
    assert exact["schedule"] == "2bw" and len(exact["notes"]) == 1
    assert "no per-action cost" in exact["notes"][0] and "analytic memory bandwidth" in exact["notes"][0]
    # the same stage totals: within the 1:2 split's error of each other
    assert exact["predicted_step_time_s"] == pytest.approx(alone["predicted_step_time_s"], rel=0.5)


def test_simulate_bad_input_exits_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "pipedream:vgg16"]) == 2  # a profile without a cluster
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--cluster" in err and "Traceback" not in err
    assert main(["simulate", str(tmp_path / "missing.json"), "--cluster", "paper:A"]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(["simulate", "pipedream:alexnet", "--cluster", "paper:A", "--schedule", "zigzag"]) == 2
    assert "zigzag" in capsys.readouterr().err


def _fake_runtime_trace(folder: Path) -> None:
    """What train.py --trace writes: per rank a list of actions, seconds from the rank's start."""
    folder.mkdir()
    r0 = [("0F0", 0.0, 1.0), ("0SF0", 1.0, 1.01), ("0F1", 1.01, 2.0), ("0SF1", 2.0, 2.01), ("0WV1", 2.01, 2.01),
          ("0RB0", 2.01, 3.9), ("0B0", 4.0, 6.0), ("0RB1", 6.0, 6.0), ("0B1", 6.0, 8.0), ("0ST", 8.0, 8.2)]
    r1 = [("1RF0", 0.0, 0.5), ("1F0", 0.5, 1.5), ("1B0", 1.5, 3.5), ("1SB0", 3.5, 3.51), ("1RF1", 3.51, 3.51),
          ("1F1", 3.51, 4.5), ("1B1", 4.5, 6.5), ("1SB1", 6.5, 6.5), ("1ST", 6.5, 6.7)]
    for rank, evs, origin in ((0, r0, 100.0), (1, r1, 100.5)):
        (folder / f"rank_{rank}.events.json").write_text(json.dumps(
            [{"rank": rank, "name": n, "start_s": s, "end_s": e, "origin_s": origin} for n, s, e in evs]))


def test_runtime_events_convert_to_a_chrome_trace(tmp_path: Path) -> None:
    _fake_runtime_trace(tmp_path / "trace")
    events = read_runtime_events(tmp_path / "trace")
    assert "0WV1" not in {e.name for e in events}  # bookkeeping dropped
    f0 = {e.name: e for e in events}
    assert f0["0F0"].start_s == 0.0 and f0["1F0"].start_s == pytest.approx(1.0)  # aligned by origin_s
    assert f0["0B0"].category == "backward" and f0["1RF0"].category == "recv"
    out = tmp_path / "trace.json"
    runtime_trace_to_chrome(tmp_path / "trace", out, metadata={"run": "fake"})
    data = json.loads(out.read_text())
    slices = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in slices} == {0, 1} and all(e["dur"] >= 0 for e in slices)
    assert {e["args"]["name"] for e in data["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"} \
        == {"rank 0", "rank 1"}
    assert sorted(e.name for e in read_chrome_trace(out)) == sorted(e.name for e in events)
    assert microbatch_of("1SB12") == 12 and microbatch_of("0ST") is None and microbatch_of("0WV2") is None
    one = select_microbatches(events, 1, 1)
    assert {e.name for e in one} == {"0F1", "0SF1", "0RB1", "0B1", "0ST", "1RF1", "1F1", "1B1", "1SB1", "1ST"}


def test_simulate_draws_measured_under_predicted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _fake_runtime_trace(tmp_path / "trace")
    png = tmp_path / "both.png"
    assert main(["simulate", "pipedream:alexnet", "--cluster", "local:2", "--microbatches", "2",
                 "--measured", str(tmp_path / "trace"), "--png", str(png)]) == 0
    assert "wrote timeline" in capsys.readouterr().out and png.stat().st_size > 10_000
    assert main(["simulate", "pipedream:alexnet", "--cluster", "local:2",
                 "--measured", str(tmp_path / "nothing")]) == 2


@pytest.mark.multiproc
@pytest.mark.slow
def test_a_real_runtime_trace_converts_and_the_programs_plan_simulates(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """train.py --trace on two processes: every rank's actions, in a valid Chrome trace. All of it as a user
    types it in a fresh folder, with relative paths; then the program's own plan.json (whose plan codegen stores
    beside the program's fields) simulates."""
    import torch

    from pdcompile.api import pdcompile
    from _ranks import run_ranks
    from pdcompile.zoo import get

    (tmp_path / "user").mkdir()
    monkeypatch.chdir(tmp_path / "user")
    z = get("mlp", batch_size=8)
    pipe = pdcompile(z.model, example_inputs=z.example_inputs, example_target=z.target, loss_fn=z.loss_fn,
                     optimizer=lambda p: torch.optim.SGD(p, lr=0.01), stages=2, schedule="flush",
                     num_microbatches=2, leaf_modules=z.leaf_modules)
    data = {"factory": "pdcompile.zoo:batches", "kwargs": {"name": "mlp", "cycle": 2}}
    prog = pipe.emit("prog", data=data)
    rc, log = run_ranks(prog, 2, ["--steps", "2", "--trace", "trace", "--timeout", "60"], timeout=120)
    assert rc == 0, log[-2000:]
    events = runtime_trace_to_chrome(Path("trace"), Path("trace.json"))
    names = {e.name for e in events}
    assert {"0F0", "0F3", "0B3", "0ST", "1F0", "1B3", "1ST"} <= names
    assert len(read_chrome_trace(Path("trace.json"))) == len(events)

    capsys.readouterr()
    assert main(["simulate", "prog/plan.json", "--json"]) == 0  # (drawn with --measured: test_simulate_draws_...)
    out = json.loads(capsys.readouterr().out)
    # the program's schedule, microbatches and configuration, from its plan's own per-stage totals
    assert (out["schedule"], out["num_microbatches"], out["configuration"]) == ("flush", 2, pipe.plan.configuration)
    alone = pipe.plan.stages  # flush of 2 microbatches on 2 stages, forward:backward 1:2: the step is at least
    # every stage's work and at most all of it in a row
    work = [st.compute_s * st.replicas * 2 for st in alone]
    assert max(work) <= out["predicted_step_time_s"] <= sum(work) + sum(st.send_s for st in alone) * 2


@pytest.mark.parametrize("flags", [
    [],  # the DP's defaults: recomputation where memory needs it, pooled workers (VGG-16 on Cluster A: 15-1)
    # a synchronous schedule is planned by its step of the microbatches simulated (both commands' --microbatches)
    ["--schedule", "gpipe", "--cost-model", "paper", "--memory-limit", "--no-pool", "--recompute", "full",
     "--microbatches", "8"],
    ["--schedule", "2bw", "--shard", "optimizer", "--recompute", "none"],
])
def test_simulate_plans_a_profile_as_pdcompile_plan_does(flags: list[str]) -> None:
    """``pdcompile simulate PROFILE`` simulates the plan ``pdcompile plan --profile PROFILE`` prints for the
    same planning flags (one function builds both's options and plans: _cli/plan.py)."""
    from pdcompile._cli.plan import plan_for
    from pdcompile._cli.simulate import predict
    from pdcompile.cli import build_parser

    def fingerprint(p: Any) -> dict[str, Any]:
        d = p.to_dict()
        d.pop("planning_seconds")
        return d

    parser = build_parser()
    planned = plan_for(parser.parse_args(["plan", "--profile", "pipedream:vgg16", "--cluster", "paper:A", *flags]))
    _, simulated, _, _, _ = predict(parser.parse_args(["simulate", "pipedream:vgg16", "--cluster", "paper:A", *flags]))
    assert fingerprint(simulated) == fingerprint(planned)


def test_simulate_counts_the_profiles_optimizer_state(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A profile of a model trained with Adam: each stage holds two bytes of optimizer state per weight byte,
    one more than SGD with momentum's (PipeDream's profiles' optimizer), in the simulated peak memory, the
    stage's weights read from the profile's layers."""
    import dataclasses

    from pdcompile.profile import save

    prof = load("pipedream:alexnet")
    assert prof.optimizer == "sgd-momentum"
    adam = tmp_path / "adam.json"
    save(dataclasses.replace(prof, optimizer="adam"), adam)
    out = {}
    for name, source in (("momentum", "pipedream:alexnet"), ("adam", str(adam))):
        assert main(["simulate", source, "--cluster", str(_cluster_toml(tmp_path)), "--schedule", "flush",
                     "--no-memory-limit", "--json"]) == 0
        out[name] = json.loads(capsys.readouterr().out)
    assert out["adam"]["configuration"] == out["momentum"]["configuration"]
    # planned by its step of the 8 microbatches simulated (simulate's default count)
    p = plan(linearize(prof), flat_cluster(4, 10e9), schedule="flush", memory_limit=False, pool=True,
             num_microbatches=8)
    assert p.configuration == out["adam"]["configuration"]
    layers = linearize(prof).layers
    weights = [sum(l.param_bytes for l in layers[st.first:st.last + 1]) for st in p.stages]
    more = [a - m for a, m in zip(out["adam"]["peak_memory_bytes"], out["momentum"]["peak_memory_bytes"])]
    assert more == pytest.approx(weights, rel=1e-9) and min(weights) > 0
