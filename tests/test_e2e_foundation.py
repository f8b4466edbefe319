"""End to end through torchrun: the pipeline trains exactly what single-process training trains."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from pdcompile.api import pdcompile
from _ranks import run_ranks
from pdcompile.merge import merge_weights
from pdcompile.reference import train_sync
from pdcompile.zoo import batches, get

pytestmark = [pytest.mark.timeout(180), pytest.mark.multiproc]

STEPS = 5
MICRO = 2
LR = 0.05


def _opt(params):  # noqa: ANN001, ANN202
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def _compile(name: str, stages: int, schedule: str = "flush"):  # noqa: ANN202
    z = get(name, batch_size=8, seed=0)
    pipe = pdcompile(z.model, example_inputs=z.example_inputs, example_target=z.target, loss_fn=z.loss_fn,
                     optimizer=_opt, stages=stages, schedule=schedule, num_microbatches=MICRO,
                     leaf_modules=z.leaf_modules)
    return z, pipe


def _reference(name: str) -> dict[str, torch.Tensor]:
    z = get(name, batch_size=8, seed=0)
    model = z.model
    train_sync(model, z.loss_fn, _opt(model.parameters()), batches(8, name), steps=STEPS, num_microbatches=MICRO)
    state = {k: v.detach() for k, v in model.named_parameters()}
    state.update({k: v.detach() for k, v in model.named_buffers()})
    return state


# no plain mlp under flush: the resnet and gpt flush rows cover it
@pytest.mark.parametrize("name,stages,schedule", [
    ("mlp", 3, "gpipe"),
    ("resnet", 2, "flush"), ("resnet", 3, "flush"),
    ("gpt", 2, "gpipe"), ("gpt", 3, "flush"),
])
def test_pipeline_equals_single_process(tmp_path: Path, name: str, stages: int, schedule: str) -> None:
    z, pipe = _compile(name, stages, schedule)
    if name == "resnet" and stages == 3:  # the skip connection really crosses a stage boundary (the 2-stage
        # cut the cost model with fixed per-op costs balances lies between two blocks)
        assert any(len(st.inputs) > 1 for st in pipe.split.stages[1:])
    if name == "gpt":  # the tied embedding really lives in two stages
        assert pipe.split.tied and len({s for s, _ in pipe.split.tied[0]}) == 2
    out = pipe.emit(tmp_path / "prog", data={"factory": "pdcompile.zoo:batches", "kwargs": {"name": name}})
    rc, log = run_ranks(out, stages, ["--steps", str(STEPS), "--save-final", str(tmp_path / "final"),
                                      "--timeout", "60"], timeout=150)
    assert rc == 0, log[-3000:]
    got = merge_weights(out, tmp_path / "final")
    want = _reference(name)
    assert set(got) == set(want)
    init_model = get(name, batch_size=8, seed=0).model
    initial = dict(init_model.named_parameters())
    initial.update(dict(init_model.named_buffers()))
    moved = 0
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=f"{name}: {k}")
        moved += int(not torch.equal(want[k], initial[k]))
    assert moved > len(list(init_model.parameters())) // 2  # training really changed the weights


@pytest.mark.parametrize("replicas", [[2, 1], [1, 2]])
def test_tied_weights_across_a_replicated_stage(tmp_path: Path, replicas: list[int], forked_run: None) -> None:
    """GPT's tied embedding in stage 0 and stage 1, one of them with 2 replicas: the replicas'
    all-reduce, then the tied-gradient sum (each replica contributing 1/replicas), equal
    single-process training. With the last stage replicated, each replica reads its targets from
    the data itself and checks its first one against the first stage's (--targets auto). ``run()``'s
    ranks forked (conftest ``forked_run``): the subject is what they compute."""
    z = get("gpt", batch_size=8, seed=0)
    pipe = pdcompile(z.model, example_inputs=z.example_inputs, example_target=z.target, loss_fn=z.loss_fn,
                     optimizer=_opt, stages=2, replicas=replicas, schedule="flush", num_microbatches=4)
    assert pipe.split.tied and pipe.world_size == 3
    result = pipe.run(batches(8, "gpt"), steps=STEPS, out=tmp_path)
    trained = get("gpt", batch_size=8, seed=0).model
    trained.load_state_dict(result.state_dict())
    ref = get("gpt", batch_size=8, seed=0)
    train_sync(ref.model, ref.loss_fn, _opt(ref.model.parameters()), batches(8, "gpt"), steps=STEPS,
               num_microbatches=4)
    for (k, a), (_, b) in zip(trained.state_dict().items(), ref.model.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=k)
