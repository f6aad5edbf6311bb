"""Model factories for the code generator's tests: the tiny GPT and Llama of the
runtime tests, loaded by emitted programs as ``tests/codegen_models.py:tiny_gpt``."""

from __future__ import annotations

from autopar.examples.gpt import GPT, GPTConfig
from autopar.examples.llama import Llama, LlamaConfig


def tiny_gpt() -> GPT:
    """A 2-layer GPT: dim 32, 4 heads, vocabulary 128, sequence 16, tied embeddings."""
    return GPT(GPTConfig(vocab_size=128, max_seq_len=16, dim=32, n_layers=2, n_heads=4))


def tiny_llama() -> Llama:
    """A 2-layer Llama: dim 32, 4 heads (2 KV), FFN 64, vocabulary 128, sequence 16."""
    return Llama(LlamaConfig(vocab_size=128, max_seq_len=16, dim=32, n_layers=2, n_heads=4,
                             n_kv_heads=2, ffn_dim=64))
