"""The planner's memory model against a run: saved-activation bytes from saved-tensor hooks, each
stage's predicted peak against what the stage measured through torchrun (within 10%, flush and 1F1B,
with and without recomputation), GPipe planned with all its microbatches in flight, and training with
recomputation equal to training without it."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from pdcompile.api import pdcompile
from pdcompile.merge import merge_weights
from pdcompile.passes.annotate_costs import saved_tensor_bytes
from pdcompile.passes.partition_dp import plan_from_assignment
from pdcompile.passes.trace import trace
from pdcompile.reference import train_sync
from pdcompile.runtime.memory import MemoryMeter
from pdcompile.zoo import gpt

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _emitted import launch_two  # noqa: E402

CFG = dict(vocab_size=1024, seq_len=32, d_model=64, n_heads=4, n_layers=4)
M, B = 4, 2


def batches(batch_size: int, seed: int = 0, **cfg: int) -> Any:
    """The emitted program's data: seeded token batches."""
    c = gpt.GPTConfig(**cfg)
    i = 0
    while True:
        yield gpt.make_batch(c, torch.device("cpu"), seed + i, batch_size)
        i += 1


class _Views(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.act = torch.nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.act(self.fc(x))  # relu_ saves its result: the linear output's storage
        return (y.view(-1) * y.reshape(-1)).sum()  # two views of one storage, each saved by mul


def test_saved_bytes_count_each_storage_once() -> None:
    torch.manual_seed(0)
    m = _Views()
    x = torch.randn(4, 8)
    per_node = saved_tensor_bytes(trace(m, ()), (x,))
    total = sum(v[0] for v in per_node.values())
    # independent: one eager forward under saved-tensor hooks, unique storages, parameters left out
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        m(x)
    params = {p.untyped_storage().data_ptr() for p in m.parameters()}
    expected = sum(n for p, n in seen.items() if p not in params)
    assert total == expected == x.numel() * 4 + 4 * 8 * 4  # the input (for fc's weight grad) + one 4x8 storage


def test_a_microbatch_cut_from_a_batch_counts_its_own_bytes() -> None:
    """The data a first stage reads are views of the minibatch: the prediction and the meter charge a
    microbatch its own bytes, not the batch's storage."""
    torch.manual_seed(0)
    m = _Views()
    batch = torch.randn(16, 8)
    chunks = batch.chunk(4)
    on_view = saved_tensor_bytes(trace(m, ()), (chunks[1],))
    on_copy = saved_tensor_bytes(trace(m, ()), (chunks[1].clone(),))
    assert sorted(on_view.values()) == sorted(on_copy.values())
    meter = MemoryMeter(m, torch.optim.SGD(m.parameters(), lr=0.1))
    meter.data(chunks)
    for k in (0, 1):
        meter.add(k, [chunks[k], chunks[k][:, :4]])  # a view of a view: inside the microbatch's span
    meter.measure(in_flight=[0, 1], posted=[], live_versions=1)
    assert meter.report()["activations"] == 2 * chunks[0].numel() * 4
    other = MemoryMeter(m, torch.optim.SGD(m.parameters(), lr=0.1))  # a view of an intermediate holds it all
    other.add(0, [chunks[0]])
    other.measure(in_flight=[0], posted=[], live_versions=1)
    assert other.report()["activations"] == batch.numel() * 4


def test_gpipe_planned_with_all_microbatches_in_flight() -> None:
    cfg = gpt.GPTConfig(**CFG)
    torch.manual_seed(0)
    (x,), y = gpt.make_batch(cfg, torch.device("cpu"), 0, 8 * B)
    pipe = pdcompile(gpt.GPT(cfg), example_inputs=(x,), example_target=y, loss_fn=gpt.SequenceCrossEntropy(),
                     stages=2, schedule="gpipe", num_microbatches=8)
    assign = [(s.first, s.last, s.replicas, s.ranks) for s in pipe.plan.stages]
    plans = {name: plan_from_assignment(pipe.state.chain, pipe.state.cluster, assign, schedule=name,
                                        memory_limit=False, num_microbatches=8) for name in ("gpipe", "flush")}
    assert [s.in_flight for s in plans["gpipe"].stages] == [8, 8]
    assert [s.in_flight for s in plans["flush"].stages] == [2, 1]
    assert all(g.memory_bytes > f.memory_bytes for g, f in zip(plans["gpipe"].stages, plans["flush"].stages))


def _emit(tmp: Path, recompute: str) -> tuple[Any, Path]:
    cfg = gpt.GPTConfig(**CFG)
    torch.manual_seed(0)
    (x,), y = gpt.make_batch(cfg, torch.device("cpu"), 0, M * B)
    pipe = pdcompile(gpt.GPT(cfg), example_inputs=(x,), example_target=y, loss_fn=gpt.SequenceCrossEntropy(),
                     optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), stages=2, schedule="flush",
                     num_microbatches=M, recompute=recompute)
    return pipe, pipe.emit(tmp / f"prog_{recompute}", data={"factory": "tests.test_memory_model:batches", "kwargs": CFG})


@pytest.mark.multiproc
@pytest.mark.timeout(400)
def test_predicted_memory_matches_measured_and_recompute_trains_the_same(tmp_path: Path) -> None:
    """Each stage's predicted peak within 10% of what it measured through the ranks (flush and 1F1B, with and
    without recompute="full"); recomputation trains as training without it does; and the recompute="full"
    flush run (one of those launches) ends with the final weights and every microbatch's loss of plain
    single-process training (reference.train_sync)."""
    runs: dict[tuple[str, str], Any] = {}
    progs: dict[str, Path] = {}
    for recompute in ("none", "full"):
        pipe, prog = _emit(tmp_path, recompute)
        progs[recompute] = prog
        assert [s.recompute for s in pipe.plan.stages] == [recompute] * 2
        assign = [(s.first, s.last, s.replicas, s.ranks) for s in pipe.plan.stages]
        for schedule in ("flush", "1f1b"):
            plan = plan_from_assignment(pipe.state.chain, pipe.state.cluster, assign, schedule=schedule,
                                        memory_limit=False, num_microbatches=M, recompute=recompute)
            metrics, weights = launch_two(tmp_path, prog, schedule, f"{recompute}_{schedule}")
            runs[(recompute, schedule)] = (metrics, weights)
            for s, st in enumerate(plan.stages):
                measured = metrics[s]["memory"]["total"]
                assert abs(st.memory_bytes - measured) <= 0.10 * measured, (recompute, schedule, s, st.memory_bytes,
                                                                             metrics[s]["memory"])
            # recomputation really ran: the backward rebuilt a forward, and less stays stashed
            if recompute == "full":
                assert all(metrics[s]["memory"]["recompute"] > 0 for s in metrics)
    for schedule in ("flush", "1f1b"):
        (m0, w0), (m1, w1) = runs[("none", schedule)], runs[("full", schedule)]
        assert m1[0]["memory"]["activations"] < m0[0]["memory"]["activations"] / 2
        assert m0[1]["losses"] == pytest.approx(m1[1]["losses"], abs=1e-6)
        for k in w0:
            for n in w0[k]:
                torch.testing.assert_close(w1[k][n], w0[k][n], rtol=0, atol=1e-6)

    # recompute="full" under PipeDream-Flush equals single-process training (was its own test, with its own
    # compile and launch of this same program and schedule)
    metrics = runs[("full", "flush")][0]
    got = merge_weights(progs["full"], tmp_path / "w_full_flush")
    # independent: the same seeded model, the same batches, one process, no pipeline, no recomputation
    torch.manual_seed(0)
    ref = gpt.GPT(gpt.GPTConfig(**CFG))
    initial = {k: v.detach().clone() for k, v in ref.named_parameters()}
    losses = train_sync(ref, gpt.SequenceCrossEntropy(), torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9),
                        batches(M * B, **CFG), steps=3, num_microbatches=M)
    assert metrics[1]["losses"] == pytest.approx(losses, rel=1e-6)
    want = dict(ref.named_parameters())
    assert set(got) >= set(want)
    moved = 0
    for k, w in want.items():
        w = w.detach()
        rel = float((got[k] - w).norm() / w.norm().clamp_min(1e-30))
        assert rel <= 1e-6, (k, rel)
        moved += int(not torch.equal(w, initial[k]))
    assert moved == len(want)  # training moved every parameter
