"""Materialize a ``meta``-device model after it has been laid out, so each rank
allocates only its own shards.

:func:`materialize` allocates every parameter's local shard (``to_empty``) and runs
each module's ``reset_parameters()``, children before parents;
:func:`materialize_stage` does so for one pipeline stage. A meta model therefore
gets a fresh initialization from ``reset_parameters()``, which every module that
directly owns tensors must have (:func:`check_materializable`;
:func:`without_reset_parameters` names the first that lacks one).

The order of initialization, tied parameters and seeding on CPU and CUDA:
docs/runtime.md, section ``autopar.runtime.materialize``.
"""

from __future__ import annotations

import torch
from torch import nn

from autopar.errors import LoweringError

__all__ = ["is_meta_model", "without_reset_parameters", "check_materializable",
           "tied_aliases", "materialize", "materialize_stage"]


def is_meta_model(model: nn.Module) -> bool:
    """True when the model's parameters and buffers are on the ``meta`` device
    (raises LoweringError when only some are)."""
    tensors = [(n, t) for n, t in model.named_parameters()] + list(model.named_buffers())
    meta = [n for n, t in tensors if t.is_meta]
    if meta and len(meta) != len(tensors):
        real = next(n for n, t in tensors if not t.is_meta)
        raise LoweringError(f"the model has both meta tensors (e.g. '{meta[0]}') and real ones "
                            f"(e.g. '{real}'); build it entirely on the meta device or "
                            "entirely on a real one")
    return bool(meta)


def without_reset_parameters(model: nn.Module) -> str | None:
    """The first module, in module order, that directly owns parameters or buffers but
    has no ``reset_parameters()`` to initialize them after a meta start, written
    ``'path' (Class)``; None when the model can start on meta."""
    for path, m in model.named_modules():
        owns = any(True for _ in m.parameters(recurse=False)) or \
            any(True for _ in m.buffers(recurse=False))
        if owns and not callable(getattr(m, "reset_parameters", None)):
            return f"'{path or 'the root module'}' ({type(m).__name__})"
    return None


def check_materializable(model: nn.Module) -> None:
    """Every module that directly owns parameters or buffers of a meta model must have
    ``reset_parameters()``, or its tensors would stay uninitialized
    (:func:`without_reset_parameters`, which emitted programs also run)."""
    missing = without_reset_parameters(model)
    if missing is not None:
        raise LoweringError(f"module {missing} of the meta model owns tensors but has no "
                            "reset_parameters() to initialize them; add one, or build the "
                            "model on a real device before apply_plan")


def tied_aliases(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module, str]]:
    """(module, name, first module, its name) for every parameter slot that holds a
    parameter an earlier slot (in module order) holds too."""
    first: dict[int, tuple[nn.Module, str]] = {}
    out = []
    for m in model.modules():
        for name, p in m._parameters.items():
            if p is None:
                continue
            if id(p) in first:
                out.append((m, name) + first[id(p)])
            else:
                first[id(p)] = (m, name)
    return out


def materialize(model: nn.Module, device: torch.device) -> None:
    """Allocate the local shards of a laid-out meta model on ``device`` and initialize
    them with each module's ``reset_parameters()``, children before parents, so that a
    model's own has the last word over its submodules' defaults. A tied parameter is
    initialized by its first owner in module order and stays tied (``to_empty`` alone
    would give each module its own copy where no wrapper keeps them as one)."""
    ties = tied_aliases(model)
    model.to_empty(device=device)
    for module, name, first, first_name in ties:
        module._parameters[name] = first._parameters[first_name]
    aliases = {(id(module), name) for module, name, _, _ in ties}
    with torch.no_grad():
        for m in reversed(list(model.modules())):  # every module after its descendants
            reset = getattr(m, "reset_parameters", None)
            own = [name for name, p in m._parameters.items() if p is not None]
            if callable(reset) and not (own and all((id(m), n) in aliases for n in own)):
                reset()  # skipped: a module holding only parameters tied to an earlier one


def materialize_stage(stage: nn.Module, device: torch.device) -> None:
    """Materialize one pipeline stage module of a meta model (see
    :mod:`autopar.runtime.pipeline_split`): its unit modules as :func:`materialize`
    does, keeping the constants that tracing stored on the stage itself."""
    constants = {name: t for name, t in stage.named_buffers(recurse=False) if not t.is_meta}
    materialize(stage, device)
    for name, t in constants.items():
        stage.register_buffer(name, t.to(device))
