"""The program runs the schedule the compiler printed: plan.json carries the schedule (policy and
parameters, and every rank's actions for a short run), the schedule dump shows the same, and every
rank of the emitted program executes exactly those actions, posting its receives in the order the
transfer plan derives from them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pdcompile.api import pdcompile
from _ranks import run_ranks
from pdcompile.runtime.schedules import Kind, format_grid, parse_grid, transfer_plan
from pdcompile.runtime.schedules.spec import CHECK_STEPS, ScheduleSpec
from pdcompile.zoo import get

RECEIVES = {Kind.RECV_ACT.value, Kind.RECV_GRAD.value}

# (schedule, stages, replicas): every schedule, 2-3 stages, a replicated stage
CASES = [("gpipe", 2, None), ("flush", 3, [1, 2, 1]), ("1f1b", 3, None), ("2bw", 2, [2, 1])]


def _is_receive(name: str) -> bool:
    return name.lstrip("0123456789")[:2] in RECEIVES


@pytest.mark.multiproc
@pytest.mark.timeout(200)
@pytest.mark.parametrize("schedule,stages,replicas", CASES, ids=[c[0] for c in CASES])
def test_ranks_execute_the_compiled_action_lists(tmp_path: Path, schedule: str, stages: int,
                                                  replicas: list[int] | None) -> None:
    z = get("mlp", batch_size=8, seed=0)
    pipe = pdcompile(z.model, example_inputs=z.example_inputs, example_target=z.target, loss_fn=z.loss_fn,
                     optimizer=lambda p: torch.optim.SGD(p, lr=0.05), stages=stages, replicas=replicas,
                     schedule=schedule, num_microbatches=2)
    prog = pipe.emit(tmp_path / "prog")
    raw = json.loads((prog / "plan.json").read_text())["schedule"]
    spec = ScheduleSpec.from_json(raw)
    assert spec == pipe.state.schedule_spec and spec.name == schedule
    printed = parse_grid("\n".join(f"rank {r}: {acts}" for r, acts in raw["check"]["ranks"].items()))
    # the IR dump shows the same lists
    dump = next(r.dump for r in pipe.records if r.name == "schedule")
    assert format_grid(printed, compute_only=False) in dump and str(spec) in dump
    nproc = sum(spec.replicas)
    rc, log = run_ranks(prog, nproc, ["--steps", str(CHECK_STEPS), "--trace", str(tmp_path / "trace"),
                                      "--timeout", "30"], timeout=120)
    assert rc == 0, log[-3000:]
    assert "not the compiled" not in log
    posts = transfer_plan(printed, list(spec.replicas))
    for rank in range(nproc):
        names = [e["name"] for e in json.loads((tmp_path / "trace" / f"rank_{rank}.events.json").read_text())]
        want = [str(a) for a in printed[rank]]
        assert [n for n in names if not _is_receive(n)] == [n for n in want if not _is_receive(n)], rank
        first: list[str] = []  # each receive's first slice is its posting
        for n in names:
            if _is_receive(n) and n not in first:
                first.append(n)
        assert first == [str(b) for p in posts[rank] for b in p], rank


def test_a_plan_this_runtime_would_not_rebuild_is_refused(tmp_path: Path) -> None:
    """A plan.json whose check lists this runtime would not rebuild is refused (exit 2) before training."""
    import subprocess
    import sys

    z = get("mlp", batch_size=8, seed=0)
    pipe = pdcompile(z.model, example_inputs=z.example_inputs, example_target=z.target, loss_fn=z.loss_fn,
                     optimizer=lambda p: torch.optim.SGD(p, lr=0.05), stages=2, schedule="flush", num_microbatches=2)
    prog = pipe.emit(tmp_path / "prog")
    plan = json.loads((prog / "plan.json").read_text())
    lists = plan["schedule"]["check"]["ranks"]
    lists["0"] = lists["0"].replace("0F1 0SF1", "0SF1 0F1", 1)  # not what this runtime builds
    (prog / "plan.json").write_text(json.dumps(plan))
    p = subprocess.run([sys.executable, str(prog / "train.py"), "--steps", "1"], capture_output=True, text=True,
                       timeout=60, cwd=tmp_path, env={"WORLD_SIZE": "2", "RANK": "0", "PATH": "/usr/bin:/bin"})
    assert p.returncode == 2, p.stderr[-2000:]
    assert "builds rank 0's schedule" in p.stderr and "re-emit" in p.stderr and "Traceback" not in p.stderr
