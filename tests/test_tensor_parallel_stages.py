"""A tensor-parallel degree per stage (``tensor_parallel=[t0, t1, ...]`` with ``stages=``): the rank layout
(runtime/tensor_parallel.py ``RankLayout``) against a brute-force enumeration, the option's refusals, what
the plan charges per stage, and training of the zoo GPT with t = [2, 1] and [1, 2] on 3 processes (flush,
1F1B) against single-process training of the same model (fp32, gloo)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from _hf_llama import token_batches
from _ranks import run_ranks
from pdcompile.errors import UsageError
from pdcompile.merge import merge_weights
from pdcompile.passes.planner import tensor
from pdcompile.runtime.data import save_batches
from pdcompile.runtime.tensor_parallel import RankLayout
from _tp_common import CFG, MICRO, MODELS, STEPS, reference_weights
from pdcompile.zoo.losses import SequenceCrossEntropy
from test_tensor_parallel import _compile, _compiled

pytestmark = pytest.mark.xdist_group("tensor_parallel")  # shares test_tensor_parallel's compiles


# --- the layout, by brute force ------------------------------------------------------------------

def _brute(stage_ranks: list[list[int]], degrees: list[int]) -> dict[int, tuple[int, int]]:
    """process -> (pipeline rank, tensor index): the ranks in order, each its stage's t processes in a row."""
    t_of = {q: t for rs, t in zip(stage_ranks, degrees) for q in rs}
    out, p = {}, 0
    for q in sorted(t_of):
        for j in range(t_of[q]):
            out[p] = (q, j)
            p += 1
    return out


LAYOUTS = [([[0], [1]], [2, 1]), ([[0], [1]], [1, 2]), ([[0], [1], [2]], [4, 2, 1]), ([[0, 1], [2]], [2, 4]),
           ([[0], [1, 2], [3]], [1, 2, 3]), ([[0], [1]], [2, 2]), ([[0, 1], [2, 3]], [1, 1])]


@pytest.mark.parametrize("stage_ranks,degrees", LAYOUTS)
def test_the_rank_layout_matches_a_brute_force_enumeration(stage_ranks: list[list[int]], degrees: list[int]) -> None:
    lay = RankLayout.of(stage_ranks, degrees)
    where = _brute(stage_ranks, degrees)
    assert lay.world == len(where) == sum(len(rs) * t for rs, t in zip(stage_ranks, degrees))
    for p, (q, j) in where.items():
        got = lay.locate(p)
        assert (got.logical, got.index, got.degree) == (q, j, degrees[next(s for s, rs in enumerate(stage_ranks)
                                                                          if q in rs)])
        assert lay.process(q, j) == p
    if len(set(degrees)) == 1:  # one degree: the (pipeline, data, tensor) mesh, tensor innermost
        assert all(p == q * degrees[0] + j for p, (q, j) in where.items())
    # every pair of ranks a value may cross between (either direction: activations and gradients)
    ranks = sorted({q for rs in stage_ranks for q in rs})
    for a, b in itertools.permutations(ranks, 2):
        ta, tb = lay.rank_degrees[a], lay.rank_degrees[b]
        sent = {(s, r) for j in range(ta) for r in lay.targets(a, j, b) for s in [lay.process(a, j)]}
        got = {(lay.source(b, k, a), lay.process(b, k)) for k in range(tb)}
        assert sent == got  # what each sender sends is what each receiver posts a receive for
        receivers = [r for _, r in sent]
        assert sorted(receivers) == [p for p, (q, _) in where.items() if q == b]  # each receiver exactly once
        for s, r in sent:  # from a sender of its own rank, the index rule: k % t_send
            assert where[s][0] == a and where[s][1] == where[r][1] % ta
        if tb >= ta:  # every sender sends; else only the first tb do
            assert {s for s, _ in sent} == set(lay.block(a))
        else:
            assert {where[s][1] for s, _ in sent} == set(range(tb))
    for rs in stage_ranks:  # a stage's replicas: a group per tensor index, each process in one
        groups = lay.groups(rs)
        assert sorted(p for g in groups for p in g) == sorted(p for q in rs for p in lay.block(q))
    # a weight tied across every stage: each process in exactly one group, each group holding every rank,
    # and the shares of a rank's processes in a group adding to one copy of the rank's gradient
    tied = lay.tied_groups(ranks)
    assert sorted(p for g in tied for p in g) == list(range(lay.world))
    for g in tied:
        assert {where[p][0] for p in g} == set(ranks)
        for q in ranks:
            mine = [p for p in g if where[p][0] == q]
            assert all(lay.tied_share(q, where[p][1], ranks) == len(mine) for p in mine)


def test_virtual_stages_of_one_rank_with_differing_degrees_are_refused() -> None:
    with pytest.raises(ValueError, match="need one degree"):
        RankLayout.of([[0], [1], [1], [0]], [2, 1, 1, 1]).world
    with pytest.raises(UsageError, match=r"rank 0 runs stages 0 and 2, whose degrees differ"):
        _compile("gpt", 4, "interleaved-1f1b", tensor_parallel=[2, 1, 1, 1], virtual_stages=2)


# --- the option, the plan --------------------------------------------------------------------------

def test_a_degree_list_must_name_every_stage() -> None:
    with pytest.raises(UsageError, match=r"tensor_parallel=\[2, 1, 1\] names 3 stages, but stages=2; give one degree"):
        _compile("gpt", 2, tensor_parallel=[2, 1, 1])
    with pytest.raises(UsageError, match=r"needs stages= as many"):
        _compile("gpt", None, tensor_parallel=[2, 1])


def test_each_stage_is_charged_and_shown_at_its_own_degree(tmp_path: Path) -> None:
    pipe = _compiled("gpt", 2, "flush", (2, 1))
    flat = _compiled("gpt", 2, "flush", None)
    assert [st.tensor_parallel for st in pipe.plan.stages] == [2, 1]
    assert [(st.first, st.last) for st in pipe.plan.stages] == [(st.first, st.last) for st in flat.plan.stages]
    # stage 0 charged as one of its 2 processes (passes/planner/tensor.py, its own closed form), stage 1 whole
    chain, bw = pipe.wire_chain, pipe.cluster.levels[0].bandwidth
    a, b = pipe.plan.stages[0].first, pipe.plan.stages[0].last
    want0 = sum(tensor.layer_at(l, 2, bw).forward_s + tensor.layer_at(l, 2, bw).backward_s
                for l in chain.layers[a:b + 1])
    assert pipe.plan.stages[0].compute_s == pytest.approx(want0, rel=1e-9)
    assert pipe.plan.stages[0].compute_s != pytest.approx(flat.plan.stages[0].compute_s, rel=1e-6)  # (on this
    # tiny model the all-reduces' latency outweighs the halved work)
    assert pipe.plan.stages[1].compute_s == pytest.approx(flat.plan.stages[1].compute_s, rel=1e-9)
    assert pipe.simulate().step_time_s != pytest.approx(flat.simulate().step_time_s, rel=1e-6)
    assert pipe.world_size == 3
    assert [st.degree for st in pipe.state.tensor_parallel.stages] == [2, 1]
    text = pipe.explain()
    assert "stage 0: tensor parallel t=2" in text and "stage 1: tensor parallel t=1" in text
    assert "degrees [2, 1] per stage, 3 processes" in text
    assert "tied to a copy in a stage of another degree (stage 0: t=2, stage 1: t=1)" in text
    prog = pipe.emit(tmp_path / "prog")
    plan = json.loads((prog / "plan.json").read_text())
    assert plan["world_size"] == 3
    assert [(s["ranks"], s["tensor_parallel"], s["processes"]) for s in plan["stages"]] == \
        [([0], 2, [[0, 1]]), ([1], 1, [[2]])]


def test_the_command_line_takes_a_degree_per_stage(tmp_path: Path) -> None:
    from pdcompile.cli import main

    out = tmp_path / "prog"
    assert main(["emit", "zoo:gpt", "--stages", "2", "--tensor-parallel", "1,2", "-o", str(out)]) == 0
    plan = json.loads((out / "plan.json").read_text())
    assert plan["world_size"] == 3 and [s["tensor_parallel"] for s in plan["stages"]] == [1, 2]
    assert main(["emit", "zoo:gpt", "--stages", "2", "--tensor-parallel", "2,1,1", "-o", str(tmp_path / "x")]) == 2


# --- training: t = [2, 1] and [1, 2] on 3 processes --------------------------------------------------

# the GPT's embedding and head are tied across its 2 stages (whole: degrees differ); the Llama's are not (its
# embedding splits by vocabulary in stage 0), and it clips by the global norm over stages of both degrees
CASES = [("gpt", (2, 1), "flush", None), ("gpt", (1, 2), "1f1b", None), ("llama", (2, 1), "1f1b", 0.5)]


@pytest.mark.multiproc
@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind,degrees,schedule,clip", CASES,
                         ids=[f"{k}-{d[0]}x{d[1]}-{s}-{c}" for k, d, s, c in CASES])
def test_degrees_per_stage_train_like_one_process(tmp_path: Path, kind: str, degrees: tuple[int, int],
                                                  schedule: str, clip: float | None) -> None:
    data = token_batches(CFG.vocab_size, STEPS, 4, CFG.seq_len)
    save_batches(data, STEPS, tmp_path / "data.pt")
    pipe = _compiled(kind, 2, schedule, degrees)
    prog = pipe.emit(tmp_path / "prog", data={"factory": "pdcompile.runtime.data:from_file",
                                              "kwargs": {"path": str(tmp_path / "data.pt")}})
    extra = ["--clip-grad-norm", str(clip)] if clip is not None else []
    rc, log = run_ranks(prog, 3, ["--steps", str(STEPS), "--save-final", str(tmp_path / "final"),
                                  "--metrics", str(tmp_path / "m"), "--timeout", "90", *extra], timeout=400)
    assert rc == 0, log[-3000:]
    files = sorted(p.name for p in (tmp_path / "final").iterdir())
    split = degrees.index(2)  # the stage of 2 processes: its index 1 writes the parameters it left whole
    assert files == sorted(["stage_0.rank_0.pt", "stage_1.rank_1.pt", f"stage_{split}.rank_{split}.tensor_1.pt"])
    zero = torch.load(tmp_path / "final" / f"stage_{split}.rank_{split}.pt", weights_only=True)
    one = torch.load(tmp_path / "final" / f"stage_{split}.rank_{split}.tensor_1.pt", weights_only=True)
    assert one and all(torch.equal(zero[n], t) for n, t in one.items())  # whole parameters: the same on both
    got = merge_weights(prog, tmp_path / "final")
    norms: list[float] = []
    want, _ = reference_weights(_compiled(kind, 2, schedule, None), schedule, SequenceCrossEntropy(), data,
                                replicas=[1, 1], max_norm=clip, norms=norms)
    initial = {k: v.detach() for k, v in MODELS[kind][0]().named_parameters()}
    assert set(want) <= set(got)
    for k, w in want.items():
        torch.testing.assert_close(got[k], w, rtol=0, atol=1e-5, msg=lambda m: f"{k}: {m}")
    assert sum(not torch.equal(want[k], initial[k]) for k in want) > len(want) // 2  # it trained
    metrics: Any = json.loads((tmp_path / "m" / f"rank_{split}.json").read_text())
    shards = metrics["tensor_parallel_shards"]  # the split stage's linears hold half their rows or columns
    assert shards is not None and any(v for v in shards.values())
    if kind == "llama":  # untied: stage 0's embedding splits by vocabulary
        assert pipe.state.tensor_parallel.stages[0].embeddings
    if clip is not None:  # the global norm counts each shard once and each whole parameter once, over both stages
        last = json.loads((tmp_path / "m" / "rank_0.json").read_text())
        assert len(last["grad_norms"]) == len(norms) == STEPS * MICRO and min(norms) > clip  # it clipped (1F1B steps
        # each microbatch)
        assert last["grad_norms"] == pytest.approx(norms, rel=1e-5)
