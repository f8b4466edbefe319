"""Staleness corrections for the asynchronous schedules (``staleness=`` in plan.json): the formulas as
pure functions of tensors and numbers, and the two objects a stage's executor holds.

A stage's *delay* ``s`` is read off the compiled schedule (``schedules.versions.update_delays``): how
many optimizer steps the stage takes between a microbatch's forward and the step that applies its
gradient (1F1B: the stage's in-flight count less one, NOAM-based, per replica; 2BW: 1; flush: 0).

* ``lr`` (PipeMare, Yang et al.): the step applying an update at progress ``t`` runs at
  ``eta(t) / max(s, 1) ** (1 - min(t / K, 1))``. ``eta(t)`` is the learning rate the optimizer holds
  (the user's LR scheduler enters first, as in AsyncPP's ``adjust_learning_rate``), ``t`` the
  minibatches the update completes (the last backward's microbatch + 1, over ``M``: 1-based, as
  AsyncPP's ``1 + step``), ``K = warmup x`` the run's minibatches. The group's rate is set for the
  step and put back after it, so a scheduler chaining on ``group["lr"]`` never sees the factor.
* ``predict`` (XPipe / PipeOptim; SpecTrain for momentum SGD): a forward uses
  ``W_hat = W - s * lr * D``, ``D`` the optimizer's own next direction from its state now: Adam
  ``m_hat / (sqrt(v_hat) + eps)`` with bias corrections at the state's step count (PipeOptim's
  convention; no step yet: ``D = 0``), AdamW the same plus its decoupled decay ``weight_decay * W``
  (the step it predicts shrinks W too), momentum SGD its momentum buffer. ``lr`` is the rate the
  next step will use (after the scheduler), held for all ``s`` steps. ``s`` is our delay, the number
  of updates between the forward and the one its gradient meets (PipeOptim counts one more).
  The predicted tensors are the version stashed for the backward (runtime/weights.py). FTPipe's
  multi-step form (:func:`predict_adam_multistep`) was measured against this one and lost
  (benchmarks/RESULTS.md); it stays as a formula for ``benchmarks/staleness_probe.py --form decay``.
* ``predict+lr``: both; the prediction uses the rate of the stage's last (rescaled) step.
* ``staleness_sync = N`` (any mode): the first ``N`` minibatches synchronous, each its own schedule
  (a flush after each: delay 0, no prediction, full rate), then the schedule; PipeMare's ``t`` counts
  from the end of those ``N``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pdcompile.errors import UsageError

MODES = ("none", "lr", "predict", "predict+lr", "auto")
CORRECTIONS = ("none", "lr", "predict", "predict+lr")  # what a stage applies ("auto" resolves to one of these)
PREDICTING = ("predict", "predict+lr")  # the modes that predict weights (need the optimizer's rule)
RESCALING = ("lr", "predict+lr")  # the modes that rescale each stage's rate (PipeMare)
DEFAULT_WARMUP = 0.25  # K as a fraction of the run (PipeMare's ramp back to the full rate)


# ---- the formulas ---------------------------------------------------------------------------------

def pipemare_factor(delay: int, progress: float, warmup: float) -> float:
    """PipeMare's multiplier ``1 / max(delay, 1) ** (1 - min(progress / warmup, 1))``: ``progress``
    and ``warmup`` (K) in the same unit (minibatches, or fractions of the run); ``warmup <= 0``: 1."""
    tau = max(int(delay), 1)
    if tau == 1 or warmup <= 0:
        return 1.0
    return float(tau ** -(1.0 - min(progress / warmup, 1.0)))


def adam_direction(m: torch.Tensor, v: torch.Tensor, step: float, betas: tuple[float, float],
                   eps: float) -> torch.Tensor:
    """Adam's update direction ``m_hat / (sqrt(v_hat) + eps)`` at ``step`` updates (0: zeros)."""
    if step <= 0:
        return torch.zeros_like(m)
    b1, b2 = betas
    return (m / (1 - b1 ** step)) / ((v / (1 - b2 ** step)).sqrt() + eps)


def predict_adam(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: float, lr: float, delay: int, *,
                 betas: tuple[float, float], eps: float, weight_decay: float = 0.0,
                 decoupled: bool = False) -> torch.Tensor:
    """``p - delay * lr * (adam_direction + [decoupled] weight_decay * p)`` (a new tensor). Coupled
    decay (Adam's ``weight_decay``) is in the gradient, so in ``m`` and ``v`` already."""
    d = adam_direction(m, v, step, betas, eps)
    if decoupled and weight_decay:
        d = d + weight_decay * p
    return p - (delay * lr) * d


def predict_adam_multistep(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: float, lrs: Sequence[float], *,
                           betas: tuple[float, float], eps: float, weight_decay: float = 0.0,
                           decoupled: bool = False) -> torch.Tensor:
    """FTPipe's schedule-aware prediction (``pipe/pipeline/weight_prediction/adam.py``): the ``k``-th of
    the ``len(lrs)`` coming steps moves by ``lrs[k-1] * b1^k m / (1 - b1^(step+k)) / (sqrt(v / (1 -
    b2^(step+k))) + eps)``: ``m`` decays as if the coming gradients were zero, each step bias-corrected
    at its own count, ``v`` held; AdamW adds ``lr_k * weight_decay * p`` per step. No step yet: ``p``."""
    if step <= 0:
        return p.clone()
    b1, b2 = betas
    out = p.clone()
    for k, lr in enumerate(lrs, start=1):
        d = (b1 ** k) * m / (1 - b1 ** (step + k)) / ((v / (1 - b2 ** (step + k))).sqrt() + eps)
        if decoupled and weight_decay:
            d = d + weight_decay * p
        out = out - lr * d
    return out


def predict_momentum(p: torch.Tensor, buf: torch.Tensor | None, lr: float, delay: int) -> torch.Tensor:
    """``p - delay * lr * buf`` (SpecTrain); no buffer yet (no step): ``p``'s copy."""
    if buf is None:
        return p.clone()
    return p - (delay * lr) * buf


# ---- which rule an optimizer has ------------------------------------------------------------------

def rule_for(class_path: str, kwargs: Mapping[str, Any]) -> str:
    """The prediction rule of an optimizer (plan.json's ``optimizer``): ``adam``, ``adamw`` or
    ``momentum``; one without a rule is a UsageError naming the fix."""
    name = class_path.rsplit(".", 1)[-1]
    fix = "Fix: staleness='lr' (any optimizer), or use Adam, AdamW or SGD with momentum > 0"
    if name in ("Adam", "AdamW"):
        if kwargs.get("amsgrad") or kwargs.get("maximize"):
            raise UsageError(f"staleness='predict' has no rule for {name} with amsgrad/maximize. {fix}")
        decoupled = name == "AdamW" or bool(kwargs.get("decoupled_weight_decay"))
        return "adamw" if decoupled else "adam"
    if name == "SGD":
        if not kwargs.get("momentum") or kwargs.get("nesterov") or kwargs.get("maximize"):
            raise UsageError("staleness='predict' predicts SGD by its momentum buffer: it needs momentum > 0 "
                             f"(not nesterov, not maximize). {fix}")
        return "momentum"
    raise UsageError(f"staleness='predict' has no rule for {class_path}. {fix}")


def has_rule(class_path: str, kwargs: Mapping[str, Any]) -> bool:
    try:
        rule_for(class_path, kwargs)
    except UsageError:
        return False
    return True


def resolve(mode: str, synchronous: bool, class_path: str, kwargs: Mapping[str, Any]) -> str:
    """The correction a run applies for ``mode``: ``auto`` is ``none`` for a synchronous schedule,
    else ``predict`` where the optimizer has a rule and ``lr`` where it has none; ``predict`` is
    checked against the optimizer (UsageError with the fix)."""
    if mode not in MODES:
        raise UsageError(f"staleness must be one of {list(MODES)}, got {mode!r}")
    if mode == "auto":
        if synchronous:
            return "none"
        return "predict" if has_rule(class_path, kwargs) else "lr"
    if mode in PREDICTING:
        rule_for(class_path, kwargs)
    return mode


def check_warmup(warmup: Any) -> float:
    """``staleness_warmup`` (K as a fraction of the run) checked: a number in [0, 1]."""
    if isinstance(warmup, bool) or not isinstance(warmup, (int, float)) or not 0 <= warmup <= 1:
        raise UsageError(f"staleness_warmup must be a fraction of the run in [0, 1] (PipeMare's K), got {warmup!r}")
    return float(warmup)


def check_sync(sync: Any) -> int:
    """``staleness_sync`` (the minibatches run synchronously first) checked: an int >= 0."""
    if isinstance(sync, bool) or not isinstance(sync, int) or sync < 0:
        raise UsageError(f"staleness_sync must be a number of minibatches >= 0 (run synchronously before the "
                         f"schedule's stale weights), got {sync!r}")
    return sync


def sync_cuts(start: int, steps: int, sync: int) -> set[int]:
    """The flush points of a synchronous start: after each of the first ``sync`` minibatches (each then
    its own schedule, so every stage's forward uses the newest weights: delay 0), from ``start`` on."""
    return set(range(start + 1, min(sync, steps) + 1))


def describe(mode: str, delays: list[int], warmup: float, sync: int = 0) -> list[str]:
    """explain()'s lines: each stage's delay and what it applies."""
    out = [f"staleness: {mode}" + (f" (K = {warmup:g} of the run)" if mode in RESCALING else "")
           + (f"; the first {sync} minibatch(es) synchronous (each flushed: delay 0)" if sync else "")]
    for s, d in enumerate(delays):
        if d == 0 or mode == "none":
            what = "nothing" + (" (delay 0)" if d == 0 and mode != "none" else "")
        elif mode == "lr":
            what = f"lr / {d}^(1 - min(t/K, 1))"
        elif mode == "predict":
            what = f"forward on W - {d} * lr * (next update direction)"
        else:
            what = f"forward on W - {d} * lr' * (next update direction), stepping at lr' = lr / {d}^(1 - min(t/K, 1))"
        out.append(f"  stage {s}: delay {d} update(s); applies {what}")
    return out


# ---- what a stage holds ---------------------------------------------------------------------------

@dataclass
class LrCorrection:
    """PipeMare's rate for one stage: :meth:`step` runs ``optimizer.step`` with each group's rate
    scaled by :func:`pipemare_factor` and puts the rates back. ``total`` is the run's minibatches,
    ``micro`` the microbatches per minibatch; progress comes from the last microbatch backwarded."""

    delay: int
    warmup: float
    total: int
    micro: int
    used: list[float] | None = None  # the first group's rate of each step (metrics)
    sync: int = 0  # the minibatches run synchronously first (staleness_sync): full rate, t counted after them
    last: float = 1.0  # the factor of the last step (a predictor under "predict+lr" predicts with it)

    def factor(self, last_microbatch: int) -> float:
        t = (last_microbatch + 1) / self.micro - self.sync  # counted from the end of a synchronous start
        return 1.0 if t <= 0 else pipemare_factor(self.delay, t, self.warmup * self.total)

    def applied(self, last_microbatch: int) -> float:
        """The factor of the step closed by ``last_microbatch``, recorded as :attr:`last`."""
        self.last = self.factor(last_microbatch)
        return self.last

    def step(self, optimizer: Any, last_microbatch: int) -> None:
        f = self.applied(last_microbatch)
        groups = optimizer.param_groups
        saved = [g["lr"] for g in groups]
        for g in groups:
            g["lr"] = g["lr"] * f
        try:
            if self.used is not None and groups:
                self.used.append(float(groups[0]["lr"]))
            optimizer.step()
        finally:
            for g, lr in zip(groups, saved):
                g["lr"] = lr


class Predictor:
    """The predicted weights of one stage, ``W_hat = W - delay * lr * D`` per parameter, from its
    optimizer's state now (called when a version is stashed, while the live parameters hold it).
    Groups are looked up at each call: ``load_state_dict`` (``--resume``) replaces them."""

    def __init__(self, optimizer: Any, params: Mapping[str, torch.nn.Parameter], delay: int, rule: str,
                 form: str = "linear", scaled: LrCorrection | None = None) -> None:
        self.optimizer, self.delay, self.rule, self.form, self.scaled = optimizer, delay, rule, form, scaled
        self.params = dict(params)

    def predicted(self, p: torch.Tensor, group: Mapping[str, Any] | None) -> torch.Tensor:
        """One parameter's prediction under its optimizer group (None: not optimized, kept)."""
        w = p.detach()
        state = self.optimizer.state.get(p, {}) if group is not None else {}
        if group is None:
            return w.clone()
        lr = float(group["lr"]) * (self.scaled.last if self.scaled is not None else 1.0)
        if self.rule == "momentum":
            if self.form == "decay" and state.get("momentum_buffer") is not None:  # the buffer decays by mu a step
                mu = float(group["momentum"])
                return predict_momentum(w, state["momentum_buffer"], lr * sum(mu ** k for k in range(1, self.delay + 1)) / self.delay,
                                        self.delay)
            return predict_momentum(w, state.get("momentum_buffer"), lr, self.delay)
        if "exp_avg" not in state:
            return w.clone()
        b1, b2 = group["betas"]
        kw = dict(betas=(float(b1), float(b2)), eps=float(group["eps"]), weight_decay=float(group["weight_decay"]),
                  decoupled=self.rule == "adamw")
        if self.form == "decay":
            return predict_adam_multistep(w, state["exp_avg"], state["exp_avg_sq"], float(state["step"]),
                                          [lr] * self.delay, **kw)  # type: ignore[arg-type]
        return predict_adam(w, state["exp_avg"], state["exp_avg_sq"], float(state["step"]), lr, self.delay,
                            **kw)  # type: ignore[arg-type]

    def __call__(self) -> dict[str, torch.Tensor]:
        group_of = {id(p): g for g in self.optimizer.param_groups for p in g["params"]}
        with torch.no_grad():
            return {n: self.predicted(p, group_of.get(id(p))) for n, p in self.params.items()}


def of_stage(mode: str, delay: int, optimizer: Any, params: Mapping[str, torch.nn.Parameter],
             optimizer_spec: Mapping[str, Any], *, warmup: float, total: int, micro: int,
             sharded: bool, sync: int = 0) -> tuple[LrCorrection | None, Predictor | None]:
    """What a stage of ``delay`` applies under correction ``mode`` (resolved): an LR correction, a
    predictor, or neither (delay 0, or ``none``: today's code path exactly)."""
    if delay <= 0 or mode == "none" or not params:
        return None, None
    lr = LrCorrection(delay, warmup, total, micro, used=[], sync=sync) if mode in RESCALING else None
    if mode not in PREDICTING:
        return lr, None
    if sharded:
        raise UsageError(f"staleness={mode!r} needs each replica to hold its stage's whole optimizer state; "
                         "this stage is sharded. Fix: shard='none', or staleness='lr'")
    rule = rule_for(str(optimizer_spec["class"]), optimizer_spec.get("kwargs", {}))
    return lr, Predictor(optimizer, params, delay, rule, scaled=lr)


def plan_entry(mode: str, warmup: float, spec: Any, optimizer_spec: Mapping[str, Any],
               sharded: Sequence[bool] = (), sync: int = 0) -> dict[str, Any]:
    """plan.json's ``staleness``: the mode asked, the correction it resolves to for this schedule and
    optimizer (:func:`resolve`), K, and each stage's delay read off the compiled schedule ``spec``
    (a ``ScheduleSpec``; the runtime reads its own again from the schedule it runs). ``sharded``: per
    stage, whether its replicas shard their state (prediction needs the whole state: refused)."""
    from pdcompile.runtime.schedules import policy
    from pdcompile.runtime.schedules.spec import stage_delays

    applied = resolve(mode, policy(spec.name).synchronous, str(optimizer_spec["class"]),
                      optimizer_spec.get("kwargs", {}))
    delays = stage_delays(spec)  # what each stage faces, corrected or not (explain, plan.json)
    if applied in PREDICTING and any(sh and delays.get(s, 0) > 0 for s, sh in enumerate(sharded)):
        raise UsageError(f"staleness={applied!r} needs each replica to hold its stage's whole optimizer state; the "
                         "plan shards a replicated stage's. Fix: shard='none', or staleness='lr'")
    return {"asked": mode, "mode": applied, "warmup": check_warmup(warmup),
            "sync": check_sync(sync) if any(delays.values()) else 0,  # a synchronous schedule has nothing to warm
            "delays": [delays.get(s, 0) for s in range(len(spec.replicas) * spec.virtual_stages)]}
