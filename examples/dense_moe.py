"""A mixture-of-experts decoder written densely, as research code and many small MoE
implementations write it: every expert runs on every token, its weights stacked
(experts, in, out) and applied by one einsum over all tokens, and a gate that is zero
outside each token's top-k experts combines their outputs
(``einsum("eth,te->th", out, gate)``). No token is dropped or moved: the routing
only weighs. The Llama of :mod:`autopar.examples.llama` with this feed-forward in
every block; nothing in it knows about parallelism."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from autopar.examples.llama import Block, Llama, LlamaConfig


@dataclass
class DenseMoEConfig(LlamaConfig):
    """Shape of a dense-dispatch mixture of experts: a Llama's, plus ``n_experts``
    experts of hidden size ``expert_ffn_dim``, each token weighed by its ``top_k``."""

    n_experts: int = 4
    top_k: int = 2
    expert_ffn_dim: int = 64


class DenseExperts(nn.Module):
    """E GELU experts with their weights stacked, run on every token and combined by a
    gate: w_in (E, dim, ffn), w_out (E, ffn, dim)."""

    def __init__(self, n: int, dim: int, ffn: int) -> None:
        super().__init__()
        self.w_in = nn.Parameter(torch.empty(n, dim, ffn))
        self.w_out = nn.Parameter(torch.empty(n, ffn, dim))
        for w, fan_in in ((self.w_in, dim), (self.w_out, ffn)):
            nn.init.normal_(w, 0.0, fan_in ** -0.5)

    def forward(self, tokens: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """tokens (T, dim), gate (T, E) -> (T, dim): each expert's output weighed by the
        token's gate and summed over the experts."""
        h = F.gelu(torch.einsum("th,ehf->etf", tokens, self.w_in))
        out = torch.einsum("etf,efh->eth", h, self.w_out)
        return torch.einsum("eth,te->th", out, gate)


class DenseMoE(nn.Module):
    """Softmax router, top-k renormalized into a gate over all experts (zero outside
    the top-k), then :class:`DenseExperts`."""

    def __init__(self, cfg: DenseMoEConfig) -> None:
        super().__init__()
        self.top_k = cfg.top_k
        self.router = nn.Linear(cfg.dim, cfg.n_experts, bias=False)
        self.experts = DenseExperts(cfg.n_experts, cfg.dim, cfg.expert_ffn_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (batch, seq, dim) -> the same shape."""
        b, s, d = x.shape
        tokens = x.reshape(b * s, d)
        scores = self.router(tokens).softmax(-1)
        weights, chosen = scores.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        gate = torch.zeros_like(scores).scatter(-1, chosen, weights)  # (T, E)
        return self.experts(tokens, gate).view(b, s, d)


class DenseMoETransformer(Llama):
    """Decoder-only language model returning logits (batch, seq, vocab): the Llama with a
    :class:`DenseMoE` feed-forward in every block."""

    def block(self, cfg: DenseMoEConfig, index: int) -> nn.Module:
        """Block ``index``: the Llama's, its feed-forward a :class:`DenseMoE`."""
        return Block(cfg, DenseMoE(cfg))
