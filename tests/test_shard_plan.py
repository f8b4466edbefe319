"""``shard=``: the option, its resolution per stage, the plan table, plan.json and the CLI flag (the
planner's choice and memory model: tests/test_shard_planner.py)."""

from __future__ import annotations

import json

import pytest
import torch

from pdcompile import pdcompile
from pdcompile.cli import main
from pdcompile.errors import UsageError
from pdcompile.passes.planner.sharding import check_option, resolve
from pdcompile.plan import Plan

pytestmark = pytest.mark.timeout(120)


def _model() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 10))
    return m, torch.randn(8, 16), torch.randint(0, 10, (8,))


def _compile(**kw: object) -> object:
    m, x, y = _model()
    return pdcompile(m, example_inputs=(x,), example_target=y, loss_fn=torch.nn.CrossEntropyLoss(), **kw)


def test_resolve_applies_a_mode_to_replicated_stages_and_says_what_it_left() -> None:
    assert resolve([2, 1, 3], "full", "flush", 4) == (("full", "none", "full"),
                                                      ("shard='full': stage 1 has one replica and runs unsharded",))
    assert resolve([2, 2], "optimizer", "1f1b", 1) == (("optimizer", "optimizer"), ())
    assert resolve([2, 1], "auto", "flush", 4) == (("none", "none"), ())
    assert resolve([2, 1], "auto", "flush", 4, planned=("full", "none")) == (("full", "none"), ())
    assert resolve([2, 1], ("optimizer", "none"), "gpipe", 4) == (("optimizer", "none"), ())


@pytest.mark.parametrize("replicas, shard, schedule, m, words", [
    ([2, 1], ("full", "full"), "flush", 4, "stage 1 has one replica"),
    ([2, 1], ("full",), "flush", 4, "names 1 stages but the plan has 2"),
    ([2, 1], "full", "1f1b", 4, "stashed weight versions"),
    ([2, 1], "full", "2bw", 4, "stashed weight versions"),
    ([4, 1], "full", "gpipe", 2, "at least 4 microbatches"),
])
def test_resolve_refuses_what_a_stage_cannot_run(replicas: list[int], shard: object, schedule: str, m: int,
                                                 words: str) -> None:
    with pytest.raises(UsageError, match=words):
        resolve(replicas, shard, schedule, m)  # type: ignore[arg-type]


def test_check_option() -> None:
    assert check_option("auto") == "auto"
    assert check_option(["full", "none"]) == ("full", "none")
    for bad in ("zero", ["full", "zero3"], [], 3):
        with pytest.raises(UsageError, match="shard"):
            check_option(bad)


def test_the_plan_carries_each_stage_mode_into_its_table_json_and_plan_json(tmp_path: object) -> None:
    pipe = _compile(stages=2, replicas=[2, 1], shard="full")
    plan = pipe.plan  # type: ignore[attr-defined]
    assert [s.shard for s in plan.stages] == ["full", "none"]
    table = str(plan)
    assert table.splitlines()[3].split()[-1] == "shard" and table.splitlines()[4].split()[-1] == "full"
    assert "stage 1 has one replica and runs unsharded" in table
    assert Plan.from_json(plan.to_json()) == plan
    assert "stage 0 (x2): full" in pipe.explain()  # type: ignore[attr-defined]
    out = pipe.emit(tmp_path / "prog")  # type: ignore[attr-defined, operator]
    doc = json.loads((out / "plan.json").read_text())
    assert [s["shard"] for s in doc["stages"]] == ["full", "none"]
    assert [s["shard"] for s in doc["plan"]["stages"]] == ["full", "none"]


def test_no_column_when_no_stage_shards() -> None:
    plan = _compile(stages=2, replicas=[2, 1], shard="none").plan  # type: ignore[attr-defined]
    assert [s.shard for s in plan.stages] == ["none", "none"] and "shard" not in str(plan)


@pytest.mark.parametrize("kw, words", [
    (dict(shard="zero3"), "shard must be one of"),
    (dict(shard=["full", "none"]), "needs stages= as many"),
    (dict(shard=["full", "none"], stages=3), "needs stages= as many"),
    (dict(shard=["full", "full"], stages=2, replicas=[2, 1]), "stage 1 has one replica"),
    (dict(shard="full", stages=2, replicas=[2, 1], schedule="1f1b"), "shard='optimizer'"),
])
def test_bad_options_are_one_line_usage_errors(kw: dict[str, object], words: str) -> None:
    with pytest.raises(UsageError, match=words) as e:
        _compile(**kw)
    assert "\n" not in str(e.value)


def _cli(capfd: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """``pdcompile ARGS`` in this process (the console script's ``main``; no process start, no second torch
    import): its exit status, stdout and stderr."""
    capfd.readouterr()
    try:
        rc = main(list(args))
    except SystemExit as e:  # argparse
        rc = int(e.code or 0)
    out, err = capfd.readouterr()
    return rc, out, err


def test_cli_shard_flag(capfd: pytest.CaptureFixture[str]) -> None:
    rc, out, err = _cli(capfd, "plan", "--profile", "pipedream:vgg16", "--cluster", "paper:A", "--schedule", "flush",
                        "--shard", "full", "--json")
    assert rc == 0, err
    stages = json.loads(out)["stages"]
    assert [s["shard"] for s in stages] == ["full" if s["replicas"] > 1 else "none" for s in stages]
    rc, _, err = _cli(capfd, "plan", "--profile", "pipedream:vgg16", "--cluster", "paper:A", "--shard", "full")  # 1f1b stashes
    assert rc == 2 and "shard='optimizer'" in err and "Traceback" not in err
    rc, _, err = _cli(capfd, "plan", "--profile", "pipedream:vgg16", "--cluster", "paper:A", "--shard", "zero")
    assert rc == 2 and "shard must be one of" in err


class _Tied(torch.nn.Module):
    """A first and a last layer sharing one weight (tied across stages when split in two)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.mid, self.head = (torch.nn.Linear(16, 16) for _ in range(3))
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.mid(torch.relu(self.emb(x)))))


def test_full_is_not_given_to_a_stage_with_a_tied_parameter() -> None:
    from pdcompile.passes.planner.sharding import untie

    x, y = torch.randn(8, 16), torch.randint(0, 16, (8,))
    with pytest.raises(UsageError, match="tied to another stage"):
        pdcompile(_Tied(), example_inputs=(x,), example_target=y, loss_fn=torch.nn.CrossEntropyLoss(), stages=2,
                  replicas=[2, 2], shard="full")
    plan = _compile(stages=2, replicas=[2, 1], shard="full").plan  # type: ignore[attr-defined]
    got = untie(plan, {0}, "auto")  # auto had chosen full for a tied stage: ZeRO-1 instead, said in a note
    assert [s.shard for s in got.stages] == ["optimizer", "none"] and "tied across stages" in got.notes[-1]
    assert untie(plan, {1}, "auto") is plan
