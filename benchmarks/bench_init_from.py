"""A Hugging Face model of about 300M parameters started from safetensors in 2- and 4-stage pipelines,
against today's emit path (#28 Measure, third item); and the readers of a stage's tensors side by side.

    python benchmarks/bench_init_from.py                 # ~15 minutes on 2 shared cores, ~6 GB of disk in /tmp
    python benchmarks/bench_init_from.py --part readers  # one part
    python benchmarks/bench_init_from.py --quick         # a tiny Llama, prints only

The model: a Llama of 20 layers, width 1024 (``benchmarks/_common.py`` ``llama-300m``), saved once with
``save_pretrained`` (fp32 safetensors). Two ways to a program, each compiled in its own process:

- *init_from*: the model built on the meta device, compiled with analytic costs, emitted with
  ``init_from=`` the saved folder (no weights written); each rank reads only its stage's tensors;
- *emit*: today's path: ``from_pretrained`` in the compiling process, whose ``stage_K.pt`` files
  the ranks load.

*pipelines*: each program trains 1 step (SGD without momentum: no optimizer state; ``--optimizer adam``:
two states per parameter, torch's default per-tensor Adam on CPU; ``adam-fused``: ``Adam(fused=True)``, its
fused CPU kernel) under torchrun, with ``train.py --grad-accumulation`` as ``--grad-accumulation`` says
(default ``auto``: the big weights' gradients fused into ``.grad``; ``autograd``: as before) and ``train.py
--malloc`` as ``--malloc`` says (several modes: each program trained once per mode, back to back; ``--steps N``
also gives the median step time). Reported: the compiling process's peak RSS (``ru_maxrss``;
target < 1 GiB with init_from); each rank's peak RSS (the metrics' ``peak_rss_mb``); the baseline of a
process that has only imported what a rank imports before it builds anything (torch and the runtime;
``python -c "import torch"`` alone is reported too; and one with a torch.optim optimizer's step, which
imports torch._dynamo: the ratio against it is a second column); and the stage's share (its weights, gradients and
optimizer state, fp32). Target: rank peak - baseline <= share x 1.15.

*readers*: stage 0 and the last stage of the 4-stage program filled in a fresh process by each reader:
ours (plain reads, ``runtime/sources.py``), safetensors' ``safe_open`` slices (the file mapped for each
tensor: our path before), and torch.distributed.checkpoint's ``HuggingFaceStorageReader`` (``dcp.load`` of the stage's
keys into its own tensors). Reported: seconds, and the peak RSS above the stage's weights.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import llama_config, peak_rss_mib, run_child  # noqa: E402
from benchmarks._results import publish  # noqa: E402

MiB = 2.0**20
BATCH, SEQ = 2, 32
READERS = ("ours", "safe_open", "hf_storage_reader")


def child(cfg: dict[str, Any]) -> dict[str, Any]:
    """One step in its own process: ``save`` the model, compile and emit (``way``: init_from or emit) for
    ``stages`` stages, or ``read`` one stage with one reader."""
    if cfg["step"] == "read":
        return read_stage(Path(cfg["prog"]), cfg["stage"], cfg["reader"], Path(cfg["hf"]))
    import torch
    import transformers

    config = llama_config(cfg["model"])
    if cfg["step"] == "save":
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(config).save_pretrained(cfg["hf"])
        return {}
    from pdcompile.api import pdcompile
    from pdcompile.zoo.losses import SequenceCrossEntropy

    t0 = time.perf_counter()
    if cfg["way"] == "init_from":
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(config)
    else:
        model = transformers.LlamaForCausalLM.from_pretrained(cfg["hf"])
    x = torch.randint(0, 100, (BATCH, SEQ))
    adam, fused = cfg["optimizer"].startswith("adam"), cfg["optimizer"] == "adam-fused"
    pipe = pdcompile(model, example_inputs=(x,), example_target=torch.randint(0, 100, (BATCH, SEQ)),
                     loss_fn=SequenceCrossEntropy(), stages=cfg["stages"], num_microbatches=BATCH,
                     cost_mode="analytic", optimizer=(lambda p: torch.optim.Adam(p, lr=1e-4, fused=fused)) if adam
                     else (lambda p: torch.optim.SGD(p, lr=0.01)))
    pipe.emit(cfg["out"], init_from=cfg["hf"] if cfg["way"] == "init_from" else None)
    params = {st.index: sum(p.numel() for p in st.gm.parameters()) for st in pipe.split.stages}
    return {"compile_emit_s": time.perf_counter() - t0, "rss_mib": peak_rss_mib(), "stage_params": params,
            "params": sum(p.numel() for p in model.parameters())}


def read_stage(prog: Path, stage: int, reader: str, hf: Path) -> dict[str, Any]:
    """Stage ``stage`` of ``prog`` built on meta, given storage, and filled from ``hf`` by ``reader``;
    checked against safetensors' own whole-tensor reads."""
    import warnings

    import torch
    from safetensors import safe_open

    from pdcompile.runtime import sources
    from pdcompile.runtime.program import Program, _load_file

    p = Program.load(prog)
    spec = p.stages[stage]
    with torch.device("meta"):
        module = getattr(_load_file(p.folder / spec.module, "stage"), spec.cls)()
    module = module.to_empty(device="cpu")
    own = sources.stage_tensors(module)
    skip = set(p.init.get("not_in_state_dict") or ())
    wanted = {orig: own[local] for local, orig in spec.param_names.items() if orig not in skip}
    weights = sum(t.numel() * t.element_size() for t in wanted.values()) / MiB
    files = sorted(hf.glob("*.safetensors"))
    import torch.distributed.checkpoint as dcp  # imported before the clock, as a rank would have
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    before = peak_rss_mib()
    t0 = time.perf_counter()
    with torch.no_grad():
        if reader == "ours":
            ck = sources.open_checkpoint(hf)
            assert isinstance(ck, sources.SafetensorsReader)
            for name, t in wanted.items():
                ck.copy_into(name, t)
        elif reader == "safe_open":  # our path before: the file mapped once per tensor, 16 MiB slices of rows
            where = {k: f for f in files for k in _keys(f)}
            for name, t in wanted.items():
                with safe_open(str(where[name]), framework="pt", device="cpu") as h:
                    part = h.get_slice(name)
                    step = max(1, (16 << 20) // max(1, t[0].numel() * t.element_size()))
                    for i in range(0, t.shape[0], step):
                        t[i:i + step].copy_(part[i:i + step])
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dcp.load(dict(wanted), storage_reader=HuggingFaceStorageReader(str(hf)), no_dist=True)
    seconds = time.perf_counter() - t0
    peak = peak_rss_mib()
    wrong = 0
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as h:
            wrong += sum(not torch.equal(wanted[k], h.get_tensor(k)) for k in h.keys() if k in wanted)
    return {"s": seconds, "above_weights_mib": peak - before - weights, "weights_mib": weights, "wrong": wrong}


def _keys(f: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(f), framework="pt", device="cpu") as h:
        return list(h.keys())


def _baseline(code: str) -> float:
    """Peak RSS (MiB) of a fresh ``python -c code``: what a process holds before it does anything."""
    out = subprocess.run([sys.executable, "-c", f"{code}\nimport resource\n"
                          "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)"],
                         capture_output=True, text=True, check=True, timeout=300)
    return float(out.stdout.split()[-1])


def _child(cfg: dict[str, Any]) -> dict[str, Any]:
    r = run_child(__file__, cfg, timeout=1800)
    if "error" in r:
        raise RuntimeError(f"child {cfg['step']} failed: {r['error']}")
    return r


def train_one_step(prog: Path, world: int, metrics: Path, grad_accumulation: str = "auto", malloc: str = "keep",
                   steps: int = 1) -> tuple[dict[int, float], float | None]:
    """Each rank's peak RSS (MiB) over start-up and ``steps`` training steps, by stage; and the median
    step time (s, the slowest rank's, the first step left out) when there are more than one."""
    import statistics

    from pdcompile.launcher import launch

    shutil.rmtree(metrics, ignore_errors=True)
    rc, log = launch(prog, world, ["--steps", str(steps), "--metrics", str(metrics), "--timeout", "600",
                                   "--grad-accumulation", grad_accumulation, "--malloc", malloc], timeout=1800)
    if rc != 0:
        raise RuntimeError(f"training failed ({rc}):\n{log[-3000:]}")
    ranks = [json.loads(p.read_text()) for p in sorted(metrics.glob("rank_*.json"))]
    step = statistics.median(max(t) for t in list(zip(*(r["step_times_s"] for r in ranks)))[1:]) if steps > 1 else None
    return {int(r["stage"]): float(r["peak_rss_mb"]) for r in ranks}, step


def _met(ratio: Sequence[float]) -> str:
    return "yes" if all(x <= 1.15 for x in ratio) else f"{sum(x <= 1.15 for x in ratio)} of {len(ratio)}"


def pipelines(model: str, hf: Path, tmp: Path, optimizer: str, grad_accumulation: str = "auto",
              stage_counts: Sequence[int] = (2, 4), ways: Sequence[str] = ("init_from", "emit"),
              mallocs: Sequence[str] = ("keep",), steps: int = 1) -> str:
    """Each program trained once per ``train.py --malloc`` mode in ``mallocs``, back to back."""
    torch_only = _baseline("import torch")
    base = _baseline("import torch\nimport pdcompile.runtime.trainer")
    # torch.optim imports torch._dynamo at an optimizer's construction and at each step (its
    # ``_disable_dynamo`` wrappers, ``_use_grad_for_differentiable``): any process that trains with it holds it
    optim = _baseline("import torch\nimport pdcompile.runtime.trainer\n"
                      "torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1).step()")
    adam = optimizer.startswith("adam")
    per_param = 8 + (8 if adam else 0)  # fp32 weight + gradient (+ Adam's two states)
    rows = ["| way | stages | --malloc | compile + emit (s) | compiling process: peak RSS (MiB) | rank: peak RSS (MiB) | "
            "rank: peak - baseline (MiB) | share: weights + grads" + (" + Adam state" if adam else "")
            + " (MiB) | (peak - baseline) / share | target met (<= 1.15) | (peak - baseline with torch.optim's "
            "imports) / share | met | step s (median of steps 2..) |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    r: dict[str, Any] = {}
    for stages in stage_counts:
        for way in ways:
            out = tmp / f"{way}_{stages}"
            r = _child({"step": "compile", "model": model, "hf": str(hf), "way": way, "stages": stages,
                        "out": str(out), "optimizer": optimizer})
            share = {int(k): per_param * n / MiB for k, n in r["stage_params"].items()}
            for malloc in mallocs:
                ranks, step = train_one_step(out, stages, tmp / f"m_{way}_{stages}", grad_accumulation, malloc, steps)
                ks = sorted(ranks)
                ratio = [(ranks[k] - base) / share[k] for k in ks]
                ratio_optim = [(ranks[k] - optim) / share[k] for k in ks]
                rows.append(f"| {way} | {stages} | {malloc} | {r['compile_emit_s']:.1f} | {r['rss_mib']:.0f} | "
                            + ", ".join(f"{ranks[k]:.0f}" for k in ks) + " | "
                            + ", ".join(f"{ranks[k] - base:.0f}" for k in ks) + " | "
                            + ", ".join(f"{share[k]:.0f}" for k in ks) + " | "
                            + ", ".join(f"{x:.2f}" for x in ratio) + f" | {_met(ratio)} | "
                            + ", ".join(f"{x:.2f}" for x in ratio_optim) + f" | {_met(ratio_optim)} | "
                            + (f"{step:.2f}" if step is not None else "-") + " |")
                print(rows[-1], flush=True)
            shutil.rmtree(out, ignore_errors=True)
    return (f"{model}: {r['params'] / 1e6:.0f}M parameters; optimizer {optimizer}; --grad-accumulation "
            f"{grad_accumulation}. Baselines (peak RSS of a fresh "
            f"process): `python -c \"import torch\"` {torch_only:.0f} MiB; what a rank imports before it builds "
            f"anything (torch, pdcompile.runtime) {base:.0f} MiB: the 'baseline' below; that and one step of a "
            f"torch.optim optimizer (which imports torch._dynamo) {optim:.0f} MiB: 'baseline with torch.optim's "
            f"imports'. Minibatch {BATCH} x {SEQ} tokens, {BATCH} microbatches, flush, {steps} step(s). Per rank: "
            f"stage 0 first.\n\n" + "\n".join(rows))


def readers(model: str, hf: Path, tmp: Path) -> str:
    prog = tmp / "readers_prog"
    _child({"step": "compile", "model": model, "hf": str(hf), "way": "init_from", "stages": 4, "out": str(prog),
            "optimizer": "sgd"})
    rows = ["| reader | stage | its weights (MiB) | seconds | peak RSS above its weights (MiB) | tensors wrong |",
            "|---|---|---|---|---|---|"]
    for stage in (0, 3):
        for reader in READERS:
            r = _child({"step": "read", "prog": str(prog), "stage": stage, "reader": reader, "hf": str(hf)})
            rows.append(f"| {reader} | {stage} | {r['weights_mib']:.0f} | {r['s']:.2f} | {r['above_weights_mib']:.0f} "
                        f"| {r['wrong']} |")
            print(rows[-1], flush=True)
    return ("Stage 0 (embedding first) and stage 3 (LM head last) of the 4-stage program, each filled in a fresh "
            "process from the one-file fp32 checkpoint:\n\n" + "\n".join(rows))


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=["pipelines", "readers", "all"], default="all")
    ap.add_argument("--optimizer", choices=["sgd", "adam", "adam-fused"], default="sgd",
                    help="adam: torch's default Adam (per tensor on CPU); adam-fused: Adam(fused=True)")
    ap.add_argument("--grad-accumulation", choices=["auto", "fused", "autograd"], default="auto",
                    help="train.py --grad-accumulation of the ranks (autograd: as before fused accumulation)")
    ap.add_argument("--stages", type=int, nargs="+", choices=[2, 4], default=[2, 4])
    ap.add_argument("--malloc", nargs="+", choices=["keep", "release", "glibc"], default=["keep"],
                    help="train.py --malloc of the ranks; several: each program trained once per mode, back to back")
    ap.add_argument("--steps", type=int, default=1, help="training steps per launch (more than one: step times too)")
    ap.add_argument("--ways", nargs="+", choices=["init_from", "emit"], default=["init_from", "emit"])
    ap.add_argument("--quick", action="store_true", help="a tiny Llama; print only")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(child(json.loads(a.child))), flush=True)
        return ""
    with open("/proc/loadavg") as f:
        load = f.read().strip()
    model = "tiny" if a.quick else "llama-300m"
    parts = []
    with tempfile.TemporaryDirectory(prefix="bench-init-from-") as t:
        tmp = Path(t)
        hf = tmp / "hf"
        _child({"step": "save", "model": model, "hf": str(hf)})
        size = sum(f.stat().st_size for f in hf.glob("*.safetensors")) / MiB
        if a.part in ("pipelines", "all"):
            parts.append(pipelines(model, hf, tmp, a.optimizer, a.grad_accumulation, a.stages, a.ways, a.malloc,
                                   a.steps))
        if a.part in ("readers", "all"):
            parts.append(readers(model, hf, tmp))
    body = (f"The checkpoint: {size:.0f} MiB of fp32 safetensors (one file).\n\n" + "\n\n".join(parts)
            + f"\n\nLoad before the run (`cat /proc/loadavg`): {load}; machine: 2-core CPU, shared.\n")
    publish("Big model: a 300M HF model from safetensors vs emitted weights", body,
            f"python benchmarks/bench_init_from.py{' --part ' + a.part if a.part != 'all' else ''}"
            f"{' --optimizer ' + a.optimizer if a.optimizer != 'sgd' else ''}"
            f"{' --grad-accumulation ' + a.grad_accumulation if a.grad_accumulation != 'auto' else ''}"
            f"{' --malloc ' + ' '.join(a.malloc) if a.malloc != ['keep'] else ''}"
            f"{' --steps ' + str(a.steps) if a.steps != 1 else ''}",
            write=not a.quick and a.part == "all" and a.optimizer == "sgd" and a.grad_accumulation == "auto"
            and a.stages == [2, 4] and a.ways == ["init_from", "emit"] and a.malloc == ["keep"] and a.steps == 1)  # other runs: printed, read by hand
    return body


if __name__ == "__main__":
    main()
