"""A Hugging Face model of about 300M parameters started from safetensors in 2- and 4-stage pipelines,
against today's emit path (#28 Measure, third item).

    python benchmarks/bench_init_from.py            # ~10 minutes on 2 shared cores, about 6 GB of disk in /tmp
    python benchmarks/bench_init_from.py --quick    # a tiny Llama, prints only

The model: a Llama of 20 layers, width 1024 (transformers' ``LlamaConfig``), saved once with
``save_pretrained`` (fp32 safetensors). Two ways to a program, each compiled in its own process:

- *init_from*: the model built on the meta device, compiled with analytic costs, emitted with
  ``init_from=`` the saved folder (no weights written); each rank reads only its stage's tensors;
- *emit*: today's path: ``from_pretrained`` in the compiling process, whose ``stage_K.pt`` files
  the ranks load.

Each program then trains 1 step (SGD without momentum: no optimizer state) under torchrun. Reported:
the compiling process's peak RSS (``ru_maxrss``; target < 1 GiB with init_from), each rank's peak RSS
(the metrics' ``peak_rss_mb``), and that rank's share of weights and gradients (fp32: 8 bytes per
parameter of its stage) plus 15%, the target, above the RSS of a process that has only imported
what a rank imports (torch, transformers, the runtime).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._results import publish  # noqa: E402

MiB = 2.0**20
CONFIGS = {
    "llama-300m": dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=20,
                       num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=512),
    "tiny": dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                 num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64),
}
BATCH, SEQ = 2, 32


def _rss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def child(cfg: dict[str, Any]) -> dict[str, Any]:
    """One step in its own process: ``save`` the model, ``baseline`` (imports only), or compile and emit
    (``way``: init_from or emit) for ``stages`` stages."""
    import torch
    import transformers

    config = transformers.LlamaConfig(use_cache=False, **CONFIGS[cfg["model"]])
    if cfg["step"] == "save":
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(config).save_pretrained(cfg["hf"])
        return {}
    import pdcompile.runtime.trainer  # noqa: F401 - what a rank imports
    if cfg["step"] == "baseline":
        return {"rss_mib": _rss_mib()}
    from pdcompile.api import pdcompile
    from pdcompile.zoo.losses import SequenceCrossEntropy

    t0 = time.perf_counter()
    if cfg["way"] == "init_from":
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(config)
    else:
        model = transformers.LlamaForCausalLM.from_pretrained(cfg["hf"])
    x = torch.randint(0, 100, (BATCH, SEQ))
    pipe = pdcompile(model, example_inputs=(x,), example_target=torch.randint(0, 100, (BATCH, SEQ)),
                     loss_fn=SequenceCrossEntropy(), stages=cfg["stages"], num_microbatches=BATCH,
                     cost_mode="analytic", optimizer=lambda p: torch.optim.SGD(p, lr=0.01))
    pipe.emit(cfg["out"], init_from=cfg["hf"] if cfg["way"] == "init_from" else None)
    params = {st.index: sum(p.numel() for p in st.gm.parameters()) for st in pipe.split.stages}
    return {"compile_emit_s": time.perf_counter() - t0, "rss_mib": _rss_mib(), "stage_params": params,
            "params": sum(p.numel() for p in model.parameters())}


def run_child(cfg: dict[str, Any], timeout: float = 1800) -> dict[str, Any]:
    p = subprocess.run([sys.executable, __file__, "--child", json.dumps(cfg)], capture_output=True, text=True,
                       timeout=timeout)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        raise RuntimeError(f"child {cfg['step']} failed ({p.returncode}): {p.stderr[-2000:]}")
    return dict(json.loads(lines[-1]))


def train_one_step(prog: Path, world: int, metrics: Path) -> dict[int, float]:
    """Each rank's peak RSS (MiB) over start-up and one training step."""
    from pdcompile.launcher import launch

    rc, log = launch(prog, world, ["--steps", "1", "--metrics", str(metrics), "--timeout", "600"], timeout=1800)
    if rc != 0:
        raise RuntimeError(f"training failed ({rc}):\n{log[-3000:]}")
    ranks = [json.loads(p.read_text()) for p in sorted(metrics.glob("rank_*.json"))]
    return {int(r["stage"]): float(r["peak_rss_mb"]) for r in ranks}


def run(quick: bool) -> str:
    model = "tiny" if quick else "llama-300m"
    rows = ["| way | stages | compile + emit (s) | compiling process peak RSS (MiB) | rank: peak RSS (MiB) | "
            "rank: above an idle rank (MiB) | target: weights + grads + 15% (MiB) |", "|---|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory(prefix="bench-init-from-") as tmp:
        hf = Path(tmp) / "hf"
        run_child({"step": "save", "model": model, "hf": str(hf)})
        size = sum(f.stat().st_size for f in hf.glob("*.safetensors")) / MiB
        idle = run_child({"step": "baseline", "model": model})["rss_mib"]
        for stages in (2, 4):
            for way in ("init_from", "emit"):
                out = Path(tmp) / f"{way}_{stages}"
                r = run_child({"step": "compile", "model": model, "hf": str(hf), "way": way, "stages": stages,
                               "out": str(out)})
                ranks = train_one_step(out, stages, Path(tmp) / f"m_{way}_{stages}")
                shares = {int(k): 8 * n / MiB * 1.15 for k, n in r["stage_params"].items()}
                rows.append(f"| {way} | {stages} | {r['compile_emit_s']:.1f} | {r['rss_mib']:.0f} | "
                            + ", ".join(f"{ranks[k]:.0f}" for k in sorted(ranks)) + " | "
                            + ", ".join(f"{ranks[k] - idle:.0f}" for k in sorted(ranks)) + " | "
                            + ", ".join(f"{shares[k]:.0f}" for k in sorted(shares)) + " |")
                print(rows[-1], flush=True)
                shutil.rmtree(out, ignore_errors=True)
        params = r["params"]
    return (f"{model}: {params / 1e6:.0f}M parameters, {size:.0f} MiB of fp32 safetensors; a process that only "
            f"imported torch, transformers and the runtime: {idle:.0f} MiB. Minibatch {BATCH} x {SEQ} tokens, "
            f"{BATCH} microbatches, flush, one step. Per rank: stage 0 first.\n\n" + "\n".join(rows))


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a tiny Llama; print only")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(child(json.loads(a.child))), flush=True)
        return ""
    with open("/proc/loadavg") as f:
        load = f.read().strip()
    table = run(a.quick)
    body = (f"{table}\n\nLoad before the run (`cat /proc/loadavg`): {load}; machine: 2-core CPU, shared.\n")
    publish("Big model: a 300M HF model from safetensors vs emitted weights", body,
            "python benchmarks/bench_init_from.py", write=not a.quick)
    return body


if __name__ == "__main__":
    main()
