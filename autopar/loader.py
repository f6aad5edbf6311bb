"""Load a user's own model or loss from ``path/to/file.py:name``.

The file is imported under a module name of its own; its factory returns the model,
and perhaps its example inputs and targets. The CLI (through
:mod:`autopar.examples.zoo`, which adds the zoo's names) and the code generator
(:mod:`autopar.runtime.codegen`) read user files through here.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autopar.errors import ConfigError, FactoryError

__all__ = ["load", "load_callable", "load_with_targets"]


def load(spec: str, *, batch_size: int = 1, seq_len: int | None = None,
         **kwargs: Any) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Load ``path/to/file.py:factory`` and call ``factory(**kwargs)``: the model and
    its example inputs, as :func:`load_with_targets` gives them."""
    model, inputs, _ = load_with_targets(spec, batch_size=batch_size, seq_len=seq_len,
                                         **kwargs)
    return model, inputs


def load_callable(spec: str) -> Any:
    """The callable ``name`` of ``path/to/file.py:name`` (the file is imported under a
    module name of its own). Raises ConfigError naming what is missing."""
    path, sep, attr = spec.rpartition(":")
    if not sep or not path or not attr:
        raise ConfigError(f"{spec!r} is not of the form path/to/file.py:name")
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"file {path!r} does not exist")
    module_name = f"autopar_user_model_{file.stem}"
    mod_spec = importlib.util.spec_from_file_location(module_name, file)
    if mod_spec is None or mod_spec.loader is None:
        raise ConfigError(f"{path} is not a Python file that can be imported")
    module = importlib.util.module_from_spec(mod_spec)
    sys.modules[module_name] = module  # so dataclasses and pickling inside it work
    try:
        mod_spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 — the user's file: report, do not crash
        sys.modules.pop(module_name, None)
        raise ConfigError(f"importing {path} failed: {type(e).__name__}: {e}") from None
    found = getattr(module, attr, None)
    if found is None or not callable(found):
        public = sorted(n for n, v in vars(module).items() if callable(v) and
                        not n.startswith("_") and getattr(v, "__module__", "") == module_name)
        raise ConfigError(f"{path} has no callable named {attr!r}; it defines "
                          f"{', '.join(public) or 'no public callables'}")
    return found


def load_with_targets(spec: str, *, batch_size: int = 1, seq_len: int | None = None,
                      **kwargs: Any) -> tuple[nn.Module, tuple[torch.Tensor, ...],
                                              torch.Tensor | None]:
    """Load ``path/to/file.py:factory`` and call ``factory(**kwargs)``.

    The factory returns ``(model, example_inputs, example_targets)``,
    ``(model, example_inputs)`` or a model alone: then the inputs are token ids of
    shape (batch_size, seq_len) for the model's first nn.Embedding, seq_len defaulting
    to the model config's maximum length (``max_seq_len``, ``n_positions`` or
    ``max_position_embeddings``). The targets are None when the factory gives none.
    """
    if not spec.rpartition(":")[0]:
        raise ConfigError(f"model spec {spec!r} is not of the form path/to/file.py:factory")
    factory = load_callable(spec)
    try:
        result = factory(**kwargs)
    except Exception as e:  # noqa: BLE001
        raise FactoryError(f"{spec}() raised {type(e).__name__}: {e}") from None
    if isinstance(result, nn.Module):
        return result, _guess_inputs(result, spec, batch_size, seq_len), None
    if isinstance(result, (tuple, list)) and len(result) in (2, 3) and \
            isinstance(result[0], nn.Module):
        inputs = tuple(result[1]) if isinstance(result[1], (tuple, list)) else (result[1],)
        targets = result[2] if len(result) == 3 else None
        if inputs and all(isinstance(t, torch.Tensor) for t in inputs) and \
                (targets is None or isinstance(targets, torch.Tensor)):
            return result[0], inputs, targets
    raise ConfigError(f"{spec} must return a model, (model, example_inputs) or (model, "
                      f"example_inputs, example_targets) with tensor inputs and targets, got "
                      f"{_kind(result)}")


def _kind(v: Any) -> str:
    if isinstance(v, (tuple, list)):
        return f"{type(v).__name__} of ({', '.join(type(x).__name__ for x in v)})"
    return type(v).__name__


def _guess_inputs(model: nn.Module, spec: str, batch_size: int,
                  seq_len: int | None) -> tuple[torch.Tensor, ...]:
    emb = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    cfg = getattr(model, "config", None) or getattr(model, "cfg", None)
    if seq_len is None:
        for key in ("max_seq_len", "n_positions", "max_position_embeddings"):
            seq_len = getattr(cfg, key, None) if cfg is not None else None
            if isinstance(seq_len, int):
                break
    if emb is None or not isinstance(seq_len, int):
        raise ConfigError(f"{spec} returned a model alone and its inputs cannot be guessed "
                          "(no token embedding or no sequence length); return "
                          "(model, example_inputs) instead")
    p = next(iter(model.parameters()), None)
    device = p.device if p is not None else torch.device("cpu")
    return (torch.randint(0, emb.num_embeddings, (batch_size, seq_len), device=device),)
