"""Benchmark: checkpoint save and load+verify time, and file sizes, per stage of a 3-stage GPT pipeline.

The GPT-style zoo model (``--size full``: GPT-2 small, ~124M parameters, tied embedding and output
projection) is compiled into 3 stages. Each stage gets an Adam optimizer with one step taken (so its
state holds ``exp_avg`` and ``exp_avg_sq``: twice the weights), then each stage is checkpointed with
``pdcompile.runtime.checkpoint`` under the model's names (torch.distributed.checkpoint's files, the
rank's state file, SHA-256 of each, the manifest last: ``write_offline``, one process) and loaded back
(``load_rank``: manifest, SHA-256 of the files it reads, DCP's load in place, the optimizer's
``load_state_dict``); the whole model is then merged into Hugging Face's safetensors layout.
The restored weights and optimizer state are checked bitwise against the saved ones.

Stages run one after another in this process (train.py's ranks save in parallel, so a real
checkpoint takes about the slowest stage's time, plus the manifest).

Usage: python benchmarks/bench_checkpoint.py [--size full|small] [--repeats 1] [--dir DIR] [--merge-memory]
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import argparse  # noqa: E402
import copy  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from benchmarks._results import write_section  # noqa: E402
from pdcompile.api import pdcompile  # noqa: E402
from pdcompile import merge  # noqa: E402
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
    parts = [checkpoint.StagePart(st.gm, opt, dict(st.param_names), None, st.index) for st, opt in zip(stages, opts)]
    rows: dict[int, dict[str, Any]] = {st.index: {"save": [], "load": []} for st in stages}
    merge_s: list[float] = []
    bitwise = True
    for rep in range(repeats):
        for st, part in zip(stages, parts):  # each stage as its rank writes it: its own DCP part, then read back
            root = folder / f"rep{rep}" / f"stage{st.index}"
            state = checkpoint.rank_state([part], 1, 1)
            t = time.perf_counter()
            step = checkpoint.write_offline(root, plan, 1, checkpoint.state_dict_of([part]), state)
            rows[st.index]["save"].append(time.perf_counter() - t)
            rows[st.index]["bytes"] = sum(p.stat().st_size for p in step.iterdir())
            rows[st.index]["params"] = sum(p.numel() for p in st.gm.parameters())
            want_w = {n: t.detach().clone() for n, t in st.gm.state_dict().items()}
            want_opt = copy.deepcopy(part.optimizer.state_dict())
            with torch.no_grad():
                for p in st.gm.parameters():
                    p.zero_()
            fresh = torch.optim.Adam(st.gm.parameters(), lr=1e-4)
            t = time.perf_counter()
            checkpoint.load_rank(step, None, st.index, [checkpoint.StagePart(st.gm, fresh, part.names, None, st.index)])
            rows[st.index]["load"].append(time.perf_counter() - t)
            got = st.gm.state_dict()
            bitwise &= set(got) == set(want_w) and all(torch.equal(got[n], want_w[n]) for n in want_w)
            bitwise &= _same_optimizer_state(want_opt, fresh.state_dict())
        # the whole model in one checkpoint, merged back into Hugging Face's layout (2 GB shards)
        whole = checkpoint.write_offline(folder / f"rep{rep}" / "all", plan, 1, checkpoint.state_dict_of(parts),
                                         checkpoint.rank_state(parts, 1, 1))
        t = time.perf_counter()
        merge.write_hf(merge.checkpoint_source(whole, plan), folder / f"rep{rep}" / "hf", "2GB")
        merge_s.append(time.perf_counter() - t)
        shutil.rmtree(folder / f"rep{rep}")
    med = statistics.median
    lines = ["| stage | parameters | files (MiB) | save (s) | load + verify (s) |", "|---|---|---|---|---|"]
    for k, r in sorted(rows.items()):
        lines.append(f"| {k} | {r['params'] / 1e6:.1f} M | {_mib(r['bytes'])} | {med(r['save']):.2f} | "
                     f"{med(r['load']):.2f} |")
    lines.append(f"| all | {sum(r['params'] for r in rows.values()) / 1e6:.1f} M | "
                 f"{_mib(sum(r['bytes'] for r in rows.values()))} | {sum(med(r['save']) for r in rows.values()):.2f} | "
                 f"{sum(med(r['load']) for r in rows.values()):.2f} |")
    c = gpt.CONFIGS[size]
    cfg = f"{c.n_layers} layers, d={c.d_model}, T={c.seq_len}, vocabulary {c.vocab_size}"
    body = "\n".join([
        f"GPT-style zoo model, size `{size}` ({cfg}), {STAGES} stages "
        f"(compiled in {compile_s:.1f} s), Adam after one step; median of {repeats} run(s); files on local disk.",
        "",
        *lines,
        "",
        f"Restored weights and optimizer state bitwise equal to the saved ones: {'yes' if bitwise else 'NO'}. "
        f"`pdcompile merge` of the whole checkpoint into Hugging Face safetensors: {med(merge_s):.2f} s.",
        "",
        "Save = torch.distributed.checkpoint's save of the stage's tensors and Adam state under the model's names "
        "(one process), the rank's state file, SHA-256 of each file, the manifest; load + verify = manifest, SHA-256 "
        "of DCP's index and of the files holding the stage's tensors, DCP's load in place, the optimizer's "
        "load_state_dict. Stages ran one after another in one process; train.py's ranks save in parallel, so a "
        "pipeline's checkpoint costs about its largest stage. Times on a shared, loaded machine vary by 2x between runs.",
    ])
    return body, {"bitwise": bitwise, "rows": rows}


_SYNTHETIC = """
import sys, torch
from pdcompile.runtime import checkpoint
stages, tensors = [], {}
for s in range(4):
    names = {}
    for j in range(5):
        names[f"w{j}"] = f"layers.{s}.w{j}"
        tensors[f"layers.{s}.w{j}"] = torch.randn(10_000_000)  # 40 MB
    stages.append({"index": s, "ranks": [s], "param_names": names})
state = checkpoint.RankState(step=1, data_consumed=1, lr_scheduler=None, param_groups=None, rng={})
checkpoint.write_offline(sys.argv[1], {"world_size": 4, "stages": stages}, 1, tensors, state)
"""


def merge_memory(folder: Path) -> str:
    """Peak RSS of ``pdcompile merge`` on a checkpoint of 4 stages x 200 MB, each merge its own process
    (started from this small one: a child inherits its parent's peak), against the imports alone."""
    import subprocess

    subprocess.run([sys.executable, "-c", _SYNTHETIC, str(folder / "ck")], check=True)

    def peak(code: str) -> float:
        code += "; import resource; print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)"
        done = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
        return float(done.stdout.strip().splitlines()[-1])

    base = peak("import torch, pdcompile.cli, pdcompile.merge")
    rows = ["| output | peak RSS (MiB) | above the imports (MiB) |", "|---|---|---|"]
    for what, out in [("one model.safetensors", ["-o", str(folder / "one")]),
                      ("shards of 300MB + index", ["-o", str(folder / "sh"), "--max-shard-size", "300MB"]),
                      ("one .pt state dict (whole model in memory)", ["-o", str(folder / "m.pt")])]:
        mib = peak(f"from pdcompile.cli import main; main(['merge', {str(folder / 'ck')!r}, *{out!r}])")
        rows.append(f"| {what} | {mib:.0f} | {mib - base:.0f} |")
    return "\n".join([
        "A checkpoint of 4 stages x 200 MB (800 MB of fp32 tensors, 40 MB each), merged by `pdcompile merge` "
        f"in a fresh process each; the imports alone peak at {base:.0f} MiB.", "", *rows, "",
        "The folder outputs read and write one stage at a time (headers from shapes alone): about a stage above "
        "the imports. The .pt output holds the whole model (and a copy while serialising)."])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--merge-memory", action="store_true",
                    help="instead: peak RSS of pdcompile merge on a synthetic 4-stage, 800 MB checkpoint")
    ap.add_argument("--size", default="full", help="zoo GPT size: full (GPT-2 small, 124M) or small")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--dir", default=None, help="where to write the checkpoints (default: a temporary folder)")
    ap.add_argument("--no-write", action="store_true", help="print the table, don't touch RESULTS.md")
    args = ap.parse_args()
    folder = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="pd-bench-ckpt-"))
    folder.mkdir(parents=True, exist_ok=True)
    if args.merge_memory:
        try:
            body = merge_memory(folder)
        finally:
            if not args.dir:
                shutil.rmtree(folder, ignore_errors=True)
        print(body)
        if not args.no_write:
            write_section("pdcompile merge: peak memory", body)
        return
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
