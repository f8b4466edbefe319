"""Activation recomputation modes "selective" and "partial" (runtime/recompute.py).

In process: partial's head/tail split computes the stage's forward and gradients bitwise, at every K, on
the zoo models' emitted stages (the runtime's traced graph has the compiler's compute nodes), on a
one-stage GPT (its tied embedding and head in one stage) and on Hugging Face GPT-2's exported stages;
a changed graph is refused; selective caches exactly the FLOP-counted ops' outputs and replays dropout.
Through torchrun: training with selective and partial gives the weights of training without
recomputation (GPT with dropout, VGG; flush and 1F1B with weight stashing), the meter sees a rebuild
and keeps less per microbatch, and annotate-costs' selective bytes are what the meter measures.
"""

from __future__ import annotations

import json
import sys
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from pdcompile import zoo
from pdcompile.api import pdcompile
from pdcompile.runtime.memory import MemoryMeter, span_bytes
from pdcompile.runtime.program import Program
from pdcompile.runtime.recompute import (FlopOutputs, RecomputeError, StageRecompute, compute_nodes, flop_counted, kept,
                                         graph_signature, split_stage, stage_graph)
from pdcompile.zoo import gpt

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _emitted import launch_two  # noqa: E402

M, B = 4, 2
GPT_CFG = dict(vocab_size=128, seq_len=16, d_model=32, n_heads=2, n_layers=4)


class DropoutGPT(gpt.GPT):
    """The zoo GPT with dropout after the embeddings and after every block (the zoo's has none)."""

    def __init__(self, vocab_size: int = 128, seq_len: int = 16, d_model: int = 32, n_heads: int = 2,
                 n_layers: int = 4, p: float = 0.2) -> None:
        super().__init__(gpt.GPTConfig(vocab_size, seq_len, d_model, n_heads, n_layers))
        self.drop = nn.Dropout(p)

    def forward(self, idx: Tensor) -> Tensor:
        x = self.drop(self.wte(idx) + self.wpe(self.pos))
        for block in self.h:
            x = self.drop(block(x))
        return self.lm_head(self.ln_f(x))


def gpt_batches(batch_size: int, seed: int = 0) -> Any:
    """The emitted GPT program's data: seeded token batches."""
    cfg = gpt.GPTConfig(**GPT_CFG)
    i = 0
    while True:
        yield gpt.make_batch(cfg, torch.device("cpu"), seed + i, batch_size)
        i += 1


def _compile_zoo(name: str, tmp: Path, stages: int = 2) -> tuple[Any, Program, Any]:
    z = zoo.get(name, size="small", batch_size=M * B, seed=0)
    pipe = pdcompile(z.model, example_inputs=z.example_inputs, example_target=z.target, loss_fn=z.loss_fn,
                     stages=stages, schedule="flush", num_microbatches=M, leaf_modules=z.leaf_modules)
    return pipe, Program.load(pipe.emit(tmp / f"{name}_{stages}")), z


def _stage_inputs(prog: Program, x: tuple[Tensor, ...]) -> list[list[Tensor]]:
    """Each stage's inputs for one microbatch ``x`` (the previous stages run on it)."""
    out, values = [], list(x)
    for k, spec in enumerate(prog.stages):
        ins = [v.detach().clone().requires_grad_(s.requires_grad) for v, s in zip(values, spec.inputs)]
        out.append(ins)
        if k + 1 < prog.num_stages:
            with torch.no_grad():
                values = list(prog.build_stage(k)(*ins))
    return out


def _grads(out: Any, leaves: list[Tensor]) -> list[Tensor | None]:
    """Backward of a seeded weighting of ``out``'s tensors that need one; the gradients of ``leaves``."""
    outs = [o for o in (out if isinstance(out, (tuple, list)) else [out]) if o.requires_grad]
    g = torch.Generator().manual_seed(1)
    seeds = [torch.randn(o.shape, generator=g) for o in outs]
    torch.autograd.backward(outs, seeds)
    return [t.grad for t in leaves]


def _check_split(stage: nn.Module, inputs: list[Tensor], ks: list[int]) -> tuple[int, int]:
    """The partial split at each ``k`` of ``ks`` against the stage: outputs and every gradient bitwise,
    through StageRecompute (checkpointed head, parameters of a weight version); returns how many of the
    splits pass a head value to a tail node that is not the first one (a value used late), and at how
    many the backward reran the head (not where nothing in it needs a gradient)."""
    late = reran = 0
    names = [n for n, _ in stage.named_parameters()]

    def fresh() -> tuple[dict[str, Tensor], list[Tensor]]:
        params = {n: p.detach().clone().requires_grad_() for n, p in stage.named_parameters()}
        return params, [x.detach().clone().requires_grad_(x.requires_grad) for x in inputs]

    params, xs = fresh()
    want = torch.func.functional_call(stage, params, tuple(xs))
    want_grads = _grads(want, [*params.values(), *xs])
    sig = graph_signature(stage_graph(stage).graph)
    for k in ks:
        rc = StageRecompute.from_plan({"recompute": "partial", "recompute_nodes": k, "graph_signature": sig}, stage, 0)
        assert rc is not None and rc.split is not None
        params, xs = fresh()
        rebuilt = []
        out, kept = rc.forward(lambda p, *a: torch.func.functional_call(stage, p, a), params, xs,
                               lambda: rebuilt.append(k))
        got_grads = _grads(out, [*params.values(), *xs])
        assert rebuilt in ([], [k]) and kept == []  # the backward reran the head at most once
        reran += len(rebuilt)
        for w, g in zip(want if isinstance(want, tuple) else (want,), out if isinstance(out, tuple) else (out,)):
            assert torch.equal(w, g), k
        for n, w, g in zip([*names, *(f"input {i}" for i in range(len(xs)))], want_grads, got_grads):
            assert (w is None and g is None) or torch.equal(w, g), (k, n)  # type: ignore[arg-type]
        tail_nodes = compute_nodes(rc.split.tail.graph)
        first_users = {p for p in rc.split.tail.graph.nodes if p.op == "placeholder" and p.name.startswith("head_")
                       and any(u is not (tail_nodes[0] if tail_nodes else None) for u in p.users)}
        late += bool(first_users)
    return late, reran


@pytest.mark.parametrize("name", ["mlp", "vgg", "resnet", "gpt"])
def test_partial_split_equals_the_stage_bitwise_at_every_k(tmp_path: Path, name: str) -> None:
    pipe, prog, z = _compile_zoo(name, tmp_path)
    x = tuple(t[:B] for t in z.example_inputs)
    late = 0
    for k, ins in enumerate(_stage_inputs(prog, x)):
        stage = prog.build_stage(k)
        # the runtime's traced graph is the compiler's stage graph: same compute nodes, same signature
        compiled = pipe.state.stages.stages[k].gm.graph
        traced = stage_graph(stage).graph
        assert [(n.op, str(n.target)) for n in compute_nodes(traced)] == \
            [(n.op, str(n.target)) for n in compute_nodes(compiled)]
        assert graph_signature(traced) == graph_signature(compiled)
        n = len(compute_nodes(traced))
        used_late, reran = _check_split(stage, ins, list(range(1, n)))
        late += used_late
        assert reran >= n // 2, (k, reran, n)
    if name in ("resnet", "gpt"):  # residuals: some head value is read after the tail's first node
        assert late > 0


def test_partial_split_with_tied_weights_in_one_stage(tmp_path: Path) -> None:
    """One stage holds GPT's embedding and its tied LM head: the head/tail split of it, with a weight
    version's parameters, gives the tied parameter's gradient summed over both uses, bitwise."""
    pipe, prog, z = _compile_zoo("gpt", tmp_path, stages=1)
    stage = prog.build_stage(0)
    ties = [n for n, _ in stage.named_parameters(remove_duplicate=False)]
    assert len(ties) > len(list(stage.named_parameters()))  # a parameter under two names: tied in the stage
    x = [t[:B] for t in z.example_inputs]
    n = len(compute_nodes(stage_graph(stage).graph))
    assert _check_split(stage, x, [1, 2, n // 2, n - 2, n - 1])[1] == 5


def test_partial_split_on_an_exported_hugging_face_stage(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=16, use_cache=False,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                                  attn_implementation="eager")
    model = transformers.GPT2LMHeadModel(cfg)
    x = torch.randint(1, 100, (4, 8), generator=torch.Generator().manual_seed(0))
    target = torch.randint(0, 100, (4, 8), generator=torch.Generator().manual_seed(1))
    pipe = pdcompile(model, example_inputs=(x,), example_target=target, loss_fn=zoo.losses.SequenceCrossEntropy(),
                     stages=2, schedule="flush", num_microbatches=2, frontend="export")
    prog = Program.load(pipe.emit(tmp_path / "hf"))
    for k, ins in enumerate(_stage_inputs(prog, (x[:2],))):
        stage = prog.build_stage(k)
        traced = stage_graph(stage).graph
        assert graph_signature(traced) == graph_signature(pipe.state.stages.stages[k].gm.graph)
        n = len(compute_nodes(traced))
        assert _check_split(stage, ins, sorted({1, n // 3, n // 2, n - 1}))[1] >= 3


def test_a_changed_stage_or_a_bad_entry_is_refused(tmp_path: Path) -> None:
    _, prog, _ = _compile_zoo("mlp", tmp_path)
    stage = prog.build_stage(1)
    sig = graph_signature(stage_graph(stage).graph)
    other = graph_signature(stage_graph(prog.build_stage(0)).graph)
    assert sig != other and len(sig) == 16
    with pytest.raises(RecomputeError, match=r"stage 1: plan.json's graph_signature .* compile the program again"):
        StageRecompute.from_plan({"recompute": "partial", "recompute_nodes": 1, "graph_signature": other}, stage, 1)
    with pytest.raises(RecomputeError, match="stage 1: recompute 'partial' needs 'recompute_nodes'"):
        StageRecompute.from_plan({"recompute": "partial", "graph_signature": sig}, stage, 1)
    n = len(compute_nodes(stage_graph(stage).graph))
    with pytest.raises(RecomputeError, match=f"recompute_nodes must be in 1..{n - 1}"):
        StageRecompute.from_plan({"recompute": "partial", "recompute_nodes": n, "graph_signature": sig}, stage, 1)
    with pytest.raises(RecomputeError, match="stage 1: plan.json says recompute 'some'"):
        StageRecompute.from_plan({"recompute": "some"}, stage, 1)
    assert StageRecompute.from_plan({}, stage, 1) is None
    assert StageRecompute.from_plan({"recompute": "none"}, stage, 1) is None
    with pytest.raises(RecomputeError):
        split_stage(stage, 0)


def test_selective_caches_the_flop_counted_outputs_and_replays_dropout() -> None:
    aten = torch.ops.aten
    assert all(flop_counted(op) for op in (aten.mm.default, aten.addmm.default, aten.bmm.default,
                                            aten.convolution.default,
                                            aten._scaled_dot_product_flash_attention.default))
    assert not any(flop_counted(op) for op in (aten.relu.default, aten._softmax.default, aten.native_dropout.default,
                                                aten.native_layer_norm.default, aten.view.default, aten.gelu.default))
    torch.manual_seed(0)
    model = DropoutGPT(n_layers=2)
    x = torch.randint(0, 128, (B, 16), generator=torch.Generator().manual_seed(0))
    rc = StageRecompute.from_plan({"recompute": "selective"}, model, 0)
    assert rc is not None

    def run(p: dict[str, Tensor] | None, *a: Tensor) -> Tensor:
        return model(*a) if p is None else torch.func.functional_call(model, p, a)

    assert all(kept(op) for op in (aten.mm.default, aten.addmm.default, aten.convolution.default))
    assert not any(kept(op) for op in (aten.bmm.default, aten.baddbmm.default, aten.relu.default,
                                        aten._scaled_dot_product_flash_attention.default))
    # independent count: the weight-multiplying ops of one plain forward (addmm/mm for the linears; core
    # attention's bmm rebuilt)
    with FlopOutputs() as rec, torch.no_grad():
        model(x)
    ops: list[Tensor] = rec.outputs
    params = {n: p.detach().clone().requires_grad_() for n, p in model.named_parameters()}
    torch.manual_seed(5)
    want = torch.func.functional_call(model, params, (x,))
    want_grads = _grads(want, list(params.values()))
    params = {n: p.detach().clone().requires_grad_() for n, p in model.named_parameters()}
    torch.manual_seed(5)
    rebuilt: list[int] = []
    out, cache = rc.forward(run, params, [x], lambda: rebuilt.append(1))
    assert len(cache) == len(ops) == 2 * 4 + 1  # per block 4 linears (qkv, out, mlp up, down); + the LM head
    assert sorted(t.shape for t in cache) == sorted(t.shape for t in ops)
    got_grads = _grads(out, list(params.values()))
    assert rebuilt == [1]
    assert torch.equal(want, out)  # the same dropout masks in the forward...
    for w, g in zip(want_grads, got_grads):
        assert torch.equal(w, g)  # type: ignore[arg-type]  # ... and in the rebuild (else gradients differ)
    # what the meter charges: the cache, far less than what autograd saves without recomputation
    meter = MemoryMeter(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with meter.saving(0, params.values()):
        out, cache = rc.forward(run, params, [x], lambda: None)
    meter.add(0, [*cache, x])
    with meter.saving(1, params.values()):
        run(params, x)
    assert sum(span_bytes([meter.activations[0]]).values()) == sum(t.untyped_storage().nbytes() for t in [*cache, x])
    assert sum(span_bytes([meter.activations[0]]).values()) < 0.7 * sum(span_bytes([meter.activations[1]]).values())


# -- through torchrun ----------------------------------------------------------------------------


def _emit_gpt(tmp: Path) -> tuple[Any, Path]:
    torch.manual_seed(0)
    (x,), y = gpt.make_batch(gpt.GPTConfig(**GPT_CFG), torch.device("cpu"), 0, M * B)
    pipe = pdcompile(DropoutGPT(**GPT_CFG), example_inputs=(x,), example_target=y, loss_fn=gpt.SequenceCrossEntropy(),
                     optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), stages=2, schedule="flush",
                     num_microbatches=M)
    return pipe, pipe.emit(tmp / "gpt", data={"factory": "tests.test_recompute_modes:gpt_batches", "kwargs": {}})


def _emit_vgg(tmp: Path) -> tuple[Any, Path]:
    z = zoo.get("vgg", size="small", batch_size=M * B, seed=0)
    pipe = pdcompile(z.model, example_inputs=z.example_inputs, example_target=z.target, loss_fn=z.loss_fn,
                     optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), stages=2, schedule="flush",
                     num_microbatches=M, leaf_modules=z.leaf_modules)
    return pipe, pipe.emit(tmp / "vgg", data={"factory": "pdcompile.zoo:batches", "kwargs": {"name": "vgg"}})


def with_recompute(prog: Path, modes: dict[int, str], tag: str, head: float = 0.5) -> tuple[Path, dict[int, int]]:
    """A copy of the emitted program whose plan.json recomputes stage k as ``modes[k]``, a partial
    stage its first ``head`` share of compute nodes, at most all but one (the entries the planner will
    write); and each K."""
    dst = prog.parent / f"{prog.name}_{tag}"
    shutil.copytree(prog, dst)
    program = Program.load(prog)
    raw = json.loads((dst / "plan.json").read_text())
    ks = {}
    for k, mode in modes.items():
        entry = raw["plan"]["stages"][k]
        entry["recompute"] = mode
        if mode == "partial":
            graph = stage_graph(program.build_stage(k)).graph
            n = len(compute_nodes(graph))
            ks[k] = entry["recompute_nodes"] = min(n - 1, max(1, int(n * head)))
            entry["graph_signature"] = graph_signature(graph)
    (dst / "plan.json").write_text(json.dumps(raw))
    return dst, ks


def _same_training(base: tuple[dict[int, Any], dict[int, Any]], run: tuple[dict[int, Any], dict[int, Any]],
                   what: str) -> None:
    (m0, w0), (m1, w1) = base, run
    assert m1[1]["losses"] == pytest.approx(m0[1]["losses"], abs=1e-6), what
    for k in w0:
        for n in w0[k]:
            torch.testing.assert_close(w1[k][n], w0[k][n], rtol=0, atol=1e-6, msg=lambda s: f"{what} {k}.{n}: {s}")


def _per_microbatch(memory: dict[str, int]) -> float:
    return float(memory["microbatch"])  # the most one microbatch in flight held


def _run_modes(tmp: Path, pipe: Any, prog: Path, schedules: dict[str, list[dict[int, str]]],
               head: float = 0.5) -> dict[Any, Any]:
    runs: dict[Any, Any] = {}
    for schedule, variants in schedules.items():
        base = runs[("none", schedule)] = launch_two(tmp, prog, schedule, f"none_{schedule}")
        for modes in variants:
            tag = "_".join(modes[k] for k in sorted(modes))
            variant, ks = with_recompute(prog, modes, f"{tag}_{schedule}", head)
            run = runs[(tag, schedule)] = launch_two(tmp, variant, schedule, f"{tag}_{schedule}")
            _same_training(base, run, f"{tag} under {schedule}")
            for s, mode in modes.items():
                mem, mem0 = run[0][s]["memory"], base[0][s]["memory"]
                assert mem["rebuilt"] > 0, (tag, schedule, s, mem)  # a backward rebuilds activations...
                assert mem["recompute"] > 0 or mem["in_flight"] == 0, (tag, schedule, s, mem)  # ...at the peak
                assert _per_microbatch(mem) < _per_microbatch(mem0), (tag, schedule, s, mem, mem0)
            runs[(tag, schedule, "k")] = ks
    return runs


@pytest.mark.multiproc
@pytest.mark.timeout(400)
def test_gpt_with_dropout_trains_the_same_with_selective_and_partial(tmp_path: Path) -> None:
    pipe, prog = _emit_gpt(tmp_path)
    both = [{0: "selective", 1: "partial"}, {0: "partial", 1: "selective"}]
    # flush only: 1F1B's weight stashing with both modes is test_vgg_trains_the_same_with_selective_and_partial's
    runs = _run_modes(tmp_path, pipe, prog, {"flush": both})
    # the planner's model of stage 0 (annotate-costs' fields summed over its layers) against the meter
    names = set(pipe.state.stages.stages[0].nodes)
    layers = [l for l in pipe.state.chain.layers if l.name in names]
    spec = Program.load(prog).stages[0]
    boundary = sum(4 * torch.Size(t.shape).numel() for t in spec.outputs) + \
        sum(8 * torch.Size(t.shape).numel() for t in spec.inputs)  # float32 outputs, int64 token inputs
    mem = runs[("selective_partial", "flush")][0][0]["memory"]
    kept = sum(l.selective_saved_bytes for l in layers) + boundary
    rebuilt = sum(l.selective_rebuilt_bytes for l in layers)
    assert kept == pytest.approx(_per_microbatch(mem), rel=0.10), (kept, mem)
    assert rebuilt == pytest.approx(mem["rebuilt"], rel=0.10), (rebuilt, mem)
    # partial: the tail's saved bytes (+ boundary) per microbatch, the head's rebuilt
    k = runs[("partial_selective", "flush", "k")][0]
    compiled = compute_nodes(pipe.state.stages.stages[0].gm.graph)
    by_name = {l.name: l for l in layers}
    head = [by_name[n.name] for n in compiled[:k] if n.name in by_name]
    tail = [by_name[n.name] for n in compiled[k:] if n.name in by_name]
    mem = runs[("partial_selective", "flush")][0][0]["memory"]
    assert sum(l.saved_bytes for l in head) == pytest.approx(mem["rebuilt"], rel=0.10), mem
    assert sum(l.saved_bytes for l in tail) + boundary == pytest.approx(_per_microbatch(mem), rel=0.10), mem


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_vgg_trains_the_same_with_selective_and_partial(tmp_path: Path) -> None:
    pipe, prog = _emit_vgg(tmp_path)
    # no flush run here: the GPT test above runs selective and partial on each stage under flush
    _run_modes(tmp_path, pipe, prog, {"1f1b": [{0: "partial", 1: "selective"}, {0: "selective", 1: "partial"}]},
               head=1.0)  # VGG's first stage: conv relu conv relu pool, a head the tail reads all of but its end


def test_selective_fields_travel_from_annotate_costs_to_the_chain(tmp_path: Path) -> None:
    """NodeCost -> ProfileLayer -> the profile file (optional keys) -> ChainLayer; absent in imported profiles."""
    from pdcompile import profile as profile_mod
    from pdcompile.passes.linearize import linearize

    pipe, _, _ = _compile_zoo("gpt", tmp_path)
    prof = pipe.state.profile
    linear = next(l for l in prof.layers if l.op == "Linear")
    gelu = next(l for l in prof.layers if l.op == "GELU")
    assert linear.selective_saved_bytes == linear.output_bytes and linear.selective_recompute_s == 0.0
    assert gelu.selective_saved_bytes == 0.0 and gelu.selective_recompute_s == gelu.forward_s
    assert gelu.saved_bytes and gelu.selective_rebuilt_bytes == 0.0  # what GELU saves, a Linear's output, is cached
    norm = next(l for l in prof.layers if l.op == "LayerNorm" and l.name != "wte")
    assert norm.saved_bytes and norm.selective_rebuilt_bytes == norm.saved_bytes  # a residual sum, its statistics
    again = profile_mod.from_json(json.loads(json.dumps(profile_mod.to_json(prof))))
    assert [l.selective_saved_bytes for l in again.layers] == [l.selective_saved_bytes for l in prof.layers]
    chain = linearize(again)
    by = {l.name: l for l in chain.layers}
    assert all(by[l.name].selective_rebuilt_bytes == l.selective_rebuilt_bytes for l in prof.layers)
    half = prof.at_batch_size(prof.batch_size * 2)
    assert half.layer(linear.name).selective_saved_bytes == 2 * linear.selective_saved_bytes
    imported = profile_mod.load("pipedream:vgg16")
    assert imported.layers[0].selective_saved_bytes is None
    assert "selective_saved_bytes" not in profile_mod.to_json(imported)["layers"][0]


@pytest.mark.parametrize("mode", ["full", "selective", "partial"])
def test_a_rebuild_leaves_batchnorm_running_statistics_as_the_forward_left_them(mode: str) -> None:
    """A backward's rebuild runs the forward again, which would update BatchNorm's running statistics
    (and its batch count) a second time: after forward and backward of two microbatches the buffers
    equal those of the same steps without recomputation, as do the outputs and gradients."""
    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                             nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())

    xs = [torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
    plain, recomputed = make(), make()
    entry: dict[str, Any] = {"recompute": mode}
    if mode == "partial":
        g = stage_graph(recomputed).graph
        entry.update(recompute_nodes=3, graph_signature=graph_signature(g))
    rc = StageRecompute.from_plan(entry, recomputed, 0)
    assert rc is not None

    def run(module: nn.Module) -> Any:
        return lambda p, *a: module(*a) if p is None else torch.func.functional_call(module, p, a)

    rebuilt: list[int] = []
    for x in xs:
        want = plain(x)
        want.sum().backward()
        got, _ = rc.forward(run(recomputed), None, [x], lambda: rebuilt.append(1))
        got.sum().backward()
        assert torch.equal(want, got)
    assert rebuilt == [1, 1]
    for (n, a), (_, b) in zip(plain.named_buffers(), recomputed.named_buffers()):
        assert torch.equal(a, b), n
    for (n, a), (_, b) in zip(plain.named_parameters(), recomputed.named_parameters()):
        assert a.grad is not None and torch.equal(a.grad, b.grad), n  # type: ignore[arg-type]
