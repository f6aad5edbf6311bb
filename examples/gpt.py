"""A GPT in the style of GPT-2 / Megatron-LM: learned positions, pre-norm blocks, GeLU
MLP of 4h, tied output embedding. Written plainly, as users write models: nothing in it
knows about parallelism."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class GPTConfig:
    """Shape of a GPT model."""

    vocab_size: int = 50304
    max_seq_len: int = 1024
    dim: int = 768
    n_layers: int = 12
    n_heads: int = 12
    ffn_mult: int = 4
    tie_embeddings: bool = True
    bias: bool = True


class Attention(nn.Module):
    """Causal multi-head self-attention with separate q, k, v projections."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.head_dim = cfg.dim // cfg.n_heads
        self.q = nn.Linear(cfg.dim, cfg.dim, bias=cfg.bias)
        self.k = nn.Linear(cfg.dim, cfg.dim, bias=cfg.bias)
        self.v = nn.Linear(cfg.dim, cfg.dim, bias=cfg.bias)
        self.proj = nn.Linear(cfg.dim, cfg.dim, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    """Two-layer GeLU feed-forward network."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.dim, cfg.ffn_mult * cfg.dim, bias=cfg.bias)
        self.fc2 = nn.Linear(cfg.ffn_mult * cfg.dim, cfg.dim, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Decoder-only language model returning logits of shape (batch, seq, vocab)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.tok_emb.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2's embedding initialization (std 0.02) over nn.Embedding's N(0, 1), which
        through a tied head would give huge first logits. A meta model laid out by
        autopar runs it after its submodules' own (:mod:`autopar.runtime.materialize`)."""
        with torch.no_grad():
            self.tok_emb.weight.normal_(0.0, 0.02)
            self.pos_emb.weight.normal_(0.0, 0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))
