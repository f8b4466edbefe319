"""staleness= (runtime/staleness.py): PipeMare's learning-rate rescheduling and weight prediction for
1F1B and 2BW, exact against the formulas. Without a launch: each formula on the optimizer's own state
against an independent float64 reference, the rate of each step against the closed form, each stage's
delay against PipeDream's in-flight counts. With launches: predicted 1F1B (a replicated stage, AdamW
with weight decay, resumed from a checkpoint), predicted 2BW (momentum SGD) and PipeMare's 1F1B
against PipeDream's reference run with the same corrections; a delay of 0 trains bitwise as plain 1F1B."""

from __future__ import annotations

import functools
import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from _ranks import run_ranks
from pdcompile import reference
from pdcompile.api import pdcompile
from pdcompile.errors import UsageError
from pdcompile.runtime import staleness
from pdcompile.runtime.program import Program, build
from pdcompile.runtime.schedules.spec import ScheduleSpec, stage_delays
from pdcompile.runtime.weights import VersionedStore
from pdcompile.zoo import batches, get

pytestmark = pytest.mark.timeout(600)

M = 2


# ---- the formulas, independently: float64, from the papers' definitions -----------------------------

def _want(opt: torch.optim.Optimizer, module: torch.nn.Module, delay: int,
          scale: float = 1.0) -> dict[str, torch.Tensor]:
    """W - delay * lr * D in float64 for every parameter of ``module`` (D: Adam's m_hat / (sqrt(v_hat) +
    eps) [+ AdamW's weight_decay * W], momentum SGD's buffer; no state yet: W); ``lr`` times ``scale``."""
    out = {}
    for g in opt.param_groups:
        names = {id(p): n for n, p in module.named_parameters()}
        for p in g["params"]:
            w, st = p.detach().double(), opt.state.get(p, {})
            if "exp_avg" in st:
                t = float(st["step"])
                b1, b2 = g["betas"]
                m_hat = st["exp_avg"].double() / (1 - b1 ** t)
                v_hat = st["exp_avg_sq"].double() / (1 - b2 ** t)
                d = m_hat / (v_hat.sqrt() + g["eps"])
                if g.get("decoupled_weight_decay"):
                    d = d + g["weight_decay"] * w
            elif "momentum_buffer" in st:
                d = st["momentum_buffer"].double()
            else:
                d = torch.zeros_like(w)
            out[names[id(p)]] = (w - delay * g["lr"] * scale * d).float()
    return out


def _pipemare(lr: float, delay: int, t: float, k: float) -> float:
    """PipeMare's rate: lr / tau^(1 - min(t / K, 1)), tau = max(delay, 1)."""
    return lr / max(delay, 1) ** (1 - min(t / k, 1))


def _stepped(make: Any, steps: int, seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))
    opt = make(m.parameters())
    for _ in range(steps):
        for p in m.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
    return m, opt


OPTIMIZERS = {
    "adam": functools.partial(torch.optim.Adam, lr=0.01, weight_decay=0.05),  # coupled: in m and v
    "adamw": functools.partial(torch.optim.AdamW, lr=0.01, weight_decay=0.1),
    "momentum": functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9, weight_decay=0.01),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("steps", [0, 1, 5])
def test_predicted_weights_are_the_formula(name: str, steps: int) -> None:
    """The predictor on the optimizer's own (p, m, v, step, lr) equals the float64 formula, for delays 1
    and 3; before any step it is W itself; the live parameters are untouched."""
    m, opt = _stepped(OPTIMIZERS[name], steps)
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    for delay in (1, 3):
        got = staleness.Predictor(opt, dict(m.named_parameters()), delay, staleness.rule_for(
            type(opt).__module__ + "." + type(opt).__name__, opt.defaults))()
        want = _want(opt, m, delay)
        for n in want:
            torch.testing.assert_close(got[n], want[n], rtol=1e-6, atol=1e-7)
            if steps == 0:
                assert torch.equal(got[n], before[n])
            else:  # a real move, of the order of delay * lr
                assert float((got[n] - before[n]).abs().max()) > 1e-4 * delay
    for n, p in m.named_parameters():
        assert torch.equal(p.detach(), before[n])


def test_adamw_prediction_includes_its_decoupled_decay() -> None:
    """AdamW's prediction moves W by its decay too (the step it predicts shrinks W): with m = 0 after a
    zero gradient step, W_hat = W - s * lr * wd * W exactly as the formula says, where Adam's is W."""
    torch.manual_seed(1)
    p = torch.nn.Parameter(torch.randn(3))
    opt = torch.optim.AdamW([p], lr=0.1, weight_decay=0.5)
    st = {"step": torch.tensor(2.0), "exp_avg": torch.zeros(3), "exp_avg_sq": torch.ones(3)}
    opt.state[p] = st
    got = staleness.Predictor(opt, {"w": p}, 2, "adamw")()["w"]
    torch.testing.assert_close(got, p.detach() * (1 - 2 * 0.1 * 0.5), rtol=1e-6, atol=0)
    assert torch.equal(staleness.Predictor(opt, {"w": p}, 2, "adam")()["w"], p.detach())


def test_each_steps_rate_is_pipemares_closed_form() -> None:
    """LrCorrection.step runs each step at eta(t) / tau^(1 - min(t/K, 1)), eta(t) the scheduler's rate
    (StepLR here), t the minibatches the update completes; the group's rate is put back after the
    step, so the scheduler continues as without the correction."""
    m = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.4)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    corr = staleness.LrCorrection(delay=3, warmup=0.5, total=6, micro=2, used=[])
    for n in range(12):  # one update per microbatch (1F1B): t = (n + 1) / M minibatches
        eta = 0.4 * 0.5 ** (n // 2)
        assert opt.param_groups[0]["lr"] == pytest.approx(eta, rel=1e-12)
        for p in m.parameters():
            p.grad = torch.ones_like(p)
        w = m.weight.detach().clone()
        corr.step(opt, n)
        want = _pipemare(eta, 3, (n + 1) / 2, 0.5 * 6)
        assert corr.used[-1] == pytest.approx(want, rel=1e-12)
        torch.testing.assert_close(m.weight.detach(), w - want, rtol=0, atol=1e-7)
        sched.step()
    assert corr.used[-1] == pytest.approx(0.4 * 0.5 ** 5, rel=1e-12)  # past K: the full rate
    assert staleness.pipemare_factor(0, 0.1, 1.0) == 1.0 == staleness.pipemare_factor(1, 0.0, 1.0)


def test_predict_lr_predicts_with_the_rate_it_steps_at() -> None:
    """staleness='predict+lr': a stage holds PipeMare's rate and a predictor; each step runs at the closed
    form, and the weights stashed after it are W - s * (lr * factor of that step) * D, the float64 formula
    at the rescaled rate (before any step: W). A stage of delay 0 holds neither."""
    m, opt = _stepped(OPTIMIZERS["adamw"], 0)
    corr, pred = staleness.of_stage("predict+lr", 2, opt, dict(m.named_parameters()),
                                    {"class": "torch.optim.adamw.AdamW", "kwargs": {}}, warmup=0.5, total=8, micro=2,
                                    sharded=False)
    assert corr is not None and pred is not None
    for n in range(6):
        for p in m.parameters():
            p.grad = torch.randn_like(p)
        corr.step(opt, n)
        f = _pipemare(1.0, 2, (n + 1) / 2, 4)
        assert corr.used[-1] == pytest.approx(0.01 * f, rel=1e-12) and opt.param_groups[0]["lr"] == 0.01
        want, got = _want(opt, m, 2, scale=f), pred()
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-7)
    assert f < 1 and staleness.of_stage("predict+lr", 0, opt, dict(m.named_parameters()), {"class": "x"}, warmup=0.5,
                                        total=8, micro=2, sharded=False) == (None, None)
    with pytest.raises(UsageError, match="Fix: staleness='lr'"):  # it predicts: the optimizer needs a rule
        staleness.resolve("predict+lr", False, "torch.optim.sgd.SGD", {"momentum": 0})


def test_a_synchronous_start_cuts_every_minibatch_and_delays_pipemares_ramp() -> None:
    """staleness_sync=N: train.py's schedule is cut after each of the first N minibatches (then at its
    evaluations and checkpoints only), from a resumed step on too; PipeMare's rate is the full rate over
    those N and then the closed form at t - N (its ramp starts where the staleness does)."""
    from pdcompile.runtime import loop

    assert loop.cuts(0, 10, 0, 6, extra=staleness.sync_cuts(0, 10, 3)) == [(0, 1), (1, 2), (2, 3), (3, 6), (6, 10)]
    assert loop.cuts(2, 10, 0, 6, extra=staleness.sync_cuts(2, 10, 3)) == [(2, 3), (3, 6), (6, 10)]
    assert loop.cuts(0, 2, 0, 0, extra=staleness.sync_cuts(0, 2, 5)) == [(0, 1), (1, 2)]
    assert loop.cuts(0, 4, 0, 0, extra=staleness.sync_cuts(0, 4, 0)) == [(0, 4)]
    corr = staleness.LrCorrection(delay=2, warmup=0.5, total=8, micro=2, sync=3)
    for n in range(16):
        t = (n + 1) / 2
        assert corr.factor(n) == (1.0 if t <= 3 else pytest.approx(_pipemare(1.0, 2, t - 3, 4), rel=1e-12))
    assert corr.factor(7) < 1 == corr.factor(5) == corr.factor(15)  # t - 3 = 1 of K = 4; t = 3; past K
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(UsageError, match="staleness_sync must be"):
            staleness.check_sync(bad)
    spec = ScheduleSpec("1f1b", (1, 1), 1)
    assert staleness.plan_entry("none", 0.25, spec, {"class": "torch.optim.adam.Adam"}, sync=5)["sync"] == 5
    assert staleness.plan_entry("none", 0.25, ScheduleSpec("flush", (1, 1), 2), {"class": "torch.optim.adam.Adam"},
                                sync=5)["sync"] == 0  # nothing stale to start synchronously


def test_ftpipe_multistep_prediction_is_its_per_step_sum() -> None:
    """predict_adam_multistep (FTPipe's form, measured against ours in RESULTS.md): the float64 sum over
    the s coming steps of lr_k * b1^k m / (1 - b1^(t+k)) / (sqrt(v / (1 - b2^(t+k))) + eps), v held;
    AdamW's decay lr_k * wd * W per step; at step 0: W."""
    m, opt = _stepped(OPTIMIZERS["adamw"], 3)
    g = opt.param_groups[0]
    b1, b2 = g["betas"]
    for p in m.parameters():
        st = opt.state[p]
        t = float(st["step"])
        ex, ex2, w = st["exp_avg"].double(), st["exp_avg_sq"].double(), p.detach().double()
        lrs = [0.01, 0.02, 0.005]
        want = w.clone()
        for k, lr in enumerate(lrs, start=1):
            want -= lr * (b1 ** k * ex / (1 - b1 ** (t + k)) / ((ex2 / (1 - b2 ** (t + k))).sqrt() + g["eps"])
                          + g["weight_decay"] * w)
        got = staleness.predict_adam_multistep(p.detach(), st["exp_avg"], st["exp_avg_sq"], t, lrs, betas=(b1, b2),
                                               eps=g["eps"], weight_decay=g["weight_decay"], decoupled=True)
        torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=1e-7)
        assert torch.equal(staleness.predict_adam_multistep(p.detach(), st["exp_avg"], st["exp_avg_sq"], 0, lrs,
                                                            betas=(b1, b2), eps=1e-8), p.detach())


def _noam(replicas: list[int], s: int) -> int:
    return math.ceil(sum(replicas[s:]) / replicas[s])


@pytest.mark.parametrize("replicas", [[1, 1, 1], [1, 2, 1], [2, 1], [3, 1], [1, 1, 1, 1]])
def test_each_stages_delay_is_read_off_its_schedule(replicas: list[int]) -> None:
    """1F1B: a replica's in-flight count (NOAM-based, its own with replicas) less one; 2BW: 1; the
    synchronous schedules 0; one rank's own stage alone gives the same."""
    for m in (1, 4):
        spec = ScheduleSpec("1f1b", tuple(replicas), m)
        want = {s: _noam(replicas, s) - 1 for s in range(len(replicas))}
        assert stage_delays(spec) == want
        assert stage_delays(spec, ranks=(sum(replicas) - 1,)) == {len(replicas) - 1: 0}
        assert stage_delays(ScheduleSpec("2bw", tuple(replicas), max(m, 2))) == {s: 1 for s in want}
        assert stage_delays(ScheduleSpec("flush", tuple(replicas), m)) == {s: 0 for s in want}


def test_modes_resolve_and_refuse_with_the_fix() -> None:
    adam, sgd = "torch.optim.adam.Adam", "torch.optim.sgd.SGD"
    assert staleness.resolve("auto", True, adam, {}) == "none"
    assert staleness.resolve("auto", False, adam, {}) == "predict"
    assert staleness.resolve("auto", False, "torch.optim.adamw.AdamW", {}) == "predict"
    assert staleness.resolve("auto", False, "torch.optim.rmsprop.RMSprop", {}) == "lr"
    assert staleness.resolve("lr", False, "torch.optim.rmsprop.RMSprop", {}) == "lr"
    assert staleness.rule_for(adam, {"decoupled_weight_decay": True}) == "adamw"
    for cls, kw in ((sgd, {"momentum": 0}), (sgd, {"momentum": 0.9, "nesterov": True}),
                    (adam, {"amsgrad": True}), ("torch.optim.rmsprop.RMSprop", {})):
        with pytest.raises(UsageError, match="Fix: staleness='lr'"):
            staleness.resolve("predict", False, cls, kw)
    with pytest.raises(UsageError, match="staleness must be one of"):
        staleness.resolve("stale", False, adam, {})
    with pytest.raises(UsageError, match="staleness_warmup"):
        staleness.check_warmup(1.5)
    spec = ScheduleSpec("1f1b", (2, 1), 2)
    with pytest.raises(UsageError, match="Fix: shard='none', or staleness='lr'"):  # ZeRO-1/FSDP2 replicas
        staleness.plan_entry("predict", 0.25, spec, {"class": adam}, sharded=[True, False])
    assert staleness.plan_entry("lr", 0.25, spec, {"class": adam}, sharded=[True, False])["delays"] == [1, 0]
    m = torch.nn.Linear(2, 2)
    assert staleness.of_stage("predict", 0, None, dict(m.named_parameters()), {"class": sgd}, warmup=0.25,
                              total=4, micro=2, sharded=False) == (None, None)  # delay 0: today's code path


def test_predicting_store_stashes_predicted_weights_and_adds_their_gradients() -> None:
    """VersionedStore with a predictor: a forward runs on its version's predicted clone even where no
    step comes before its backward, and the clone's gradient lands in the live parameters' .grad."""
    m, opt = _stepped(OPTIMIZERS["adamw"], 2)
    pred = staleness.Predictor(opt, dict(m.named_parameters()), 2, "adamw")
    store = VersionedStore(m, pred)
    from pdcompile.runtime.schedules import Action
    store.expect([Action.from_str(x) for x in "0F0 0B0 0ST".split()])
    params = store.params_for_forward(0)
    assert params is not None
    want = _want(opt, m, 2)
    for n, t in params.items():
        torch.testing.assert_close(t.detach(), want[n], rtol=1e-6, atol=1e-7)
    torch.func.functional_call(m, params, (torch.ones(1, 5),)).sum().backward()
    store.after_backward(0)
    assert all(p.grad is not None and float(p.grad.abs().sum()) > 0 for p in m.parameters())


# ---- launches: the runtime against PipeDream's reference with the same corrections ------------------

def _emit(folder: Path, *, stages: int, schedule: str, optimizer: Any, mode: str, replicas: list[int] | None = None,
          warmup: float = 0.25, micro: int = M, sync: int = 0) -> tuple[Path, Any]:
    z = get("mlp", batch_size=8, seed=0)
    pipe = pdcompile(z.model, example_inputs=z.example_inputs, example_target=z.target, loss_fn=z.loss_fn,
                     optimizer=optimizer, stages=stages, schedule=schedule, num_microbatches=micro, replicas=replicas,
                     staleness=mode, staleness_warmup=warmup, shard="none", staleness_sync=sync)
    return pipe.emit(folder, data={"factory": "pdcompile.zoo:batches", "kwargs": {"name": "mlp"}}), pipe


def _reference_run(prog: Path, segments: list[tuple[int, int]], versions: Any, scale: float,
                   stash_delays: list[int] | None = None, lr_factor: Any = None) -> list[dict[str, torch.Tensor]]:
    program = Program.load(prog)
    stages = [program.build_stage(k) for k in range(program.num_stages)]
    opts = [build(program.raw["optimizer"], m.parameters()) for m in stages]
    data = batches(8, "mlp")
    end = max(e for _, e in segments)
    micro = [((x,), y) for _ in range(end) for (xs,), ys in [next(data)] for x, y in zip(xs.chunk(M), ys.chunk(M))]
    stash = None if stash_delays is None else (lambda s: _want(opts[s], stages[s], stash_delays[s]))
    for first, last in segments:
        fwd, bwd, group = versions
        reference.train_versioned(stages, opts, program.build_loss(), micro[first * M:last * M], fwd=fwd, bwd=bwd,
                                  group=group, scale=scale, stash=stash, lr_factor=lr_factor)
    return [{n: p.detach() for n, p in m.named_parameters()} for m in stages]


def _final(prog: Path, folder: Path) -> dict[int, dict[str, torch.Tensor]]:
    program = Program.load(prog)
    return {program.stage_of_rank(int(p.name.split(".rank_")[1].split(".")[0])).index: torch.load(p, weights_only=True)
            for p in folder.glob("stage_*.pt")}


def _metrics(folder: Path) -> dict[int, Any]:
    return {json.loads(p.read_text())["rank"]: json.loads(p.read_text()) for p in folder.glob("rank_*.json")}


def _close(got: dict[int, dict[str, torch.Tensor]], want: list[dict[str, torch.Tensor]]) -> float:
    worst = 0.0
    for s, tensors in got.items():
        for n, w in want[s].items():
            worst = max(worst, float((tensors[n] - w).abs().max()))
    return worst


@pytest.mark.multiproc
def test_predicted_1f1b_with_a_replicated_stage_resumes_and_trains_the_reference(tmp_path: Path) -> None:
    """1F1B on [1, 2, 1] under AdamW with weight decay, staleness='predict', 2 minibatches, checkpointed,
    then resumed to 4: the stages' delays are 3, 1 and 0 (NOAM 4 at the input stage; the replicated
    stage its own ceil(3/2) - 1), explain() and the metrics say so, and the final weights equal
    PipeDream's 1F1B reference whose stashed versions are the float64 predictions (segment by segment:
    after the resume the prediction continues from the checkpoint's optimizer state), within 1e-5 —
    while the uncorrected reference is far off (the prediction is real)."""
    adamw = functools.partial(torch.optim.AdamW, lr=0.01, weight_decay=0.1)
    prog, pipe = _emit(tmp_path / "p", stages=3, schedule="1f1b", optimizer=adamw, mode="predict", replicas=[1, 2, 1])
    text = pipe.explain()
    assert "stage 0: delay 3 update(s); applies forward on W - 3 * lr" in text
    assert "stage 2: delay 0 update(s); applies nothing (delay 0)" in text
    plan = json.loads((prog / "plan.json").read_text())["staleness"]
    assert plan == {"asked": "predict", "mode": "predict", "warmup": 0.25, "sync": 0, "delays": [3, 1, 0]}
    ck = tmp_path / "ck"
    common = ["--timeout", "90", "--checkpoint-dir", str(ck)]
    rc, out = run_ranks(prog, 4, [*common, "--steps", "2", "--checkpoint-every", "2"], timeout=240)
    assert rc == 0, out[-3000:]
    rc, out = run_ranks(prog, 4, [*common, "--steps", "4", "--checkpoint-every", "4", "--resume",
                                  "--save-final", str(tmp_path / "final"), "--metrics", str(tmp_path / "m")],
                        timeout=240)
    assert rc == 0, out[-3000:]
    metrics = _metrics(tmp_path / "m")
    seen = {r: (m["staleness"][str(m["stage"])]["delay"], m["staleness"][str(m["stage"])]["applies"])
            for r, m in metrics.items()}
    assert seen == {0: (3, "predict"), 1: (1, "predict"), 2: (1, "predict"), 3: (0, "nothing")}
    fwd = reference.pipedream_1f1b([1, 2, 1])
    want = _reference_run(prog, [(0, 2), (2, 4)], fwd, 1.0, stash_delays=[3, 1, 0])
    plain = _reference_run(prog, [(0, 2), (2, 4)], fwd, 1.0)
    got = _final(prog, tmp_path / "final")
    assert _close(got, want) < 1e-5
    assert _close(got, plain) > 1e-4


@pytest.mark.multiproc
def test_predicted_2bw_under_momentum_sgd_trains_the_reference(tmp_path: Path) -> None:
    """2BW (delay 1 on every stage) with momentum SGD predicted by its buffer equals PipeDream-2BW's
    reference whose versions are the float64 predictions."""
    sgd = functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9)
    prog, _ = _emit(tmp_path / "p", stages=2, schedule="2bw", optimizer=sgd, mode="auto")
    assert json.loads((prog / "plan.json").read_text())["staleness"]["mode"] == "predict"
    rc, out = run_ranks(prog, 2, ["--timeout", "90", "--steps", "4", "--save-final", str(tmp_path / "final"),
                                  "--metrics", str(tmp_path / "m")], timeout=240)
    assert rc == 0, out[-3000:]
    assert [m["staleness"][str(m["stage"])]["delay"] for _, m in sorted(_metrics(tmp_path / "m").items())] == [1, 1]
    want = _reference_run(prog, [(0, 4)], reference.pipedream_2bw(M), 1.0 / M, stash_delays=[1, 1])
    plain = _reference_run(prog, [(0, 4)], reference.pipedream_2bw(M), 1.0 / M)
    got = _final(prog, tmp_path / "final")
    assert _close(got, want) < 1e-5
    assert _close(got, plain) > 1e-5


@pytest.mark.multiproc
def test_pipemare_1f1b_steps_each_stage_at_the_closed_form(tmp_path: Path) -> None:
    """staleness='lr' on 1F1B [1, 1, 1] (delays 2, 1, 0), Adam, K = half the run: every step's rate on
    every stage is lr / max(delay, 1)^(1 - min(t/K, 1)) with t = (n + 1) / M minibatches after
    microbatch n's update, and the final weights equal the reference stepped at those rates."""
    lr = 0.01
    adam = functools.partial(torch.optim.Adam, lr=lr)
    steps, warmup = 4, 0.5
    prog, _ = _emit(tmp_path / "p", stages=3, schedule="1f1b", optimizer=adam, mode="lr", warmup=warmup)
    rc, out = run_ranks(prog, 3, ["--timeout", "90", "--steps", str(steps), "--save-final", str(tmp_path / "final"),
                                  "--metrics", str(tmp_path / "m")], timeout=240)
    assert rc == 0, out[-3000:]
    metrics = _metrics(tmp_path / "m")
    delays = [2, 1, 0]
    for r, m in metrics.items():
        entry = m["staleness"][str(m["stage"])]
        assert entry["delay"] == delays[m["stage"]]
        if delays[m["stage"]] == 0:
            assert entry["applies"] == "nothing" and entry["lrs"] is None
            continue
        want = [_pipemare(lr, delays[m["stage"]], (n + 1) / M, warmup * steps) for n in range(steps * M)]
        assert entry["lrs"] == pytest.approx(want, rel=1e-12), r
    assert metrics[0]["staleness"]["0"]["lrs"][0] == pytest.approx(lr / 2 ** 0.75, rel=1e-12)  # t = 1/2 of K = 2
    factor = (lambda s, n: _pipemare(1.0, delays[s], (n + 1) / M, warmup * steps))
    want_w = _reference_run(prog, [(0, steps)], reference.pipedream_1f1b([1, 1, 1]), 1.0, lr_factor=factor)
    got = _final(prog, tmp_path / "final")
    assert _close(got, want_w) < 1e-5
    assert _close(got, _reference_run(prog, [(0, steps)], reference.pipedream_1f1b([1, 1, 1]), 1.0)) > 1e-5


class _Chain(torch.nn.Module):
    """A program's stages in order, as one model (the synchronous reference trains it whole)."""

    def __init__(self, stages: list[torch.nn.Module]) -> None:
        super().__init__()
        self.stages = torch.nn.ModuleList(stages)

    def forward(self, *x: torch.Tensor) -> Any:
        out: Any = x
        for m in self.stages:
            out = m(*out)
            out = out if isinstance(out, tuple) else (out,)
        return out if len(out) > 1 else out[0]


class _Each:
    """Every stage's optimizer stepped as one (reference.train_sync takes one optimizer)."""

    def __init__(self, opts: list[torch.optim.Optimizer]) -> None:
        self.opts = opts

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.opts:
            o.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        for o in self.opts:
            o.step()


@pytest.mark.multiproc
def test_a_synchronous_start_then_predict_lr_1f1b_trains_sync_then_the_reference(tmp_path: Path) -> None:
    """1F1B on 3 stages, one microbatch a minibatch, Adam, staleness='predict+lr' with staleness_sync=2 over
    5 minibatches (K = 0.4 of the run, 2 minibatches), checkpointed at 3 and resumed: explain() and
    plan.json say so; the resumed steps run at PipeMare's closed form at t - 2 (the metrics' rates); the
    final weights equal reference.train_sync of the whole model for 2 minibatches, then PipeDream's 1F1B
    reference (cut at the checkpoint's flush) whose stashed versions are the float64 predictions at the
    rate of each stage's last step, carried over the resume, within 1e-5; the same run without the
    synchronous start ends elsewhere (it changed something)."""
    lr, steps, sync, warmup = 0.01, 5, 2, 0.4
    adam = functools.partial(torch.optim.Adam, lr=lr)
    prog, pipe = _emit(tmp_path / "p", stages=3, schedule="1f1b", optimizer=adam, mode="predict+lr", micro=1,
                       warmup=warmup, sync=sync)
    assert "the first 2 minibatch(es) synchronous" in pipe.explain()
    assert "stage 0: delay 2 update(s); applies forward on W - 2 * lr'" in pipe.explain()
    plan = json.loads((prog / "plan.json").read_text())["staleness"]
    assert (plan["mode"], plan["sync"], plan["delays"]) == ("predict+lr", 2, [2, 1, 0])
    common = ["--checkpoint-dir", str(tmp_path / "ck"), "--steps", str(steps), "--checkpoint-every", "3"]
    # the run (K is a fraction of --steps) killed at step 4, after its checkpoint at 3, and resumed
    rc, out = run_ranks(prog, 3, [*common, "--timeout", "10", "--fail-at-step", "4", "--fail-rank", "0"], timeout=240)
    assert rc != 0 and "killed at step 4" in out, out[-3000:]
    rc, out = run_ranks(prog, 3, [*common, "--timeout", "90", "--resume",
                                  "--save-final", str(tmp_path / "final"), "--metrics", str(tmp_path / "m")], timeout=240)
    assert rc == 0, out[-3000:]
    delays, k = [2, 1, 0], warmup * steps
    for r, m in _metrics(tmp_path / "m").items():
        entry = m["staleness"][str(m["stage"])]
        if delays[m["stage"]]:
            want = [_pipemare(lr, delays[m["stage"]], t - sync, k) for t in range(4, steps + 1)]
            assert (entry["applies"], entry["lrs"]) == ("predict+lr", pytest.approx(want, rel=1e-12)), r

    def reference_run(first_sync: int) -> list[dict[str, torch.Tensor]]:
        program, stages, opts, data = _synchronous_start(prog, first_sync, 1)
        last = [1.0] * 3  # the factor of each stage's last step (the prediction's rate)

        def factor(s: int, n: int) -> float:
            last[s] = _pipemare(1.0, delays[s], n + 1, k)  # the n-th minibatch after the start: t - sync = n + 1
            return last[s]
        fwd, bwd, group = reference.pipedream_1f1b([1, 1, 1])
        for a, b in ((first_sync, 3), (3, steps)):  # the checkpoint at 3 is a flush point
            rest = [((xs[0],), ys) for _, (xs, ys) in zip(range(b - a), data)]
            reference.train_versioned(stages, opts, program.build_loss(), rest, fwd=fwd, bwd=bwd, group=group,
                                      stash=lambda s: _want(opts[s], stages[s], delays[s], last[s]),
                                      lr_factor=lambda s, n, a=a: factor(s, a - first_sync + n))
        return [{n: p.detach() for n, p in m.named_parameters()} for m in stages]

    got = _final(prog, tmp_path / "final")
    assert _close(got, reference_run(sync)) < 1e-5
    assert _close(got, reference_run(0)) > 1e-4


def _synchronous_start(prog: Path, first_sync: int, num_microbatches: int) -> tuple[Any, list[Any], list[Any], Any]:
    """The emitted program's stages and optimizers trained in one process through a synchronous start of
    ``first_sync`` minibatches (``reference.train_sync``): (program, stages, optimizers, the data iterator
    where it stopped), for the schedule's reference to go on from."""
    program = Program.load(prog)
    stages = [program.build_stage(s) for s in range(program.num_stages)]
    opts = [build(program.raw["optimizer"], m.parameters()) for m in stages]
    data = batches(8, "mlp")
    reference.train_sync(_Chain(stages), program.build_loss(), _Each(opts), data,  # type: ignore[arg-type]  # duck-typed optimizer
                         steps=first_sync, num_microbatches=num_microbatches)
    return program, stages, opts, data


@pytest.mark.multiproc
def test_a_synchronous_start_then_predicted_2bw_trains_sync_then_the_reference(tmp_path: Path) -> None:
    """2BW on 2 stages (delay 1 on each), 2 microbatches a minibatch, Adam, staleness='predict' with
    staleness_sync=2 over 4 minibatches: plan.json says so; the final weights equal reference.train_sync of
    the whole model for 2 minibatches (each its own flush: the mean gradient of its 2 microbatches at the
    newest weights), then PipeDream-2BW's reference (one version late, scaled 1/M) whose versions are the
    float64 predictions, within 1e-5; the same reference without the start ends elsewhere."""
    steps, sync = 4, 2
    adam = functools.partial(torch.optim.Adam, lr=0.01)
    prog, _ = _emit(tmp_path / "p", stages=2, schedule="2bw", optimizer=adam, mode="predict", sync=sync)
    plan = json.loads((prog / "plan.json").read_text())["staleness"]
    assert (plan["mode"], plan["sync"], plan["delays"]) == ("predict", 2, [1, 1])
    rc, out = run_ranks(prog, 2, ["--timeout", "90", "--steps", str(steps), "--save-final", str(tmp_path / "final")],
                        timeout=240)
    assert rc == 0, out[-3000:]

    def reference_run(first_sync: int) -> list[dict[str, torch.Tensor]]:
        program, stages, opts, data = _synchronous_start(prog, first_sync, M)
        rest = [((x,), y) for _, ((xs,), ys) in zip(range(steps - first_sync), data)
                for x, y in zip(xs.chunk(M), ys.chunk(M))]
        fwd, bwd, group = reference.pipedream_2bw(M)
        reference.train_versioned(stages, opts, program.build_loss(), rest, fwd=fwd, bwd=bwd, group=group,
                                  scale=1.0 / M, stash=lambda s: _want(opts[s], stages[s], 1))
        return [{n: p.detach() for n, p in m.named_parameters()} for m in stages]

    got = _final(prog, tmp_path / "final")
    assert _close(got, reference_run(sync)) < 1e-5
    assert _close(got, reference_run(0)) > 1e-4


@pytest.mark.multiproc
def test_delay_zero_trains_bitwise_as_plain_1f1b(tmp_path: Path) -> None:
    """One stage under 1F1B has delay 0: staleness='predict' and 'lr' apply nothing, and the weights
    after 3 minibatches are bitwise those of plain 1F1B."""
    adam = functools.partial(torch.optim.Adam, lr=0.01)
    prog, pipe = _emit(tmp_path / "p", stages=1, schedule="1f1b", optimizer=adam, mode="predict")
    assert json.loads((prog / "plan.json").read_text())["staleness"]["delays"] == [0]
    finals = {}
    for mode in ("predict", "none"):
        folder = tmp_path / mode
        shutil.copytree(prog, folder)
        raw = json.loads((folder / "plan.json").read_text())
        raw["staleness"]["mode"] = mode
        (folder / "plan.json").write_text(json.dumps(raw, indent=1))
        rc, out = run_ranks(folder, 1, ["--timeout", "90", "--steps", "3", "--save-final", str(tmp_path / f"w_{mode}"),
                                        "--metrics", str(tmp_path / f"m_{mode}")], timeout=240)
        assert rc == 0, out[-3000:]
        finals[mode] = torch.load(tmp_path / f"w_{mode}" / "stage_0.rank_0.pt", weights_only=True)
    assert _metrics(tmp_path / "m_predict")[0]["staleness"]["0"] == {"delay": 0, "applies": "nothing", "lrs": None}
    start = torch.load(prog / "stage_0.pt", weights_only=True) if (prog / "stage_0.pt").exists() else None
    for n, w in finals["none"].items():
        assert torch.equal(finals["predict"][n], w), n
        if isinstance(start, dict) and n in start:
            assert not torch.equal(start[n], w)  # it trained


def test_plan_and_simulate_commands_say_each_stages_delay(capsys: pytest.CaptureFixture[str]) -> None:
    """``pdcompile plan --staleness auto`` on PipeDream's VGG-16 profile (SGD with momentum) for paper:A
    under 1F1B: the 15-1 plan's stage 0 of 15 replicas has delay ceil(16/15) - 1 = 1, the last 0, and
    momentum SGD has a rule (predict); --json carries the same entry; simulate under flush says delay 0."""
    from pdcompile.cli import main

    assert main(["plan", "--profile", "pipedream:vgg16", "--cluster", "paper:A", "--schedule", "1f1b",
                 "--staleness", "auto", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    reps = [len(st["ranks"]) for st in got["stages"]]
    assert got["staleness"]["mode"] == "predict"
    assert got["staleness"]["delays"] == [_noam(reps, s) - 1 for s in range(len(reps))]
    assert main(["plan", "--profile", "pipedream:vgg16", "--cluster", "paper:A", "--schedule", "1f1b",
                 "--staleness", "lr"]) == 0
    text = capsys.readouterr().out
    assert "staleness: lr (K = 0.25 of the run)" in text and f"stage {len(reps) - 1}: delay 0 update(s)" in text
    assert main(["plan", "--profile", "pipedream:vgg16", "--cluster", "paper:A", "--schedule", "1f1b",
                 "--staleness", "predict+lr", "--staleness-sync", "7", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["staleness"]
    assert (got["mode"], got["sync"]) == ("predict+lr", 7)
    assert main(["simulate", "pipedream:vgg16", "--cluster", "paper:A", "--schedule", "flush", "--microbatches", "4",
                 "--staleness", "predict", "--json"]) == 0
    sim = json.loads(capsys.readouterr().out)
    assert set(sim["staleness"]["delays"]) == {0}
