"""A Llama-style decoder: RMSNorm, rotary position embedding, grouped-query attention,
SwiGLU feed-forward, untied output head. Written plainly; nothing in it knows about
parallelism."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class LlamaConfig:
    """Shape of a Llama model."""

    vocab_size: int = 32000
    max_seq_len: int = 2048
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 8
    ffn_dim: int = 14336
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0


def rope_tables(head_dim: int, seq_len: int, theta: float,
                device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosine and sine tables of shape (seq_len, head_dim // 2), made on ``device`` (made
    on the host and copied, they would stall the host at every forward until the device
    caught up: a pageable host-to-device copy waits for the device)."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    angles = torch.outer(torch.arange(seq_len, device=device).float(), freqs)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of channels of x (batch, seq, heads, head_dim) by position."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)


class Attention(nn.Module):
    """Grouped-query attention with rotary embeddings."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.head_dim = cfg.dim // cfg.n_heads
        self.n_rep = cfg.n_heads // cfg.n_kv_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = apply_rope(self.wq(x).view(b, t, -1, self.head_dim), cos, sin)
        k = apply_rope(self.wk(x).view(b, t, -1, self.head_dim), cos, sin)
        v = self.wv(x).view(b, t, -1, self.head_dim)
        k = k.unsqueeze(3).expand(-1, -1, -1, self.n_rep, -1).flatten(2, 3)
        v = v.unsqueeze(3).expand(-1, -1, -1, self.n_rep, -1).flatten(2, 3)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    """SwiGLU feed-forward network."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """Pre-norm Llama block (``ffn``: its feed-forward, by default the SwiGLU one)."""

    def __init__(self, cfg: LlamaConfig, ffn: nn.Module | None = None) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.ffn = ffn if ffn is not None else FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.ffn(self.ffn_norm(x))


class Llama(nn.Module):
    """Llama decoder returning logits of shape (batch, seq, vocab)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(self.block(cfg, i) for i in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def block(self, cfg: LlamaConfig, index: int) -> nn.Module:
        """Block ``index`` of the stack."""
        return Block(cfg)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        cos, sin = rope_tables(self.cfg.dim // self.cfg.n_heads, t, self.cfg.rope_theta,
                               idx.device)
        x = self.tok_emb(idx)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.output(self.norm(x))
