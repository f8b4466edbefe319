"""The compiler's pass list, in order, with each pass's IR dump: the one place that defines it.

A pass named ``split-stages`` is ``run`` in ``passes/split_stages.py`` (``pdcompile.passes.split_stages``);
its dump is ``NN_split-stages.txt``. :mod:`pdcompile.passmanager` runs the list; the API only
checks the user's options and turns them into each pass's typed options here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from pdcompile.ir import CompileState, need
from pdcompile.passes import (
    annotate_costs,
    linearize,
    partition,
    propagate_shapes,
    schedule,
    split_stages,
    tensor_parallel,
    trace,
    trace_loss,
)
from pdcompile.passmanager import Pass

O = TypeVar("O")


@dataclass(frozen=True)
class PassOptions:
    """Every pass's options, checked by the API."""

    trace: trace.TraceOptions
    annotate: annotate_costs.AnnotateOptions
    partition: partition.PartitionOptions
    schedule: schedule.ScheduleOptions
    loss: trace_loss.TraceLossOptions | None  # None: trace-loss waits for a target (emit/run)
    tensor_parallel: tensor_parallel.TensorParallelOptions = tensor_parallel.TensorParallelOptions()


def _with(run: Callable[[CompileState, O], CompileState], opts: O) -> Callable[[CompileState], CompileState]:
    return lambda state: run(state, opts)


def _dump_trace(s: CompileState) -> str:
    gm = need(s.gm, "gm")
    return gm.code.strip() + "\n\n" + str(gm.graph)


def passes(opts: PassOptions) -> list[Pass]:
    """The passes in the order they run."""
    out = [
        Pass("trace", _with(trace.run, opts.trace), _dump_trace),
        Pass("propagate-shapes", propagate_shapes.run,
             lambda s: propagate_shapes.format_graph_with_shapes(need(s.gm, "gm"))),
        Pass("annotate-costs", _with(annotate_costs.run, opts.annotate),
             lambda s: annotate_costs.format_costs(need(s.gm, "gm"))),
        Pass("linearize", linearize.run,
             lambda s: linearize.report(need(s.chain, "chain")) + "\n" + str(s.chain)),
        Pass("partition", _with(partition.run, opts.partition), partition.format_partition),
        Pass("split-stages", split_stages.run, lambda s: str(s.stages)),
    ]
    if opts.loss is not None:  # before tensor-parallel: the LM head splits by vocabulary only into a plain cross-entropy
        out.append(Pass("trace-loss", _with(trace_loss.run, opts.loss), lambda s: str(s.loss)))
    out += [
        Pass("tensor-parallel", _with(tensor_parallel.run, opts.tensor_parallel),
             lambda s: tensor_parallel.format_tensor_parallel(s) + "\n\n" + str(s.stages)),
        Pass("schedule", _with(schedule.run, opts.schedule), schedule.format_schedule),
    ]
    return out
