"""Tests of the profile file: JSON round trip, PipeDream import, errors, batch-size scaling."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdcompile.errors import ProfileError
from pdcompile.profile import (
    PIPEDREAM_DIR,
    Profile,
    ProfileInput,
    ProfileLayer,
    from_json,
    load,
    load_pipedream,
    optimizer_state_factor,
    pipedream_profiles,
    save,
    to_json,
)

pytestmark = pytest.mark.timeout(120)

PIPEDREAM = PIPEDREAM_DIR  # PipeDream's fourteen profiles, shipped in the package (pipedream:NAME)
FILES = sorted(PIPEDREAM.glob("*.txt"))


def _direct_totals(path: Path) -> tuple[float, float, int, int]:
    """Totals straight from the text, independently of the parser: (fwd+bwd seconds over
    non-input nodes, parameter bytes, #non-input nodes, #input nodes)."""
    comp = params = 0.0
    n_layers = n_inputs = 0
    for line in path.read_text().splitlines():
        if not line.startswith("node"):
            continue
        desc = line.split(" -- ")[1]
        f = float(re.search(r"forward_compute_time=([\d.]+)", line).group(1))
        b = float(re.search(r"backward_compute_time=([\d.]+)", line).group(1))
        p = float(re.search(r"parameter_size=([\d.]+)", line).group(1))
        if re.fullmatch(r"Input\d*", desc):
            n_inputs += 1
            continue
        n_layers += 1
        comp += (f + b) / 1e3
        params += p
    return comp, params, n_layers, n_inputs


def test_fourteen_profiles_are_there() -> None:
    assert len(FILES) == 14


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_pipedream_import_totals(path: Path) -> None:
    prof = load(path)
    comp, params, n_layers, n_inputs = _direct_totals(path)
    assert prof.mode == "pipedream"
    assert len(prof.layers) == n_layers
    assert len(prof.inputs) == n_inputs
    assert prof.compute_s == pytest.approx(comp, rel=1e-12)
    assert prof.param_bytes == pytest.approx(params, rel=1e-12)
    # layers are topological: each reads only earlier layers or inputs
    seen = {i.name for i in prof.inputs}
    for layer in prof.layers:
        assert set(layer.inputs) <= seen
        seen.add(layer.name)
    # every edge of the file is kept
    n_edges = sum(1 for line in path.read_text().splitlines() if line.startswith("\t"))
    assert sum(len(l.inputs) for l in prof.layers) == n_edges


def test_multi_output_activation_is_summed() -> None:
    prof = load_pipedream("pipedream:gnmt")
    lstm = prof.layer("node7")
    assert lstm.op == "LSTM"
    assert lstm.output_bytes == 6291456.0 + 131072.0 + 131072.0
    assert lstm.forward_s == pytest.approx(3.190e-3)
    assert lstm.backward_s == pytest.approx(5.348e-3)
    assert [i.name for i in prof.inputs] == ["node1", "node2", "node3"]


def test_json_round_trip_pipedream(tmp_path: Path) -> None:
    prof = load("pipedream:inception_v3")
    out = tmp_path / "p.json"
    save(prof, out)
    back = load(out)
    assert back.layers == prof.layers
    assert back.inputs == prof.inputs
    assert (back.batch_size, back.mode, back.name) == (prof.batch_size, prof.mode, prof.name)
    assert json.loads(out.read_text())["format"] == "pdcompile-profile"


names = st.text(alphabet="abcdefgh_", min_size=1, max_size=6)
costs = st.floats(min_value=0, max_value=1e3, allow_nan=False)


@st.composite
def profiles(draw: st.DrawFn) -> Profile:
    n = draw(st.integers(1, 8))
    inputs = (ProfileInput("x", draw(costs), "3*b"),)
    layers = []
    for k in range(n):
        earlier = ["x"] + [f"l{j}" for j in range(k)]
        ins = draw(st.lists(st.sampled_from(earlier), max_size=3, unique=True))
        layers.append(ProfileLayer(
            name=f"l{k}", op=draw(names), forward_s=draw(costs), backward_s=draw(costs),
            output_bytes=draw(costs), param_bytes=draw(costs), inputs=tuple(ins),
            desc=draw(names), forward_flops=draw(costs),
            output_bytes_expr=draw(st.sampled_from([None, "4*b", "2*b + 7"])),
            tensor_output=draw(st.booleans()),
        ))
    return Profile(layers=tuple(layers), batch_size=draw(st.integers(1, 64)),
                   device="cpu", name=draw(names), inputs=inputs,
                   outputs=(f"l{n - 1}",), optimizer="adam")


@settings(max_examples=40, deadline=None)
@given(profiles())
def test_json_round_trip_random(prof: Profile) -> None:
    back = from_json(json.loads(json.dumps(to_json(prof))))
    assert back.layers == prof.layers
    assert back.inputs == prof.inputs
    assert back.outputs == prof.outputs
    assert (back.batch_size, back.device, back.name, back.optimizer) == (
        prof.batch_size, prof.device, prof.name, prof.optimizer)


def test_at_batch_size_uses_expressions_and_scales_times() -> None:
    prof = Profile(
        layers=(
            ProfileLayer("a", "Linear", 1.0, 2.0, 400.0, 10.0, ("x",), output_bytes_expr="100*b"),
            ProfileLayer("s", "size", 0.0, 0.0, 8.0, 0.0, ("a",), output_bytes_expr="8"),
            ProfileLayer("c", "relu", 0.5, 0.5, 400.0, 0.0, ("a",)),
        ),
        batch_size=4, inputs=(ProfileInput("x", 64.0, "16*b"),),
    )
    p8 = prof.at_batch_size(8)
    assert p8.batch_size == 8
    assert p8.layer("a").output_bytes == 800
    assert p8.layer("s").output_bytes == 8  # constant stays constant
    assert p8.layer("c").output_bytes == 800  # no expression: linear in b
    assert p8.layer("a").forward_s == 2.0 and p8.layer("a").backward_s == 4.0
    assert p8.layer("a").param_bytes == 10.0
    assert p8.inputs[0].output_bytes == 128


def test_at_batch_size_analytic_follows_flops() -> None:
    layer = ProfileLayer("a", "Linear", 1.0, 2.0, 40.0, 0.0, forward_flops=110.0,
                         forward_flops_expr="100*b + 10", backward_flops=220.0,
                         backward_flops_expr="200*b + 20")
    prof = Profile(layers=(layer,), batch_size=1, mode="analytic")
    a = prof.at_batch_size(3).layer("a")
    assert a.forward_flops == 310 and a.backward_flops == 620
    assert a.forward_s == pytest.approx(310 / 110)
    assert a.backward_s == pytest.approx(2 * 620 / 220)


def test_optimizer_state() -> None:
    assert optimizer_state_factor("sgd-momentum") == 1.0
    assert optimizer_state_factor("Adam") == 2.0
    prof = Profile(layers=(ProfileLayer("a", "Linear", 0, 0, 0, 100.0),), batch_size=1,
                   optimizer="adam")
    assert prof.optimizer_state_bytes() == 200.0
    with pytest.raises(ProfileError, match="unknown optimizer"):
        optimizer_state_factor("lamb")


GOOD = (
    "node1 -- Input0 -- forward_compute_time=0.000, backward_compute_time=0.000, "
    "activation_size=16.0, parameter_size=0.000\n"
    "node2 -- Linear(4, 4) -- forward_compute_time=1.5, backward_compute_time=2.5, "
    "activation_size=16.0, parameter_size=80.0\n"
    "node3 -- ReLU -- forward_compute_time=0.5, backward_compute_time=0.5, "
    "activation_size=16.0, parameter_size=0.0\n"
    "\tnode1 -- node2\n"
    "\tnode2 -- node3\n"
)


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "graph.txt"
    p.write_text(text)
    return p


def test_small_graph(tmp_path: Path) -> None:
    prof = load(_write(tmp_path, GOOD))
    assert [l.name for l in prof.layers] == ["node2", "node3"]
    assert prof.layer("node2").inputs == ("node1",)
    assert prof.layer("node2").forward_s == pytest.approx(1.5e-3)


@pytest.mark.parametrize(
    "edit, line, pattern",
    [
        (lambda t: t.replace("node3 -- ReLU -- ", "node3 ReLU "), 3, "malformed node line"),
        (lambda t: t.replace("\tnode2 -- node3", "\tnode2 -> node3"), 5, "malformed edge line"),
        (lambda t: t + "\tnode3 -- node2\n", 6, "cycle"),
        (lambda t: t + "\tnode2 -- node9\n", 6, "node9"),
        (lambda t: t.replace("forward_compute_time=1.5", "forward_compute_time=-1.5"), 2,
         "non-negative"),
        (lambda t: t.replace("activation_size=16.0, parameter_size=80.0",
                             "activation_size=abc, parameter_size=80.0"), 2, "not a number"),
        (lambda t: t.replace(", parameter_size=80.0", ""), 2, "lacks"),
    ],
    ids=["malformed-node", "malformed-edge", "cycle", "missing-node", "negative-time",
         "not-a-number", "missing-metric"],
)
def test_bad_input_names_file_and_line(tmp_path: Path, edit, line: int, pattern: str) -> None:
    path = _write(tmp_path, edit(GOOD))
    with pytest.raises(ProfileError, match=pattern) as exc:
        load(path)
    assert f"{path}:{line}:" in str(exc.value)


def test_bad_json(tmp_path: Path) -> None:
    p = tmp_path / "p.json"
    p.write_text('{"format": "pdcompile-profile",\n "version": 1,\n "layers": [}')
    with pytest.raises(ProfileError, match=rf"{re.escape(str(p))}:3: invalid JSON"):
        load(p)
    p.write_text(json.dumps({"format": "pdcompile-profile", "version": 99, "batch_size": 1,
                             "layers": []}))
    with pytest.raises(ProfileError, match="version 99"):
        load(p)
    good = to_json(Profile(layers=(ProfileLayer("a", "x", 1, 1, 1, 1, ("zz",)),),
                           batch_size=1, inputs=(ProfileInput("zz"),)))
    good["layers"][0]["forward_s"] = -1.0
    p.write_text(json.dumps(good))
    with pytest.raises(ProfileError, match="forward_s=-1.0"):
        load(p)
    good["layers"][0]["forward_s"] = 1.0
    good["inputs"] = []
    p.write_text(json.dumps(good))
    with pytest.raises(ProfileError, match="'zz'"):
        load(p)


def test_profile_module_imports_without_torch() -> None:
    code = ("import sys; import pdcompile.profile, pdcompile.passes.linearize; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
