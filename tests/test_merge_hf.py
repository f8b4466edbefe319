"""Back to Hugging Face: a small Llama (tied embedding and LM head) trained 3 steps through a 2-stage
pipeline, merged by ``pdcompile merge -o OUT/ --like`` from the run's --save-final folder (one
model.safetensors) and from its checkpoint (shards with an index), loads with
``from_pretrained`` to the weights single-process training gives."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from _hf_llama import Logits, llama_config, token_batches
from _ranks import run_ranks
from pdcompile import api
from pdcompile.cli import main
from pdcompile.reference import train_sync
from pdcompile.runtime.data import save_batches
from pdcompile.zoo.losses import SequenceCrossEntropy

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

pytestmark = [pytest.mark.timeout(300)]

VOCAB, SEQ, BATCH, MICRO, STEPS, LR = 64, 8, 4, 2, 3, 0.05


def llama() -> Any:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(llama_config(VOCAB, num_key_value_heads=1, tie_word_embeddings=True,
                                                      attn_implementation="eager"))


def _opt(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


@pytest.mark.multiproc
def test_merged_folder_loads_with_from_pretrained(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    like = tmp_path / "hf"
    llama().save_pretrained(like)  # the user's Hugging Face folder: config and weights ...
    (like / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 32}))  # ... and tokenizer files
    (like / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<s>"}))
    saved_keys = set(safetensors_torch.load_file(str(like / "model.safetensors")))
    assert "lm_head.weight" not in saved_keys and "model.embed_tokens.weight" in saved_keys  # tied: saved once

    data = token_batches(VOCAB, STEPS, BATCH, SEQ)
    (x,), target = data[0]
    pipe = api.pdcompile(llama(), example_inputs=(x,), example_target=target, loss_fn=SequenceCrossEntropy(),
                         optimizer=_opt, stages=2, schedule="flush", num_microbatches=MICRO, frontend="export")
    save_batches(data, STEPS, tmp_path / "data.pt")
    prog = pipe.emit(tmp_path / "prog", data={"factory": "pdcompile.runtime.data:from_file",
                                              "kwargs": {"path": str(tmp_path / "data.pt")}})
    rc, log = run_ranks(prog, 2, ["--steps", str(STEPS), "--save-final", str(tmp_path / "final"), "--timeout", "60",
                                  "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", str(STEPS)],
                        timeout=200)
    assert rc == 0, log[-3000:]

    ref = llama()
    initial = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    train_sync(Logits(ref), SequenceCrossEntropy(), _opt(ref.parameters()), data, steps=STEPS, num_microbatches=MICRO)
    want = {k: v.detach() for k, v in ref.state_dict().items()}

    one, sharded = tmp_path / "one", tmp_path / "sharded"
    capsys.readouterr()
    assert main(["merge", str(tmp_path / "final"), "--program", str(prog), "-o", str(one), "--like", str(like)]) == 0
    assert "model.rotary_emb.inv_freq" in capsys.readouterr().out  # a buffer the model does not save: left out
    assert main(["merge", str(tmp_path / "ck"), "-o", str(sharded), "--like", str(like),
                 "--max-shard-size", "20KB"]) == 0
    assert sorted(p.name for p in one.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                     "special_tokens_map.json", "tokenizer_config.json"]
    assert set(safetensors_torch.load_file(str(one / "model.safetensors"))) == saved_keys  # what save_pretrained keeps
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = sorted({f for f in index["weight_map"].values()})
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert set(index["weight_map"]) == saved_keys
    for f in shards:  # each shard within the limit, unless it holds one bigger tensor
        held = safetensors_torch.load_file(str(sharded / f))
        assert len(held) == 1 or sum(t.numel() * t.element_size() for t in held.values()) <= 20_000
        assert all(index["weight_map"][k] == f for k in held)
    assert index["metadata"]["total_size"] == sum(want[k].numel() * 4 for k in saved_keys)

    for out in (one, sharded):
        loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out))
        got = loaded.state_dict()
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight  # tied again by from_pretrained
        moved = 0
        for k, v in want.items():
            torch.testing.assert_close(got[k], v, rtol=0, atol=1e-5, msg=f"{out.name}: {k}")
            moved += int(not torch.equal(v, initial[k]))
        assert moved > len(want) // 2  # training changed the weights
