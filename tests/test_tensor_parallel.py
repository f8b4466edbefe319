"""Tensor parallelism inside a stage (passes/tensor_parallel.py, runtime/tensor_parallel.py):
which linears the pass splits and what it rewrites, what it refuses, and training with t = 2 on 2
processes and t = 2 x 2 stages on 4 (and t = 2 x 2 replicas), against single-process training of the
same model (the zoo GPT and a small Hugging Face Llama, fp32, gloo), under flush and 1F1B."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from _hf_llama import token_batches
from _tp_common import BATCH, CFG, MICRO, STEPS, assert_trained_like, compile_model, reference_weights, train
from pdcompile import api
from pdcompile.cli import main
from pdcompile.cluster import local_cpu_cluster, paper_cluster
from pdcompile.errors import UsageError
from pdcompile.merge import merge_weights
from pdcompile.runtime.launch import check_args, parse_args
from pdcompile.runtime.program import Program
from pdcompile.zoo.losses import SequenceCrossEntropy


def _compile(kind: str, stages: int | None, schedule: str = "flush", **kw: Any) -> Any:
    return compile_model(kind, stages, schedule, SequenceCrossEntropy(),
                         token_batches(CFG.vocab_size, 1, BATCH, CFG.seq_len), **kw)


# The file's tests run on one xdist worker, one after another, so that a compile two of them make is made once:
# the pass's own tests read the compiles the training tests launch (a compile is read, emitted and deep-copied,
# never changed). Compiling is most of this file's time.
pytestmark = pytest.mark.xdist_group("tensor_parallel")


@functools.lru_cache(maxsize=None)
def _compiled(kind: str, stages: int, schedule: str = "flush", tensor_parallel: int | tuple[int, ...] | None = None,
              replicas: tuple[int, ...] | None = None) -> Any:
    """``_compile`` of these arguments, made once per test process."""
    kw: dict[str, Any] = {}
    if tensor_parallel is not None:
        kw["tensor_parallel"] = tensor_parallel
    if replicas is not None:
        kw["replicas"] = list(replicas)
    return _compile(kind, stages, schedule, **kw)


# --- the pass -----------------------------------------------------------------------------------

def test_gpt_attention_and_mlp_pairs_are_split_and_head_counts_made_local(tmp_path: Path) -> None:
    pipe = _compiled("gpt", 1, tensor_parallel=2)
    tp = pipe.state.tensor_parallel.stages[0]
    assert tp.colwise == ("h_0_attn_c_attn", "h_0_mlp_c_fc", "h_1_attn_c_attn", "h_1_mlp_c_fc")
    assert tp.rowwise == ("h_0_attn_c_proj", "h_0_mlp_c_proj", "h_1_attn_c_proj", "h_1_mlp_c_proj")
    assert dict(tp.fused) == {"h_0_attn_c_attn": 3, "h_1_attn_c_attn": 3}  # q, k, v in one projection
    whole = "\n".join(tp.whole)  # the token embedding and the head (one weight) split by vocabulary
    assert "wpe: position embeddings stay whole" in whole and (tp.embeddings, tp.head) == (("wte",), "lm_head")
    code = pipe.split.stages[0].gm.code
    assert code.count("view(-1, 8, 1, 16)") == 6 and code.count("split(16, dim = 2)") == 2  # 1 head of 2 per rank
    assert code.count("reshape(-1, 8, 16)") == 2
    prog = pipe.emit(tmp_path / "prog")
    plan = json.loads((prog / "plan.json").read_text())
    assert plan["world_size"] == 2 and plan["stages"][0]["ranks"] == [0]  # one pipeline rank, 2 processes
    assert plan["tensor_parallel"]["degree"] == 2
    assert plan["tensor_parallel"]["stages"][0]["fused"] == {"h_0_attn_c_attn": 3, "h_1_attn_c_attn": 3}
    assert "column h_0_attn_c_attn (fused: 3 chunks)" in pipe.explain()
    assert "tensor parallel t=2" in pipe.records[[r.name for r in pipe.records].index("tensor-parallel")].dump


def test_an_exported_llamas_linears_become_modules_under_the_models_names() -> None:
    pipe = _compiled("llama", 2, tensor_parallel=2)
    stages = pipe.state.tensor_parallel.stages  # where the planner cuts (between layers, or inside one) is its own

    def stage_of(k: int, module: str) -> int:  # the stage holding model.layers.k.<module>'s weight
        return next(i for i, st in enumerate(pipe.split.stages)
                    if f"model.layers.{k}.{module}.weight" in st.param_names.values())

    blocks = {"self_attn": (("q_proj", "k_proj", "v_proj"), ("o_proj",)),
              "mlp": (("gate_proj", "up_proj"), ("down_proj",))}
    split_blocks = 0
    for k in (0, 1):
        for block, (cols, rows) in blocks.items():
            where = {stage_of(k, f"{block}.{n}") for n in (*cols, *rows)}
            col = {f"model_layers_{k}_{block}_{n}" for n in cols}
            row = {f"model_layers_{k}_{block}_{n}" for n in rows}
            for s in range(len(stages)):
                got_col, got_row = col & set(stages[s].colwise), row & set(stages[s].rowwise)
                if where == {s}:  # a pair wholly in one stage is split Megatron's way, under the model's names
                    assert (got_col, got_row) == (col, row), (k, block, s)
                    split_blocks += 1
                else:  # a pair the stage boundary cuts stays whole
                    assert not got_col and not got_row, (k, block, s)
        s = stage_of(k, "self_attn.q_proj")
        node = f"model_layers_{k}_self_attn_q_proj"
        assert pipe.split.stages[s].param_names[f"{node}.weight"] == f"model.layers.{k}.self_attn.q_proj.weight"
    assert split_blocks >= 3  # at most one pair is cut by the one boundary
    assert pipe.state.tensor_parallel.stages[1].head == "lm_head"  # a plain cross-entropy: split by vocabulary


class _Pairs(torch.nn.Module):
    """A pair the pass splits (linear, ReLU, linear) and one it can't (a LayerNorm over the split features)."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.act, self.down = torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8)
        self.a, self.norm, self.b = torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.norm(self.a(self.down(self.act(self.up(x))))))


def test_a_part_the_pass_cannot_split_stays_whole_and_the_plan_says_why() -> None:
    pipe = api.pdcompile(_Pairs(), example_inputs=(torch.randn(4, 8),), example_target=torch.randn(4, 8),
                         loss_fn=torch.nn.MSELoss(), stages=1, num_microbatches=2, tensor_parallel=2)
    tp = pipe.state.tensor_parallel.stages[0]
    assert (tp.colwise, tp.rowwise) == (("up",), ("down",))
    assert any(w.startswith("a: ") and "norm" in w for w in tp.whole), tp.whole


def test_degrees_that_do_not_fit_are_refused_with_the_fix() -> None:
    with pytest.raises(UsageError, match=r"tensor_parallel=4 does not divide the 2 heads .* give a degree that divides"):
        _compile("gpt", 1, tensor_parallel=4)
    with pytest.raises(UsageError, match="is the planner's choice, which stages=1 leaves out; give the degree"):
        _compile("gpt", 1, tensor_parallel="auto")
    with pytest.raises(UsageError, match="splits every backward, which tensor parallelism does not run yet"):
        _compile("gpt", 1, "zb-h1", tensor_parallel=2)
    # a hidden size t does not divide
    with pytest.raises(UsageError, match=r"tensor_parallel=4 does not divide the 6 output features of up .* give a "
                                         r"degree that divides the head count and the hidden sizes"):
        api.pdcompile(_Pair(), example_inputs=(torch.randn(4, 8),), example_target=torch.randn(4, 8),
                      loss_fn=torch.nn.MSELoss(), stages=1, num_microbatches=2, tensor_parallel=4)
    # t across a level it does not fit in, whether the planner or the user chooses the stages (refused before
    # any pass: the GPT's 2 heads would refuse t=4 and t=16 too, later)
    for cluster, t, where in ((local_cpu_cluster(2), 4, "processes unit of 2 workers"),
                              (paper_cluster("B"), 16, "gpus-in-server unit of 8 workers")):
        for stages in (None, 1):
            with pytest.raises(UsageError, match=rf"^tensor_parallel={t} does not fit in one {where} .* give a "
                                                 rf"degree that divides"):
                _compile("gpt", stages, tensor_parallel=t, cluster=cluster)
    # replicas of a split stage sharded by FSDP2: not run yet (DTensors on a 2-D mesh), refused at compile (ZeRO-1
    # runs: test_tensor_parallel_ckpt.py trains and checkpoints it)
    with pytest.raises(UsageError, match=r"stage 0 shards its 2 replicas \(shard='full'\) and is split by "
                                         r"tensor_parallel=2, which is not run yet; give shard='optimizer' or 'none'"):
        _compile("gpt", 1, tensor_parallel=2, replicas=[2], shard="full")


class _Pair(torch.nn.Module):
    """A linear pair whose hidden size (6) t = 4 does not divide."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.act, self.down = torch.nn.Linear(8, 6), torch.nn.ReLU(), torch.nn.Linear(6, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(x)))


def test_a_degree_that_does_not_fit_is_one_line_from_the_command_line(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "pdcompile.cli", "emit", "zoo:gpt", "--stages", "1", "--tensor-parallel", "4",
           "--cluster", "local:2", "-o", str(tmp_path / "prog")]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr[-2000:]
    lines = [line for line in p.stderr.splitlines() if line.strip() and "warning" not in line]
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    assert "tensor_parallel=4 does not fit in one processes unit of 2 workers" in lines[0] and "give a degree" in lines[0]
    assert not (tmp_path / "prog").exists()


def test_a_parameter_split_over_a_two_dimensional_mesh_is_refused_by_checkpoints(tmp_path: Path) -> None:
    """runtime/tensor_parallel.py's layouts read parameters split along one dimension of the tensor mesh; a split
    stage's replicas sharded too (refused at compile, above) would put them on a 2-D mesh: our error, not a crash."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from pdcompile.runtime.tensor_parallel import layouts

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        mesh = DeviceMesh("cpu", torch.zeros(1, 1, dtype=torch.int), mesh_dim_names=("data", "tensor"))
        lin = torch.nn.Linear(4, 4)
        lin.weight = torch.nn.Parameter(distribute_tensor(lin.weight.detach(), mesh, [Shard(0), Shard(0)]))
        with pytest.raises(UsageError, match=r"weight: split over .* of a 2-D mesh .* run the stage with shard 'none'"):
            layouts(lin, {"degree": 1})
    finally:
        dist.destroy_process_group()


def test_the_command_line_takes_tensor_parallel(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "prog"
    assert main(["emit", "zoo:gpt", "--stages", "1", "--tensor-parallel", "2", "-o", str(out)]) == 0
    plan = json.loads((out / "plan.json").read_text())
    assert plan["world_size"] == 2 and plan["tensor_parallel"]["degree"] == 2
    assert main(["emit", "zoo:gpt", "--stages", "1", "--tensor-parallel", "auto", "-o", str(tmp_path / "x")]) == 2
    assert main(["plan", "--profile", "pipedream:vgg16", "--cluster", "local:2", "--tensor-parallel", "2"]) == 2
    err = capsys.readouterr().err
    assert "is the planner's choice" in err and "does not say what tensor parallelism splits" in err
    program = Program.load(out)
    with pytest.raises(UsageError, match="split backward of a stage split"):
        check_args(parse_args(["--split-backward"], program), program, world=2)


# --- training: t = 2, and t = 2 x 2 stages -------------------------------------------------------

# (model, stages, schedule, clip, replicas): t = 2 on 2 and 4 processes; the last, (pipeline, data, tensor) = (1, 2, 2)
CASES = [("gpt", 1, "flush", None, 1), ("gpt", 2, "1f1b", None, 1), ("llama", 1, "1f1b", None, 1),
         ("llama", 2, "flush", 0.5, 1), ("gpt", 1, "flush", None, 2)]


@pytest.mark.multiproc
@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind,stages,schedule,clip,reps", CASES,
                         ids=[f"{k}-{s}x{r}x2-{c}" for k, s, c, _, r in CASES])
def test_tensor_parallel_trains_like_one_process(tmp_path: Path, kind: str, stages: int, schedule: str,
                                                 clip: float | None, reps: int) -> None:
    data = token_batches(CFG.vocab_size, STEPS, BATCH, CFG.seq_len)
    replicas = [reps] * stages
    pipe = _compiled(kind, stages, schedule, 2, None if reps == 1 else tuple(replicas))  # one replica: the default
    extra = ["--clip-grad-norm", str(clip)] if clip is not None else []
    prog = train(pipe, tmp_path, data, 2 * stages * reps, extra)
    # one file per pipeline rank (its tensor index 0 writes), gathered whole; index 1 writes its copy of the
    # parameters left whole, which must be index 0's exactly (each index computed their gradients alone)
    files = sorted(p.name for p in (tmp_path / "final").iterdir())
    ranks = [(k, r) for k in range(stages) for r in range(k * reps, (k + 1) * reps)]  # (stage, pipeline rank)
    assert files == sorted([f"stage_{k}.rank_{r}.pt" for k, r in ranks] + [f"stage_{k}.rank_{r}.tensor_1.pt"
                                                                            for k, r in ranks])
    for k, r in ranks:
        zero = torch.load(tmp_path / "final" / f"stage_{k}.rank_{r}.pt", weights_only=True)
        one = torch.load(tmp_path / "final" / f"stage_{k}.rank_{r}.tensor_1.pt", weights_only=True)
        assert one and all(torch.equal(zero[n], t) for n, t in one.items())
        assert len(one) < len([n for n in zero if "weight" in n or "bias" in n])  # some were split
    got = merge_weights(prog, tmp_path / "final")
    norms: list[float] = []
    plain = _compiled(kind, stages, schedule, None, None if reps == 1 else tuple(replicas))
    want, _ = reference_weights(plain, schedule, SequenceCrossEntropy(), data, replicas=replicas, max_norm=clip,
                                norms=norms)
    assert_trained_like(got, want, kind)
    if clip is not None:  # the global norm counts each shard once and each whole parameter once
        metrics = json.loads((tmp_path / "m" / "rank_0.json").read_text())
        assert len(metrics["grad_norms"]) == STEPS and min(norms) > clip  # it clipped
        assert metrics["grad_norms"] == pytest.approx(norms, rel=1e-5)
