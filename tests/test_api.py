"""The Python API: pdcompile(...) as a function and a decorator, argument checks, run() and state_dict()."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdcompile.api import CompiledPipeline, pdcompile
from pdcompile.errors import UsageError
from pdcompile.reference import train_sync
from pdcompile.zoo import batches, get
from pdcompile.zoo.mlp import MLP, MLPConfig

pytestmark = pytest.mark.timeout(120)


def _opt(params):  # noqa: ANN001, ANN202
    return torch.optim.SGD(params, lr=0.1, momentum=0.5)


@pytest.mark.multiproc
def test_run_returns_weights_equal_to_single_process_training(tmp_path: Path) -> None:
    z = get("gpt", batch_size=8, seed=0)
    pipe = pdcompile(z.model, example_inputs=z.example_inputs, example_target=z.target, loss_fn=z.loss_fn,
                     optimizer=_opt, stages=2, schedule="flush", num_microbatches=2)
    result = pipe.run(batches(8, "gpt"), steps=5, out=tmp_path)
    assert len(result.metrics["losses"]) == 5 * 2
    trained = get("gpt", batch_size=8, seed=0).model
    trained.load_state_dict(result.state_dict())  # strict: every key, tied ones included
    ref = get("gpt", batch_size=8, seed=0)
    losses = train_sync(ref.model, ref.loss_fn, _opt(ref.model.parameters()), batches(8, "gpt"), steps=5,
                        num_microbatches=2)
    for (k, a), (_, b) in zip(trained.state_dict().items(), ref.model.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=k)
    assert result.metrics["losses"] == pytest.approx(losses, rel=1e-5)


def test_decorator_on_a_class_and_on_a_factory() -> None:
    z = get("mlp", batch_size=4)

    @pdcompile(None, example_inputs=z.example_inputs, example_target=z.target, loss_fn=z.loss_fn, stages=2)
    class Net(MLP):
        pass

    pipe = Net(MLPConfig(in_features=16, hidden=(32, 32), num_classes=10))
    assert isinstance(pipe, CompiledPipeline) and len(pipe.split.stages) == 2
    x = tuple(t[:2] for t in z.example_inputs)
    assert torch.equal(pipe.split.run(*x), pipe.model(*x))

    @pdcompile(None, example_inputs=z.example_inputs, example_target=z.target, loss_fn=z.loss_fn, stages=3)
    def factory() -> torch.nn.Module:
        return get("mlp", batch_size=4).model

    assert len(factory().split.stages) == 3


@pytest.mark.parametrize("kwargs,match", [
    ({"loss_fn": None}, "loss_fn= is required"),
    ({"loss_fn": "cross_entropy"}, "loss_fn must be callable"),
    ({"schedule": "zigzag"}, "schedule must be one of"),
    ({"num_microbatches": 3}, "must divide the example batch"),
    ({"example_inputs": None}, "example_inputs=.* is required"),
])
def test_bad_arguments_are_refused_up_front(kwargs: dict, match: str) -> None:
    z = get("mlp", batch_size=4)
    args = dict(example_inputs=z.example_inputs, example_target=z.target, loss_fn=z.loss_fn, stages=2)
    args.update(kwargs)
    with pytest.raises(UsageError, match=match):
        pdcompile(z.model, **args)


def test_emit_without_a_target_shape_says_how_to_fix(tmp_path: Path) -> None:
    z = get("mlp", batch_size=4)
    pipe = pdcompile(z.model, example_inputs=z.example_inputs, loss_fn=z.loss_fn, stages=2)
    with pytest.raises(UsageError, match="example_target="):
        pipe.emit(tmp_path)


def test_compiling_leaves_the_models_buffers_as_they_were() -> None:
    """The passes run the model's forward in training mode; BatchNorm's running statistics (and its
    count of batches) are what they were before, in the user's model and in the emitted stages'
    buffers (the same tensors), so training starts from the model as given."""
    import dataclasses

    import torch

    from pdcompile.api import pdcompile
    from pdcompile.zoo import get, resnet

    z = get("resnet", batch_size=8, seed=0)
    torch.manual_seed(0)
    model = resnet.ResNet(dataclasses.replace(resnet.CONFIGS["small"], norm="batch"))
    before = {n: b.clone() for n, b in model.named_buffers()}
    assert any(n.endswith("running_mean") for n in before)
    pipe = pdcompile(model, example_inputs=z.example_inputs, example_target=z.target, loss_fn=z.loss_fn,
                     optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), stages=2, schedule="flush",
                     num_microbatches=4)
    for n, b in model.named_buffers():
        assert torch.equal(b, before[n]), n
    staged = [b for st in pipe.split.stages for b in st.gm.buffers()]
    assert staged and all(any(torch.equal(b, v) for v in before.values()) for b in staged)
    assert all(int(b) == 0 for n, b in model.named_buffers() if n.endswith("num_batches_tracked"))
