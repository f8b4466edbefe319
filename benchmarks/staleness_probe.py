"""Where 1F1B's stale weights cost the character GPT its epochs, and how much of the staleness weight
prediction removes: an in-process probe of PipeDream's 1F1B semantics (issue 37, RESULTS.md "Staleness
corrections").

    python benchmarks/staleness_probe.py PROGRAM --delays 2,1,0 [--predict [--form decay]] [--pipemare K]
                                         [--sync-first N] [--lr 1e-3] [--fresh wte.weight] [--eval-every N]
                                         [--steps 300] [--diag]

PROGRAM is an emitted program folder (``bench_time_to_accuracy.py`` leaves its planner's in
``/tmp/pd-tta-shakespeare-1f1b-*``). Minibatch ``j`` after each flush point (one every ``eval_every``
minibatches, where train.py evaluates) runs stage ``s`` at the version of its weights ``delays[s]``
updates old (``max(0, j - delays[s])``, the stashed one of PipeDream's 1F1B without replicas); the
forward and backward are one pass, since with stashing both use that version; tied parameters step with
their summed gradient. ``--predict``: the versions are the runtime's own
:class:`pdcompile.runtime.staleness.Predictor`'s weights (``W - s lr D``). Ablations the pipeline cannot
run: any ``--delays`` per stage, and ``--fresh NAMES`` (those parameters at the current version).
``--sync-first N``: the first N minibatches at delay 0 (``staleness_sync``'s start). ``--form decay``: FTPipe's
multi-step prediction instead of ours; ``--pipemare K``: PipeMare's rate on each stage of delay > 0 over K
minibatches after the synchronous start (with ``--predict``: ``predict+lr``). ``--diag``: for stage 0, the norm of (weights when the gradient is applied - weights the forward used)
against the same without prediction, and the least-squares scale ``c*`` of the prediction (1: its size
is right). Prints the validation loss at every evaluation, as train.py's metrics.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import _tta
from pdcompile.runtime import staleness
from pdcompile.runtime.program import Program, build


def _flat(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().flatten() for t in tensors.values()])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("program", type=Path)
    p.add_argument("--workload", default="shakespeare")
    p.add_argument("--delays", required=True, help="per stage, e.g. 2,1,0 (PipeDream's 1F1B on 3 stages)")
    p.add_argument("--predict", action="store_true", help="forwards on the predicted weights (staleness='predict')")
    p.add_argument("--lr", type=float, default=None, help="the optimizer's rate instead of the program's")
    p.add_argument("--fresh", default="", help="comma-separated parameter names used at the current version")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--diag", action="store_true", help="stage 0's prediction error against its staleness")
    p.add_argument("--form", default="linear", choices=("linear", "decay"),
                   help="--predict's form: s * lr * D (PipeOptim), or FTPipe's per-step sum with m decayed by beta1")
    p.add_argument("--pipemare", type=float, default=0.0, metavar="K",
                   help="PipeMare's rate on each stage of delay > 0, K in minibatches (with --predict: predict+lr)")
    p.add_argument("--eval-every", type=int, default=None, metavar="N", help="minibatches between evaluations")
    p.add_argument("--sync-first", type=int, default=0, metavar="N",
                   help="the first N minibatches synchronous (every delay 0), as a flush schedule would run them")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    prog = Program.load(args.program)
    stages = [prog.build_stage(k) for k in range(prog.num_stages)]
    spec = dict(prog.raw["optimizer"])
    if args.lr:
        spec["kwargs"] = {**spec["kwargs"], "lr": args.lr}
    opts = [build(spec, m.parameters()) for m in stages]
    loss_fn = prog.build_loss()
    delays = [int(d) for d in args.delays.split(",")]
    fresh = set(filter(None, args.fresh.split(",")))
    params = [dict(m.named_parameters()) for m in stages]
    rule = staleness.rule_for(str(spec["class"]), spec.get("kwargs", {})) if args.predict else ""
    w = _tta.workload(args.workload)
    data = iter(_tta.import_object(w.data["factory"])(w.batch, **w.data["kwargs"]))
    evals = [b for _, b in zip(range(w.eval_steps), _tta.import_object(w.eval_data)(w.batch))]

    every = args.eval_every or w.eval_every
    lrfix = [staleness.LrCorrection(d, 1.0, int(args.pipemare), 1, sync=args.sync_first) if args.pipemare and d > 0
             else None
             for d in delays]

    def stash(s: int) -> dict[str, torch.Tensor]:
        if args.predict and delays[s] > 0:
            return staleness.Predictor(opts[s], params[s], delays[s], rule, args.form, lrfix[s])()
        return {k: t.detach().clone() for k, t in params[s].items()}

    def chain(x: tuple[Any, ...], weights: list[dict[str, torch.Tensor]] | None) -> Any:
        for s, m in enumerate(stages):
            x = m(*x) if weights is None else torch.func.functional_call(m, weights[s], x)
            x = x if isinstance(x, tuple) else (x,)
        return x if len(x) > 1 else x[0]

    step, asked = 0, delays
    while step < args.steps:
        delays = [0] * len(asked) if step < args.sync_first else asked
        versions = [{0: stash(s)} for s in range(len(stages))]
        plain = {0: {k: t.detach().clone() for k, t in params[0].items()}}  # stage 0 unpredicted (--diag)
        errs: list[tuple[float, float, float]] = []
        # up to the next evaluation; a synchronous start ends its own segment (the pipeline then starts afresh)
        for j in range(min(every - step % every, args.steps - step, *([args.sync_first - step] if delays != asked else []))):
            (x,), y = next(data)
            used = [{k: (versions[s][j][k] if k in fresh else t).detach().requires_grad_(params[s][k].requires_grad)
                     for k, t in versions[s][max(0, j - delays[s])].items()} for s in range(len(stages))]
            loss_fn(chain((x,), used), y).backward()
            grads = [{k: t.grad for k, t in u.items()} for u in used]
            for group in prog.raw.get("tied", []):
                total = sum(grads[s][k] for s, k in group)
                for s, k in group:
                    grads[s][k] = total
            if args.diag and j >= delays[0] > 0:
                live, pred = _flat(params[0]), _flat(versions[0][j - delays[0]])
                raw = _flat(plain[j - delays[0]])
                moved, guess = live - raw, pred - raw
                errs.append((float((live - pred).norm()), float(moved.norm()),
                             float(moved @ guess) / max(float(guess @ guess), 1e-30)))
            for s, opt in enumerate(opts):
                for k, q in params[s].items():
                    q.grad = grads[s][k]
                if lrfix[s] is not None and delays[s] > 0:
                    lrfix[s].step(opt, step)  # type: ignore[union-attr]  # checked in the same expression
                else:
                    opt.step()
                opt.zero_grad(set_to_none=True)
                versions[s][j + 1] = stash(s)
                versions[s].pop(j - delays[s], None)  # the next forward reads j + 1 - delays[s] (and j + 1: --fresh)
            if args.diag:
                plain[j + 1] = {k: t.detach().clone() for k, t in params[0].items()}
                plain.pop(j - delays[0], None)
            step += 1
        if step % every and step < args.steps:
            continue  # a segment cut short by the synchronous start: no evaluation here
        for m in stages:
            m.eval()
        with torch.no_grad():
            val = statistics.mean(float(loss_fn(chain(tuple(xs), None), ys)) for xs, ys in evals)
        for m in stages:
            m.train()
        line = f"step {step}: validation loss {val:.4f}"
        if errs:
            line += (f"; stage 0: |W_apply - W_fwd| / |W_apply - W_stale| {statistics.mean(e / r for e, r, _ in errs if r):.3f}"
                     f", c* {statistics.mean(c for *_, c in errs):.3f}")
        print(line, flush=True)


if __name__ == "__main__":
    main()
