"""Models written the way their authors write them, not the way autopar's examples are.

``NanoGPT`` follows nanoGPT: one fused ``c_attn`` projection split into q, k, v, head
shapes read from the input (``B, T, C = x.size()``), positions made with
``torch.arange`` in the root's forward, and the output head tied to the token
embedding through ``F.linear`` in the root. ``TinyLlama`` follows the Llama reference
code: rotary tables computed in the root, grouped-query attention expanded with
``repeat_interleave``, SwiGLU, RMSNorm written out by hand. ``lm_loss`` is the loss
most training scripts write. ``fused_qkv_gpt`` is autopar's example GPT with each
block's separate q, k and v projections written as one fused ``nn.Linear`` split in
three (the same math; Hugging Face's ``GPT2LMHeadModel`` writes it a third way, with a
``Conv1D``). Three writings of a GPT's initialization, for the emitted program's build
(tests/test_codegen_init.py): ``init_in_init`` draws its weights in ``__init__`` and
makes its batch on a device (code that cannot run under ``torch.device("meta")``),
``seeded_nano`` is nanoGPT's ``_init_weights`` behind a factory that seeds itself, and
``example_gpt`` is autopar's GPT, initialized by ``reset_parameters()`` alone.
"""

from __future__ import annotations

import math

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from autopar.examples.gpt import GPTConfig


class FusedQKVAttention(nn.Module):
    """Causal self-attention with one fused q/k/v projection split in three, as
    nanoGPT, GPT-NeoX and Megatron-LM write it; the math of
    :class:`autopar.examples.gpt.Attention`."""

    def __init__(self, dim: int, n_heads: int, bias: bool = True) -> None:
        super().__init__()
        self.dim, self.head_dim = dim, dim // n_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=bias)
        self.proj = nn.Linear(dim, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).split(self.dim, dim=-1)
        q = q.view(b, t, -1, self.head_dim).transpose(1, 2)
        k = k.view(b, t, -1, self.head_dim).transpose(1, 2)
        v = v.view(b, t, -1, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


def fused_qkv_gpt(cfg: "GPTConfig") -> nn.Module:
    """autopar's example GPT of ``cfg`` with every block's attention written with a
    fused q/k/v projection (:class:`FusedQKVAttention`)."""
    from autopar.examples.gpt import GPT

    model = GPT(cfg)
    for block in model.blocks:
        block.attn = FusedQKVAttention(cfg.dim, cfg.n_heads, cfg.bias)
    return model


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy as training scripts write it, in fp32."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))


def lm_sum_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy summed over the tokens (``reduction="sum"``)."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1),
                           reduction="sum")


class CausalSelfAttention(nn.Module):
    """nanoGPT's attention: fused qkv, head shapes read from the input."""

    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head = n_head
        self.n_embd = n_embd

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    """nanoGPT's MLP."""

    def __init__(self, n_embd: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.c_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """nanoGPT with its tied head applied functionally in the root."""

    def __init__(self, vocab_size: int = 128, block_size: int = 16, n_layer: int = 2,
                 n_head: int = 4, n_embd: int = 32) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList([Block(n_embd, n_head) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return F.linear(self.ln_f(x), self.wte.weight)


class RMSNorm(nn.Module):
    """RMSNorm written out, as the Llama reference code does."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        out = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return out.type_as(x) * self.weight


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Rotate the two halves of the last dim (Hugging Face's rotary convention)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class LlamaAttention(nn.Module):
    """Grouped-query attention with ``repeat_interleave`` of the key/value heads."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        q = self.wq(x).view(bsz, seqlen, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        rep = self.n_heads // self.n_kv_heads
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        mask = torch.full((seqlen, seqlen), float("-inf"), device=x.device).triu(1)
        attn = F.softmax(scores + mask, dim=-1)
        out = (attn @ v).transpose(1, 2).reshape(bsz, seqlen, -1)
        return self.wo(out)


class FeedForward(nn.Module):
    """SwiGLU feed-forward."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Llama block."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, hidden: int) -> None:
        super().__init__()
        self.attention = LlamaAttention(dim, n_heads, n_kv_heads)
        self.feed_forward = FeedForward(dim, hidden)
        self.attention_norm = RMSNorm(dim)
        self.ffn_norm = RMSNorm(dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class TinyLlama(nn.Module):
    """A Llama written after the reference code: rotary tables made in the root."""

    def __init__(self, vocab_size: int = 128, dim: int = 32, n_layers: int = 2,
                 n_heads: int = 4, n_kv_heads: int = 2, hidden: int = 64) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleList([TransformerBlock(dim, n_heads, n_kv_heads, hidden)
                                     for _ in range(n_layers)])
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab_size, bias=False)
        self.head_dim = dim // n_heads

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seqlen = tokens.shape[1]
        inv = 1.0 / (10000.0 ** (torch.arange(0, self.head_dim, 2, device=tokens.device).float()
                                 / self.head_dim))
        freqs = torch.outer(torch.arange(seqlen, device=tokens.device).float(), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))


BATCH, SEQ, VOCAB = 8, 16, 128


def example_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """One global batch of token ids and next-token targets."""
    g = torch.Generator().manual_seed(1)
    return (torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
            torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))


def nano_gpt() -> tuple[nn.Module, tuple[torch.Tensor], torch.Tensor]:
    """Factory for ``autopar plan/codegen file.py:nano_gpt``: the model and a batch."""
    x, y = example_batch()
    return NanoGPT(vocab_size=VOCAB, block_size=SEQ), (x,), y


def tiny_llama() -> tuple[nn.Module, tuple[torch.Tensor], torch.Tensor]:
    """Factory for ``autopar plan/codegen file.py:tiny_llama``: the model and a batch."""
    x, y = example_batch()
    return TinyLlama(vocab_size=VOCAB), (x,), y


DIM, LAYERS, HEADS = 32, 2, 4


class InitInInitGPT(NanoGPT):
    """NanoGPT whose ``__init__`` sets its own initialization, with no method for it:
    embeddings N(0, 0.02), every Linear N(0, 0.02) with zero bias."""

    def __init__(self) -> None:
        super().__init__(VOCAB, SEQ, LAYERS, HEADS, DIM)
        nn.init.normal_(self.wte.weight, std=0.02)
        nn.init.normal_(self.wpe.weight, std=0.02)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)
                nn.init.zeros_(m.bias)


class SeededNanoGPT(NanoGPT):
    """NanoGPT with nanoGPT's initialization: ``self.apply(self._init_weights)``, then
    every ``c_proj`` weight N(0, 0.02 / sqrt(2 · layers))."""

    def __init__(self) -> None:
        super().__init__(VOCAB, SEQ, LAYERS, HEADS, DIM)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * LAYERS))

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)


def init_in_init() -> tuple[nn.Module, tuple[torch.Tensor], torch.Tensor]:
    """:class:`InitInInitGPT` and a batch drawn on a CPU generator and moved to the
    device a script trains on (here the CPU)."""
    device = "cpu"
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (8, SEQ), generator=g).to(device)
    y = torch.randint(0, VOCAB, (8, SEQ), generator=g).to(device)
    return InitInInitGPT().to(device), (x,), y


def seeded_nano() -> tuple[nn.Module, tuple[torch.Tensor], torch.Tensor]:
    """:class:`SeededNanoGPT`, built after the factory's own ``torch.manual_seed(1234)``."""
    torch.manual_seed(1234)
    x, y = example_batch()
    return SeededNanoGPT(), (x,), y


def example_gpt() -> tuple[nn.Module, tuple[torch.Tensor], torch.Tensor]:
    """autopar's example GPT (dim 32, 2 layers), initialized by ``reset_parameters()``."""
    from autopar.examples.gpt import GPT, GPTConfig

    x, y = example_batch()
    return GPT(GPTConfig(vocab_size=VOCAB, max_seq_len=SEQ, dim=DIM, n_layers=LAYERS,
                         n_heads=HEADS)), (x,), y


class FusedAttention(nn.Module):
    """Grouped-query attention with q, k and v from one projection (as Megatron-LM and
    GPT-NeoX store them), cut apart by head counts, the key/value heads repeated with
    ``repeat_interleave``; the math of autopar.examples.llama's attention."""

    def __init__(self, cfg: "LlamaConfig") -> None:
        super().__init__()
        self.head_dim = cfg.dim // cfg.n_heads
        self.heads = (cfg.n_heads, cfg.n_kv_heads, cfg.n_kv_heads)
        self.wqkv = nn.Linear(cfg.dim, sum(self.heads) * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        from autopar.examples.llama import apply_rope

        b, t, _ = x.shape
        q, k, v = self.wqkv(x).view(b, t, -1, self.head_dim).split(self.heads, dim=2)
        rep = self.heads[0] // self.heads[1]
        q = apply_rope(q, cos, sin).transpose(1, 2)
        k = apply_rope(k, cos, sin).repeat_interleave(rep, dim=2).transpose(1, 2)
        v = v.repeat_interleave(rep, dim=2).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).flatten(2))


class FusedFeedForward(nn.Module):
    """SwiGLU with the gate and up projections in one matrix, halved by ``chunk``."""

    def __init__(self, cfg: "LlamaConfig") -> None:
        super().__init__()
        self.w13 = nn.Linear(cfg.dim, 2 * cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


def fused_llama(cfg: "LlamaConfig") -> nn.Module:
    """autopar.examples.llama's Llama with fused q/k/v and gate/up projections."""
    from autopar.examples.llama import Llama

    model = Llama(cfg)
    for block in model.layers:
        block.attn, block.ffn = FusedAttention(cfg), FusedFeedForward(cfg)
    return model
