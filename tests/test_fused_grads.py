"""Fused weight-gradient accumulation (runtime/fused_grads.py, ``train.py --grad-accumulation``).

A linear's or an embedding's weight gradient is added straight into ``.grad`` in its backward. Checked
against plain autograd in one process (the same stage modules, and plain ``nn.Linear``/``nn.Embedding``):
the gradients of several microbatches are equal within 1e-6 for emitted torch.fx and torch.export stage
code; what it does not cover (autocast, embedding options, a split backward's ``autograd.grad``, FSDP2,
small weights under ``auto``) runs plain; tied uses, stashed versions (through the real weight store)
and recomputation accumulate correctly; the second microbatch's backward makes no weight-sized tensor
(it does without fusion); and one 2-rank run that mixes fused and split backwards trains as the
single-process reference does.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.utils.checkpoint
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from pdcompile import reference
from pdcompile.api import pdcompile
from pdcompile.runtime import fused_grads
from pdcompile.runtime.program import Program
from pdcompile.runtime.schedules import Action, Kind
from pdcompile.runtime.weights import VersionedStore
from pdcompile.zoo import get
from pdcompile.zoo.losses import SequenceCrossEntropy
from _emitted import stages_and_microbatches
from _hf_llama import llama_config
from _ranks import run_ranks

# one worker for the file (tests/conftest.py): ``programs`` is compiled once
pytestmark = [pytest.mark.timeout(240), pytest.mark.xdist_group("fused_grads")]

MICRO, BATCH, STEPS, LR = 2, 8, 3, 0.05


def _opt(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


@pytest.fixture(scope="module")
def programs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The zoo GPT through torch.fx (nn.Linear / nn.Embedding calls) and a small HF Llama through
    torch.export (aten.linear / aten.embedding on the stage's parameters), each in 2 stages."""
    transformers = pytest.importorskip("transformers")
    z = get("gpt", batch_size=BATCH, seed=0)
    fx = pdcompile(z.model, example_inputs=z.example_inputs, example_target=z.target, loss_fn=z.loss_fn,
                   optimizer=_opt, stages=2, schedule="flush", num_microbatches=MICRO, leaf_modules=z.leaf_modules,
                   cost_mode="analytic")
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(llama_config(100, tie_word_embeddings=False))
    x, t = torch.randint(0, 100, (4, 8)), torch.randint(0, 100, (4, 8))
    ex = pdcompile(llama, example_inputs=(x,), example_target=t, loss_fn=SequenceCrossEntropy(), optimizer=_opt,
                   stages=2, schedule="flush", num_microbatches=MICRO, cost_mode="analytic")
    root = tmp_path_factory.mktemp("fused")
    return {"fx": fx.emit(root / "fx", data={"factory": "pdcompile.zoo:batches", "kwargs": {"name": "gpt"}}),
            "export": ex.emit(root / "export")}


def _inputs(spec: Any, k: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(10 + k)
    return [torch.randint(1, 60, t.shape, generator=g) if not t.dtype.is_floating_point
            else torch.randn(t.shape, generator=g, dtype=t.dtype) for t in spec.inputs]


def _backward(module: nn.Module, inputs: list[torch.Tensor], k: int) -> None:
    """One microbatch: the outputs' weighted sum, seeded per microbatch, backpropagated."""
    outs = module(*inputs)
    outs = outs if isinstance(outs, (tuple, list)) else (outs,)
    g = torch.Generator().manual_seed(100 + k)
    sum((o * torch.randn(o.shape, generator=g)).sum() for o in outs if o.is_floating_point()).backward()


def _close(got: torch.Tensor | None, want: torch.Tensor | None, what: str) -> None:
    assert got is not None and want is not None, what
    err = float((got - want).abs().max())
    assert err <= 1e-6 * max(1.0, float(want.abs().max())), f"{what}: {err}"


@pytest.mark.parametrize("front", ["fx", "export"])
def test_emitted_stages_accumulate_as_autograd_does(programs: dict[str, Path], front: str) -> None:
    """Every linear and embedding weight of both stages fused (mode ``fused``); after 3 microbatches
    each gradient equals plain autograd's on the same stage code within 1e-6."""
    program = Program.load(programs[front])
    for k in range(program.num_stages):
        plain, fused = program.build_stage(k), program.build_stage(k)
        fg = fused_grads.install(fused, "fused")
        assert fg is not None
        for mb in range(3):
            ins = _inputs(program.stages[k], mb)
            _backward(plain, ins, mb)
            _backward(fused, [t.clone() for t in ins], mb)
        src = (program.folder / program.stages[k].module).read_text()
        calls = {"linear": src.count("torch.nn.Linear(") + src.count("aten.linear.default("),
                 "embedding": src.count("torch.nn.Embedding(") + src.count("aten.embedding.default(")}
        assert fg.counts == {kind: 3 * n for kind, n in calls.items()} and calls["linear"], (front, k, fg.counts, calls)
        for (name, p), q in zip(plain.named_parameters(), fused.parameters()):
            _close(q.grad, p.grad, f"{front} stage {k} {name}")


class Both(nn.Module):
    """An embedding and linears written both ways a stage writes them (module calls and aten ops)."""

    def __init__(self, vocab: int = 64, d: int = 16, tied: bool = False, **emb: Any) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d, **emb)
        self.lin = nn.Linear(d, d)
        self.head = self.emb.weight if tied else nn.Parameter(torch.randn(vocab, d) * 0.1)
        self.table = nn.Parameter(torch.randn(vocab, d) * 0.1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.lin(self.emb(ids)))
        logits = torch.ops.aten.linear.default(h, self.head)
        return logits.logsumexp(-1) + torch.ops.aten.embedding.default(self.table, ids).sum(-1)


def _ids(k: int, vocab: int = 64) -> torch.Tensor:
    return torch.randint(0, vocab, (4, 8), generator=torch.Generator().manual_seed(k))


def _pair(make: Callable[[], nn.Module], mode: str = "fused") -> tuple[nn.Module, nn.Module, Any]:
    torch.manual_seed(0)
    plain = make()
    fused = copy.deepcopy(plain)
    return plain, fused, fused_grads.install(fused, mode)


def _train(plain: nn.Module, fused: nn.Module, mbs: int = 3, ctx: Callable[[], Any] = torch.enable_grad) -> None:
    for k in range(mbs):
        with ctx():
            lp, lf = plain(_ids(k)).sum(), fused(_ids(k)).sum()
        lp.backward()
        lf.backward()


def _same_grads(plain: nn.Module, fused: nn.Module) -> None:
    for (name, p), q in zip(plain.named_parameters(), fused.parameters()):
        _close(q.grad, p.grad, name)


def test_padding_idx_and_a_weight_tied_within_the_stage() -> None:
    """padding_idx's row gets no gradient; one parameter read by the embedding and the head (tied
    in one stage) gets both uses' gradients summed."""
    plain, fused, fg = _pair(lambda: Both(tied=True, padding_idx=5))
    _train(plain, fused)
    assert fg.counts == {"linear": 6, "embedding": 6}
    _same_grads(plain, fused)
    assert fused.emb.weight.grad is not None and fused.emb.weight is fused.head


@pytest.mark.parametrize("emb", [{"max_norm": 1.0}, {"scale_grad_by_freq": True}])
def test_embedding_options_it_does_not_fuse_run_plain(emb: dict[str, Any]) -> None:
    plain, fused, fg = _pair(lambda: Both(**emb))
    _train(plain, fused)
    assert fg.counts == {"linear": 6, "embedding": 3}  # the aten table still fused; nn.Embedding(**emb) not
    _same_grads(plain, fused)


def test_under_bf16_autocast_linears_run_plain() -> None:
    """Autocast makes a linear's weight gradient in bf16: the fused one would round otherwise, so
    linears run plain (bitwise autograd's); embeddings stay fp32 under autocast and are fused."""
    plain, fused, fg = _pair(Both)
    _train(plain, fused, ctx=lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    assert fg.counts == {"linear": 0, "embedding": 6}
    assert torch.equal(fused.head.grad, plain.head.grad) and torch.equal(fused.lin.weight.grad, plain.lin.weight.grad)
    _same_grads(plain, fused)


def test_where_it_must_not_write_grad_it_stays_out() -> None:
    """A backward split through the traced graph (the executor sets ``active`` False): ``autograd.grad``
    gets every gradient and ``.grad`` stays empty. No grad mode: nothing fused. ``autograd``, a stage
    sharded ``full`` (FSDP2's hooks) and, under ``auto``, a stage of small weights: not installed."""
    plain, fused, fg = _pair(Both)
    fg.active = False
    want = torch.autograd.grad(plain(_ids(0)).sum(), list(plain.parameters()))
    got = torch.autograd.grad(fused(_ids(0)).sum(), list(fused.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and all(p.grad is None for p in fused.parameters())
    fg.active = True
    with torch.no_grad():
        fused(_ids(0))
    assert fg.counts == {"linear": 0, "embedding": 0}
    assert fused_grads.install(Both(), "autograd") is None and fused_grads.install(Both(), "fused", sharded=True) is None
    assert fused_grads.install(Both(), "auto") is None  # 4 KiB weights: the transient is no matter


def test_a_split_backward_by_submodules_adds_the_fused_gradients_in_w() -> None:
    """Through the submodules' weight pass (runtime/weight_grads.py), as flush's split drain runs it:
    microbatch 0 unsplit, microbatch 1 split. B writes no fused gradient (it records the linears'
    on its path), W adds them and the rest once, though W and its first check walk the graph again."""
    from pdcompile.runtime.weight_grads import WeightPass

    plain, fused, fg = _pair(Both)
    plain(_ids(0)).sum().backward()
    fused(_ids(0)).sum().backward()
    before = {n: p.grad.clone() for n, p in fused.named_parameters()}
    wp = WeightPass(fused)
    deferred = fg.defer()
    handles, notes = wp.capture()
    loss = fused(_ids(1)).sum()
    for h in handles:
        h.remove()
    _, work = wp.input_grads([loss], None, [], notes)
    assert len(deferred.items) == 2  # lin and head: on B's path to the submodules' outputs
    assert all(torch.equal(p.grad, before[n]) for n, p in fused.named_parameters()), "B added a weight gradient"
    fg.weight_pass(deferred)
    wp.weight_grads(work)
    assert wp.trusted is True
    plain(_ids(1)).sum().backward()
    assert fg.counts == {"linear": 4, "embedding": 4}
    _same_grads(plain, fused)


def test_recomputation_reruns_the_fused_forward() -> None:
    plain, fused, fg = _pair(Both)
    for k in range(3):
        plain(_ids(k)).sum().backward()
        torch.utils.checkpoint.checkpoint(fused, _ids(k), use_reentrant=False).sum().backward()
    assert fg.counts["linear"] == 12  # 3 forwards + 3 reruns, two linears each
    _same_grads(plain, fused)


def test_a_stashed_version_accumulates_into_the_live_gradient() -> None:
    """Through the weight store: microbatch 1's forward runs on a clone (an ST comes before its B); its
    fused backward adds into the live parameters' .grad, as the store adds a clone's gradient."""
    plain, fused, fg = _pair(Both)
    store = VersionedStore(fused)
    acts = [Action(0, Kind.FORWARD, 0), Action(0, Kind.FORWARD, 1), Action(0, Kind.BACKWARD, 0),
            Action(0, Kind.STEP), Action(0, Kind.BACKWARD, 1)]
    store.expect(acts)
    assert store.params_for_forward(0) is None
    clone = store.params_for_forward(1)
    assert clone is not None
    out0 = fused(_ids(0)).sum()
    out1 = torch.func.functional_call(fused, clone, (_ids(1),)).sum()
    out0.backward()
    store.after_backward(0)
    store.before_step()
    with torch.no_grad():
        for p in fused.parameters():
            p.sub_(0.1 * p.grad)
            p.grad = None
    store.after_step()
    out1.backward()
    assert [n for n, t in clone.items() if t.grad is not None] == ["lin.bias"], "a fused gradient left on the clone"
    store.after_backward(1)
    plain(_ids(1)).sum().backward()  # the clone's values: the weights before the step
    assert fg.counts == {"linear": 4, "embedding": 4}
    _same_grads(plain, fused)


class _Allocations(TorchDispatchMode):
    """The largest tensor an op makes (not an in-place result: a new storage) while active."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        ins = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs))
               if isinstance(t, torch.Tensor)}
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in ins:
                self.largest = max(self.largest, t.untyped_storage().nbytes())
        return out


@pytest.mark.parametrize("mode", ["auto", "autograd"])
def test_the_second_backward_makes_no_weight_sized_gradient(mode: str) -> None:
    """4 MiB weights (``auto`` fuses them): the largest tensor made in the second microbatch's
    backward is an activation's gradient (under a quarter of a weight), not a weight's; with
    autograd it is a whole weight's."""
    vocab, d = 4096, 256
    torch.manual_seed(0)
    model = Both(vocab, d)
    fg = fused_grads.install(model, mode)
    assert (fg is not None) == (mode == "auto")
    weight = vocab * d * 4
    model(_ids(0, vocab)).sum().backward()
    loss = model(_ids(1, vocab)).sum()
    rec = _Allocations()
    with rec:
        loss.backward()
    if mode == "auto":
        assert fg is not None and fg.counts == {"linear": 2, "embedding": 4}  # the 256 x 256 linear: plain
        assert rec.largest < weight // 4, rec.largest
    else:
        assert rec.largest >= weight, rec.largest


def test_two_ranks_with_fused_and_split_backwards_train_as_the_reference(programs: dict[str, Path],
                                                                         tmp_path: Path) -> None:
    """GPT in 2 stages, flush with the drain's backward split (``--split-backward``: stage 1's last
    backward of each step is B then W, by submodules), every linear and embedding fused, in split
    backwards too: 3 steps equal single-process training within 1e-6."""
    prog = programs["fx"]
    rc, log = run_ranks(prog, 2, ["--schedule", "flush", "--split-backward", "--grad-accumulation", "fused",
                                  "--steps", str(STEPS), "--save-final", str(tmp_path / "final"), "--metrics",
                                  str(tmp_path / "metrics"), "--timeout", "60"], timeout=150)
    assert rc == 0, log[-4000:]
    metrics = {int(p.stem.split("_")[1]): json.loads(p.read_text()) for p in (tmp_path / "metrics").glob("rank_*.json")}
    program = Program.load(prog)
    for rank in (0, 1):  # every call of every microbatch, the split ones too
        src = (prog / program.stages[rank].module).read_text()
        want = {"linear": src.count("torch.nn.Linear("), "embedding": src.count("torch.nn.Embedding(")}
        assert metrics[rank]["fused_grads"] == {k: n * MICRO * STEPS for k, n in want.items()}, metrics[rank]
    assert metrics[1]["split_backwards"]["submodules"] == STEPS
    program, stages, optimizers, micro = stages_and_microbatches(prog, "gpt", STEPS, MICRO)
    tied = [[(s, n) for s, n in grp] for grp in program.raw.get("tied", [])]
    fwd, bwd, group = reference.synchronous(MICRO)
    reference.train_versioned(stages, optimizers, program.build_loss(), micro, fwd=fwd, bwd=bwd, group=group,
                              scale=1.0 / MICRO, tied=tied)
    for rank in (0, 1):
        got = torch.load(tmp_path / "final" / f"stage_{rank}.rank_{rank}.pt", weights_only=True)
        initial = dict(program.build_stage(rank).named_parameters())
        for name, w in stages[rank].named_parameters():
            torch.testing.assert_close(got[name], w.detach(), rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
        assert any(not torch.equal(w, initial[n]) for n, w in stages[rank].named_parameters())
