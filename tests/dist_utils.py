"""The multi-process test launcher: :mod:`autopar.launch`, re-exported for the tests, and
:class:`RankPool`, which keeps one gloo group of each size alive for the whole session.

Starting a rank costs seconds (each spawned process imports torch, DTensor and the
pipelining package), more than most multi-rank tests spend training. The ``rank_pool``
fixture (``tests/conftest.py``) hands out one :class:`RankPool`; ``rank_pool.run(4, fn,
...)`` runs ``fn`` on the pool's 4 ranks as :func:`run_distributed` would on 4 fresh
ones, starting them on first use only. Every task starts from the random state of a
fresh process, and the process groups it made are destroyed after it; a failing or
timed-out task ends its ranks, and the next call starts new ones, so a hung collective
never leaks into another test.
"""

from __future__ import annotations

import datetime
import functools
import gc
import os
import pickle
import queue
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from autopar.launch import RankFailure, free_port, run_distributed

__all__ = ["RankFailure", "RankPool", "run_distributed", "free_port"]

GROUP_TIMEOUT_S = 900
"""How long a pooled rank waits in a collective before gloo gives up (the parent ends
the ranks sooner, after the task's own ``timeout_s``)."""


def _next_task(tasks: Any) -> bytes | None:
    """The next task for this rank; None once the parent is gone (so a killed test
    session leaves no rank waiting)."""
    while True:
        try:
            return tasks.get(timeout=5)
        except queue.Empty:
            if not mp.parent_process().is_alive():
                return None


def _release_task_groups() -> None:
    """Destroy the process groups a task made (the sub-groups of its device meshes) and
    free them, so that their gloo threads end: each group keeps a thread that wakes
    every few milliseconds, and a few hundred of them take a core.

    DTensor caches the device meshes a task used (sharding propagation, in Python and
    C++; redistribution plans; ``functools`` caches keyed on meshes), and a later mesh
    of the same shape compares equal to a cached one whatever its groups: the caches
    are cleared, or a later task would get a mesh of destroyed groups. The default
    group stays, so group names are never reused. Private API (torch 2.13): the cache
    clearing functions and ``_world.pg_map``, the registry of live groups."""
    from torch.distributed.distributed_c10d import _world
    from torch.distributed.tensor._redistribute import clear_redistribute_planner_cache
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    clear_redistribute_planner_cache()
    for obj in gc.get_objects():
        if (type(obj) is functools._lru_cache_wrapper
                and getattr(obj, "__module__", "").startswith("torch.distributed")):
            obj.cache_clear()
    for group in list(_world.pg_map):
        if group is not dist.group.WORLD:
            dist.destroy_process_group(group)
    gc.collect()


def _serve(rank: int, world: int, port: int, tasks: Any, results: Any) -> None:
    """Body of one pooled rank: join the group, then run tasks until killed or orphaned."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    seed = torch.initial_seed()
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    while (task := _next_task(tasks)) is not None:
        torch.manual_seed(seed)  # the random state of a fresh process
        try:
            fn, args, kwargs = pickle.loads(task)
            results.put((rank, True, pickle.dumps(fn(*args, **kwargs))))
        except BaseException:  # report to the parent instead of leaving it waiting
            results.put((rank, False, traceback.format_exc()))
        _release_task_groups()


def _end(procs: list[Any], wait_s: float) -> None:
    """Wait up to ``wait_s`` seconds in all for ``procs`` to exit; kill the rest."""
    deadline = time.monotonic() + wait_s
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()


@dataclass
class _Group:
    """The processes of one pooled group and their queues."""

    procs: list[Any]
    tasks: list[Any]
    results: Any = field(repr=False)


class RankPool:
    """Gloo groups of 1, 2, 4... ranks, each started on first use and kept for reuse."""

    def __init__(self) -> None:
        self._groups: dict[int, _Group] = {}

    def run(self, world: int, fn: Callable[..., Any], *args: Any, timeout_s: float = 300,
            **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on the pool's ``world`` ranks; the results in rank
        order. Raises :class:`RankFailure` as :func:`run_distributed` does."""
        group = self._groups.get(world) or self._start(world)
        task = pickle.dumps((fn, args, kwargs))
        for q in group.tasks:
            q.put(task)
        values: dict[int, Any] = {}
        failure: str | None = None
        while len(values) < world and failure is None:
            try:
                rank, ok, value = group.results.get(timeout=timeout_s)
            except queue.Empty:
                failure = (f"ranks {sorted(set(range(world)) - set(values))} did not finish "
                           f"within {timeout_s:.0f} s")
                break
            if ok:
                values[rank] = pickle.loads(value)
            else:
                failure = f"rank {rank} of {world} failed:\n{value}"
        if failure is not None:  # the others may be stuck in a collective: end the group
            _end(self._groups.pop(world).procs, wait_s=0.5)
            raise RankFailure(failure)
        return [values[r] for r in range(world)]

    def discard(self, world: int) -> None:
        """End the pool's group of ``world`` ranks (a task left its connections cut, as
        a failure shared by :mod:`autopar.runtime.failure_watch` does); the next use
        starts a new one."""
        group = self._groups.pop(world, None)
        if group is not None:
            _end(group.procs, wait_s=0)

    def close(self) -> None:
        """End every group. Its ranks are idle, waiting for a task: they are killed, as
        an interpreter with torch loaded takes seconds to exit on its own."""
        _end([p for group in self._groups.values() for p in group.procs], wait_s=0)
        self._groups.clear()

    def _start(self, world: int) -> _Group:
        """Spawn the ``world`` ranks of a new group."""
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        tasks = [ctx.Queue() for _ in range(world)]
        port = free_port()
        procs = [ctx.Process(target=_serve, args=(r, world, port, tasks[r], results),
                             daemon=True) for r in range(world)]
        for p in procs:
            p.start()
        self._groups[world] = _Group(procs, tasks, results)
        return self._groups[world]

