"""split-stages: the stages composed in order are the model (outputs and gradients)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pdcompile.errors import UnsupportedModelError
from pdcompile.passes.propagate_shapes import propagate_shapes
from pdcompile.passes.split_stages import even_assignment, legal_cuts, shared_storage_cuts, split_stages
from pdcompile.passes.trace import trace
from pdcompile.zoo import get, names

pytestmark = pytest.mark.timeout(120)


def _traced(name: str, batch: int = 4):  # noqa: ANN202
    z = get(name, batch_size=batch, seed=0)
    gm = trace(z.model, z.leaf_modules)
    propagate_shapes(gm, z.example_inputs)
    return z, gm


@pytest.mark.parametrize("name", names())
@pytest.mark.parametrize("num_stages", [2, 3, 5])
def test_stages_compose_to_the_model(name: str, num_stages: int) -> None:
    z, gm = _traced(name)
    split = split_stages(gm, even_assignment(gm, num_stages), z.model)
    assert len(split.stages) == num_stages
    want = z.model(*z.example_inputs)
    got = split.run(*z.example_inputs)
    assert torch.equal(got, want)
    # Same gradients: the stage modules share the model's parameters in this process.
    z.model.zero_grad()
    z.loss_fn(want, z.target).backward()
    ref = {n: p.grad.clone() for n, p in z.model.named_parameters()}
    z.model.zero_grad()
    z.loss_fn(split.run(*z.example_inputs), z.target).backward()
    for n, p in z.model.named_parameters():
        torch.testing.assert_close(p.grad, ref[n], rtol=1e-6, atol=1e-7, msg=n)
    # Interfaces chain: each stage's outputs are the next stage's inputs, with the same metadata.
    for a, b in zip(split.stages, split.stages[1:]):
        assert a.outputs == b.inputs and a.output_meta == b.input_meta


def test_skip_connections_pass_through_intermediate_stages() -> None:
    class Skip(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c, self.d = (nn.Linear(4, 4) for _ in range(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            return self.d(self.c(self.b(h)) + h)

    m = Skip()
    x = torch.randn(2, 4)
    gm = trace(m)
    propagate_shapes(gm, (x,))
    split = split_stages(gm, {"a": 0, "b": 1, "c": 2, "add": 3, "d": 3}, m)
    assert split.stages[1].inputs == ("a",) and split.stages[1].outputs == ("a", "b")
    assert split.stages[2].inputs == ("a", "b") and split.stages[2].outputs == ("a", "c")
    assert torch.equal(split.run(x), m(x))


def test_tied_parameters_are_recorded_across_stages() -> None:
    z, gm = _traced("gpt")
    split = split_stages(gm, even_assignment(gm, 3), z.model)
    assert len(split.tied) == 1
    (s0, n0), (s1, n1) = split.tied[0][0], split.tied[0][-1]
    assert s0 == 0 and s1 == 2
    assert split.stages[s0].param_names[n0] == split.stages[s1].param_names[n1] == "wte.weight"


def test_backward_edges_are_rejected() -> None:
    z, gm = _traced("mlp")
    a = even_assignment(gm, 2)
    first = next(iter(a))
    a[first] = 1
    with pytest.raises(UnsupportedModelError, match="contiguous"):
        split_stages(gm, a, z.model)


def test_non_tensor_values_may_not_cross_a_cut() -> None:
    class Sized(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            n = h.size(0)
            return self.b(h).reshape(n, -1)

    m = Sized()
    x = torch.randn(2, 4)
    gm = trace(m)
    propagate_shapes(gm, (x,))
    with pytest.raises(UnsupportedModelError, match="not a single tensor"):
        split_stages(gm, {"a": 0, "size": 0, "b": 1, "reshape": 1}, m)
    # legal cuts: before size (only a tensor is live); not before b or reshape (an int is live)
    assert legal_cuts(gm) == {1}
    split = split_stages(gm, even_assignment(gm, 2), m)
    assert torch.equal(split.run(x), m(x))


def test_what_cheap_ops_make_from_a_model_input_is_made_again_where_it_is_read() -> None:
    """``x.size(0)`` (an int) and ``x * 2`` read by a later stage: made there from the model input, which that
    stage reads from the data; nothing crosses the cut for them."""
    class Late(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.b(self.a(x)) + x * 2
            return h.reshape(x.size(0), -1)

    m = Late()
    x = torch.randn(2, 4)
    gm = trace(m)
    propagate_shapes(gm, (x,))
    split = split_stages(gm, {n.name: (0 if n.name == "a" else 1) for n in gm.graph.nodes
                              if n.op not in ("placeholder", "get_attr", "output")}, m)
    assert split.stages[0].outputs == ("a",) and split.stages[1].data_inputs == ("x",)
    assert torch.equal(split.run(x), m(x))


class WritesInPlace(nn.Module):
    """In-place writes on what a cut may make a stage's input: ``add_`` (Falcon's parallel residual is
    ``aten.add_``), ``nn.ReLU(inplace=True)``, ``F.hardtanh(inplace=True)`` and ``mul_`` through a view."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 3)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h.add_(1.0)
        h = self.relu(h)
        g = self.b(h)
        g.view(-1).narrow(0, 0, 3).mul_(2.0)
        return nn.functional.hardtanh(self.c(g), -0.5, 0.5, inplace=True)


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_a_stage_input_written_in_place_is_copied_first(frontend: str) -> None:
    """At every cut, run as the runtime runs stages (a received input is a leaf that requires grad): each
    stage's output and gradients equal the model's, and the tensor a stage received is left as it came.
    Without the copy, an in-place op on a received leaf raises in autograd."""
    from pdcompile.passes.trace import trace_any

    torch.manual_seed(0)
    m, x = WritesInPlace(), torch.randn(2, 4)
    gm = trace_any(m, (x,), frontend=frontend)
    propagate_shapes(gm, (x,))
    m.zero_grad()
    want = m(x)
    want.sum().backward()
    ref = {n: p.grad.clone() for n, p in m.named_parameters()}
    compute = [n for n in gm.graph.nodes if n.op not in ("placeholder", "get_attr", "output")]
    assert any(n.target in ("add_", torch.ops.aten.add_.Tensor) for n in compute)
    copied, legal = 0, legal_cuts(gm)
    for cut in range(1, len(compute)):
        assignment = {n.name: int(i >= cut) for i, n in enumerate(compute)}
        if compute[cut - 1].target in ("view", "narrow", torch.ops.aten.view.default, torch.ops.aten.narrow.default):
            # g and a view of it both cross this cut, and mul_ writes through the view after it: refused
            assert cut not in legal
            with pytest.raises(UnsupportedModelError, match="share one storage.*Fix: move the cut"):
                split_stages(gm, assignment, m)
            continue
        assert cut in legal
        split = split_stages(gm, assignment, m)
        m.zero_grad()
        sent = split.stages[0].gm(x)
        received = [t.detach().clone().requires_grad_(meta.requires_grad)
                    for t, meta in zip(sent, split.stages[1].input_meta)]
        kept = [t.detach().clone() for t in received]
        got = split.stages[1].gm(*received)
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"cut {cut}")
        got.sum().backward()
        torch.autograd.backward([t for t in sent if t.requires_grad],
                                [r.grad for r, t in zip(received, sent) if t.requires_grad])
        for n, p in m.named_parameters():
            torch.testing.assert_close(p.grad, ref[n], rtol=1e-6, atol=1e-7, msg=f"cut {cut}: {n}")
        for r, k in zip(received, kept):
            assert torch.equal(r.detach(), k), f"cut {cut}: stage 1 wrote its input"
        copied += "clone" in split.stages[1].gm.code
    assert copied >= 4  # the cuts before add_, relu, hardtanh and the view's mul_ copy their input


def test_an_exported_in_place_op_compiles() -> None:
    """annotate-costs runs an exported graph's ``aten.add_`` on a copy of its input, as it does ``x.add_``."""
    from pdcompile.api import pdcompile

    torch.manual_seed(0)
    pipe = pdcompile(WritesInPlace(), example_inputs=(torch.randn(4, 4),), example_target=torch.randint(0, 3, (4,)),
                     loss_fn=nn.CrossEntropyLoss(), stages=2, num_microbatches=2, frontend="export")
    assert len(pipe.split.stages) == 2


class Routed(nn.Module):
    """A MoE router's bookkeeping: tokens per expert counted from ``topk``'s integer indices (a float made
    from them needs no grad, and ``cumsum(dtype=int32)`` of one that required it raises)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        weights, experts = h.topk(2, dim=-1)  # two tensors of their own: no view of one another
        counts = torch.histc(experts.float(), bins=4, min=0, max=3)
        weights /= weights.sum(dim=-1, keepdim=True)  # in place, as Mixtral's router normalises
        return self.b(h) * counts.cumsum(0, dtype=torch.int32)[-1] + weights.sum(dim=-1, keepdim=True)


def test_values_made_from_integer_indices_need_no_grad() -> None:
    """At every cut a float made from ``topk``'s indices arrives as a tensor that requires no grad (the
    runtime sets ``requires_grad`` from the stage's input metadata), and the stages give the model's output;
    annotate-costs runs each node likewise (it compiles)."""
    from pdcompile.api import pdcompile
    from pdcompile.passes.trace import trace_any

    torch.manual_seed(0)
    m, x = Routed(), torch.randn(2, 4)
    gm = trace_any(m, (x,), frontend="export")
    propagate_shapes(gm, (x,))
    want = m(x)
    compute = [n for n in gm.graph.nodes if n.op not in ("placeholder", "get_attr", "output")]
    crossed = 0
    for cut in legal_cuts(gm):
        split = split_stages(gm, {n.name: int(i >= cut) for i, n in enumerate(compute)}, m)
        metas = dict(zip(split.stages[1].inputs, split.stages[1].input_meta))
        floats = [k for k in ("to", "histc") if k in metas]  # made from the indices, crossing this cut
        assert not any(metas[k].requires_grad for k in floats)
        crossed += bool(floats)
        received = [t.detach().requires_grad_(meta.requires_grad)
                    for t, meta in zip(split.stages[0].gm(x), split.stages[1].input_meta)]
        got = split.stages[1].gm(*received)
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"cut {cut}")
        got.sum().backward()
    assert crossed >= 2
    # topk's two outputs share no storage: writing one after a cut they both cross is a legal cut
    assert shared_storage_cuts(gm, [n.name for n in compute]) == set()
    assert {compute.index(n) for n in compute if n.name in ("to", "histc", "div_")} <= legal_cuts(gm)
    pdcompile(Routed(), example_inputs=(torch.randn(4, 4),), example_target=torch.randn(4, 4),
              loss_fn=nn.MSELoss(), stages=2, num_microbatches=2, frontend="export")
