"""Reference semantics: what each schedule computes, in one process, written from the definitions.

Synchronous schedules (GPipe, PipeDream-Flush) are plain synchronous SGD with gradient
accumulation: for each minibatch, split it into ``M`` microbatches, accumulate the gradients of
``loss(microbatch) / M``, then take one optimizer step. The pipeline must reproduce this exactly
(up to floating-point reassociation).

Asynchronous schedules (PipeDream 1F1B with weight stashing, vertical sync, 2BW, and 1F1B without
stashing, which is wrong on purpose) are :func:`train_versioned` with the weight version each
stage uses per microbatch, as the papers define it (:func:`pipedream_1f1b`, :func:`pipedream_2bw`).
Global-norm clipping there (``max_norm=``) is per update: the k-th update of every stage holds the
same microbatches, and its gradient is clipped by the norm over every stage's gradient of it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch


def train_sync(model: torch.nn.Module, loss_fn: Callable[..., torch.Tensor],
               optimizer: torch.optim.Optimizer, batches: Iterable[tuple[tuple[torch.Tensor, ...], torch.Tensor]],
               *, steps: int, num_microbatches: int, lr_scheduler: Any = None) -> list[float]:
    """Train ``steps`` minibatches from ``batches``; return each microbatch's loss (unscaled)."""
    losses: list[float] = []
    it: Iterator[Any] = iter(batches)
    model.train()
    for _ in range(steps):
        inputs, target = next(it)
        micro_in = [x.chunk(num_microbatches) for x in inputs]
        micro_t = target.chunk(num_microbatches)
        optimizer.zero_grad(set_to_none=True)
        for j in range(num_microbatches):
            loss = loss_fn(model(*(x[j] for x in micro_in)), micro_t[j])
            losses.append(float(loss.detach()))
            (loss / num_microbatches).backward()
        optimizer.step()
        if lr_scheduler is not None:
            lr_scheduler.step()
    return losses


# ------------------------------------------------------------------------------------------------
# Asynchronous schedules: per-stage weight versions.
#
# One definition covers them all. A pipeline is a chain of stage modules; stage ``s`` has weight
# versions ``W_s(0)`` (initial), ``W_s(1)``, ... where ``W_s(g+1)`` is the optimizer's step from
# ``W_s(g)`` with the gradients of the microbatches in group ``g`` of stage ``s``, summed. For
# microbatch ``n`` the forward on stage ``s`` uses ``W_s(fwd(s, n))``; the gradient it adds to its
# group is taken at ``W_s(bwd(s, n))`` (with the stage input the forward produced upstream and the
# output gradient coming back from downstream). Weight stashing means ``bwd == fwd``.

Versions = Callable[[int, int], int]  # (stage, microbatch) -> version


def train_versioned(stages: Sequence[torch.nn.Module], optimizers: Sequence[torch.optim.Optimizer],
                    loss_fn: Callable[..., torch.Tensor],
                    microbatches: Sequence[tuple[tuple[torch.Tensor, ...], torch.Tensor]], *,
                    fwd: Versions, bwd: Versions | None = None, group: Versions, scale: float = 1.0,
                    tied: Sequence[Sequence[tuple[int, str]]] = (), max_norm: float | None = None,
                    norms: list[float] | None = None,
                    stash: Callable[[int], dict[str, torch.Tensor]] | None = None,
                    lr_factor: Callable[[int, int], float] | None = None,
                    data_inputs: Sequence[Sequence[int]] = ()) -> list[float]:
    """Train the chain ``stages`` on ``microbatches`` with the weight versions above; return the losses.

    ``data_inputs[s]``: the model inputs (indices into a microbatch's inputs) stage ``s`` reads itself, after
    what it receives (an emitted program's ``StageSpec.data``).
    ``stages[s]``'s parameters end as its newest version; ``optimizers[s]`` owns them. Each
    microbatch's loss is multiplied by ``scale``. ``tied``: groups of ``(stage, parameter name)``
    whose gradients are summed before every step (they step in the same group on every stage).
    Needs ``fwd(s, n) <= group(s, n)`` and ``bwd(s, n) <= group(s, n)`` (a version exists before a
    microbatch that uses it contributes), and groups non-decreasing in ``n``.

    ``max_norm``: global-norm clipping per update. Update ``g`` of every stage holds the same
    microbatches (``group`` must not depend on the stage), so its gradients, each stage's taken at
    its own versions, are one gradient of the whole model; every stage's is scaled by
    ``min(1, max_norm / (norm_g + 1e-6))`` before its step, ``norm_g`` the L2 norm over all of them
    (each tied group once, after its sum; computed in float64). ``norms`` (if given) receives each
    ``norm_g``, unclipped.

    Staleness corrections (``staleness=``): ``stash(s)`` gives what version ``v`` of stage ``s`` holds,
    called when the live weights and the optimizer's state are version ``v`` (default: their copy;
    weight prediction: the predicted weights); ``lr_factor(s, n)`` scales every group's rate for the
    step closed by microbatch ``n`` (PipeMare), put back after it.
    """
    bwd = bwd or fwd
    S, N = len(stages), len(microbatches)
    params = [dict(m.named_parameters()) for m in stages]

    def stashed(s: int) -> dict[str, torch.Tensor]:
        if stash is not None:
            return {k: t.detach().clone() for k, t in stash(s).items()}
        return {k: p.detach().clone() for k, p in params[s].items()}

    versions = [[stashed(s)] for s in range(S)]
    acc: list[dict[str, torch.Tensor]] = [{} for _ in range(S)]
    losses: list[float] = []

    def run(s: int, v: int, x: tuple[torch.Tensor, ...]) -> Any:
        w = {k: t.clone().requires_grad_(params[s][k].requires_grad) for k, t in versions[s][v].items()}
        return w, torch.func.functional_call(stages[s], w, x)

    for n, (inputs, target) in enumerate(microbatches):
        xs = [tuple(inputs)]  # forward with W_s(fwd(s, n)); xs[s] is stage s's input
        read = [tuple(inputs[j] for j in (data_inputs[s] if s < len(data_inputs) and s > 0 else ())) for s in range(S)]
        for s in range(S - 1):
            _, out = run(s, fwd(s, n), xs[s] + read[s])
            xs.append(tuple(o.detach() for o in out))
        with torch.no_grad():
            _, out = run(S - 1, fwd(S - 1, n), xs[-1] + read[-1])
            losses.append(float(loss_fn(out, target)))
        grad_out: list[torch.Tensor | None] = []
        for s in reversed(range(S)):  # backward at W_s(bwd(s, n))
            x = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in xs[s])
            w, out = run(s, bwd(s, n), x + read[s])
            if s == S - 1:
                (loss_fn(out, target) * scale).backward()
            else:
                pairs = [(o, g) for o, g in zip(out, grad_out) if o.requires_grad and g is not None]  # type: ignore[arg-type]  # zip of optional gradients, filtered
                if pairs:
                    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            grad_out = [t.grad for t in x]  # lines up with stage s-1's outputs
            for k, t in w.items():
                if t.grad is not None:
                    acc[s][k] = acc[s][k] + t.grad if k in acc[s] else t.grad
        done = [s for s in range(S) if n == N - 1 or group(s, n + 1) > group(s, n)]
        for grp in tied:  # tied copies step with the sum of their gradients
            if any(s in done for s, _ in grp):
                if not all(s in done for s, _ in grp):
                    raise ValueError(f"tied parameters {list(grp)} step in different groups at microbatch {n}")
                total = sum(acc[s].get(k, torch.zeros_like(params[s][k])) for s, k in grp)
                for s, k in grp:
                    acc[s][k] = total.clone()  # type: ignore[union-attr]  # total is set by the first contribution
        if max_norm is not None and done:
            if len(done) != S:
                raise ValueError(f"clipping by the global norm needs every stage's update to hold the same "
                                 f"microbatches; at microbatch {n} only stages {done} close one")
            dup = {(s, k) for grp in tied for s, k in list(grp)[1:]}  # tied copies: counted once
            sq = sum(float(torch.linalg.vector_norm(g.double()) ** 2)
                     for s in range(S) for k, g in acc[s].items() if (s, k) not in dup)
            norm = sq ** 0.5
            if norms is not None:
                norms.append(norm)
            coef = min(1.0, max_norm / (norm + 1e-6))
            acc = [{k: g * coef for k, g in a.items()} for a in acc]
        for s in done:
            if group(s, n) != len(versions[s]) - 1:
                raise ValueError(f"stage {s}: microbatch {n} closes group {group(s, n)}, but "
                                 f"{len(versions[s]) - 1} groups were stepped")
            with torch.no_grad():
                for k, p in params[s].items():
                    p.grad = acc[s].get(k, torch.zeros_like(p)).clone()
            if lr_factor is None:
                optimizers[s].step()
            else:  # the stage's rate scaled for this one step (staleness="lr"), then put back
                groups = optimizers[s].param_groups
                saved = [g["lr"] for g in groups]
                for g in groups:
                    g["lr"] = g["lr"] * lr_factor(s, n)
                optimizers[s].step()
                for g, lr in zip(groups, saved):
                    g["lr"] = lr
            optimizers[s].zero_grad(set_to_none=True)
            versions[s].append(stashed(s))
            acc[s] = {}
    return losses


def warmup(replicas: Sequence[int], s: int) -> int:
    """PipeDream's admission depth of a replica of stage ``s``: ``ceil(workers from s on / r_s)``."""
    return -(-sum(replicas[s:]) // replicas[s])


def pipedream_1f1b(replicas: Sequence[int], *, stash: bool = True,
                   vertical_sync: bool = False) -> tuple[Versions, Versions, Versions]:
    """``(fwd, bwd, group)`` of PipeDream's 1F1B (1F1B-RR with replicas), every microbatch a minibatch.

    Replica ``n % r_s`` of stage ``s`` takes minibatch ``n`` as its ``i = n // r_s``-th; it admits
    ``w_s = warmup(replicas, s)`` minibatches, then one backward, one forward, and updates after
    every backward (its replicas together, gradients summed): group ``i``. So the forward of its
    ``i``-th minibatch follows the updates of its first ``i - w_s + 1``: version ``max(0, i - w_s + 1)``.

    * ``stash``: the backward uses that same version; without stashing it uses the newest at the
      backward, i.e. all updates before its own: version ``i`` (what PipeDream shows is wrong).
    * ``vertical_sync``: every stage uses the version matching the updates the input stage had when
      ``n`` entered: with ``c = max(0, n // r_0 - w_0 + 1)`` input-stage updates (minibatches
      ``< c * r_0``), stage ``s`` uses version ``c * r_0 // r_s``.
    """
    def group(s: int, n: int) -> int:
        return n // replicas[s]

    def fwd(s: int, n: int) -> int:
        if vertical_sync:
            c = max(0, n // replicas[0] - warmup(replicas, 0) + 1)
            return c * replicas[0] // replicas[s]
        return max(0, n // replicas[s] - warmup(replicas, s) + 1)

    return fwd, (fwd if stash else group), group


def pipedream_2bw(num_microbatches: int) -> tuple[Versions, Versions, Versions]:
    """``(fwd, bwd, group)`` of PipeDream-2BW: step ``t`` = microbatches ``t*M ..``, all of which use
    ``W(t-1)`` (``W(-1) = W(0)``), so ``W(t+1) = W(t) - lr * grad f_t(W(t-1))``."""
    def group(s: int, n: int) -> int:
        return n // num_microbatches

    def fwd(s: int, n: int) -> int:
        return max(0, n // num_microbatches - 1)

    return fwd, fwd, group


def synchronous(num_microbatches: int) -> tuple[Versions, Versions, Versions]:
    """``(fwd, bwd, group)`` of GPipe and PipeDream-Flush: step ``t`` uses ``W(t)``."""
    def group(s: int, n: int) -> int:
        return n // num_microbatches

    return group, group, group
