"""Any loss callable trains a pipeline: functions, lambdas, closures, ``functools.partial``, nn.Modules.

The loss is traced into the last stage's emitted source (trace-loss). Each kind is trained 2 stages,
PipeDream-Flush, 3 steps through torchrun and compared with a plain single-process PyTorch loop
(same model, loss, data, optimizer): weights and every microbatch's loss within 1e-5 relative.
A Hugging Face GPT-2 is trained with a lambda reading ``out.logits`` of its ``ModelOutput``.
Untraceable losses are refused with a UsageError naming the cause.

Losses that look at their output run as in eager Python (``hasattr``, ``getattr``, ``isinstance``, keys
of a dict, positions of a tuple, fields of a ``ModelOutput``): a plain-tensor MLP, a model returning a
dict holding a tuple, and a Hugging Face Llama built with its default config (``use_cache=True``) each
train through the pipeline as single-process PyTorch does.
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from pdcompile.api import CompiledPipeline, pdcompile
from pdcompile.errors import UsageError
from _ranks import run_ranks
from pdcompile.merge import merge_weights
from pdcompile.runtime.data import save_batches
from pdcompile.runtime.program import Program

pytestmark = [pytest.mark.timeout(240)]

STEPS, MICRO, BATCH, LR = 3, 2, 8, 0.05
Batches = list[tuple[tuple[torch.Tensor, ...], torch.Tensor]]


def _opt(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(),
                               torch.nn.Linear(32, 10))


def mlp_batches() -> Batches:
    g = torch.Generator().manual_seed(7)
    return [((torch.randn(BATCH, 16, generator=g),), torch.randint(0, 10, (BATCH,), generator=g))
            for _ in range(STEPS)]


def gpt2() -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=16, use_cache=False,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                                  attn_implementation="eager")
    return transformers.GPT2LMHeadModel(cfg)


def gpt2_batches() -> Batches:
    g = torch.Generator().manual_seed(11)
    return [((torch.randint(1, 100, (4, 8), generator=g),), torch.randint(0, 100, (4, 8), generator=g))
            for _ in range(STEPS)]


# -- the losses: one of each kind a PyTorch user writes ----------------------------------------------

def scaled_weighted_ce(scale: float, class_weight: torch.Tensor) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """A closure over a float and a tensor (class weights)."""
    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return scale * F.cross_entropy(out, target, weight=class_weight)
    return loss


class TemperedCE(torch.nn.Module):
    """A user nn.Module loss with a constructor argument (defined in a test, rebuilt by nobody: traced)."""

    def __init__(self, temperature: float) -> None:
        super().__init__()
        self.temperature = temperature

    def forward(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out / self.temperature, target) + 0.01 * out.pow(2).mean()


CLASS_WEIGHT = torch.linspace(0.5, 1.5, 10)


def logits_loss(out: Any, target: torch.Tensor) -> torch.Tensor:  # the lambda's body, for the reference
    return F.cross_entropy(out.logits.flatten(0, 1), target.flatten())


# -- the independent reference --------------------------------------------------------------------------

def single_process(model: torch.nn.Module, loss_fn: Callable[..., torch.Tensor], data: Batches) -> list[float]:
    """Plain PyTorch: per minibatch, the mean over MICRO microbatches of the loss, one optimizer step."""
    opt = _opt(model.parameters())
    model.train()
    losses = []
    for (x,), y in data:
        opt.zero_grad()
        for xs, ys in zip(x.chunk(MICRO), y.chunk(MICRO)):
            loss = loss_fn(model(xs), ys)  # the model's own output: a tensor, or a ModelOutput
            losses.append(float(loss.detach()))
            (loss / MICRO).backward()
        opt.step()
    return losses


def _compile(model: torch.nn.Module, data: Batches, loss_fn: Any, *, with_target: bool = True,
             **kw: Any) -> CompiledPipeline:
    (x,), y = data[0]
    return pdcompile(model, example_inputs=(x,), example_target=y if with_target else None, loss_fn=loss_fn,
                     optimizer=_opt, stages=2, schedule="flush", num_microbatches=MICRO, **kw)


def _launch(pipe: CompiledPipeline, data: Batches, tmp: Path) -> tuple[Path, dict[str, torch.Tensor], list[float]]:
    """Emit and train through torchrun; the program, the merged final weights and the losses."""
    save_batches(data, STEPS, tmp / "data.pt")
    prog = pipe.emit(tmp / "prog", data={"factory": "pdcompile.runtime.data:from_file",
                                         "kwargs": {"path": str(tmp / "data.pt")}})
    rc, log = run_ranks(prog, 2, ["--steps", str(STEPS), "--save-final", str(tmp / "final"),
                                  "--metrics", str(tmp / "metrics"), "--timeout", "60"], timeout=150)
    assert rc == 0, log[-3000:]
    ranks = [json.loads(p.read_text()) for p in (tmp / "metrics").glob("rank_*.json")]
    return prog, merge_weights(prog, tmp / "final"), max(ranks, key=lambda r: r["stage"])["losses"]


def _assert_equal_training(got: dict[str, torch.Tensor], losses: list[float], ref: torch.nn.Module,
                           ref_losses: list[float], initial: dict[str, torch.Tensor]) -> None:
    want = dict(ref.named_parameters())
    assert set(want) <= set(got)
    for k, w in want.items():
        torch.testing.assert_close(got[k], w.detach(), rtol=1e-5, atol=1e-6, msg=k)
    assert sum(not torch.equal(got[k], initial[k]) for k in want) == len(want)  # every weight trained
    assert len(losses) == len(ref_losses) == STEPS * MICRO
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)


def _last_stage_source(prog: Path) -> str:
    plan = json.loads((prog / "plan.json").read_text())
    loss = plan["loss"]
    assert loss["module"] == f"stage_{len(plan['stages']) - 1}.py" and loss["class"] == "Loss"
    return (prog / loss["module"]).read_text()


# -- through torchrun ----------------------------------------------------------------------------------

@pytest.mark.multiproc
def test_lambda_over_hf_logits_trains_like_single_process(tmp_path: Path) -> None:
    data = gpt2_batches()
    model = gpt2()
    ref = copy.deepcopy(model)
    initial = {k: v.detach().clone() for k, v in model.named_parameters()}
    pipe = _compile(model, data, lambda out, target: F.cross_entropy(out.logits.flatten(0, 1), target.flatten()),
                    frontend="export")
    prog, got, losses = _launch(pipe, data, tmp_path)
    src = _last_stage_source(prog)
    assert "class Loss(torch.nn.Module)" in src and "torch.ops.aten.nll_loss_forward.default(" in src
    assert "logits" not in src.split("class Loss")[1]  # out.logits is the tensor the last stage returns
    ref_losses = single_process(ref, logits_loss, data)  # the reference reads .logits of a real ModelOutput
    _assert_equal_training(got, losses, ref, ref_losses, initial)


@pytest.mark.multiproc
@pytest.mark.parametrize("kind", ["closure", "partial", "module"])
def test_plain_pytorch_losses_train_like_single_process(tmp_path: Path, kind: str, forked_run: None) -> None:
    loss_fn: Any = {"closure": scaled_weighted_ce(0.5, CLASS_WEIGHT),
                    "partial": functools.partial(F.cross_entropy, label_smoothing=0.1),
                    "module": TemperedCE(2.0)}[kind]
    data = mlp_batches()
    model = mlp()
    ref = copy.deepcopy(model)
    initial = {k: v.detach().clone() for k, v in model.named_parameters()}
    if kind == "closure":  # and item 4: run(data) reads the target's shape and dtype from the data
        pipe = _compile(model, data, loss_fn, with_target=False)
        result = pipe.run(data, steps=STEPS, out=tmp_path, timeout=150, extra_args=["--timeout", "60"])
        prog, got, losses = result.program, result.state_dict(), result.metrics["losses"]
        assert json.loads((prog / "plan.json").read_text())["target"] == \
            {"shape": [BATCH // MICRO], "dtype": "int64", "requires_grad": False}
    else:
        prog, got, losses = _launch(_compile(model, data, loss_fn), data, tmp_path)
    src = _last_stage_source(prog)
    if kind == "closure":  # the captured float is code, the captured tensor a buffer saved beside it
        assert "aten.mul.Tensor(getitem, 0.5)" in src and "nll_loss_forward.default(_log_softmax, target, " \
            "_tensor_constant0" in src
        saved = torch.load(prog / "loss.pt", weights_only=True)
        assert torch.equal(saved["_tensor_constant0"], CLASS_WEIGHT)
    elif kind == "partial":
        assert "aten.mul.Scalar(getitem, 0.9)" in src  # (1 - label_smoothing) of the plain loss
    else:
        assert "aten.div.Tensor(output, 2.0)" in src and "aten.pow.Tensor_Scalar(output, 2)" in src
    ref_losses = single_process(ref, loss_fn, data)
    _assert_equal_training(got, losses, ref, ref_losses, initial)


# -- in process: what the last stage runs, and what is refused --------------------------------------------

def test_the_built_loss_equals_the_callable_on_any_output(tmp_path: Path) -> None:
    data = mlp_batches()
    losses: list[Any] = [scaled_weighted_ce(0.5, CLASS_WEIGHT), functools.partial(F.cross_entropy, label_smoothing=0.1),
                         TemperedCE(2.0), torch.nn.CrossEntropyLoss(label_smoothing=0.2),
                         lambda out, t: F.nll_loss(F.log_softmax(out, -1), t)]
    out = torch.randn(BATCH // MICRO, 10, generator=torch.Generator().manual_seed(3))
    target = data[1][1][: BATCH // MICRO]
    for i, fn in enumerate(losses):
        prog = _compile(mlp(), data, fn).emit(tmp_path / str(i))
        built = Program.load(prog).build_loss()
        torch.testing.assert_close(built(out, target), fn(out, target), rtol=1e-6, atol=0)


def test_a_program_naming_its_loss_by_class_path_still_builds(tmp_path: Path) -> None:
    prog = _compile(mlp(), mlp_batches(), torch.nn.CrossEntropyLoss()).emit(tmp_path / "p")
    plan = json.loads((prog / "plan.json").read_text())
    plan["loss"] = {"class": "torch.nn.CrossEntropyLoss", "kwargs": {"label_smoothing": 0.1}}
    (prog / "plan.json").write_text(json.dumps(plan))
    built = Program.load(prog).build_loss()
    assert isinstance(built, torch.nn.CrossEntropyLoss) and built.label_smoothing == 0.1


class ClippedCE(torch.nn.Module):
    """An nn.Module loss tracing can't capture (a Python ``if`` on the loss value); importable, rebuildable."""

    def forward(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(out, target)
        if loss > 10:
            return loss.clamp(max=10.0)
        return loss


def test_an_untraceable_module_loss_is_named_by_class_path_as_before(tmp_path: Path) -> None:
    data = mlp_batches()
    prog = _compile(mlp(), data, ClippedCE()).emit(tmp_path / "p")
    entry = json.loads((prog / "plan.json").read_text())["loss"]
    assert entry["class"].endswith("ClippedCE") and entry["traced"] is None and "control flow" in entry["why"]
    assert "class Loss" not in _last_stage_source_any(prog)
    built = Program.load(prog).build_loss()
    out, target = torch.randn(4, 10), data[0][1][:4]
    assert isinstance(built, ClippedCE)
    torch.testing.assert_close(built(out, target), F.cross_entropy(out, target), rtol=0, atol=0)
    with pytest.raises(UsageError, match="can't be traced"):  # a function has no class to fall back on
        _compile(mlp(), data, lambda o, t: ClippedCE()(o, t))


def _last_stage_source_any(prog: Path) -> str:
    plan = json.loads((prog / "plan.json").read_text())
    return (prog / plan["stages"][-1]["module"]).read_text()


def _branches(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    loss = F.cross_entropy(out, target)
    if loss > 1:  # on data
        return loss * 2
    return loss


class ScaledCE(torch.nn.Module):
    """A loss with a parameter of its own that would train: refused, named as the user named it."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(()))

    def forward(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.scale * F.cross_entropy(out, target)


@pytest.mark.parametrize("fn,match", [
    (lambda out, t: F.cross_entropy(out, t) / out.abs().max().item(), r"host sync: `\.item\(\)`.*test_loss_fns\.py"),
    (_branches, r"control flow.*`if loss > 1:"),
    (lambda out, t: float(F.cross_entropy(out, t)), "can't be traced.*float"),
    (lambda out, t: F.cross_entropy(out, t, reduction="none"), "a pipeline needs a scalar"),
    ("cross_entropy", "loss_fn must be callable"),
    (ScaledCE(), r"trainable parameters \['scale'\]"),
], ids=["item", "branch-on-data", "float", "not-scalar", "not-callable", "trainable"])
def test_untraceable_losses_are_refused_with_the_cause(fn: Any, match: str) -> None:
    with pytest.raises(UsageError, match=match) as e:
        _compile(mlp(), mlp_batches(), fn)
    assert "Fix:" in str(e.value)


def test_a_loss_reading_an_output_the_pipeline_does_not_compute_is_refused() -> None:
    data = gpt2_batches()
    with pytest.raises(UsageError, match=r"reads output\.hidden_states.*'logits'"):
        _compile(gpt2(), data, lambda out, t: out.hidden_states[-1].mean(), frontend="export")


def test_shape_dependent_python_decides_on_the_examples_shapes() -> None:
    def generic(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if out.dim() == 3:  # fx can't branch on a traced shape; the loss run on the example sees its shape
            out = out.flatten(0, 1)
        return F.cross_entropy(out, target.flatten())

    data = gpt2_batches()
    pipe = _compile(gpt2(), data, lambda out, t: generic(out.logits, t), frontend="export")
    traced = pipe.loss()
    assert traced is not None and traced.frontend == "make_fx" and "nll_loss" in traced.gm.code
    out = torch.randn(2, 8, 100)
    torch.testing.assert_close(traced.gm(out, data[0][1][:2]), generic(out, data[0][1][:2]), rtol=1e-6, atol=0)


def test_the_target_is_needed_only_when_no_data_shows_it(tmp_path: Path) -> None:
    pipe = _compile(mlp(), mlp_batches(), torch.nn.CrossEntropyLoss(), with_target=False)
    with pytest.raises(UsageError, match="example_target=.*run\\(data\\) reads it from the data"):
        pipe.emit(tmp_path / "a")
    y = mlp_batches()[0][1]
    prog = pipe.emit(tmp_path / "b", target=y)  # emit(target=) is enough
    assert json.loads((prog / "plan.json").read_text())["target"]["shape"] == [BATCH // MICRO]
    # run(data) whose targets (class probabilities) disagree with the example_target= given (class ids)
    soft = [(x, F.one_hot(t, 10).float()) for x, t in mlp_batches()]
    pipe = _compile(mlp(), mlp_batches(), torch.nn.CrossEntropyLoss())
    with pytest.raises(UsageError, match=r"the data's targets are torch.float32 \(4, 10\).*example_target="):
        pipe.run(soft, steps=1, out=tmp_path / "c")


def test_a_loss_indexing_the_hf_output_by_key_sees_the_logits() -> None:
    def by_key(out: Any, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out["logits"].flatten(0, 1), target.flatten(), label_smoothing=0.05)

    data = gpt2_batches()
    model = gpt2()
    traced = _compile(model, data, by_key, frontend="export").loss()
    assert traced is not None and traced.frontend == "make_fx"
    (x,), y = data[0]
    with torch.no_grad():
        output = model(x[:2])  # the real ModelOutput; the last stage returns its logits
        torch.testing.assert_close(traced.gm(output.logits, y[:2]), by_key(output, y[:2]), rtol=1e-6, atol=0)


# -- losses that look at their output (#29 item 1): they run as Python runs them ---------------------------

def by_hasattr(out: Any, target: torch.Tensor) -> torch.Tensor:
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits.flatten(0, -2), target.flatten())


def by_getattr(out: Any, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(getattr(out, "logits", out).flatten(0, -2), target.flatten())


def by_isinstance(out: Any, target: torch.Tensor) -> torch.Tensor:
    logits = out if isinstance(out, torch.Tensor) else out[0]
    return F.cross_entropy(logits.flatten(0, -2), target.flatten())


def probing(out: Any, target: torch.Tensor) -> torch.Tensor:
    """The three checks in one loss (one launch trains them all), each deciding as in eager."""
    return by_hasattr(out, target) + 0.5 * by_getattr(out, target) + 0.25 * by_isinstance(out, target)


class DictOut(torch.nn.Module):
    """A model returning a dict that holds a tuple: ``{"logits": ..., "aux": (hidden, scale)}``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32))
        self.head = torch.nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        h = self.body(x)
        return {"logits": self.head(torch.relu(h)), "aux": (h, h.abs().mean(-1))}


def over_structure(out: Any, target: torch.Tensor) -> torch.Tensor:
    """A loss over a dict and a tuple, with the checks a user writes around them."""
    assert isinstance(out, dict) and "aux" in out and isinstance(out["aux"], tuple)
    hidden, scale = out["aux"]
    extra = sum(0.01 * v.pow(2).mean() for k, v in out.items() if k != "logits" and isinstance(v, torch.Tensor))
    return F.cross_entropy(out["logits"], target) + 0.01 * hidden.pow(2).mean() + 0.1 * scale.mean() + extra


LLAMA_VOCAB = 64


def llama() -> torch.nn.Module:
    """A Hugging Face Llama as it comes: its default config (``use_cache=True``), only made small."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=LLAMA_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    assert cfg.use_cache is True
    return transformers.LlamaForCausalLM(cfg)


def llama_batches() -> Batches:
    g = torch.Generator().manual_seed(13)
    return [((torch.randint(0, LLAMA_VOCAB, (4, 8), generator=g),), torch.randint(0, LLAMA_VOCAB, (4, 8), generator=g))
            for _ in range(STEPS)]


PROBES = {"hasattr": by_hasattr, "getattr": by_getattr, "isinstance": by_isinstance}


@pytest.mark.parametrize("model_name", ["mlp", "llama"])
def test_each_probing_loss_is_traced_as_eager_runs_it(model_name: str) -> None:
    """Each form alone, on a plain-tensor output and on a ModelOutput: the built loss equals calling it."""
    model, data = (mlp(), mlp_batches()) if model_name == "mlp" else (llama(), llama_batches())
    pipe = _compile(model, data, by_hasattr)
    (x,), y = data[0]
    micro_x, micro_y = x.chunk(MICRO)[0], y.chunk(MICRO)[0]
    from pdcompile.passes.trace_loss import loss_program
    with torch.no_grad():
        eager_out = model(micro_x)  # a tensor, or the model's ModelOutput
        stage_out = pipe.split.run(micro_x)  # what the last stage hands the loss
        for name, fn in {**PROBES, "probing": probing}.items():
            traced = loss_program(fn, pipe.split.stages[-1].gm, micro_y, pipe.state.output_key).traced
            assert traced is not None and traced.frontend == "make_fx", name
            torch.testing.assert_close(traced.gm(stage_out, micro_y), fn(eager_out, micro_y), rtol=1e-6, atol=0,
                                       msg=name)


# no mlp row: probing a plain tensor output is traced as eager runs it (test_each_probing_loss_is_traced_...)
# and a traced loss over the mlp trains like single-process (test_plain_pytorch_losses_train_like_single_process)
@pytest.mark.multiproc
@pytest.mark.parametrize("model_name", ["dict", "llama"])
def test_losses_that_look_at_the_output_train_like_single_process(tmp_path: Path, model_name: str) -> None:
    factory, batches, loss_fn = {"mlp": (mlp, mlp_batches, probing), "dict": (DictOut, mlp_batches, over_structure),
                                 "llama": (llama, llama_batches, probing)}[model_name]
    data = batches()
    model = factory()
    config_before = model.config.to_dict() if model_name == "llama" else None
    ref = copy.deepcopy(model)
    initial = {k: v.detach().clone() for k, v in model.named_parameters()}
    pipe = _compile(model, data, loss_fn)
    if config_before is not None:  # item 2: captured without the KV cache, the user's config left as it was
        assert model.config.to_dict() == config_before and model.config.use_cache is True
    prog, got, losses = _launch(pipe, data, tmp_path)
    traced = pipe.loss()
    assert traced is not None and traced.frontend == "make_fx"
    ref_losses = single_process(ref, loss_fn, data)  # eager: the model's own output, the loss as written
    _assert_equal_training(got, losses, ref, ref_losses, initial)
