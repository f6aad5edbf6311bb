"""The model zoo: named models for the CLI and the benchmarks, built on any device
(``meta`` by default, so the largest ones plan without allocating a weight), and a
loader for a user's own ``path/to/file.py:factory``.

Shapes come from the papers named in each entry's description: the Megatron-LM GPT
family is that of Narayanan et al., "Efficient Large-Scale Language Model Training on
GPU Clusters Using Megatron-LM" (SC'21, Table 1), and the Llama 3 shapes are those of
Meta's Llama 3 release.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autopar import loader
from autopar.errors import ConfigError
from autopar.examples.dense_moe import DenseMoEConfig, DenseMoETransformer
from autopar.examples.gpt import GPT, GPTConfig
from autopar.examples.llama import Llama, LlamaConfig
from autopar.examples.mlp import MLP
from autopar.examples.moe import MoEConfig, MoETransformer

MLP_INPUT = 784  # the MLP entry reads flattened 28x28 images (MNIST-sized)


@dataclass(frozen=True)
class Entry:
    """A zoo model: its configuration, standard training sequence length (None for
    models that do not read token ids) and a one-line description."""

    config: GPTConfig | LlamaConfig | MoEConfig | DenseMoEConfig | None
    seq_len: int | None
    about: str

    def build(self, seq_len: int | None) -> nn.Module:
        """The model, with position tables long enough for ``seq_len`` tokens."""
        if self.config is None:
            return MLP(in_dim=MLP_INPUT)
        cfg = dataclasses.replace(self.config, max_seq_len=max(self.config.max_seq_len,
                                                               seq_len or 0))
        if isinstance(cfg, MoEConfig):
            return MoETransformer(cfg)
        if isinstance(cfg, DenseMoEConfig):
            return DenseMoETransformer(cfg)
        return GPT(cfg) if isinstance(cfg, GPTConfig) else Llama(cfg)

    @property
    def vocab_size(self) -> int | None:
        """Vocabulary size (None for the MLP)."""
        return self.config.vocab_size if self.config is not None else None


def _gpt(title: str, layers: int, dim: int, heads: int, *, vocab: int = 51200,
         seq: int = 2048, note: str = "") -> Entry:
    cfg = GPTConfig(vocab_size=vocab, max_seq_len=seq, dim=dim, n_layers=layers, n_heads=heads)
    return Entry(cfg, seq, f"{title}: GPT, {layers} layers, hidden {dim}, {heads} heads, "
                           f"vocab {vocab}{note}, seq {seq}, tied embeddings")


def _llama(title: str, layers: int, dim: int, heads: int, kv: int, ffn: int, *,
           vocab: int = 128256, seq: int = 8192) -> Entry:
    cfg = LlamaConfig(vocab_size=vocab, max_seq_len=seq, dim=dim, n_layers=layers,
                      n_heads=heads, n_kv_heads=kv, ffn_dim=ffn, rope_theta=500000.0)
    return Entry(cfg, seq, f"{title}: Llama, {layers} layers, hidden {dim}, {heads} heads "
                           f"({kv} KV), FFN {ffn}, vocab {vocab}, seq {seq}, rope theta 500000")


def _moe(title: str, layers: int, dim: int, heads: int, kv: int, ffn: int, *, experts: int,
         top_k: int, expert_ffn: int, shared: int = 0, dense: int = 0, score: str = "softmax",
         vocab: int, seq: int, theta: float, note: str = "") -> Entry:
    cfg = MoEConfig(vocab_size=vocab, max_seq_len=seq, dim=dim, n_layers=layers, n_heads=heads,
                    n_kv_heads=kv, ffn_dim=ffn, rope_theta=theta, n_experts=experts,
                    top_k=top_k, expert_ffn_dim=expert_ffn, n_shared_experts=shared,
                    n_dense_layers=dense, score=score)
    extra = (f", {shared} shared" if shared else "") + \
        (f", first {dense} blocks dense (FFN {ffn})" if dense else "")
    return Entry(cfg, seq, f"{title}: MoE, {layers} layers, hidden {dim}, {heads} heads "
                           f"({kv} KV), top-{top_k} of {experts} experts of FFN {expert_ffn}"
                           f"{extra}, {score} router, capacity factor 1.25, vocab {vocab}, "
                           f"seq {seq}{note}")


# Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
# Megatron-LM", SC'21, Table 1: name -> (heads, hidden, layers); vocab 51200, seq 2048.
_MEGATRON = {
    "gpt-1.7b": (24, 2304, 24), "gpt-3.6b": (32, 3072, 30), "gpt-7.5b": (32, 4096, 36),
    "gpt-18.4b": (48, 6144, 40), "gpt-39.1b": (64, 8192, 48), "gpt-76.1b": (80, 10240, 60),
    "gpt-145.6b": (96, 12288, 80), "gpt-310.1b": (128, 16384, 96),
    "gpt-529.6b": (128, 20480, 105), "gpt-1t": (160, 25600, 128),
}

# GPT-2's vocabulary of 50257 tokens, padded up to 50304 (a multiple of 64) as GPT-2
# trainers do (nanoGPT's train config) so the embedding and head shard evenly.
_GPT2_NOTE = " (GPT-2's 50257 padded to a multiple of 64)"


def _entries() -> dict[str, Entry]:
    e = {
        "tiny-gpt": _gpt("tiny GPT for tests", 2, 32, 4, vocab=128, seq=16),
        "tiny-llama": _llama("tiny Llama for tests", 2, 32, 4, 2, 64, vocab=128, seq=16),
        "mlp": Entry(None, None, f"MLP classifier: {MLP_INPUT} inputs, 4 hidden layers of "
                                 "1024 with GeLU, 10 classes"),
        "gpt2-small": _gpt("GPT-2 small (Radford et al. 2019)", 12, 768, 12, vocab=50304,
                           seq=1024, note=_GPT2_NOTE),
        "gpt2-medium": _gpt("GPT-2 medium", 24, 1024, 16, vocab=50304, seq=1024,
                            note=_GPT2_NOTE),
        "gpt2-large": _gpt("GPT-2 large", 36, 1280, 20, vocab=50304, seq=1024,
                           note=_GPT2_NOTE),
        "gpt2-xl": _gpt("GPT-2 XL", 48, 1600, 25, vocab=50304, seq=1024, note=_GPT2_NOTE),
    }
    for name, (heads, dim, layers) in _MEGATRON.items():
        size = name.removeprefix("gpt-").upper()
        e[name] = _gpt(f"Megatron-LM GPT {size} (Narayanan et al. SC'21, Table 1)", layers,
                       dim, heads)
    e["gpt3-175b"] = _gpt("GPT-3 175B (Brown et al. 2020)", 96, 12288, 96)
    e["llama3-8b"] = _llama("Llama 3 8B", 32, 4096, 32, 8, 14336)
    e["llama3-70b"] = _llama("Llama 3 70B", 80, 8192, 64, 8, 28672)
    e["llama3-405b"] = _llama("Llama 3 405B", 126, 16384, 128, 8, 53248)
    e["tiny-moe"] = _moe("tiny MoE for tests", 2, 32, 4, 2, 64, experts=4, top_k=2,
                         expert_ffn=32, shared=1, dense=1, vocab=128, seq=16, theta=10000.0)
    e["tiny-dense-moe"] = Entry(
        DenseMoEConfig(vocab_size=128, max_seq_len=16, dim=32, n_layers=2, n_heads=4,
                       n_kv_heads=2, ffn_dim=64, n_experts=4, top_k=2, expert_ffn_dim=32), 16,
        "tiny dense-dispatch MoE for tests: Llama, 2 layers, hidden 32, 4 heads (2 KV), "
        "4 experts of FFN 32 run on every token, top-2 gate, vocab 128, seq 16")
    # Jiang et al., "Mixtral of Experts" (2024), Table 1.
    e["mixtral-8x7b"] = _moe("Mixtral 8x7B", 32, 4096, 32, 8, 14336, experts=8, top_k=2,
                             expert_ffn=14336, vocab=32000, seq=4096, theta=1e6)
    # Mistral AI's Mixtral 8x22B (2024), as Megatron-Core's MoE model zoo configures it
    # (NVIDIA Megatron-MoE-ModelZoo, model_configs/benchmarking/Mixtral-8x22B.yaml): 56
    # layers, hidden 6144, 48 heads (8 KV), 8 experts of FFN 16384, top-2, vocab 32768.
    e["mixtral-8x22b"] = _moe("Mixtral 8x22B", 56, 6144, 48, 8, 16384, experts=8, top_k=2,
                              expert_ffn=16384, vocab=32768, seq=4096, theta=1e6)
    # DeepSeek-AI, "DeepSeek-V3 Technical Report" (2024), §4.2: 61 layers, hidden 7168,
    # 128 heads, first 3 FFNs dense (18432), 1 shared + 256 routed experts of 2048, 8
    # active, sigmoid router. Its multi-head latent attention is written here as
    # grouped-query attention with 128 heads of 56, which has about as many weights.
    e["deepseek-v3"] = _moe("DeepSeek-V3 671B", 61, 7168, 128, 128, 18432, experts=256,
                            top_k=8, expert_ffn=2048, shared=1, dense=3, score="sigmoid",
                            vocab=129280, seq=4096, theta=10000.0,
                            note=" (attention as GQA, not MLA)")
    return e


def names() -> list[str]:
    """Names of the zoo models, smallest families first."""
    return list(_entries())


def describe(name: str) -> str:
    """One line about zoo model ``name``."""
    return _entry(name).about


def _entry(name: str) -> Entry:
    entries = _entries()
    if name not in entries:
        raise ConfigError(f"unknown model {name!r}; known models: {', '.join(entries)} "
                          "(or pass path/to/file.py:factory)")
    return entries[name]


def get(name: str, *, batch_size: int = 1, seq_len: int | None = None,
        device: str = "meta") -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Zoo model ``name`` built on ``device``, with example inputs: token ids of shape
    (batch_size, seq_len) (seq_len defaults to the model's training length), or for the
    MLP float features of shape (batch_size, 784)."""
    e = _entry(name)
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"batch_size={batch_size!r}: expected a positive integer")
    if seq_len is not None and (not isinstance(seq_len, int) or seq_len < 1):
        raise ConfigError(f"seq_len={seq_len!r}: expected a positive integer")
    seq = seq_len if seq_len is not None else e.seq_len
    with torch.device(device):
        model = e.build(seq)
        if e.vocab_size is None:
            x = torch.randn(batch_size, MLP_INPUT)
        else:
            x = torch.randint(0, e.vocab_size, (batch_size, seq))
    return model, (x,)


def load(spec: str, *, batch_size: int = 1, seq_len: int | None = None,
         **kwargs: Any) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Load ``path/to/file.py:factory`` and call ``factory(**kwargs)``: the model and
    its example inputs, as :func:`load_with_targets` gives them."""
    model, inputs, _ = load_with_targets(spec, batch_size=batch_size, seq_len=seq_len,
                                         **kwargs)
    return model, inputs


def load_with_targets(spec: str, *, batch_size: int = 1, seq_len: int | None = None,
                      **kwargs: Any) -> tuple[nn.Module, tuple[torch.Tensor, ...],
                                              torch.Tensor | None]:
    """Load ``path/to/file.py:factory`` and call ``factory(**kwargs)``, as
    :func:`autopar.loader.load_with_targets` does; a spec that is no file names the
    zoo's models in its error."""
    if not spec.rpartition(":")[0]:
        raise ConfigError(f"model spec {spec!r} is neither a zoo name nor of the form "
                          f"path/to/file.py:factory; zoo models: {', '.join(names())}")
    return loader.load_with_targets(spec, batch_size=batch_size, seq_len=seq_len, **kwargs)
