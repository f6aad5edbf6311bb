"""A checkpoint any plan can load: tensors named as the plain model names them.

Every rank's share of the model and optimizer state goes to one
``torch.distributed.checkpoint`` (DCP) folder under the names of the user's model
(the first name of a tied weight), whatever the plan: DTensors keep their global
shape, so DCP reshards them on load for another mesh, world size or pipeline
split. A folder counts only once ``autopar.json`` is in it: it is written after every
rank's shards, and the folder is renamed into place. These functions use torch and
the standard library only; an emitted program carries copies of them
(:mod:`autopar.runtime.codegen_templates`). Format: docs/runtime.md, section
``autopar.runtime.checkpoint``.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
from pathlib import Path
from typing import Any, Collection, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

__all__ = ["state_names", "canonical_tensors", "optimizer_record", "checkpoint_record",
           "init_optimizer_state", "flat_state", "read_commit", "commit", "begin_partial",
           "save_state", "damaged_file", "unreadable", "load_state",
           "committed_steps", "prune_checkpoints", "attempt_store"]


def state_names(model: nn.Module) -> tuple[dict[str, str], frozenset[str]]:
    """What :func:`canonical_tensors` needs from the whole model (a ``meta`` one will
    do), before it is laid out or cut: each later name of a tensor held under several
    names -> its first, and the first names of its state dict's tensors."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    named = list(model.named_parameters(remove_duplicate=False)) + \
        list(model.named_buffers(remove_duplicate=False))
    for name, t in named:
        owner = first.setdefault(id(t), name)
        if owner != name:
            aliases[name] = owner
    return aliases, frozenset(aliases.get(k, k) for k in model.state_dict())


def optimizer_record(optimizer: torch.optim.Optimizer | None) -> list[dict[str, Any]]:
    """The hyperparameters of each parameter group (learning rate, betas, ...) as
    JSON values; tensors become numbers, what JSON cannot hold is left out."""
    groups = []
    for group in optimizer.param_groups if optimizer is not None else []:
        hyper: dict[str, Any] = {}
        for key, value in group.items():
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                value = value.item()
            if isinstance(value, tuple):
                value = list(value)
            if key != "params" and (value is None or isinstance(value, (bool, int, float, str))
                                    or (isinstance(value, list) and all(
                                        isinstance(v, (int, float)) for v in value))):
                hyper[key] = value
        groups.append(hyper)
    return groups


def checkpoint_record(step: int, extra: Mapping[str, Any], mesh: Mapping[str, int],
                      model: str, aliases: Mapping[str, str],
                      optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """The record ``autopar.json`` holds (JSON): the step and the caller's ``extra``,
    where it was saved (world size, mesh, model), the tied names, the optimizer's
    class and hyperparameters."""
    return {"format": "autopar-checkpoint", "version": 1, "step": step, "extra": dict(extra),
            "world_size": dist.get_world_size() if dist.is_initialized() else 1,
            "mesh": dict(mesh), "model": model, "aliases": dict(aliases),
            "optimizer": type(optimizer).__name__ if optimizer is not None else None,
            "param_groups": optimizer_record(optimizer),
            "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat()}


def canonical_tensors(modules: Sequence[nn.Module], aliases: Mapping[str, str],
                      keys: Collection[str], skip: Collection[tuple[int, str]] = (),
                      ) -> dict[str, list[torch.Tensor]]:
    """The model's name -> this rank's tensors of it (parameters and persistent
    buffers of ``modules``; several where a rank holds copies of a tied weight).

    ``aliases`` maps each later name of a tied tensor to its first; ``keys`` are the
    names of the model's state dict (what is not among them, such as a graph's
    constants, is left out); ``skip`` are (module index, name) pairs to leave out (a
    pipeline stage's later copy of a tied weight, when saving)."""
    wrappers = ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "_orig_mod.")
    out: dict[str, list[torch.Tensor]] = {}
    for index, module in enumerate(modules):
        named = list(module.named_parameters(remove_duplicate=False)) + \
            list(module.named_buffers(remove_duplicate=False))
        for name, t in named:
            if (index, name) in skip:
                continue
            for w in wrappers:
                name = name.replace(w, "")
            name = aliases.get(name, name)
            held = out.setdefault(name, []) if name in keys else []
            if name in keys and not any(x is t for x in held):
                held.append(t)
    return out


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter of ``optimizer`` its state (torch makes it at the first
    step), so that a load has tensors to fill: one step on zero gradients at learning
    rate 0, which changes no parameter; the gradients are then cleared."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if all(p in optimizer.state for p in params):
        return
    lrs = [g["lr"] for g in optimizer.param_groups]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    for g in optimizer.param_groups:
        g["lr"] = torch.zeros_like(g["lr"]) if isinstance(g["lr"], torch.Tensor) else 0.0
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs):
        g["lr"] = lr
    optimizer.zero_grad(set_to_none=True)


def _chunkable(t: torch.Tensor) -> torch.Tensor:
    """``t``, or, for a DTensor split piecewise (``_StridedShard``: a fused projection's
    pieces each split over the ranks, whose local rows DCP would take for one
    contiguous chunk and find overlapping), a copy replicated along those mesh axes."""
    if isinstance(t, DTensor) and any(type(p).__name__ == "_StridedShard"
                                      for p in t.placements):
        return t.redistribute(placements=[Replicate() if type(p).__name__ == "_StridedShard"
                                          else p for p in t.placements])
    return t


def flat_state(tensors: Mapping[str, Sequence[torch.Tensor]],
               optimizer: torch.optim.Optimizer | None, rank: int,
               originals: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """DCP's flat state dict: ``model.<name>`` for each tensor, ``optim.<name>.<key>``
    for each tensor of its optimizer state, ``rng.<rank>.cpu`` (and ``.cuda``) for this
    rank's random generators. A tensor DCP cannot chunk is replaced by a copy
    (:func:`_chunkable`), and ``originals`` (if given) maps its key to the tensor."""
    state: dict[str, torch.Tensor] = {}
    found: dict[str, torch.Tensor] = {}
    for name, held in tensors.items():
        found[f"model.{name}"] = held[0].detach()
        own = optimizer.state.get(held[0], {}) if optimizer is not None else {}
        for key, value in own.items():
            if isinstance(value, torch.Tensor):
                found[f"optim.{name}.{key}"] = value
    for key, t in found.items():
        state[key] = _chunkable(t)
        if originals is not None and state[key] is not t:
            originals[key] = t
    state[f"rng.{rank}.cpu"] = torch.get_rng_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state[f"rng.{rank}.cuda"] = torch.cuda.get_rng_state()
    return state


def _copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[...] = src`` for two tensors on this rank (DTensors redistributed to
    ``dst``'s placements)."""
    with torch.no_grad():
        if isinstance(src, DTensor) and isinstance(dst, DTensor):
            if any(type(p).__name__ == "_StridedShard" for p in dst.placements):
                src = distribute_tensor(src.full_tensor(), dst.device_mesh, dst.placements,
                                        src_data_rank=None)  # each rank cuts its pieces
            elif (src.device_mesh, src.placements) != (dst.device_mesh, dst.placements):
                src = src.redistribute(dst.device_mesh, dst.placements)
            dst.to_local().copy_(src.to_local())
        else:
            dst.copy_(src)


def read_commit(path: str | os.PathLike) -> dict[str, Any]:
    """The record ``autopar.json`` of a committed checkpoint folder; ValueError saying
    what is wrong for a folder that is missing, half written or not autopar's."""
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"no checkpoint at {folder}: not a folder")
    record = folder / "autopar.json"
    if not record.is_file():
        raise ValueError(f"{folder} is not a complete autopar checkpoint (no autopar.json: it "
                         "was half written when its job stopped, or not written by autopar); "
                         "load an earlier one")
    try:
        meta = json.loads(record.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{record} is not valid JSON ({e}); the checkpoint is damaged") from None
    if not isinstance(meta, dict) or meta.get("format") != "autopar-checkpoint":
        raise ValueError(f"{record} is not an autopar checkpoint record")
    if meta.get("version") != 1:
        raise ValueError(f"{folder} has checkpoint format version {meta.get('version')}; this "
                         "autopar reads version 1: upgrade autopar")
    return meta


def commit(tmp: Path, final: Path, meta: Mapping[str, Any]) -> None:
    """Write the record into the finished folder ``tmp`` and rename it to ``final``
    (an older ``final`` is removed only after)."""
    with open(tmp / "autopar.json", "w") as f:
        json.dump(meta, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    old = final.with_name(final.name + ".old")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def begin_partial(final: Path) -> Path:
    """The folder ``final.partial`` a save writes into, emptied of an earlier killed
    save's files (rank 0 removes them; every rank waits for it)."""
    tmp = final.with_name(final.name + ".partial")
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    return tmp


def save_state(path: str | os.PathLike, tensors: Mapping[str, Sequence[torch.Tensor]],
               optimizer: torch.optim.Optimizer | None, meta: Mapping[str, Any]) -> None:
    """Save on every rank into folder ``path``, committed with the record ``meta``
    (JSON: step, hyperparameters, what the caller keeps): the shards go to
    ``path.partial``, which becomes ``path`` once every rank has written."""
    final = Path(path)
    tmp = begin_partial(final)
    rank = dist.get_rank()
    dcp.save(flat_state(tensors, optimizer, rank), checkpoint_id=str(tmp))
    if rank == 0:  # dcp.save returns once every rank's shards and the metadata are written
        commit(tmp, final, meta)
    dist.barrier()


def _check_shapes(state: Mapping[str, torch.Tensor], saved: Mapping[str, Any],
                  folder: Path) -> None:
    """Every tensor asked for is in the checkpoint with the same global shape."""
    for key, t in state.items():
        if key.startswith("model.") and key not in saved:
            raise ValueError(f"the checkpoint {folder} has no '{key[6:]}'; was it saved from "
                             "another model?")
        size = getattr(saved.get(key), "size", None)
        if size is not None and tuple(size) != tuple(t.shape):
            raise ValueError(f"'{key.partition('.')[2]}' has shape {tuple(t.shape)} here but "
                             f"{tuple(size)} in the checkpoint {folder}; was it saved from "
                             "another model?")


def damaged_file(folder: Path, storage: Mapping[Any, Any]) -> str | None:
    """What is wrong with the first shard file of checkpoint ``folder`` that DCP's index
    (``storage``: its ``storage_data``, each item's file, offset and length) lists but
    that is missing or shorter than the bytes the index places in it; None when every
    file is there in full."""
    need: dict[str, int] = {}
    for item in storage.values():
        end = item.offset + item.length
        need[item.relative_path] = max(need.get(item.relative_path, 0), end)
    for name in sorted(need):
        file = folder / name
        if not file.is_file():
            return f"its file {name} is missing (its index lists it)"
        size = file.stat().st_size
        if size < need[name]:
            return (f"its file {name} has {size} bytes, fewer than the {need[name]} its index "
                    "lists: it was cut short (a full disk, or a copy that stopped)")
    return None


def unreadable(folder: Path, error: BaseException,
               storage: Mapping[Any, Any] | None) -> ValueError:
    """The ValueError for checkpoint ``folder`` whose files DCP could not read: it names
    the file at fault: DCP's index ``.metadata`` (``storage`` None: the index itself
    failed), a shard file that is missing or cut short (:func:`damaged_file`), or the
    file ``error`` names; else it quotes the first failing rank's exception."""
    what = damaged_file(folder, storage) if storage is not None else None
    if what is None:
        cause = error
        failures = getattr(error, "failures", None)  # CheckpointException: rank -> (error, trace)
        if isinstance(failures, dict) and failures:
            cause = failures[min(failures)][0]
        line = (str(cause).strip().splitlines() or [""])[0]
        named = getattr(cause, "filename", None)
        file = "its index file .metadata" if storage is None else \
            f"its file {Path(named).name}" if named else "its shard files"
        what = f"reading {file} raised {type(cause).__name__}: {line}"
    return ValueError(f"cannot load the checkpoint {folder}: {what}; load an earlier "
                      "checkpoint, or copy this one again")


def load_state(path: str | os.PathLike, tensors: Mapping[str, Sequence[torch.Tensor]],
               optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """Fill ``tensors`` (every copy) and the optimizer's state from the committed
    checkpoint ``path``, resharded onto this rank's layout; restore this rank's
    random generators where the checkpoint has them, and the optimizer's
    hyperparameters. Returns the checkpoint's record, with ``optimizer_restored`` and
    ``rng_restored`` added."""
    folder = Path(path)
    meta = read_commit(folder)
    try:
        index = dcp.FileSystemReader(str(folder)).read_metadata()
    except Exception as e:  # noqa: BLE001 - unpickling a damaged index raises any type
        raise unreadable(folder, e, None) from e
    saved = index.state_dict_metadata
    has_optim = any(k.startswith("optim.") for k in saved)
    if optimizer is not None and has_optim:
        init_optimizer_state(optimizer)
    rank = dist.get_rank()
    originals: dict[str, torch.Tensor] = {}
    state = flat_state(tensors, optimizer if has_optim else None, rank, originals)
    rng = {k: state.pop(k) for k in list(state) if k.startswith("rng.")}
    state.update({k: v.clone() for k, v in rng.items() if k in saved})
    _check_shapes(state, saved, folder)
    state = {k: v for k, v in state.items() if k in saved}
    try:
        dcp.load(state, checkpoint_id=str(folder))
    except (Exception, dcp.CheckpointException) as e:  # the latter derives from BaseException
        raise unreadable(folder, e, index.storage_data) from e
    for key, t in originals.items():  # loaded into a chunkable copy: back into place
        if key in state:
            _copy_into(t, state[key])
    for name, held in tensors.items():  # a rank's later copies of a tied weight
        for t in held[1:]:
            _copy_into(t.detach(), held[0].detach())
            if optimizer is not None and has_optim:
                for key, value in optimizer.state.get(held[0], {}).items():
                    if isinstance(value, torch.Tensor):
                        _copy_into(optimizer.state[t][key], value)
    if f"rng.{rank}.cpu" in state:
        torch.set_rng_state(state[f"rng.{rank}.cpu"])
    if f"rng.{rank}.cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state[f"rng.{rank}.cuda"])
    groups = meta.get("param_groups") or []
    if optimizer is not None and has_optim and len(groups) == len(optimizer.param_groups):
        for group, hyper in zip(optimizer.param_groups, groups):
            for key, value in hyper.items():
                old = group.get(key)
                if isinstance(old, torch.Tensor):
                    old.fill_(value)
                else:
                    group[key] = tuple(value) if isinstance(old, tuple) else value
    return dict(meta, optimizer_restored=optimizer is not None and has_optim,
                rng_restored=f"rng.{rank}.cpu" in state)


def committed_steps(root: str | os.PathLike) -> list[int]:
    """The steps of the committed ``step-<n>`` checkpoint folders under ``root``, in
    ascending order (half-written folders are not among them)."""
    folder = Path(root)
    if not folder.is_dir():
        return []
    steps = []
    for child in folder.iterdir():
        tail = child.name.removeprefix("step-")
        if child.name.startswith("step-") and tail.isdigit() and \
                (child / "autopar.json").is_file():
            steps.append(int(tail))
    return sorted(steps)


def prune_checkpoints(root: str | os.PathLike, keep: int) -> None:
    """Remove all but the last ``keep`` committed ``step-<n>`` folders under ``root``
    (rank 0 removes; every rank waits for it)."""
    if dist.get_rank() == 0:
        for step in committed_steps(root)[:-keep]:
            shutil.rmtree(Path(root) / f"step-{step:08d}", ignore_errors=True)
    dist.barrier()


def attempt_store(rank: int, world: int, timeout: datetime.timedelta) -> dist.Store:
    """torchrun's store, with this attempt's keys apart from earlier attempts'.

    Under ``torchrun --max-restarts``, every attempt's workers meet in the agent's
    store, which outlives them; with torch's own ``env://`` set-up a restarted gloo
    group reads the peer addresses the killed attempt left there and fails to connect
    (torch 2.13, seen here). A prefix per attempt (``TORCHELASTIC_RESTART_COUNT``)
    keeps each attempt's keys its own."""
    hosted = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"  # else the agent's
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=hosted and rank == 0, timeout=timeout)
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    return dist.PrefixStore(f"autopar/attempt_{attempt}", store)
