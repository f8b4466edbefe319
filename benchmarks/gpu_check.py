"""The checks one GPU can run, in one command (a few minutes on one GPU).

1. **Profiling**: GPT's per-node costs measured on the GPU (annotate-costs' measured mode: CUDA
   events), cross-checked with torch.profiler's kernel times inside whole training steps
   (:mod:`pdcompile.profiler_check`).
2. **Every stage on the one GPU**: the emitted 2-stage program (GPT's tied embedding in both
   stages) trained in one process, its stage modules on the GPU, in the pipeline's synchronous
   semantics (:func:`pdcompile.reference.train_versioned`: the stages in turn, tied
   gradients summed). Two ranks cannot share a GPU under NCCL, and gloo's point-to-point moves
   CPU tensors only, so this runs the emitted stages, not the runtime's executor. Its weights must
   equal single-process training of the model on the GPU.
3. **The runtime on the GPU**: the emitted 1-stage program through torchrun (``--device cuda``:
   NCCL, ``cuda:0``, pinned data, CUDA-event step times); its weights must equal single-process
   training, and its measured step time is put beside the simulator's prediction from the GPU
   profile (plus the loss and the optimizer step, measured apart: the profile ends at the model's
   output).
4. **A Hugging Face model through torch.export**: a small ``LlamaForCausalLM`` (its default config,
   ``use_cache=True``) compiled on the CPU as a user would, its 2 emitted stages built and moved to
   the device and trained in one process as in part 2: its stage code names no device (rotary
   frequencies, masks and positions follow the stage's), and its weights equal single-process
   training of the model on the device.

5. **Each layer against the analytic model**: the forward and backward of every node of the zoo GPT
   and of a Hugging Face Llama decoder layer (a 1-layer ``LlamaForCausalLM`` through torch.export:
   the layer's nodes and the embedding, final norm and head around them) timed on the device
   (annotate-costs' measured mode), each beside the analytic model's prediction for the device
   (the roofline of ``passes/costs/roofline.py`` for the GPU named by torch: h100, h200, a100, v100),
   printed per node, and summed per op class (matmul/linear, convolution, attention, normalisation,
   elementwise, embedding/gather, shape, loss) with the error of each class.

Exit status 0 when every equality holds, 1 otherwise (the timing rows are measurements, not
pass/fail). Writes its table to benchmarks/RESULTS.md (section "GPU check"). ``--dry-run`` runs the
same code on the CPU (small GPT, few steps, 3 profiling repeats) and only prints: CI runs it
(tests/test_gpu_check.py).

Usage: python benchmarks/gpu_check.py [--dry-run] [--size full|small] [--steps 8]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from benchmarks._results import publish  # noqa: E402

NAME = "GPU check"
MODEL = "gpt"  # its tied embedding crosses the stage boundary
M = 4  # microbatches per minibatch
MICRO = 2  # samples per microbatch
WARMUP = 2  # runtime steps left out of the measured median


@dataclass(frozen=True)
class Row:
    check: str
    result: str
    ok: bool | None  # None: a measurement, no pass/fail

    def markdown(self) -> str:
        mark = "-" if self.ok is None else ("yes" if self.ok else "**NO**")
        return f"| {self.check} | {self.result} | {mark} |"


def optimizer(params: Any) -> torch.optim.Optimizer:
    """The optimizer every part trains with (momentum: state that must match too)."""
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def seconds(device: torch.device, fn: Callable[[], Any], repeats: int = 10) -> float:
    """Median seconds of ``fn`` on ``device`` (runtime/timing.py: CUDA events on a GPU), after 2 untimed."""
    from pdcompile.runtime.timing import StepTimer

    for _ in range(2):
        fn()
    timer = StepTimer(device)
    for _ in range(repeats):
        timer.start()
        fn()
        timer.stop()
    return statistics.median(timer.collect())


def on(device: torch.device, batch: tuple[tuple[torch.Tensor, ...], torch.Tensor]) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    inputs, target = batch
    return tuple(x.to(device) for x in inputs), target.to(device)


def data(size: str, device: torch.device) -> Iterator[tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
    """The minibatches every part trains on (those the emitted programs' data factory yields)."""
    from pdcompile.zoo import batches

    return (on(device, b) for b in batches(MICRO * M, MODEL, size=size))


def max_relative_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """The largest ``max|got - want| / max|want|`` over ``want``'s tensors (inf if one is missing)."""
    worst = 0.0
    for k, w in want.items():
        if k not in got or got[k].shape != w.shape:
            return float("inf")
        w = w.float()
        worst = max(worst, float((got[k].float() - w).abs().max() / (w.abs().max() + 1e-12)))
    return worst


# --- 1. profiling ---------------------------------------------------------------------------------

def profile_rows(size: str, device: torch.device) -> tuple[list[Row], Any, float, float]:
    """Measured profile on ``device`` and its torch.profiler cross-check; also the loss's and the
    optimizer step's seconds (for the prediction in part 3)."""
    from pdcompile.passes.annotate_costs import profile_model
    from pdcompile.profiler_check import cross_check_model, summary
    from pdcompile.zoo import get

    z = get(MODEL, size=size, batch_size=MICRO, seed=0)
    model, loss_fn = z.model.to(device), z.loss_fn.to(device)
    inputs, target = on(device, (z.example_inputs, z.target))
    warmup, repeats = (3, 9) if device.type == "cuda" else (1, 3)  # the CPU part checks the rows, not the figures
    prof = profile_model(model, inputs, mode="measured", leaf_modules=z.leaf_modules, warmup=warmup, repeats=repeats,
                         symbolic=False, progress=False)
    check = summary(cross_check_model(model, inputs, prof, leaf_modules=z.leaf_modules, loss_fn=loss_fn,
                                      target=target))
    with torch.no_grad():
        out = model(*inputs)

    def loss_step() -> None:
        loss_fn(out.detach().requires_grad_(True), target).backward()

    loss_s = seconds(device, loss_step)
    model.zero_grad(set_to_none=True)
    loss_fn(model(*inputs), target).backward()
    opt = optimizer(model.parameters())
    step_s = seconds(device, opt.step)
    ratio = check["ratio"]
    rows = [Row(f"profile: {MODEL} ({size}), microbatch {MICRO}, {len(prof.layers)} nodes on {device.type} "
                f"({prof.device})",
                f"nodes' forward + backward: measured {prof.compute_s * 1e3:.3f} ms, torch.profiler "
                f"{check['profiler_sum_s'] * 1e3:.3f} ms (measured / profiler {ratio:.2f}); heavy nodes within "
                f"25%: {check['heavy_within']}/{check['heavy']}",
                None)]
    return rows, prof, loss_s, step_s


# --- 2. every stage on the one device, in one process ---------------------------------------------

def compile_program(size: str, stages: int, folder: Path) -> Path:
    from pdcompile.api import pdcompile
    from pdcompile.zoo import get

    z = get(MODEL, size=size, batch_size=MICRO * M, seed=0)
    pipe = pdcompile(z.model, example_inputs=z.example_inputs, example_target=z.target, loss_fn=z.loss_fn,
                     optimizer=optimizer, stages=stages, schedule="flush", num_microbatches=M,
                     leaf_modules=z.leaf_modules)
    return pipe.emit(folder, data={"factory": "pdcompile.zoo:batches", "kwargs": {"name": MODEL, "size": size}})


def single_process(size: str, steps: int, device: torch.device) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The model's (initial, trained) parameters: ``steps`` minibatches of plain synchronous SGD on
    ``device`` with ``M`` microbatches of accumulated gradients (what a flush pipeline computes)."""
    from pdcompile.reference import train_sync
    from pdcompile.zoo import get

    z = get(MODEL, size=size, batch_size=MICRO * M, seed=0)
    model = z.model.to(device)
    initial = {k: v.detach().cpu().clone() for k, v in model.named_parameters()}
    train_sync(model, z.loss_fn.to(device), optimizer(model.parameters()), data(size, device), steps=steps,
               num_microbatches=M)
    return initial, {k: v.detach().cpu() for k, v in model.named_parameters()}


def train_in_process(prog: Path, size: str, steps: int, device: torch.device, out: Path,
                     batches: Iterator[tuple[tuple[torch.Tensor, ...], torch.Tensor]] | None = None) -> dict[str, torch.Tensor]:
    """Train the emitted program's stages on ``device`` in one process; their weights merged
    under the model's names (through the files train.py --save-final writes). ``batches``: the
    minibatches (default the zoo model's)."""
    from pdcompile.merge import merge_weights
    from pdcompile import reference
    from pdcompile.runtime.program import Program, build

    program = Program.load(prog)
    stages = [program.build_stage(k).to(device) for k in range(program.num_stages)]
    opts = [build(program.raw["optimizer"], m.parameters()) for m in stages]
    # the loss as train.py builds it (Program.build_loss where the program emits its traced loss)
    loss_fn = program.build_loss()
    loss_fn = loss_fn.to(device) if isinstance(loss_fn, torch.nn.Module) else loss_fn
    b = program.raw["microbatch_size"]
    it = batches if batches is not None else data(size, device)
    micro = []
    for _ in range(steps):
        inputs, target = next(it)
        ins = [x.split(b) for x in inputs]
        micro += [(tuple(x[j] for x in ins), target.split(b)[j]) for j in range(M)]
    fwd, bwd, group = reference.synchronous(M)
    tied = [[(s, n) for s, n in grp] for grp in program.raw.get("tied", [])]
    reference.train_versioned(stages, opts, loss_fn, micro, fwd=fwd, bwd=bwd, group=group, scale=1.0 / M, tied=tied)
    out.mkdir(parents=True, exist_ok=True)
    for k, m in enumerate(stages):
        tensors = {n: t.detach().cpu() for n, t in m.named_parameters()}
        tensors.update({n: t.detach().cpu() for n, t in m.named_buffers()})
        torch.save(tensors, out / f"stage_{k}.rank_{program.stages[k].ranks[0]}.pt")
    return merge_weights(prog, out)


def split_backward_row(prog: Path, size: str, device: torch.device, tolerance: float) -> Row:
    """The split backward's weight pass (runtime/weight_grads.py) on the last stage of ``prog`` on
    ``device``: trusted by its first-``W`` check (bitwise on the CPU or in deterministic mode,
    within noise otherwise), and its weight gradients equal an unsplit backward's."""
    from pdcompile.runtime.program import Program, build
    from pdcompile.runtime.weight_grads import WeightPass

    program = Program.load(prog)
    first, last = program.build_stage(0).to(device), program.build_stage(program.num_stages - 1).to(device)
    loss_fn = program.build_loss()
    loss_fn = loss_fn.to(device) if isinstance(loss_fn, torch.nn.Module) else loss_fn
    inputs, target = next(data(size, device))
    target = target[:MICRO]
    with torch.no_grad():
        h = first(*(x[:MICRO] for x in inputs))
    h = tuple(h) if isinstance(h, (tuple, list)) else (h,)
    specs = program.stages[-1].inputs

    def fresh() -> list[torch.Tensor]:
        return [t.detach().clone().requires_grad_(sp.requires_grad and t.is_floating_point()) for t, sp in zip(h, specs)]

    last.zero_grad(set_to_none=True)
    loss_fn(last(*fresh()), target).backward()
    want = {n: p.grad.detach().clone() for n, p in last.named_parameters() if p.grad is not None}
    wp = WeightPass(last)
    for _ in range(2):  # the first W checks the fast path, the second runs as checked
        last.zero_grad(set_to_none=True)
        xs = fresh()
        handles, notes = wp.capture()
        out = last(*xs)
        for hd in handles:
            hd.remove()
        _, work = wp.input_grads([loss_fn(out, target)], None, [x for x in xs if x.requires_grad], notes)
        wp.weight_grads(work)
    got = {n: p.grad.detach() for n, p in last.named_parameters() if p.grad is not None}
    diff = max_relative_diff(got, want)
    mode = "bitwise" if weight_grads_bitwise(device) else "within noise (non-deterministic kernels allowed)"
    return Row(f"split backward's weight pass (runtime/weight_grads.py), stage {program.num_stages - 1} on {device.type}",
               f"fast path trusted by its check ({mode}): {'yes' if wp.trusted else 'no'}; max relative "
               f"difference to an unsplit backward {diff:.2g} (tolerance {tolerance:g}), {len(want)} gradients",
               wp.trusted is True and diff <= tolerance and len(want) > 0)


def weight_grads_bitwise(device: torch.device) -> bool:
    from pdcompile.runtime.weight_grads import bitwise_check

    return bitwise_check(device)


def equality_row(what: str, got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                 initial: dict[str, torch.Tensor], tolerance: float) -> Row:
    diff = max_relative_diff(got, want)
    moved = sum(not torch.equal(want[k], initial[k]) for k in want)
    ok = diff <= tolerance and moved > len(want) // 2  # equal, and training really changed the weights
    return Row(what, f"max relative weight difference to single-process training {diff:.2g} (tolerance "
                     f"{tolerance:g}); {moved}/{len(want)} parameters trained", ok)


# --- 4. a Hugging Face model through torch.export -------------------------------------------------

HF_VOCAB, HF_SEQ = 128, 16


def hf_llama() -> torch.nn.Module:
    """A small LlamaForCausalLM with its default config (``use_cache=True``, rotary embeddings, causal mask)."""
    import transformers

    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=HF_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64))


def hf_batches(steps: int, device: torch.device) -> list[tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [on(device, ((torch.randint(0, HF_VOCAB, (MICRO * M, HF_SEQ), generator=g),),
                        torch.randint(0, HF_VOCAB, (MICRO * M, HF_SEQ), generator=g))) for _ in range(steps)]


def hf_row(steps: int, device: torch.device, folder: Path, tolerance: float) -> Row:
    """Part 4: Llama's exported stages, compiled on the CPU, trained on ``device`` = single-process training."""
    from pdcompile.api import pdcompile
    from pdcompile.reference import train_sync
    from pdcompile.zoo.losses import SequenceCrossEntropy

    loss_fn = SequenceCrossEntropy()
    (x,), y = hf_batches(1, torch.device("cpu"))[0]
    pipe = pdcompile(hf_llama(), example_inputs=(x,), example_target=y, loss_fn=loss_fn, optimizer=optimizer,
                     stages=2, schedule="flush", num_microbatches=M, frontend="export")
    prog = pipe.emit(folder / "prog")
    named = [k for k in range(len(pipe.split.stages)) if "device(type=" in (prog / f"stage_{k}.py").read_text()]
    got = train_in_process(prog, "small", steps, device, folder / "final", iter(hf_batches(steps, device)))
    ref = hf_llama().to(device)
    initial = {k: v.detach().cpu().clone() for k, v in ref.named_parameters()}
    train_sync(ref, lambda out, t: loss_fn(out.logits, t), optimizer(ref.parameters()), hf_batches(steps, device),
               steps=steps, num_microbatches=M)
    want = {k: v.detach().cpu() for k, v in ref.named_parameters()}
    row = equality_row(f"Hugging Face Llama (torch.export, default config), 2 stages compiled on the CPU, trained "
                       f"on {device.type}", got, want, initial, tolerance)
    where = f"stage code naming a device: {named or 'none'}; "
    return Row(row.check, where + row.result, bool(row.ok) and not named)


# --- 5. each layer against the analytic model ----------------------------------------------------

#: op classes, each by substrings of a node's op name (lower case), first match wins
OP_CLASSES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention", ("scaled_dot_product", "flash", "efficient_attention", "softmax")),
    ("convolution", ("conv",)),
    ("matmul/linear", ("linear", "matmul", "addmm", "bmm", "mm", "baddbmm", "einsum")),
    ("normalisation", ("norm",)),
    ("embedding/gather", ("embedding", "gather", "index_select", "index")),
    ("loss", ("cross_entropy", "nll_loss", "loss")),
    ("shape", ("view", "reshape", "transpose", "permute", "split", "getitem", "expand", "unsqueeze", "squeeze",
               "contiguous", "slice", "cat", "flatten", "select", "size", "clone", "alias", "_unsafe")),
)


def op_class(op: str, owner: str = "") -> str:
    """The op class of a profile layer's ``op`` (a module's class, a function's or an aten op's name:
    ``aten.t.default`` and ``t.default`` are read as ``t``). ``owner``: the class of the innermost module the node came
    from (torch.export's ``nn_module_stack``): a norm's decomposed steps (pow, mean, rsqrt, mul) are
    the norm's."""
    low = op.lower().removeprefix("aten.")
    if not low.startswith("."):  # an aten overload (t.default, add.Tensor): its op's name
        low = low.split(".")[0]
    cls = "shape" if low == "t" else next((c for c, keys in OP_CLASSES if any(k in low for k in keys)), "elementwise")
    return "normalisation" if cls in ("elementwise", "shape") and "norm" in owner.lower() else cls


def owners(gm: Any) -> dict[str, str]:
    """Node name -> the class name of the innermost module it came from (export's ``nn_module_stack``)."""
    out = {}
    for node in gm.graph.nodes:
        stack = node.meta.get("nn_module_stack")
        if stack:
            kind = list(stack.values())[-1][1]
            out[node.name] = str(getattr(kind, "__name__", kind)).rsplit(".", 1)[-1]
    return out


def analytic_spec(device: torch.device) -> str:
    """The analytic model's device for ``device``: the GPU's name as ``passes/costs/roofline.py`` knows it, else cpu."""
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device).lower()
    return next((k for k in ("h200", "h100", "a100", "v100") if k in name), "h100")


def node_costs(model: torch.nn.Module, inputs: tuple[torch.Tensor, ...], mode: str, spec: str, frontend: str,
               leaf_modules: Any = ()) -> Any:
    """The Profile of ``model`` per node: measured on its device, or analytic for ``spec`` (profile_model's
    steps, with a choice of front end: torch.export for the Hugging Face model), and :func:`owners`."""
    from pdcompile.passes.annotate_costs import annotate_costs
    from pdcompile.passes.costs.profile import profile_from_graph
    from pdcompile.passes.propagate_shapes import propagate_shapes
    from pdcompile.passes.trace import trace_any

    gm = trace_any(model, inputs, leaf_modules, frontend)
    propagate_shapes(gm, inputs)
    on_gpu = inputs[0].device.type == "cuda"
    annotate_costs(gm, inputs, mode=mode, device_spec=spec, warmup=3 if on_gpu else 1, repeats=9 if on_gpu else 3,
                   symbolic=False, progress=False)
    return (profile_from_graph(gm, batch_size=int(inputs[0].shape[0]), device=spec, name=type(model).__name__),
            owners(gm))


def llama_layer(device: torch.device, small: bool) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...], str]:
    """One Llama decoder layer in a ``LlamaForCausalLM`` (its embedding, final norm and head around it)."""
    import transformers

    torch.manual_seed(0)
    shape = (dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
             if small else dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_attention_heads=16,
                                num_key_value_heads=8))
    batch, seq = (2, 16) if small else (4, 512)
    cfg = transformers.LlamaConfig(num_hidden_layers=1, max_position_embeddings=max(64, seq), use_cache=False, **shape)
    model = transformers.LlamaForCausalLM(cfg).to(device)
    x = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1)).to(device)
    return model, (x,), (f"Llama decoder layer (hidden {cfg.hidden_size}, {cfg.num_attention_heads} heads, "
                         f"{cfg.num_key_value_heads} KV heads, MLP {cfg.intermediate_size}), {batch} x {seq} tokens")


def layer_rows(size: str, device: torch.device) -> list[Row]:
    """Part 5: per node measured against analytic (printed), per op class summed (the rows)."""
    from pdcompile.zoo import get

    spec = analytic_spec(device)
    z = get(MODEL, size=size, batch_size=MICRO, seed=0)
    gpt_model = z.model.to(device)
    gpt_inputs = tuple(x.to(device) for x in z.example_inputs)
    llama, llama_inputs, llama_what = llama_layer(device, size != "full")
    rows = []
    for what, model, inputs, frontend, leaves in (
            (f"zoo {MODEL} ({size}), microbatch {MICRO}", gpt_model, gpt_inputs, "fx", z.leaf_modules),
            (llama_what, llama, llama_inputs, "export", ())):
        measured, owner = node_costs(model, inputs, "measured", spec, frontend, leaves)
        analytic, _ = node_costs(model, inputs, "analytic", spec, frontend, leaves)
        predicted = {l.name: l for l in analytic.layers}
        print(f"  {what}: per node on {device.type}, measured against analytic ({spec}), us "
              f"(forward, backward):", flush=True)
        by: dict[str, list[float]] = {}
        for l in measured.layers:
            a = predicted.get(l.name)
            if a is None:
                continue
            cls = op_class(l.op, owner.get(l.name, ""))
            print(f"    {l.name:<32} {cls:<16} measured {l.forward_s * 1e6:9.1f} {l.backward_s * 1e6:9.1f}   "
                  f"analytic {a.forward_s * 1e6:9.1f} {a.backward_s * 1e6:9.1f}", flush=True)
            got = by.setdefault(cls, [0, 0.0, 0.0, 0.0, 0.0])
            got[0] += 1
            got[1] += l.forward_s
            got[2] += l.backward_s
            got[3] += a.forward_s
            got[4] += a.backward_s
        for cls, (n, mf, mb, af, ab) in sorted(by.items(), key=lambda kv: -(kv[1][1] + kv[1][2])):
            err = (af + ab) / (mf + mb) - 1 if mf + mb > 0 else float("nan")
            rows.append(Row(f"layers vs analytic ({spec}): {what}: {cls}",
                            f"{int(n)} nodes, forward + backward measured {(mf + mb) * 1e3:.4g} ms "
                            f"({mf * 1e3:.4g} + {mb * 1e3:.4g}), analytic {(af + ab) * 1e3:.4g} ms "
                            f"({af * 1e3:.4g} + {ab * 1e3:.4g}): error {err:+.0%}", None))
    return rows


# --- 3. the runtime on the device ------------------------------------------------------------------

def run_runtime(prog: Path, steps: int, device: torch.device,
                out: Path) -> tuple[dict[str, torch.Tensor], list[float], str, dict[str, Any]]:
    """train.py through torchrun (one process); its merged weights, step times, output and metrics."""
    from pdcompile.launcher import launch
    from pdcompile.merge import merge_weights

    rc, log = launch(prog, 1, ["--steps", str(steps), "--device", device.type, "--save-final", str(out / "final"),
                               "--metrics", str(out / "metrics"), "--timeout", "120"], timeout=240)
    if rc != 0:
        raise RuntimeError(f"train.py exited {rc}:\n{log[-3000:]}")
    metrics = json.loads((out / "metrics" / "rank_0.json").read_text())
    return merge_weights(prog, out / "final"), metrics["step_times_s"], log, metrics


def memory_row(prog: Path, metrics: dict[str, Any], device: torch.device) -> Row:
    """The planner's predicted peak of the stage (plan.json) beside the runtime's own accounting
    (runtime/memory.py) and, on a GPU, the CUDA allocator's ``max_memory_allocated``: the issue's
    target is within 10%. A measurement (no pass/fail)."""
    predicted = float(json.loads((prog / "plan.json").read_text())["plan"]["stages"][0]["memory_bytes"])
    counted = float(metrics["memory"]["total"])  # the accounting's peak (runtime/memory.py MemoryMeter)
    cuda = metrics.get("cuda_max_memory_allocated")
    mib = 2.0 ** 20
    text = f"predicted {predicted / mib:.1f} MiB, runtime's accounting {counted / mib:.1f} MiB"
    if cuda is not None:
        text += (f", CUDA max_memory_allocated {cuda / mib:.1f} MiB: allocator / predicted {cuda / predicted:.2f}, "
                 f"accounting / allocator {counted / cuda:.2f}")
    else:
        text += f": accounting / predicted {counted / predicted:.2f} (no CUDA allocator on {device.type})"
    return Row(f"stage memory on {device.type}: planner vs runtime", text, None)


def predicted_step(prof: Any, loss_s: float, step_s: float) -> float:
    """The simulator's flush step on one stage from the measured profile: ``M`` microbatches'
    forward (+ loss) and backward, then the optimizer step."""
    from pdcompile.simulate import simulate_schedule

    sim = simulate_schedule("flush", [1], M, split_backward=False, forward_s=[prof.forward_s + loss_s],
                            backward_s=[prof.backward_s], step_s=[step_s])
    return float(sim.step_time_s)


# ---------------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true",
                    help="the CPU part: the same code on the CPU, small GPT, few steps; prints, writes nothing")
    ap.add_argument("--size", choices=("full", "small"), default=None,
                    help="zoo GPT size (default: full on the GPU, small with --dry-run)")
    ap.add_argument("--steps", type=int, default=None, help="minibatches each training part runs (default 8; 4 dry)")
    args = ap.parse_args(argv)
    if args.dry_run:
        device = torch.device("cpu")
        torch.set_num_threads(1)  # as each runtime process runs (launcher: OMP_NUM_THREADS=1); least noise
    elif torch.cuda.is_available():
        device = torch.device("cuda", 0)
    else:
        print("gpu_check.py: no GPU here (torch.cuda.is_available() is False): run it on a machine with a GPU "
              "and a CUDA build of torch, or pass --dry-run for its CPU part", file=sys.stderr)
        return 2
    size = args.size or ("small" if args.dry_run else "full")
    steps = args.steps or (4 if args.dry_run else 8)
    tolerance = 1e-5 if device.type == "cpu" else 1e-4  # a GPU's reductions may reassociate between runs
    what = f"{device} ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "cpu"
    print(f"gpu_check: {MODEL} ({size}), {steps} steps of {M} x {MICRO} samples, on {what}"
          + (" -- dry run: RESULTS.md is not written" if args.dry_run else ""), flush=True)
    t_all = time.perf_counter()
    rows: list[Row] = []

    t0 = time.perf_counter()
    prof_rows, prof, loss_s, step_s = profile_rows(size, device)
    rows += prof_rows
    print(f"  profiled in {time.perf_counter() - t0:.1f} s", flush=True)

    with tempfile.TemporaryDirectory(prefix="pdcompile-gpu-check-") as tmp:
        t0 = time.perf_counter()
        initial, want = single_process(size, steps, device)
        prog2 = compile_program(size, 2, Path(tmp) / "prog2")
        got = train_in_process(prog2, size, steps, device, Path(tmp) / "chain")
        rows.append(equality_row(f"2 stages (tied embedding in both), flush, every stage on {device.type}, "
                                 f"one process", got, want, initial, tolerance))
        rows.append(split_backward_row(prog2, size, device, tolerance))
        print(f"  in-process pipeline in {time.perf_counter() - t0:.1f} s", flush=True)

        t0 = time.perf_counter()
        prog1 = compile_program(size, 1, Path(tmp) / "prog1")
        got, times, _, metrics = run_runtime(prog1, steps, device, Path(tmp) / "run")
        backend = "NCCL" if device.type == "cuda" else "gloo"
        rows.append(equality_row(f"runtime: 1 stage through torchrun, {backend}, --device {device.type}",
                                 got, want, initial, tolerance))
        measured = statistics.median(times[WARMUP:] or times)
        predicted = predicted_step(prof, loss_s, step_s)
        rows.append(Row(f"step time on {device.type}: simulator vs runtime",
                        f"predicted {predicted * 1e3:.3f} ms (profile {prof.compute_s * M * 1e3:.3f} + loss "
                        f"{loss_s * M * 1e3:.3f} + optimizer step {step_s * 1e3:.3f}), measured median "
                        f"{measured * 1e3:.3f} ms over {len(times[WARMUP:] or times)} steps: measured / predicted "
                        f"{measured / predicted:.2f}", None))
        rows.append(memory_row(prog1, metrics, device))
        print(f"  runtime in {time.perf_counter() - t0:.1f} s", flush=True)

        t0 = time.perf_counter()
        rows.append(hf_row(steps, device, Path(tmp) / "hf", tolerance))
        print(f"  Hugging Face model in {time.perf_counter() - t0:.1f} s", flush=True)

    t0 = time.perf_counter()
    rows += layer_rows(size, device)
    print(f"  layers against the analytic model in {time.perf_counter() - t0:.1f} s", flush=True)

    ok = all(r.ok is not False for r in rows)
    body = "\n".join([
        f"{MODEL} ({size}), {steps} steps of {M} microbatches x {MICRO} samples, SGD with momentum, on {what}. "
        f"Whole check: {time.perf_counter() - t_all:.0f} s.",
        "",
        "| check | result | passed |",
        "|---|---|---|",
        *(r.markdown() for r in rows),
        "",
        f"All equalities hold: {'yes' if ok else 'NO'}.",
    ])
    publish(NAME, body, "python benchmarks/gpu_check.py" + (f" --size {args.size}" if args.size else "")
            + (f" --steps {args.steps}" if args.steps else ""), write=not args.dry_run)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
