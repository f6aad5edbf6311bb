"""The model zoo: named models for the CLI and the benchmarks, built on any device
(``meta`` by default, so the largest plan without allocating a weight)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from autopar.errors import ConfigError
from autopar.examples.gpt import GPT, GPTConfig
from autopar.examples.llama import Llama, LlamaConfig
from autopar.examples.mlp import MLP


@dataclass(frozen=True)
class Entry:
    """A zoo model: how to build it and its standard training sequence length."""

    build: Callable[[int], nn.Module]
    seq_len: int | None
    about: str


def _gpt(layers: int, dim: int, heads: int, vocab: int = 51200, seq: int = 2048) -> Entry:
    return Entry(lambda s: GPT(GPTConfig(vocab_size=vocab, max_seq_len=max(s, seq), dim=dim,
                                         n_layers=layers, n_heads=heads)), seq,
                 f"GPT, {layers} layers, hidden {dim}, {heads} heads, vocab {vocab}")


def _llama(layers: int, dim: int, heads: int, kv: int, ffn: int, vocab: int = 128256,
           seq: int = 8192) -> Entry:
    return Entry(lambda s: Llama(LlamaConfig(vocab_size=vocab, max_seq_len=max(s, seq), dim=dim,
                                             n_layers=layers, n_heads=heads, n_kv_heads=kv,
                                             ffn_dim=ffn, rope_theta=500000.0)), seq,
                 f"Llama, {layers} layers, hidden {dim}, {heads}/{kv} heads, ffn {ffn}")


def _entries() -> dict[str, Entry]:
    # GPT-2 vocab 50257 padded to 50304 (a multiple of 128), as GPT-2 trainers do.
    e = {
        "tiny-gpt": _gpt(2, 32, 4, vocab=128, seq=16),
        "tiny-llama": _llama(2, 32, 4, 2, 64, vocab=128, seq=16),
        "mlp": Entry(lambda s: MLP(), None, "MLP classifier, 4 hidden layers of 1024"),
        "gpt2-small": _gpt(12, 768, 12, vocab=50304, seq=1024),
        "gpt2-medium": _gpt(24, 1024, 16, vocab=50304, seq=1024),
        "gpt2-large": _gpt(36, 1280, 20, vocab=50304, seq=1024),
        "gpt2-xl": _gpt(48, 1600, 25, vocab=50304, seq=1024),
        "gpt3-175b": _gpt(96, 12288, 96),
        "llama3-8b": _llama(32, 4096, 32, 8, 14336),
        "llama3-70b": _llama(80, 8192, 64, 8, 28672),
        "llama3-405b": _llama(126, 16384, 128, 8, 53248),
    }
    # Narayanan et al., SC'21, Table 1 (shapes in shared reference_configs.md)
    for name, (heads, dim, layers) in {
            "gpt-1.7b": (24, 2304, 24), "gpt-3.6b": (32, 3072, 30), "gpt-7.5b": (32, 4096, 36),
            "gpt-18.4b": (48, 6144, 40), "gpt-39.1b": (64, 8192, 48),
            "gpt-76.1b": (80, 10240, 60), "gpt-145.6b": (96, 12288, 80),
            "gpt-310.1b": (128, 16384, 96), "gpt-529.6b": (128, 20480, 105),
            "gpt-1t": (160, 25600, 128)}.items():
        e[name] = _gpt(layers, dim, heads)
    return e


def names() -> list[str]:
    """Names of the zoo models."""
    return list(_entries())


def describe(name: str) -> str:
    """One line about a zoo model."""
    return _entry(name).about


def _entry(name: str) -> Entry:
    entries = _entries()
    if name not in entries:
        raise ConfigError(f"unknown model {name!r}; known models: {', '.join(entries)} "
                          "(or pass path/to/file.py:factory)")
    return entries[name]


def get(name: str, *, batch_size: int = 2, seq_len: int | None = None,
        device: str = "meta") -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Build zoo model ``name`` on ``device`` with example inputs of ``batch_size``."""
    e = _entry(name)
    seq = seq_len or e.seq_len
    with torch.device(device):
        model = e.build(seq or 0)
        if seq is None:
            x = torch.randn(batch_size, 784)
        else:
            x = torch.randint(0, 100, (batch_size, seq))
    return model, (x,)


def load(spec: str, **kwargs: Any) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Load ``path/to/file.py:factory``; the factory returns a model or (model, inputs)."""
    path, _, attr = spec.rpartition(":")
    if not path or not attr:
        raise ConfigError(f"model spec {spec!r} is not of the form path/to/file.py:factory")
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"model file {path!r} does not exist")
    mod_spec = importlib.util.spec_from_file_location(file.stem, file)
    module = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(module)  # type: ignore[union-attr]
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ConfigError(f"{path} has no callable named {attr!r}")
    result = factory(**kwargs)
    if isinstance(result, nn.Module):
        raise ConfigError(f"{spec} returned a model without example inputs; return "
                          "(model, example_inputs) so autopar knows the input shapes")
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], nn.Module):
        inputs = result[1] if isinstance(result[1], tuple) else (result[1],)
        return result[0], inputs
    raise ConfigError(f"{spec} must return (model, example_inputs), got {type(result).__name__}")
