"""Collective measurements of ``autopar profile`` and their α-β fit.

Run under ``torchrun --nproc-per-node N`` (N > 1): every rank calls
:func:`measure_collectives`; NCCL on CUDA, gloo on CPU. Each point is the median over
repeats of the slowest rank's time (a MAX all-reduce of the per-rank medians).

Message sizes follow nccl-tests' convention, the same as :mod:`autopar.cost_models.comm`'s ``B``:
all_reduce the buffer, all_gather the gathered (full) tensor, reduce_scatter the full
input, all_to_all the bytes each rank holds, send_recv the message (one way of a
ping-pong between ranks 0 and 1).

Fit (:func:`fit_alpha_beta`): ``t = α + bytes/β`` per collective and group size, by
least squares on the *relative* residuals ``(α + B/β - t)/t`` so that small messages
(which set α) weigh as much as large ones (which set β). β is then the algorithm
bandwidth. The ring factor ``f`` (2(n-1)/n for all_reduce, (n-1)/n for all_gather,
reduce_scatter and all_to_all, 1 for send_recv; Thakur et al. 2005, as in
:mod:`autopar.cost_models.comm`) turns it into the per-link bandwidth of the ring
model, ``β·f`` (nccl-tests' "bus bandwidth"), and α into the per-step latency
``α / steps`` with steps = 2(n-1) for all_reduce, n-1 for the others and 1 for
send_recv.

This module imports ``torch.distributed`` inside its functions only, so that importing
the profiler never pulls it in.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

import torch

from autopar.cost_models.profiling.timing import Timer, sig

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
"""The collectives measured, in order."""


@dataclass(frozen=True)
class AlphaBeta:
    """``t = alpha + bytes / beta`` (seconds, bytes/s), with the fit's largest
    relative residual."""

    alpha: float
    beta: float
    max_rel_error: float


def fit_alpha_beta(sizes: list[float], times: list[float]) -> AlphaBeta:
    """Least squares on relative residuals of ``t = α + B/β`` (module docstring).
    α is clamped at 0; β at 1e-30 s/byte inverse (a flat curve)."""
    import numpy as np

    b = np.asarray(sizes, dtype=float)
    t = np.asarray(times, dtype=float)
    if len(b) < 2:
        raise ValueError("an α-β fit needs at least two message sizes")
    x = np.stack([1.0 / t, b / t], axis=1)  # (α + B·γ)/t ≈ 1, γ = 1/β
    (alpha, gamma), *_ = np.linalg.lstsq(x, np.ones_like(t), rcond=None)
    alpha, gamma = max(float(alpha), 0.0), max(float(gamma), 1e-30)
    pred = alpha + b * gamma
    return AlphaBeta(alpha=alpha, beta=1.0 / gamma,
                     max_rel_error=float(np.max(np.abs(pred - t) / t)))


def ring_factor(kind: str, n: int) -> tuple[float, int]:
    """(bandwidth factor, latency steps) of the ring algorithm for ``kind`` on n ranks."""
    if kind == "send_recv":
        return 1.0, 1
    if kind == "all_reduce":
        return 2 * (n - 1) / n, 2 * (n - 1)
    return (n - 1) / n, n - 1


FIT_FORMULA = ("t = alpha_s + bytes / beta_bytes_per_s (least squares on relative "
               "residuals); ring link bandwidth = beta · ring_factor (bus bandwidth), "
               "per-step latency = alpha / latency_steps")
"""How to read a fit of :func:`fit_table` (stored beside the fits in the profile)."""


def fit_table(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """α-β fits of measured collective rows, keyed ``"<op>/<world>"``."""
    fits: dict[str, Any] = {}
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in rows:
        if "seconds" in r:
            groups.setdefault((r["op"], r["world"]), []).append(r)
    for (op, n), pts in sorted(groups.items()):
        if len(pts) < 2:
            continue
        ab = fit_alpha_beta([p["bytes"] for p in pts], [p["seconds"] for p in pts])
        f, steps = ring_factor(op, n)
        fits[f"{op}/{n}"] = {
            "op": op, "world": n, "alpha_s": sig(ab.alpha), "beta_bytes_per_s": sig(ab.beta),
            "max_rel_error": sig(ab.max_rel_error, 2), "ring_factor": sig(f),
            "latency_steps": steps, "bus_bandwidth_bytes_per_s": sig(ab.beta * f),
            "alpha_per_step_s": sig(ab.alpha / steps),
        }
    return fits


def _op(kind: str, nbytes: int, rank: int, world: int,
        device: torch.device) -> Callable[[], Any]:
    """A closure running one ``kind`` collective of ``nbytes`` (fp32 elements)."""
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
                fn = _op(kind, nbytes, rank, world, device)
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
