"""ZB-H1 (zero bubble, handcrafted, at 1F1B's memory): its order, validation, transfers under
NCCL's rules, the simulator's bubble against the paper's closed form, and training through torchrun
equal to single-process SGD (and bitwise to flush's unsplit backwards)."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import pytest
from _schedule_edits import move

from pdcompile.errors import ScheduleError
from pdcompile.runtime.schedules import (
    Action,
    Kind,
    check_transfers,
    format_grid,
    make_schedule,
    peak_in_flight,
    policy,
    transfer_plan,
    validate,
)
from pdcompile.simulate import simulate_schedule

# ------------------------------------------------------------------------------------------------
# the order


def test_golden_zb_h1_4_stages_8_microbatches() -> None:
    # the paper's Figure 3 (top): 1F1B's F and B, stage s holds back s weight passes, which fill
    # the drain (the last stage runs F B pairs until 4 microbatches are held, then B W F)
    assert format_grid(make_schedule("zb-h1", [1, 1, 1, 1], 8)) == """\
rank 0: 0F0 0F1 0F2 0F3 0B0 0W0 0F4 0B1 0W1 0F5 0B2 0W2 0F6 0B3 0W3 0F7 0B4 0W4 0B5 0W5 0B6 0W6 0B7 0W7 0ST
rank 1: 1F0 1F1 1F2 1B0 1F3 1B1 1W0 1F4 1B2 1W1 1F5 1B3 1W2 1F6 1B4 1W3 1F7 1B5 1W4 1B6 1W5 1B7 1W6 1W7 1ST
rank 2: 2F0 2F1 2B0 2F2 2B1 2F3 2B2 2W0 2F4 2B3 2W1 2F5 2B4 2W2 2F6 2B5 2W3 2F7 2B6 2W4 2B7 2W5 2W6 2W7 2ST
rank 3: 3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3W0 3F4 3B4 3W1 3F5 3B5 3W2 3F6 3B6 3W3 3F7 3B7 3W4 3W5 3W6 3W7 3ST"""
    # B is sent at once; W follows later, with nothing to send
    row1 = [str(a) for a in make_schedule("zb-h1", [1, 1], 2)[1]]
    assert row1 == ["1RF0", "1F0", "1B0", "1SB0", "1RF1", "1F1", "1B1", "1SB1", "1W0", "1W1", "1ST"]


def test_zb_h1_policy() -> None:
    p = policy("zb-h1")
    assert p.synchronous and p.splits_every_backward and p.version_lag == 0 and not p.update_per_microbatch
    assert [p.held([1] * 4, s, 8) for s in range(4)] == [4, 4, 4, 4]  # 1F1B's first stage, on every stage
    assert [p.in_flight([1] * 4, s, 8) for s in range(4)] == [4, 3, 2, 1]  # F..B as in 1F1B
    assert not policy("flush").splits_every_backward


CONFIGS = [(reps, m, steps) for reps in ([1], [1, 1], [1, 1, 1], [1, 1, 1, 1], [1] * 6, [2, 1], [1, 2], [2, 2],
                                         [1, 3, 1], [3, 1, 2])
           for m in (1, 2, 3, 4, 5, 8) for steps in (1, 3)]


@pytest.mark.parametrize("replicas,m,steps", CONFIGS)
def test_zb_h1_validates_and_completes_under_nccl_rules(replicas: list[int], m: int, steps: int) -> None:
    for tied in (False, True):
        sched = make_schedule("zb-h1", replicas, m, tied=tied, num_steps=steps)
        validate(sched, replicas, m, "zb-h1", num_steps=steps)  # rule 11 runs check_transfers too
        posts = transfer_plan(sched, replicas)
        for targets in (None, (), range(replicas[-1])):
            check_transfers(sched, replicas, posts, targets=targets, name="zb-h1")
    # every F and B of every stage has its W, after the B and before the step; no more held than promised
    for r, acts in sched.items():
        pos = {(a.kind, a.microbatch): i for i, a in enumerate(acts)}
        steps_at = [i for i, a in enumerate(acts) if a.kind is Kind.STEP]
        for (kind, k), b in pos.items():
            if kind is Kind.BACKWARD:
                w = pos[(Kind.WEIGHT_GRAD, k)]
                assert b < w < min(i for i in steps_at if i > b)
        held = most = 0
        for a in acts:
            held += (a.kind is Kind.FORWARD) - (a.kind is Kind.WEIGHT_GRAD)
            most = max(most, held)
        s = acts[0].stage
        assert most <= policy("zb-h1").held(replicas, s, m)
    # F..B in flight stays 1F1B's
    flush_peak = peak_in_flight(make_schedule("flush", replicas, m, num_steps=steps))
    assert peak_in_flight(sched) == flush_peak




def _rule(sched: dict, replicas: list[int], m: int) -> str:
    with pytest.raises(ScheduleError) as err:
        validate(sched, replicas, m, "zb-h1")
    return str(err.value)


def test_validate_rejects_broken_zb_h1() -> None:
    sched = make_schedule("zb-h1", [1, 1, 1], 4)
    ok = dict(sched)
    # W before its B
    msg = _rule({**ok, 1: move(sched[1], "1W2", "1B2")}, [1, 1, 1], 4)
    assert "breaks rule 'split backward'" in msg and "1W2 must come after" in msg
    # W after the update that needs its gradient
    msg = _rule({**ok, 2: move(sched[2], "2W3", None) + [Action.from_str("2W3")]}, [1, 1, 1], 4)
    assert "breaks rule 'split backward'" in msg and "comes after 2ST" in msg
    # a W missing (every backward is split here)
    msg = _rule({**ok, 0: move(sched[0], "0W1", None)}, [1, 1, 1], 4)
    assert "breaks rule 'split backward'" in msg and "0W1 is missing" in msg
    # W's all held back to the step: more microbatches held than 1F1B's memory
    late = [a for a in sched[0] if a.kind is not Kind.WEIGHT_GRAD]
    late = late[:-1] + [Action(0, Kind.WEIGHT_GRAD, k) for k in range(4)] + late[-1:]
    msg = _rule({**ok, 0: late}, [1, 1, 1], 4)
    assert "breaks rule 'in-flight bound'" in msg and "held" in msg
    # stage 0's W stays refused where splitting is optional (flush)
    plain = make_schedule("flush", [1, 1], 2, split_backward=False)
    with pytest.raises(ScheduleError, match="stage 0 sends no input gradients"):
        validate({0: plain[0][:-1] + [Action.from_str("0W1"), plain[0][-1]], 1: plain[1]}, [1, 1], 2, "flush")


# ------------------------------------------------------------------------------------------------
# simulator: the paper's closed form


@pytest.mark.parametrize("p", [2, 3, 4, 6])
@pytest.mark.parametrize("f,b,w", [(1, 1, 1), (2, 2, 1), (1, 2, 1), (3, 2, 2), (1, 1, Fraction(1, 2))])
def test_zb_h1_makespan_is_the_papers_closed_form(p: int, f: Fraction, b: Fraction, w: Fraction) -> None:
    """Equal stages, F, B (input gradients), W (weight gradients) per microbatch, free transfers,
    m >= p: ZB-H1 takes m (F + B + W) + (p - 1)(F + B - W) (Qi et al. §3.1), 1F1B (flush, unsplit)
    (m + p - 1)(F + B + W): with F = B = W a bubble of (p - 1) / (3m) against 1F1B's (p - 1) / m."""
    f, b, w = Fraction(f), Fraction(b), Fraction(w)
    for m in (p, 2 * p + 1, 3 * p):
        zb = simulate_schedule("zb-h1", [1] * p, m, forward_s=f, backward_s=b + w, input_grad_s=b, weight_grad_s=w)
        one = simulate_schedule("flush", [1] * p, m, forward_s=f, backward_s=b + w, split_backward=False)
        assert zb.makespan_s == m * (f + b + w) + (p - 1) * (f + b - w)
        assert one.makespan_s == (m + p - 1) * (f + b + w)
        if f == b == w:
            assert (zb.makespan_s - m * (f + b + w)) / (m * (f + b + w)) == Fraction(p - 1, 3 * m)
        # memory: activations held until W, p on every stage (1F1B's first stage)
        assert zb.peak_in_flight == [p] * p and max(one.peak_in_flight) == p


def test_zb_h1_few_microbatches_is_its_critical_path() -> None:
    # m < p, F = B = W = 1: the first F reaches the last stage at p - 1, which then runs m F B pairs
    # back to back (2m); the last B travels back through p - 1 stages; stage 0 ends with its W
    for p in (3, 4, 6):
        for m in range(1, p):
            zb = simulate_schedule("zb-h1", [1] * p, m, forward_s=1, backward_s=2, input_grad_s=1, weight_grad_s=1)
            assert zb.makespan_s == 2 * p + 2 * m - 1


# ------------------------------------------------------------------------------------------------
# through torchrun (NCCL's point-to-point rules on: tests/conftest.py)

STEPS = 5
MICRO = 4  # >= stages: the steady state, where W's are held back, is reached


def _opt(params):  # noqa: ANN001, ANN202
    import torch

    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _emit(tmp: Path, name: str, stages: int, replicas: list[int] | None = None) -> Path:
    from pdcompile.api import pdcompile
    from pdcompile.zoo import get

    z = get(name, batch_size=8, seed=0)
    pipe = pdcompile(z.model, example_inputs=z.example_inputs, example_target=z.target, loss_fn=z.loss_fn,
                     optimizer=_opt, stages=stages, schedule="zb-h1", num_microbatches=MICRO,
                     leaf_modules=z.leaf_modules, replicas=replicas)
    assert "0W0" in format_grid(pipe.state.schedule)  # stage 0 splits too
    return pipe.emit(tmp / "prog", data={"factory": "pdcompile.zoo:batches", "kwargs": {"name": name}})


def _train(prog: Path, out: Path, nproc: int, extra: tuple[str, ...] = ()) -> dict:
    from _ranks import run_ranks
    from pdcompile.merge import merge_weights

    rc, log = run_ranks(prog, nproc, ["--steps", str(STEPS), "--save-final", str(out), "--timeout", "60",
                                       "--trace", str(out / "trace"), *extra], timeout=150)
    assert rc == 0, log[-3000:]
    return merge_weights(prog, out)


# the readers of ``gpt_zb`` on one worker (tests/conftest.py): its 4-rank launch is made once
GPT_ZB_GROUP = pytest.mark.xdist_group("gpt_zb")


@pytest.fixture(scope="module")
def gpt_zb(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict]:
    """GPT on 4 ranks under zb-h1 (tied embedding: stage 0 and stage 3), trained once: (program, its
    output folder, merged weights); read by the single-process check and the bitwise-flush check."""
    tmp = tmp_path_factory.mktemp("gpt_zb")
    prog = _emit(tmp, "gpt", 4)
    return prog, tmp / "final", _train(prog, tmp / "final", 4)


@pytest.mark.multiproc
@pytest.mark.timeout(300)
# the plain 2-stage mlp row was dropped: the replicated mlp row and test_graph_split's 2-rank zb-h1 runs cover it
@pytest.mark.parametrize("name,stages,replicas", [("resnet", 3, None), pytest.param("gpt", 4, None, marks=GPT_ZB_GROUP),
                                                  ("mlp", 2, [2, 1])])
def test_zb_h1_trains_single_process_sgd(tmp_path: Path, request: pytest.FixtureRequest, name: str, stages: int,
                                         replicas: list[int] | None) -> None:
    import json

    import torch

    from pdcompile.reference import train_sync
    from pdcompile.zoo import batches, get

    reps = replicas or [1] * stages
    if name == "gpt":  # the launch test_zb_h1_is_bitwise_flush_with_unsplit_backwards compares with flush
        prog, out, got = request.getfixturevalue("gpt_zb")
    else:
        prog, out = _emit(tmp_path, name, stages, replicas), tmp_path / "final"
        got = _train(prog, out, sum(reps))
    z = get(name, batch_size=8, seed=0)
    initial = {k: v.detach().clone() for k, v in z.model.named_parameters()}
    train_sync(z.model, z.loss_fn, _opt(z.model.parameters()), batches(8, name), steps=STEPS, num_microbatches=MICRO)
    want = dict(z.model.named_parameters())
    for k, w in want.items():
        torch.testing.assert_close(got[k], w.detach(), rtol=1e-5, atol=1e-6, msg=f"{name}: {k}")
    assert sum(not torch.equal(want[k].detach(), initial[k]) for k in want) > len(want) // 2
    # every rank ran a W for every microbatch, where the schedule puts them (a replicated stage
    # all-reduces after its last W)
    sched = make_schedule("zb-h1", reps, MICRO, num_steps=STEPS)
    for r in range(sum(reps)):
        names = [e["name"] for e in json.loads((out / "trace" / f"rank_{r}.events.json").read_text())]
        assert [n for n in names if "W" in n and "WV" not in n] == \
               [str(a) for a in sched[r] if a.kind is Kind.WEIGHT_GRAD] and len(sched[r]) > 0


@pytest.mark.multiproc
@pytest.mark.timeout(300)
@GPT_ZB_GROUP
def test_zb_h1_is_bitwise_flush_with_unsplit_backwards(tmp_path: Path, gpt_zb: tuple[Path, Path, dict]) -> None:
    """Every backward split (stage 0's too) and the W's delayed: the weights are bitwise those of
    flush with plain backwards (the same gradients, accumulated in the same microbatch order)."""
    import torch

    prog, _, zb = gpt_zb
    plain = _train(prog, tmp_path / "flush", 4, ("--schedule", "flush", "--no-split-backward"))
    assert zb.keys() == plain.keys()
    for k in zb:
        assert torch.equal(zb[k], plain[k]), f"{k} differs between zb-h1 and flush"


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_zb_h1_trains_a_hugging_face_gpt2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """tests/test_hf_models.py's GPT-2 (export front end, tied LM head), launched with --schedule
    zb-h1: the weights single-process SGD gives."""
    import torch

    hf = pytest.importorskip("test_hf_models")  # its model, data and reference (skips without transformers)
    from _ranks import run_ranks
    from pdcompile.merge import merge_weights
    from pdcompile.reference import train_sync
    from pdcompile.runtime.data import save_batches
    from pdcompile.zoo.losses import SequenceCrossEntropy

    data, loss_fn = hf._batches("gpt2"), SequenceCrossEntropy()
    pipe = hf._compile(hf.gpt2(), data, loss_fn, monkeypatch)
    save_batches(data, hf.STEPS, tmp_path / "data.pt")
    prog = pipe.emit(tmp_path / "prog", data={"factory": "pdcompile.runtime.data:from_file",
                                              "kwargs": {"path": str(tmp_path / "data.pt")}})
    rc, log = run_ranks(prog, 2, ["--schedule", "zb-h1", "--steps", str(hf.STEPS), "--save-final",
                                  str(tmp_path / "final"), "--timeout", "60", "--trace", str(tmp_path / "trace")],
                        timeout=150)
    assert rc == 0, log[-3000:]
    import json

    names = [e["name"] for e in json.loads((tmp_path / "trace" / "rank_0.events.json").read_text())]
    assert "0W0" in names  # zb-h1 ran: stage 0 splits its backwards too
    got = merge_weights(prog, tmp_path / "final")
    ref = hf.gpt2()
    initial = {k: v.detach().clone() for k, v in ref.named_parameters()}
    train_sync(hf.SelectedOutput(ref), loss_fn, hf._opt(ref.parameters()), data, steps=hf.STEPS,
               num_microbatches=hf.MICRO)
    want = dict(ref.named_parameters())
    for k, w in want.items():
        torch.testing.assert_close(got[k], w.detach(), rtol=1e-5, atol=1e-6, msg=f"gpt2: {k}")
    assert sum(not torch.equal(got[k], initial[k]) for k in want) > len(want) // 2
