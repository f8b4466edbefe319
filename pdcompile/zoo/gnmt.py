"""GNMT: an LSTM encoder-decoder with attention (Wu et al., 2016), shaped like PipeDream's GNMT-8.

Encoder: embedding; a bidirectional LSTM; an LSTM from 2H to H; further LSTMs with residual adds.
Decoder: embedding; an LSTM whose output attends over the encoder outputs (dot-product attention:
matmul, softmax, matmul); further LSTMs fed ``cat([x, context])``, residual from the third on;
a Linear classifier over the vocabulary. Each ``nn.LSTM`` is one layer, kept whole by the tracer;
its output tuple is indexed with ``[0]``. No dropout (deterministic training), no initial states.

``full`` follows PipeDream's GNMT-8 profile: 4 encoder and 4 decoder layers, hidden 1024,
vocabulary 32320 (~192M parameters).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from pdcompile.zoo._common import Batch, Family, generator, randint
from pdcompile.zoo.losses import SequenceCrossEntropy


@dataclass(frozen=True)
class GNMTConfig:
    vocab_size: int
    hidden: int
    enc_layers: int  # >= 2: bidirectional, then 2H -> H, then residual H -> H
    dec_layers: int  # >= 2: attention LSTM, then cat([x, ctx]) -> H, residual from the third
    src_len: int
    tgt_len: int


CONFIGS = {
    "small": GNMTConfig(vocab_size=32, hidden=16, enc_layers=3, dec_layers=3, src_len=6, tgt_len=5),
    "full": GNMTConfig(vocab_size=32320, hidden=1024, enc_layers=4, dec_layers=4, src_len=50, tgt_len=50),
}


class Encoder(nn.Module):
    def __init__(self, cfg: GNMTConfig):
        super().__init__()
        h = cfg.hidden
        self.embedding = nn.Embedding(cfg.vocab_size, h)
        self.bidir = nn.LSTM(h, h, batch_first=True, bidirectional=True)
        self.layer1 = nn.LSTM(2 * h, h, batch_first=True)
        self.residual = nn.ModuleList(nn.LSTM(h, h, batch_first=True) for _ in range(cfg.enc_layers - 2))

    def forward(self, src: Tensor) -> Tensor:
        x = self.bidir(self.embedding(src))[0]
        x = self.layer1(x)[0]
        for lstm in self.residual:
            x = x + lstm(x)[0]
        return x


class Decoder(nn.Module):
    def __init__(self, cfg: GNMTConfig):
        super().__init__()
        h = cfg.hidden
        self.scale = 1.0 / math.sqrt(h)
        self.embedding = nn.Embedding(cfg.vocab_size, h)
        self.attn_rnn = nn.LSTM(h, h, batch_first=True)
        self.layer1 = nn.LSTM(2 * h, h, batch_first=True)
        self.residual = nn.ModuleList(nn.LSTM(2 * h, h, batch_first=True) for _ in range(cfg.dec_layers - 2))
        self.classifier = nn.Linear(h, cfg.vocab_size)

    def forward(self, tgt: Tensor, enc: Tensor) -> Tensor:
        y = self.attn_rnn(self.embedding(tgt))[0]  # (B, T, H)
        scores = torch.matmul(y, enc.transpose(1, 2)) * self.scale  # (B, T, S)
        ctx = torch.matmul(torch.softmax(scores, dim=-1), enc)  # (B, T, H)
        x = self.layer1(torch.cat([y, ctx], dim=2))[0]
        for lstm in self.residual:
            x = x + lstm(torch.cat([x, ctx], dim=2))[0]
        return self.classifier(x)


class GNMT(nn.Module):
    def __init__(self, cfg: GNMTConfig):
        super().__init__()
        assert cfg.enc_layers >= 2 and cfg.dec_layers >= 2, "GNMT needs at least 2 encoder and 2 decoder layers"
        self.encoder = Encoder(cfg)
        self.decoder = Decoder(cfg)

    def forward(self, src: Tensor, tgt: Tensor) -> Tensor:
        return self.decoder(tgt, self.encoder(src))


def make_batch(cfg: GNMTConfig, device: torch.device, seed: int, batch_size: int) -> Batch:
    """Random source sentences; the target sequence is fed shifted by one (teacher forcing)."""
    gen = generator(seed)
    src = randint(gen, cfg.vocab_size, (batch_size, cfg.src_len), device)
    tgt = randint(gen, cfg.vocab_size, (batch_size, cfg.tgt_len + 1), device)
    return (src, tgt[:, :-1].contiguous()), tgt[:, 1:].contiguous()


FAMILY = Family(
    configs=CONFIGS,
    build=GNMT,
    make_batch=make_batch,
    loss=SequenceCrossEntropy,
    leaf_modules=(nn.LSTM,),
)
