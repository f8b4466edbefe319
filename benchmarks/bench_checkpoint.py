"""Benchmark: checkpoint save and load+verify time, and file sizes, per stage of a 3-stage GPT pipeline.

The GPT-style zoo model (``--size full``: GPT-2 small, ~124M parameters, tied embedding and output
projection) is compiled into 3 stages. Each stage gets an Adam optimizer with one step taken (so its
state holds ``exp_avg`` and ``exp_avg_sq``: twice the weights), then the stages are checkpointed
with ``pdcompile.runtime.checkpoint`` exactly as train.py's ranks do it (``write_rank`` per rank:
torch.save to memory, SHA-256, temporary file, fsync, rename; then ``write_manifest`` by rank 0) and
loaded back (``load_rank``: manifest, plan check, SHA-256 of the rank's files,
``torch.load(weights_only=True)``; then ``restore_module`` and the optimizer's ``load_state_dict``).
The restored weights and optimizer state are checked bitwise against the saved ones.

Stages run one after another in this process (train.py's ranks save in parallel, so a real
checkpoint takes about the slowest stage's time, plus the manifest).

Usage: python benchmarks/bench_checkpoint.py [--size full|small] [--repeats 1] [--dir DIR]
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import argparse  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from benchmarks._results import write_section  # noqa: E402
from pdcompile.api import pdcompile  # noqa: E402
from pdcompile.runtime import checkpoint  # noqa: E402
from pdcompile.zoo import get, gpt  # noqa: E402

STAGES = 3


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def _adam(module: torch.nn.Module) -> torch.optim.Optimizer:
    opt = torch.optim.Adam(module.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    for p in module.parameters():
        p.grad = torch.randn(p.shape, generator=gen) * 1e-3
    opt.step()
    opt.zero_grad(set_to_none=True)
    return opt


def _same_optimizer_state(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a["param_groups"] != b["param_groups"] or set(a["state"]) != set(b["state"]):
        return False
    for k, sa in a["state"].items():
        sb = b["state"][k]
        if set(sa) != set(sb) or not all(torch.equal(torch.as_tensor(sa[n]), torch.as_tensor(sb[n])) for n in sa):
            return False
    return True


def run(size: str, repeats: int, folder: Path) -> tuple[str, dict[str, Any]]:
    t0 = time.perf_counter()
    z = get("gpt", size=size, batch_size=2, seed=0)
    pipe = pdcompile(z.model, example_inputs=z.example_inputs, example_target=z.target, loss_fn=z.loss_fn,
                     stages=STAGES, num_microbatches=2, leaf_modules=z.leaf_modules)
    compile_s = time.perf_counter() - t0
    stages = pipe.split.stages
    plan = {"world_size": STAGES,
            "stages": [{"index": st.index, "ranks": [st.index], "param_names": dict(st.param_names)} for st in stages]}
    opts = [_adam(st.gm) for st in stages]
    rows: dict[int, dict[str, Any]] = {st.index: {"save": [], "load": [], "verify": []} for st in stages}
    manifest_s: list[float] = []
    bitwise = True
    for rep in range(repeats):
        root = folder / f"rep{rep}"
        files: dict[str, tuple[str, int]] = {}
        saved: dict[int, tuple[dict[str, torch.Tensor], dict[str, Any]]] = {}
        for st, opt in zip(stages, opts):
            weights = {n: t for n, t in st.gm.state_dict().items()}
            state = checkpoint.RankState(step=1, next_microbatch=2, data_consumed=1, optimizer=opt.state_dict(),
                                         lr_scheduler=None, weight_store=None, rng=checkpoint.rng_state())
            t = time.perf_counter()
            written = checkpoint.write_rank(root, plan, st.index, st.index, weights, state)
            rows[st.index]["save"].append(time.perf_counter() - t)
            files.update(written)
            rows[st.index]["weights_bytes"] = written[checkpoint.weights_name(st.index, st.index)][1]
            rows[st.index]["state_bytes"] = written[checkpoint.state_name(st.index, st.index)][1]
            rows[st.index]["params"] = sum(p.numel() for p in st.gm.parameters())
            saved[st.index] = ({n: t.detach().clone() for n, t in weights.items()}, opt.state_dict())
        t = time.perf_counter()
        step_folder = checkpoint.write_manifest(root, plan, 1, files)
        manifest_s.append(time.perf_counter() - t)
        for st, opt in zip(stages, opts):
            names = [checkpoint.weights_name(st.index, st.index), checkpoint.state_name(st.index, st.index)]
            t = time.perf_counter()
            checkpoint.verify(step_folder, plan, names)
            rows[st.index]["verify"].append(time.perf_counter() - t)
            t = time.perf_counter()
            weights, state = checkpoint.load_rank(step_folder, plan, st.index, st.index)
            checkpoint.restore_module(st.gm, weights, str(step_folder))
            opt.load_state_dict(state.optimizer)
            rows[st.index]["load"].append(time.perf_counter() - t)
            want_w, want_opt = saved[st.index]
            got = st.gm.state_dict()
            bitwise &= set(got) == set(want_w) and all(torch.equal(got[n], want_w[n]) for n in want_w)
            bitwise &= _same_optimizer_state(want_opt, opt.state_dict())
        shutil.rmtree(root)
    med = statistics.median
    lines = ["| stage | parameters | weights file (MiB) | state file (MiB) | save (s) | load + verify (s) | "
             "of which manifest + SHA-256 check (s) |", "|---|---|---|---|---|---|---|"]
    for k, r in sorted(rows.items()):
        lines.append(f"| {k} | {r['params'] / 1e6:.1f} M | {_mib(r['weights_bytes'])} | {_mib(r['state_bytes'])} | "
                     f"{med(r['save']):.2f} | {med(r['load']):.2f} | {med(r['verify']):.2f} |")
    total_bytes = sum(r["weights_bytes"] + r["state_bytes"] for r in rows.values())
    lines.append(f"| all | {sum(r['params'] for r in rows.values()) / 1e6:.1f} M | "
                 f"{_mib(sum(r['weights_bytes'] for r in rows.values()))} | "
                 f"{_mib(sum(r['state_bytes'] for r in rows.values()))} | "
                 f"{sum(med(r['save']) for r in rows.values()):.2f} | {sum(med(r['load']) for r in rows.values()):.2f} | "
                 f"{sum(med(r['verify']) for r in rows.values()):.2f} |")
    c = gpt.CONFIGS[size]
    cfg = f"{c.n_layers} layers, d={c.d_model}, T={c.seq_len}, vocabulary {c.vocab_size}"
    body = "\n".join([
        f"GPT-style zoo model, size `{size}` ({cfg}), {STAGES} stages "
        f"(compiled in {compile_s:.1f} s), Adam after one step; median of {repeats} run(s); files on local disk. "
        f"Tied embedding/output weights are stored in both stages that hold them.",
        "",
        *lines,
        "",
        f"Manifest (rank 0, after every rank's files): {med(manifest_s):.3f} s. Total on disk: "
        f"{_mib(total_bytes)} MiB. Restored weights and optimizer state bitwise equal to the saved ones: "
        f"{'yes' if bitwise else 'NO'}.",
        "",
        "Save = torch.save into memory + SHA-256 + write + fsync + rename, for the weights and the state file; "
        "load + verify = manifest and plan check, SHA-256 of the rank's two files, torch.load(weights_only=True), "
        "copy into the module and the optimizer. Stages ran one after another in one process; train.py's ranks "
        "save in parallel, so a pipeline's checkpoint costs about its largest stage. Times on a shared, loaded "
        "machine vary by 2x between runs.",
    ])
    return body, {"bitwise": bitwise, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="full", help="zoo GPT size: full (GPT-2 small, 124M) or small")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--dir", default=None, help="where to write the checkpoints (default: a temporary folder)")
    ap.add_argument("--no-write", action="store_true", help="print the table, don't touch RESULTS.md")
    args = ap.parse_args()
    folder = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="pd-bench-ckpt-"))
    folder.mkdir(parents=True, exist_ok=True)
    try:
        body, info = run(args.size, args.repeats, folder)
    finally:
        if not args.dir:
            shutil.rmtree(folder, ignore_errors=True)
    print(body)
    if not info["bitwise"]:
        raise SystemExit("restored checkpoint differs from the saved state")
    if not args.no_write:
        write_section("Checkpoint save/load per stage (GPT)", body)


if __name__ == "__main__":
    main()
