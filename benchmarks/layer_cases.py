"""Full-size transformer layers at the shard shapes their plans run, for measuring the
cost model where it prices (``gpu_layers.py`` on a GPU, ``layer_accuracy.py`` on a CPU).

A tensor-parallel rank of a Megatron-style layer (Shoeybi et al. 2019) computes the
whole hidden size ``h`` on its tokens, but only ``heads / tp`` attention heads and
``ffn / tp`` feed-forward columns. :class:`ShardLlamaLayer` and :class:`ShardGPTLayer`
are that rank's computation written out as plain layers (no communication), so one GPU
can run it and the planner can price it as a one-device model. The configurations:

- Llama 3 8B: h 4096, 32 heads, 8 KV heads, FFN 14336, SwiGLU, RMSNorm, rotary
  (Meta's Llama 3 release config);
- Llama 3 70B: h 8192, 64 heads, 8 KV heads, FFN 28672 (same source);
- GPT-3 175B: h 12288, 96 heads of 128, FFN 4h, GELU, LayerNorm, biases (Brown et al.
  2020, Table 2.1), with a fused qkv projection as Megatron-LM writes it.

A case stacks ``layers`` such layers into :class:`LayerSlice`, whose input is the
hidden state (micro-batch, sequence, h) and whose loss is a mean-squared error against
a target of the same shape, so that the measured forward+backward is the layers' own.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Arch:
    """One model's layer shape (module docstring)."""

    name: str
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    style: str  # "llama" or "gpt"


ARCHS: dict[str, Arch] = {
    "llama3-8b": Arch("llama3-8b", 4096, 32, 8, 14336, "llama"),
    "llama3-70b": Arch("llama3-70b", 8192, 64, 8, 28672, "llama"),
    "gpt3-175b": Arch("gpt3-175b", 12288, 96, 96, 49152, "gpt"),
}


@dataclass(frozen=True)
class LayerCase:
    """One measured point: an architecture at tensor-parallel degree ``tp``, sequence
    ``seq``, micro-batch ``batch``, activation recomputation ``recompute`` ("none",
    "selective" or "full"), ``layers`` layers deep."""

    arch: str
    tp: int
    seq: int
    batch: int
    recompute: str = "none"
    layers: int = 2

    @property
    def name(self) -> str:
        """A short unique label, e.g. ``llama3-8b/tp2/s4096/b1/none``."""
        return f"{self.arch}/tp{self.tp}/s{self.seq}/b{self.batch}/{self.recompute}"

    def as_dict(self) -> dict:
        """The case as plain data (for the JSON results)."""
        return asdict(self)


def default_cases() -> list[LayerCase]:
    """The grid ``gpu_layers.py`` measures: every architecture at tp 1, 2, 4 and 8 over
    (sequence, micro-batch) = (2048, 1), (4096, 1), (8192, 1) and (2048, 4) without
    recomputation, then selective and full recomputation at (4096, 1) for tp 2 and 8."""
    shapes = ((2048, 1), (4096, 1), (8192, 1), (2048, 4))
    cases = [LayerCase(a, tp, s, b) for a in ARCHS for tp in (1, 2, 4, 8)
             for s, b in shapes]
    cases += [LayerCase(a, tp, 4096, 1, rc) for a in ARCHS for tp in (2, 8)
              for rc in ("selective", "full")]
    return cases


def tiny_cases() -> list[LayerCase]:
    """Three small cases for checking the scripts on a CPU in seconds."""
    return [LayerCase("tiny-llama", 2, 64, 2), LayerCase("tiny-gpt", 2, 64, 2, "full"),
            LayerCase("tiny-llama", 1, 64, 1, "selective")]


TINY: dict[str, Arch] = {
    "tiny-llama": Arch("tiny-llama", 64, 4, 2, 128, "llama"),
    "tiny-gpt": Arch("tiny-gpt", 64, 4, 4, 256, "gpt"),
}


def arch_of(case: LayerCase) -> Arch:
    """The case's :class:`Arch`."""
    return ARCHS.get(case.arch) or TINY[case.arch]


def _rope(x: torch.Tensor, theta: float = 500000.0) -> torch.Tensor:
    """Rotary embedding of x (batch, seq, heads, head_dim), tables made per call."""
    t, d = x.shape[1], x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device).float() / d))
    ang = torch.outer(torch.arange(t, device=x.device).float(), inv)
    c, s = ang.cos()[None, :, None, :], ang.sin()[None, :, None, :]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2).type_as(x)


class ShardLlamaLayer(nn.Module):
    """One tensor-parallel rank's share of a Llama layer (module docstring)."""

    def __init__(self, a: Arch, tp: int) -> None:
        super().__init__()
        self.hd = a.hidden // a.heads
        self.nh, self.nkv = a.heads // tp, max(1, a.kv_heads // tp)
        self.attn_norm = nn.RMSNorm(a.hidden, eps=1e-5)
        self.wq = nn.Linear(a.hidden, self.nh * self.hd, bias=False)
        self.wk = nn.Linear(a.hidden, self.nkv * self.hd, bias=False)
        self.wv = nn.Linear(a.hidden, self.nkv * self.hd, bias=False)
        self.wo = nn.Linear(self.nh * self.hd, a.hidden, bias=False)
        self.ffn_norm = nn.RMSNorm(a.hidden, eps=1e-5)
        self.w1 = nn.Linear(a.hidden, a.ffn // tp, bias=False)
        self.w3 = nn.Linear(a.hidden, a.ffn // tp, bias=False)
        self.w2 = nn.Linear(a.ffn // tp, a.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        b, t, _ = x.shape
        h = self.attn_norm(x)
        q = _rope(self.wq(h).view(b, t, self.nh, self.hd))
        k = _rope(self.wk(h).view(b, t, self.nkv, self.hd))
        v = self.wv(h).view(b, t, self.nkv, self.hd)
        rep = self.nh // self.nkv
        k = k.unsqueeze(3).expand(-1, -1, -1, rep, -1).flatten(2, 3)
        v = v.unsqueeze(3).expand(-1, -1, -1, rep, -1).flatten(2, 3)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        x = x + self.wo(y.transpose(1, 2).reshape(b, t, -1))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class ShardGPTLayer(nn.Module):
    """One tensor-parallel rank's share of a GPT-3 layer (module docstring)."""

    def __init__(self, a: Arch, tp: int) -> None:
        super().__init__()
        self.hd, self.nh = a.hidden // a.heads, a.heads // tp
        width = self.nh * self.hd
        self.ln1 = nn.LayerNorm(a.hidden)
        self.qkv = nn.Linear(a.hidden, 3 * width)
        self.proj = nn.Linear(width, a.hidden)
        self.ln2 = nn.LayerNorm(a.hidden)
        self.fc = nn.Linear(a.hidden, a.ffn // tp)
        self.out = nn.Linear(a.ffn // tp, a.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(self.nh * self.hd, dim=-1)
        q, k, v = (z.view(b, t, self.nh, self.hd).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, -1))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class LayerSlice(nn.Module):
    """``n`` shard layers in a row; input and output are hidden states."""

    def __init__(self, a: Arch, tp: int, n: int) -> None:
        super().__init__()
        kind = ShardLlamaLayer if a.style == "llama" else ShardGPTLayer
        self.layers = nn.ModuleList(kind(a, tp) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        for layer in self.layers:
            x = layer(x)
        return x


def mse_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The slice's loss: mean-squared error in fp32."""
    return F.mse_loss(output.float(), target.float())


def build(case: LayerCase, device: str = "meta") -> tuple[LayerSlice, torch.Tensor, torch.Tensor]:
    """The case's model on ``device`` and example (input, target) on ``device``."""
    a = arch_of(case)
    with torch.device(device):
        model = LayerSlice(a, case.tp, case.layers)
        x = torch.randn(case.batch, case.seq, a.hidden)
        y = torch.randn(case.batch, case.seq, a.hidden)
    return model, x, y


def layer_flops(case: LayerCase) -> float:
    """Model FLOPs of one layer's forward+backward (3x the forward: 2 per multiply-add
    of each GEMM, plus causal attention's 4·b·s²·heads·head_dim / 2 forward), for MFU."""
    a = arch_of(case)
    hd, nh, nkv = a.hidden // a.heads, a.heads // case.tp, max(1, a.kv_heads // case.tp)
    tokens = case.batch * case.seq
    n_mlp = 3 if a.style == "llama" else 2
    weights = a.hidden * hd * (2 * nh + 2 * nkv) + n_mlp * a.hidden * (a.ffn // case.tp)
    attn = 4 * case.batch * case.seq ** 2 * nh * hd / 2
    return 3 * (2 * tokens * weights + attn)
