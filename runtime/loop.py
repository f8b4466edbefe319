"""The training loop's flags and plan (docs/training-loop.md): ``--epochs`` or ``--steps``, the LR
schedule (``--lr-scheduler``), validation (``--eval-data``, ``--eval-every``, ``--eval-steps``,
``--eval-metric``) and logs (``--log-every``, ``--tensorboard``); the lengths every rank agrees on,
and where a run is cut into segments (a checkpoint or an evaluation falls on a flush point)."""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pdcompile.errors import UsageError
from pdcompile.runtime.program import PICKLED, import_object, load_callable

DEFAULT_STEPS = 10


def add_flags(p: argparse.ArgumentParser) -> None:
    """The training loop's flags (``--steps`` itself stays with the other run flags)."""
    g = p.add_argument_group("training loop")
    g.add_argument("--epochs", type=int, default=None, metavar="N",
                   help="train N passes over --data (instead of --steps; the data must have a length: a DataLoader, "
                        "a list); a short last minibatch of a pass is dropped")
    g.add_argument("--lr-scheduler", default=None, metavar="MODULE:FUNCTION",
                   help="a function from the optimizer to a torch.optim.lr_scheduler, stepped after every optimizer "
                        "step on every stage (1f1b, 2bw: every update, M per minibatch); default: the compiled one. "
                        "Here and in --data, --eval-data, --eval-metric: or a FILE.pkl pdcompile serialized by value")
    g.add_argument("--eval-data", default=None, metavar="MODULE:FUNCTION",
                   help="validation data: a function of the minibatch size returning a DataLoader or iterable of "
                        "(inputs, target); run forward only through the pipeline")
    g.add_argument("--eval-every", type=_every, default=0, metavar="N|epoch",
                   help="evaluate after every N steps (a flush point), or after every epoch ('epoch', with "
                        "--epochs), and at the end; 0: at the end only")
    g.add_argument("--eval-steps", type=int, default=None, metavar="N",
                   help="minibatches of --eval-data per evaluation (default: one pass over it)")
    g.add_argument("--eval-metric", default=None, metavar="accuracy|MODULE:FUNCTION",
                   help="besides the loss: 'accuracy' (argmax of the output's last dimension equals the target), or a "
                        "function (output, target) -> number for one microbatch, averaged over the microbatches")
    g.add_argument("--log-every", type=int, default=1, metavar="N",
                   help="a log line every N steps on the last stage's rank (and a JSONL record with --metrics)")
    g.add_argument("--tensorboard", default=None, metavar="DIR",
                   help="TensorBoard event files (loss, LR, throughput, eval) into DIR (pip install tensorboard)")


def check(args: argparse.Namespace, folder: Path | None = None) -> None:
    """Refuse loop flags that cannot work, before anything starts (a :class:`UsageError`); ``--steps``
    defaults to 10 when neither it nor ``--epochs`` is given. ``folder``: the program's, where a flag's
    relative ``FILE.pkl`` is looked for first."""
    def at_least(flag: str, value: Any, what: str, least: int = 1) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise UsageError(f"{flag} {value!r}: must be an integer >= {least} ({what})")

    epochs = getattr(args, "epochs", None)
    if epochs is not None and args.steps is not None:
        raise UsageError("--epochs and --steps both given: train a number of passes (--epochs N) or of minibatches "
                         "(--steps N), not both")
    if epochs is None and args.steps is None:
        args.steps = DEFAULT_STEPS
    if epochs is not None:
        at_least("--epochs", epochs, "passes over --data; e.g. --epochs 2")
    else:
        at_least("--steps", args.steps, "optimizer steps to train; e.g. --steps 10")
    if getattr(args, "eval_every", 0) == "epoch":
        if epochs is None:
            raise UsageError("--eval-every epoch needs --epochs N (with --steps, give --eval-every STEPS)")
    else:
        at_least("--eval-every", getattr(args, "eval_every", 0), "steps between evaluations, or 'epoch'; 0: at the "
                 "end only", least=0)
    if getattr(args, "eval_steps", None) is not None:
        at_least("--eval-steps", args.eval_steps, "minibatches per evaluation")
    at_least("--log-every", getattr(args, "log_every", 1), "steps between log lines")
    if getattr(args, "eval_data", None) is None:
        for flag in ("eval_every", "eval_steps", "eval_metric"):
            if getattr(args, flag, None):
                raise UsageError(f"--{flag.replace('_', '-')} needs --eval-data MODULE:FUNCTION (the validation data)")
    for flag in ("lr_scheduler", "eval_data"):
        _importable(args, flag, folder)
    if getattr(args, "tensorboard", None):
        try:
            import torch.utils.tensorboard  # noqa: F401 - needs the tensorboard package, an extra
        except ImportError as e:
            raise UsageError(f"--tensorboard needs the tensorboard package ({e}): pip install "
                             f"'pdcompile[tensorboard]' (or pip install tensorboard)") from None
    metric = getattr(args, "eval_metric", None)
    if metric is not None and metric != "accuracy":
        _importable(args, "eval_metric", folder)


def _every(text: str) -> int | str:
    """``--eval-every``'s value: a number of steps, or ``epoch``."""
    if text == "epoch":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give a number of steps or 'epoch'") from None


def _importable(args: argparse.Namespace, flag: str, folder: Path | None = None) -> None:
    path = getattr(args, flag, None)
    if path is None:
        return
    name = "--" + flag.replace("_", "-")
    if path.endswith(PICKLED):
        if not any(p.is_file() for p in ([folder / path] if folder is not None else []) + [Path(path)]):
            raise UsageError(f"{name} {path!r}: no such file (a .pkl names a callable pdcompile serialized by value "
                             f"into the program folder); give MODULE:FUNCTION or that file")
        return
    if ":" not in path:
        raise UsageError(f"{name} {path!r}: give MODULE:FUNCTION (e.g. mydata:val_loader)")
    try:
        import_object(path)
    except (ImportError, AttributeError) as e:
        raise UsageError(f"{name} {path!r}: can't import it ({e}); is its folder on PYTHONPATH?") from None


def agree(local: int | None, device: torch.device) -> int | None:
    """The largest of every rank's ``local`` length (ranks that read no data pass None): one
    all-reduce over the default group, so every rank plans the same run; None if no rank knows one."""
    t = torch.tensor([-1 if local is None else int(local)], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    n = int(t.item())
    return None if n < 0 else n


def cuts(start: int, steps: int, *everys: int, extra: Iterable[int] = ()) -> list[tuple[int, int]]:
    """[first, end) minibatch ranges run as one schedule each: cut at every multiple of each of
    ``everys`` (checkpoints, evaluations; 0: none) and at each of ``extra`` (a synchronous start's)."""
    points = {start, steps} | {s for e in everys if e > 0 for s in range(e, steps, e) if s > start} | \
        {s for s in extra if start < s < steps}
    bounds = sorted(c for c in points if c >= start)
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


def build_scheduler(spec: dict[str, Any] | None, optimizer: Any, folder: Path | None = None) -> Any:
    """The LR scheduler plan.json (or ``--lr-scheduler``) names, for one stage's optimizer:
    ``{"factory": "MODULE:FUNCTION" or "FILE.pkl", "kwargs": {...}}`` calls the function (imported, or
    serialized by value into the program ``folder``) with the optimizer; ``{"class": PATH, "kwargs": {...}}``
    constructs the class with it."""
    if not spec:
        return None
    if "factory" in spec:
        made = load_callable(spec["factory"], folder)(optimizer, **spec.get("kwargs", {}))
    else:
        made = import_object(spec["class"])(optimizer, **spec.get("kwargs", {}))
    if not hasattr(made, "step") or not hasattr(made, "state_dict"):
        raise UsageError(f"lr_scheduler {spec}: returned {type(made).__name__}, not a torch.optim.lr_scheduler")
    return made


def scheduler_spec(args: argparse.Namespace, raw: dict[str, Any]) -> dict[str, Any] | None:
    """``--lr-scheduler`` if given, else plan.json's ``lr_scheduler``."""
    flag = getattr(args, "lr_scheduler", None)
    return {"factory": flag} if flag else raw.get("lr_scheduler")
