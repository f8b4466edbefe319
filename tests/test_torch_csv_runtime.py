"""A schedule written for torch.distributed.pipelining, as its compute-only CSV, compiled and run
on our runtime (``schedule="csv:PATH"``, ``pdcompile emit --schedule csv:PATH``): exactly
single-process SGD through torchrun under NCCL's rules, every rank running the CSV's order."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdcompile import torch_orders

STEPS = 3


def _opt(params):  # noqa: ANN001, ANN202
    import torch

    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


@pytest.mark.multiproc
@pytest.mark.timeout(300)
@pytest.mark.parametrize("which,name,m,targets", [
    ("interleaved-zb", "mlp", 4, "send"),  # torch's ScheduleInterleavedZeroBubble: no schedule of ours is it
    ("interleaved-zb", "gpt", 4, "local"),  # tied embedding across ranks
    ("dualpipe-v", "resnet", 4, "send"),
])
def test_a_torch_csv_trains_single_process_sgd(tmp_path: Path, which: str, name: str, m: int, targets: str) -> None:
    import torch

    from pdcompile.api import pdcompile
    from _ranks import run_ranks
    from pdcompile.merge import merge_weights
    from pdcompile.reference import train_sync
    from pdcompile.runtime.schedules.torch_csv import csv_name
    from pdcompile.zoo import batches, get

    path = tmp_path / "schedule.csv"
    text = torch_orders.torch_csv(which, 2, m, 2, path=path)
    z = get(name, batch_size=8, seed=0)
    pipe = pdcompile(z.model, example_inputs=z.example_inputs, example_target=z.target, loss_fn=z.loss_fn,
                     optimizer=_opt, schedule=f"csv:{path}", leaf_modules=z.leaf_modules)
    spec = pipe.state.schedule_spec
    assert spec.name == csv_name(text) and spec.csv == text and spec.virtual_stages == 2 and spec.num_microbatches == m
    prog = pipe.emit(tmp_path / "prog", data={"factory": "pdcompile.zoo:batches", "kwargs": {"name": name}})
    path.unlink()  # the program carries the CSV: train.py does not need the file
    rc, log = run_ranks(prog, 2, ["--steps", str(STEPS), "--save-final", str(tmp_path / "final"), "--timeout", "60",
                                  "--targets", targets, "--trace", str(tmp_path / "trace")], timeout=150)
    assert rc == 0, log[-3000:]
    got = merge_weights(prog, tmp_path / "final")
    z = get(name, batch_size=8, seed=0)
    train_sync(z.model, z.loss_fn, _opt(z.model.parameters()), batches(8, name), steps=STEPS, num_microbatches=m)
    for k, w in z.model.named_parameters():
        torch.testing.assert_close(got[k], w.detach(), rtol=1e-5, atol=1e-6, msg=f"{which} {name}: {k}")
    # each rank ran the CSV's compute order, step after step (I -> our B, then its W)
    order = torch_orders.torch_order(which, 2, m, 2)
    for r in range(2):
        names = [e["name"] for e in json.loads((tmp_path / "trace" / f"rank_{r}.events.json").read_text())]
        ran = [n for n in names if n[-1].isdigit() and any(c in n for c in "FBW") and not any(c in n for c in "RSV")]
        want = []
        for t in range(STEPS):
            for cell in order[r]:
                for part in (cell[1:].split(")")[0].split(";") if cell.startswith("(") else [cell]):
                    st, kind, k = int(part[0]), part[1], int(part[2:])
                    want.append(f"{st}{'B' if kind == 'I' else kind}{k + t * m}")
        assert ran == want


def test_a_broken_csv_is_refused_naming_the_rule_and_the_cell(tmp_path: Path) -> None:
    import torch

    from pdcompile.api import pdcompile
    from pdcompile.errors import ScheduleError, UsageError

    path = tmp_path / "broken.csv"
    path.write_text("0F0,0B0,0F1,0B1\n,1F0,1B1,1F1,1B0\n")  # rank 1 backpropagates microbatch 1 before its forward
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    kw = dict(example_inputs=(torch.zeros(4, 4),), example_target=torch.zeros(4, 4), loss_fn=torch.nn.MSELoss())
    with pytest.raises(ScheduleError, match=r"torch CSV row 2 \(rank 1\), column 3 \('1B1'\): rule 'backward after forward'"):
        pdcompile(model, schedule=f"csv:{path}", **kw)
    with pytest.raises(UsageError, match="no file"):
        pdcompile(model, schedule=f"csv:{tmp_path / 'missing.csv'}", **kw)
    path.write_text("0F0,0F1,0B0,0B1\n,1F0,1B0,1F1,1B1\n")
    with pytest.raises(UsageError, match="num_microbatches=4, but the CSV .* has 2"):
        pdcompile(model, schedule=f"csv:{path}", num_microbatches=4, **kw)


def test_the_cli_emits_a_torch_csv_program(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """`pdcompile emit MODEL --schedule csv:schedule.csv` from a fresh folder, relative paths (the CLI's
    main in this process: no second torch import)."""
    from pdcompile.cli import main

    torch_orders.torch_csv("interleaved-1f1b", 2, 4, 2, path=tmp_path / "schedule.csv")
    monkeypatch.chdir(tmp_path)
    rc = main(["emit", "zoo:mlp", "-o", "prog", "--schedule", "csv:schedule.csv"])
    assert rc == 0, capsys.readouterr().err[-2000:]
    plan = json.loads((tmp_path / "prog" / "plan.json").read_text())
    assert plan["schedule"]["csv"] == (tmp_path / "schedule.csv").read_text()
    assert plan["world_size"] == 2 and [s["ranks"] for s in plan["stages"]] == [[0], [1], [0], [1]]
