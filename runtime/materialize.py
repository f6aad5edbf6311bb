"""Materialize a ``meta``-device model after it has been laid out, so each rank
allocates only its own shards.

The tensor- and data-parallel passes run on the meta model (they only record
placements); then ``to_empty(device=...)`` allocates every parameter's local shard,
and each submodule's ``reset_parameters()`` initializes it. A meta model therefore
gets a fresh initialization, not the weights of any earlier instance. A parameter
shared by several modules (tied embeddings) is initialized once, by its first owner,
as when a model ties its weights after construction.

On CPU meshes DTensor random initialization runs on each rank's local generator, so
seed every rank alike (``torch.manual_seed``) before ``apply_plan`` to get identical
replicas; on CUDA, DTensor's own RNG tracker keeps replicas consistent.
"""

from __future__ import annotations

import torch
from torch import nn

from autopar.errors import LoweringError

__all__ = ["is_meta_model", "check_materializable", "materialize", "materialize_stage"]


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


def check_materializable(model: nn.Module) -> None:
    """Every module that directly owns parameters or buffers of a meta model must have
    ``reset_parameters()``, or its tensors would stay uninitialized."""
    for path, m in model.named_modules():
        owns = any(True for _ in m.parameters(recurse=False)) or \
            any(True for _ in m.buffers(recurse=False))
        if owns and not callable(getattr(m, "reset_parameters", None)):
            name = path or "the root module"
            raise LoweringError(f"module '{name}' ({type(m).__name__}) of the meta model owns "
                                "tensors but has no reset_parameters() to initialize them; add "
                                "one, or build the model on a real device before apply_plan")


def materialize(model: nn.Module, device: torch.device) -> None:
    """Allocate the local shards of a laid-out meta model on ``device`` and initialize
    them with each submodule's ``reset_parameters()``."""
    model.to_empty(device=device)
    done: set[int] = set()
    with torch.no_grad():
        for m in model.modules():
            reset = getattr(m, "reset_parameters", None)
            if not callable(reset):
                continue
            own = [id(p) for p in m.parameters(recurse=False)]
            if own and all(i in done for i in own):
                continue  # only tied parameters, already initialized by their first owner
            reset()
            done.update(own)


def materialize_stage(stage: nn.Module, device: torch.device) -> None:
    """Materialize one pipeline stage module of a meta model (see
    :mod:`autopar.runtime.pipeline_split`): its unit modules as :func:`materialize`
    does, keeping the constants that tracing stored on the stage itself."""
    constants = {name: t for name, t in stage.named_buffers(recurse=False) if not t.is_meta}
    materialize(stage, device)
    for name, t in constants.items():
        stage.register_buffer(name, t.to(device))
