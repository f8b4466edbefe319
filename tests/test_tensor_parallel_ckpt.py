"""Checkpoints, ``init_from`` and ``merge`` of tensor-parallel stages (runtime/tensor_parallel.py's
layouts, runtime/checkpoint.py): a checkpoint written with t = 2 holds the model's own tensors under its
names (fused q, k, v rows in the model's order; Adam's state split like its weights), so it resumes under
another t, another degree per stage (``tensor_parallel=[2, 1]`` to ``[1, 2]``), t = 1, another stage or replica
count (the replicas sharding the optimizer, ZeRO-1), and a t = 1 checkpoint resumes under t = 2; every run is
checked against one uninterrupted single-process run (``reference.train_sync``), fp32, gloo."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from _hf_llama import token_batches
from _ranks import run_ranks
from pdcompile import api, reference
from pdcompile.cli import main
from pdcompile.merge import checkpoint_source, merge_weights
from pdcompile.runtime import checkpoint
from pdcompile.runtime.data import save_batches
from pdcompile.zoo import gpt
from pdcompile.zoo.losses import SequenceCrossEntropy

CFG = gpt.CONFIGS["small"]  # 2 layers, 2 heads, d=32 (c_attn: q, k, v fused), T=8, vocabulary 64
MICRO, BATCH, STEPS = 2, 4, 6

pytestmark = pytest.mark.xdist_group("tensor_parallel")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return gpt.GPT(CFG)


def _opt(params: Any) -> torch.optim.Optimizer:
    # Adam: its state is split like the weights. eps well above rounding: a key projection's bias has a zero
    # gradient (softmax ignores a shift of every score), whose rounding noise a tiny eps would turn into steps
    return torch.optim.Adam(params, lr=1e-3, eps=1e-4)


Degrees = int | tuple[int, ...]  # one t for every stage, or one per stage


@functools.lru_cache(maxsize=None)
def _compiled(stages: int, t: Degrees, replicas: int = 1, shard: str = "none") -> Any:
    (x,), target = token_batches(CFG.vocab_size, 1, BATCH, CFG.seq_len)[0]
    kw: dict[str, Any] = {"tensor_parallel": list(t)} if isinstance(t, tuple) else {"tensor_parallel": t} if t > 1 else {}
    if replicas > 1:
        kw.update(replicas=[replicas] * stages, shard=shard)
    return api.pdcompile(_model(), example_inputs=(x,), example_target=target, loss_fn=SequenceCrossEntropy(),
                         optimizer=_opt, stages=stages, schedule="flush", num_microbatches=MICRO, **kw)


def _reference(data: list[Any]) -> tuple[list[dict[str, torch.Tensor]], list[dict[str, torch.Tensor]]]:
    """The whole model trained in one process: its state dict and Adam's state (``optim/NAME/KEY``) after
    each of 1..STEPS minibatches."""
    model = _model()
    opt = _opt(model.parameters())
    names = {id(p): n for n, p in model.named_parameters()}
    weights, states = [], []
    for k in range(STEPS):
        reference.train_sync(model, SequenceCrossEntropy(), opt, data[k:k + 1], steps=1, num_microbatches=MICRO)
        weights.append({n: p.detach().clone() for n, p in model.named_parameters()})
        states.append({checkpoint.optim_key(names[id(p)], key): v.clone() for p, st in opt.state.items()
                       for key, v in st.items() if key != "step"})
    return weights, states


def _close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert set(want) <= set(got), (what, sorted(set(want) - set(got))[:3])
    for k, w in want.items():
        torch.testing.assert_close(got[k], w, rtol=0, atol=1e-5, msg=lambda m: f"{what}: {k}: {m}")


def _run(prog: Path, nproc: int, *args: str) -> None:
    rc, log = run_ranks(prog, nproc, ["--timeout", "90", *args], timeout=400)
    assert rc == 0, log[-3000:]


def _pieces(step: Path) -> dict[str, int]:
    """How many pieces the checkpoint at ``step`` holds of each tensor: 1 written whole, t written by each of a
    split stage's processes at its offset."""
    md = checkpoint.read_metadata(step)
    return {k: len(getattr(md.state_dict_metadata[k], "chunks")) for k in checkpoint.tensor_shapes(md)}


def _adam_state(step: Path, want: dict[str, torch.Tensor], what: str) -> None:
    """Adam's state in the checkpoint at ``step``, read whole under ``optim/NAME/KEY``, is ``want``."""
    shapes = checkpoint.tensor_shapes(checkpoint.read_metadata(step))
    got = {k: torch.empty(shapes[k][0], dtype=shapes[k][1]) for k in want}
    checkpoint.read_tensors(step, got)
    _close(got, want, what)


@pytest.mark.multiproc
@pytest.mark.timeout(900)
def test_checkpoints_of_split_stages_resume_under_another_t_and_stage_count_and_merge(tmp_path: Path) -> None:
    """One chain of runs (steps 1-2, 3, 3 again, 4-5, 6), each resuming the checkpoint of one before it under
    another layout: t = [2, 1] per stage -> [1, 2] and -> t = 1 on 1 stage -> t = 2 x 1 stage x 2 replicas sharding
    the optimizer (ZeRO-1) -> t = 2 x 2 stages, every one checked against the single-process run."""
    data = token_batches(CFG.vocab_size, STEPS, BATCH, CFG.seq_len)
    save_batches(data, STEPS, tmp_path / "data.pt")
    source = {"factory": "pdcompile.runtime.data:from_file", "kwargs": {"path": str(tmp_path / "data.pt")}}
    layouts: list[tuple[int, Degrees, int]] = [(2, (2, 1), 1), (2, (1, 2), 1), (1, 1, 1), (1, 2, 2), (2, 2, 1)]
    progs = {(s, t, r): _compiled(s, t, r, "optimizer").emit(tmp_path / f"prog_{s}x{t}x{r}".replace(" ", ""), data=source)
             for s, t, r in layouts}
    weights, states = _reference(data)
    initial = {n: p.detach() for n, p in _model().named_parameters()}
    assert sum(not torch.equal(weights[1][n], initial[n]) for n in initial) > len(initial) // 2  # it trains

    # t = [2, 1]: stage 0 on 2 processes, stage 1 on 1 (3 processes): 2 steps, a checkpoint after the second
    _run(progs[2, (2, 1), 1], 3, "--steps", "2", "--checkpoint-dir", str(tmp_path / "a"), "--checkpoint-every", "2")
    step2 = checkpoint.latest(tmp_path / "a")
    assert step2 is not None and step2.name == "step_00000002"
    # it holds the model's tensors under its names, whole in the model's order (c_attn's fused rows too):
    # `pdcompile merge` of the checkpoint folder gives the model's state dict ...
    assert main(["merge", str(tmp_path / "a"), "-o", str(tmp_path / "merged.pt"), "--no-safetensors"]) == 0
    _close(torch.load(tmp_path / "merged.pt", weights_only=True), weights[1], "pdcompile merge of the [2, 1] checkpoint")
    # stage 0's 2 processes each wrote their shard (rows of a column linear), stage 1 (t = 1) its tensors whole
    pieces = _pieces(step2)
    assert pieces["h.0.mlp.c_fc.weight"] == pieces["optim/h.0.mlp.c_fc.weight/exp_avg"] == 2, pieces
    assert pieces["h.1.mlp.c_fc.weight"] == pieces["optim/h.1.mlp.c_fc.weight/exp_avg"] == 1, pieces
    # ... and Adam's state, split like its weights, whole under optim/NAME/KEY
    _adam_state(step2, states[1], "Adam's state in the [2, 1] checkpoint")

    # resumed under t = [1, 2] (the other stage split; 3 processes): step 3, checkpointed
    _run(progs[2, (1, 2), 1], 3, "--steps", "3", "--resume", str(step2), "--checkpoint-dir", str(tmp_path / "b"),
         "--checkpoint-every", "3", "--save-final", str(tmp_path / "final_b"))
    _close(merge_weights(progs[2, (1, 2), 1], tmp_path / "final_b"), weights[2], "[2, 1] resumed under [1, 2]")
    step3b = checkpoint.latest(tmp_path / "b")
    assert step3b is not None
    _close({k: v for part in checkpoint_source(step3b).stream() for k, v in part.items()}, weights[2],
           "merge of the [1, 2] checkpoint")
    assert _pieces(step3b)["h.1.mlp.c_fc.weight"] == 2 and _pieces(step3b)["h.0.mlp.c_fc.weight"] == 1
    _adam_state(step3b, states[2], "Adam's state in the [1, 2] checkpoint")

    # the [2, 1] checkpoint resumed under t = 1 on one stage (1 process): step 3 again, checkpointed (t = 1)
    _run(progs[1, 1, 1], 1, "--steps", "3", "--resume", str(step2), "--checkpoint-dir", str(tmp_path / "c"),
         "--checkpoint-every", "3", "--save-final", str(tmp_path / "final_c"))
    _close(merge_weights(progs[1, 1, 1], tmp_path / "final_c"), weights[2], "[2, 1] x 2 stages resumed under t=1 x 1")
    step3 = checkpoint.latest(tmp_path / "c")
    assert step3 is not None

    # that t = 1 checkpoint resumed under t = 2 x 1 stage x 2 replicas, each of the 2 processes of a tensor index
    # stepping half its parameters with Adam (ZeRO-1) and broadcasting them (4 processes): steps 4 and 5,
    # checkpointed again with t = 2 (a shard two replicas hold written once, Adam's state by the replica holding it)
    _run(progs[1, 2, 2], 4, "--steps", "5", "--resume", str(step3), "--checkpoint-dir", str(tmp_path / "d"),
         "--checkpoint-every", "5", "--metrics", str(tmp_path / "m"))
    step5 = checkpoint.latest(tmp_path / "d")
    assert step5 is not None and step5.name == "step_00000005"
    _close({k: v for part in checkpoint_source(step5).stream() for k, v in part.items()}, weights[4],
           "t=1 resumed under t=2 x 1 x 2 replicas with ZeRO-1 (its checkpoint merged)")
    _adam_state(step5, states[4], "Adam's state in the t=2 x 2 replicas ZeRO-1 checkpoint")
    # ZeRO-1 held Adam's state (2 tensors the size of each weight) of about half the shard's weights
    mem = json.loads((tmp_path / "m" / "rank_0.json").read_text())["memory"]
    assert 0.5 * mem["weights"] < mem["optimizer_state"] < 1.5 * mem["weights"], mem

    # that t = 2 checkpoint of one stage and 2 replicas resumed under t = 2 x 2 stages (4 processes): step 6,
    # checkpointed with t = 2 on both stages
    _run(progs[2, 2, 1], 4, "--steps", "6", "--resume", str(step5), "--checkpoint-dir", str(tmp_path / "e"),
         "--checkpoint-every", "6")
    step6 = checkpoint.latest(tmp_path / "e")
    assert step6 is not None
    assert main(["merge", str(tmp_path / "e"), "-o", str(tmp_path / "merged_e.pt"), "--no-safetensors"]) == 0
    _close(torch.load(tmp_path / "merged_e.pt", weights_only=True), weights[5], "t=2 x 1 x 2 resumed under t=2 x 2")
    shapes = checkpoint.tensor_shapes(checkpoint.read_metadata(step6))
    assert shapes["h.0.attn.c_attn.weight"][0] == (3 * CFG.d_model, CFG.d_model)
    # each process wrote its shard (2 pieces: rows of a column linear, columns of a row linear); a fused
    # projection's shard is not one piece of the whole, so it was gathered and written whole (1 piece)
    pieces = _pieces(step6)
    assert pieces["h.0.mlp.c_fc.weight"] == pieces["h.1.mlp.c_proj.weight"] == 2, pieces
    assert pieces["optim/h.0.mlp.c_fc.weight/exp_avg"] == 2 and pieces["h.0.attn.c_attn.weight"] == 1
    _adam_state(step6, states[5], "Adam's state in the t=2 x 2 checkpoint")


@pytest.mark.parametrize("dim,chunks,t", [(0, 1, 2), (1, 1, 2), (0, 3, 2), (0, 3, 4), (1, 2, 4)])
def test_a_layout_takes_each_processes_part_and_puts_the_parts_back_in_the_models_order(dim: int, chunks: int,
                                                                                    t: int) -> None:
    """What apply's interleave and DTensor's split give each process (its rows of every fused chunk) is what
    ``Layout.local`` reads from the model's tensor, and ``Layout.whole`` undoes the concatenation
    ``full_tensor()`` makes."""
    from pdcompile.runtime.tensor_parallel import Layout, interleave

    whole = torch.arange(24 * 5, dtype=torch.float32).reshape(24, 5)
    whole = whole if dim == 0 else whole.T.contiguous()
    moved = whole.movedim(dim, 0)
    split = interleave(moved, chunks, t).movedim(0, dim).chunk(t, dim)  # as apply + ColwiseParallel hold it
    locals_ = [Layout(dim, t, j, chunks).local(whole) for j in range(t)]
    for j in range(t):
        assert torch.equal(locals_[j], split[j]), j
    assert torch.equal(Layout(dim, t, 0, chunks).whole(torch.cat(locals_, dim)), whole)
    if chunks > 1:  # the parts are not the plain split: the interleave matters
        assert not torch.equal(locals_[0], whole.chunk(t, dim)[0])


def _pretrained(folder: Path) -> dict[str, torch.Tensor]:
    """Trained-looking weights of the GPT (not what an initialiser gives), saved in ``folder/w.safetensors``."""
    from safetensors.torch import save_file

    whole = _model()
    with torch.no_grad():
        for p in whole.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    sd = {k: v.detach().clone() for k, v in whole.state_dict().items()}
    save_file({k: v.contiguous() for k, v in sd.items() if k != "lm_head.weight"}, folder / "w.safetensors")
    return sd


def _meta_compiled(folder: Path, stages: int = 1, t: Degrees = 2) -> Any:
    """The GPT compiled on the meta device with ``t``, its weights from ``folder/w.safetensors``."""
    with torch.device("meta"):
        model = gpt.GPT(CFG)
    (x,), target = token_batches(CFG.vocab_size, 1, BATCH, CFG.seq_len)[0]
    return api.pdcompile(model, example_inputs=(x,), example_target=target, loss_fn=SequenceCrossEntropy(),
                         optimizer=_opt, stages=stages, num_microbatches=MICRO,
                         tensor_parallel=list(t) if isinstance(t, tuple) else t, init_from=folder / "w.safetensors")


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_a_meta_compiled_model_trains_from_init_from_with_t2_like_the_whole_model_loaded(tmp_path: Path) -> None:
    """The emitted program on 2 stages of degrees [1, 2] (3 processes): each process builds its stage on meta and
    reads its slices of the safetensors file; 2 steps train like the whole model loaded from that file."""
    sd = _pretrained(tmp_path)
    data = token_batches(CFG.vocab_size, 2, BATCH, CFG.seq_len)
    save_batches(data, 2, tmp_path / "data.pt")
    prog = _meta_compiled(tmp_path, 2, (1, 2)).emit(tmp_path / "prog", data={
        "factory": "pdcompile.runtime.data:from_file", "kwargs": {"path": str(tmp_path / "data.pt")}})
    assert not list(prog.glob("stage_*.pt"))  # no weights emitted: the ranks read the checkpoint
    _run(prog, 3, "--steps", "2", "--save-final", str(tmp_path / "final"))
    model = _model()
    model.load_state_dict(sd)
    reference.train_sync(model, SequenceCrossEntropy(), _opt(model.parameters()), data, steps=2,
                         num_microbatches=MICRO)
    want = {n: p.detach() for n, p in model.named_parameters()}
    assert sum(not torch.equal(want[n], sd[n]) for n in want) > len(want) // 2  # it trained
    _close(merge_weights(prog, tmp_path / "final"), want, "init_from with t=[1, 2]")


def _fake_group(rank: int, world: int) -> None:
    """One process standing for ``rank`` of ``world`` (torch's fake process group: collectives do nothing),
    enough to build a stage's DTensors and see what this rank keeps."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("degrees", [2, (2, 1)], ids=["t2", "per-stage-2-1"])
def test_init_from_fills_each_process_with_its_own_part_of_every_format(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, degrees: Degrees) -> None:
    """A GPT compiled on meta with t = 2 on one stage, or degrees [2, 1] on two stages, each stage built from a
    checkpoint (safetensors: read as slices; torch.save; DCP) as each process builds it: each holds what
    splitting the whole model gives it (column linears' rows, fused q, k, v per chunk; row linears' columns),
    and every tensor left whole (all of a stage of degree 1)."""
    import torch.distributed as dist

    from pdcompile.runtime import sources, tensor_parallel
    from pdcompile.runtime.program import Program
    from pdcompile.runtime.tensor_parallel import interleave

    sd = _pretrained(tmp_path)
    torch.save(sd, tmp_path / "w.pt")
    checkpoint.write_offline(tmp_path / "dcp", {"stages": []}, 0, sd, checkpoint.rank_state([], 0, 0))
    prog = Program.load(_meta_compiled(tmp_path, 1 if isinstance(degrees, int) else len(degrees), degrees)
                        .emit(tmp_path / "prog"))
    lay = tensor_parallel.rank_layout(prog.raw)
    assert lay.world == (2 if isinstance(degrees, int) else 3)

    whole_reads: list[str] = []  # a safetensors file's split tensors are read as slices, never whole
    for method in ("read", "copy_into"):
        real = getattr(sources.SafetensorsReader, method)

        def spy(self: Any, name: Any, *a: Any, _real: Any = real, **k: Any) -> Any:
            whole_reads.extend([name] if isinstance(name, str) else name)
            return _real(self, name, *a, **k)
        monkeypatch.setattr(sources.SafetensorsReader, method, spy)

    for process in range(lay.world):
        me = lay.locate(process)
        k = next(st.index for st in prog.stages if me.logical in st.ranks)
        entry, names = tensor_parallel.stage_entry(prog.raw, k), prog.stages[k].param_names
        col, row, fused = set(entry.get("colwise", ())), set(entry.get("rowwise", ())), dict(entry.get("fused", {}))
        assert (me.degree > 1) == bool(col and row and fused)
        vocab = {*entry.get("embeddings", ()), *([entry["head"]] if entry.get("head") else [])}
        tied = {n for n in names if names[n] in {names[m] for m in names if m.rpartition(".")[0] in vocab}}
        layers = {names[n].split(".")[1] for n in names if names[n].startswith("h.")}  # the stage's blocks

        def expected(local: str, j: int = me.index, t: int = me.degree) -> torch.Tensor:
            # splitting the whole model, as Megatron lays it out
            w, (mod, _, leaf) = sd[names[local]], local.rpartition(".")
            if local in tied:  # split by vocabulary: rows (a tied embedding and head under either name)
                return w.chunk(t, 0)[j]
            if mod in col:
                return interleave(w, fused.get(mod, 1), t).chunk(t, 0)[j]
            return w.chunk(t, 1)[j] if mod in row and leaf == "weight" else w

        _fake_group(process, lay.world)
        try:
            mesh = tensor_parallel.tensor_mesh(prog.raw, "cpu")
            assert (mesh is None) == (me.degree == 1)
            for path in ("w.safetensors", "w.pt", "step_00000000"):
                src = tmp_path / ("dcp" if path.startswith("step") else "") / path
                stage = prog.build_stage(k, "cpu", init_from=str(src),
                                         split=tensor_parallel.Split(entry, mesh) if me.degree > 1 else None)
                split = 0
                for local, t in stage.named_parameters():
                    got = tensor_parallel.local_tensor(t)
                    split += got.shape != t.shape
                    assert torch.equal(got, expected(local)), (path, process, local)
                # c_attn, c_fc: weights and biases; both c_proj: weights; the tied wte/lm_head (one tensor) by
                # vocabulary (where one stage holds both: across stages of different degrees the weight is whole)
                want = 6 * len(layers) + len(tied & {n for n, _ in stage.named_parameters()}) if me.degree > 1 else 0
                assert split == want and (split > 0) == (me.degree > 1), (path, process)
                if path.endswith("safetensors"):
                    assert whole_reads and not {names[n] for n, t in stage.named_parameters()
                                                if tensor_parallel.local_tensor(t).shape != t.shape} & set(whole_reads)
                whole_reads.clear()
        finally:
            dist.destroy_process_group()
