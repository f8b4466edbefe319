"""pdcompile: PipeDream as a compiler — trace, profile, plan and emit pipeline-parallel training.

    from pdcompile import pdcompile, ClusterSpec
    pipe = pdcompile(model, ClusterSpec.from_toml("cluster.toml"), example_inputs=(x,),
                     example_target=y, loss_fn=torch.nn.CrossEntropyLoss())

Names are imported lazily, so the plain-data modules (profile, plan, cluster, schedules,
simulate) stay importable without torch.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["pdcompile", "ClusterSpec", "CompiledPipeline", "RunResult", "Plan", "__version__"]

_LAZY = {
    "pdcompile": ("pdcompile.api", "pdcompile"),
    "CompiledPipeline": ("pdcompile.api", "CompiledPipeline"),
    "RunResult": ("pdcompile.run_result", "RunResult"),
    "ClusterSpec": ("pdcompile.cluster", "ClusterSpec"),
    "Plan": ("pdcompile.plan", "Plan"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'pdcompile' has no attribute {name!r}")
