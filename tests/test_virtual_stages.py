"""Virtual stages in the runtime: a rank runs several stages (interleaved 1F1B, looped BFS), their
hand-overs in memory, and trains exactly single-process synchronous SGD through torchrun under
NCCL's point-to-point rules (tests/conftest.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

STEPS = 3
MICRO = 4


def _opt(params):  # noqa: ANN001, ANN202
    import torch

    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _emit(tmp: Path, name: str, schedule: str, stages: int, v: int) -> Path:
    from pdcompile.api import pdcompile
    from pdcompile.zoo import get

    z = get(name, batch_size=8, seed=0)
    pipe = pdcompile(z.model, example_inputs=z.example_inputs, example_target=z.target, loss_fn=z.loss_fn,
                     optimizer=_opt, stages=stages, virtual_stages=v, schedule=schedule, num_microbatches=MICRO,
                     leaf_modules=z.leaf_modules)
    return pipe.emit(tmp / "prog", data={"factory": "pdcompile.zoo:batches", "kwargs": {"name": name}})


def _train(prog: Path, out: Path, nproc: int, extra: tuple[str, ...] = ()) -> dict:
    from _ranks import run_ranks
    from pdcompile.merge import merge_weights

    rc, log = run_ranks(prog, nproc, ["--steps", str(STEPS), "--save-final", str(out), "--timeout", "60",
                                       "--trace", str(out / "trace"), "--metrics", str(out / "metrics"), *extra],
                        timeout=150)
    assert rc == 0, log[-3000:]
    return merge_weights(prog, out)


def _reference(name: str) -> tuple[dict, dict]:
    import torch

    from pdcompile.reference import train_sync
    from pdcompile.zoo import batches, get

    z = get(name, batch_size=8, seed=0)
    initial = {k: v.detach().clone() for k, v in z.model.named_parameters()}
    train_sync(z.model, z.loss_fn, _opt(z.model.parameters()), batches(8, name), steps=STEPS, num_microbatches=MICRO)
    return {k: v.detach() for k, v in z.model.named_parameters()}, initial


@pytest.mark.multiproc
@pytest.mark.timeout(300)
# each schedule: tied embeddings (gpt) and a skip connection (resnet), one with sent and one with local
# targets; the plain mlp rows were dropped (nothing they covered is missing: 4 stages of looped-bfs and a
# V's in-memory hand-over run in the gpt rows and test_virtual_stages_train_a_hugging_face_gpt2)
@pytest.mark.parametrize("name,schedule,stages,targets", [
    ("resnet", "interleaved-1f1b", 4, "send"),
    ("resnet", "looped-bfs", 6, "local"),
    ("gpt", "interleaved-1f1b", 4, "local"),  # tied embeddings: stage 0 on rank 0, stage 3 on rank 1
    ("gpt", "looped-bfs", 6, "send"),
    ("resnet", "zb-v", 6, "local"),  # a V: stages 0 and 5 on rank 0 ... (hand-overs in memory)
    ("gpt", "zb-v", 4, "send"),  # both ends of the tied embedding on rank 0: summed there
    ("gpt", "dualpipe-v", 4, "local"),
    ("resnet", "dualpipe-v", 4, "send"),
])
def test_virtual_stages_train_single_process_sgd(tmp_path: Path, name: str, schedule: str, stages: int,
                                                 targets: str) -> None:
    import torch

    from pdcompile.runtime.schedules.spec import ScheduleSpec

    prog = _emit(tmp_path, name, schedule, stages, 2)
    plan = json.loads((prog / "plan.json").read_text())
    p = stages // 2
    place = [[s] if s < p else [stages - 1 - s] for s in range(stages)] if schedule in ("zb-v", "dualpipe-v") else \
        [[s % p] for s in range(stages)]
    assert plan["world_size"] == p and [s["ranks"] for s in plan["stages"]] == place
    got = _train(prog, tmp_path / "final", p, ("--targets", targets))
    want, initial = _reference(name)
    assert set(want) <= set(got)
    for k, w in want.items():
        torch.testing.assert_close(got[k], w, rtol=1e-5, atol=1e-6, msg=f"{name} {schedule}: {k}")
    assert sum(not torch.equal(want[k], initial[k]) for k in want) > len(want) // 2
    # every rank ran exactly the compiled schedule's compute actions, for both its stages
    spec = ScheduleSpec.from_json(plan["schedule"])
    for r in range(p):
        names = [e["name"] for e in json.loads((tmp_path / "final" / "trace" / f"rank_{r}.events.json").read_text())]
        compute = [n for n in names if n[-1].isdigit() and any(k in n for k in "FBW") and not any(k in n for k in "RSV")]
        want_acts = [str(a) for a, _ in spec.rank_run(STEPS, r) if a.kind.value in ("F", "B", "W")]
        assert compute == want_acts
        if name == "gpt":  # tied embeddings: one TG per step on every rank, traced (the rank sums its stages' once)
            assert sum(n.endswith("TG") for n in names) == STEPS, names
        metrics = json.loads((tmp_path / "final" / "metrics" / f"rank_{r}.json").read_text())
        assert metrics["stages"] == [s for s in range(stages) if r in place[s]]
        assert len(metrics["step_times_s"]) == STEPS  # one per step, not one per stage's update


@pytest.mark.multiproc
@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "looped-bfs", "zb-v", "dualpipe-v"])
def test_virtual_stages_train_a_hugging_face_gpt2(tmp_path: Path, schedule: str) -> None:
    """tests/test_hf_models.py's GPT-2 (export front end, LM head tied to the embedding: across ranks
    when interleaved, on rank 0 in a V), 4 stages on 2 ranks: the weights single-process SGD gives."""
    import torch

    hf = pytest.importorskip("test_hf_models")  # its model, data and reference (skips without transformers)
    from pdcompile import api
    from _ranks import run_ranks
    from pdcompile.merge import merge_weights
    from pdcompile.reference import train_sync
    from pdcompile.runtime.data import save_batches
    from pdcompile.zoo.losses import SequenceCrossEntropy

    data, loss_fn = hf._batches("gpt2"), SequenceCrossEntropy()
    (x,), target = data[0]
    m = 4 if schedule == "dualpipe-v" else hf.MICRO  # DualPipeV needs m >= 2p
    pipe = api.pdcompile(hf.gpt2(), example_inputs=(x,), example_target=target, loss_fn=loss_fn, optimizer=hf._opt,
                         stages=4, virtual_stages=2, schedule=schedule, num_microbatches=m,
                         frontend="export")
    save_batches(data, hf.STEPS, tmp_path / "data.pt")
    prog = pipe.emit(tmp_path / "prog", data={"factory": "pdcompile.runtime.data:from_file",
                                              "kwargs": {"path": str(tmp_path / "data.pt")}})
    assert pipe.state.stages is not None and pipe.state.stages.tied  # the LM head is tied to the embedding
    rc, log = run_ranks(prog, 2, ["--steps", str(hf.STEPS), "--save-final", str(tmp_path / "final"), "--timeout", "60"],
                        timeout=150)
    assert rc == 0, log[-3000:]
    got = merge_weights(prog, tmp_path / "final")
    ref = hf.gpt2()
    initial = {k: v.detach().clone() for k, v in ref.named_parameters()}
    train_sync(hf.SelectedOutput(ref), loss_fn, hf._opt(ref.parameters()), data, steps=hf.STEPS,
               num_microbatches=m)
    want = dict(ref.named_parameters())
    for k, w in want.items():
        torch.testing.assert_close(got[k], w.detach(), rtol=1e-5, atol=1e-6, msg=f"gpt2 {schedule}: {k}")
    assert sum(not torch.equal(got[k], initial[k]) for k in want) > len(want) // 2


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_stages_without_parameters_train(tmp_path: Path) -> None:
    """Stages that hold only activations (torch's optimizers refuse an empty parameter list)."""
    import torch

    from pdcompile import pdcompile
    from pdcompile.reference import train_sync
    from pdcompile.runtime.data import save_batches

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.ReLU(), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    data = [((torch.randn(8, 6),), torch.randn(8, 3)) for _ in range(STEPS)]
    pipe = pdcompile(model, example_inputs=data[0][0], example_target=data[0][1], loss_fn=torch.nn.MSELoss(),
                     optimizer=_opt, schedule="interleaved-1f1b", virtual_stages=2, stages=4, num_microbatches=MICRO)
    assert [sum(p.numel() for p in st.gm.parameters()) == 0 for st in pipe.state.stages.stages] == \
        [False, True, True, False]
    save_batches(data, STEPS, tmp_path / "data.pt")
    prog = pipe.emit(tmp_path / "prog", data={"factory": "pdcompile.runtime.data:from_file",
                                              "kwargs": {"path": str(tmp_path / "data.pt")}})
    got = _train(prog, tmp_path / "final", 2)
    train_sync(model, torch.nn.MSELoss(), _opt(model.parameters()), data, steps=STEPS, num_microbatches=MICRO)
    for k, w in model.named_parameters():
        torch.testing.assert_close(got[k], w.detach(), rtol=1e-5, atol=1e-6, msg=k)


def test_virtual_stage_options_are_checked() -> None:
    import torch

    from pdcompile import pdcompile
    from pdcompile.errors import UsageError

    model, x = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(4)]), torch.zeros(4, 4)
    kw = dict(example_inputs=(x,), loss_fn=torch.nn.MSELoss())
    with pytest.raises(UsageError, match="virtual_stages=2 needs a schedule with several stages per rank"):
        pdcompile(model, schedule="flush", virtual_stages=2, **kw)
    with pytest.raises(UsageError, match="stages= a multiple of 2"):
        pdcompile(model, schedule="interleaved-1f1b", virtual_stages=2, stages=3, **kw)
    with pytest.raises(UsageError, match="clip_grad_norm= with schedule='interleaved-1f1b'"):
        pdcompile(model, schedule="interleaved-1f1b", virtual_stages=2, stages=4, clip_grad_norm=1.0, **kw)
    with pytest.raises(UsageError, match="one replica per stage"):
        pdcompile(model, schedule="looped-bfs", virtual_stages=2, stages=4, replicas=[2, 1, 1, 1], **kw)


# the readers of ``programs`` on one worker (tests/conftest.py): compiled once
PROGRAMS_GROUP = pytest.mark.xdist_group("virtual_programs")


@pytest.fixture(scope="module")
def programs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A program with virtual stages and one without (mlp, 4 stages)."""
    import torch

    from pdcompile import pdcompile

    model, x = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(4)]), torch.zeros(8, 4)
    out = {}
    for sched, v in (("interleaved-1f1b", 2), ("flush", 1)):
        pipe = pdcompile(model, example_inputs=(x,), example_target=torch.zeros(8, 4), loss_fn=torch.nn.MSELoss(),
                         schedule=sched, virtual_stages=v, stages=4, num_microbatches=4)
        out[sched] = pipe.emit(tmp_path_factory.mktemp(sched) / "prog")
    return out


@PROGRAMS_GROUP
@pytest.mark.parametrize("which,flags,match", [
    ("interleaved-1f1b", ["--schedule", "flush"], "compiled with several stages per rank"),
    ("flush", ["--schedule", "looped-bfs"], "compiled with one stage per rank"),
    ("interleaved-1f1b", ["--clip-grad-norm", "1"], "--clip-grad-norm with virtual stages"),
])
def test_train_py_refuses_what_virtual_stages_cannot_run(programs: dict[str, Path], which: str, flags: list[str],
                                                          match: str) -> None:
    from pdcompile.errors import UsageError
    from pdcompile.runtime.launch import check_args, parse_args
    from pdcompile.runtime.program import Program

    program = Program.load(programs[which])
    args = parse_args(flags, program)
    with pytest.raises(UsageError, match=match):
        check_args(args, program, world=program.world_size)


@PROGRAMS_GROUP
def test_the_compiled_virtual_program_checks_its_schedule(programs: dict[str, Path]) -> None:
    """plan.json maps stages to ranks as the schedule places them; train.py rebuilds its lists."""
    from pdcompile.runtime.launch import check_args, parse_args
    from pdcompile.runtime.run_schedule import run_schedule
    from pdcompile.runtime.program import Program
    from pdcompile.runtime.schedules.spec import agrees

    program = Program.load(programs["interleaved-1f1b"])
    assert program.world_size == 2 and [st.ranks for st in program.stages] == [(0,), (1,), (0,), (1,)]
    assert [st.index for st in program.stages_of_rank(1)] == [1, 3]
    args = parse_args([], program)
    check_args(args, program, world=2)
    for rank in (0, 1):
        spec = run_schedule(program, args, rank)
        assert spec.virtual_stages == 2 and agrees(spec, program.raw["schedule"], rank)


def test_sent_targets_are_not_refused_with_virtual_stages() -> None:
    """Interleaved on 3 ranks: the targets from rank 0 to rank 2 share that pair with chunk hand-overs
    (stage 2 -> 3 and back); sent a step at a time (tests/test_sent_targets.py) they pair as NCCL
    needs, so train.py runs them. Two ranks, the V placements and one stage per rank too."""
    from pdcompile.runtime.run_schedule import refuse_sent_targets
    from pdcompile.runtime.schedules.spec import ScheduleSpec

    for spec in (ScheduleSpec("interleaved-1f1b", (1,) * 6, 6, virtual_stages=2),
                 ScheduleSpec("interleaved-1f1b", (1,) * 4, 4, virtual_stages=2),
                 ScheduleSpec("looped-bfs", (1,) * 6, 3, virtual_stages=2),
                 ScheduleSpec("zb-v", (1,) * 6, 6, virtual_stages=2), ScheduleSpec("flush", (1,) * 4, 4)):
        refuse_sent_targets(spec)


def _v_ranks(stages: int) -> list[list[int]]:
    """The V placement from ZB-V's definition: stage s on rank min(s, 2p-1-s), p = stages / 2."""
    return [[min(s, stages - 1 - s)] for s in range(stages)]


def test_virtual_stages_inferred_where_the_placement_fixes_them() -> None:
    """``stages=4`` on 2 workers without ``virtual_stages=``: the V schedules admit only 2 per rank, the
    interleaved ones put 4 stages on exactly 2 ranks only with 2: each plans as with ``virtual_stages=2``
    given. Where several counts fit and none exactly on the workers, the error names them."""
    import torch

    from pdcompile import pdcompile
    from pdcompile.cluster import local_cpu_cluster
    from pdcompile.errors import UsageError

    model, x = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(6)]), torch.zeros(4, 4)
    kw: dict = dict(example_inputs=(x,), example_target=torch.zeros(4, 4), loss_fn=torch.nn.MSELoss(),
                    num_microbatches=4)
    two = local_cpu_cluster(2)
    for schedule, want in (("zb-v", _v_ranks(4)), ("dualpipe-v", _v_ranks(4)),
                           ("interleaved-1f1b", [[s % 2] for s in range(4)]), ("looped-bfs", [[s % 2] for s in range(4)])):
        pipe = pdcompile(model, two, schedule=schedule, stages=4, **kw)
        given = pdcompile(model, two, schedule=schedule, stages=4, virtual_stages=2, **kw)
        assert pipe.options.virtual_stages == 2 and pipe.world_size == 2, schedule
        assert [list(st.ranks) for st in pipe.plan.stages] == want, schedule
        assert pipe.state.schedule_spec == given.state.schedule_spec, schedule
        assert pipe.plan.stages == given.plan.stages and pipe.plan.notes == given.plan.notes, schedule
    # a V fixes 2 per rank on any cluster, and without stages= it takes 2 per worker
    assert pdcompile(model, schedule="zb-v", stages=6, **kw).world_size == 3
    assert [list(st.ranks) for st in pdcompile(model, two, schedule="dualpipe-v", **kw).plan.stages] == _v_ranks(4)
    # no inference where the placement has nothing to fix: one stage per rank
    assert pdcompile(model, two, schedule="flush", stages=2, **kw).options.virtual_stages == 1
    assert pdcompile(model, local_cpu_cluster(4), schedule="interleaved-1f1b", stages=4, **kw).world_size == 4
    with pytest.raises(UsageError, match=r"schedule='interleaved-1f1b' with stages=6 on 4 workers: .*give "
                                         r"virtual_stages= 2 \(3 ranks\), 3 \(2 ranks\), 6 \(1 rank\), or stages= "
                                         r"one of 4, 8, 12$"):
        pdcompile(model, local_cpu_cluster(4), schedule="interleaved-1f1b", stages=6, **kw)


def test_cli_infers_virtual_stages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    """``pdcompile emit zoo:mlp --schedule zb-v --stages 4 --cluster local:2`` from a fresh folder, no
    ``--virtual-stages``: the program places the V on 2 ranks. The CLI's main in this process (the
    console script is tests/test_newcomer.py's): no second torch import."""
    from pdcompile.cli import main

    monkeypatch.chdir(tmp_path)
    rc = main(["emit", "zoo:mlp", "--schedule", "zb-v", "--stages", "4", "--cluster", "local:2", "-o", "prog"])
    assert rc == 0, capsys.readouterr().err[-2000:]
    plan = json.loads((tmp_path / "prog" / "plan.json").read_text())
    assert plan["world_size"] == 2 and [s["ranks"] for s in plan["stages"]] == _v_ranks(4)
    assert plan["schedule"]["virtual_stages"] == 2
