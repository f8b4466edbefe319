"""``RunResult``: what ``CompiledPipeline.run`` leaves (``RUN/program``, ``RUN/final``, ``RUN/metrics``), and the
one step back to the user's world: the trained weights under the model's own names as a state dict, a
``.pt`` file (:meth:`RunResult.save`) or a Hugging Face folder (:meth:`RunResult.save_pretrained`), written
by :mod:`pdcompile.merge`, as ``pdcompile merge RUN/final`` writes them."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


def aliases(model: torch.nn.Module) -> dict[str, str]:
    """state_dict key -> the canonical name of the same tensor (tied parameters share one)."""
    canonical = {id(t): n for n, t in model.named_parameters()}
    canonical.update({id(t): n for n, t in model.named_buffers()})
    return {k: canonical.get(id(v), k) for k, v in model.state_dict(keep_vars=True).items()}


@dataclass(frozen=True)
class RunResult:
    """What ``CompiledPipeline.run`` leaves: the folder, metrics, and the trained weights."""

    folder: Path
    program: Path
    aliases: dict[str, str]

    @property
    def metrics(self) -> dict[str, Any]:
        """Loss per microbatch (last stage, every replica's), per-rank step times, wall time, and each
        evaluation's results (``eval``: step, loss, metric; the last stage's first replica reports them)."""
        from pdcompile.runtime.logs import last_stage_losses

        ranks = [json.loads(p.read_text()) for p in sorted((self.folder / "metrics").glob("rank_*.json"))]
        final = max(s for r in ranks for s in r["stages"])  # a rank's first stage is not the last in a V
        last = min((r for r in ranks if final in r["stages"]), key=lambda r: r["rank"])
        return {"losses": last_stage_losses(ranks), "step_times_s": {r["rank"]: r["step_times_s"] for r in ranks},
                "wall_s": max(r["wall_s"] for r in ranks), "ranks": ranks, "eval": last.get("eval", [])}

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The trained weights under the original model's names: ``model.load_state_dict(...)``."""
        from pdcompile.merge import merge_weights

        merged = merge_weights(self.program, self.folder / "final")
        return {k: merged[c] for k, c in self.aliases.items() if c in merged}

    def save(self, out: str | os.PathLike[str], *, safetensors: bool = True) -> list[Path]:
        """The trained weights as one ``torch.save``'d state dict ``out`` (a ``.pt`` file) and, with
        ``safetensors``, ``out`` as ``.safetensors`` beside it: what ``pdcompile merge RUN/final -o out``
        writes (a tied parameter once). Returns the files written."""
        from pdcompile import merge
        from pdcompile.errors import UsageError

        if Path(out).suffix != ".pt":
            raise UsageError(f"save({str(out)!r}): give a file ending in .pt; for a Hugging Face folder use "
                             f"save_pretrained(folder, like=hf_folder)")
        return merge.save_file(merge.save_final_source(self.program, self.folder / "final"), out, safetensors).files

    def save_pretrained(self, out: str | os.PathLike[str], *, like: str | os.PathLike[str] | None = None,
                        max_shard_size: int | str = "5GB") -> list[Path]:
        """The trained weights as a Hugging Face folder ``out`` (``model.safetensors``, or shards above
        ``max_shard_size`` with their index); ``like``: the Hugging Face folder the model came from (its
        config and tokenizer files are copied, and the tensors its model saves written), so
        ``from_pretrained(out)`` loads the trained model. What ``pdcompile merge RUN/final -o out --like``
        writes. Returns the files written."""
        from pdcompile import merge

        source = merge.save_final_source(self.program, self.folder / "final")
        done = merge.save_folder(source, out, max_shard_size, like)
        return done.files + done.copied
