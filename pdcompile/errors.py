"""Our exception and warning types: each names the cause and the fix.

The CLI turns any :class:`PdcompileError` into one line on stderr and exit status 2
(a traceback only with ``--debug``), and any :class:`PdcompileWarning` into one line on stderr.
"""

from __future__ import annotations


class PdcompileError(Exception):
    """Base class of every error pdcompile raises on purpose (bad input, infeasible request)."""


class UnsupportedModelError(PdcompileError):
    """The model can't be traced or split; the message lists every offending construct."""


class ClusterSpecError(PdcompileError):
    """A cluster description is invalid (names the key and, from TOML, the line)."""


class ProfileError(PdcompileError):
    """A profile file is malformed (names the file and line)."""


class InfeasiblePlanError(PdcompileError):
    """No plan satisfies the constraints (e.g. memory); says what would fit."""


class ScheduleError(PdcompileError):
    """A schedule breaks a rule (names the rule, rank and step; validate's errors also carry them
    as ``rule``, ``rank`` and ``step``, the index in that rank's action list)."""

    rule: str | None = None
    rank: int | None = None
    step: int | None = None


class CheckpointError(PdcompileError):
    """A checkpoint is incomplete, corrupt or belongs to another plan."""


class PassError(PdcompileError):
    """A compiler pass failed; names the pass and the passes before it."""


class UsageError(PdcompileError):
    """Arguments given to the API or CLI are invalid."""


class PdcompileWarning(UserWarning):
    """Base class of pdcompile's warnings: it worked, less well than it could; one line naming the
    cause and the fix (the CLI prints it as ``pdcompile: warning: ...`` on stderr)."""


class UncalibratedWarning(PdcompileWarning):
    """``schedule="auto"`` chose the microbatch count without this runtime's measured per-action cost
    (``python -m pdcompile.calibrate`` measures it)."""
