"""The emulated slow link (pdcompile/slowlink.py) moves a message as a NIC does: its send completes
once the bytes have crossed at the emulated bandwidth, whatever the receiver is doing, and a receiver
that was busy meanwhile finds the bytes there when it posts its receive."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

from _ranks import run_script

BPS = 4e6
NBYTES = 4_000_000  # 1 s on the emulated link
LINK_S = NBYTES / BPS

SCRIPT = textwrap.dedent(f"""
    import json, time, datetime
    import torch, torch.distributed as dist
    from pdcompile import slowlink

    assert slowlink.install()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, n = dist.get_rank(), {NBYTES} // 4
    out = {{}}

    def busy(seconds):  # the receiver computes, its receive not yet posted
        x, t = torch.randn(64, 64), time.perf_counter()
        while time.perf_counter() - t < seconds:
            x = torch.tanh(x @ x)

    for case in ("ready", "busy"):
        dist.barrier()
        if rank == 1:
            msg = torch.arange(n, dtype=torch.float32) + (case == "busy")
            out[case + "_sent"] = time.perf_counter()
            w = dist.isend(msg, 0)
            w.wait()
            out[case + "_send_done"] = time.perf_counter()
            msg.zero_()  # the caller's buffer is its own again once the send completed
        else:
            if case == "busy":
                busy({3 * LINK_S})
            buf = torch.empty(n)
            out[case + "_posted"] = time.perf_counter()
            dist.irecv(buf, 1).wait()
            out[case + "_received"] = time.perf_counter()
            out[case + "_intact"] = bool(torch.equal(buf, torch.arange(n, dtype=torch.float32) + (case == "busy")))
    print("TIMES", rank, json.dumps(out), flush=True)
    dist.barrier()
    dist.destroy_process_group()
""")


def test_a_send_completes_after_its_bytes_time_with_the_receiver_busy(tmp_path: Path) -> None:
    """Clocks are perf_counter's (CLOCK_MONOTONIC, one clock for the processes of a machine). Bounds
    are relative to the emulated time (1 s) and generous on the slow side, where a loaded machine errs;
    the link's own delay is a sleep, so its lower bound is exact. The old link (a message crosses only
    once its receiver waits) fails the busy case: the receive then waits the full second."""
    script = tmp_path / "link.py"
    script.write_text(SCRIPT)
    status, log = run_script(script, 2, timeout=120, env={"PDCOMPILE_LINK_BPS": str(BPS)})
    assert status == 0, log
    times: dict[str, float] = {}
    for line in log.splitlines():
        if line.startswith("TIMES"):
            times.update(json.loads(line.split(" ", 2)[2]))
    assert times["ready_intact"] and times["busy_intact"], "the bytes received are the bytes sent"
    # receiver waiting: the message arrives one link time after the send, not before
    ready = times["ready_received"] - times["ready_sent"]
    assert 0.95 * LINK_S <= ready <= LINK_S + 1.5, ready
    assert 0.95 * LINK_S <= times["ready_send_done"] - times["ready_sent"] <= LINK_S + 1.5
    # receiver computing for 3 link times: the send completed meanwhile, before the receive was posted
    assert times["busy_send_done"] - times["busy_sent"] >= 0.95 * LINK_S
    assert times["busy_send_done"] < times["busy_posted"], times
    # and the receiver, posting late, finds the bytes there: its wait is a fraction of the link time
    late_wait = times["busy_received"] - times["busy_posted"]
    assert late_wait < 0.5 * LINK_S, late_wait
