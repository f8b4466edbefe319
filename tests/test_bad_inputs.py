"""The bad-input corpus (tests/bad_inputs/): every case refused through the API and the CLI with its error type."""

from __future__ import annotations

import hashlib
import importlib
import json
import pickle
import re
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from pdcompile import errors
from pdcompile.api import pdcompile
from pdcompile.cli import main
from pdcompile.cluster import ClusterSpec
from pdcompile.launcher import launch
from pdcompile.profile import load as load_profile
from pdcompile.runtime import checkpoint
from pdcompile.zoo import get

pytestmark = pytest.mark.timeout(180)

BAD = Path(__file__).resolve().parent / "bad_inputs"
MODELS = BAD / "models"
CLUSTERS = BAD / "clusters"
PROFILES = BAD / "profiles"
if str(MODELS) not in sys.path:
    sys.path.insert(0, str(MODELS))

STEP = "step_00000001"
RUN_TIMEOUT = 120  # seconds per torchrun launch (CI machines are loaded)


# --- how a case is run -----------------------------------------------------------------------

@dataclass
class Ctx:
    """Where a case may write (``out``: must stay empty on failure) and the generated checkpoints."""

    out: Path
    ck: dict[str, Path] = field(default_factory=dict)  # case name -> its checkpoint step folder
    prog_a: Path | None = None  # the program the checkpoints are checked against


@dataclass(frozen=True)
class Case:
    """One bad input: how the API and the CLI meet it, and what they must answer."""

    name: str
    file: str  # under tests/bad_inputs/, or "generated: ..." (checkpoints)
    error: type[errors.PdcompileError]
    causes: tuple[str, ...]  # every one must appear in the message (API and CLI)
    api: Callable[[Ctx], Any]
    cli: Callable[[Ctx], list[str]]
    check_report: bool = False  # CLI is `pdcompile check`: a report on stdout, exit 2
    hangs: bool = False  # a known hang: bounded by a short timeout


def _opt(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05)


def compile_model(module: str, shape: tuple[int, ...] = (8, 16), **kw: Any) -> Any:
    """``pdcompile`` on ``tests/bad_inputs/models/<module>.py``'s ``make()``, 4 classes."""
    made = importlib.import_module(module).make()
    return pdcompile(made, example_inputs=(torch.randn(*shape),), example_target=torch.randint(0, 4, (shape[0],)),
                     loss_fn=torch.nn.CrossEntropyLoss(), optimizer=_opt, **kw)


def compile_mlp(cluster: Any = None, **kw: Any) -> Any:
    z = get("mlp", batch_size=16, seed=0)
    return pdcompile(z.model, cluster, example_inputs=z.example_inputs, example_target=z.target,
                     loss_fn=z.loss_fn, optimizer=_opt, leaf_modules=z.leaf_modules, **kw)


def emit_cli(model: str, *args: str) -> Callable[[Ctx], list[str]]:
    return lambda c: ["emit", model, *args, "-o", str(c.out / "program")]


def model_case(name: str, module: str, construct: str, line: int, source: str, **kw: Any) -> Case:
    """An untraceable model: the fx front end lists the construct with its file, line and source."""
    return Case(name, f"models/{module}.py", errors.UnsupportedModelError,
                (construct, f"{module}.py:{line}", source),
                api=lambda c: compile_model(module, frontend="fx"),
                cli=lambda c: ["check", f"{module}:make", "--input", "8x16"], check_report=True, **kw)


def cluster_case(name: str, causes: tuple[str, ...], **kw: Any) -> Case:
    path = CLUSTERS / f"{name}.toml"
    return Case(f"cluster_{name}", f"clusters/{name}.toml", errors.ClusterSpecError, (f"{name}.toml", *causes),
                api=lambda c: ClusterSpec.from_toml(path),
                cli=emit_cli("zoo:mlp", "--cluster", str(path)), **kw)


def profile_case(file: str, causes: tuple[str, ...], **kw: Any) -> Case:
    path = PROFILES / file
    return Case(f"profile_{file.replace('.', '_')}", f"profiles/{file}", errors.ProfileError, (file, *causes),
                api=lambda c: load_profile(path), cli=lambda c: ["profile", "--show", str(path)], **kw)


def plan_a(c: Ctx) -> dict[str, Any]:
    assert c.prog_a is not None
    return json.loads((c.prog_a / "plan.json").read_text())


def ckpt_case(name: str, causes: tuple[str, ...], api: str = "verify", **kw: Any) -> Case:
    """A checkpoint made at test time and damaged: ``checkpoint.verify`` (or ``load_rank`` of stage 0)
    against program A's plan, and ``pdcompile merge`` with ``--program`` A."""

    def call_api(c: Ctx) -> Any:
        if api == "load_rank":
            return checkpoint.load_rank(c.ck[name], plan_a(c), 0, [_stage_0(c)])
        return checkpoint.verify(c.ck[name], plan_a(c))

    return Case(f"ckpt_{name}", f"generated: {name}", errors.CheckpointError, causes, api=call_api,
                cli=lambda c: ["merge", str(c.ck[name]), "--program", str(c.prog_a), "-o",
                               str(c.out / "merged" / "model.pt")], **kw)


CASES: list[Case] = [
    # untraceable models -------------------------------------------------------------------
    Case("model_data_if", "models/bad_data_if.py", errors.UnsupportedModelError,
         ("data-dependent control flow", "bad_data_if.py:14", "if h.sum() > 0", "neither front end"),
         api=lambda c: compile_model("bad_data_if"),  # the default front end: fx, then torch.export
         cli=emit_cli("bad_data_if:make", "--input", "8x16", "--target", "8:int64:4")),
    model_case("model_while", "bad_while", "data-dependent control flow", 14, "while h.abs().max() > 1", hangs=True),
    model_case("model_len_loop", "bad_len_loop", "iteration over a tensor", 14, "range(len(h))"),
    model_case("model_item", "bad_item", "host sync", 14, ".item()"),
    model_case("model_tolist", "bad_tolist", "host sync", 14, ".tolist()"),
    model_case("model_iter_tensor", "bad_iter_tensor", "iteration over a tensor", 14, "for row in h"),
    Case("model_nontensor_cut", "models/bad_nontensor_cut.py", errors.UsageError,
         ("[partition pass]", "no way to cut the model into 2 stages", "only tensors cross"),
         api=lambda c: compile_model("bad_nontensor_cut", stages=2),
         cli=emit_cli("bad_nontensor_cut:make", "--input", "8x16", "--target", "8:int64:4", "--stages", "2")),
    Case("model_wrong_shape", "models/bad_shape.py", errors.PassError,
         ("'propagate-shapes' pass", "RuntimeError: mat1 and mat2 shapes cannot be multiplied (2x10 and 16x32)"),
         api=lambda c: compile_model("bad_shape", shape=(8, 10)),
         cli=emit_cli("bad_shape:make", "--input", "8x10", "--target", "8:int64:4")),
    Case("model_unrebuildable", "models/bad_unrebuildable.py", errors.UnsupportedModelError,
         ("can't rebuild Scale", "'factor'", "pd_ctor_kwargs"),
         api=lambda c: compile_model("bad_unrebuildable", stages=2,
                                     leaf_modules=[importlib.import_module("bad_unrebuildable").Scale]).emit(
             c.out / "program"),
         cli=emit_cli("bad_unrebuildable:make", "--input", "8x16", "--target", "8:int64:4", "--stages", "2",
                      "--leaf", "bad_unrebuildable.Scale")),
    # cluster specs ------------------------------------------------------------------------
    cluster_case("zero_count", (":8", "levels[0].count", "positive integer (got 0)")),
    cluster_case("negative_count", (":13", "levels[1].count", "(got -2)")),
    cluster_case("negative_bandwidth", (":9", "levels[0].bandwidth", "must be positive")),
    cluster_case("unknown_unit", (":9", "levels[0].bandwidth", "unknown bandwidth unit 'GB/sec'")),
    cluster_case("string_count", (":8", "levels[0].count", "(got 'four')")),
    cluster_case("string_memory", (":4", "device.memory", "'lots'")),
    cluster_case("syntax_error", ("invalid TOML", "line 6")),
    cluster_case("missing_bandwidth", (":6", "levels[0]", "missing key 'bandwidth'")),
    Case("cluster_no_memory", "clusters/no_memory.toml", errors.ClusterSpecError,
         ("[partition pass]", "device.memory: missing", "memory limit"),
         api=lambda c: compile_mlp(ClusterSpec.from_toml(CLUSTERS / "no_memory.toml")),
         cli=emit_cli("zoo:mlp", "--cluster", str(CLUSTERS / "no_memory.toml"))),
    # profiles -----------------------------------------------------------------------------
    profile_case("cycle.txt", ("cycle.txt:8", "has a cycle", "node2", "node4")),
    profile_case("cycle.json", ("reads 'fc2', which comes later", "cycle")),
    profile_case("negative_time.txt", ("negative_time.txt:3", "forward_compute_time=-0.01", "non-negative")),
    profile_case("negative_time.json", ("'fc1'", "backward_s=-0.02", "non-negative")),
    profile_case("missing_node.txt", ("missing_node.txt:4", "'node7'", "no node line")),
    profile_case("missing_node.json", ("'fc2'", "'ghost'", "neither a layer nor a model input")),
    profile_case("malformed_line.txt", ("malformed_line.txt:2", "malformed node line")),
    profile_case("not_a_number.txt", ("not_a_number.txt:2", "'fast' is not a number")),
    profile_case("bad_json.json", ("bad_json.json:3", "invalid JSON")),
    profile_case("string_time.json", ("'fc1'", "forward_s='10 ms'")),
    profile_case("layers_not_list.json", ("layers",)),
    profile_case("overflow.json", ("'fc1'", "forward_s sum to inf", "too large to plan with", "fix the profile's units")),
    profile_case("overflow.txt", ("'node2'", "output_bytes sum to inf", "too large to plan with")),
    profile_case("empty.txt", ("the file is empty (0 bytes)", "pdcompile profile MODEL -o empty.txt")),
    profile_case("empty.json", ("holds only whitespace", "not a profile")),
    Case("plan_overflow_json", "profiles/overflow.json", errors.ProfileError,  # was: numpy overflow warnings, then
         ("overflow.json", "forward_s sum to inf", "too large to plan with"),  # InfeasiblePlanError "fits in 32 B"
         api=lambda c: load_profile(PROFILES / "overflow.json"),
         cli=lambda c: ["plan", "--profile", str(PROFILES / "overflow.json"), "--cluster", "paper:A"]),
    Case("plan_overflow_txt", "profiles/overflow.txt", errors.ProfileError,  # was: planned with inf times, exit 0
         ("overflow.txt", "output_bytes sum to inf"),
         api=lambda c: load_profile(PROFILES / "overflow.txt"),
         cli=lambda c: ["plan", "--profile", str(PROFILES / "overflow.txt"), "--cluster", "paper:A"]),
    Case("profile_unknown_pipedream", "(arguments)", errors.ProfileError,
         ("'pipedream:vgg17'", "no such PipeDream profile", "pipedream:vgg16", "pipedream:gnmt_large"),
         api=lambda c: load_profile("pipedream:vgg17"),
         cli=lambda c: ["plan", "--profile", "pipedream:vgg17", "--cluster", "paper:A"]),
    # infeasible plans and microbatching ---------------------------------------------------
    Case("infeasible_memory", "clusters/tiny_memory.toml", errors.InfeasiblePlanError,
         ("[partition pass]", "fits in 1 KiB per worker", "the smallest per-worker memory that fits"),
         api=lambda c: compile_mlp(ClusterSpec.from_toml(CLUSTERS / "tiny_memory.toml")),
         cli=emit_cli("zoo:mlp", "--cluster", str(CLUSTERS / "tiny_memory.toml"))),
    Case("microbatches_not_dividing", "(arguments)", errors.UsageError,
         ("num_microbatches=3", "must divide the example batch (16)"),
         api=lambda c: compile_mlp(stages=2, num_microbatches=3),
         cli=emit_cli("zoo:mlp", "--stages", "2", "--microbatches", "3")),
    # checkpoints (made by one torchrun run, then damaged) ---------------------------------
    ckpt_case("truncated", ("__1_0.distcp", "checksum mismatch", "corrupt or truncated")),
    ckpt_case("corrupted", ("__0_0.distcp", "checksum mismatch", "SHA-256 differs")),
    ckpt_case("swapped", ("__0_0.distcp", "checksum mismatch")),
    ckpt_case("truncated_manifest", ("manifest.json", "not valid JSON", "truncated or corrupt")),
    ckpt_case("missing_file", ("rank_1.state.pt", "listed in the manifest but missing")),
    ckpt_case("manifest_missing_entry", ("incomplete manifest", "rank_1.state.pt")),
    ckpt_case("other_model", ("a checkpoint of another model", "only in the checkpoint", "layers.0.weight")),
    ckpt_case("no_manifest", ("no manifest.json", "incomplete")),
    ckpt_case("unsafe_pickle", (".metadata", "never unpickle files you don't trust"), api="load_rank"),
]
BY_NAME = {c.name: c for c in CASES}


# --- checkpoints: one real run, then copies damaged one way each ----------------------------

def _emit(folder: Path, stages: int) -> Path:
    z = get("mlp", batch_size=8, seed=0)
    pipe = pdcompile(z.model, example_inputs=z.example_inputs, example_target=z.target, loss_fn=z.loss_fn,
                     optimizer=_opt, stages=stages, schedule="flush", num_microbatches=2,
                     leaf_modules=z.leaf_modules)
    return pipe.emit(folder, data={"factory": "pdcompile.zoo:batches", "kwargs": {"name": "mlp"}})


def _rewrite_manifest(folder: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    path = folder / checkpoint.MANIFEST
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest, indent=1))


def _rehash(folder: Path, name: str) -> Callable[[dict[str, Any]], None]:
    def edit(m: dict[str, Any]) -> None:
        m["files"][name] = {"sha256": checkpoint.sha256_file(folder / name), "bytes": (folder / name).stat().st_size}
    return edit


class NotATensor:
    """A pickled object ``weights_only`` loading must refuse (stands in for a malicious payload)."""

    def __init__(self) -> None:
        self.payload = "anything"


def _stage_0(c: Ctx) -> checkpoint.StagePart:
    """Program A's stage 0 as rank 0 builds it."""
    from pdcompile.runtime.program import Program

    assert c.prog_a is not None
    program = Program.load(c.prog_a)
    module = program.build_stage(0)
    return checkpoint.StagePart(module, _opt(list(module.parameters())), program.stages[0].param_names)


def _other_model_checkpoint(root: Path, prog: Path, step: int) -> Path:
    """A complete checkpoint of another model (a GPT's weights) written with runtime/checkpoint.py's own functions."""
    plan = json.loads((prog / "plan.json").read_text())
    state = checkpoint.RankState(step=step, data_consumed=step, lr_scheduler=None, param_groups=None,
                                 rng=checkpoint.rng_state())
    return checkpoint.write_offline(root, plan, step, get("gpt", batch_size=8, seed=0).model.state_dict(), state,
                                    world_size=2)


@pytest.fixture(scope="session")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> Ctx:
    """Program A (mlp, 2 stages) trained one step with a checkpoint; a copy per checkpoint case, damaged.
    Its tests run on one xdist worker (``bad_ckpt``), so it is made once; its ranks are forked (tests/_ranks.py:
    the checkpoint is what matters here, torchrun's part is test_train_resume_refuses')."""
    from _ranks import run_ranks

    root = tmp_path_factory.mktemp("bad_ckpt")
    prog_a = _emit(root / "prog_a", 2)
    rc, log = run_ranks(prog_a, 2, ["--timeout", "60", "--steps", "1", "--checkpoint-dir", str(root / "ck"),
                                 "--checkpoint-every", "1"], timeout=RUN_TIMEOUT)
    assert rc == 0, log[-3000:]
    good = checkpoint.step_dir(root / "ck", 1)
    checkpoint.verify(good, json.loads((prog_a / "plan.json").read_text()))  # the original is sound
    ck: dict[str, Path] = {}
    for case in CASES:
        if case.name.startswith("ckpt_") and case.name != "ckpt_other_model":
            ck[case.name[5:]] = shutil.copytree(good, root / case.name / STEP)
    w1 = ck["truncated"] / "__1_0.distcp"
    w1.write_bytes(w1.read_bytes()[: w1.stat().st_size // 2])
    w0 = ck["corrupted"] / "__0_0.distcp"
    data = bytearray(w0.read_bytes())
    data[len(data) // 2] ^= 0xFF
    w0.write_bytes(bytes(data))
    a, b = ck["swapped"] / "__0_0.distcp", ck["swapped"] / "__1_0.distcp"
    tmp = a.read_bytes()
    a.write_bytes(b.read_bytes())
    b.write_bytes(tmp)
    m = ck["truncated_manifest"] / checkpoint.MANIFEST
    m.write_text(m.read_text()[: len(m.read_text()) // 2])
    (ck["missing_file"] / "rank_1.state.pt").unlink()
    _rewrite_manifest(ck["manifest_missing_entry"], lambda m: m["files"].pop("rank_1.state.pt"))
    # killed between the stage files and the manifest: rank 0 writes plan.json and the manifest last
    (ck["no_manifest"] / checkpoint.MANIFEST).unlink()
    (ck["no_manifest"] / "plan.json").unlink()
    # DCP's index replaced by another pickled object, with a manifest that vouches for it (checksums can't catch it)
    unsafe = ck["unsafe_pickle"]
    (unsafe / checkpoint.METADATA).write_bytes(pickle.dumps({"fc.weight": NotATensor()}, protocol=2))
    _rewrite_manifest(unsafe, _rehash(unsafe, checkpoint.METADATA))
    # a checkpoint of another model (program A's plan, a GPT's weights)
    ck["other_model"] = _other_model_checkpoint(root / "ck_b", prog_a, 1)
    return Ctx(out=root / "unused", ck=ck, prog_a=prog_a)


def _snapshot(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _ctx(case: Case, tmp_path: Path, request: pytest.FixtureRequest) -> Ctx:
    out = tmp_path / "out"
    out.mkdir()
    if case.name.startswith("ckpt_"):
        made: Ctx = request.getfixturevalue("ckpts")
        return Ctx(out=out, ck={case.name[5:]: made.ck[case.name[5:]]}, prog_a=made.prog_a)
    return Ctx(out=out)


CKPT_GROUP = pytest.mark.xdist_group("bad_ckpt")  # the tests reading ``ckpts``: one worker makes it once


def _params() -> list[Any]:
    """Every case; those that used to hang get a 4 s timeout."""
    return [pytest.param(c, id=c.name, marks=[*([pytest.mark.timeout(4)] if c.hangs else []),
                                              *([CKPT_GROUP] if c.name.startswith("ckpt_") else [])]) for c in CASES]



def _assert_names_cause(case: Case, message: str) -> None:
    for cause in case.causes:
        assert cause in message, f"{case.name}: {cause!r} not in {message!r}"


# --- the tests -------------------------------------------------------------------------------

def test_corpus_is_large_and_indexed() -> None:
    assert len(CASES) >= 25
    index = (BAD / "README.md").read_text()
    for case in CASES:
        assert f"`{case.name}`" in index, f"{case.name} missing from tests/bad_inputs/README.md"
        if not case.file.startswith(("generated", "(")):
            assert (BAD / case.file).is_file(), case.file
    on_disk = {str(p.relative_to(BAD)) for p in BAD.rglob("*") if p.suffix in (".py", ".toml", ".txt", ".json")}
    used = {c.file for c in CASES} | {"profiles/good.json"}
    assert on_disk <= used, f"files in tests/bad_inputs/ no case uses: {sorted(on_disk - used)}"


@pytest.mark.parametrize("case", _params())
def test_api_raises_the_exact_error(case: Case, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    ctx = _ctx(case, tmp_path, request)
    before = _snapshot(ctx.ck[case.name[5:]]) if ctx.ck else None
    with pytest.raises(errors.PdcompileError) as info:
        case.api(ctx)
    assert type(info.value) is case.error, f"{type(info.value).__name__}: {info.value}"
    _assert_names_cause(case, str(info.value))
    assert list(ctx.out.iterdir()) == [], "a failed call left files behind"
    if before is not None:
        assert _snapshot(ctx.ck[case.name[5:]]) == before, "the checkpoint was modified"


def _run_cli(argv: list[str], capfd: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    capfd.readouterr()
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse
        rc = int(e.code or 0)
    out, err = capfd.readouterr()
    return rc, out, err


@pytest.mark.parametrize("case", _params())
def test_cli_exits_2_with_one_error_line(case: Case, tmp_path: Path, request: pytest.FixtureRequest,
                                         capfd: pytest.CaptureFixture[str]) -> None:
    ctx = _ctx(case, tmp_path, request)
    before = _snapshot(ctx.ck[case.name[5:]]) if ctx.ck else None
    rc, out, err = _run_cli(case.cli(ctx), capfd)
    assert rc == 2, f"exit {rc}\nstdout: {out[-2000:]}\nstderr: {err[-2000:]}"
    if case.check_report:  # `pdcompile check`: the findings are its output
        _assert_names_cause(case, out)
        assert err.strip() == "", err
    else:
        lines = [ln for ln in err.splitlines() if ln.strip()]
        head = f"pdcompile: error: {case.error.__name__}: "
        found = [i for i, ln in enumerate(lines) if ln.startswith("pdcompile: error: ")]
        assert len(found) == 1, err[-3000:]
        first = found[0]
        assert lines[first].startswith(head), lines[first]
        message = lines[first] if case.error is not errors.UnsupportedModelError else "\n".join(lines[first:])
        _assert_names_cause(case, message)
        if case.error is not errors.UnsupportedModelError:  # which lists every construct, one a line
            assert first == len(lines) - 1, f"lines after the error line:\n{err}"
        assert "Traceback" not in err and first == 0, f"stderr before the error line:\n{err[-3000:]}"
    assert list(ctx.out.iterdir()) == [], f"a failed command left files behind: {list(ctx.out.rglob('*'))}"
    if before is not None:
        assert _snapshot(ctx.ck[case.name[5:]]) == before, "the checkpoint was modified"


def test_check_report_lists_construct_with_module_line_and_fix(capfd: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run_cli(["check", "bad_iter_tensor:make", "--input", "8x16", "--json"], capfd)
    assert rc == 2
    found = json.loads(out)["constructs"]
    assert found[0]["kind"] == "iteration over a tensor" and found[0]["module"] == ""
    assert "bad_iter_tensor.py:14" in found[0]["where"] and "fixed count" in found[0]["fix"]


def test_emit_failure_keeps_an_existing_program_whole(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """A failed emit into a folder holding a program leaves that program as it was."""
    out = tmp_path / "program"
    assert main(["emit", "zoo:mlp", "--stages", "2", "-o", str(out)]) == 0
    before = _snapshot(out)
    rc, _, err = _run_cli(BY_NAME["model_unrebuildable"].cli(Ctx(out=tmp_path))[:-2] + ["-o", str(out)], capfd)
    assert rc == 2 and "can't rebuild Scale" in err
    assert _snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["program"]  # no temporary sibling left


# --- resume through train.py: refused, nothing written ---------------------------------------

@pytest.mark.multiproc
@CKPT_GROUP
@pytest.mark.parametrize("name,causes", [
    ("truncated", ("rank 1: CheckpointError", "__1_0.distcp", "checksum mismatch")),
    ("other_model", ("CheckpointError", "a checkpoint of another model", "only in the checkpoint")),
])
def test_train_resume_refuses(name: str, causes: tuple[str, ...], ckpts: Ctx, tmp_path: Path) -> None:
    assert ckpts.prog_a is not None
    folder = ckpts.ck[name]
    ck_dir = tmp_path / "ck"
    shutil.copytree(folder, ck_dir / STEP)  # resume picks the newest complete checkpoint in ck_dir
    args = ["--resume", str(ck_dir / STEP)] if name == "other_model" else ["--resume"]  # a step folder, or newest
    before = _snapshot(ck_dir)
    rc, log = launch(ckpts.prog_a, 2, ["--timeout", "60", "--steps", "3", "--checkpoint-dir", str(ck_dir),
                                       "--checkpoint-every", "1", "--save-final", str(tmp_path / "final"), *args],
                     timeout=RUN_TIMEOUT)
    assert rc != 0, log[-3000:]
    # the refusing rank exits 2 (torchrun may SIGTERM the other one before it exits on its own)
    codes = re.findall(r"exitcode\s+:\s*(-?\d+) \(pid", log)
    assert "2" in codes and set(codes) <= {"2", "-15"}, log[-3000:]
    for cause in causes:
        assert cause in log, f"{cause!r} not in the log:\n{log[-3000:]}"
    for rank in (0, 1):  # a rank says why in one line; no traceback from the program (torchrun adds its own)
        assert len(re.findall(rf"^train\.py: rank {rank}: CheckpointError: ", log, re.M)) <= 1, log[-3000:]
    assert not re.search(r'File ".*(train\.py|/runtime/|/pdcompile/)', log), log[-3000:]
    assert not (tmp_path / "final").exists(), "a refused resume still saved final weights"
    assert _snapshot(ck_dir) == before, "a refused resume changed the checkpoint folder"
    assert "resumed from" not in log


# --- train.py's flags: refused before anything starts (with or without torchrun) ------------

@dataclass(frozen=True)
class TrainCase:
    """A train.py command line that cannot train: exit 2 and one ``train.py: error:`` line."""

    name: str
    argv: tuple[str, ...]
    causes: tuple[str, ...]
    world: int | None = None  # WORLD_SIZE as torchrun would set it (None: run as plain `python train.py`)


TRAIN_CASES: list[TrainCase] = [
    TrainCase("train_steps_negative", ("--steps", "-3"), ("--steps -3", "must be an integer >= 1")),  # was: exit 0
    TrainCase("train_steps_zero", ("--steps", "0"), ("--steps 0", ">= 1")),
    TrainCase("train_microbatches_zero", ("--microbatches", "0"), ("--microbatches 0", ">= 1")),
    TrainCase("train_checkpoint_every_negative", ("--checkpoint-every", "-1", "--checkpoint-dir", "ck"),
              ("--checkpoint-every -1", ">= 0")),
    TrainCase("train_checkpoint_every_without_dir", ("--checkpoint-every", "2"), ("needs --checkpoint-dir",)),
    TrainCase("train_timeout_zero", ("--timeout", "0"), ("--timeout 0.0", "positive number of seconds")),
    TrainCase("train_timeout_nan", ("--timeout", "nan"), ("--timeout nan", "positive number of seconds")),
    TrainCase("train_schedule_unknown", ("--schedule", "zigzag"), ("--schedule 'zigzag'", "1f1b", "gpipe")),
    TrainCase("train_world_without_torchrun", ("--steps", "2"),
              ("needs 2 processes", "this job has 1", "torchrun --nproc-per-node=2")),  # was: exit 1
    TrainCase("train_world_mismatch", ("--steps", "2"), ("needs 2 processes", "this job has 3"), world=3),
]


# the readers of ``two_stage_program`` on one worker (tests/conftest.py): compiled once
PROGRAM_GROUP = pytest.mark.xdist_group("bad_train_flags")


@pytest.fixture(scope="module")
def two_stage_program(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-stage MLP program (flush, 2 microbatches) for train.py's flag checks."""
    return _emit(tmp_path_factory.mktemp("train_flags") / "prog", 2)


def test_train_cases_are_indexed() -> None:
    index = (BAD / "README.md").read_text()
    for case in TRAIN_CASES:
        assert f"`{case.name}`" in index, f"{case.name} missing from tests/bad_inputs/README.md"


@PROGRAM_GROUP
def test_default_train_flags_pass_the_check(two_stage_program: Path) -> None:
    """The check refuses only what cannot train: every default, and the plan's own process count, pass."""
    from pdcompile.runtime.launch import check_args, parse_args
    from pdcompile.runtime.program import Program

    program = Program.load(two_stage_program)
    check_args(parse_args([], program), program, world=2)
    check_args(parse_args(["--steps", "1", "--checkpoint-every", "1", "--checkpoint-dir", "ck", "--schedule", "1f1b",
                           "--microbatches", "4", "--timeout", "0.5"], program), program, world=2)
    with pytest.raises(errors.UsageError, match="this job has 1"):
        check_args(parse_args([], program), program, world=1)


# run as a user runs them: `python train.py FLAGS` in a fresh process (the two that once exited 0 and 1);
# the others call the same entry point in this process (a process start costs 3-5 s of the suite's budget)
TRAIN_IN_PROCESS = {"train_steps_negative", "train_world_without_torchrun"}


@PROGRAM_GROUP
@pytest.mark.parametrize("case", TRAIN_CASES, ids=lambda c: c.name)
def test_train_py_refuses_bad_flags(case: TrainCase, two_stage_program: Path, tmp_path: Path,
                                    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """``python train.py FLAGS`` (no torchrun): exit 2, one line naming the flag and the fix, nothing written."""
    import os
    import subprocess

    from pdcompile.runtime import launch

    torchrun_env = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    argv = [*case.argv, "--save-final", "final", "--metrics", "metrics"]
    if case.name in TRAIN_IN_PROCESS:
        env = {k: v for k, v in os.environ.items() if k not in torchrun_env}
        if case.world is not None:
            env.update(WORLD_SIZE=str(case.world), RANK="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE=str(case.world))
        p = subprocess.run([sys.executable, str(two_stage_program / "train.py"), *argv], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=120)
        code, out, err = p.returncode, p.stdout, p.stderr
    else:
        for k in torchrun_env:
            monkeypatch.delenv(k, raising=False)
        if case.world is not None:
            for k, v in dict(WORLD_SIZE=str(case.world), RANK="0", LOCAL_RANK="0",
                             LOCAL_WORLD_SIZE=str(case.world)).items():
                monkeypatch.setenv(k, v)
        monkeypatch.chdir(tmp_path)

        def no_group(*a: object, **k: object) -> None:
            raise AssertionError("train.py went on to form a process group: the flags were not refused")

        monkeypatch.setattr(launch, "init_process_group", no_group)
        capsys.readouterr()
        with pytest.raises(SystemExit) as exited:
            launch.main(two_stage_program, argv)
        code = exited.value.code
        out, err = capsys.readouterr()
    assert code == 2, f"exit {code}\n{err[-2000:]}"
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("train.py: error: "), err[-2000:]
    for cause in case.causes:
        assert cause in lines[0], f"{cause!r} not in {lines[0]!r}"
    assert out == "" and list(tmp_path.iterdir()) == [], "a refused run wrote something"


@pytest.mark.multiproc
@PROGRAM_GROUP
def test_train_py_wrong_process_count_under_torchrun(two_stage_program: Path, tmp_path: Path) -> None:
    """A 2-rank plan started on 1 process: the rank exits 2 (bad input) with one line, before any group forms."""
    rc, log = launch(two_stage_program, 1, ["--steps", "2", "--save-final", str(tmp_path / "final")],
                     timeout=RUN_TIMEOUT)
    assert rc != 0
    assert re.findall(r"exitcode\s*:\s*(-?\d+)", log) in (["2"], ["2", "2"]), log[-3000:]
    assert log.count("train.py: error: plan.json needs 2 processes, this job has 1") == 1, log[-3000:]
    assert "[rank0]: Traceback" not in log and not (tmp_path / "final").exists()


# --- misspelt keywords (issue 29 item 5) -------------------------------------------------------

def test_misspelt_option_names_the_one_meant() -> None:
    """An unknown keyword to ``pdcompile()`` is our UsageError naming the closest option and listing every
    option (the signature's and :class:`Options`' fields), not Python's TypeError."""
    from dataclasses import fields

    from pdcompile.api import Options

    z = get("mlp", batch_size=16, seed=0)
    with pytest.raises(errors.UsageError) as e:
        pdcompile(z.model, example_inputs=z.example_inputs, loss_fn=z.loss_fn, shedule="flush")
    msg = str(e.value)
    assert "\n" not in msg and "unknown option shedule=" in msg and "did you mean schedule=?" in msg, msg
    listed = msg.split("valid options: ")[1].split(", ")
    internal = {f.name for f in fields(Options) if f.metadata.get("internal")}
    assert internal >= {"csv_text", "also_rate"}  # set by pdcompile itself, never listed to the user
    assert {f.name for f in fields(Options)} - internal <= set(listed), msg
    assert {"example_inputs", "dump_dir"} <= set(listed) and not internal & set(listed), msg
    with pytest.raises(errors.UsageError, match=r"unknown option virtual_stage=; did you mean virtual_stages=\?"):
        pdcompile(example_inputs=z.example_inputs, loss_fn=z.loss_fn, virtual_stage=2)  # the decorator form too


def test_misspelt_emit_and_run_keywords_name_the_one_meant(tmp_path: Path) -> None:
    """``emit()``/``run()``/``simulate()``: the same error, before anything is written or launched."""
    import inspect

    pipe = compile_mlp()
    z = get("mlp", batch_size=16, seed=0)
    with pytest.raises(errors.UsageError, match=r"^emit: unknown option traget=; did you mean target=\? ") as e:
        pipe.emit(tmp_path / "program", traget=z.target)
    # the list is emit's own parameters, however many it has
    assert str(e.value).split("valid options: ")[1].split(", ") == sorted(inspect.signature(pipe.emit).parameters)
    with pytest.raises(errors.UsageError, match=r"^run: unknown option timout=; did you mean timeout=\?"):
        pipe.run([(z.example_inputs, z.target)], steps=1, out=tmp_path / "run", timout=5)
    with pytest.raises(errors.UsageError, match=r"^simulate: unknown option num_microbatch=; did you mean "
                                                r"num_microbatches=\?"):
        pipe.simulate(num_microbatch=2)
    assert list(tmp_path.iterdir()) == []
    # extra_args= are train.py's flags, checked as its ranks would before any starts
    with pytest.raises(errors.UsageError, match=r"train.py: error: unrecognized arguments: --no-such-flag\. Fix"):
        pipe.run([(z.example_inputs, z.target)], steps=1, out=tmp_path / "run", extra_args=["--no-such-flag"])
    assert not (tmp_path / "run" / "train.log").exists()
