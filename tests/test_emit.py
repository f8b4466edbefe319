"""emit: readable stage modules that rebuild the stages exactly; IR dumps; failures that fail fast.

The failures' launches start their ranks as torchrun starts them, without its agent (tests/_ranks.py:
what is tested is what the ranks do; torchrun's own part is test_newcomer's, test_cli's, test_faults')."""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import time
from pathlib import Path

import pytest
import torch

from _ranks import run_ranks
from pdcompile.api import pdcompile
from pdcompile.errors import UnsupportedModelError
from pdcompile.passes.codegen import object_spec
from pdcompile.runtime.program import Program
from pdcompile.zoo import get, names

pytestmark = pytest.mark.timeout(120)


def _pipe(name: str, stages: int = 2, dump_dir: Path | None = None):  # noqa: ANN202
    z = get(name, batch_size=4, seed=0)
    return z, pdcompile(z.model, example_inputs=z.example_inputs, example_target=z.target, loss_fn=z.loss_fn,
                        stages=stages, num_microbatches=2, leaf_modules=z.leaf_modules, dump_dir=dump_dir)


@pytest.mark.parametrize("name", names())
def test_emitted_stages_rebuild_the_split_exactly(tmp_path: Path, name: str) -> None:
    z, pipe = _pipe(name, stages=3)
    out = pipe.emit(tmp_path)
    program = Program.load(out)
    x = tuple(t[:2] for t in z.example_inputs)
    values: tuple = x
    for k in range(3):
        src = (out / f"stage_{k}.py").read_text()
        ast.parse(src)  # valid Python
        assert f"class Stage{k}(torch.nn.Module)" in src and "repr(" not in src
        module = program.build_stage(k)
        ref = pipe.split.stages[k].gm
        args = (*values, *(x[j] for j, _ in program.stages[k].data))  # and the model inputs it reads itself
        got = module(*args)
        want = ref(*args)
        assert torch.equal(got, want) if k == 2 else all(torch.equal(a, b) for a, b in zip(got, want))
        values = got if k < 2 else values
    assert torch.equal(got, z.model(*x))


def test_stage_code_uses_the_models_names(tmp_path: Path) -> None:
    _, pipe = _pipe("gpt", stages=2)
    out = pipe.emit(tmp_path)
    src0 = (out / "stage_0.py").read_text()
    assert "self.wte = torch.nn.Embedding(num_embeddings=64, embedding_dim=32)" in src0
    plan = json.loads((out / "plan.json").read_text())
    assert plan["stages"][0]["param_names"]["wte.weight"] == "wte.weight"
    assert plan["tied"], "the tied embedding must be recorded"


def test_modules_that_cant_be_rebuilt_are_refused() -> None:
    class Opaque(torch.nn.Module):
        def __init__(self, scale: float) -> None:
            super().__init__()
            self._s = scale

    with pytest.raises(UnsupportedModelError, match="pd_ctor_kwargs|__main__|inside a function"):
        object_spec(Opaque(2.0))


EXPECTED_SPLIT_DUMP = """\
# Constructed by split-stages
stage 0
  inputs:  x: float32[2,16]
  outputs: layers_2: float32[2,32]
  def forward(self, x):
      layers_0 = self.layers_0(x);  x = None
      layers_1 = self.layers_1(layers_0);  layers_0 = None
      layers_2 = self.layers_2(layers_1);  layers_1 = None
      return (layers_2,)
stage 1
  inputs:  layers_2: float32[2,32]
  outputs: model output float32[2,10]
  def forward(self, layers_2):
      layers_3 = self.layers_3(layers_2);  layers_2 = None
      layers_4 = self.layers_4(layers_3);  layers_3 = None
      layers_5 = self.layers_5(layers_4);  layers_4 = None
      layers_6 = self.layers_6(layers_5);  layers_5 = None
      return layers_6
"""


def test_ir_dumps_exist_for_every_pass_and_match_golden(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDCOMPILE_DUMP", str(tmp_path / "env"))
    _, pipe = _pipe("mlp", stages=2, dump_dir=tmp_path / "ir")
    files = sorted(p.name for p in (tmp_path / "ir").iterdir())
    assert files == [f"{i:02d}_{r.name}.txt" for i, r in enumerate(pipe.records)]
    assert {r.name for r in pipe.records} >= {"trace", "propagate-shapes", "split-stages", "schedule"}
    for f in (tmp_path / "ir").iterdir():
        head = f.read_text().splitlines()[0]
        assert head.startswith(f"# Constructed by {f.stem[3:]} (took ")
    split_file = next((tmp_path / "ir").glob("*_split-stages.txt"))
    text = split_file.read_text()
    text = text.split("\n", 1)[1]
    assert "# Constructed by split-stages\n" + text == EXPECTED_SPLIT_DUMP
    pipe.dump_ir(tmp_path / "again")
    assert sorted(p.name for p in (tmp_path / "again").iterdir()) == files


@pytest.mark.multiproc
def test_a_broken_stage_fails_the_job_fast_naming_rank_and_action(tmp_path: Path) -> None:
    _, pipe = _pipe("mlp", stages=2)
    out = pipe.emit(tmp_path, data={"factory": "pdcompile.zoo:batches", "kwargs": {"name": "mlp"}})
    src = (out / "stage_1.py").read_text().replace(
        "    def forward(self, layers_2):\n", "    def forward(self, layers_2):\n        raise ValueError('boom')\n")
    (out / "stage_1.py").write_text(src)
    t0 = time.monotonic()
    rc, log = run_ranks(out, 2, ["--steps", "3", "--timeout", "20"], timeout=90)
    took = time.monotonic() - t0
    assert rc != 0
    assert "rank 1 (stage 1) failed in action 1F0" in log and "boom" in log
    assert took < 45, f"the job took {took:.0f}s to fail"


RANK_DATA = '''
import os
import torch


def make(batch_size):
    """Minibatches seeded by the rank: what an unseeded shuffle does to --targets local."""
    g = torch.Generator().manual_seed(int(os.environ["RANK"]))
    while True:
        yield (torch.randn(batch_size, 16, generator=g),), torch.randint(0, 10, (batch_size,), generator=g)
'''


@pytest.mark.multiproc
def test_local_targets_refuse_a_data_source_that_differs_between_ranks(tmp_path: Path) -> None:
    from pdcompile.runtime.data import local_targets
    from pdcompile.runtime.program import Program

    _, pipe = _pipe("mlp", stages=2)
    out = pipe.emit(tmp_path / "prog")
    (out / "rank_data.py").write_text(RANK_DATA)
    # auto: the built-in data is local, a user's factory is sent
    prog = Program.load(out)
    auto = lambda **kw: local_targets(prog, argparse.Namespace(**{"targets": "auto", "data": None, **kw}))  # noqa: E731
    assert auto() and not auto(data="rank_data:make")
    # forced local on a source that differs per rank: the first target is compared, the job fails naming the fix
    rc, log = run_ranks(out, 2, ["--steps", "2", "--timeout", "20", "--data", "rank_data:make", "--targets", "local"],
                     timeout=90)
    assert rc != 0 and "differs from the one the first stage read" in log and "--targets send" in log
    rc, log = run_ranks(out, 2, ["--steps", "2", "--timeout", "20", "--data", "rank_data:make"], timeout=90)
    assert rc == 0, log[-2000:]
