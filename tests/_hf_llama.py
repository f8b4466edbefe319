"""A small Hugging Face Llama and what the tests that train one through a pipeline share (test_init_from,
test_merge_hf): its config, seeded token batches, and the model as the pipeline trains it (its logits)."""

from __future__ import annotations

from typing import Any

import torch


def llama_config(vocab: int, **kw: Any) -> Any:
    """transformers' ``LlamaConfig`` of a 2-layer Llama of width 32 (``kw`` overrides any field)."""
    import transformers

    fields: dict[str, Any] = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
                                  use_cache=False)
    return transformers.LlamaConfig(**{**fields, **kw})


def token_batches(vocab: int, steps: int, batch: int, seq: int) -> list[tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
    """``steps`` minibatches ``((tokens,), target)``, seeded per step (tokens avoid id 0)."""
    out = []
    for i in range(steps):
        g = torch.Generator().manual_seed(100 + i)
        out.append(((torch.randint(1, vocab, (batch, seq), generator=g),),
                    torch.randint(0, vocab, (batch, seq), generator=g)))
    return out


class Logits(torch.nn.Module):
    """The model as the pipeline trains it: its logits."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x).logits
