"""IR dumps cost nothing unless asked for: a compile without a dump folder never formats one, and
``dump_ir`` later writes what a compile with ``dump_dir`` wrote as it went (#28 item 7)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from pdcompile import pipeline
from pdcompile.api import pdcompile
from pdcompile.passes import annotate_costs, linearize, partition, propagate_shapes, schedule
from pdcompile.zoo import get

pytestmark = pytest.mark.timeout(120)


def _compile(name: str, dump_dir: Path | None = None):  # noqa: ANN202
    z = get(name, batch_size=4, seed=0)
    return pdcompile(z.model, example_inputs=z.example_inputs, example_target=z.target, loss_fn=z.loss_fn,
                     optimizer=lambda p: torch.optim.SGD(p, lr=0.1), stages=2, num_microbatches=2,
                     leaf_modules=z.leaf_modules, schedule="1f1b", dump_dir=dump_dir)


def _bodies(folder: Path) -> dict[str, str]:
    """Each dump file's text below its header (the header holds the pass's time, which varies), the
    planner's own time ("planned in 1.2 ms") blanked."""
    return {p.name: re.sub(r"planned in [\d.]+ ms", "planned in - ms", p.read_text().split("\n", 1)[1])
            for p in sorted(folder.iterdir())}


def test_a_compile_without_a_dump_folder_formats_no_dump(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PDCOMPILE_DUMP", raising=False)

    def refuse(*_: object) -> str:
        raise AssertionError("a dump was formatted though none was asked for")

    for module, fn in ((pipeline, "_dump_trace"), (propagate_shapes, "format_graph_with_shapes"),
                       (annotate_costs, "format_costs"), (linearize, "report"),
                       (partition, "format_partition"), (schedule, "format_schedule")):
        monkeypatch.setattr(module, fn, refuse)
    pipe = _compile("mlp")
    assert [r.name for r in pipe.records][:3] == ["trace", "propagate-shapes", "annotate-costs"]
    with pytest.raises(AssertionError, match="none was asked for"):  # reading one formats it, then
        _ = pipe.records[0].dump


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_dump_ir_writes_what_a_dump_folder_gets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    monkeypatch.delenv("PDCOMPILE_DUMP", raising=False)
    _compile(name, dump_dir=tmp_path / "eager")  # formatted as each pass ends
    lazy = _compile(name)
    lazy.emit(tmp_path / "prog")  # emitting first changes nothing a dump shows
    lazy.dump_ir(tmp_path / "lazy")
    eager, later = _bodies(tmp_path / "eager"), _bodies(tmp_path / "lazy")
    assert list(later) == list(eager) and len(eager) == len(lazy.records)
    for f in eager:
        assert later[f] == eager[f], f
    assert "periodic form" in later[next(f for f in later if f.endswith("_schedule.txt"))]
