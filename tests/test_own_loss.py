"""Models that compute their own loss: the target is a model input, forward returns the loss (nanoGPT's
``logits, loss = model(X, Y)``, a Hugging Face causal LM's ``model(ids, labels=labels).loss``), and
``loss_fn`` picks it. Compiled as users write them, they train on 2 and 3 stages under flush and 1F1B to
the weights single-process training gives (pdcompile.reference)."""

from __future__ import annotations

import functools
import importlib.util
import json
from pathlib import Path
from typing import Any

import cloudpickle
import pytest
import torch

from _ranks import run_ranks
from pdcompile import pdcompile, reference
from pdcompile.errors import UsageError
from pdcompile.merge import merge_weights
from pdcompile.runtime.data import check_inputs, from_file, save_batches
from pdcompile.runtime.program import Program, TensorSpec, build

NANOGPT = Path(__file__).resolve().parent / "fixtures" / "nanogpt"  # nanoGPT's model.py as published (MIT)
_spec = importlib.util.spec_from_file_location("nanogpt_model", NANOGPT / "model.py")
assert _spec is not None and _spec.loader is not None
nanogpt_model = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(nanogpt_model)
GPT, GPTConfig = nanogpt_model.GPT, nanogpt_model.GPTConfig

pytestmark = [pytest.mark.timeout(300)]

VOCAB, T, BATCH, MICRO, STEPS = 64, 16, 8, 4, 3


def nanogpt() -> Any:
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=T, vocab_size=VOCAB, n_layer=3, n_head=2, n_embd=32, dropout=0.0))


def batches() -> list[tuple[tuple[torch.Tensor, torch.Tensor], None]]:
    """nanoGPT's get_batch: X, and Y = X shifted by one; no target beside them (the model's loss reads Y)."""
    g = torch.Generator().manual_seed(10)
    data = torch.randint(0, VOCAB, (1000,), generator=g)
    out = []
    for _ in range(STEPS):
        ix = torch.randint(len(data) - T, (BATCH,), generator=g)
        x = torch.stack([data[i:i + T] for i in ix])
        y = torch.stack([data[i + 1:i + 1 + T] for i in ix])
        out.append(((x, y), None))
    return out


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_nanogpt_compiles_as_written_and_its_stages_compute_its_loss(frontend: str) -> None:
    """``example_inputs=(x, y)``, ``loss_fn=lambda out, t: out[1]``, no target: through either front end
    (fx: ``b, t = idx.size()`` and the assert on it decided on the example's shapes; export: the entry of
    the model's tuple the loss reads), the stages and the traced loss give the model's own loss."""
    model = nanogpt()
    (x, y), _ = batches()[0]
    pipe = pdcompile(model, example_inputs=(x, y), loss_fn=lambda out, t: out[1], stages=2, num_microbatches=MICRO,
                     optimizer=_sgd, frontend=frontend)
    assert len(pipe.split.stages) == 2
    assert [n for n in pipe.split.stages[0].inputs] == ["idx", "targets"]
    b = BATCH // MICRO
    traced = pipe.loss()  # no target: the model needs none
    assert traced is not None
    for j in range(2):
        xs, ys = x[j * b:(j + 1) * b], y[j * b:(j + 1) * b]
        with torch.no_grad():
            got = traced.gm(pipe.split.run(xs, ys), torch.empty(b, 0))
            want = model(xs, ys)[1]
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_the_targets_go_to_the_last_stage_from_the_data_not_through_the_stages(tmp_path: Path) -> None:
    """3 stages: the targets only the loss reads (and ``targets.view(-1)``, made again where it is read) cross
    no boundary; the last stage reads them from the data (plan.json ``data_inputs``, the stage's forward), and
    the planner charges each boundary exactly the bytes the stages send."""
    model = nanogpt()
    (x, y), _ = batches()[0]
    pipe = pdcompile(model, example_inputs=(x, y), loss_fn=lambda out, t: out[1], stages=3, num_microbatches=MICRO,
                     optimizer=_sgd)
    first, middle, last = pipe.split.stages
    assert first.inputs == ("idx", "targets") and last.data_inputs == ("targets",)
    assert middle.data_inputs == () and "targets" not in middle.inputs + last.inputs
    assert all(m.dtype == "torch.float32" for st in (first, middle) for m in st.output_meta)  # no int64 targets
    cuts = [pipe.state.chain.cut_bytes[st.last] for st in pipe.plan.stages[:-1]]
    assert cuts == [float(sum(m.nbytes for m in st.output_meta)) for st in (first, middle)]
    prog = pipe.emit(tmp_path / "prog")
    plan = json.loads((prog / "plan.json").read_text())
    assert [[(d["name"], d["index"]) for d in st["data_inputs"]] for st in plan["stages"]] == [[], [], [("targets", 1)]]
    assert "DATA_INPUTS = ('targets',)" in (prog / "stage_2.py").read_text()
    assert Program.load(prog).relayed(1) == (1,) and Program.load(prog).relayed(2) == (1,)  # --targets send's relay


def test_input_shapes_taken_as_constants_are_guarded() -> None:
    """``b, t = idx.size()`` was decided on the example: data of another length is refused, in one line."""
    specs = (TensorSpec("idx", (2, T), torch.int64, False), TensorSpec("targets", (2, T), torch.int64, False))
    check_inputs((torch.zeros(8, T, dtype=torch.long), torch.zeros(8, T, dtype=torch.long)), specs)
    with pytest.raises(UsageError, match=r"input 'idx' has samples of shape \(12,\), the program was compiled for "
                                         r"\(16,\)"):
        check_inputs((torch.zeros(8, 12, dtype=torch.long), torch.zeros(8, 12, dtype=torch.long)), specs)
    with pytest.raises(UsageError, match=r"has 1 input tensor\(s\), the program was compiled for 2 \(idx, targets\)"):
        check_inputs((torch.zeros(8, T, dtype=torch.long),), specs)


def _train_and_compare(tmp_path: Path, replicas: list[int], schedule: str, targets: str) -> None:
    data = batches()
    model = nanogpt()
    (x, y), _ = data[0]
    stages = len(replicas)
    pipe = pdcompile(model, example_inputs=(x, y), loss_fn=lambda out, t: out[1], stages=stages, replicas=replicas,
                     num_microbatches=MICRO, optimizer=_sgd, schedule=schedule)
    assert len(pipe.split.stages) == stages
    save_batches(data, STEPS, tmp_path / "data.pt")
    prog = pipe.emit(tmp_path / "prog", data={"factory": "pdcompile.runtime.data:from_file",
                                              "kwargs": {"path": str(tmp_path / "data.pt")}})
    # --targets send also validates after training, on the first minibatch (the evaluator relays the targets too)
    (prog / "eval.pkl").write_bytes(cloudpickle.dumps(functools.partial(from_file, path=str(tmp_path / "data.pt"))))
    evaluate = ["--eval-data", "eval.pkl", "--eval-steps", "1"] if targets == "send" else []
    rc, log = run_ranks(prog, sum(replicas), ["--steps", str(STEPS), "--save-final", str(tmp_path / "final"),
                                       "--metrics", str(tmp_path / "metrics"), "--targets", targets, "--timeout", "60",
                                       *evaluate], timeout=150)
    assert rc == 0, log[-3000:]
    # --targets local: the first stage sends its activations only, the last stage reads the targets itself;
    # --targets send: the targets travel on after the activations, every microbatch (int64)
    sent = json.loads((tmp_path / "metrics" / "rank_0.json").read_text())["p2p_bytes_sent"]
    minibatches = STEPS + (1 if evaluate else 0)
    want = {"float32": minibatches * MICRO * sum(m.nbytes for m in pipe.split.stages[0].output_meta)}
    if targets == "send":
        want["int64"] = minibatches * BATCH * T * 8
    assert sent == want, sent
    assert [len(st.ranks) for st in Program.load(prog).stages] == replicas
    got = merge_weights(prog, tmp_path / "final")
    if evaluate:  # the validation loss is the trained model's own loss on that minibatch, computed in one process
        trained = nanogpt()
        assert not trained.load_state_dict(got, strict=False).unexpected_keys
        b = BATCH // MICRO
        with torch.no_grad():
            own = sum(float(trained(x[j * b:(j + 1) * b], y[j * b:(j + 1) * b])[1]) for j in range(MICRO)) / MICRO
        reported = json.loads((tmp_path / "metrics" / f"rank_{sum(replicas) - 1}.json").read_text())["eval"]
        assert reported[-1]["loss"] == pytest.approx(own, rel=1e-5), reported
    ref = nanogpt()
    initial = {k: v.detach().clone() for k, v in ref.named_parameters()}
    if schedule == "flush":  # synchronous: the unsplit model, gradients accumulated over the microbatches
        reference.train_sync(ref, lambda out, t: out[1], _sgd(ref.parameters()),
                             [(inputs, torch.empty(BATCH, 0)) for inputs, _ in data], steps=STEPS, num_microbatches=MICRO)
        want = dict(ref.named_parameters())
    else:  # PipeDream's 1F1B: each stage's weight versions as the paper defines them
        program = Program.load(prog)
        mods = [program.build_stage(k) for k in range(program.num_stages)]
        opts = [build(program.raw["optimizer"], m.parameters()) for m in mods]
        b = BATCH // MICRO
        micro = [((x[j * b:(j + 1) * b], y[j * b:(j + 1) * b]), torch.empty(b, 0))
                 for (x, y), _ in data for j in range(MICRO)]
        fwd, bwd, group = reference.pipedream_1f1b([1] * stages)
        reference.train_versioned(mods, opts, program.build_loss(), micro, fwd=fwd, bwd=bwd, group=group,
                                  tied=[[(s, n) for s, n in grp] for grp in program.raw.get("tied", [])],
                                  data_inputs=[[j for j, _ in st.data] for st in program.stages])
        want = {}
        for st, m in zip(program.stages, mods):
            for n, p in m.named_parameters():
                want.setdefault(st.param_names.get(n, n), p)
    moved = 0
    for k, w in want.items():
        name = k if k in got else next(a for a in got if a.replace(".", "_") == k.replace(".", "_"))
        torch.testing.assert_close(got[name], w.detach(), rtol=1e-5, atol=1e-5, msg=lambda m: f"{k}: {m}")
        moved += int(k in initial and not torch.equal(got[name], initial[k]))
    assert moved > len(initial) // 2


@pytest.mark.multiproc
@pytest.mark.parametrize("replicas,schedule,targets", [([1, 2], "flush", "local"), ([1, 1, 1], "1f1b", "send")])
def test_nanogpt_trains_like_single_process(tmp_path: Path, replicas: list[int], schedule: str, targets: str) -> None:
    """nanoGPT's model.py as published, its own loss: 2 stages under flush, the last one replicated (each replica
    reads the targets of its own microbatches), equal the unsplit model trained with gradient accumulation;
    3 stages under PipeDream's 1F1B equal its weight-versioned reference, the targets relayed through the
    middle stage (``--targets send``: data the last stage cannot read itself)."""
    _train_and_compare(tmp_path, replicas, schedule, targets)



def test_a_loss_that_reads_the_target_still_needs_one(tmp_path: Path) -> None:
    """Without example_target, only a loss that reads no target is given the empty one: a loss that reads it
    (here one that would broadcast against an empty target to a NaN) is told to pass example_target=."""
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    pipe = pdcompile(net, example_inputs=(torch.randn(8, 4),), stages=2,
                     loss_fn=lambda out, t: torch.nn.functional.mse_loss(out, t))
    with pytest.raises(UsageError, match="the last stage must know the target's shape: pass example_target="):
        pipe.emit(tmp_path / "prog")


def test_the_docs_adamw_factory_is_rebuilt_by_the_ranks() -> None:
    """``optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3)`` (the docs' nanoGPT example): plan.json's spec
    builds it back (AdamW's defaults hold Adam's ``decoupled_weight_decay``, which its constructor refuses)."""
    from pdcompile.passes.codegen import optimizer_spec

    spec = optimizer_spec(lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.1)).to_json()
    opt = build(spec, [torch.nn.Parameter(torch.zeros(2))])
    assert isinstance(opt, torch.optim.AdamW)
    assert opt.defaults["lr"] == 1e-3 and opt.defaults["weight_decay"] == 0.1
