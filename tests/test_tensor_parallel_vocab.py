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
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from _hf_llama import token_batches
from _tp_common import BATCH, CFG, MICRO, MODELS, STEPS, assert_trained_like, compile_model, gpt_model, opt, \
    reference_weights, train
from pdcompile import api
from pdcompile.merge import merge_weights
from pdcompile.runtime.data import from_file, save_batches
from pdcompile.zoo.losses import SequenceCrossEntropy

V = CFG.vocab_size

pytestmark = pytest.mark.xdist_group("tensor_parallel")  # one worker: the compiles below are made once


def _flat_ce(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # as a user writes it
    return F.cross_entropy(out.reshape(-1, V), y.reshape(-1), ignore_index=-100)


def _smoothed(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # no plain cross-entropy: the head stays whole
    return F.cross_entropy(out.reshape(-1, V), y.reshape(-1), label_smoothing=0.1)


LOSSES = {"seq": SequenceCrossEntropy(), "flat": _flat_ce, "smooth": _smoothed}


def _data(vocab: int = V) -> list[Any]:
    """Token batches whose targets ignore some positions (-100, as Hugging Face pads labels)."""
    data = token_batches(vocab, STEPS, BATCH, CFG.seq_len)
    for (_, y) in data:
        y[0, :3] = -100
        y[2, 5:] = -100
    return data


@functools.lru_cache(maxsize=None)
def _compiled(kind: str, stages: int, schedule: str, loss: str, t: int | None, **kw: Any) -> Any:
    if t is not None:
        kw["tensor_parallel"] = t
    return compile_model(kind, stages, schedule, LOSSES[loss], _data(), **kw)


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
    pipe = api.pdcompile(gpt_model(), example_inputs=(_data()[0][0][0],), example_target=_data()[0][1],
                         loss_fn=_smoothed, stages=1, num_microbatches=MICRO, tensor_parallel=2)
    tp = pipe.state.tensor_parallel.stages[0]
    assert (tp.embeddings, tp.head) == ((), None)
    whole = "\n".join(tp.whole)
    assert "lm_head: the LM head stays whole" in whole and "wte: its weight is tied to lm_head.weight" in whole
    # without a target the loss is not known when the stages are split: the head stays whole
    bare = api.pdcompile(MODELS["llama"][0](), example_inputs=(_data()[0][0][0],), loss_fn=_flat_ce, stages=1,
                         num_microbatches=MICRO, tensor_parallel=2, frontend="export")
    assert any("no example_target" in w for w in bare.state.tensor_parallel.stages[0].whole)


# --- training ------------------------------------------------------------------------------------

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
    prog = train(_compiled(kind, stages, schedule, loss, 2), tmp_path, data, 2 * stages)
    for k in range(stages):  # each split weight held as V / t rows by the process (tensor index 0)
        shards = json.loads((tmp_path / "m" / f"rank_{k}.json").read_text())["tensor_parallel_shards"][str(k)]
        for name in vocab[k]:
            assert shards[name] == [V // 2, CFG.d_model], (k, name, shards)
        heads = [n for n in ("lm_head.weight",) if k == stages - 1 and n not in vocab[k]]
        assert not set(heads) & set(shards)  # a head left whole is whole on the process
    got = merge_weights(prog, tmp_path / "final")
    want, _ = reference_weights(_compiled(kind, stages, schedule, loss, None), schedule, LOSSES[loss], data)
    assert_trained_like(got, want, kind)
    losses = json.loads((tmp_path / "m" / f"rank_{stages - 1}.json").read_text())["losses"]
    assert len(losses) == STEPS * MICRO and all(0 < v < 10 for v in losses)  # plain numbers, not DTensors


# --- with bf16, recomputation, validation, and a vocabulary t does not divide ----------------------

def _val(vocab: int) -> list[Any]:
    """Validation minibatches, drawn apart from the training ones."""
    g = torch.Generator().manual_seed(7)
    return [((torch.randint(1, vocab, (BATCH, CFG.seq_len), generator=g),),
             torch.randint(0, vocab, (BATCH, CFG.seq_len), generator=g)) for _ in range(2)]


def _reference_bf16(pipe: Any, loss_fn: Any, data: list[Any]) -> tuple[dict[str, torch.Tensor], list[torch.nn.Module]]:
    """One stage trained in one process as ``precision="bf16"`` trains it (a synchronous schedule): the forward
    and the loss under bf16 autocast, fp32 master weights and gradients."""
    (st,) = pipe.split.stages
    mod = copy.deepcopy(st.gm)
    o = opt(mod.parameters())
    for (x,), y in data:
        o.zero_grad(set_to_none=True)
        for xs, ys in zip(x.chunk(MICRO), y.chunk(MICRO)):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = loss_fn(mod(xs), ys)
            (loss / MICRO).backward()
        o.step()
    return {st.param_names[n]: p.detach() for n, p in mod.named_parameters()}, [mod]


def _validate(mods: list[torch.nn.Module], loss_fn: Any, val: list[Any], bf16: bool) -> dict[str, float]:
    """What ``--eval-data`` reports for a one-stage model: the mean loss and accuracy over its microbatches."""
    (mod,) = mods
    losses, hits = [], []
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        for (x,), y in val:
            for xs, ys in zip(x.chunk(MICRO), y.chunk(MICRO)):
                out = mod(xs)
                losses.append(float(loss_fn(out, ys)))
                hits.append(float((out.argmax(-1) == ys).float().mean()))
    return {"loss": sum(losses) / len(losses), "accuracy": sum(hits) / len(hits)}


# (model, schedule, loss, precision, recompute, vocabulary); t = 2 on 2 processes, validated after the last step
FEATURES = [("gpt", "flush", "seq", "bf16", "none", V), ("gpt", "1f1b", "flat", "fp32", "full", V),
            ("llama", "flush", "flat", "fp32", "selective", V),
            ("gpt", "flush", "seq", "fp32", "none", V + 1)]  # 65: the embedding and the head stay whole


@pytest.mark.multiproc
@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind,schedule,loss,precision,recompute,vocab", FEATURES,
                         ids=[f"{k}-{c}-{p}-recompute_{r}-V{v}" for k, c, _, p, r, v in FEATURES])
def test_the_vocabulary_split_trains_under_bf16_recomputation_and_validation(
        tmp_path: Path, kind: str, schedule: str, loss: str, precision: str, recompute: str, vocab: int) -> None:
    """The split head's logits (a DTensor) through autocast, a checkpointed forward (whole, or selective, which
    caches the head's matmul) and the forward-only validation pass: the same as one process computes; and a
    vocabulary t does not divide leaves the embedding and the head whole (the plan says why) and trains exactly."""
    data, val = _data(vocab), _val(vocab)
    kw: dict[str, Any] = {"precision": precision, "recompute": recompute}
    if vocab == V:
        pipe, plain = _compiled(kind, 1, schedule, loss, 2, **kw), _compiled(kind, 1, schedule, loss, None, **kw)
    else:
        pipe, plain = (compile_model(kind, 1, schedule, LOSSES[loss], data, build_kw={"vocab": vocab}, **kw, **t)
                       for t in ({"tensor_parallel": 2}, {}))
        whole = "\n".join(pipe.state.tensor_parallel.stages[0].whole)
        assert f"wte: its vocabulary of {vocab} does not divide by t=2" in whole and "pad the vocabulary" in whole
    save_batches(val, len(val), tmp_path / "val.pt")
    (tmp_path / "val.pkl").write_bytes(pickle.dumps(functools.partial(from_file, path=str(tmp_path / "val.pt"))))
    prog = train(pipe, tmp_path, data, 2, ["--eval-data", str(tmp_path / "val.pkl"), "--eval-steps", str(len(val)),
                                          "--eval-metric", "accuracy"])
    plan = json.loads((prog / "plan.json").read_text())
    assert plan["precision"] == precision and plan["plan"]["stages"][0]["recompute"] == recompute
    shards = json.loads((tmp_path / "m" / "rank_0.json").read_text())["tensor_parallel_shards"]["0"]
    head = "lm_head.weight" if kind == "llama" else "wte.weight"
    assert (head in shards) == (vocab == V), shards  # split by vocabulary where t divides it, else whole
    assert len(shards) >= 8  # the linear pairs split either way
    got = merge_weights(prog, tmp_path / "final")
    bf16 = precision == "bf16"
    want, mods = (_reference_bf16(plain, LOSSES[loss], data) if bf16
                  else reference_weights(plain, schedule, LOSSES[loss], data))
    # bf16: the tolerance of tests/test_precision_clip.py's bf16 pipeline against single-process autocast
    assert_trained_like(got, want, kind, atol=1e-3 if bf16 else 1e-5, rtol=1.6e-2 if bf16 else 0.0,
                        **({"vocab": vocab} if vocab != V else {}))
    if bf16:  # it ran in bf16: fp32 training (which t = 2 matches within 1e-5) ends elsewhere
        fp32, _ = reference_weights(plain, schedule, LOSSES[loss], data)
        assert max(float((got[k] - w).abs().max()) for k, w in fp32.items()) > 1e-4
        assert json.loads((tmp_path / "m" / "rank_0.json").read_text())["precision"] == "bf16"
    (evaluated,) = json.loads((tmp_path / "m" / "rank_0.json").read_text())["eval"]
    expect = _validate(mods, LOSSES[loss], val, bf16)
    assert evaluated["step"] == STEPS
    assert evaluated["loss"] == pytest.approx(expect["loss"], rel=1e-2 if bf16 else 1e-5)
    assert evaluated["accuracy"] == pytest.approx(expect["accuracy"], abs=0.1 if bf16 else 1e-6)


def test_the_planner_charges_the_vocabulary_split_where_the_pass_makes_it() -> None:
    """``chain_shares`` (what the planner charges, passes/planner/tensor.py) counts the token embedding and the
    head as split under a plain cross-entropy; under another loss the head, and the embedding tied to it, whole."""
    (x,), y = _data()[0]

    def shares(loss: Any) -> dict[str, tuple[float, float, int]]:
        pipe = api.pdcompile(gpt_model(), example_inputs=(x,), example_target=y, loss_fn=loss, num_microbatches=MICRO,
                             tensor_parallel=2)
        return {l.name: (l.tp_share, l.tp_param_share, l.tp_allreduces) for l in pipe.state.chain.layers
                if {"wte", "lm_head"} & set(l.members or (l.name,))}

    plain, smooth = shares(SequenceCrossEntropy()), shares(_smoothed)
    assert set(plain) == set(smooth) == {"wte", "lm_head"}
    assert plain == {"wte": (1.0, 1.0, 1), "lm_head": (1.0, 0.0, 1)}  # the tied weight's bytes are wte's
    assert smooth == {"wte": (0.0, 0.0, 0), "lm_head": (0.0, 0.0, 0)}
