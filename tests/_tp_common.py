"""What the tensor-parallel training tests share (test_tensor_parallel, test_tensor_parallel_vocab): the zoo GPT
and a small Hugging Face Llama of the same vocabulary, their optimizer, a compile of either, a launch of the
emitted program on its seeded batches, and the single-process reference it is checked against."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from _hf_llama import llama_config, token_batches
from _ranks import run_ranks
from pdcompile import api, reference
from pdcompile.runtime.data import save_batches
from pdcompile.zoo import gpt

CFG = gpt.CONFIGS["small"]  # 2 layers, 2 heads, d=32, T=8, vocabulary 64
STEPS, MICRO, BATCH, LR = 2, 2, 4, 0.1

Batches = list[tuple[tuple[torch.Tensor, ...], torch.Tensor]]


def gpt_model(vocab: int = CFG.vocab_size) -> torch.nn.Module:
    torch.manual_seed(0)
    return gpt.GPT(dataclasses.replace(CFG, vocab_size=vocab))


def llama_model() -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(llama_config(CFG.vocab_size, attn_implementation="eager"))  # head untied


MODELS: dict[str, tuple[Callable[..., torch.nn.Module], str]] = {"gpt": (gpt_model, "auto"),
                                                                 "llama": (llama_model, "export")}


def opt(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def compile_model(kind: str, stages: int | None, schedule: str, loss_fn: Any, example: Batches,
                  build_kw: dict[str, Any] | None = None, **kw: Any) -> Any:
    """``kind`` (a key of :data:`MODELS`, built with ``build_kw``) compiled on the first of ``example``'s
    minibatches."""
    build, frontend = MODELS[kind]
    (x,), target = example[0]
    return api.pdcompile(build(**(build_kw or {})), example_inputs=(x,), example_target=target, loss_fn=loss_fn, optimizer=opt,
                         stages=stages, schedule=schedule, num_microbatches=MICRO, frontend=frontend, **kw)


def train(pipe: Any, tmp_path: Path, data: Batches, procs: int, extra: Sequence[str] = ()) -> Path:
    """``pipe`` emitted to read ``data`` and trained ``STEPS`` minibatches on ``procs`` processes, its final
    weights in ``tmp_path/final`` and metrics in ``tmp_path/m``; the program's folder."""
    save_batches(data, STEPS, tmp_path / "data.pt")
    prog: Path = pipe.emit(tmp_path / "prog", data={"factory": "pdcompile.runtime.data:from_file",
                                                    "kwargs": {"path": str(tmp_path / "data.pt")}})
    rc, log = run_ranks(prog, procs, ["--steps", str(STEPS), "--save-final", str(tmp_path / "final"),
                                      "--metrics", str(tmp_path / "m"), "--timeout", "90", *extra], timeout=400)
    assert rc == 0, log[-3000:]
    return prog


def reference_weights(pipe: Any, schedule: str, loss_fn: Any, data: Batches, *, replicas: Sequence[int] | None = None,
                      max_norm: float | None = None, norms: list[float] | None = None
                      ) -> tuple[dict[str, torch.Tensor], list[torch.nn.Module]]:
    """The model trained in one process with what ``schedule`` computes (reference.py), from the stages of
    ``pipe``, an untouched (t = 1) compile: its final weights under the model's names, and the stage modules
    holding them."""
    stages = len(pipe.split.stages)
    mods = [copy.deepcopy(s.gm) for s in pipe.split.stages]
    micro = [((x.chunk(MICRO)[j],), y.chunk(MICRO)[j]) for (x,), y in data for j in range(MICRO)]
    fwd, bwd, group = (reference.pipedream_1f1b(list(replicas or [1] * stages)) if schedule == "1f1b"
                       else reference.synchronous(MICRO))
    reference.train_versioned(mods, [opt(m.parameters()) for m in mods], loss_fn, micro, fwd=fwd, bwd=bwd,
                              group=group, scale=1.0 if schedule == "1f1b" else 1 / MICRO,
                              tied=[list(g) for g in pipe.split.tied], max_norm=max_norm, norms=norms)
    weights = {st.param_names[n]: p.detach() for st, m in zip(pipe.split.stages, mods) for n, p in m.named_parameters()}
    return weights, mods


def assert_trained_like(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], kind: str,
                        atol: float = 1e-5, rtol: float = 0.0, **build: Any) -> None:
    """Every weight of ``want`` in ``got`` within the tolerance, and most of them moved from their start."""
    initial = {k: v.detach() for k, v in MODELS[kind][0](**build).named_parameters()}
    assert set(want) <= set(got), sorted(set(want) - set(got))[:3]
    for k, w in want.items():
        torch.testing.assert_close(got[k], w, rtol=rtol, atol=atol, msg=lambda m: f"{k}: {m}")
    assert sum(not torch.equal(want[k], initial[k]) for k in want) > len(want) // 2  # it trained
