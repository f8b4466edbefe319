"""The model zoo: every model builds, trains, traces, and is deterministic."""

from __future__ import annotations

import dataclasses
import importlib
import operator
from typing import Any

import pytest
import torch
import torch.fx
from torch import Tensor
from torch.utils._pytree import tree_leaves
from torch.utils._python_dispatch import TorchDispatchMode

from pdcompile.errors import UsageError
from pdcompile.zoo import ZooModel, get, names, sizes
from pdcompile.zoo.losses import SequenceCrossEntropy

B = 4

# Output shape of each small model for a batch of B.
SMALL_OUTPUT = {
    "mlp": (B, 10),
    "vgg": (B, 10),
    "resnet": (B, 10),
    "gpt": (B, 8, 64),
    "gnmt": (B, 5, 32),
}

# Parameter counts of the full configs (shared parameters counted once), as loose sanity ranges.
FULL_PARAMS = {
    "mlp": (40e6, 44e6),  # 1024 -> 3x4096 -> 1000: 41.9M
    "vgg": (135e6, 141e6),  # VGG-16: 138.4M
    "resnet": (24e6, 27e6),  # ResNet-50: 25.6M
    "gpt": (120e6, 130e6),  # GPT-2 small, tied embeddings: 124.4M
    "gnmt": (180e6, 200e6),  # GNMT-8 (PipeDream): 191.7M
}

FULL_OUTPUT = {
    "mlp": (2, 1000),
    "vgg": (2, 1000),
    "resnet": (2, 1000),
    "gpt": (2, 1024, 50257),
    "gnmt": (2, 50, 32320),
}


def _tensors_equal(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor):
        return isinstance(b, Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return len(a) == len(b) and all(_tensors_equal(x, y) for x, y in zip(a, b))


def test_names() -> None:
    assert names() == ["mlp", "vgg", "resnet", "gpt", "gnmt"]
    for name in names():
        assert sizes(name) == ["small", "full"]


@pytest.mark.parametrize("name", names())
def test_small_forward_loss_backward(name: str) -> None:
    z = get(name, batch_size=B)
    assert isinstance(z, ZooModel) and (z.name, z.size, z.factory) == (name, "small", "pdcompile.zoo:get")
    out = z.model(*z.example_inputs)
    assert tuple(out.shape) == SMALL_OUTPUT[name]
    loss = z.loss_fn(out, z.target)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    for pname, p in z.model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname
        assert p.grad.abs().sum() > 0, f"{pname} got an all-zero gradient"


@pytest.mark.parametrize("name", names())
def test_fx_trace_matches_eager(name: str) -> None:
    z = get(name, batch_size=B)
    gm = torch.fx.symbolic_trace(z.model)
    assert torch.equal(gm(*z.example_inputs), z.model(*z.example_inputs))
    for leaf in z.leaf_modules:  # the extra leaf classes appear whole in the graph
        assert any(
            n.op == "call_module" and isinstance(gm.get_submodule(str(n.target)), leaf) for n in gm.graph.nodes
        )


class _RecordValues(torch.fx.Interpreter):
    def __init__(self, gm: torch.fx.GraphModule):
        super().__init__(gm)
        self.values: dict[torch.fx.Node, Any] = {}

    def run_node(self, n: torch.fx.Node) -> Any:
        result = super().run_node(n)
        self.values[n] = result
        return result


@pytest.mark.parametrize("name", names())
def test_only_tensors_flow_between_layers(name: str) -> None:
    # The pipeline splitter can send only Tensors between stages: no value of the graph may be an
    # int (e.g. from x.size()), except tuples of Tensors (an LSTM's) unpacked at once by getitem.
    z = get(name, batch_size=B)
    gm = torch.fx.symbolic_trace(z.model)
    rec = _RecordValues(gm)
    rec.run(*z.example_inputs)
    for n, value in rec.values.items():
        if n.op == "output":
            continue
        if isinstance(value, tuple):
            assert all(isinstance(v, Tensor) for v in tree_leaves(value)), n.format_node()
            assert all(u.op == "call_function" and u.target is operator.getitem for u in n.users), n.format_node()
        else:
            assert isinstance(value, Tensor), f"{n.format_node()} produces {type(value).__name__}"


@pytest.mark.parametrize("name", names())
def test_samples_are_independent_of_their_batch(name: str) -> None:
    # What makes microbatching exact: a sample's output does not depend on the rest of its batch.
    z = get(name, batch_size=B)
    whole = z.model(*z.example_inputs)
    part = z.model(*(x[:1] for x in z.example_inputs))
    torch.testing.assert_close(part, whole[:1])


@pytest.mark.parametrize("name", names())
def test_get_is_deterministic(name: str) -> None:
    a, b = get(name, batch_size=B, seed=3), get(name, batch_size=B, seed=3)
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert _tensors_equal(a.example_inputs, b.example_inputs) and torch.equal(a.target, b.target)
    assert torch.equal(a.model(*a.example_inputs), b.model(*b.example_inputs))
    c = get(name, batch_size=B, seed=4)
    assert not all(torch.equal(p, q) for p, q in zip(a.model.parameters(), c.model.parameters()))


@pytest.mark.parametrize("name", names())
def test_make_batch(name: str) -> None:
    z = get(name, batch_size=B, seed=5)
    inputs, target = z.make_batch(5, B)
    assert _tensors_equal(inputs, z.example_inputs) and torch.equal(target, z.target)
    again = z.make_batch(11, 3)
    assert _tensors_equal(again, z.make_batch(11, 3))
    assert not _tensors_equal(again[0], z.make_batch(12, 3)[0])
    inputs3, target3 = again
    assert len(inputs3) == len(z.example_inputs)
    for x3, x in zip(inputs3, z.example_inputs):
        assert x3.shape == (3, *x.shape[1:]) and x3.dtype == x.dtype and x3.device == x.device
    assert target3.shape == (3, *z.target.shape[1:]) and target3.dtype == z.target.dtype
    assert tuple(z.model(*inputs3).shape) == (3, *SMALL_OUTPUT[name][1:])


@pytest.mark.parametrize("name", names())
def test_loss_rebuilds_from_class_path(name: str) -> None:
    z = get(name, batch_size=B)
    cls = type(z.loss_fn)
    rebuilt = getattr(importlib.import_module(cls.__module__), cls.__qualname__)()
    out = z.model(*z.example_inputs)
    assert torch.equal(rebuilt(out, z.target), z.loss_fn(out, z.target))


def test_sequence_cross_entropy_flattens() -> None:
    logits, target = torch.randn(2, 3, 5), torch.randint(5, (2, 3))
    expected = torch.nn.functional.cross_entropy(logits.reshape(6, 5), target.reshape(6))
    assert torch.equal(SequenceCrossEntropy()(logits, target), expected)
    smoothed = SequenceCrossEntropy(label_smoothing=0.1)(logits, target)
    assert not torch.equal(smoothed, expected)


def test_gpt_ties_embeddings_and_registers_buffers() -> None:
    z = get("gpt")
    model: Any = z.model
    assert model.lm_head.weight is model.wte.weight
    T = 8
    assert torch.equal(model.pos, torch.arange(T))
    for block in model.h:
        mask = block.attn.causal_mask
        assert mask.shape == (T, T) and mask.dtype == torch.bool
        assert torch.equal(mask, torch.ones(T, T, dtype=torch.bool).triu(1))
    # causality: changing a later token leaves the logits of earlier positions unchanged
    (idx,) = z.example_inputs
    changed = idx.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 64
    torch.testing.assert_close(model(changed)[:, :-1], model(idx)[:, :-1], rtol=0, atol=0)


def test_gnmt_keeps_lstms_whole() -> None:
    z = get("gnmt")
    assert z.leaf_modules == (torch.nn.LSTM,)
    gm = torch.fx.symbolic_trace(z.model)
    modules = dict(gm.named_modules())
    lstms = [n for n in gm.graph.nodes if n.op == "call_module" and isinstance(modules[n.target], torch.nn.LSTM)]
    assert len(lstms) == 3 + 3  # encoder: bidir, layer1, 1 residual; decoder: attn_rnn, layer1, 1 residual
    for n in lstms:
        assert [u.args[1] for u in n.users] == [0]


def test_resnet_small_has_no_running_state() -> None:
    # small uses GroupNorm so training-mode forwards are batch-independent and mutate nothing
    z = get("resnet")
    assert not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in z.model.modules())
    assert len(list(z.model.buffers())) == 0


class _RealAllocations(TorchDispatchMode):
    """Records the element count of every tensor an aten op returns off the meta device."""

    def __init__(self) -> None:
        super().__init__()
        self.numels: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and not t.is_meta:
                self.numels.append(t.numel())
        return out


@pytest.mark.parametrize("name", names())
def test_full_builds_on_meta(name: str) -> None:
    with _RealAllocations() as real:  # built on meta from the start: no full-size tensor ever made
        z = get(name, size="full", batch_size=2, device="meta")
    assert max(real.numels, default=0) < 1 << 20, f"{name} made a real tensor of {max(real.numels):,} elements"
    params = list(z.model.parameters())
    assert all(p.is_meta for p in params) and all(b.is_meta for b in z.model.buffers())
    assert all(x.is_meta for x in z.example_inputs) and z.target.is_meta
    lo, hi = FULL_PARAMS[name]
    count = sum(p.numel() for p in params)
    assert lo <= count <= hi, f"{name} full has {count:,} parameters"
    assert tuple(z.model(*z.example_inputs).shape) == FULL_OUTPUT[name]


def test_full_gpt_on_meta_is_gpt2_small() -> None:
    model: Any = get("gpt", size="full", device="meta").model
    assert model.lm_head.weight is model.wte.weight
    assert model.h[0].attn.causal_mask.shape == (1024, 1024)
    assert sum(p.numel() for p in model.parameters()) == 124_439_808


def test_errors_name_the_choices() -> None:
    with pytest.raises(UsageError, match="unknown zoo model 'bert'.*'gpt'"):
        get("bert")
    with pytest.raises(UsageError, match="no size 'huge'.*'full', 'small'"):
        get("gpt", size="huge")
    with pytest.raises(UsageError, match="batch_size"):
        get("mlp", batch_size=0)


def test_zoo_model_is_frozen() -> None:
    z = get("mlp")
    with pytest.raises(dataclasses.FrozenInstanceError):
        z.name = "other"  # type: ignore[misc]
