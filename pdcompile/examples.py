"""The example minibatch ``pdcompile`` is given: positional inputs (``example_inputs=``) and keyword inputs
(``example_kwargs=``), checked, with the tensors in the order the traced graph (and the first stage) takes
them, the tensor keywords' names (plan.json's ``input_keywords``), the batch size and one microbatch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from pdcompile.errors import UsageError
from pdcompile.ir import graph_inputs


@dataclass(frozen=True)
class Example:
    """One minibatch of model inputs: ``model(*args, **kwargs)``. Keyword values that are not tensors are
    constants of the compiled program."""

    args: tuple[torch.Tensor, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The graph's inputs, in order: the positional ones, then the keyword tensors."""
        return graph_inputs(self.args, self.kwargs)

    @property
    def keywords(self) -> tuple[str, ...]:
        """The keyword inputs that are tensors, in the order the first stage takes them."""
        return tuple(k for k, v in self.kwargs.items() if isinstance(v, torch.Tensor))

    @property
    def batch(self) -> int:
        return int(self.tensors[0].shape[0])

    def micro(self, size: int, meta: bool = False) -> "Example":
        """The first ``size`` samples of every tensor (on the meta device with ``meta``)."""
        def cut(v: Any) -> Any:
            if not isinstance(v, torch.Tensor):
                return v
            return v[:size].to("meta") if meta else v[:size]
        return Example(tuple(cut(x) for x in self.args), {k: cut(v) for k, v in self.kwargs.items()})


def check_example(example_inputs: Any, example_kwargs: Any) -> Example:
    """``example_inputs`` and ``example_kwargs`` as an :class:`Example`, or a :class:`UsageError` saying what is
    wrong: a tensor without a batch dimension, batch sizes that differ, kwargs that are not a dict of names."""
    kwargs = example_kwargs
    if kwargs is not None and (not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs)):
        raise UsageError(f"pdcompile: example_kwargs must be a dict of forward()'s keyword arguments, e.g. "
                         f"{{'attention_mask': mask}}, got {type(kwargs).__name__}")
    if example_inputs is None and not kwargs:
        raise UsageError("pdcompile: example_inputs=(x, ...) is required (one minibatch of model inputs; keyword "
                         "inputs go in example_kwargs={...})")
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    args = tuple(example_inputs or ())
    if not all(isinstance(x, torch.Tensor) and x.dim() > 0 for x in args):
        raise UsageError("pdcompile: example_inputs must be tensors with a batch dimension (dim 0)")
    for k, v in (kwargs or {}).items():
        if isinstance(v, torch.Tensor) and v.dim() == 0:
            raise UsageError(f"pdcompile: example_kwargs[{k!r}] is a tensor without a batch dimension (dim 0); "
                             f"give one minibatch of it, or a Python value (a constant of the compiled program)")
    example = Example(args, dict(kwargs or {}))
    if not example.tensors:
        raise UsageError("pdcompile: the example inputs hold no tensor; give one minibatch of model inputs")
    batch = example.batch
    if any(x.shape[0] != batch for x in example.tensors):
        raise UsageError("pdcompile: every example input (and tensor of example_kwargs) needs the same batch size "
                         "along dim 0")
    return example
