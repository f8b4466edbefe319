"""A program's stages rebuilt in one process, for tests' single-process references."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

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
