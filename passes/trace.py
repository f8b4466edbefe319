"""The ``trace`` pass: nn.Module -> torch.fx.GraphModule, through one of two front ends.

``torch.fx`` (:mod:`.fx_frontend`: leaf modules kept whole, every untraceable construct listed) or
``torch.export`` (:mod:`.export_frontend`: aten ops, for models fx can't trace, such as Hugging Face
``transformers``). :func:`trace_any` picks one; :func:`run` writes the graph and the key of the model
output it returns. Both front ends sit below this module and import nothing of it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from pdcompile.errors import UnsupportedModelError, UsageError
from pdcompile.ir import CompileState
from pdcompile.passes.export_frontend import LossProbe, export_trace
from pdcompile.passes.fx_frontend import (  # noqa: F401 - the fx front end's names, as callers know them here
    Offence, PdTracer, diagnose, format_offences, host_syncs, is_builtin_leaf, trace, user_frame)

FRONTENDS = ("auto", "fx", "export")


def trace_any(model: torch.nn.Module, example_inputs: Sequence[Any] | torch.Tensor,
              leaf_modules: Sequence[type | str] = (), frontend: str = "auto", *,
              kwargs: Mapping[str, Any] | None = None, output: str | int | None = None,
              loss_probe: LossProbe | None = None) -> fx.GraphModule:
    """The trace pass with a choice of front end.

    ``"fx"``: :func:`pdcompile.passes.fx_frontend.trace` (module-level, leaf modules kept whole).
    ``"export"``: :func:`export_trace` (aten ops; ``leaf_modules`` has no meaning and is ignored).
    ``"auto"``: fx first; if it fails (UnsupportedModelError, any tracing error), export. With
    ``kwargs=`` or ``output=`` (export-only options) "auto" goes straight to export. When both fail the error lists both reasons.
    ``loss_probe``: the loss, which picks the model output export returns (:func:`~.export_frontend.loss_choice`).
    """
    if frontend not in FRONTENDS:
        raise UsageError(f"trace: frontend must be one of {FRONTENDS}, got {frontend!r}")
    if frontend == "export":
        return export_trace(model, example_inputs, kwargs=kwargs, output=output, loss_probe=loss_probe)
    shapes = _shapes(example_inputs)
    if frontend == "fx":
        if kwargs or output is not None:
            raise UsageError("trace: kwargs= and output= need frontend='export' (or 'auto')")
        return trace(model, leaf_modules, inputs=_count(example_inputs), example_shapes=shapes)
    fx_failed = False
    if not kwargs and output is None:
        try:
            return trace(model, leaf_modules, explain=False, inputs=_count(example_inputs), example_shapes=shapes)
        except Exception:  # noqa: BLE001 - fall back to torch.export below
            fx_failed = True
    try:
        return export_trace(model, example_inputs, kwargs=kwargs, output=output, loss_probe=loss_probe)
    except UnsupportedModelError as e:
        if not fx_failed:
            raise
        fx_error = _fx_error(model, leaf_modules, _count(example_inputs), shapes)  # what fx found, listed only now that it is reported
        raise UnsupportedModelError(
            f"trace: neither front end can capture {type(model).__name__}.\n"
            f"torch.fx: {fx_error}\ntorch.export: {e}") from e


def _count(example_inputs: Sequence[Any] | torch.Tensor) -> int:
    """How many positional inputs the model is given (its later parameters keep their defaults)."""
    return 1 if isinstance(example_inputs, torch.Tensor) else len(example_inputs)


def _shapes(example_inputs: Sequence[Any] | torch.Tensor) -> list[tuple[int, ...]] | None:
    """The example inputs' shapes (None where one is not a tensor)."""
    xs = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
    if not xs or not all(isinstance(x, torch.Tensor) for x in xs):
        return None
    return [tuple(x.shape) for x in xs]


def _fx_error(model: torch.nn.Module, leaf_modules: Sequence[type | str], inputs: int,
              shapes: list[tuple[int, ...]] | None) -> BaseException:
    """The fx front end's error for ``model``, with every offending construct listed (:func:`diagnose`)."""
    try:
        trace(model, leaf_modules, inputs=inputs, example_shapes=shapes)
    except Exception as e:  # noqa: BLE001 - the error is the answer
        return e
    return UnsupportedModelError(f"{type(model).__name__} traced by torch.fx only on a second try")


@dataclass(frozen=True)
class TraceOptions:
    leaf_modules: tuple[type | str, ...] = ()
    frontend: str = "auto"  # "fx", "export", or "auto": fx, else export
    output: str | int | None = None  # export front end: which model output (e.g. "logits")
    loss_probe: LossProbe | None = None  # export front end: the loss, which picks the output it reads


def run(state: CompileState, opts: TraceOptions) -> CompileState:
    """Writes ``gm`` and ``output_key`` (the key of the model output the graph returns: the loss may
    read ``out.logits``)."""
    gm = trace_any(state.model, state.example_inputs, opts.leaf_modules, opts.frontend,
                   kwargs=state.example_kwargs or None, output=opts.output, loss_probe=opts.loss_probe)
    return state.replace(gm=gm, output_key=gm.meta.get("pd.output_key"))
