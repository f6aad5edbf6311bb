"""Hugging Face's traced causal mask is priced as the ``is_causal`` attention it runs as
eagerly; masks that run as masks stay as captured."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from autopar.capture import capture
from autopar.masks import SDPA, is_causal_mask

transformers = pytest.importorskip("transformers")

BATCH, SEQ, HEADS, DIM, VOCAB = 2, 16, 4, 32, 64


def _config(cls, **kw):
    return cls(num_hidden_layers=2, hidden_size=DIM, num_attention_heads=HEADS,
               num_key_value_heads=2, intermediate_size=64, vocab_size=VOCAB,
               max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=0, pad_token_id=0,
               **kw)


def _attention(model: torch.nn.Module, device: str = "meta") -> list:
    x = torch.randint(0, VOCAB, (BATCH, SEQ), device=device)
    return [n for n in capture(model, (x,)).nodes if n.target == SDPA]


def _priced(attn: list) -> list[tuple[bool, float]]:
    """(is_causal, FLOPs) of each attention op as the planner prices it."""
    return [(len(n.args) > 5 and n.args[5] is True, n.flops) for n in attn]


def _full_flops() -> float:
    """Q·Kᵀ and P·V of every head without a mask's savings (autopar.flops)."""
    head = DIM // HEADS
    return 2.0 * BATCH * HEADS * SEQ * SEQ * (head + head)


class _SdpaCalls(TorchFunctionMode):
    """Records (attn_mask is None, is_causal) of each SDPA call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[bool, bool]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
            self.calls.append((mask is None, bool(kwargs.get("is_causal", False))))
        return func(*args, **kwargs)


def test_hf_runs_its_mask_as_is_causal_eagerly() -> None:
    """The premise: run eagerly, HF's SDPA attention gets no mask and is_causal."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_config(transformers.LlamaConfig))
    with _SdpaCalls() as mode:
        model(torch.randint(0, VOCAB, (BATCH, SEQ)))
    assert mode.calls == [(True, True)] * 2


def test_hf_traced_causal_mask_is_priced_causal() -> None:
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(_config(transformers.LlamaConfig))
    attn = _attention(model)
    assert _priced(attn) == [(True, _full_flops() / 2)] * 2


def test_sliding_window_shorter_than_the_sequence_stays_a_mask() -> None:
    with torch.device("meta"):
        narrow = transformers.MistralForCausalLM(_config(transformers.MistralConfig,
                                                         sliding_window=SEQ // 4))
        wide = transformers.MistralForCausalLM(_config(transformers.MistralConfig,
                                                       sliding_window=4 * SEQ))
    assert _priced(_attention(narrow)) == [(False, _full_flops())] * 2
    assert _priced(_attention(wide)) == [(True, _full_flops() / 2)] * 2


class _TrilMasked(torch.nn.Module):
    """Attention that passes its own lower-triangular mask: it runs with the mask."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, DIM)
        self.qkv = torch.nn.Linear(DIM, 3 * DIM)
        self.head = torch.nn.Linear(DIM, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        b, s = idx.shape
        q, k, v = self.qkv(self.emb(idx)).view(b, s, 3, HEADS, DIM // HEADS).unbind(2)
        mask = torch.ones(s, s, dtype=torch.bool, device=idx.device).tril()
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), attn_mask=mask)
        return self.head(y.transpose(1, 2).reshape(b, s, DIM))


def test_a_mask_written_by_the_model_stays_a_mask() -> None:
    attn = _attention(_TrilMasked(), device="cpu")
    assert _priced(attn) == [(False, _full_flops())]


def test_causal_mask_forms() -> None:
    tril = torch.ones(4, 4, dtype=torch.bool).tril()
    additive = torch.zeros(4, 4).masked_fill(~tril, float("-inf"))
    assert is_causal_mask(tril.expand(2, 1, 4, 4))
    assert is_causal_mask(additive)
    assert not is_causal_mask(tril.T)
    assert not is_causal_mask(torch.zeros(4, 4).masked_fill(~tril, -1.0))  # a bias, not a mask
    assert not is_causal_mask(torch.ones(4, 5, dtype=torch.bool).tril())
