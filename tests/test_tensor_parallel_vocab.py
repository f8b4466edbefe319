"""Vocabulary-parallel tensor parallelism (passes/vocab_parallel.py, runtime/tensor_parallel.py): the token
embedding split by rows and the LM head by output features, its logits into torch's loss-parallel
cross-entropy, where the loss is a plain cross-entropy over the logits; any other loss keeps the head whole
(and an embedding tied to it). Trained with t = 2 on 2 processes and t = 2 x 2 stages on 4 (a Hugging Face
Llama, untied, and the zoo GPT, whose wte and lm_head are one weight), flush and 1F1B, against
single-process training of the same model (fp32, gloo), on targets with ignored (-100) positions."""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from _hf_llama import llama_config, token_batches
from _ranks import run_ranks
from pdcompile import api, reference
from pdcompile.merge import merge_weights
from pdcompile.runtime.data import save_batches
from pdcompile.zoo import gpt
from pdcompile.zoo.losses import SequenceCrossEntropy

CFG = gpt.CONFIGS["small"]  # 2 layers, 2 heads, d=32, T=8, vocabulary 64
V = CFG.vocab_size
STEPS, MICRO, BATCH, LR = 2, 2, 4, 0.1

pytestmark = pytest.mark.xdist_group("tensor_parallel")  # one worker: the compiles below are made once


def _gpt() -> torch.nn.Module:
    torch.manual_seed(0)
    return gpt.GPT(CFG)


def _llama() -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(llama_config(V, attn_implementation="eager"))  # head untied


def _flat_ce(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # as a user writes it
    return F.cross_entropy(out.reshape(-1, V), y.reshape(-1), ignore_index=-100)


def _smoothed(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # no plain cross-entropy: the head stays whole
    return F.cross_entropy(out.reshape(-1, V), y.reshape(-1), label_smoothing=0.1)


MODELS = {"gpt": (_gpt, "auto"), "llama": (_llama, "export")}
LOSSES = {"seq": SequenceCrossEntropy(), "flat": _flat_ce, "smooth": _smoothed}


def _data() -> list[Any]:
    """Token batches whose targets ignore some positions (-100, as Hugging Face pads labels)."""
    data = token_batches(V, STEPS, BATCH, CFG.seq_len)
    for (_, y) in data:
        y[0, :3] = -100
        y[2, 5:] = -100
    return data


def _opt(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


@functools.lru_cache(maxsize=None)
def _compiled(kind: str, stages: int, schedule: str, loss: str, t: int | None) -> Any:
    build, frontend = MODELS[kind]
    (x,), target = _data()[0]
    kw: dict[str, Any] = {} if t is None else {"tensor_parallel": t}
    return api.pdcompile(build(), example_inputs=(x,), example_target=target, loss_fn=LOSSES[loss],
                         optimizer=_opt, stages=stages, schedule=schedule, num_microbatches=MICRO,
                         frontend=frontend, **kw)


# --- the pass -------------------------------------------------------------------------------------

def test_the_embedding_and_the_tied_head_split_by_vocabulary_into_a_plain_cross_entropy(tmp_path: Path) -> None:
    pipe = _compiled("gpt", 1, "1f1b", "seq", 2)
    tp = pipe.state.tensor_parallel.stages[0]
    assert (tp.embeddings, tp.head) == (("wte",), "lm_head")  # one weight: both split alike
    assert any(w.startswith("wpe: position embeddings stay whole") for w in tp.whole), tp.whole
    dump = pipe.records[[r.name for r in pipe.records].index("tensor-parallel")].dump
    assert "vocab  lm_head (LM head: split by vocabulary into a loss-parallel cross-entropy)" in dump
    plan = json.loads((pipe.emit(tmp_path / "prog") / "plan.json").read_text())
    entry = plan["tensor_parallel"]["stages"][0]
    assert entry["embeddings"] == ["wte"] and entry["head"] == "lm_head"
    # an exported Llama's aten.embedding and aten.linear become modules under the model's names
    llama = _compiled("llama", 2, "1f1b", "flat", 2)
    first, last = llama.state.tensor_parallel.stages
    assert (first.embeddings, first.head, last.embeddings, last.head) == (("model_embed_tokens",), None, (), "lm_head")
    assert llama.split.stages[0].param_names["model_embed_tokens.weight"] == "model.embed_tokens.weight"
    assert llama.split.stages[1].param_names["lm_head.weight"] == "lm_head.weight"


def test_any_other_loss_keeps_the_head_whole_and_the_plan_says_why() -> None:
    llama = _compiled("llama", 1, "flush", "smooth", 2).state.tensor_parallel.stages[0]
    assert llama.embeddings == ("model_embed_tokens",) and llama.head is None  # the embedding still splits
    assert any(w.startswith("lm_head: the LM head stays whole: the loss") and "label smoothing" in w
               for w in llama.whole), llama.whole
    # the GPT's head shares its weight with wte: both stay whole
    pipe = api.pdcompile(_gpt(), example_inputs=(_data()[0][0][0],), example_target=_data()[0][1],
                         loss_fn=_smoothed, stages=1, num_microbatches=MICRO, tensor_parallel=2)
    tp = pipe.state.tensor_parallel.stages[0]
    assert (tp.embeddings, tp.head) == ((), None)
    whole = "\n".join(tp.whole)
    assert "lm_head: the LM head stays whole" in whole and "wte: its weight is tied to lm_head.weight" in whole
    # without a target the loss is not known when the stages are split: the head stays whole
    bare = api.pdcompile(_llama(), example_inputs=(_data()[0][0][0],), loss_fn=_flat_ce, stages=1,
                         num_microbatches=MICRO, tensor_parallel=2, frontend="export")
    assert any("no example_target" in w for w in bare.state.tensor_parallel.stages[0].whole)


# --- training ------------------------------------------------------------------------------------

def _reference(kind: str, stages: int, schedule: str, loss: str, data: list[Any]) -> dict[str, torch.Tensor]:
    """The same model trained in one process with what ``schedule`` computes (reference.py), from the stages
    of an untouched (t = 1) compile: final weights under the model's names."""
    pipe = _compiled(kind, stages, schedule, loss, None)
    mods = [copy.deepcopy(s.gm) for s in pipe.split.stages]
    micro = [((x.chunk(MICRO)[j],), y.chunk(MICRO)[j]) for (x,), y in data for j in range(MICRO)]
    fwd, bwd, group = reference.pipedream_1f1b([1] * stages) if schedule == "1f1b" else reference.synchronous(MICRO)
    reference.train_versioned(mods, [_opt(m.parameters()) for m in mods], LOSSES[loss], micro, fwd=fwd, bwd=bwd,
                              group=group, scale=1.0 if schedule == "1f1b" else 1 / MICRO,
                              tied=[list(g) for g in pipe.split.tied])
    return {st.param_names[n]: p.detach() for st, m in zip(pipe.split.stages, mods) for n, p in m.named_parameters()}


# (model, stages, schedule, loss, what is split by vocabulary: {stage: parameter names})
CASES = [("llama", 1, "flush", "flat", {0: ["lm_head.weight", "model_embed_tokens.weight"]}),
         ("llama", 2, "1f1b", "seq", {0: ["model_embed_tokens.weight"], 1: ["lm_head.weight"]}),
         ("gpt", 1, "1f1b", "seq", {0: ["wte.weight"]}),  # lm_head holds the same parameter
         ("gpt", 2, "flush", "flat", {0: ["wte.weight"], 1: ["lm_head.weight"]}),
         ("llama", 1, "flush", "smooth", {0: ["model_embed_tokens.weight"]})]


@pytest.mark.multiproc
@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind,stages,schedule,loss,vocab", CASES, ids=[f"{k}-{s}x2-{c}-{l}" for k, s, c, l, _ in CASES])
def test_vocabulary_parallel_trains_like_one_process(tmp_path: Path, kind: str, stages: int, schedule: str, loss: str,
                                                     vocab: dict[int, list[str]]) -> None:
    data = _data()
    save_batches(data, STEPS, tmp_path / "data.pt")
    pipe = _compiled(kind, stages, schedule, loss, 2)
    prog = pipe.emit(tmp_path / "prog", data={"factory": "pdcompile.runtime.data:from_file",
                                              "kwargs": {"path": str(tmp_path / "data.pt")}})
    rc, log = run_ranks(prog, 2 * stages, ["--steps", str(STEPS), "--save-final", str(tmp_path / "final"),
                                           "--metrics", str(tmp_path / "m"), "--timeout", "90"], timeout=400)
    assert rc == 0, log[-3000:]
    for k in range(stages):  # each split weight held as V / t rows by the process (tensor index 0)
        shards = json.loads((tmp_path / "m" / f"rank_{k}.json").read_text())["tensor_parallel_shards"][str(k)]
        for name in vocab[k]:
            assert shards[name] == [V // 2, CFG.d_model], (k, name, shards)
        heads = [n for n in ("lm_head.weight",) if k == stages - 1 and n not in vocab[k]]
        assert not set(heads) & set(shards)  # a head left whole is whole on the process
    got = merge_weights(prog, tmp_path / "final")
    want = _reference(kind, stages, schedule, loss, data)
    initial = {k: v.detach() for k, v in MODELS[kind][0]().named_parameters()}
    assert set(want) <= set(got)
    for k, w in want.items():
        torch.testing.assert_close(got[k], w, rtol=0, atol=1e-5, msg=lambda m: f"{k}: {m}")
    assert sum(not torch.equal(want[k], initial[k]) for k in want) > len(want) // 2  # it trained
    losses = json.loads((tmp_path / "m" / f"rank_{stages - 1}.json").read_text())["losses"]
    assert len(losses) == STEPS * MICRO and all(0 < v < 10 for v in losses)  # plain numbers, not DTensors


def test_the_planner_charges_the_vocabulary_split_where_the_pass_makes_it() -> None:
    """``chain_shares`` (what the planner charges, passes/planner/tensor.py) counts the token embedding and the
    head as split under a plain cross-entropy; under another loss the head, and the embedding tied to it, whole."""
    (x,), y = _data()[0]

    def shares(loss: Any) -> dict[str, tuple[float, float, int]]:
        pipe = api.pdcompile(_gpt(), example_inputs=(x,), example_target=y, loss_fn=loss, num_microbatches=MICRO,
                             tensor_parallel=2)
        return {l.name: (l.tp_share, l.tp_param_share, l.tp_allreduces) for l in pipe.state.chain.layers
                if {"wte", "lm_head"} & set(l.members or (l.name,))}

    plain, smooth = shares(SequenceCrossEntropy()), shares(_smoothed)
    assert set(plain) == set(smooth) == {"wte", "lm_head"}
    assert plain == {"wte": (1.0, 1.0, 1), "lm_head": (1.0, 0.0, 1)}  # the tied weight's bytes are wte's
    assert smooth == {"wte": (0.0, 0.0, 0), "lm_head": (0.0, 0.0, 0)}
