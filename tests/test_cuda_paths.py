"""The CUDA paths, exercised on the CPU with torch.cuda mocked: device selection and its errors
(runtime/launch.py), pinned data, clocks that wait for the device (runtime/timing.py), and the split
backward's trust check under non-deterministic kernels (runtime/weight_grads.py)."""

from __future__ import annotations

import itertools
import json
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from pdcompile.errors import UsageError
from pdcompile.runtime import devices, launch, timing, trainer, weight_grads
from pdcompile.runtime.weight_grads import WeightPass, same_grads

pytestmark = pytest.mark.timeout(120)

CUDA0, CUDA1 = torch.device("cuda", 0), torch.device("cuda", 1)


# --- device selection ----------------------------------------------------------------------------

@pytest.mark.parametrize("flag,available,count,local_rank,local_world,want", [
    ("auto", False, 0, 0, 2, (torch.device("cpu"), "gloo")),
    ("auto", True, 2, 1, 2, (CUDA1, "nccl")),
    ("auto", True, 8, 0, 4, (CUDA0, "nccl")),  # more GPUs than ranks is fine
    ("cuda", True, 2, 0, 2, (CUDA0, "nccl")),
    ("cpu", True, 8, 3, 8, (torch.device("cpu"), "gloo")),  # forced CPU on a GPU machine
    ("cpu", False, 0, 0, 1, (torch.device("cpu"), "gloo")),
])
def test_choose_device(flag: str, available: bool, count: int, local_rank: int, local_world: int,
                       want: tuple[torch.device, str]) -> None:
    assert devices.choose_device(flag, available, count, local_rank, local_world) == want


@pytest.mark.parametrize("flag,available,count,local_rank,local_world,words", [
    ("auto", True, 1, 0, 2, ["1 GPU(s) for 2 local ranks", "--nproc-per-node", "--device cpu"]),
    ("cuda", True, 2, 3, 4, ["2 GPU(s) for 4 local ranks", "LOCAL_RANK 3", "--device cpu"]),
    ("cuda", False, 0, 0, 1, ["CUDA is not available", "--device cpu"]),
    ("gpu", True, 1, 0, 1, ["--device 'gpu'", "auto, cpu, cuda"]),
])
def test_choose_device_refuses_with_cause_and_fix(flag: str, available: bool, count: int, local_rank: int,
                                                  local_world: int, words: list[str]) -> None:
    with pytest.raises(UsageError) as e:
        devices.choose_device(flag, available, count, local_rank, local_world)
    msg = str(e.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg


@pytest.fixture
def program(tmp_path: Path) -> Path:
    """A 2-stage program's plan.json: all that train.py reads before its process group."""
    stage = {"module": "stage.py", "class": "Stage", "weights": "stage.pt", "inputs": [], "outputs": []}
    plan = {"model": "Tiny", "world_size": 2, "schedule": "flush", "num_microbatches": 2, "microbatch_size": 2,
            "stages": [dict(stage, index=k, ranks=[k]) for k in range(2)]}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    return tmp_path


def _main_until_init(monkeypatch: pytest.MonkeyPatch, folder: Path, argv: list[str], gpus: int,
                     local_world: int, local_rank: int = 1) -> list[Any]:
    """Run train.py's main on a machine with ``gpus`` mocked GPUs, up to init_process_group; the
    calls to set_device and init_process_group, in order."""
    calls: list[Any] = []

    class Stop(Exception):
        pass

    def init(backend: str, timeout: Any) -> None:
        calls.append(("init", backend))
        raise Stop

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", torch.device(d))))
    monkeypatch.setattr(launch, "init_process_group", init)
    monkeypatch.setattr(launch, "pin_cores", lambda rank, world: None)  # not this test process's cores (--pin-cores)
    env = {"RANK": str(local_rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(local_world)}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("PDCOMPILE_BACKEND", raising=False)
    factory = logging.getLogRecordFactory()
    try:
        launch.main(folder, argv)
    except Stop:
        pass
    finally:
        logging.setLogRecordFactory(factory)
    return calls


def test_train_py_sets_the_device_before_the_process_group(monkeypatch: pytest.MonkeyPatch, program: Path) -> None:
    calls = _main_until_init(monkeypatch, program, [], gpus=2, local_world=2)
    assert calls == [("set_device", CUDA1), ("init", "nccl")]


def test_train_py_device_cpu_forces_gloo_on_a_gpu_machine(monkeypatch: pytest.MonkeyPatch, program: Path) -> None:
    calls = _main_until_init(monkeypatch, program, ["--device", "cpu"], gpus=2, local_world=2)
    assert calls == [("init", "gloo")]


@pytest.mark.parametrize("local_rank", [0, 1])
def test_train_py_too_few_gpus_exits_2_with_one_line(monkeypatch: pytest.MonkeyPatch, program: Path,
                                                     capsys: pytest.CaptureFixture[str], local_rank: int) -> None:
    with pytest.raises(SystemExit) as e:
        _main_until_init(monkeypatch, program, [], gpus=1, local_world=2, local_rank=local_rank)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    if local_rank:  # said once per node, by its local rank 0
        assert err == []
    else:
        assert len(err) == 1 and "1 GPU(s) for 2 local ranks" in err[0] and "--device cpu" in err[0], err


# --- pinned data ---------------------------------------------------------------------------------

def _fake_pinning(monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """Tensor.pin_memory as a copy that is remembered (a CPU-only torch can't pin); is_pinned by it."""
    made: list[torch.Tensor] = []

    def pin_memory(self: torch.Tensor) -> torch.Tensor:
        out = self.clone()
        made.append(out)
        return out

    def is_pinned(self: torch.Tensor) -> bool:
        return any(self.untyped_storage().data_ptr() == m.untyped_storage().data_ptr() for m in made)

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(torch.Tensor, "is_pinned", is_pinned)
    return made


def test_pinned_only_for_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    made = _fake_pinning(monkeypatch)
    x = torch.randn(4, 3)
    assert devices.pinned(x, torch.device("cpu")) is x and not made
    p = devices.pinned(x, CUDA0)
    assert made == [p] and torch.equal(p, x)
    assert devices.pinned(p, CUDA0) is p and len(made) == 1  # already pinned: not copied again
    on_gpu = SimpleNamespace(device=CUDA0)  # a tensor already on the GPU is left alone
    assert devices.pinned(on_gpu, CUDA0) is on_gpu  # type: ignore[arg-type]


def test_trainer_data_gives_views_of_a_pinned_minibatch(monkeypatch: pytest.MonkeyPatch) -> None:
    made = _fake_pinning(monkeypatch)
    monkeypatch.setattr(devices, "rank_device", lambda: CUDA0)
    x, y = torch.randn(6, 3), torch.arange(6)
    t = trainer.Trainer.__new__(trainer.Trainer)
    stage0 = SimpleNamespace(inputs=[SimpleNamespace(name="x", shape=[2, 3])])  # the compiled input, checked per read
    t.program = SimpleNamespace(raw={"microbatch_size": 2}, stages=[stage0])
    t.M, t.data_index, t.data_iter = 3, -1, iter([(0, (0, 1, 2), (x,), y)])  # runtime/data.py Reader's items
    for k in range(3):
        (xk,), yk = t.data(k)
        assert torch.equal(xk, x[2 * k:2 * k + 2]) and torch.equal(yk, y[2 * k:2 * k + 2])
        assert xk.is_pinned() and yk.is_pinned()
    assert len(made) == 2  # the minibatch's input and target, once each


# --- timing --------------------------------------------------------------------------------------

class FakeEvent:
    """torch.cuda.Event on a fake device clock: record() stamps the next tick (ms)."""

    clock = itertools.count(start=10, step=7)
    synced: list["FakeEvent"] = []

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.t: int | None = None

    def record(self) -> None:
        self.t = next(FakeEvent.clock)

    def synchronize(self) -> None:
        FakeEvent.synced.append(self)

    def elapsed_time(self, end: "FakeEvent") -> float:
        assert self.t is not None and end.t is not None
        assert any(s.t is not None and s.t >= end.t for s in FakeEvent.synced), "read before the events ran"
        return float(end.t - self.t)


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    syncs: list[Any] = []
    FakeEvent.synced = []
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: syncs.append(d))
    return syncs


def test_step_timer_cpu_is_the_wall_clock(monkeypatch: pytest.MonkeyPatch, fake_cuda: list[Any]) -> None:
    ticks = iter([1.0, 1.5, 2.0, 4.0])
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(ticks))
    t = timing.StepTimer("cpu")
    for _ in range(2):
        t.start()
        t.stop()
    assert t.pending == 2
    assert t.collect() == [0.5, 2.0] and t.pending == 0 and t.collect() == []
    assert fake_cuda == [] and FakeEvent.synced == []
    with pytest.raises(RuntimeError):
        t.stop()


def test_step_timer_cuda_reads_events_at_collect_only(fake_cuda: list[Any]) -> None:
    t = timing.StepTimer(CUDA0)
    for _ in range(3):
        t.start()
        t.stop()
    assert FakeEvent.synced == [] and fake_cuda == []  # no host synchronisation per step
    # events stamped 10, 17 | 24, 31 | 38, 45 (ms): each step 7 ms
    assert t.collect() == pytest.approx([0.007, 0.007, 0.007])
    assert len(FakeEvent.synced) == 1 and FakeEvent.synced[0].t == 45  # waited for the newest event only
    assert fake_cuda == []


def test_sync_and_now_wait_for_a_gpu_only(monkeypatch: pytest.MonkeyPatch, fake_cuda: list[Any]) -> None:
    timing.sync("cpu")
    timing.sync(torch.device("cpu"))
    assert fake_cuda == []
    timing.sync(CUDA1)
    assert fake_cuda == [CUDA1]
    order: list[str] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: order.append("sync"))
    monkeypatch.setattr(timing.time, "perf_counter", lambda: order.append("clock") or 3.0)
    assert timing.now(CUDA0) == 3.0 and order == ["sync", "clock"]
    order.clear()
    assert timing.now("cpu") == 3.0 and order == ["clock"]


def test_recorder_ends_a_slice_when_the_gpu_is_done(monkeypatch: pytest.MonkeyPatch, fake_cuda: list[Any]) -> None:
    events: list[tuple[str, float, float]] = []
    timing.recorder(events.append, "cpu")("0F0", 1.0, 2.0)
    assert events == [("0F0", 1.0, 2.0)] and fake_cuda == []
    monkeypatch.setattr(timing.time, "perf_counter", lambda: 5.0)
    timing.recorder(events.append, CUDA0)("0B0", 3.0, 4.0)
    assert events[-1] == ("0B0", 3.0, 5.0) and fake_cuda == [CUDA0]


# --- the split backward's trust check under non-deterministic kernels ----------------------------

def test_same_grads_bitwise_or_within_noise() -> None:
    g = torch.randn(64, 32)
    ulp = torch.nextafter(g, torch.full_like(g, float("inf")))  # one unit in the last place
    assert same_grads(g, g.clone(), exact=True)
    assert not same_grads(g, ulp, exact=True)
    assert same_grads(g, ulp, exact=False)
    part = g.clone()
    part[0] *= 0.5  # a contribution missing from one row
    assert not same_grads(g, part, exact=False)
    assert not same_grads(g, g[:32], exact=False)
    h = g.half()
    h_ulp = torch.nextafter(h, torch.full_like(h, float("inf")))
    assert not same_grads(h, h_ulp, exact=True) and same_grads(h, h_ulp, exact=False)
    z = torch.zeros(3)
    assert same_grads(z, z.clone(), exact=False) and not same_grads(z, z + 1e-30, exact=False)


def test_bitwise_check_on_cpu_or_deterministic_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: False)
    assert weight_grads.bitwise_check(torch.device("cpu"))
    assert not weight_grads.bitwise_check(CUDA0)
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    assert weight_grads.bitwise_check(CUDA0)


class TwoLinear(torch.nn.Module):
    """Linear -> tanh -> Linear; ``outside``: the second Linear's weight also used outside its call."""

    def __init__(self, outside: bool) -> None:
        super().__init__()
        self.a, self.b, self.outside = torch.nn.Linear(6, 8), torch.nn.Linear(8, 8), outside

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.b(torch.tanh(self.a(x)))
        return h + h @ self.b.weight if self.outside else h


@pytest.mark.parametrize("exact", [True, False])
@pytest.mark.parametrize("kind", ["plain", "outside"])
def test_trust_check_with_noisy_kernels(monkeypatch: pytest.MonkeyPatch, exact: bool, kind: str) -> None:
    """Non-deterministic kernels emulated: the plain walk's weight gradients come out one ulp off.
    A bitwise check then distrusts a stage whose fast path is exact; the tolerant one (what a GPU
    without deterministic algorithms gets) trusts it, and still distrusts a parameter used outside
    its submodule's call."""
    torch.manual_seed(0)
    net = TwoLinear(outside=kind == "outside")
    x = torch.randn(4, 6, requires_grad=True)
    wp = WeightPass(net)
    real_grad = torch.autograd.grad

    def noisy_grad(outputs: Any, inputs: Any, *a: Any, **k: Any) -> Any:
        got = real_grad(outputs, inputs, *a, **k)
        if isinstance(inputs, list) and len(inputs) == len(wp.params) and all(p is q for p, q in zip(inputs, wp.params)):
            return tuple(g if g is None else torch.nextafter(g, torch.full_like(g, float("inf"))) for g in got)
        return got

    monkeypatch.setattr(torch.autograd, "grad", noisy_grad)
    monkeypatch.setattr(weight_grads, "bitwise_check", lambda device: exact)
    handles, notes = wp.capture()
    loss = net(x).pow(2).mean()
    for h in handles:
        h.remove()
    _, work = wp.input_grads([loss], None, [x], notes)
    wp.weight_grads(work)
    assert wp.trusted is (kind == "plain" and not exact)
    assert all(p.grad is not None for p in net.parameters())
