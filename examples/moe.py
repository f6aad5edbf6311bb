"""A mixture-of-experts decoder: the Llama of :mod:`autopar.examples.llama` with its
feed-forward replaced, in some or all blocks, by routed experts — top-k of E, each
expert a SwiGLU network, the experts' weights stacked (E, in, out) — and optionally
shared experts every token goes through (DeepSeek-MoE, Dai et al. 2024).

Tokens are routed as GShard and Switch Transformer define it (Lepikhin et al. 2020,
Fedus et al. 2021): each sequence is a group with a capacity of
``ceil(capacity_factor · k · seq_len / E)`` tokens per expert, filled in token order;
a token past its expert's capacity is dropped (its output from that expert is zero).
Dispatch scatters each (token, choice) into its expert's slot of a (experts, capacity)
buffer and combine gathers it back, so every shape is static and nothing of size
tokens x experts x capacity is kept for backward. Written plainly; nothing in it knows
about parallelism."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from autopar.examples.llama import Block, FeedForward, Llama, LlamaConfig


@dataclass
class MoEConfig(LlamaConfig):
    """Shape of a mixture-of-experts model: a Llama's, plus its experts.

    ``expert_ffn_dim`` is each routed expert's hidden size; ``n_shared_experts``
    shared experts of that size run on every token; the first ``n_dense_layers``
    blocks keep the dense ``ffn_dim`` feed-forward. ``score`` is how router logits
    become weights: "softmax" over all experts then top-k renormalized (Mixtral),
    or "sigmoid" then top-k normalized (DeepSeek-V3)."""

    n_experts: int = 8
    top_k: int = 2
    expert_ffn_dim: int = 14336
    n_shared_experts: int = 0
    n_dense_layers: int = 0
    capacity_factor: float = 1.25
    score: str = "softmax"


class Experts(nn.Module):
    """E SwiGLU experts with their weights stacked: w1, w3 (E, dim, ffn), w2 (E, ffn, dim)."""

    def __init__(self, n: int, dim: int, ffn: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n, dim, ffn))
        self.w3 = nn.Parameter(torch.empty(n, dim, ffn))
        self.w2 = nn.Parameter(torch.empty(n, ffn, dim))
        for w, fan_in in ((self.w1, dim), (self.w3, dim), (self.w2, ffn)):
            nn.init.normal_(w, 0.0, fan_in ** -0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (batch, experts, capacity, dim) -> the same shape."""
        h = F.silu(torch.einsum("becd,edf->becf", x, self.w1)) * \
            torch.einsum("becd,edf->becf", x, self.w3)
        return torch.einsum("becf,efd->becd", h, self.w2)


class MoE(nn.Module):
    """Top-k routing to capacity-limited experts, plus the shared experts."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.router = nn.Linear(cfg.dim, cfg.n_experts, bias=False)
        self.experts = Experts(cfg.n_experts, cfg.dim, cfg.expert_ffn_dim)
        self.shared = None
        if cfg.n_shared_experts:
            shared = LlamaConfig(dim=cfg.dim, ffn_dim=cfg.n_shared_experts * cfg.expert_ffn_dim)
            self.shared = FeedForward(shared)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        b, t, d = x.shape
        e, k = cfg.n_experts, cfg.top_k
        capacity = math.ceil(cfg.capacity_factor * k * t / e)
        logits = self.router(x).float()
        scores = logits.softmax(-1) if cfg.score == "softmax" else logits.sigmoid()
        weights, chosen = scores.topk(k, dim=-1)                      # (b, t, k)
        weights = weights / weights.sum(-1, keepdim=True)
        picks = F.one_hot(chosen, e).flatten(1, 2)                     # (b, t·k, e)
        slot = ((picks.cumsum(1) - 1) * picks).sum(-1)                 # place in its buffer
        spare = e * capacity                                           # where dropped go
        where = torch.where(slot < capacity, chosen.flatten(1) * capacity + slot, spare)
        where = where.unsqueeze(-1).expand(b, t * k, d)                # (b, t·k, d)
        rows = x.unsqueeze(2).expand(b, t, k, d).flatten(1, 2)         # each token k times
        slots = x.new_zeros(b, spare + 1, d).scatter(1, where, rows)
        y = self.experts(slots[:, :spare].view(b, e, capacity, d))    # (b, e, c, d)
        y = torch.cat([y.flatten(1, 2), y.new_zeros(b, 1, d)], 1)      # the spare reads 0
        out = y.gather(1, where).view(b, t, k, d)
        out = (out * weights.to(x.dtype).unsqueeze(-1)).sum(2)
        return out if self.shared is None else out + self.shared(x)


class MoETransformer(Llama):
    """Decoder-only mixture-of-experts language model returning logits (batch, seq, vocab):
    the Llama with an MoE in every block past the first ``n_dense_layers``."""

    def block(self, cfg: MoEConfig, index: int) -> nn.Module:
        """Block ``index``: the Llama's, its feed-forward an MoE unless it is dense."""
        return Block(cfg, None if index < cfg.n_dense_layers else MoE(cfg))
