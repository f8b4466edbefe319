"""A program's stages rebuilt in one process, for tests' single-process references; a 2-process
launch that returns each stage's metrics and final weights."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from _ranks import run_ranks

from pdcompile.merge import merge_weights
from pdcompile.runtime.data import save_batches
from pdcompile.runtime.program import Program, build
from pdcompile.zoo import batches


def stages_and_microbatches(prog: Path, name: str, steps: int, micro: int) -> tuple[
        Program, list[torch.nn.Module], list[Any], list[tuple[tuple[torch.Tensor, ...], torch.Tensor]]]:
    """The emitted program, its stage modules with fresh optimizers (its initial weights), and the
    zoo model ``name``'s first ``steps`` minibatches cut into ``micro`` microbatches each."""
    program = Program.load(prog)
    stages = [program.build_stage(k) for k in range(program.num_stages)]
    optimizers = [build(program.raw["optimizer"], m.parameters()) for m in stages]
    b = program.raw["microbatch_size"]
    data = batches(b * micro, name)
    out = []
    for _ in range(steps):
        inputs, target = next(data)
        ins = [x.split(b) for x in inputs]
        out += [(tuple(x[j] for x in ins), target.split(b)[j]) for j in range(micro)]
    return program, stages, optimizers, out


ROOT = Path(__file__).resolve().parent.parent


def launch_two(tmp: Path, prog: Path, schedule: str, tag: str) -> tuple[dict[int, Any], dict[int, dict[str, torch.Tensor]]]:
    """``prog`` trained 3 steps under ``schedule`` on 2 processes: (metrics, final weights) per stage."""
    env = {"PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    rc, log = run_ranks(prog, 2, ["--schedule", schedule, "--steps", "3", "--metrics", str(tmp / f"m_{tag}"),
                                  "--save-final", str(tmp / f"w_{tag}"), "--timeout", "60"], timeout=120, env=env)
    assert rc == 0, log[-3000:]
    metrics = {json.loads(p.read_text())["stage"]: json.loads(p.read_text()) for p in (tmp / f"m_{tag}").glob("*.json")}
    weights = {int(p.name.split("_")[1].split(".")[0]): torch.load(p, weights_only=True)
               for p in (tmp / f"w_{tag}").glob("stage_*.pt")}
    return metrics, weights



def train_saved(pipe: Any, data: Any, steps: int, tmp: Path, nproc: int = 2,
                keywords: tuple[str, ...] = (), extra: tuple[str, ...] = ()) -> tuple[Path, dict[str, torch.Tensor]]:
    """``data``'s first ``steps`` minibatches saved to a file, ``pipe`` emitted to read them, trained on
    ``nproc`` ranks with ``--save-final`` (and train.py flags ``extra``): the program folder and the trained
    weights under the model's names."""
    save_batches(data, steps, tmp / "data.pt", keywords=keywords)
    prog = pipe.emit(tmp / "prog", data={"factory": "pdcompile.runtime.data:from_file",
                                         "kwargs": {"path": str(tmp / "data.pt")}})
    rc, log = run_ranks(prog, nproc, ["--steps", str(steps), "--save-final", str(tmp / "final"),
                                      "--timeout", "60", *extra], timeout=150)
    assert rc == 0, log[-3000:]
    return prog, merge_weights(prog, tmp / "final")
