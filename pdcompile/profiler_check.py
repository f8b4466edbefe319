"""Cross-check measured per-node costs against ``torch.profiler`` on a whole training step.

``annotate-costs`` (measured mode) times every node alone, on copies of its inputs. This module
times them *inside* a real step instead (:func:`profiler_cross_check`), so that a node whose two
times differ by several times points at a measurement problem. Example::

    check = profiler_cross_check(gm, inputs, loss_fn=nn.CrossEntropyLoss(), target=y)
    print(summary(check))
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.profiler import ProfilerActivity, profile, record_function

from pdcompile.passes.annotate_costs import COMPUTE_OPS  # the nodes annotate-costs times
from pdcompile.runtime.timing import sync

_PREFIX = "pd::"
_ENGINE = "autograd::engine::evaluate_function: "


@dataclass(frozen=True)
class CrossCheckRow:
    """One node: seconds per step by torch.profiler inside a whole step, and by annotate-costs."""

    node: str
    profiler_forward_s: float
    profiler_backward_s: float
    measured_forward_s: float | None
    measured_backward_s: float | None

    @property
    def profiler_s(self) -> float:
        return self.profiler_forward_s + self.profiler_backward_s

    @property
    def measured_s(self) -> float | None:
        if self.measured_forward_s is None or self.measured_backward_s is None:
            return None
        return self.measured_forward_s + self.measured_backward_s

    def __str__(self) -> str:
        ours = self.measured_s
        ratio = f"{ours / self.profiler_s:5.2f}" if ours is not None and self.profiler_s > 0 else "    -"
        return (f"{self.node:<28} profiler {self.profiler_forward_s * 1e3:8.3f} + {self.profiler_backward_s * 1e3:8.3f} ms"
                f"   measured/profiler {ratio}")


@dataclass(frozen=True)
class CrossCheck:
    """Rows per compute node (graph order), gradient accumulation not attributable to a node, and
    the step's wall time under the profiler (all per step, seconds)."""

    rows: tuple[CrossCheckRow, ...]
    accumulate_grad_s: float
    step_s: float

    def heavy(self, share: float = 0.01) -> list[CrossCheckRow]:
        """Rows above ``share`` of the profiler's total node time."""
        total = sum(r.profiler_s for r in self.rows)
        return [r for r in self.rows if r.profiler_s > share * total]

    def __str__(self) -> str:
        lines = [str(r) for r in self.rows]
        lines.append(f"AccumulateGrad (parameters) {self.accumulate_grad_s * 1e3:.3f} ms; "
                     f"step under the profiler {self.step_s * 1e3:.3f} ms")
        return "\n".join(lines)


class _Ranges(fx.Interpreter):
    """Run the graph with one ``record_function`` range per compute node."""

    def run_node(self, n: fx.Node) -> Any:
        if n.op in COMPUTE_OPS:
            with record_function(_PREFIX + n.name):
                return super().run_node(n)
        return super().run_node(n)


def _scalar_loss(out: Any) -> torch.Tensor:
    leaves = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not leaves:
        raise ValueError("the graph's output carries no gradient: nothing to cross-check")
    return sum(t.float().sum() for t in leaves)  # type: ignore[return-value]  # sum of tensors is a tensor


def profiler_cross_check(gm: fx.GraphModule, example_inputs: Sequence[Any], *,
                         loss_fn: Callable[..., torch.Tensor] | None = None, target: Any = None,
                         steps: int = 3, warmup: int = 2) -> CrossCheck:
    """Profile ``steps`` training steps (forward, loss, backward) of ``gm`` with ``torch.profiler``
    and attribute the time to its nodes. Without ``loss_fn`` the loss is the sum of the outputs.
    The ``pd.cost`` written by annotate-costs, when present, is put beside.

    An ``fx.Interpreter`` wraps every compute node in ``record_function("pd::<node>")``. A node's
    forward is the time of the operators directly inside its range (not the interpreter's Python);
    its backward is the sum of the ``evaluate_function: XBackward`` events whose ``sequence_nr`` is
    that of an operator recorded inside its range (autograd's link from backward to forward op).
    ``AccumulateGrad`` belongs to no operator and is reported apart. On CUDA the events' device
    time is used. The profiler adds overhead per operator, so expect agreement within tens of
    percent on heavy nodes."""
    inputs = tuple(example_inputs)
    device = next((t.device for t in inputs if isinstance(t, torch.Tensor)), torch.device("cpu"))
    cuda = device.type == "cuda"

    def step() -> None:
        out = _Ranges(gm).run(*inputs)
        loss = loss_fn(out, target) if loss_fn is not None else _scalar_loss(out)
        loss.backward()
        gm.zero_grad(set_to_none=True)

    was_training = gm.training
    gm.train()
    try:
        for _ in range(warmup):
            step()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            for _ in range(steps):
                with record_function("pd::step"):
                    step()
                    sync(device)  # inside the range: the step's time is the GPU's, not the queueing's
    finally:
        gm.train(was_training)
    events = list(prof.events())

    def seconds(e: Any) -> float:
        return (e.device_time_total if cuda else e.time_range.end - e.time_range.start) * 1e-6

    forward: dict[str, float] = {}
    owner: dict[int, str] = {}  # sequence_nr of a forward op -> the node whose range holds it
    step_s = 0.0
    for e in events:
        if e.name == "pd::step":
            step_s += (e.time_range.end - e.time_range.start) * 1e-6
        elif e.name.startswith(_PREFIX):
            # the operators the range holds, not the range: the interpreter's and the profiler's
            # Python around them is no cost of the model's
            forward[e.name[len(_PREFIX):]] = (forward.get(e.name[len(_PREFIX):], 0.0)
                                              + sum(seconds(c) for c in e.cpu_children))
        if e.sequence_nr >= 0 and not e.name.startswith(_ENGINE):
            p = e.cpu_parent
            while p is not None and not p.name.startswith(_PREFIX):
                p = p.cpu_parent
            if p is not None and p.name != "pd::step":
                owner.setdefault(e.sequence_nr, p.name[len(_PREFIX):])
    backward: dict[str, float] = {}
    accumulate = 0.0
    for e in events:
        if not e.name.startswith(_ENGINE):
            continue
        if "AccumulateGrad" in e.name:
            accumulate += seconds(e)
        elif e.sequence_nr in owner:
            backward[owner[e.sequence_nr]] = backward.get(owner[e.sequence_nr], 0.0) + seconds(e)
    rows = []
    for n in gm.graph.nodes:
        if n.op not in COMPUTE_OPS:
            continue
        cost = n.meta.get("pd.cost")
        rows.append(CrossCheckRow(n.name, forward.get(n.name, 0.0) / steps, backward.get(n.name, 0.0) / steps,
                                  getattr(cost, "forward_s", None), getattr(cost, "backward_s", None)))
    return CrossCheck(tuple(rows), accumulate / steps, step_s / steps)


def cross_check_model(model: torch.nn.Module, example_inputs: Sequence[Any], profile: Any, *,
                      leaf_modules: Sequence[type | str] = (), loss_fn: Callable[..., torch.Tensor] | None = None,
                      target: Any = None, steps: int = 3) -> CrossCheck:
    """Trace ``model`` as the profiler of ``profile`` (a :class:`pdcompile.profile.Profile`) did and
    cross-check its layers (matched by name) against torch.profiler in a whole step."""
    from dataclasses import replace as _replace

    from pdcompile.passes.trace import trace

    gm = trace(model, leaf_modules)
    check = profiler_cross_check(gm, example_inputs, loss_fn=loss_fn, target=target, steps=steps)
    layers = {l.name: l for l in profile.layers}
    rows = tuple(_replace(r, measured_forward_s=layers[r.node].forward_s, measured_backward_s=layers[r.node].backward_s)
                 if r.node in layers else r for r in check.rows)
    return _replace(check, rows=rows)


def summary(check: CrossCheck, share: float = 0.01, tolerance: float = 0.25) -> dict[str, Any]:
    """Numbers for a table: node sums (measured / profiler) and heavy nodes within ``tolerance``."""
    heavy = [r for r in check.heavy(share) if r.measured_s is not None and r.profiler_s > 0]
    within = [r for r in heavy if abs(r.measured_s / r.profiler_s - 1) <= tolerance]  # type: ignore[operator]  # heavy rows have profiler times
    measured = sum(r.measured_s or 0.0 for r in check.rows)
    profiled = sum(r.profiler_s for r in check.rows)
    return {"measured_sum_s": measured, "profiler_sum_s": profiled,
            "ratio": measured / profiled if profiled else float("nan"),
            "heavy": len(heavy), "heavy_within": len(within), "tolerance": tolerance,
            "step_under_profiler_s": check.step_s, "accumulate_grad_s": check.accumulate_grad_s}


__all__ = ["CrossCheck", "CrossCheckRow", "cross_check_model", "profiler_cross_check", "summary"]
