"""Collective timings of ``autopar profile``, under ``torchrun --nproc-per-node N``
(N > 1): every rank calls :func:`measure_collectives`; NCCL on CUDA, gloo on CPU. Each
point is the median over repeats of the slowest rank's time (a MAX all-reduce of the
per-rank medians); :func:`autopar.cost_models.profiling.fit.fit_table` fits them.

Message sizes B follow nccl-tests' convention, the same as
:mod:`autopar.cost_models.comm`'s: all_reduce the buffer, all_gather the gathered
(full) tensor, reduce_scatter the full input, all_to_all the bytes each rank holds,
send_recv the message (one way of a ping-pong between ranks 0 and 1).
``torch.distributed`` is imported inside the functions only.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch

from autopar.cost_models.profiling.timing import Timer, sig

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
"""The collectives measured, in order."""


def collective_call(kind: str, nbytes: int, rank: int, world: int,
                    device: torch.device) -> Callable[[], Any]:
    """A closure running one ``kind`` collective of ``nbytes`` (fp32 elements; B as in
    the module docstring) on the current process group, as ``rank`` of ``world``."""
    import torch.distributed as dist

    n = max(world, nbytes // 4 // world * world)  # elements, a multiple of world
    full = torch.randn(n, device=device)
    part = torch.empty(n // world, device=device)
    if kind == "all_reduce":
        return lambda: dist.all_reduce(full)
    if kind == "all_gather":
        return lambda: dist.all_gather_into_tensor(full, part)
    if kind == "reduce_scatter":
        return lambda: dist.reduce_scatter_tensor(part, full)
    if kind == "all_to_all":
        out = torch.empty_like(full)
        return lambda: dist.all_to_all_single(out, full)

    def ping_pong() -> None:  # rank 0 -> 1 -> 0; ranks >= 2 idle
        if rank == 0:
            dist.send(full, 1)
            dist.recv(full, 1)
        elif rank == 1:
            dist.recv(full, 0)
            dist.send(full, 0)
    return ping_pong


def measure_collectives(sizes: list[int], device: torch.device, reps: int = 10,
                        skip: frozenset[str] = frozenset(),
                        emit: Callable[[dict[str, Any]], None] | None = None) -> list[dict]:
    """Time every collective at every size on the current process group; every rank
    calls this; rows (rank 0's, also passed to ``emit`` one by one) carry the median
    of the slowest rank over ``reps`` timed calls (10: enough for a median of calls
    that each synchronize every rank; chosen). Keys in ``skip`` (``"<op>:<bytes>"``) are not measured."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    timer = Timer(device)
    rows = []
    for kind in COLLECTIVES:
        for nbytes in sizes:
            key = f"{kind}:{nbytes}:{world}"
            if key in skip:
                continue
            row: dict[str, Any] = {"op": kind, "world": world, "bytes": nbytes,
                                   "key": key, "backend": dist.get_backend()}
            try:
                fn = collective_call(kind, nbytes, rank, world, device)
                for _ in range(3):  # warm-up: NCCL communicators and buffers
                    fn()
                times = []
                for _ in range(reps):
                    dist.barrier()
                    timer.sync()
                    times.append(timer.batch(fn, 1))
                med = torch.tensor([sorted(times)[len(times) // 2]], dtype=torch.float64,
                                   device=device)
                dist.all_reduce(med, op=dist.ReduceOp.MAX)
                sec = float(med.item()) / (2 if kind == "send_recv" else 1)
                row.update(seconds=sig(sec), reps=reps, alg_bytes_per_s=sig(nbytes / sec))
            except Exception as e:  # noqa: BLE001 — record it, go on with the rest
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            rows.append(row)
            if emit is not None and rank == 0:
                emit(row)
    return rows


def init_from_env(device_type: str) -> tuple[int, int] | None:
    """Join the torchrun process group (NCCL on CUDA, gloo on CPU) when WORLD_SIZE > 1;
    returns (rank, world) or None when running as a single process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return None
    import torch.distributed as dist

    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
    return dist.get_rank(), dist.get_world_size()
