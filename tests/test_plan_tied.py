"""The step search charges the all-reduce of a weight tied across stages (a GPT's embedding and LM head on the
first and last stage: the runtime sums its gradients between them every step, ``TG``), as simulate() does:
``ChainLayer.tied_params`` says which layers share a parameter, ``plan.tied_of`` which stages of a plan hold
it. Expected figures are worked by hand: a ring all-reduce between two ranks moves the bytes once over their
link."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest

from pdcompile.cluster import flat_cluster
from pdcompile.ir import Chain, ChainLayer
from pdcompile.plan import plan, tied_of
from pdcompile.simulate import simulate_plan, update_bandwidth_of
from test_per_action_cost import _spy_search

pytestmark = pytest.mark.timeout(300)

LINK = 1e8  # bytes/s between the two workers


def _chain(tied_bytes: float, middle: float = 1e7) -> Chain:
    """Four layers of 10 ms forward, 20 ms backward per sample; ``middle`` bytes of weights in each middle layer;
    the first and last layers use one parameter of ``tied_bytes`` (held by the first, a copy in the last)."""
    wte = (("wte.weight", tied_bytes),)
    layers = (ChainLayer("emb", "embedding", 1e-2, 2e-2, 1e3, tied_bytes, ("emb",), tied_params=wte),
              ChainLayer("l1", "linear", 1e-2, 2e-2, 1e3, middle, ("l1",)),
              ChainLayer("l2", "linear", 1e-2, 2e-2, 1e3, middle, ("l2",)),
              ChainLayer("head", "linear", 1e-2, 2e-2, 1e3, 0.0, ("head",), shared_param_bytes=tied_bytes,
                         tied_params=wte))
    return Chain(layers, (1e3,) * 3, batch_size=1, name="tied")


def _untied(chain: Chain) -> Chain:
    return dataclasses.replace(chain, layers=tuple(dataclasses.replace(l, tied_params=()) for l in chain.layers))


def _sim(p: Any, chain: Chain, cluster: Any, tied_bytes: float = 0.0, tied_stages: tuple[int, ...] = ()) -> Any:
    return simulate_plan(p, chain.at_batch(p.microbatch_size), cluster, "flush", p.num_microbatches,
                         split_backward=True, update_bandwidth=update_bandwidth_of(cluster),
                         tied_bytes=tied_bytes, tied_stages=tied_stages)


def test_the_step_search_charges_the_tied_all_reduce_between_its_stages() -> None:
    """Two stages (embedding + first block | second block + head): the search's step is simulate_plan's with the
    tie given by hand (2 MB between stages 0 and 1), whose TG lasts 2 MB / 100 MB/s = 20 ms on both ranks and
    holds back their optimizer steps; the plan simulated without the tie is faster (what the search rated
    before). With a 50 MB tie (0.5 s a step) and light middle layers, the search leaves the pipeline it picks
    untied (0.3 s against data parallelism's 0.24 s of compute + 0.5 s all-reduce) for data parallelism, one
    stage holding both tied layers."""
    cluster = flat_cluster(2, LINK, 64e9, name="gpu")
    chain = _chain(2e6)
    p = plan(chain, cluster, schedule="flush", num_microbatches=4)
    assert [(st.first, st.last) for st in p.stages] == [(0, 1), (2, 3)], p
    assert tied_of(p, chain) == (2e6, [0, 1])
    by_hand = _sim(p, chain, cluster, 2e6, (0, 1))
    assert p.seconds_per_minibatch == pytest.approx(float(by_hand.step_time_s), rel=1e-9)
    tg = [e for e in by_hand.events if e.category == "tied"]
    assert sorted(e.rank for e in tg) == [0, 1]
    for e in tg:
        assert e.end_s - e.start_s == pytest.approx(2e6 / LINK, rel=1e-9)
        st = next(x for x in by_hand.events if x.rank == e.rank and x.name.endswith("ST"))
        assert st.start_s >= e.end_s - 1e-12  # the optimizer step waits for the summed gradient
    untied = float(_sim(p, chain, cluster).step_time_s)
    assert p.seconds_per_minibatch > untied + 2e6 / LINK / 2

    heavy = _chain(5e7, middle=1e5)
    free = plan(_untied(heavy), cluster, schedule="flush", num_microbatches=4)
    assert len(free.stages) == 2 and tied_of(free, heavy)[1] == [0, 1]  # untied, it would split them
    charged = plan(heavy, cluster, schedule="flush", num_microbatches=4)
    assert tied_of(charged, heavy) == (0.0, [])
    assert charged.seconds_per_minibatch == pytest.approx(float(_sim(charged, heavy, cluster).step_time_s), rel=1e-9)
    assert float(_sim(free, heavy, cluster, 5e7, (0, 1)).step_time_s) > charged.seconds_per_minibatch


def _compile_lm(schedule: str) -> Any:
    """A user's small language model whose LM head reuses the embedding, for two CPU workers on a 100 MB/s
    link, with cross-entropy over its logits."""
    import torch

    from pdcompile.api import pdcompile
    from pdcompile.cluster import local_cpu_cluster

    class TinyLM(torch.nn.Module):
        def __init__(self, vocab: int = 512, d: int = 256, n: int = 4) -> None:
            super().__init__()
            self.wte = torch.nn.Embedding(vocab, d)
            self.blocks = torch.nn.Sequential(*[torch.nn.Sequential(
                torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d)) for _ in range(n)])
            self.head = torch.nn.Linear(d, vocab, bias=False)
            self.head.weight = self.wte.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.blocks(self.wte(x)))

    def loss(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), t.reshape(-1))

    torch.manual_seed(0)
    x, y = torch.randint(0, 512, (16, 32)), torch.randint(0, 512, (16, 32))
    return pdcompile(TinyLM(), local_cpu_cluster(2, bandwidth=1e8), example_inputs=(x,), example_target=y,
                     loss_fn=loss, schedule=schedule)


def test_a_tied_language_model_is_planned_as_simulate_charges_it(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A user's small language model whose LM head reuses the embedding (512 x 256 fp32 = 524288 bytes, by
    hand), compiled for two CPU workers on a 100 MB/s link: the step search's pick is two stages, the tie
    between them; the search's step equals simulate() of the compiled program (which reads the tie off the
    split stages), whose TG lasts 524288 / 1e8 s; tied_of reads the same tie off the plan and chain, and a
    profile file keeps it (pdcompile plan / simulate plan from one)."""
    from pdcompile.passes.linearize import linearize
    from pdcompile.profile import load, save

    monkeypatch.setenv("PDCOMPILE_CACHE", str(tmp_path))  # no calibration: the analytic model, deterministic
    found = _spy_search(monkeypatch)
    pipe = _compile_lm("flush")
    tie = 512 * 256 * 4
    assert len(pipe.plan.stages) == 2
    assert pipe._tied() == (tie, [0, 1])
    assert tied_of(pipe.plan, pipe.wire_chain) == (tie, [0, 1])
    sim = pipe.simulate()
    assert found[-1].seconds_per_minibatch == pytest.approx(float(sim.step_time_s), rel=1e-9)
    assert [(st.first, st.last) for st in found[-1].stages] == [(st.first, st.last) for st in pipe.plan.stages]
    tg = [e for e in sim.events if e.category == "tied"]
    assert tg and all(e.end_s - e.start_s == pytest.approx(tie / 1e8, rel=1e-9) for e in tg)
    save(pipe.state.profile, tmp_path / "lm.json")
    assert tied_of(pipe.plan, linearize(load(tmp_path / "lm.json"))) == (tie, [0, 1])
    assert os.path.getsize(tmp_path / "lm.json") > 0


@pytest.mark.parametrize("schedule", ["flush", "gpipe", "zb-h1"])
def test_every_step_schedules_search_rates_its_pick_as_simulate_does(schedule: str, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Every schedule family planned by its step (the synchronous ones with a stage per rank), on a calibrated
    local CPU cluster (synthetic calibration: op costs, per-action cost, optimizer step), the tied LM: the step
    search's own figure for its pick (before the API replaces the headline) is simulate() of the compiled
    program, which charges the calibrated per-action cost and optimizer step and the tie, each read its own way
    (the split stages' tie, the compile's step costs). The other families (1f1b, 2bw, virtual stages) are
    planned by PipeDream's steady state and headlined by simulate() (test_plan_step)."""
    from test_cli_step_costs import OVERHEAD, STEP_RATE, _calibrate

    monkeypatch.setenv("PDCOMPILE_CACHE", str(tmp_path))
    _calibrate(tmp_path)
    found = _spy_search(monkeypatch)
    pipe = _compile_lm(schedule)
    assert pipe.cost_source.table is not None and pipe.action_cost is not None
    # the calibration has no per-tensor costs (one before session 22): CPU's defaults ride with the per-action ones
    from pdcompile.machine_cache import FLATTEN_TENSOR_KEY, STEP_TENSOR_KEY
    from pdcompile.passes.costs.roofline import TENSOR_FLATTEN_S, TENSOR_STEP_S

    assert pipe.action_cost.seconds == {**OVERHEAD, STEP_TENSOR_KEY: TENSOR_STEP_S["cpu"],
                                        FLATTEN_TENSOR_KEY: TENSOR_FLATTEN_S["cpu"]}
    assert pipe.update_bandwidth == pytest.approx(5 * STEP_RATE)
    search = found[-1]
    assert (search.schedule, search.num_microbatches) == (schedule, pipe.num_microbatches)
    assert [(st.first, st.last, st.replicas) for st in search.stages] == \
        [(st.first, st.last, st.replicas) for st in pipe.plan.stages]
    assert search.seconds_per_minibatch == pytest.approx(float(pipe.simulate().step_time_s), rel=1e-9)
    assert pipe._tied() == tied_of(pipe.plan, pipe.wire_chain)
