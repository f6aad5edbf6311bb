"""Model factories for the code generator's tests: the tiny GPT, Llama and mixture of
experts of the runtime tests, loaded by emitted programs as
``tests/codegen_models.py:tiny_gpt``."""

from __future__ import annotations

from autopar.examples.dense_moe import DenseMoEConfig, DenseMoETransformer
from autopar.examples.gpt import GPT, GPTConfig
from autopar.examples.llama import Llama, LlamaConfig
from autopar.examples.moe import MoEConfig, MoETransformer

MOE_CONFIG = MoEConfig(vocab_size=64, max_seq_len=16, dim=32, n_layers=3, n_heads=4,
                       n_kv_heads=2, ffn_dim=64, n_experts=4, top_k=2, expert_ffn_dim=32,
                       n_shared_experts=1, n_dense_layers=1, capacity_factor=1.0)
"""A 3-layer mixture of experts (the first block dense): 4 experts, top-2, one shared
expert, dim 32, vocabulary 64, sequence 16."""

DENSE_MOE_CONFIG = DenseMoEConfig(vocab_size=64, max_seq_len=16, dim=32, n_layers=2, n_heads=4,
                                  n_kv_heads=2, ffn_dim=64, n_experts=4, top_k=2,
                                  expert_ffn_dim=32)
"""A 2-layer dense-dispatch mixture of experts: 4 experts run on every token, top-2
gate, dim 32, vocabulary 64, sequence 16."""


def tiny_gpt() -> GPT:
    """A 2-layer GPT: dim 32, 4 heads, vocabulary 128, sequence 16, tied embeddings."""
    return GPT(GPTConfig(vocab_size=128, max_seq_len=16, dim=32, n_layers=2, n_heads=4))


def tiny_llama() -> Llama:
    """A 2-layer Llama: dim 32, 4 heads (2 KV), FFN 64, vocabulary 128, sequence 16."""
    return Llama(LlamaConfig(vocab_size=128, max_seq_len=16, dim=32, n_layers=2, n_heads=4,
                             n_kv_heads=2, ffn_dim=64))



def tiny_llama_f64() -> Llama:
    """:func:`tiny_llama` in float64 (for comparisons to 1e-6 across plans)."""
    return tiny_llama().double()


def tiny_moe() -> MoETransformer:
    """The mixture of experts of :data:`MOE_CONFIG`."""
    return MoETransformer(MOE_CONFIG)


def tiny_dense_moe() -> DenseMoETransformer:
    """The dense-dispatch mixture of experts of :data:`DENSE_MOE_CONFIG`."""
    return DenseMoETransformer(DENSE_MOE_CONFIG)
