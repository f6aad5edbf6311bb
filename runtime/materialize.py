"""Materialize a ``meta``-device model after it has been laid out, so each rank
allocates only its own shards.

:func:`materialize` allocates every parameter's local shard (``to_empty``) and runs
each module's ``reset_parameters()``, children before parents;
:func:`materialize_stage` does so for one pipeline stage. A meta model therefore
gets a fresh initialization from ``reset_parameters()``, which every module that
directly owns tensors must have (:func:`check_materializable`;
:func:`without_reset_parameters` names the first that lacks one); an initialization of
the model's own (:func:`custom_initialization`) is not run.
On a CPU the initialization runs at full size, each rank keeping its slice
(:func:`full_size_init`).
The order of initialization, tied parameters and seeding on CPU and CUDA:
docs/runtime.md, section ``autopar.runtime.materialize``.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from autopar.errors import LoweringError

__all__ = ["reset_enclosing", "is_meta_model", "without_reset_parameters", "custom_initialization",
           "check_materializable", "tied_aliases", "full_size_init", "materialize",
           "materialize_stage"]


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


def custom_initialization(model: nn.Module) -> str | None:
    """The first module, in module order, with an initialization method of its own that
    :func:`materialize` does not run (``_init_weights`` or ``init_weights``, as
    nanoGPT, torchtitan and Hugging Face models name theirs), written ``'path' (Class)
    defines _init_weights()``; None when there is none. A model built on meta starts
    from its modules' ``reset_parameters()`` instead."""
    for path, m in model.named_modules():
        for name in ("_init_weights", "init_weights"):
            if callable(getattr(m, name, None)):
                return f"'{path or 'the root module'}' ({type(m).__name__}) defines {name}()"
    return None


def check_materializable(model: nn.Module) -> None:
    """Every module that directly owns parameters or buffers of a meta model must have
    ``reset_parameters()``, or its tensors would stay uninitialized
    (:func:`without_reset_parameters`, which emitted programs also run); a model with an
    initialization of its own (:func:`custom_initialization`) is warned that it gets
    its modules' ``reset_parameters()`` instead."""
    missing = without_reset_parameters(model)
    if missing is not None:
        raise LoweringError(f"module {missing} of the meta model owns tensors but has no "
                            "reset_parameters() to initialize them; add one, or build the "
                            "model on a real device before apply_plan")
    own = custom_initialization(model)
    if own is not None:
        warnings.warn(f"module {own}, which a meta model does not run: it is initialized "
                      "by each module's reset_parameters() instead; build the model on the "
                      "CPU to keep its own initialization", UserWarning, stacklevel=3)


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


@contextlib.contextmanager
def full_size_init(model: nn.Module, device: torch.device,
                   keep: bool = False) -> Iterator[None]:
    """Inside, every DTensor parameter and buffer of ``model`` is a plain tensor of its
    full shape on ``device``; on leaving, each rank copies its own slice of it into the
    DTensor (``distribute_tensor(..., src_data_rank=None)``: no communication) and the
    DTensors are back. Only where DTensor has no random-number tracker, a CPU mesh
    (torch 2.13 warns "DTensor random operators may not have complete support on cpu"):
    a random op on a DTensor there draws each rank's shard from the rank's own
    generator, so every shard of a parameter would get the same values (rows repeated
    across tp and dp ranks, units that stay copies of each other as they train). Drawn
    full size, the weights are the ones one process draws under the same seed. Costs a
    full copy of the model on each rank while it lasts, as a CPU run can afford. With
    ``keep`` the full tensors start from the DTensors' values (gathered), for an
    initialization that touches only some of them."""
    full: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(DTensor) -> (it, full)
    slots = []
    for m in model.modules():
        for table in (m._parameters, m._buffers):
            for name, t in table.items():
                if isinstance(t, DTensor):
                    if id(t) not in full:
                        plain = t.full_tensor().detach().to(device).clone() if keep \
                            else torch.empty(t.shape, dtype=t.dtype, device=device)
                        full[id(t)] = (t, nn.Parameter(plain, t.requires_grad)
                                       if isinstance(t, nn.Parameter) else plain)
                    slots.append((table, name, t))
                    table[name] = full[id(t)][1]
    try:
        yield
    finally:
        for table, name, t in slots:
            table[name] = t
    with torch.no_grad():
        for t, plain in full.values():
            own = distribute_tensor(plain.detach(), t.device_mesh, t.placements,
                                    src_data_rank=None)
            t.to_local().copy_(own.to_local())


def materialize(model: nn.Module, device: torch.device) -> None:
    """Allocate the local shards of a laid-out meta model on ``device`` and initialize
    them with each module's ``reset_parameters()``, children before parents, so that a
    model's own has the last word over its submodules' defaults. A tied parameter is
    initialized by its first owner in module order and stays tied (``to_empty`` alone
    would give each module its own copy where no wrapper keeps them as one). On a CPU
    device the initialization runs at full size (:func:`full_size_init`)."""
    ties = tied_aliases(model)
    model.to_empty(device=device)
    for module, name, first, first_name in ties:
        module._parameters[name] = first._parameters[first_name]
    aliases = {(id(module), name) for module, name, _, _ in ties}
    with torch.no_grad(), (full_size_init(model, device) if device.type == "cpu"
                           else contextlib.nullcontext()):
        for m in reversed(list(model.modules())):  # every module after its descendants
            reset = getattr(m, "reset_parameters", None)
            own = [name for name, p in m._parameters.items() if p is not None]
            if callable(reset) and not (own and all((id(m), n) in aliases for n in own)):
                reset()  # skipped: a module holding only parameters tied to an earlier one


def materialize_stage(stage: nn.Module, device: torch.device,
                      root: nn.Module | None = None) -> None:
    """Materialize one pipeline stage module of a meta model (see
    :mod:`autopar.runtime.pipeline_split`): its unit modules as :func:`materialize`
    does, keeping the constants that tracing stored on the stage itself, then the
    initialization of the modules of ``root`` (the whole model) that enclose them
    (:func:`reset_enclosing`)."""
    constants = {name: t for name, t in stage.named_buffers(recurse=False) if not t.is_meta}
    materialize(stage, device)
    for name, t in constants.items():
        stage.register_buffer(name, t.to(device))
    if root is not None:
        reset_enclosing(root, stage, device)


def reset_enclosing(root: nn.Module, stage: nn.Module, device: torch.device) -> None:
    """Run ``reset_parameters()`` of each module of ``root`` that encloses a module of
    ``stage`` without being in it (the model itself, mostly), deepest first, once the
    stage is materialized: a model whose own initialization overrides its submodules'
    defaults (GPT-2's std-0.02 embeddings over nn.Embedding's N(0, 1)) keeps it on
    every stage, as :func:`materialize` gives it the last word. Its parameters on
    other stages are still on ``meta``, where the initialization does nothing; one
    that cannot run on a part of the model is skipped with a warning."""
    inside = {id(m) for m in stage.modules()}
    enclosing = [m for m in root.modules() if id(m) not in inside
                 and callable(getattr(m, "reset_parameters", None))
                 and any(id(c) in inside for c in m.modules())]
    with torch.no_grad(), (full_size_init(stage, device, keep=True) if device.type == "cpu"
                           else contextlib.nullcontext()):
        for m in reversed(enclosing):
            try:
                m.reset_parameters()
            except (RuntimeError, NotImplementedError) as e:
                warnings.warn(f"{type(m).__name__}.reset_parameters() could not run on one "
                              f"pipeline stage ({e}); the stage keeps its modules' own "
                              "initialization", stacklevel=2)
