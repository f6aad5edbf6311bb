"""Materialize a ``meta``-device model after it has been laid out, so each rank
allocates only its own shards.

:func:`materialize` allocates every parameter's local shard (``to_empty``) and runs
each module's ``reset_parameters()``, children before parents;
:func:`materialize_stage` does so for one pipeline stage. A meta model therefore
gets a fresh initialization from ``reset_parameters()``, not the weights the model's
own code makes (:func:`meta_start_note` says so); every module that directly owns
tensors must have one (:func:`check_materializable`). :func:`choose_build` decides
where an emitted program builds the model: on the CPU from its factory whenever it
fits, on meta only when asked or when it does not. On a CPU the initialization runs
at full size, each rank keeping its slice (:func:`full_size_init`).
The order of initialization, tied parameters and seeding on CPU and CUDA:
docs/runtime.md, section ``autopar.runtime.materialize``.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from autopar.errors import LoweringError

__all__ = ["reset_enclosing", "is_meta_model", "without_reset_parameters", "custom_initialization",
           "meta_start_note", "check_materializable", "tensor_bytes", "available_host_bytes",
           "choose_build", "tied_aliases", "full_size_init", "materialize", "materialize_stage"]


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


def meta_start_note(model: nn.Module) -> str:
    """What initializes a model that starts on meta, for the user to read: each
    rank's shards get its modules' ``reset_parameters()``, not the weights the model's
    own code makes (in ``__init__``, a factory's seed, or an initialization method of
    its own, :func:`custom_initialization`, named when there is one)."""
    own = custom_initialization(model)
    text = ("the model starts on meta: each rank initializes its own shards with each "
            "module's reset_parameters(), not with the weights the model's code makes")
    return text + (f" (module {own}, which does not run)" if own is not None else "")


def check_materializable(model: nn.Module) -> None:
    """Every module that directly owns parameters or buffers of a meta model must have
    ``reset_parameters()``, or its tensors would stay uninitialized
    (:func:`without_reset_parameters`, which emitted programs also run); then the
    initialization that runs instead of the model's own is said
    (:func:`meta_start_note`, a UserWarning on rank 0)."""
    missing = without_reset_parameters(model)
    if missing is not None:
        raise LoweringError(f"module {missing} of the meta model owns tensors but has no "
                            "reset_parameters() to initialize them; add one, or build the "
                            "model on a real device before apply_plan")
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        warnings.warn(meta_start_note(model) + "; build the model on the CPU before "
                      "apply_plan to train those weights", UserWarning, stacklevel=3)


def tensor_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers, each tensor counted once (tied
    weights once), at their dtypes: what one whole copy of the model holds."""
    seen: dict[int, torch.Tensor] = {}
    for t in [*model.parameters(), *model.buffers()]:
        seen.setdefault(id(t), t)
    return sum(t.numel() * t.element_size() for t in seen.values())


def available_host_bytes() -> int:
    """The host memory this machine can still give (Linux ``MemAvailable`` of
    ``/proc/meminfo``; elsewhere the free physical pages)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def choose_build(build: str, meta_model: nn.Module | None, meta_error: str, local_ranks: int,
                 host_bytes: int, device_bytes: int | None) -> tuple[bool, str]:
    """Where a program builds the model: (on meta, what to tell the user, '' for
    nothing). ``build`` is "cpu" (from the factory, on the CPU), "meta" or "auto";
    ``meta_model`` the factory's model built on meta, None when that failed with
    ``meta_error``. "auto" builds on the CPU, the weights the factory makes, whenever
    ``local_ranks`` whole copies fit in ``host_bytes`` and one fits in
    ``device_bytes`` (the device's free memory, None for a CPU run): each rank holds
    one while it builds and lays it out. Otherwise it starts on meta and says which
    initialization runs instead. Raises ValueError where neither can work."""
    if build == "cpu":
        return False, ""
    if meta_model is None:
        if build == "meta":
            raise ValueError(f"--build meta: the factory cannot run on the meta device "
                             f"({meta_error}); use --build cpu")
        return False, (f"the factory cannot run on the meta device ({meta_error}): building "
                       "the model on the CPU")
    missing = without_reset_parameters(meta_model)
    if build == "meta":
        if missing is not None:
            raise ValueError(f"--build meta: module {missing} owns tensors but has no "
                             "reset_parameters() to initialize them on meta; use --build cpu")
        return True, meta_start_note(meta_model)
    size = tensor_bytes(meta_model)
    if local_ranks * size <= host_bytes and (device_bytes is None or size <= device_bytes):
        return False, ""
    where = (f"{local_ranks} whole cop{'y' if local_ranks == 1 else 'ies'} of {size / 1e9:.3g} "
             f"GB need more than the host's {host_bytes / 1e9:.3g} GB"
             if local_ranks * size > host_bytes else
             f"one whole copy of {size / 1e9:.3g} GB needs more than the device's free "
             f"{(device_bytes or 0) / 1e9:.3g} GB")
    if missing is not None:
        raise ValueError(f"the model cannot be built whole ({where}) and module {missing} "
                         "has no reset_parameters() to start on meta; add one, or run on "
                         "machines with more memory")
    return True, f"{meta_start_note(meta_model)}, since {where} (--build cpu builds it anyway)"


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
    :mod:`autopar.pipeline_split`): its unit modules as :func:`materialize`
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
