"""The operators ``gpu_measure.py`` times: one Llama-3 8B layer, one GPT-2 small layer,
and the embedding / output head / cross-entropy, built from ``autopar.examples`` modules
in bf16 so the kernels are those the example models run.

Shapes: Llama 3 8B (hidden 4096, 32 heads, 8 KV heads, FFN 14336, rope theta 500000;
Meta's Llama 3 release config) at sequence 8192, micro-batch 1; GPT-2 small (hidden
768, 12 heads, FFN 3072; Radford et al. 2019) at sequence 1024, batch 8.
The rotary tables are cast to bf16 here: the example keeps them in fp32, which promotes
q and k to fp32 outside autocast, and the measured op is the bf16 rotation itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from autopar.cost_models.profiling.compute_bound import attention_flops
from autopar.examples import gpt, llama

BF16 = torch.bfloat16


@dataclass(frozen=True)
class Op:
    """One operator to time: ``fn(*inputs)``, with ``params`` the weights ``fn`` uses,
    ``count`` occurrences per layer (0: shown for reference, not summed) and its FLOPs
    (None when memory-bound)."""

    name: str
    fn: Callable[..., torch.Tensor]
    inputs: tuple[torch.Tensor, ...]
    params: tuple[torch.Tensor, ...] = ()
    flops_fwd: float | None = None
    flops_bwd: float | None = None
    count: int = 1
    note: str = ""


def linear_op(name: str, mod: nn.Linear, x: torch.Tensor, count: int = 1,
              note: str = "") -> Op:
    """A Linear layer: 2·tokens·in·out FLOPs forward, twice that backward (dX and dW)."""
    tokens = x.numel() // x.shape[-1]
    f = 2.0 * tokens * mod.in_features * mod.out_features
    return Op(name, mod, (x,), tuple(mod.parameters()), f, 2 * f, count, note)


def sdpa_op(b: int, s: int, heads: int, hd: int, device: torch.device) -> Op:
    """Causal SDPA on q, k, v of shape (b, s, heads, hd) transposed to (b, heads, s, hd),
    as the example models pass them (k and v already expanded to all heads)."""

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                              v.transpose(1, 2), is_causal=True)

    qkv = tuple(torch.randn(b, s, heads, hd, device=device, dtype=BF16) for _ in range(3))
    return Op("sdpa", fn, qkv, (), attention_flops(b, heads, s, hd, False),
              attention_flops(b, heads, s, hd, True))


def _rand(*shape: int, device: torch.device) -> torch.Tensor:
    return torch.randn(*shape, device=device, dtype=BF16)


def llama_layer_ops(device: torch.device, tiny: bool) -> tuple[dict, list[Op], nn.Module,
                                                               tuple[torch.Tensor, ...]]:
    """(config, ops, block, block args) of one Llama-3 8B layer."""
    dim, heads, kv, ffn, seq = (64, 4, 2, 128, 32) if tiny else (4096, 32, 8, 14336, 8192)
    b, hd, rep = 1, dim // heads, heads // kv
    cfg = llama.LlamaConfig(vocab_size=128256, max_seq_len=seq, dim=dim, n_layers=1,
                            n_heads=heads, n_kv_heads=kv, ffn_dim=ffn)
    with torch.device(device):
        block = llama.Block(cfg).to(BF16)
    cos, sin = (t.to(device, BF16) for t in llama.rope_tables(hd, seq, cfg.rope_theta))
    x = _rand(b, seq, dim, device=device)
    a, f = block.attn, block.ffn

    def rope(t: torch.Tensor) -> torch.Tensor:
        return llama.apply_rope(t, cos, sin)

    def expand(t: torch.Tensor) -> torch.Tensor:
        return t.unsqueeze(3).expand(-1, -1, -1, rep, -1).flatten(2, 3)

    def silu_mul(u: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.silu(u) * w

    ops = [
        Op("attn_norm (RMSNorm)", block.attn_norm, (x,), tuple(block.attn_norm.parameters())),
        linear_op("wq", a.wq, x), linear_op("wk", a.wk, x), linear_op("wv", a.wv, x),
        Op("rope_q", rope, (_rand(b, seq, heads, hd, device=device),)),
        Op("rope_k", rope, (_rand(b, seq, kv, hd, device=device),)),
        Op("kv_expand (repeat k, v to all heads)", expand,
           (_rand(b, seq, kv, hd, device=device),), count=2),
        sdpa_op(b, seq, heads, hd, device),
        linear_op("wo", a.wo, _rand(b, seq, heads * hd, device=device)),
        Op("residual_add", torch.add, (x, _rand(b, seq, dim, device=device)), count=2),
        Op("ffn_norm (RMSNorm)", block.ffn_norm, (x,), tuple(block.ffn_norm.parameters())),
        linear_op("w1", f.w1, x), linear_op("w3", f.w3, x),
        Op("silu_mul", silu_mul, (_rand(b, seq, ffn, device=device),
                                  _rand(b, seq, ffn, device=device))),
        linear_op("w2", f.w2, _rand(b, seq, ffn, device=device)),
    ]
    meta = {"model": "Llama 3 8B layer", "hidden": dim, "heads": heads, "kv_heads": kv,
            "head_dim": hd, "ffn": ffn, "seq": seq, "batch": b, "dtype": "bf16"}
    return meta, ops, block, (x, cos, sin)


def gpt2_layer_ops(device: torch.device, tiny: bool) -> tuple[dict, list[Op], nn.Module,
                                                              tuple[torch.Tensor, ...]]:
    """(config, ops, block, block args) of one GPT-2 small layer."""
    dim, heads, seq, b = (64, 4, 32, 2) if tiny else (768, 12, 1024, 8)
    hd = dim // heads
    cfg = gpt.GPTConfig(vocab_size=50257, max_seq_len=seq, dim=dim, n_layers=1, n_heads=heads)
    with torch.device(device):
        block = gpt.Block(cfg).to(BF16)
        qkv = nn.Linear(dim, 3 * dim).to(BF16)
    x = _rand(b, seq, dim, device=device)
    h4 = _rand(b, seq, 4 * dim, device=device)
    ops = [
        Op("layer_norm", block.ln1, (x,), tuple(block.ln1.parameters()), count=2),
        linear_op("q / k / v (each)", block.attn.q, x, count=3,
                  note="the example projects q, k, v separately"),
        linear_op("qkv (fused)", qkv, x, count=0, note="reference: one fused projection"),
        sdpa_op(b, seq, heads, hd, device),
        linear_op("proj", block.attn.proj, _rand(b, seq, dim, device=device)),
        Op("residual_add", torch.add, (x, _rand(b, seq, dim, device=device)), count=2),
        linear_op("fc1", block.mlp.fc1, x),
        Op("gelu", F.gelu, (h4,)),
        linear_op("fc2", block.mlp.fc2, h4),
    ]
    meta = {"model": "GPT-2 small layer", "hidden": dim, "heads": heads, "head_dim": hd,
            "ffn": 4 * dim, "seq": seq, "batch": b, "dtype": "bf16"}
    return meta, ops, block, (x,)


def head_ops(device: torch.device, tiny: bool) -> list[Op]:
    """Token embedding, output head and cross-entropy (bf16 logits, and upcast to fp32
    first as torchtitan does) at 8192 tokens for each vocabulary."""
    tokens = 64 if tiny else 8192
    models = ((1000, 64, "llama3"),) if tiny else \
        ((128256, 4096, "llama3"), (50257, 768, "gpt2"), (50304, 768, "gpt2-padded"))
    ops = []
    for vocab, dim, tag in models:
        with torch.device(device):
            emb = nn.Embedding(vocab, dim).to(BF16)
            head = nn.Linear(dim, vocab, bias=False).to(BF16)
        ids = torch.randint(0, vocab, (tokens,), device=device)
        logits = _rand(tokens, vocab, device=device)

        def ce_bf16(lg: torch.Tensor, ids: torch.Tensor = ids) -> torch.Tensor:
            return F.cross_entropy(lg, ids)

        def ce_fp32(lg: torch.Tensor, ids: torch.Tensor = ids) -> torch.Tensor:
            return F.cross_entropy(lg.float(), ids)

        note = f"vocab {vocab}, hidden {dim}, {tokens} tokens"
        ops += [Op(f"{tag} embedding", emb, (ids,), (emb.weight,), note=note),
                linear_op(f"{tag} output head", head, _rand(tokens, dim, device=device),
                          note=note),
                Op(f"{tag} cross_entropy bf16", ce_bf16, (logits,), note=note),
                Op(f"{tag} cross_entropy fp32 upcast", ce_fp32, (logits,), note=note)]
    return ops
