"""GPT: a decoder-only transformer with tied input/output embeddings (Radford et al., 2019).

Pre-LN blocks; causal self-attention written with plain tensor ops (matmul, masked_fill, softmax)
so the tracer sees every step. No value is computed from an input's shape: heads are split with
``view(-1, T, H, head_dim)`` using config constants, the causal mask is a registered (T, T) buffer,
and position ids are a registered ``arange(T)`` buffer. Inputs must therefore be exactly T tokens.

``full`` is GPT-2 small: 12 layers, 12 heads, d=768, T=1024, vocabulary 50257 (~124M parameters).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from pdcompile.zoo._common import Batch, Family, generator, randint
from pdcompile.zoo.losses import SequenceCrossEntropy


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    seq_len: int
    d_model: int
    n_heads: int
    n_layers: int

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


CONFIGS = {
    "small": GPTConfig(vocab_size=64, seq_len=8, d_model=32, n_heads=2, n_layers=2),
    "full": GPTConfig(vocab_size=50257, seq_len=1024, d_model=768, n_heads=12, n_layers=12),
}


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        assert cfg.d_model % cfg.n_heads == 0, "d_model must be a multiple of n_heads"
        self.seq_len, self.n_heads, self.head_dim, self.d_model = (
            cfg.seq_len,
            cfg.n_heads,
            cfg.head_dim,
            cfg.d_model,
        )
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        self.c_attn = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.c_proj = nn.Linear(cfg.d_model, cfg.d_model)
        # True above the diagonal: position i may not attend to j > i.
        mask = torch.triu(torch.ones(cfg.seq_len, cfg.seq_len, dtype=torch.bool), diagonal=1)
        self.register_buffer("causal_mask", mask)

    def _heads(self, x: Tensor) -> Tensor:  # (B, T, d) -> (B, H, T, hd)
        return x.view(-1, self.seq_len, self.n_heads, self.head_dim).transpose(1, 2)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.c_attn(x).split(self.d_model, dim=2)
        q, k, v = self._heads(q), self._heads(k), self._heads(v)
        att = torch.matmul(q, k.transpose(-2, -1)) * self.scale
        att = att.masked_fill(self.get_buffer("causal_mask"), float("-inf"))
        att = torch.softmax(att, dim=-1)
        y = torch.matmul(att, v).transpose(1, 2).reshape(-1, self.seq_len, self.d_model)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: Tensor) -> Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.register_buffer("pos", torch.arange(cfg.seq_len))
        self.h = nn.Sequential(*[Block(cfg) for _ in range(cfg.n_layers)])
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.apply(self._init_weights)
        self.lm_head.weight = self.wte.weight  # tied: one Parameter used by two layers

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        # GPT-2's initialisation: N(0, 0.02) weights, zero biases.
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: Tensor) -> Tensor:
        x = self.wte(idx) + self.wpe(self.pos)
        x = self.ln_f(self.h(x))
        return self.lm_head(x)


def make_batch(cfg: GPTConfig, device: torch.device, seed: int, batch_size: int) -> Batch:
    """Random token streams of T+1 tokens: the first T are the input, the last T the target."""
    tokens = randint(generator(seed), cfg.vocab_size, (batch_size, cfg.seq_len + 1), device)
    return (tokens[:, :-1].contiguous(),), tokens[:, 1:].contiguous()


FAMILY = Family(configs=CONFIGS, build=GPT, make_batch=make_batch, loss=SequenceCrossEntropy)
