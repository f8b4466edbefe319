"""Point-to-point under NCCL's rules: tags ignored, one transfer at a time per pair, in issue order.

Three layers: the transfer plan checked as data against NCCL's rules (every schedule, and the old
"post at use" order failing), gloo made to follow those rules catching an order that plain gloo
lets through, and every schedule trained under those rules bitwise equal to plain gloo.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from pdcompile.api import pdcompile
from pdcompile.errors import ScheduleError
from _ranks import run_ranks, run_script
from pdcompile.runtime import schedules
from pdcompile.runtime.program import Program
from pdcompile.runtime.schedules import Kind, make_schedule
from pdcompile.runtime.schedules.transfers import Message, check_transfers, link_order, transfer_plan
from pdcompile.zoo import get

# ------------------------------------------------------------------------------------------------
# the plan, as data


def _at_use(sched: schedules.Schedule) -> dict[int, list[tuple[schedules.Action, ...]]]:
    """The old runtime's order: every receive posted at its own RF/RB."""
    return {r: [(a,) if a.kind in (Kind.RECV_ACT, Kind.RECV_GRAD) else () for a in acts] for r, acts in sched.items()}


CONFIGS = [(n, reps, m) for n in ("gpipe", "flush", "1f1b", "2bw")
           for reps in ([1, 1], [1, 1, 1], [1, 1, 1, 1], [2, 1], [1, 2], [2, 2], [1, 3, 1], [3, 1, 2])
           for m in (1, 2, 4, 5)]


@pytest.mark.parametrize("name,replicas,m", CONFIGS)
def test_every_schedule_completes_under_nccl_rules(name: str, replicas: list[int], m: int) -> None:
    tied = not (name == "1f1b" and len(set(replicas)) > 1)
    for vs in ((False, True) if name == "1f1b" else (False,)):
        sched = make_schedule(name, replicas, m, tied=tied, vertical_sync=vs, num_steps=3)
        posts = transfer_plan(sched, replicas)
        for targets in (None, (), range(replicas[-1])):
            check_transfers(sched, replicas, posts, targets=targets)
        # every RF/RB is posted exactly once, at or before its own place
        for r, acts in sched.items():
            where = {b: i for i, bs in enumerate(posts[r]) for b in bs}
            recvs = [(i, a) for i, a in enumerate(acts) if a.kind in (Kind.RECV_ACT, Kind.RECV_GRAD)]
            assert sum(map(len, posts[r])) == len(recvs)
            assert all(where[a] <= i for i, a in recvs)


def test_the_old_order_fails_the_check() -> None:
    """Posting each receive at its RF/RB (as the runtime did) deadlocks 1F1B on 2 stages: rank 0's
    second send waits behind its first, rank 1 sends gradients before receiving it."""
    sched = make_schedule("1f1b", [1, 1], 4)
    with pytest.raises(ScheduleError, match="transfer order.*stuck"):
        check_transfers(sched, [1, 1], _at_use(sched))
    failing = sum(1 for name, reps, m in CONFIGS if _fails(name, reps, m))
    assert failing > len(CONFIGS) // 2


def _fails(name: str, reps: list[int], m: int) -> bool:
    sched = make_schedule(name, reps, m, num_steps=2)
    try:
        check_transfers(sched, reps, _at_use(sched))
    except ScheduleError:
        return True
    return False


def test_check_names_a_mismatched_pair() -> None:
    """Two receives of the same pair posted in swapped order pair the wrong messages (tags ignored)."""
    sched = make_schedule("gpipe", [1, 1], 2, split_backward=False)
    posts = transfer_plan(sched, [1, 1])
    rf0, rf1 = (a for a in sched[1] if a.kind is Kind.RECV_ACT)
    swapped = dict(posts)
    swapped[1] = [tuple(b for b in p if b not in (rf0, rf1)) for p in posts[1]]
    first = sched[1].index(rf0)
    swapped[1][first] = (rf1, rf0) + swapped[1][first]
    with pytest.raises(ScheduleError, match=r"rank 0's next transfer with rank 1 is to send 0A0, but rank 1's is to "
                                            r"receive 0A1|rank 1's next transfer with rank 0 is to receive 0A1, but "
                                            r"rank 0's is to send 0A0"):
        check_transfers(sched, [1, 1], swapped, targets=())


def test_link_order_respects_happens_before_and_puts_targets_first() -> None:
    sched = make_schedule("flush", [1, 1], 3)
    order = link_order(sched, [1, 1])[(0, 1)]
    assert order.index(Message(0, "T", 0)) + 1 == order.index(Message(0, "A", 0))
    for k in range(3):  # a microbatch's gradients follow its activations
        assert order.index(Message(k, "A", 0)) < order.index(Message(k, "G", 1))


def test_validate_checks_transfer_order() -> None:
    """validate() runs the NCCL check (rule 11) on every schedule it accepts."""
    sched = make_schedule("1f1b", [1, 1, 1], 4)
    schedules.validate(sched, [1, 1, 1], 4, "1f1b")
    assert "transfer order" in (schedules.validate.__doc__ or "")


# ------------------------------------------------------------------------------------------------
# gloo under NCCL's rules catches what plain gloo lets through

_SCRIPT = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist
    from pdcompile.runtime import comm
    dist.init_process_group("gloo")
    comm.configure(nccl_rules=sys.argv[1] == "nccl", timeout=4)
    rank, n = dist.get_rank(), 1 << 20  # 4 MB messages: too large to sit in a socket's buffer
    x = lambda v: torch.full((n,), float(v))
    if rank == 0:  # the old 1F1B order on 2 stages: two forwards' activations, then the first gradients
        s0, s1 = comm.post_send([x(1)], 1), comm.post_send([x(2)], 1)
        g = comm.post_recv([torch.empty(n)], 1).wait()[0]
        for w in s0 + s1:
            w.wait()
    else:
        a0 = comm.post_recv([torch.empty(n)], 0).wait()[0]
        if sys.argv[2] == "plan":  # the plan posts the second receive before sending the gradients
            p1 = comm.post_recv([torch.empty(n)], 0)
        s = comm.post_send([x(3)], 0)
        if sys.argv[2] != "plan":
            p1 = comm.post_recv([torch.empty(n)], 0)
        a1 = p1.wait()[0]
        for w in s:
            w.wait()
        assert a0[0].item() == 1 and a1[0].item() == 2
    print("ok", rank, flush=True)
    dist.destroy_process_group()
""")


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_gloo_under_nccl_rules_catches_the_old_order(tmp_path: Path) -> None:
    script = tmp_path / "order.py"
    script.write_text(_SCRIPT)

    def run(mode: str, order: str) -> tuple[int, str]:
        return run_script(script, 2, [mode, order], timeout=90, cwd=tmp_path)

    rc, out = run("plain", "old")
    assert rc == 0 and out.count("ok") == 2, out[-2000:]
    rc, out = run("nccl", "old")
    assert rc != 0
    assert "timed out after 4 s under NCCL's rules" in out, out[-3000:]
    rc, out = run("nccl", "plan")
    assert rc == 0 and out.count("ok") == 2, out[-2000:]


# ------------------------------------------------------------------------------------------------
# every schedule trains bitwise the same under NCCL's rules as on plain gloo

STEPS, MICRO, BATCH = 6, 2, 8

# (model, stages, replicas, schedule, extra flags): gpipe, flush, 1f1b, vertical sync, 2bw; a
# replicated stage; tied weights across stages (gpt); 2-4 stages; targets sent and local
# every other torchrun test of the suite runs under NCCL's rules; these check the mode changes no bit,
# on tied weights over 3 ranks, and a replicated stage with vertical sync and sent targets over 4
# (the suite's time budget)
TRAIN = [
    ("gpt", 3, None, "flush", []),
    ("mlp", 3, [2, 1, 1], "1f1b", ["--vertical-sync", "--targets", "send"]),
]


def _emit(tmp: Path, name: str, stages: int, replicas: list[int] | None) -> Path:
    z = get(name, batch_size=BATCH, seed=0)
    pipe = pdcompile(z.model, example_inputs=z.example_inputs, example_target=z.target, loss_fn=z.loss_fn,
                     optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), stages=stages,
                     schedule="flush", num_microbatches=MICRO, leaf_modules=z.leaf_modules, replicas=replicas)
    return pipe.emit(tmp / "prog", data={"factory": "pdcompile.zoo:batches", "kwargs": {"name": name}})


def _train(prog: Path, out: Path, schedule: str, extra: list[str], nccl_rules: bool) -> dict[int, Any]:
    nproc = Program.load(prog).world_size
    rc, log = run_ranks(prog, nproc, ["--schedule", schedule, "--steps", str(STEPS), "--save-final", str(out),
                                      "--timeout", "30", *extra], timeout=100,
                        env={"PDCOMPILE_NCCL_RULES": "1" if nccl_rules else "0"})
    assert rc == 0, f"{'under NCCL rules' if nccl_rules else 'plain gloo'}: exit {rc}\n{log[-4000:]}"
    return {int(p.name.split("rank_")[1].split(".")[0]): torch.load(p, weights_only=True) for p in out.glob("*.pt")}


@pytest.mark.multiproc
@pytest.mark.timeout(240)
@pytest.mark.parametrize("name,stages,replicas,schedule,extra", TRAIN,
                         ids=[f"{n}-{s}-{sch}-{'x'.join(map(str, r)) if r else 'r1'}{'-vs' if '--vertical-sync' in e else ''}"
                              f"-{'send' if 'send' in e else 'local'}" for n, s, r, sch, e in TRAIN])
def test_nccl_rules_train_bitwise_as_plain_gloo(tmp_path: Path, name: str, stages: int, replicas: list[int] | None,
                                                schedule: str, extra: list[str]) -> None:
    prog = _emit(tmp_path, name, stages, replicas)
    plain = _train(prog, tmp_path / "plain", schedule, extra, nccl_rules=False)
    ruled = _train(prog, tmp_path / "nccl", schedule, extra, nccl_rules=True)
    program = Program.load(prog)
    assert sorted(plain) == sorted(ruled) == list(range(program.world_size))
    initial = {s: dict(program.build_stage(s).named_parameters()) for s in range(program.num_stages)}
    for rank in plain:
        assert plain[rank].keys() == ruled[rank].keys()
        for k in plain[rank]:
            assert torch.equal(plain[rank][k], ruled[rank][k]), f"rank {rank} {k} differs under NCCL rules"
        s = program.stage_of_rank(rank).index
        assert any(not torch.equal(plain[rank][k], p) for k, p in initial[s].items()), f"rank {rank} never trained"


def test_no_transfer_carries_a_tag(monkeypatch: pytest.MonkeyPatch) -> None:
    """Messages are told apart by order alone: comm never passes a tag (NCCL would ignore it), and
    the packed message of several tensors of one dtype is one transfer."""
    from pdcompile.runtime import comm

    calls: list[tuple[str, int, dict[str, Any]]] = []

    class _Done:
        def wait(self) -> bool:
            return True

    def fake(kind: str) -> Any:
        def op(tensor: torch.Tensor, peer: int, **kw: Any) -> _Done:
            calls.append((kind, tensor.numel(), kw))
            return _Done()
        return op

    monkeypatch.setattr(comm.dist, "isend", fake("send"))
    monkeypatch.setattr(comm.dist, "irecv", fake("recv"))
    comm.configure(nccl_rules=False, timeout=5)
    comm.post_send([torch.zeros(2, 3), torch.zeros(4, dtype=torch.int64), torch.zeros(5)], 1)
    got = comm.post_recv([torch.zeros(2, 3), torch.zeros(4, dtype=torch.int64), torch.zeros(5)], 1).wait()
    assert [(k, n) for k, n, _ in calls] == [("send", 11), ("send", 4), ("recv", 11), ("recv", 4)]
    assert all(kw == {} for _, _, kw in calls)
    assert [t.shape for t in got] == [torch.Size([2, 3]), torch.Size([4]), torch.Size([5])]
    comm.configure(nccl_rules=True, timeout=5)  # the emulation's queue calls the same ops, also untagged
    try:
        calls.clear()
        works = comm.post_send([torch.zeros(3)], 1)
        assert all(w.wait() for w in works) and calls == [("send", 3, {})]
    finally:
        comm.configure(nccl_rules=False, timeout=120)
