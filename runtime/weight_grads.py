"""The weight half of a split backward (``W``), without walking the stage's graph twice.

A split backward (``B k`` then ``W k``, see :mod:`pdcompile.runtime.schedules`) first computes only
the gradients of the stage's inputs; ``W`` then needs the weights'. Walking the retained graph again
from the stage's outputs would recompute every activation gradient. Instead :class:`WeightPass`
notes the output of every parameter-owning submodule during the forward, ``B`` also returns the
gradients of those outputs (the engine computes them anyway), and ``W`` runs one short backward per
submodule, from its output to its own parameters. That is exact only when each parameter is used
inside its own submodule's single call, so the first ``W`` of a run checks it (:class:`WeightPass`).
The split at the graph level, which runs each backward node once: :mod:`pdcompile.runtime.graph_split`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

log = logging.getLogger("pdcompile.runtime")


def _owners(module: nn.Module) -> list[tuple[nn.Module, list[torch.nn.Parameter]]]:
    """Each submodule (the root too) with the trainable parameters it owns directly."""
    out = []
    for m in module.modules():
        own = [p for p in m.parameters(recurse=False) if p.requires_grad]
        if own:
            out.append((m, own))
    return out


class WeightPass:
    """Per stage module: capture during a forward, input gradients in ``B``, weight gradients in ``W``.

    The first ``W`` of a run also computes every weight gradient the plain way (from the stage's
    outputs) and compares them (:func:`same_grads`): equal, and the fast path is used from then on
    (an emitted stage's forward is straight-line code: the same every step); different, and every
    later ``W`` walks the whole graph (correct, slower), which is logged once."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.params = [p for p in module.parameters() if p.requires_grad]
        owners = _owners(module)
        self.root_params = next((ps for m, ps in owners if m is module), [])
        self.children = [(m, ps) for m, ps in owners if m is not module]
        # a parameter object owned by two submodules (tied inside the stage): only the plain walk is exact
        ids = [id(p) for _, ps in owners for p in ps]
        self.trusted: bool | None = None if len(ids) == len(set(ids)) else False

    @property
    def walks_whole_graph(self) -> bool:
        """Whether ``W`` would walk the stage's whole graph again from its outputs: every parameter read by the
        stage itself, none owned by a submodule it calls (an exported graph: the walk to them reaches back through
        every layer), or a stage whose check found a parameter used outside its submodule's single call (the
        plain walk). ``B`` and ``W`` then cost about two backwards, so the executor runs such a backward unsplit
        (``B`` whole, ``W`` nothing), as the cost model charges it (``passes/annotate_costs.reads_params_itself``)."""
        return self.trusted is False or (bool(self.root_params) and not self.children)

    # F -----------------------------------------------------------------------------------------
    def capture(self) -> tuple[list[Any], dict[nn.Module, list[list[torch.Tensor]]]]:
        """Start noting submodule outputs (for the next forward); returns (handles, notes)."""
        notes: dict[nn.Module, list[list[torch.Tensor]]] = {}
        if self.trusted is False:
            return [], notes

        def hook(m: nn.Module, _args: Any, out: Any) -> None:
            outs = out if isinstance(out, (tuple, list)) else (out,)
            notes.setdefault(m, []).append([t for t in outs if isinstance(t, torch.Tensor)])

        return [m.register_forward_hook(hook) for m, _ in self.children], notes

    # B -----------------------------------------------------------------------------------------
    def input_grads(self, roots: Sequence[torch.Tensor], seeds: Sequence[torch.Tensor] | None,
                    inputs: Sequence[torch.Tensor], notes: dict[nn.Module, list[Any]]) -> tuple[list[torch.Tensor], Any]:
        """The gradients of ``inputs``; and what :meth:`weight_grads` needs (the graph is retained)."""
        groups: list[Any] = []
        if self.trusted is not False:
            for m, ps in self.children:
                calls = notes.get(m, [])
                if len(calls) > 1:  # called twice: its parameters' gradient is not one output's
                    self.trusted, groups = False, []
                    break
                if calls:  # a submodule never called gets no gradient either way
                    groups.append(([y for y in calls[0] if y.requires_grad], ps))
        extra = [y for ys, _ in groups for y in ys] if groups else []
        if not inputs and not extra:  # nothing to hand back early: W walks the whole graph
            return [], (list(roots), seeds, [])
        got = torch.autograd.grad(list(roots), list(inputs) + extra, seeds, retain_graph=True, allow_unused=True)
        dinputs = [g if g is not None else torch.zeros_like(t) for g, t in zip(got, inputs)]
        if groups:
            it = iter(got[len(inputs):])
            groups = [(ys, [next(it) for _ in ys], ps) for ys, ps in groups]
        return dinputs, (list(roots), seeds, groups)

    # W -----------------------------------------------------------------------------------------
    def weight_grads(self, work: Any) -> None:
        """Accumulate the weight gradients into ``.grad``, as an unsplit backward would."""
        roots, seeds, groups = work
        if not self.params:
            return
        if not groups or self.trusted is False:
            torch.autograd.backward(roots, seeds, inputs=self.params)
            return
        fast: dict[int, torch.Tensor] = {}
        for ys, dys, ps in groups:
            pairs = [(y, g) for y, g in zip(ys, dys) if g is not None]
            if not pairs:
                continue
            got = torch.autograd.grad([y for y, _ in pairs], ps, [g for _, g in pairs], retain_graph=True,
                                      allow_unused=True)
            for p, g in zip(ps, got):
                if g is not None:
                    fast[id(p)] = g
        if self.root_params:  # used by the stage's own code: their gradient from the outputs
            got = torch.autograd.grad(roots, self.root_params, seeds, retain_graph=True, allow_unused=True)
            fast.update({id(p): g for p, g in zip(self.root_params, got) if g is not None})
        if self.trusted is None:
            plain = torch.autograd.grad(roots, self.params, seeds, retain_graph=True, allow_unused=True)
            exact = bitwise_check(self.params[0].device)
            ok = all((g is None and id(p) not in fast) or (g is not None and id(p) in fast
                                                           and same_grads(g, fast[id(p)], exact))
                     for p, g in zip(self.params, plain))
            self.trusted = ok
            if not ok:
                log.warning("split backward: this stage's parameters are not each used by one submodule call; "
                            "its W passes walk the whole graph (exact, slower)")
                fast = {id(p): g for p, g in zip(self.params, plain) if g is not None}
        for p in self.params:
            g = fast.get(id(p))
            if g is None:
                continue
            if p.grad is None:
                p.grad = g
            else:
                p.grad.add_(g)


def bitwise_check(device: torch.device) -> bool:
    """Whether the trust check may ask for bitwise equality: on the CPU (its kernels are
    deterministic), and on a GPU only when torch is told to use deterministic algorithms."""
    return device.type == "cpu" or torch.are_deterministic_algorithms_enabled()


def same_grads(plain: torch.Tensor, fast: torch.Tensor, exact: bool) -> bool:
    """The trust check's comparison of one parameter's gradient by the plain walk and by the fast
    path: bitwise when ``exact`` (:func:`bitwise_check`), else every entry within ``rtol`` (from the
    dtype) times the gradient's largest entry. With non-deterministic GPU kernels (atomics in
    scatter/index_add-style backwards, cuDNN's algorithm choice) two walks of one graph may differ in
    the last bits, and a bitwise check would distrust an exact fast path for the whole run; what the
    check must catch, a parameter used outside its submodule's call, leaves out a whole contribution
    to the gradient, far above that noise."""
    if exact or plain.shape != fast.shape:
        return torch.equal(plain, fast)
    rtol = 1e-2 if plain.element_size() <= 2 else 1e-4  # half types carry about 3 digits, float32 about 7
    scale = float(plain.detach().abs().max()) if plain.numel() else 0.0
    return bool(torch.allclose(fast, plain, rtol=0.0, atol=rtol * scale))  # all zeros: equal
