"""Hugging Face models as their users call them: ``model(input_ids, attention_mask=mask, labels=labels)``,
the loss the model's own (``loss_fn=lambda out, t: out.loss``). ``example_kwargs=`` compiles them; the
minibatches are ``(args, kwargs, None)``; keyword tensors split along dim 0 like positional ones. GPT-2
through ``run()`` on 3 stages (flush) and a left-padded Llama on 2 stages (PipeDream's 1F1B) train to the
weights single-process training gives (pdcompile.reference)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from _hf_llama import llama_config
from _emitted import train_saved
from pdcompile import pdcompile, reference
from pdcompile.errors import UsageError
from pdcompile.runtime.data import batch_parts
from pdcompile.runtime.program import Program, build

transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.timeout(300)]

VOCAB, SEQ, BATCH, MICRO, STEPS = 100, 8, 8, 4, 3


def gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=3, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))


def llama() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(llama_config(VOCAB, pad_token_id=0))


def padded_batches(left: bool) -> list[tuple[tuple[torch.Tensor], dict[str, torch.Tensor], None]]:
    """Token minibatches of ragged lengths, padded (id 0) on the left or right, masked, the pads' labels -100:
    ``((input_ids,), {"attention_mask": mask, "labels": labels}, None)``."""
    out = []
    for i in range(STEPS):
        g = torch.Generator().manual_seed(100 + i)
        ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
        lengths = torch.randint(SEQ // 2, SEQ + 1, (BATCH,), generator=g)
        pos = torch.arange(SEQ).expand(BATCH, SEQ)
        mask = (pos >= SEQ - lengths[:, None]) if left else (pos < lengths[:, None])
        ids = ids.masked_fill(~mask, 0)
        labels = ids.masked_fill(~mask, -100)
        out.append(((ids,), {"attention_mask": mask.long(), "labels": labels}, None))
    return out


class ByKeyword(torch.nn.Module):
    """The reference's model: ``model(ids, attention_mask=mask, labels=labels)`` called positionally, as
    reference.train_sync calls models."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> Any:
        return self.model(ids, attention_mask=mask, labels=labels)


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _flat(data: list[Any]) -> list[tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
    return [batch_parts(b, ("attention_mask", "labels")) for b in data]


def test_keyword_inputs_split_like_positional_ones_and_reach_the_graph() -> None:
    """attention_mask and labels by name: the stages give the model's own loss on every microbatch (a mask
    reaching the wrong parameter, or not split, would not); the program records the keywords' order."""
    data = padded_batches(left=False)
    (ids,), kw, _ = data[0]
    model = gpt2()
    pipe = pdcompile(model, example_inputs=(ids,), example_kwargs={**kw, "use_cache": False},
                     loss_fn=lambda out, t: out.loss, stages=2, num_microbatches=MICRO, optimizer=_sgd)
    assert pipe.keywords == ("attention_mask", "labels")
    assert pipe.program_fields()["input_keywords"] == ["attention_mask", "labels"]
    traced = pipe.loss()
    assert traced is not None
    b = BATCH // MICRO
    for j in range(MICRO):
        cut = slice(j * b, (j + 1) * b)
        with torch.no_grad():
            got = traced.gm(pipe.split.run(ids[cut], kw["attention_mask"][cut], kw["labels"][cut]),
                            torch.empty(b, 0))
            want = model(ids[cut], attention_mask=kw["attention_mask"][cut], labels=kw["labels"][cut]).loss
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    with pytest.raises(UsageError, match=r"keyword inputs are \['attention_mask'\], the program was compiled with "
                                         r"the tensors \['attention_mask', 'labels'\]"):
        batch_parts(((ids,), {"attention_mask": kw["attention_mask"]}, None), pipe.keywords)


@pytest.mark.multiproc
def test_gpt2_with_mask_and_labels_trains_through_run_like_single_process(tmp_path: Path) -> None:
    """GPT-2 on 3 stages, flush, through ``run()`` with (args, kwargs, None) minibatches: the weights of the
    unsplit model trained with gradient accumulation, within 1e-5."""
    data = padded_batches(left=False)
    (ids,), kw, _ = data[0]
    pipe = pdcompile(gpt2(), example_inputs=(ids,), example_kwargs=kw, loss_fn=lambda out, t: out.loss,
                     stages=3, num_microbatches=MICRO, optimizer=_sgd)
    assert len(pipe.split.stages) == 3
    # the mask every layer reads, and the labels only the loss reads, are read by the stages that use them
    assert [st.data_inputs for st in pipe.split.stages] == [(), ("attention_mask",), ("attention_mask", "labels")]
    result = pipe.run(data, steps=STEPS, eval_data=data[:1], out=tmp_path / "run", timeout=200)
    got = result.state_dict()
    # ... and sent by none: the first stage sends its activations only (float32), nothing int64 crosses
    sent = [json.loads((tmp_path / "run" / "metrics" / f"rank_{r}.json").read_text())["p2p_bytes_sent"] for r in (0, 1)]
    per_minibatch = MICRO * sum(m.nbytes for m in pipe.split.stages[0].output_meta)
    assert sent[0] == {"float32": (STEPS + 1) * per_minibatch}, sent  # the training minibatches and the validation one
    assert set(sent[1]) == {"float32"}, sent
    ref = gpt2()
    initial = {k: v.detach().clone() for k, v in ref.named_parameters()}
    reference.train_sync(ByKeyword(ref), lambda out, t: out.loss, _sgd(ref.parameters()), _flat(data),
                         steps=STEPS, num_microbatches=MICRO)
    moved = 0
    for k, w in ref.named_parameters():
        torch.testing.assert_close(got[k], w.detach(), rtol=1e-5, atol=1e-5, msg=lambda m: f"{k}: {m}")
        moved += int(not torch.equal(got[k], initial[k]))
    assert moved > len(initial) // 2
    # the validation pass at the end (its stages read the mask and labels themselves too): the trained model's loss
    inputs, _ = _flat(data[:1])[0]
    b = BATCH // MICRO
    with torch.no_grad():
        want = sum(float(ByKeyword(ref)(*(x[j * b:(j + 1) * b] for x in inputs)).loss) for j in range(MICRO)) / MICRO
    assert result.metrics["eval"][-1]["loss"] == pytest.approx(want, rel=1e-5), result.metrics["eval"]


@pytest.mark.multiproc
def test_left_padded_llama_with_labels_trains_under_1f1b_like_its_reference(tmp_path: Path) -> None:
    """A Llama given left-padded minibatches (attention_mask=, labels= with -100 on the pads), 2 stages under
    PipeDream's 1F1B: each stage's weights equal the weight-versioned single-process reference."""
    data = padded_batches(left=True)
    (ids,), kw, _ = data[0]
    pipe = pdcompile(llama(), example_inputs=(ids,), example_kwargs=kw, loss_fn=lambda out, t: out.loss,
                     stages=2, num_microbatches=MICRO, optimizer=_sgd, schedule="1f1b")
    prog, got = train_saved(pipe, data, STEPS, tmp_path, keywords=pipe.keywords)
    program = Program.load(prog)
    mods = [program.build_stage(k) for k in range(program.num_stages)]
    initial = {program.stages[s].param_names.get(n, n): p.detach().clone()
               for s, m in enumerate(mods) for n, p in m.named_parameters()}
    opts = [build(program.raw["optimizer"], m.parameters()) for m in mods]
    b = BATCH // MICRO
    micro = [(tuple(x[j * b:(j + 1) * b] for x in xs), t[j * b:(j + 1) * b]) for xs, t in _flat(data)
             for j in range(MICRO)]
    fwd, bwd, group = reference.pipedream_1f1b([1, 1])
    # the mask and labels the last stage reads it takes from the data: the first stage sends activations only
    assert [[(t.name, j) for j, t in st.data] for st in program.stages] == [[], [("attention_mask", 1), ("labels", 2)]]
    assert all(t.dtype.is_floating_point for t in program.stages[0].outputs), program.stages[0].outputs
    reference.train_versioned(mods, opts, program.build_loss(), micro, fwd=fwd, bwd=bwd, group=group,
                              tied=[[(s, n) for s, n in grp] for grp in program.raw.get("tied", [])],
                              data_inputs=[[j for j, _ in st.data] for st in program.stages])
    moved = 0
    for st, m in zip(program.stages, mods):
        for n, p in m.named_parameters():
            k = st.param_names.get(n, n)
            torch.testing.assert_close(got[k], p.detach(), rtol=1e-5, atol=1e-5, msg=lambda msg: f"{k}: {msg}")
            moved += int(not torch.equal(got[k], initial[k]))
    assert moved > len(initial) // 2


class Scaled(torch.nn.Module):
    """A model with keyword inputs that computes its own loss, returned in a dict."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(4, 8), torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None, target: torch.Tensor | None = None,
                squared: bool = True) -> dict[str, torch.Tensor]:
        h = self.b(torch.relu(self.a(x))) * scale
        err = (h - target) ** 2 if squared else (h - target).abs()
        return {"out": h, "loss": err.mean()}


def test_decorator_and_cli_factories_take_keyword_inputs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """The decorator form, and a CLI factory's ``.example_kwargs`` (``pdcompile emit``, ``profile``, ``plan``): the
    keyword tensors (not the constant ``squared=False``) become the program's inputs after the positional one, in
    order, and the stages compute the model's loss with the constant as given; profile and plan see the ops that
    read them (``* scale``, ``- target``: the model's loss)."""
    from pdcompile.cli import main

    x, scale, target = torch.randn(8, 4), torch.rand(8, 1) + 0.5, torch.randn(8, 4)
    kw = {"scale": scale, "target": target, "squared": False}

    @pdcompile(None, example_inputs=(x,), example_kwargs=kw, loss_fn=lambda out, t: out["loss"], stages=2)
    class Net(Scaled):
        pass

    pipe = Net()
    assert pipe.keywords == ("scale", "target")
    with torch.no_grad():
        got = pipe.split.run(x[:2], scale[:2], target[:2])
        want = Scaled()(x[:2], scale=scale[:2], target=target[:2], squared=False)["loss"]
    torch.testing.assert_close(got, want)
    (tmp_path / "kwmodel.py").write_text(
        "import torch\nfrom types import SimpleNamespace\nfrom test_keyword_inputs import Scaled\n\n"
        "def make():\n    x, s, t = torch.randn(8, 4), torch.rand(8, 1) + 0.5, torch.randn(8, 4)\n"
        "    return SimpleNamespace(model=Scaled(), example_inputs=(x,), example_kwargs={'scale': s, 'target': t},\n"
        "                           loss_fn=lambda out, t: out['loss'])\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent))
    assert main(["emit", "kwmodel:make", "-o", str(tmp_path / "prog"), "--stages", "2"]) == 0
    plan = json.loads((tmp_path / "prog" / "plan.json").read_text())
    assert plan["input_keywords"] == ["scale", "target"]
    assert [t["name"] for t in plan["stages"][0]["inputs"]] == ["x", "scale", "target"]
    assert plan["target"]["shape"] == [2, 0]  # no target: the loss is the model's
    assert main(["profile", "kwmodel:make", "--mode", "analytic", "--no-symbolic", "-o", str(tmp_path / "p.json")]) == 0
    profiled = json.loads((tmp_path / "p.json").read_text())
    assert [i["name"] for i in profiled["inputs"]] == ["x", "scale", "target"]
    assert {"mul", "sub", "mean"} <= {layer["name"] for layer in profiled["layers"]}
    capsys.readouterr()
    assert main(["plan", "kwmodel:make", "--cluster", "local:2", "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert {"mul", "sub", "mean"} <= {n for st in planned["stages"] for n in st["layer_names"]}
    # --input would replace the positional example only, leaving the keyword tensors of another batch
    assert main(["plan", "kwmodel:make", "--input", "4x4", "--cluster", "local:2"]) == 2
    assert "drop --input" in capsys.readouterr().err
