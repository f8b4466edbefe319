"""Compiling a model built on the meta device (#28 item 1) and its fresh initialisation on the ranks
(item 2): every pass works without data, emit writes no meta tensor, and each stage is initialised by
its owning modules' own initialisers, seeded per module name, so the plan does not change the weights."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from pdcompile import api
from pdcompile.errors import UsageError
from pdcompile.runtime.program import Program

pytestmark = pytest.mark.timeout(180)

VOCAB, SEQ, BATCH, MICRO = 100, 8, 4, 2


def llama_config(**kw: Any) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                    num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
                                    use_cache=False, **kw)


def meta_llama(**kw: Any) -> torch.nn.Module:
    import transformers

    cfg = llama_config(**kw)
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(cfg)


def compile_meta(model: torch.nn.Module, stages: int, **kw: Any) -> api.CompiledPipeline:
    from pdcompile.zoo.losses import SequenceCrossEntropy

    with torch.device("meta"):  # no data: inputs and targets on meta too
        x = torch.randint(0, VOCAB, (BATCH, SEQ))
        t = torch.randint(0, VOCAB, (BATCH, SEQ))
    return api.pdcompile(model, example_inputs=(x,), example_target=t, loss_fn=SequenceCrossEntropy(),
                         stages=stages, num_microbatches=MICRO, **kw)


def initial_weights(prog: Program) -> dict[str, torch.Tensor]:
    """Every stage built as its rank builds it, under the original names."""
    out: dict[str, torch.Tensor] = {}
    for k in range(prog.num_stages):
        module = prog.build_stage(k)
        for n, t in list(module.named_parameters()) + list(module.named_buffers()):
            assert not t.is_meta, n
            out[prog.stages[k].param_names[n]] = t.detach()
    return out


def test_meta_llama_compiles_emits_no_meta_tensors_and_fresh_weights_do_not_depend_on_the_plan(tmp_path: Path) -> None:
    import transformers

    weights = {}
    for stages in (2, 3):
        pipe = compile_meta(meta_llama(), stages)
        assert len(pipe.split.stages) == stages
        out = pipe.emit(tmp_path / f"s{stages}")
        assert not list(out.glob("*.pt")), "a meta model has no values to write"
        prog = Program.load(out)
        assert prog.init["source"] == "fresh" and all(st.weights is None for st in prog.stages)
        assert "meta" not in "".join(p.read_text() for p in out.glob("stage_*.py"))  # the device follows the input
        weights[stages] = initial_weights(prog)
    assert weights[2].keys() == weights[3].keys()
    for name, t in weights[2].items():
        assert torch.equal(t, weights[3][name]), name
    # what the model's own initialisation gives: normal(0, initializer_range) linears and embedding, ones in
    # the norms, the rotary frequencies a real model computes
    real = transformers.LlamaForCausalLM(llama_config())
    want = dict(real.named_parameters())
    want.update(dict(real.named_buffers()))
    assert set(weights[2]) == {n for n, _ in real.named_parameters()} | {"model.rotary_emb.inv_freq"}
    std = real.config.initializer_range
    for name, t in weights[2].items():
        assert t.shape == want[name].shape and t.dtype == want[name].dtype, name
        if name.endswith("norm.weight"):
            assert torch.equal(t, torch.ones_like(t)), name
        elif name.endswith("inv_freq"):
            assert torch.equal(t, want[name]), name
        else:
            assert abs(float(t.std()) - std) < 0.25 * std and abs(float(t.mean())) < 0.25 * std, name
    first, second = weights[2]["model.layers.0.mlp.up_proj.weight"], weights[2]["model.layers.1.mlp.up_proj.weight"]
    assert not torch.equal(first, second)  # each module its own seed


def test_meta_mlp_with_meta_inputs_initialises_like_reset_parameters(tmp_path: Path) -> None:
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.LayerNorm(64), torch.nn.ReLU(),
                                    torch.nn.Linear(64, 4))
        x, t = torch.randn(BATCH, 8), torch.randint(0, 4, (BATCH,))
    pipe = api.pdcompile(model, example_inputs=(x,), example_target=t, loss_fn=torch.nn.CrossEntropyLoss(),
                         stages=2, num_microbatches=MICRO)
    prog = Program.load(pipe.emit(tmp_path / "mlp"))
    w = initial_weights(prog)
    assert set(w) == {"0.weight", "0.bias", "1.weight", "1.bias", "3.weight", "3.bias"}
    for name, fan_in in (("0", 8), ("3", 64)):  # Linear.reset_parameters: uniform within 1/sqrt(fan_in)
        bound = 1 / math.sqrt(fan_in)
        for part in ("weight", "bias"):
            v = w[f"{name}.{part}"]
            assert float(v.abs().max()) <= bound and float(v.abs().max()) > bound / 2 and v.unique().numel() > 3
    assert torch.equal(w["1.weight"], torch.ones(64)) and torch.equal(w["1.bias"], torch.zeros(64))
    assert torch.equal(initial_weights(prog)["0.weight"], w["0.weight"])  # seeded: every build the same
    reseeded = next(iter(prog.build_stage(0, seed=1).parameters()))
    assert not torch.equal(reseeded, next(iter(prog.build_stage(0).parameters())))  # another seed, other weights


class NoInitialiser(torch.nn.Module):
    """A module owning a parameter it never initialises (no reset_parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.empty(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def test_meta_errors_name_cause_and_fix(tmp_path: Path) -> None:
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), NoInitialiser())
    x, t = torch.randn(BATCH, 4), torch.randn(BATCH, 4)
    with pytest.raises(UsageError, match=r'cost_mode="analytic".*--profile'):
        api.pdcompile(model, example_inputs=(x,), example_target=t, loss_fn=torch.nn.MSELoss(), stages=2,
                      cost_mode="measured")
    pipe = api.pdcompile(model, example_inputs=(x,), example_target=t, loss_fn=torch.nn.MSELoss(), stages=2)
    with pytest.raises(UsageError, match=r"'1\.scale' is on the meta device.*NoInitialiser.*reset_parameters.*"
                                         r"init_from"):
        pipe.emit(tmp_path / "bad")
    assert not (tmp_path / "bad").exists()
