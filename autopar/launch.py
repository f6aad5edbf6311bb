"""Run a function on N local gloo processes (spawned) and collect rank 0's result:
the launcher behind `autopar demo` and the multi-process tests."""

from __future__ import annotations

import os
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn, args, q) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        res = fn(*args)
        if rank == 0:
            q.put(("ok", res))
    except BaseException:  # report the failure to the parent instead of hanging
        q.put(("error", f"rank {rank}:\n{traceback.format_exc()}"))
    finally:
        dist.destroy_process_group()


def run_ranks(world: int, fn, *args, timeout: float = 600):
    """Run ``fn(*args)`` on ``world`` gloo processes; return rank 0's return value."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, args, q)) for r in range(world)]
    for p in procs:
        p.start()
    status, value = q.get(timeout=timeout)
    for p in procs:
        p.join(timeout=60)
        if p.is_alive():
            p.kill()
    if status != "ok":
        raise RuntimeError(value)
    return value
