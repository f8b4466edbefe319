"""Tests of the linearize pass: cut bytes against a brute-force count, order validity, rules."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdcompile.passes.linearize import RULES, cut_bytes, linearize, order_layers
from pdcompile.profile import PIPEDREAM_DIR, Profile, ProfileInput, ProfileLayer, load

pytestmark = pytest.mark.timeout(120)

PIPEDREAM = PIPEDREAM_DIR  # PipeDream's fourteen profiles, shipped in the package


def brute_force_cuts(prof: Profile, names: list[str]) -> list[float]:
    """For every cut, scan every value and every reader: live if produced at/before the cut
    and read (or a model output) after it; each value once."""
    pos = {n: i for i, n in enumerate(names)}
    for inp in prof.inputs:
        pos[inp.name] = -1
    nbytes = {l.name: (l.output_bytes, l.tensor_output) for l in prof.layers}
    nbytes.update({i.name: (i.output_bytes, i.tensor_output) for i in prof.inputs})
    readers: dict[str, list[int]] = {n: [] for n in pos}
    for l in prof.layers:
        for src in l.inputs:
            readers[src].append(pos[l.name])
    for o in prof.outputs:
        readers[o].append(len(names))
    cuts = []
    for i in range(len(names) - 1):
        total, blocked = 0.0, False
        for v, p in pos.items():
            if p <= i and any(r > i for r in readers[v]):
                b, tensor = nbytes[v]
                total += b
                blocked |= not tensor
        cuts.append(math.inf if blocked else total)
    return cuts


@st.composite
def dags(draw: st.DrawFn) -> Profile:
    n = draw(st.integers(1, 14))
    n_in = draw(st.integers(0, 2))
    inputs = tuple(ProfileInput(f"x{j}", float(draw(st.integers(0, 50))),
                                tensor_output=draw(st.booleans()) or True) for j in range(n_in))
    layers = []
    for k in range(n):
        earlier = [i.name for i in inputs] + [f"n{j}" for j in range(k)]
        ins = draw(st.lists(st.sampled_from(earlier), max_size=3)) if earlier else []
        layers.append(ProfileLayer(
            name=f"n{k}", op="op", forward_s=1.0, backward_s=1.0,
            output_bytes=float(draw(st.integers(0, 1000))), param_bytes=0.0,
            inputs=tuple(ins), tensor_output=draw(st.integers(0, 9)) > 0,
        ))
    outs = draw(st.lists(st.sampled_from([l.name for l in layers]), max_size=2, unique=True))
    return Profile(layers=tuple(layers), batch_size=1, inputs=inputs, outputs=tuple(outs))


def _is_topological(prof: Profile, names: list[str]) -> bool:
    pos = {n: i for i, n in enumerate(names)}
    return all(pos[s] < pos[l.name] for l in prof.layers for s in l.inputs if s in pos)


@settings(max_examples=150, deadline=None)
@given(dags(), st.sampled_from(("best",) + RULES))
def test_cuts_equal_brute_force(prof: Profile, rule: str) -> None:
    chain = linearize(prof, rule=rule)
    names = [l.name for l in chain.layers]
    assert sorted(names) == sorted(l.name for l in prof.layers)
    assert _is_topological(prof, names)
    assert [l.members for l in chain.layers] == [(n,) for n in names]
    assert list(chain.cut_bytes) == brute_force_cuts(prof, names)


@settings(max_examples=60, deadline=None)
@given(dags())
def test_best_is_no_worse_than_any_rule(prof: Profile) -> None:
    def score(chain):  # (blocked cuts, widest allowed cut)
        return (sum(math.isinf(c) for c in chain.cut_bytes), chain.widest_cut)

    best = score(linearize(prof))
    for rule in RULES:
        assert best <= score(linearize(prof, rule=rule))


def test_best_order_matches_exhaustive_search() -> None:
    """A fat skip value beside a wide branch: the best order computes the branch first."""
    L = lambda n, b, ins: ProfileLayer(n, "op", 0.0, 0.0, b, 0.0, ins)  # noqa: E731
    prof = Profile(layers=(
        L("a", 10, ()), L("fat", 1000, ("a",)), L("b1", 500, ("a",)), L("b2", 500, ("b1",)),
        L("b3", 10, ("b2",)), L("use", 10, ("fat", "b3")),
    ), batch_size=1)
    widest = linearize(prof).widest_cut
    brute = min(
        max(brute_force_cuts(prof, list(perm)))
        for perm in itertools.permutations(l.name for l in prof.layers)
        if _is_topological(prof, list(perm))
    )
    assert widest == brute == 1010  # fat (1000) live beside b3 (10)
    assert max(brute_force_cuts(prof, [l.name for l in prof.layers])) == 1500  # file order


def test_residual_block_hand_computed() -> None:
    L = lambda n, b, ins: ProfileLayer(n, "op", 0.0, 0.0, b, 0.0, ins)  # noqa: E731
    prof = Profile(
        layers=(L("conv1", 100, ("x",)), L("conv2", 100, ("conv1",)), L("add", 100, ("x", "conv2")),
                L("fc", 10, ("add",))),
        batch_size=1, inputs=(ProfileInput("x", 100.0),), outputs=("fc",))
    chain = linearize(prof)
    assert [l.name for l in chain.layers] == ["conv1", "conv2", "add", "fc"]
    assert chain.cut_bytes == (200.0, 200.0, 100.0)
    assert linearize(prof, include_inputs=False).cut_bytes == (100.0, 100.0, 100.0)


def test_non_tensor_blocks_cut() -> None:
    prof = Profile(layers=(
        ProfileLayer("size", "size", 0, 0, 8, 0, ("x",), tensor_output=False),
        ProfileLayer("a", "op", 0, 0, 50, 0, ("x",)),
        ProfileLayer("view", "view", 0, 0, 50, 0, ("a", "size")),
    ), batch_size=1, inputs=(ProfileInput("x", 50.0),))
    chain = linearize(prof, rule="profile")
    assert chain.cut_bytes[0] == math.inf
    # the best order computes the size right before its reader
    best = linearize(prof)
    assert [l.name for l in best.layers] == ["a", "size", "view"]
    assert best.cut_bytes[0] == 100.0 and best.cut_bytes[1] == math.inf


@pytest.mark.parametrize("path", sorted(PIPEDREAM.glob("*.txt")), ids=lambda p: p.stem)
def test_pipedream_chains(path: Path) -> None:
    prof = load(path)
    chain = linearize(prof)
    assert len(chain) == len(prof.layers)
    assert chain.widest_cut > 0
    assert chain.widest_cut <= linearize(prof, rule="profile").widest_cut
    names = [l.name for l in chain.layers]
    order, cuts, _ = order_layers(prof)
    assert cuts == chain.cut_bytes == cut_bytes(prof, order)
    if len(prof.layers) <= 100:  # brute force is quadratic; keep it for the small ones
        assert list(chain.cut_bytes) == brute_force_cuts(prof, names)
    assert sum(l.compute_s for l in chain.layers) == pytest.approx(prof.compute_s)
