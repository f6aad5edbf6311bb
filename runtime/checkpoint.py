"""Save a :class:`~autopar.runtime.ParallelModel` and its optimizer, and load them
under any other plan: :func:`save`, :func:`load`, and :class:`Checkpointer` for
periodic saves (keep the last k, asynchronous writes) and resuming after a restart.
The format (:mod:`~autopar.runtime.checkpoint_state`) names tensors as the plain
model does, so a checkpoint moves between meshes, world sizes, ZeRO stages,
pipeline splits and recomputation; :func:`to_torch_file` and :func:`from_torch_file`
convert one to a single-file state dict a plain model loads, and back.
Details: docs/runtime.md, section ``autopar.runtime.checkpoint``.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from autopar.errors import CheckpointError
from autopar.runtime.agree import agreed
from autopar.runtime.checkpoint_state import (begin_partial, canonical_tensors, checkpoint_record, commit,
                                              committed_steps, flat_state, load_state,
                                              prune_checkpoints, read_commit, save_state)
from autopar.runtime.parallel_model import ParallelModel

__all__ = ["Resumed", "save", "load", "Checkpointer", "to_torch_file", "from_torch_file"]


@dataclass(frozen=True)
class Resumed:
    """What :func:`load` restored.

    Attributes:
        step: the step the checkpoint was saved after.
        extra: what the caller saved with it (JSON values: data position, scheduler).
        optimizer_restored: whether optimizer state came back (a checkpoint converted
            from plain weights has none; the optimizer then starts fresh).
        rng_restored: whether this rank's random generators came back (only where the
            saving job had a rank of this number).
        saved_mesh: the mesh of the plan it was saved under.
    """

    step: int
    extra: dict[str, Any] = field(default_factory=dict)
    optimizer_restored: bool = False
    rng_restored: bool = False
    saved_mesh: dict[str, int] = field(default_factory=dict)


def _tensors(model: ParallelModel, saving: bool) -> dict[str, list[torch.Tensor]]:
    if not isinstance(model, ParallelModel):
        raise CheckpointError(f"expected the ParallelModel that autopar.parallelize or "
                              f"apply_plan returned, got {type(model).__name__}")
    modules, later = model.state_modules()
    aliases, keys = model.names
    return canonical_tensors(modules, aliases, keys, later if saving else ())


def _record(model: ParallelModel, optimizer: torch.optim.Optimizer | None, step: int,
            extra: Mapping[str, Any] | None) -> dict[str, Any]:
    if not isinstance(step, int) or step < 0:
        raise CheckpointError(f"step must be a non-negative int, got {step!r}")
    extra = dict(extra or {})
    try:
        json.dumps(extra)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"extra must hold JSON values (numbers, strings, lists, dicts): "
                              f"{e}") from None
    return checkpoint_record(step, extra, model.plan.mesh, model.plan.model, model.names[0],
                             optimizer)


def save(path: str | os.PathLike, model: ParallelModel,
         optimizer: torch.optim.Optimizer | None = None, *, step: int = 0,
         extra: Mapping[str, Any] | None = None) -> None:
    """Save ``model`` and ``optimizer`` into the folder ``path`` (every rank, at once).

    Each rank writes its own shards with ``torch.distributed.checkpoint``; the folder
    appears under ``path`` only when complete (a job killed while saving leaves
    ``path.partial``, which nothing loads, and an older ``path`` untouched). ``step``
    and ``extra`` (JSON values: the data position, a scheduler's state) come back
    from :func:`load`, as do this rank's random generators."""
    with model.guarded(f"saving the checkpoint {path}"):
        meta = _record(model, optimizer, step, extra)
        save_state(path, _tensors(model, saving=True), optimizer, meta)


def load(path: str | os.PathLike, model: ParallelModel,
         optimizer: torch.optim.Optimizer | None = None) -> Resumed:
    """Load the checkpoint in folder ``path`` into ``model`` and ``optimizer`` (every
    rank, at once), whatever plan and world size saved it: parameters, buffers and
    optimizer state are resharded onto this plan's layout, tied weights come back as
    one. Build the optimizer over ``model.parameters()`` first, as for training.

    Raises :class:`CheckpointError` on every rank alike when any rank cannot load it (a
    folder missing or half written, a shard file missing, cut short or unreadable,
    another model's tensors), naming the folder and the file at fault."""
    tensors = _tensors(model, saving=False)
    with agreed(f"loading the checkpoint {path}"):
        try:
            meta = load_state(path, tensors, optimizer)
        except ValueError as e:  # checkpoint_state's messages, torch's errors among them
            raise CheckpointError(str(e)) from e.__cause__
    return Resumed(step=int(meta["step"]), extra=dict(meta.get("extra") or {}),
                   optimizer_restored=bool(meta["optimizer_restored"]),
                   rng_restored=bool(meta["rng_restored"]), saved_mesh=dict(meta["mesh"]))


class Checkpointer:
    """Periodic checkpoints in ``root`` (folders ``step-00000010``, ...) and resuming
    from the last complete one, for jobs that restart after a fault::

        ckpt = autopar.Checkpointer("ckpt", pm, opt, every=100, keep=3)
        resumed = ckpt.resume()          # None, or what the last checkpoint held
        first = resumed.step if resumed is not None else 0
        for step in range(first + 1, steps + 1):
            pm.step(x, y); opt.step(); opt.zero_grad()
            ckpt.step(step)              # saves every 100 steps
        ckpt.close()

    ``keep`` folders are kept (older ones are removed after a newer one commits).
    With ``async_save``, ``torch.distributed.checkpoint.async_save`` writes in the
    background over a gloo group of its own, and a save commits when the next one
    starts, or at :meth:`wait` / :meth:`close`.
    """

    def __init__(self, root: str | os.PathLike, model: ParallelModel,
                 optimizer: torch.optim.Optimizer | None = None, *, every: int = 1,
                 keep: int = 2, async_save: bool = False) -> None:
        if not isinstance(every, int) or every < 1 or not isinstance(keep, int) or keep < 1:
            raise CheckpointError(f"every and keep must be positive ints, got every={every!r}, "
                                  f"keep={keep!r}")
        self.root, self.model, self.optimizer = Path(root), model, optimizer
        self.every, self.keep, self.async_save = every, keep, async_save
        self._pending: tuple[Future, Path, Path, dict[str, Any]] | None = None
        self._group = dist.new_group(backend="gloo") if async_save else None

    def folder(self, step: int) -> Path:
        """The folder of the checkpoint after ``step``."""
        return self.root / f"step-{step:08d}"

    def latest(self) -> int | None:
        """The step of the last complete checkpoint, or None."""
        steps = committed_steps(self.root)
        return steps[-1] if steps else None

    def resume(self) -> Resumed | None:
        """Load the newest complete checkpoint that loads (None: there is none, start
        from scratch). A newer one that fails to load is skipped with a warning naming
        it and why, and renamed ``step-<n>.unloadable`` (nothing is deleted), so that
        the saves after the resumed step neither replace nor prune it. Raises
        :class:`CheckpointError` when checkpoints exist but none loads (all of them
        left as they are)."""
        skipped: list[tuple[Path, CheckpointError]] = []
        for step in reversed(committed_steps(self.root)):
            try:
                resumed = load(self.folder(step), self.model, self.optimizer)
            except CheckpointError as e:
                skipped.append((self.folder(step), e))
                continue
            for folder, error in skipped:
                aside = self._set_aside(folder)
                warnings.warn(f"resuming from {self.folder(step)} (step {step}): the newer "
                              f"checkpoint {folder} does not load, kept as {aside.name}: "
                              f"{error}", stacklevel=2)
            return resumed
        if skipped:
            raise CheckpointError(f"no checkpoint under {self.root} loads ({len(skipped)} "
                                  f"tried, all left in place); the newest: {skipped[0][1]}")
        return None

    def _set_aside(self, folder: Path) -> Path:
        """Rename the checkpoint ``folder`` that does not load to the first free name
        ``<folder>.unloadable[-k]`` (rank 0; every rank waits), out of the steps that
        saves replace and pruning removes; return the new path."""
        aside, k = folder.with_name(folder.name + ".unloadable"), 1
        while aside.exists():
            k += 1
            aside = folder.with_name(f"{folder.name}.unloadable-{k}")
        dist.barrier()  # every rank has looked before rank 0 renames
        if dist.get_rank() == 0:
            os.replace(folder, aside)
        dist.barrier()
        return aside

    def step(self, step: int, extra: Mapping[str, Any] | None = None) -> bool:
        """Save after ``step`` if it is a multiple of ``every``; True if it saved."""
        if step % self.every:
            return False
        self.save(step, extra)
        return True

    def save(self, step: int, extra: Mapping[str, Any] | None = None) -> None:
        """Save after ``step`` now (and drop the oldest beyond ``keep``)."""
        self.wait()
        final = self.folder(step)
        if not self.async_save:
            save(final, self.model, self.optimizer, step=step, extra=extra)
            self._prune()
            return
        with self.model.guarded(f"saving the checkpoint {final}"):
            meta = _record(self.model, self.optimizer, step, extra)
            tmp = begin_partial(final)
            state = flat_state(_tensors(self.model, saving=True), self.optimizer,
                               dist.get_rank())
            future = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self._group)
        self._pending = (future, tmp, final, meta)

    def wait(self) -> None:
        """Finish and commit a save still writing in the background."""
        if self._pending is None:
            return
        future, tmp, final, meta = self._pending
        self._pending = None
        with self.model.guarded(f"saving the checkpoint {final}"):
            future.result()  # rank 0's returns once every rank's shards are written
            if dist.get_rank() == 0:
                commit(tmp, final, meta)
            dist.barrier()
        self._prune()

    def _prune(self) -> None:
        prune_checkpoints(self.root, self.keep)

    def close(self) -> None:
        """Commit what is pending and release the background group."""
        self.wait()
        if self._group is not None:
            dist.destroy_process_group(self._group)
            self._group = None


def to_torch_file(src: str | os.PathLike, dst: str | os.PathLike) -> list[str]:
    """Write the model of checkpoint folder ``src`` as one ``torch.save`` file of full
    tensors that the plain model's ``load_state_dict`` takes (tied weights under each
    of their names); return the names. Runs in one process, no process group."""
    try:
        meta = read_commit(src)
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    tmp = Path(str(dst) + ".partial")
    dcp_to_torch_save(str(src), str(tmp))
    flat = torch.load(tmp, weights_only=True)
    state = {k[len("model."):]: v for k, v in flat.items() if k.startswith("model.")}
    for alias, first in meta.get("aliases", {}).items():
        if first in state:
            state[alias] = state[first]
    torch.save(state, tmp)
    os.replace(tmp, dst)
    return sorted(state)


def from_torch_file(src: str | os.PathLike, dst: str | os.PathLike, *,
                    model: str = "") -> list[str]:
    """Write a plain model's state dict file ``src`` (``torch.save(model.state_dict())``)
    as a checkpoint folder ``dst`` that :func:`load` reads under any plan (step 0, no
    optimizer state); return the names it keeps (one per tied weight). Runs in one
    process, no process group."""
    try:
        state = torch.load(src, weights_only=True, map_location="cpu")
    except Exception as e:  # noqa: BLE001 — torch.load raises many types
        raise CheckpointError(f"could not read {src} as a torch.save'd state dict ({e})") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{src} does not hold a state dict (a dict of tensors)")
    first: dict[tuple[int, tuple[int, ...]], str] = {}
    aliases: dict[str, str] = {}
    for name, t in state.items():  # a tied weight is saved once, under two names
        owner = first.setdefault((t.untyped_storage().data_ptr(), tuple(t.shape)), name)
        if owner != name:
            aliases[name] = owner
    final = Path(dst)
    tmp = final.with_name(final.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    kept = {f"model.{k}": v for k, v in state.items() if k not in aliases}
    with warnings.catch_warnings():  # "assuming ... a single process": it is one
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(kept, checkpoint_id=str(tmp), no_dist=True)
    commit(tmp, final, checkpoint_record(0, {}, {}, model, aliases, None))
    return sorted(k[len("model."):] for k in kept)
