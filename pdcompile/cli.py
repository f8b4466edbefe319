"""The ``pdcompile`` command.

Subcommands live in ``pdcompile/_cli/<name>.py``; each exposes ``register(subparsers)``, which
adds its parser and sets ``func=run`` where ``run(args) -> int``.

Exit status: 0 success; 1 the job ran and failed (e.g. a training rank died); 2 bad input
(any :class:`pdcompile.errors.PdcompileError`: one line with the cause and the fix, no traceback
unless ``--debug``). A :class:`pdcompile.errors.PdcompileWarning` is one line on stderr.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
import warnings
from typing import Any

from pdcompile import _cli
from pdcompile.errors import PdcompileError, PdcompileWarning, UsageError

# Shown first in --help, in this order; any other module in _cli/ follows alphabetically.
_ORDER = ["demo", "check", "profile", "plan", "emit", "run", "simulate", "merge"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdcompile",
        description="PipeDream as a compiler: trace, profile, plan and emit pipeline-parallel training.",
        epilog="Examples:\n  pdcompile demo\n  pdcompile plan --profile pipedream:vgg16 --cluster paper:A\n"
        "  pdcompile plan --profile graph.txt --cluster cluster.toml\n"
        "\nExit status: 0 ok, 1 the job failed, 2 bad input.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    names = [m.name for m in pkgutil.iter_modules(_cli.__path__) if not m.name.startswith("_")]
    for name in sorted(names, key=lambda n: (_ORDER.index(n) if n in _ORDER else len(_ORDER), n)):
        importlib.import_module(f"pdcompile._cli.{name}").register(sub)
    return parser


def _show_warning(message: Any, category: type[Warning], *args: Any, **kwargs: Any) -> None:
    """A :class:`PdcompileWarning` as one line on stderr (any other warning as Python shows it)."""
    if issubclass(category, PdcompileWarning):
        print(f"pdcompile: warning: {message}", file=sys.stderr)
    else:
        warnings._showwarning_orig(message, category, *args, **kwargs)  # type: ignore[attr-defined]


def split_passthrough(argv: list[str]) -> tuple[list[str], list[str]]:
    """The command line before a bare ``--`` and the arguments after it, which ``pdcompile run``
    hands on to ``train.py`` as they are (any of its flags: docs/emitted-program.md)."""
    if "--" not in argv:
        return argv, []
    i = argv.index("--")
    return argv[:i], argv[i + 1:]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    with warnings.catch_warnings():
        warnings.showwarning = _show_warning
        return _main(argv)


def _main(argv: list[str]) -> int:
    debug = "--debug" in argv
    try:
        parser = build_parser()
        argv, passthrough = split_passthrough(argv)
        args = parser.parse_args(argv)
        if passthrough and not getattr(args, "takes_passthrough", False):
            raise UsageError(f"'-- {' '.join(passthrough)}': only `pdcompile run` passes arguments after '--' on "
                             f"(to train.py); remove them, or put flags of {args.command or 'the command'} before '--'")
        args.passthrough = passthrough
        if not getattr(args, "func", None):
            parser.print_help()
            return 2
        return int(args.func(args) or 0)
    except PdcompileError as e:
        if debug:
            raise
        print(f"pdcompile: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # output piped into `head` and closed early
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
