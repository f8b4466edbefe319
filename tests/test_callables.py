"""Training code as written (issue 34 items 3 and 4): the callables the ranks run (``lr_scheduler=``,
``eval_metric=``, ``data=``) may be lambdas of a script's ``__main__``, serialized by value, and a run's
weights go back to the user's world in one step (``RunResult.save_pretrained``, ``RunResult.save``,
``pdcompile merge RUN/final`` with no ``--program``).

The user's script is written to a fresh folder and run there as a subprocess, with relative paths, so
its lambdas really are ``__main__``'s: a small Hugging Face Llama saved with ``save_pretrained`` is
trained from that folder (``run(init_from=)``) under a ``LambdaLR`` lambda and saved back; an MLP trains
under a ``OneCycleLR`` lambda with a metric lambda, and its program is emitted with a data lambda. Each
is compared with single-process PyTorch training (within 1e-5).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from _hf_llama import Logits, llama_config, token_batches
from pdcompile.api import pdcompile
from pdcompile.cli import main
from pdcompile.errors import UsageError
from pdcompile.reference import train_sync

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

VOCAB, SEQ, BATCH, M, STEPS = 64, 8, 4, 2, 3
D, C, MLP_STEPS = 6, 3, 6

# What the user writes: one script, every callable a lambda of __main__.
SCRIPT = '''
import json

import torch
import torch.nn.functional as F
import transformers
from torch.utils.data import DataLoader, TensorDataset

from pdcompile import pdcompile

# 1. a Hugging Face Llama: built on meta from its folder, trained from the folder's weights, saved back
batches = torch.load("llama_batches.pt")
(x,), t = batches[0]
with torch.device("meta"):
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained("hf"))
pipe = pdcompile(model, example_inputs=(x,), example_target=t, stages=2, num_microbatches=2,
                 loss_fn=lambda out, t: F.cross_entropy(out.logits.flatten(0, 1), t.flatten()),
                 optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
                 lr_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: min(1, (s + 1) / 3)))
print(pipe.explain())
result = pipe.run(batches, steps=3, init_from="hf", out="runs/llama")
result.save_pretrained("trained", like="hf")
result.save("trained.pt")

# 2. an MLP: OneCycleLR, a metric and the emitted program's data, all lambdas
xs, ys = torch.load("points.pt")
torch.manual_seed(0)
mlp = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.ReLU(),
                          torch.nn.Linear(16, 3))
pipe = pdcompile(mlp, example_inputs=(xs[:8],), loss_fn=torch.nn.CrossEntropyLoss(), stages=2, num_microbatches=2,
                 optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
                 lr_scheduler=lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.2, total_steps=6))
result = pipe.run(DataLoader(TensorDataset(xs, ys), batch_size=8), steps=6,
                  eval_data=DataLoader(TensorDataset(xs[:16], ys[:16]), batch_size=8),
                  eval_metric=lambda out, t: (out.argmax(-1) == t).float().mean(), out="runs/mlp")
torch.save(result.state_dict(), "mlp_trained.pt")
with open("mlp_eval.json", "w") as f:
    json.dump(result.metrics["eval"], f)
pipe.emit("prog", target=ys[:8], data=lambda batch_size: DataLoader(TensorDataset(xs, ys), batch_size=batch_size))
'''


def llama() -> Any:
    torch.manual_seed(1)
    model = transformers.LlamaForCausalLM(llama_config(VOCAB))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # not what any initialiser gives: init_from must have read them
    return model


def _seq_loss(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), t.flatten())


def _mlp() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(D, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.ReLU(),
                               torch.nn.Linear(16, C))


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_a_scripts_lambdas_train_like_one_process_and_the_weights_go_back_to_hugging_face(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cwd = tmp_path / "user"
    cwd.mkdir()
    llama().save_pretrained(cwd / "hf")
    data = token_batches(VOCAB, STEPS, BATCH, SEQ)
    torch.save(data, cwd / "llama_batches.pt")
    g = torch.Generator().manual_seed(3)
    xs = torch.randn(8 * MLP_STEPS, D, generator=g)
    ys = (xs[:, 0] > 0).long() + (xs[:, 1] > 0.5).long()
    torch.save((xs, ys), cwd / "points.pt")
    (cwd / "train_lambdas.py").write_text(textwrap.dedent(SCRIPT))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    done = subprocess.run([sys.executable, "train_lambdas.py"], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=540)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    # the plan says which callables went by value, in one line each (plan.json and explain())
    plan = json.loads((cwd / "runs" / "llama" / "program" / "plan.json").read_text())
    assert plan["lr_scheduler"]["factory"] == "lr_scheduler.pkl"
    assert "lr_scheduler=<lambda> (train_lambdas.py:" in plan["lr_scheduler"]["by_value"]
    assert "cloudpickle" in plan["lr_scheduler"]["by_value"] and "\n" not in plan["lr_scheduler"]["by_value"]
    assert "note: lr_scheduler=<lambda> (train_lambdas.py:" in done.stdout
    assert (cwd / "runs" / "mlp" / "program" / "eval_metric.pkl").is_file()

    # 1. the Llama: single-process training from from_pretrained under the same LambdaLR
    ref = transformers.LlamaForCausalLM.from_pretrained(cwd / "hf")
    start = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    train_sync(Logits(ref), _seq_loss, opt, data, steps=STEPS, num_microbatches=M,
               lr_scheduler=torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1, (s + 1) / 3)))
    want = {k: v.detach() for k, v in ref.state_dict().items()}
    loaded = transformers.AutoModelForCausalLM.from_pretrained(cwd / "trained")  # save_pretrained(like=)'s folder
    got = loaded.state_dict()
    moved = 0
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-5, msg=lambda m: f"{k}: {m}")
        moved += int(not torch.equal(v, start[k]))
    assert moved > len(want) // 2  # it trained
    assert sorted(p.name for p in (cwd / "trained").iterdir()) == sorted(
        ["model.safetensors", *(p.name for p in (cwd / "hf").iterdir() if p.suffix != ".safetensors")])
    saved = torch.load(cwd / "trained.pt", weights_only=True)  # save(out.pt): the same tensors, and safetensors
    assert set(saved) - set(want) == {"model.rotary_emb.inv_freq"}  # a buffer the model makes: merge writes it too
    for k, v in want.items():
        torch.testing.assert_close(saved[k], v, rtol=1e-5, atol=1e-5, msg=lambda m: f"{k}: {m}")
    assert set(safetensors_torch.load_file(str(cwd / "trained.safetensors"))) == set(saved)
    # pdcompile merge RUN/final finds RUN/program itself, and writes what save_pretrained wrote
    capsys.readouterr()
    assert main(["merge", str(cwd / "runs" / "llama" / "final"), "-o", str(tmp_path / "merged"),
                 "--like", str(cwd / "hf")]) == 0
    merged = safetensors_torch.load_file(str(tmp_path / "merged" / "model.safetensors"))
    mine = safetensors_torch.load_file(str(cwd / "trained" / "model.safetensors"))
    assert merged.keys() == mine.keys() and all(torch.equal(merged[k], mine[k]) for k in mine)

    # 2. the MLP: single-process training under the same OneCycleLR, its metric on the final weights
    mlp = _mlp()
    opt = torch.optim.SGD(mlp.parameters(), lr=0.1, momentum=0.9)
    batches = [((xs[i:i + 8],), ys[i:i + 8]) for i in range(0, len(xs), 8)]
    train_sync(mlp, torch.nn.CrossEntropyLoss(), opt, batches, steps=MLP_STEPS, num_microbatches=M,
               lr_scheduler=torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.2, total_steps=MLP_STEPS))
    trained = torch.load(cwd / "mlp_trained.pt", weights_only=True)
    for k, v in mlp.state_dict().items():
        torch.testing.assert_close(trained[k], v, rtol=1e-5, atol=1e-5, msg=lambda m: f"{k}: {m}")
        assert not torch.equal(v, _mlp().state_dict()[k])
    (ev,) = json.loads((cwd / "mlp_eval.json").read_text())
    with torch.no_grad():
        mlp.eval()
        micro = [(xs[i:i + 4], ys[i:i + 4]) for i in range(0, 16, 4)]
        acc = [float((mlp(x).argmax(-1) == y).float().mean()) for x, y in micro]
        loss = [float(torch.nn.functional.cross_entropy(mlp(x), y)) for x, y in micro]
    assert ev["eval_metric"] == pytest.approx(sum(acc) / len(acc), abs=1e-9)  # a lambda: named by its file
    assert ev["loss"] == pytest.approx(sum(loss) / len(loss), rel=1e-5)
    # the emitted program's data lambda, as a rank reads it (runtime/data.py source) without --data
    import argparse

    from pdcompile.runtime.data import source
    from pdcompile.runtime.program import Program

    prog = Program.load(cwd / "prog")
    assert prog.raw["data"]["factory"] == "data.pkl" and "data=<lambda>" in prog.raw["data"]["by_value"]
    read = list(source(prog, argparse.Namespace(data=None, seed=0), 8))
    assert len(read) == MLP_STEPS and all(torch.equal(a[0], x[0]) and torch.equal(a[1], y)
                                          for a, (x, y) in zip(read, batches))


def test_a_callable_neither_importable_nor_picklable_is_one_line_naming_why(tmp_path: Path) -> None:
    """A lambda holding a lock, a metric writing to an open file: a UsageError before anything is emitted
    or launched, one line naming the object and the fix; importable ones stay readable by name."""
    import functools

    model = _mlp()
    kw: dict[str, Any] = dict(example_inputs=(torch.randn(8, D),), example_target=torch.zeros(8, dtype=torch.long),
                              loss_fn=torch.nn.CrossEntropyLoss(), stages=2, num_microbatches=M)
    lock = threading.Lock()
    with pytest.raises(UsageError) as e:
        pdcompile(model, lr_scheduler=lambda o: (lock, torch.optim.lr_scheduler.StepLR(o, 1))[1], **kw)
    assert "\n" not in str(e.value) and "cannot pickle '_thread.lock' object" in str(e.value)
    assert "lr_scheduler=<lambda> (test_callables.py:" in str(e.value) and "fix:" in str(e.value)
    pipe = pdcompile(model, **kw)
    with open(tmp_path / "log.txt", "w") as log:
        def margin(out: torch.Tensor, t: torch.Tensor) -> float:
            log.write("x")
            return 0.0
        with pytest.raises(UsageError, match="eval_metric=margin .*can't serialize it.*not opened for reading"):
            pipe.run([((torch.randn(8, D),), torch.zeros(8, dtype=torch.long))], steps=1,
                     eval_data=[((torch.randn(8, D),), torch.zeros(8, dtype=torch.long))], eval_metric=margin,
                     out=tmp_path / "run")
    assert not (tmp_path / "run").exists()  # refused before anything was written or launched
    with pytest.raises(UsageError, match="ReduceLROnPlateau"):
        pdcompile(model, lr_scheduler=torch.optim.lr_scheduler.ReduceLROnPlateau, **kw).program_fields()
    spec = pdcompile(model, lr_scheduler=functools.partial(torch.optim.lr_scheduler.StepLR, step_size=3),
                     **kw).program_fields()["lr_scheduler"]
    assert spec == {"factory": "torch.optim.lr_scheduler:StepLR", "kwargs": {"step_size": 3}}  # by name, readable


def test_merge_of_a_save_final_folder_with_no_program_beside_it_names_the_fix(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``pdcompile merge DIR`` of train.py --save-final files finds the program only as run() lays it out
    (``RUN/program`` beside ``RUN/final``); elsewhere it asks for --program, in one line, writing nothing."""
    final = tmp_path / "results" / "final"
    final.mkdir(parents=True)
    torch.save({"weight": torch.zeros(2)}, final / "stage_0.rank_0.pt")
    capsys.readouterr()
    assert main(["merge", str(final), "-o", str(tmp_path / "model.pt")]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "need --program with the emitted program folder" in err[0], err
    assert str(tmp_path / "results" / "program") in err[0] and not (tmp_path / "model.pt").exists()
