"""Hugging Face ``transformers`` models (built from configs, random init) through the export front end.

Split into 2 stages they compute what the unsplit model computes, outputs and gradients; trained 3
steps through torchrun on 2 CPU processes they end with the weights single-process training gives.
"""

from __future__ import annotations

import json

import copy
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.fx as fx

from pdcompile import api
from pdcompile.errors import UnsupportedModelError, UsageError
from _emitted import train_saved
from pdcompile.passes import codegen
from pdcompile.passes.export_frontend import export_trace
from pdcompile.passes.propagate_shapes import propagate_shapes
from pdcompile.passes.split_stages import StageSplit, even_assignment, split_stages
from pdcompile.passes.trace import trace_any
from pdcompile.reference import train_sync
from pdcompile.zoo.losses import SequenceCrossEntropy

transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.timeout(180)]

VOCAB, SEQ, BATCH, MICRO, STEPS, LR = 100, 8, 4, 2, 3, 0.05


def gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=16,
                                  use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  bos_token_id=0, eos_token_id=0, attn_implementation="eager")
    return transformers.GPT2LMHeadModel(cfg)


def _bert_config(**kw: Any) -> Any:
    return transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                   intermediate_size=64, max_position_embeddings=16, hidden_dropout_prob=0.0,
                                   attention_probs_dropout_prob=0.0, pad_token_id=0, **kw)


def bert() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.BertModel(_bert_config())


def bert_cls() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(_bert_config(num_labels=3))


# More models as a user pastes them: tiny sizes, the rest of each config its default (the dropouts of T5 off, as
# this test runs in training mode and compares values).
def _causal_lm(config: Any) -> Callable[[], torch.nn.Module]:
    def make() -> torch.nn.Module:
        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(config)
    return make


_SIZES = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=32)
qwen2 = _causal_lm(transformers.Qwen2Config(**_SIZES))  # GQA, biased q/k/v
falcon = _causal_lm(transformers.FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                              num_attention_heads=4))  # parallel attention: an in-place add_
bloom = _causal_lm(transformers.BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4))  # ALiBi
mixtral = _causal_lm(transformers.MixtralConfig(**_SIZES, num_local_experts=4,
                                                num_experts_per_tok=2))  # MoE: routing by integer expert ids

gemma = _causal_lm(transformers.GemmaConfig(**_SIZES, head_dim=8))  # embeddings scaled by sqrt(hidden)
phi3 = _causal_lm(transformers.Phi3Config(**_SIZES, pad_token_id=0))  # fused qkv and gate_up projections
gpt_neox = _causal_lm(transformers.GPTNeoXConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                                 num_hidden_layers=2, num_attention_heads=4,
                                                 max_position_embeddings=32))  # partial rotary
opt = _causal_lm(transformers.OPTConfig(vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                                        num_attention_heads=4, max_position_embeddings=32, word_embed_proj_dim=32,
                                        dropout=0.0))  # learned positions from the mask's cumsum


def roberta() -> torch.nn.Module:
    """Position ids from the tokens themselves (padding_idx + cumsum of non-padding)."""
    torch.manual_seed(0)
    return transformers.AutoModelForSequenceClassification.from_config(transformers.RobertaConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=32, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def bart() -> torch.nn.Module:
    """An encoder-decoder given its input ids only: the decoder's inputs are them shifted right."""
    torch.manual_seed(0)
    return transformers.BartForConditionalGeneration(transformers.BartConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32,
        dropout=0.0, use_cache=False))


def swin() -> torch.nn.Module:
    """Shifted windows: rolls, window partitions and a relative position bias table."""
    torch.manual_seed(0)
    return transformers.SwinForImageClassification(transformers.SwinConfig(
        image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4, num_labels=3,
        drop_path_rate=0.0))


def t5() -> torch.nn.Module:
    """An encoder-decoder: three inputs (ids, attention mask, decoder ids); without its KV cache, as captured."""
    torch.manual_seed(0)
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, dropout_rate=0.0, use_cache=False))


def resnet() -> torch.nn.Module:
    """transformers' ResNet: BatchNorm and in-place ReLUs (``aten.relu_``)."""
    torch.manual_seed(0)
    return transformers.ResNetForImageClassification(transformers.ResNetConfig(
        embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3))


def tokens(seed: int, batch: int = MICRO) -> torch.Tensor:
    return torch.randint(1, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(seed))


def eager_output(model: torch.nn.Module, *x: torch.Tensor) -> torch.Tensor:
    out = model(*x)
    return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state


class SelectedOutput(torch.nn.Module):
    """The model as the pipeline sees it: the logits (or last_hidden_state) of its ModelOutput."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return eager_output(self.model, x)


def split_in_two(model: torch.nn.Module, *x: torch.Tensor) -> tuple[fx.GraphModule, StageSplit]:
    gm = export_trace(model, x)
    propagate_shapes(gm, x)
    return gm, split_stages(gm, even_assignment(gm, 2), model)


def _inputs(factory: Callable[[], torch.nn.Module], seed: int) -> tuple[torch.Tensor, ...]:
    if factory is t5:
        return tokens(seed), torch.ones(MICRO, SEQ, dtype=torch.long), tokens(seed + 50)
    if factory in (resnet, swin):
        return (torch.randn(MICRO, 3, 32, 32, generator=torch.Generator().manual_seed(seed)),)
    return (tokens(seed),)


# -- the front end's IR -----------------------------------------------------------------------------

def test_fx_fails_and_auto_falls_back_to_export() -> None:
    model, x = gpt2(), tokens(0)
    with pytest.raises(UnsupportedModelError, match="co_varnames is too small"):
        trace_any(model, (x,), frontend="fx")
    gm = trace_any(model, (x,))  # "auto"
    assert any(isinstance(n.target, torch._ops.OpOverload) for n in gm.graph.nodes)
    torch.testing.assert_close(gm(x), eager_output(model, x), rtol=0, atol=0)
    with pytest.raises(UsageError, match="frontend must be one of"):
        trace_any(model, (x,), frontend="dynamo")


@pytest.mark.parametrize("factory", [gpt2, bert], ids=["gpt2", "bert"])
def test_export_gives_a_flat_graph_on_the_models_own_parameters(factory: Callable[[], torch.nn.Module]) -> None:
    model, x = factory(), tokens(0)
    gm = export_trace(model, (x,))
    ops = {n.op for n in gm.graph.nodes}
    assert ops <= {"placeholder", "get_attr", "call_function", "output"}
    assert [n.target for n in gm.graph.nodes if n.op == "placeholder"] == ["input_ids"]
    assert "tree_flatten_spec" not in gm.code and "tree_unflatten" not in gm.code and "_guards" not in gm.code
    own = dict(model.named_parameters(remove_duplicate=False))
    own.update(dict(model.named_buffers(remove_duplicate=False)))
    targets = [n.target for n in gm.graph.nodes if n.op == "get_attr"]
    assert targets
    for t in targets:  # the original qualified name, holding the model's own tensor object
        obj: Any = gm
        for part in t.split("."):
            obj = getattr(obj, part)
        assert obj is own[t], t
    out = gm.graph.output_node().args[0]
    assert isinstance(out, fx.Node)
    torch.testing.assert_close(gm(x), eager_output(model, x), rtol=0, atol=0)
    clone = copy.deepcopy(gm)  # meta holds no fake tensors
    torch.testing.assert_close(clone(x), gm(x), rtol=0, atol=0)


def test_output_selection_and_errors() -> None:
    model, x = bert(), tokens(0)
    pooled = export_trace(model, (x,), output="pooler_output")
    torch.testing.assert_close(pooled(x), model(x).pooler_output, rtol=0, atol=0)
    with pytest.raises(UsageError, match="has keys"):
        export_trace(model, (x,), output="nope")

    class TwoOutputs(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return self.fc(x), x * 2

    with pytest.raises(UnsupportedModelError, match="output=KEY or output=INDEX"):
        export_trace(TwoOutputs(), (torch.randn(2, 4),))
    second = export_trace(TwoOutputs(), (torch.randn(2, 4),), output=1)
    torch.testing.assert_close(second(torch.ones(2, 4)), torch.full((2, 4), 2.0))


def test_buffer_updates_stay_in_place_on_the_models_buffers() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))  # running stats in training
    twin = copy.deepcopy(model)
    x = torch.randn(3, 4)
    gm = export_trace(model, (x,))
    propagate_shapes(gm, (x,))  # runs once (no_grad): updates the statistics like an eager call
    twin(x)
    split = split_stages(gm, even_assignment(gm, 2), model)
    torch.testing.assert_close(split.run(x), twin(x), rtol=0, atol=0)
    for (name, got), want in zip(model.named_buffers(), twin.buffers()):
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=name)
    assert int(model[1].num_batches_tracked) == 2


def test_tensor_constants_become_buffers_and_emit() -> None:
    class Scaled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2 = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc2(torch.relu(self.fc1(x))) * torch.tensor([1.0, 2.0, 3.0])

    model, x = Scaled(), torch.randn(2, 3)
    gm = export_trace(model, (x,))
    assert [n for n, _ in gm.named_buffers()] == ["_pd_constant_0"]
    propagate_shapes(gm, (x,))
    split = split_stages(gm, even_assignment(gm, 2), model)
    torch.testing.assert_close(split.run(x), model(x), rtol=0, atol=0)
    assert "register_buffer('_pd_constant_0'" in codegen.stage_source(split, 1, "Scaled")


# -- split: transparency -----------------------------------------------------------------------------

EQUAL = {"gpt2": gpt2, "bert": bert, "bert_cls": bert_cls, "qwen2": qwen2, "falcon": falcon, "bloom": bloom,
         "mixtral": mixtral, "gemma": gemma, "phi3": phi3, "gpt_neox": gpt_neox, "opt": opt, "roberta": roberta,
         "t5": t5, "bart": bart, "resnet": resnet, "swin": swin}


@pytest.mark.parametrize("name", list(EQUAL))
def test_two_stages_equal_the_unsplit_model(name: str) -> None:
    """On other inputs than the example it was captured on (a capture specialised to its example's values,
    a MoE's routing say, would differ)."""
    factory = EQUAL[name]
    ref, model = factory(), factory()
    _, split = split_in_two(model, *_inputs(factory, 1))
    x = _inputs(factory, 7)
    assert len(split.stages) == 2 and all(list(st.gm.parameters()) for st in split.stages)
    if factory is gpt2:  # the tied embedding / LM head lives in both stages
        assert split.tied and {s for s, _ in split.tied[0]} == {0, 1}
        assert set(split.stages[0].param_names.values()) & set(split.stages[1].param_names.values()) == \
            {"transformer.wte.weight"}
    want, got = eager_output(ref, *x), split.run(*x)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    w = torch.randn(want.shape, generator=torch.Generator().manual_seed(2))
    (want * w).sum().backward()
    (got * w).sum().backward()
    grads = dict(model.named_parameters())
    checked = 0
    for pname, p in ref.named_parameters():
        q = grads[pname]
        if p.grad is None:  # e.g. BertModel's pooler: not part of last_hidden_state
            assert q.grad is None, pname
            continue
        # rounding only: SDPA's backward in the captured graph and in eager need not sum in one order
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-6, atol=max(1e-7, 1e-6 * float(p.grad.abs().max())),
                                   msg=pname)
        checked += 1
    assert checked >= len(grads) - 2
    for k in range(2):  # the stages can be written out as Python modules
        src = codegen.stage_source(split, k, type(model).__name__)
        compile(src, f"stage_{k}.py", "exec")


# -- torchrun: 3 training steps on 2 processes equal single-process training ------------------------------

def _opt(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def _batches(name: str) -> list[tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
    out = []
    for i in range(STEPS):
        g = torch.Generator().manual_seed(100 + i)
        x = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
        target = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) if name == "gpt2" else \
            torch.randint(0, 3, (BATCH,), generator=g)
        out.append(((x,), target))
    return out


def _compile(model: torch.nn.Module, data: list[Any], loss_fn: torch.nn.Module,
             monkeypatch: pytest.MonkeyPatch) -> api.CompiledPipeline:
    (x,), target = data[0]
    kw: dict[str, Any] = dict(example_inputs=(x,), example_target=target, loss_fn=loss_fn, optimizer=_opt,
                              stages=2, schedule="flush", num_microbatches=MICRO)
    if "frontend" in {f.name for f in dataclasses.fields(api.Options)}:
        kw["frontend"] = "export"
    else:  # api.py without frontend=: trace through export at the microbatch size the pipeline runs
        monkeypatch.setattr(api, "trace", lambda m, leaf_modules=(): export_trace(m, (x[: BATCH // MICRO],)))
    return api.pdcompile(model, **kw)


@pytest.mark.multiproc
@pytest.mark.parametrize("name", ["gpt2", "bert_cls"])
def test_torchrun_training_equals_single_process(tmp_path: Path, name: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    factory = {"gpt2": gpt2, "bert_cls": bert_cls}[name]
    loss_fn = SequenceCrossEntropy() if name == "gpt2" else torch.nn.CrossEntropyLoss()
    data = _batches(name)
    pipe = _compile(factory(), data, loss_fn, monkeypatch)
    assert len(pipe.split.stages) == 2
    if name == "gpt2":  # the tied embedding / LM head is trained in both stages and kept equal
        assert pipe.split.tied and {s for s, _ in pipe.split.tied[0]} == {0, 1}
    # each stage's last backward of a step split (B then W), as flush splits it where every rank has a core: an
    # exported stage reads every parameter itself, so its W would walk its whole graph again and the executor
    # runs that backward whole instead (WeightPass.walks_whole_graph; test_fused_grads counts an fx model's splits
    # with the same flag); the training must not change
    prog, got = train_saved(pipe, data, STEPS, tmp_path, extra=("--split-backward", "--metrics", str(tmp_path / "m")))
    ranks = [json.loads(p.read_text()) for p in sorted((tmp_path / "m").glob("rank_*.json"))]
    assert len(ranks) == 2 and all(r["split_backwards"] == {"graph": 0, "submodules": 0} for r in ranks)

    ref = factory()
    initial = {k: v.detach().clone() for k, v in ref.named_parameters()}
    train_sync(SelectedOutput(ref), loss_fn, _opt(ref.parameters()), data, steps=STEPS, num_microbatches=MICRO)
    want = {k: v.detach() for k, v in ref.named_parameters()}
    want.update({k: v.detach() for k, v in ref.named_buffers()})
    assert set(got) == set(want)  # every parameter and buffer comes back, a tied one once
    moved = 0
    for k, v in got.items():
        torch.testing.assert_close(v, want[k], rtol=1e-5, atol=1e-6, msg=f"{name}: {k}")
        moved += int(k in initial and not torch.equal(v, initial[k]))
    assert moved > len(initial) // 2  # training really changed the weights


def test_a_causal_lm_as_it_comes_is_captured_without_its_kv_cache() -> None:
    """GPT-2 with its default config (use_cache=True): captured, its config left as it was."""
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=VOCAB,
                                                                 n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
                                                                 attn_pdrop=0.0))
    before = model.config.to_dict()
    assert before["use_cache"] is True
    x = tokens(3)
    gm = export_trace(model, (x,))
    assert model.config.to_dict() == before
    with torch.no_grad():
        out = model(x)
        assert out.past_key_values is not None  # the user's model still caches, as configured
        torch.testing.assert_close(gm(x), out.logits, rtol=0, atol=0)
    with pytest.raises(UnsupportedModelError):  # a failed capture restores the config too
        export_trace(model, (x.float(),))
    assert model.config.to_dict() == before


def test_a_tensor_given_positionally_to_the_wrong_parameter_is_named() -> None:
    """GPT-2's second parameter is its cache, not the attention mask: the error says where the inputs went."""
    x = tokens(3)
    with pytest.raises(UnsupportedModelError, match=r"passed positionally, as GPT2LMHeadModel\.forward\(input_ids, "
                                                    r"\w+\).*by name in example_kwargs="):
        export_trace(gpt2(), (x, torch.ones_like(x)))
