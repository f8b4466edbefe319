"""Each rank builds only its own stage from a source (#28 item 2) and bad sources are refused (item 8).

A Llama compiled on the meta device is emitted once; its ranks then train from a checkpoint saved with
``save_pretrained`` (``--init-from``), equal to single-process training from ``from_pretrained``, and from
a fresh initialisation, equal to single-process training from those same weights. Every checkpoint
format gives each stage the model's tensors; a bf16 checkpoint is cast into fp32 weights; a tied
parameter is found under either name; missing, misshapen, truncated and absent weights are refused with
one line naming the cause and the fix.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from pdcompile import api
from pdcompile.errors import CheckpointError, UsageError
from pdcompile.merge import merge_weights
from pdcompile.reference import train_sync
from pdcompile.runtime.data import save_batches
from pdcompile.runtime.program import Program
from pdcompile.zoo.losses import SequenceCrossEntropy
from _hf_llama import Logits, llama_config, token_batches
from _ranks import run_ranks

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.timeout(240)

VOCAB, SEQ, BATCH, MICRO, STEPS, LR = 100, 8, 4, 2, 3, 0.05


def config(**kw: Any) -> Any:
    return llama_config(VOCAB, **kw)


def pretrained(folder: Path, **kw: Any) -> Path:
    """A small Llama with trained-looking (seeded random) weights, saved as a user would."""
    torch.manual_seed(1)
    model = transformers.LlamaForCausalLM(config(**kw))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # not the values any initialiser gives
    model.save_pretrained(folder)
    return folder


def optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def batches() -> list[tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
    return token_batches(VOCAB, STEPS, BATCH, SEQ)


def meta_pipeline(init_from: Path | None = None, **kw: Any) -> api.CompiledPipeline:
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config(**kw))
        x, t = torch.randint(0, VOCAB, (BATCH, SEQ)), torch.randint(0, VOCAB, (BATCH, SEQ))
    return api.pdcompile(model, example_inputs=(x,), example_target=t, loss_fn=SequenceCrossEntropy(),
                         optimizer=optimizer, stages=2, num_microbatches=MICRO, schedule="flush", init_from=init_from)


def trained_alone(model: torch.nn.Module, data: list[Any]) -> dict[str, torch.Tensor]:
    train_sync(Logits(model), SequenceCrossEntropy(), optimizer(model.parameters()), data, steps=STEPS,
               num_microbatches=MICRO)
    return {k: v.detach() for k, v in model.named_parameters()}


def stage_weights(prog: Program, init_from: Any = None) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for k in range(prog.num_stages):
        module = prog.build_stage(k, init_from=str(init_from) if init_from is not None else None)
        for n, t in list(module.named_parameters()) + list(module.named_buffers()):
            out[prog.stages[k].param_names[n]] = t.detach()
    return out


@pytest.mark.multiproc
def test_a_meta_llama_trains_from_save_pretrained_and_from_a_fresh_init(tmp_path: Path) -> None:
    hf = pretrained(tmp_path / "hf")
    data = batches()
    save_batches(data, STEPS, tmp_path / "data.pt")
    prog = meta_pipeline().emit(tmp_path / "prog", data={"factory": "pdcompile.runtime.data:from_file",
                                                         "kwargs": {"path": str(tmp_path / "data.pt")}})
    assert not list(prog.glob("*.pt"))
    fresh = stage_weights(Program.load(prog))  # what the ranks build without --init-from
    for tag, extra in (("pretrained", ["--init-from", str(hf)]), ("fresh", [])):
        rc, log = run_ranks(prog, 2, ["--steps", str(STEPS), "--save-final", str(tmp_path / tag), "--timeout", "60",
                                      *extra], timeout=150)
        assert rc == 0, log[-3000:]
    # pretrained: single-process training from from_pretrained
    want = trained_alone(transformers.LlamaForCausalLM.from_pretrained(hf), data)
    got = merge_weights(prog, tmp_path / "pretrained")
    start = transformers.LlamaForCausalLM.from_pretrained(hf).state_dict()
    moved = 0
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, rtol=1e-5, atol=1e-5, msg=name)
        moved += int(not torch.equal(got[name], start[name]))
    assert moved > len(want) // 2
    # fresh: single-process training from the same fresh weights
    ref = transformers.LlamaForCausalLM(config())
    missing, unexpected = ref.load_state_dict({k: v for k, v in fresh.items() if not k.endswith("inv_freq")},
                                              strict=False)
    assert not missing and not unexpected
    want = trained_alone(ref, data)
    got = merge_weights(prog, tmp_path / "fresh")
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, rtol=1e-5, atol=1e-5, msg=name)
        assert not torch.equal(got[name], fresh[name]) or name.endswith("norm.weight"), name


def test_every_checkpoint_format_fills_each_stage_with_the_models_tensors(tmp_path: Path) -> None:
    from safetensors.torch import save_file
    import torch.distributed.checkpoint as dcp

    hf = pretrained(tmp_path / "hf", tie_word_embeddings=True)
    model = transformers.LlamaForCausalLM.from_pretrained(hf)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    want = dict(sd)
    want["model.rotary_emb.inv_freq"] = model.model.rotary_emb.inv_freq
    assert torch.equal(sd["lm_head.weight"], sd["model.embed_tokens.weight"])
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").is_file() and len(list(sharded.glob("*.safetensors"))) > 2
    untied = {k: v for k, v in sd.items() if k != "lm_head.weight"}  # tied: saved once, as HF does
    save_file(untied, str(tmp_path / "one.safetensors"))
    torch.save(sd, tmp_path / "state.pt")
    dcp.save({k: v.clone() for k, v in sd.items()}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    save_file({k: v.to(torch.bfloat16) for k, v in untied.items()}, str(tmp_path / "bf16.safetensors"))
    prog = Program.load(meta_pipeline(tie_word_embeddings=True).emit(tmp_path / "prog"))
    stages_holding = [k for k in range(2) if "model.embed_tokens.weight" in prog.stages[k].param_names.values()]
    assert stages_holding == [0, 1]  # the tied embedding and head: loaded once per stage that holds it
    for source in (hf, sharded, tmp_path / "one.safetensors", tmp_path / "state.pt", tmp_path / "dcp"):
        got = stage_weights(prog, source)
        assert set(got) == set(want) - {"lm_head.weight"}, source
        for name, t in got.items():
            assert t.dtype == torch.float32 and torch.equal(t, want[name]), (source, name)
    from pdcompile.runtime.sources import SafetensorsReader

    emb = want["model.embed_tokens.weight"]
    dest = torch.empty(VOCAB, 32)  # same dtype: read straight into the tensor
    SafetensorsReader(tmp_path / "one.safetensors").copy_into("model.embed_tokens.weight", dest, chunk_bytes=64)
    assert torch.equal(dest, emb)
    dest = torch.empty(32, VOCAB).t()  # cast, and not contiguous: through a buffer of 64 bytes, one bf16 row a read
    SafetensorsReader(tmp_path / "bf16.safetensors").copy_into("model.embed_tokens.weight", dest, chunk_bytes=64)
    assert torch.equal(dest, emb.to(torch.bfloat16).float())
    # the rotary frequencies no checkpoint holds come from plan.json: a rank builds its stages without transformers
    assert set(prog.init["values"]) == {"model.rotary_emb.inv_freq"}
    code = ("import sys, torch; sys.modules['transformers'] = None\n"  # importing it fails
            "from pdcompile.runtime.program import Program\n"
            f"p = Program.load({str(prog.folder)!r})\n"
            f"torch.save([dict(p.build_stage(k, init_from={str(hf)!r}).named_buffers()) for k in range(2)], "
            f"{str(tmp_path / 'buffers.pt')!r})")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    built = torch.load(tmp_path / "buffers.pt")
    held = [t for k in range(2) for n, t in built[k].items() if prog.stages[k].param_names[n].endswith("inv_freq")]
    assert held and all(torch.equal(t, want["model.rotary_emb.inv_freq"]) for t in held)
    got = stage_weights(prog, tmp_path / "bf16.safetensors")  # bf16 checkpoint -> fp32 master weights
    for name, t in got.items():
        assert t.dtype == torch.float32, name
        cast = want[name] if name.endswith("inv_freq") else want[name].to(torch.bfloat16).float()  # not saved
        torch.testing.assert_close(t, cast, rtol=0, atol=0, msg=name)
    assert any(not torch.equal(got[n], want[n]) for n in got)  # the bf16 values really are rounded


def test_bad_sources_are_refused_with_cause_and_fix(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    hf = pretrained(tmp_path / "hf")
    sd = transformers.LlamaForCausalLM.from_pretrained(hf).state_dict()
    prog_dir = meta_pipeline().emit(tmp_path / "prog")
    prog = Program.load(prog_dir)
    last = prog.num_stages - 1
    # a checkpoint without one of the stage's tensors: named
    save_file({k: v for k, v in sd.items() if k != "model.norm.weight"}, str(tmp_path / "missing.safetensors"))
    prog.build_stage(0, init_from=str(tmp_path / "missing.safetensors"))  # stage 0 has all it needs
    with pytest.raises(CheckpointError, match=r"has no tensor 'model\.norm\.weight', which stage 1 needs.*Fix"):
        prog.build_stage(last, init_from=str(tmp_path / "missing.safetensors"))
    # a tensor of another shape: both shapes
    save_file({**sd, "lm_head.weight": torch.zeros(VOCAB + 1, 32)}, str(tmp_path / "shape.safetensors"))
    with pytest.raises(CheckpointError, match=r"'lm_head\.weight'.*shape \[101, 32\].*needs \[100, 32\].*Fix"):
        prog.build_stage(last, init_from=str(tmp_path / "shape.safetensors"))
    # a truncated safetensors file
    whole = (hf / "model.safetensors").read_bytes()
    (tmp_path / "cut").mkdir()
    (tmp_path / "cut" / "model.safetensors").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors can't be read.*truncated.*Fix"):
        prog.build_stage(0, init_from=str(tmp_path / "cut"))
    # a folder with no weights
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(UsageError, match=r"holds no weights.*Fix: give init_from"):
        prog.build_stage(0, init_from=str(tmp_path / "empty"))
    with pytest.raises(UsageError, match=r"holds no weights"):
        meta_pipeline(init_from=tmp_path / "empty").emit(tmp_path / "never")
    # train.py: exit 2 and one line, said before any process group (truncated) or by the rank (missing tensor)
    for path, said in ((tmp_path / "cut", "can't be read"), (tmp_path / "missing.safetensors", "has no tensor")):
        rc, log = run_ranks(prog_dir, 2, ["--steps", "1", "--init-from", str(path), "--timeout", "20"], timeout=90)
        assert rc == 2, log[-2000:]
        lines = [ln for ln in log.splitlines() if said in ln]
        assert lines and "Traceback" not in log, log[-2000:]


MLP_FACTORY = '''
import torch


def make_on_meta():
    with torch.device("meta"):
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
'''


def test_cli_emit_init_from_a_torch_save_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    from pdcompile.cli import main

    (tmp_path / "meta_mlp.py").write_text(MLP_FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    torch.manual_seed(3)
    real = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    torch.save(real.state_dict(), tmp_path / "weights.pt")
    common = ["meta_mlp:make_on_meta", "--input", "8x8", "--target", "8:int64:4", "--stages", "2"]
    assert main(["emit", *common, "--init-from", str(tmp_path / "weights.pt"), "-o", str(tmp_path / "out")]) == 0
    prog = Program.load(tmp_path / "out")
    assert prog.init == {**prog.init, "source": "pretrained", "path": str((tmp_path / "weights.pt").resolve())}
    got = stage_weights(prog)  # plan.json's path is the default source
    assert set(got) == set(real.state_dict())
    for name, t in real.state_dict().items():
        assert torch.equal(got[name], t), name
    # a model with real weights and init_from: stage_K.pt is still written, the checkpoint's values win
    other = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    pipe = api.pdcompile(other, example_inputs=(torch.randn(8, 8),), example_target=torch.randint(0, 4, (8,)),
                         loss_fn=torch.nn.CrossEntropyLoss(), stages=2, init_from=tmp_path / "weights.pt")
    prog = Program.load(pipe.emit(tmp_path / "real"))
    assert all(st.weights is not None and (prog.folder / st.weights).is_file() for st in prog.stages)
    got = stage_weights(prog)
    for name, t in real.state_dict().items():
        assert torch.equal(got[name], t) and not torch.equal(t, other.state_dict()[name]), name
    capsys.readouterr()
    assert main(["emit", *common, "--init-from", str(tmp_path / "nothing_here"), "-o", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not exist" in err[0] and "Fix" in err[0], err
