"""Run a function on N local gloo processes and collect every rank's result: the
launcher behind ``autopar demo`` and the multi-process tests.

:func:`run_distributed` runs each rank on a fresh gloo process group (CPU) and
returns the results in rank order; a failing rank makes it raise :class:`RankFailure`
with that rank's traceback. Its docstring shows the usage and what ``fn`` must be.
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue
import socket
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["RankFailure", "run_distributed", "free_port"]


class RankFailure(RuntimeError):
    """A rank raised (the message holds its traceback) or the ranks timed out."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(rank: int, world: int, port: int, timeout_s: float, fn: Callable[..., Any],
               args: tuple, kwargs: dict, results: Any) -> None:
    """Body of one spawned rank: join the group, run ``fn``, report, leave."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
        value = fn(*args, **kwargs)
        # plain pickle bytes: tensors are copied, not shared through file descriptors
        # that would close when this process exits
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:  # report to the parent instead of leaving the others waiting
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(world: int, fn: Callable[..., Any], *args: Any, timeout_s: float = 300,
                    **kwargs: Any) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world`` gloo ranks; return the results in rank order.

    Raises :class:`RankFailure` with the first failing rank's traceback, or when the
    ranks have not all finished within ``timeout_s`` seconds.

    Usage::

        def work(scale: float) -> float:    # module level, so a spawned process can import it
            t = torch.ones(1) * (dist.get_rank() + 1) * scale
            dist.all_reduce(t)
            return t.item()

        results = run_distributed(2, work, 1.0)  # [3.0, 3.0]: one entry per rank, in rank order

    Each rank runs with ``torch.set_num_threads(1)`` on a fresh gloo process group (CPU);
    ``fn`` and its arguments and return values must be picklable (results travel as
    pickled bytes, so tensors come back as copies). When a rank raises, the call raises
    :class:`RankFailure` carrying that rank's traceback, and ends the other ranks rather
    than letting them wait forever on a collective. Spawning costs a few seconds per rank
    (each process imports torch), so run several configurations in one call.
    """
    if world < 1:
        raise ValueError(f"world must be a positive number of ranks, got {world}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main,
                         args=(r, world, port, timeout_s, fn, args, kwargs, results), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    values: dict[int, Any] = {}
    failure: str | None = None
    try:
        while len(values) < world and failure is None:
            try:
                rank, ok, value = results.get(timeout=timeout_s)
            except queue.Empty:
                failure = f"ranks {sorted(set(range(world)) - set(values))} did not finish " \
                          f"within {timeout_s:.0f} s"
                break
            if ok:
                values[rank] = pickle.loads(value)
            else:
                failure = f"rank {rank} of {world} failed:\n{value}"
    finally:
        for p in procs:
            p.join(timeout=5 if failure is None else 0.5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    if failure is not None:
        raise RankFailure(failure)
    return [values[r] for r in range(world)]
