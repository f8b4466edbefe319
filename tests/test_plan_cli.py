"""``pdcompile plan``: the JSON and table outputs, and every bad input exits 2 with one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdcompile.cli import main

VGG = "pipedream:vgg16"  # PipeDream's profile, shipped in the package

CLUSTER_1GBS = """\
[device]
name = "V100"
memory = "16 GiB"

[[levels]]
name = "gpus"
count = 4
bandwidth = "1 GB/s"
"""


@pytest.fixture
def cluster4(tmp_path: Path) -> Path:
    p = tmp_path / "cluster.toml"
    p.write_text(CLUSTER_1GBS)
    return p


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        rc = main(list(argv))
    except SystemExit as e:  # argparse
        rc = int(e.code or 0)
    out, err = capsys.readouterr()
    return rc, out, err


def test_json_output_schema_and_vgg_three_one(capsys, cluster4):
    rc, out, err = _run(capsys, "plan", "--profile", str(VGG), "--cluster", str(cluster4),
                        "--cost-model", "paper", "--json")
    assert rc == 0, err
    d = json.loads(out)  # stdout is exactly one JSON object
    assert d["solver"] == "dp" and d["cost_model"] == "paper"
    assert [s["replicas"] for s in d["stages"]] == [3, 1]
    assert d["stages"][0]["layers"] == [0, 16] and d["stages"][1]["layers"] == [17, 39]
    assert sorted(r for s in d["stages"] for r in s["ranks"]) == [0, 1, 2, 3]
    pred = d["predicted"]
    for key in ("seconds_per_minibatch", "samples_per_second", "data_parallel_samples_per_second",
                "speedup_vs_data_parallel"):
        assert isinstance(pred[key], float)
    assert pred["speedup_vs_data_parallel"] > 1
    assert isinstance(d["planning_seconds"], float)


def test_table_output(capsys, cluster4):
    rc, out, _ = _run(capsys, "plan", "--profile", str(VGG), "--cluster", str(cluster4), "--cost-model", "paper")
    assert rc == 0
    assert "configuration 3-1" in out and "bottleneck:" in out and "speedup" in out


def test_ilp_solver_and_builtin_clusters(capsys):
    rc, out, err = _run(capsys, "plan", "--profile", str(VGG), "--cluster", "local:2", "--solver", "ilp",
                        "--cost-model", "paper", "--json", "--time-limit", "60")
    assert rc == 0, err
    d = json.loads(out)
    assert d["solver"] == "ilp" and d["optimal"] is True
    rc, out, err = _run(capsys, "plan", "--profile", str(VGG), "--cluster", "paper:B", "--schedule", "flush",
                        "--json")
    assert rc == 0, err
    assert json.loads(out)["schedule"] == "flush"


def test_microbatch_choice(capsys, tmp_path):
    from pdcompile.profile import Profile, ProfileLayer, save

    layers = tuple(
        ProfileLayer(name=f"l{i}", op="Linear", forward_s=0.01, backward_s=0.02, output_bytes=1e6,
                     param_bytes=1e6, inputs=(f"l{i - 1}",) if i else (), output_bytes_expr="125000*b")
        for i in range(6)
    )
    path = tmp_path / "p.json"
    save(Profile(layers=layers, batch_size=8, name="toy"), path)
    rc, out, err = _run(capsys, "plan", "--profile", str(path), "--cluster", "local:2", "--microbatch", "4,8,16",
                        "--json")
    assert rc == 0, err
    d = json.loads(out)
    assert d["microbatch_size"] in (4, 8, 16)
    assert any("microbatch size chosen" in n for n in d["notes"])


BAD_TOML = {
    "unit": ('[device]\nname = "x"\nmemory = "16 GiB"\n\n[[levels]]\ncount = 4\nbandwidth = "10 furlongs"\n',
             ":7:", "levels[0].bandwidth"),
    "count": ('[device]\nmemory = "16 GiB"\n\n[[levels]]\ncount = 0\nbandwidth = "10 GB/s"\n',
              ":5:", "levels[0].count"),
    "syntax": ("[device\n", "invalid TOML", ""),
}


@pytest.mark.parametrize("case", sorted(BAD_TOML))
def test_bad_cluster_files(capsys, tmp_path, case):
    text, where, key = BAD_TOML[case]
    p = tmp_path / "bad.toml"
    p.write_text(text)
    rc, out, err = _run(capsys, "plan", "--profile", str(VGG), "--cluster", str(p))
    assert rc == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert where in err and key in err


def test_bad_inputs_exit_2_with_one_line(capsys, tmp_path, cluster4):
    bad_profile = tmp_path / "bad.txt"
    bad_profile.write_text("node1 -- Conv -- forward_compute_time=oops\n")
    no_mem = tmp_path / "nomem.toml"
    no_mem.write_text('[device]\nname = "x"\n\n[[levels]]\ncount = 2\nbandwidth = "1 GB/s"\n')
    tiny = tmp_path / "tiny.toml"
    tiny.write_text('[device]\nname = "x"\nmemory = "1 MiB"\n\n[[levels]]\ncount = 2\nbandwidth = "1 GB/s"\n')
    cases = {
        "missing profile": (["--profile", str(tmp_path / "nope.txt"), "--cluster", str(cluster4)], "no such file"),
        "nothing to plan": (["--cluster", str(cluster4)], "nothing to plan"),
        "both": (["x:y", "--profile", str(VGG), "--cluster", str(cluster4)], "not both"),
        "missing cluster": (["--profile", str(VGG), "--cluster", str(tmp_path / "c.toml")], "no such file"),
        "bad local": (["--profile", str(VGG), "--cluster", "local:two"], "local:N"),
        "bad paper": (["--profile", str(VGG), "--cluster", "paper:C"], "unknown paper cluster"),
        "malformed profile": (["--profile", str(bad_profile), "--cluster", str(cluster4)], "bad.txt"),
        "memory unknown": (["--profile", str(VGG), "--cluster", str(no_mem)], "device.memory"),
        "does not fit": (["--profile", str(VGG), "--cluster", str(tiny)], "smallest per-worker memory"),
        "bad microbatch": (["--profile", str(VGG), "--cluster", str(cluster4), "--microbatch", "a,b"], "--microbatch"),
        "bad time limit": (["--profile", str(VGG), "--cluster", str(cluster4), "--time-limit", "-1"], "--time-limit"),
        "input with profile": (["--profile", str(VGG), "--cluster", str(cluster4), "--input", "8x3"], "--input"),
        "bad factory": (["nosuchmodule_xyz:make", "--input", "8x3", "--cluster", str(cluster4)], "cannot import"),
    }
    for name, (argv, needle) in cases.items():
        rc, out, err = _run(capsys, "plan", *argv)
        assert rc == 2, (name, rc, err)
        assert out == "", name
        lines = err.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in err, (name, err)
        assert needle in err, (name, err)


def test_argparse_errors_exit_2(capsys):
    for argv in (["plan"], ["plan", "--profile", "x", "--cluster", "y", "--solver", "greedy"],
                 ["plan", "--profile", "x", "--cluster", "y", "--cost-model", "nope"]):
        rc, out, err = _run(capsys, *argv)
        assert rc == 2 and "error:" in err.strip().splitlines()[-1]


def test_debug_shows_traceback(capsys, tmp_path):
    with pytest.raises(Exception):
        main(["--debug", "plan", "--profile", str(tmp_path / "nope"), "--cluster", "local:2"])


def test_vgg16_cluster_a_pools_and_recomputes_by_default(capsys) -> None:
    """With what autograd saves estimated for PipeDream's profile (an in-place ReLU counted once), the
    DP's defaults (recompute auto, pooled workers) find the paper's 15-1, its first stage recomputing
    its fewest first layers that fit 16 GiB, over 3x data parallelism; without recomputation or
    pooling, a nested 9-3-1 that fits as it is, slower."""
    rc, out, _ = _run(capsys, "plan", "--profile", VGG, "--cluster", "paper:A", "--json")
    assert rc == 0
    d = json.loads(out)
    assert [s["replicas"] for s in d["stages"]] == [15, 1]
    assert d["stages"][0]["recompute"] == "partial" and d["stages"][0]["recompute_layers"] >= 1
    assert d["stages"][1]["recompute"] == "none"
    assert all(s["memory_bytes"] <= 16 * 2**30 for s in d["stages"])
    assert d["predicted"]["speedup_vs_data_parallel"] >= 3.0
    rc, text, _ = _run(capsys, "plan", "--profile", VGG, "--cluster", "paper:A")
    assert rc == 0 and f"first {d['stages'][0]['recompute_layers']} of 31 layers" in text
    rc, out, _ = _run(capsys, "plan", "--profile", VGG, "--cluster", "paper:A", "--json", "--no-pool",
                      "--recompute", "none")
    nested = json.loads(out)
    assert rc == 0 and [s["replicas"] for s in nested["stages"]] == [9, 3, 1]
    assert all(s["recompute"] == "none" and s["memory_bytes"] <= 16 * 2**30 for s in nested["stages"])
    assert 2.9 < nested["predicted"]["speedup_vs_data_parallel"] < d["predicted"]["speedup_vs_data_parallel"]
    rc, out, err = _run(capsys, "plan", "--profile", VGG, "--cluster", "paper:A", "--solver", "ilp", "--pool")
    assert rc == 2 and "solver='dp'" in err and len(err.strip().splitlines()) == 1


def test_every_cost_model_and_schedule_from_the_cli(capsys) -> None:
    """--cost-model pipedream plans as the released optimizer does (the DP's own tests hold it to
    the released code's outputs), without pooled workers; --schedule takes every registered schedule."""
    from pdcompile.cluster import paper_cluster
    from pdcompile.passes.linearize import linearize
    from pdcompile.passes.partition_dp import partition_dp
    from pdcompile.profile import load

    rc, out, _ = _run(capsys, "plan", "--profile", "pipedream:vgg16", "--cluster", "paper:A", "--cost-model",
                      "pipedream", "--json")
    assert rc == 0
    want = partition_dp(linearize(load("pipedream:vgg16")), paper_cluster("A"), cost_model="pipedream",
                        memory_limit=False)
    assert json.loads(out)["configuration"] == want.configuration
    for schedule in ("gpipe", "zb-h1"):
        for solver in ("dp", "ilp"):
            rc, out, err = _run(capsys, "plan", "--profile", "pipedream:alexnet", "--cluster", "local:2",
                                "--schedule", schedule, "--solver", solver, "--json")
            assert rc == 0, err


def test_recompute_selective_on_a_profile_without_its_costs_is_a_clear_error(capsys) -> None:
    """PipeDream's profiles carry no per-layer selective costs: --recompute selective says so and
    what to use instead (exit 2, one line, no traceback); --recompute full plans."""
    rc, out, err = _run(capsys, "plan", "--profile", VGG, "--cluster", "paper:A", "--recompute", "selective")
    assert rc == 2 and out == "" and "Traceback" not in err
    assert "selective" in err and "recompute='full' or 'auto'" in err and len(err.strip().splitlines()) == 1
    rc, out, _ = _run(capsys, "plan", "--profile", VGG, "--cluster", "paper:A", "--recompute", "full", "--json")
    assert rc == 0 and all(s["recompute"] == "full" for s in json.loads(out)["stages"])


def test_microbatches_plan_a_synchronous_step_and_let_the_search_choose(capsys, cluster4):
    """``--microbatches N``: flush is planned by its simulated step of N microbatches (the headline is that step,
    as simulate_plan replays it); ``--choose-microbatches``: the step search cuts the same minibatch into the
    count it chooses, never slower than N; bad counts and schedules exit 2 with one line."""
    from pdcompile.passes.linearize import linearize
    from pdcompile.plan import Plan
    from pdcompile.profile import load
    from pdcompile._cli._args import resolve_cluster
    from pdcompile.simulate import simulate_plan, update_bandwidth_of

    base = ["plan", "--profile", VGG, "--cluster", str(cluster4), "--schedule", "flush", "--json"]
    rc, out, err = _run(capsys, *base, "--microbatches", "8")
    assert rc == 0, err
    fixed = Plan.from_json(out)
    assert fixed.num_microbatches == 8
    chain = linearize(load(VGG))
    cluster = resolve_cluster(str(cluster4))
    step = float(simulate_plan(fixed, chain.at_batch(fixed.microbatch_size), cluster, "flush", 8,
                               split_backward=True, optimizer_state_factor=fixed_factor(fixed),
                               update_bandwidth=update_bandwidth_of(cluster)).step_time_s)
    assert fixed.seconds_per_minibatch == pytest.approx(step, rel=1e-9)
    rc, out, err = _run(capsys, *base, "--microbatches", "8", "--choose-microbatches")
    assert rc == 0, err
    chosen = Plan.from_json(out)
    assert chosen.num_microbatches * chosen.microbatch_size == 8 * chain.batch_size
    assert chosen.seconds_per_minibatch <= fixed.seconds_per_minibatch * (1 + 1e-9)
    for bad, says in ((["--microbatches", "0"], "--microbatches 0"),
                      (["--choose-microbatches", "--schedule", "1f1b"], "--choose-microbatches")):
        rc, out, err = _run(capsys, *base, *bad)
        assert rc == 2 and says in err and len(err.strip().splitlines()) == 1, err


def fixed_factor(plan) -> float:
    """The optimizer state the command planned with (PipeDream's profiles: SGD with momentum, or as they say)."""
    from pdcompile.profile import load, optimizer_state_factor

    return optimizer_state_factor(load(VGG).optimizer)
