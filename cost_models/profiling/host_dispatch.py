"""Host seconds of eager execution on a GPU: per op, in checkpointed regions, and per
parameter of the optimizer step (:data:`DISPATCH_KEYS`, :func:`dispatch_overhead`).

On a GPU the host issues kernels while the device runs earlier ones, and a step takes
the longer of the two (exposed host time, :mod:`autopar.cost_models.host`); the device
side comes from the measured tables, the host side from here. Each figure is seconds
per op of a chain of tiny ops with autograd recording, so the wall time is the host's:
per op kind (:func:`op_dispatch`), what full and selective checkpoint regions add
(:func:`checkpoint_dispatch`), and the fused AdamW step per parameter
(:func:`optimizer_dispatch`). What each figure counts: docs/profiling.md; FSDP2's hooks
and DTensor are in :mod:`.host_wrappers`.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from autopar.cost_models.profiling.timing import (backward_times, median_difference,
                                                  median_time, paired_times)

OP_KINDS = ("matmul", "attention", "norm", "pointwise", "view", "embedding")
"""Op kinds whose host time is measured (:func:`autopar.cost_models.host.op_kind` maps a graph op to one)."""

DISPATCH_KEYS = tuple(f"op_{k}_{p}" for k in OP_KINDS for p in ("fwd", "bwd")) + (
    "ckpt_op_fwd", "ckpt_op_bwd", "sac_op_fwd", "sac_op_bwd", "optimizer_param",
    "optimizer_param_fsdp")
"""The figures :func:`dispatch_overhead` measures."""

_CHAIN, _REPS, _CALLS = 32, 5, 20


def _per_op(make: Callable[[], tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor]],
            sync: Callable[[], None]) -> tuple[float, float]:
    """(forward, backward) host seconds per op of a chain of ``_CHAIN`` calls of the op
    that ``make`` returns, with its input."""
    op, x = make()

    def fwd() -> torch.Tensor:
        y = x
        for _ in range(_CHAIN):
            y = op(y)
        return y

    def both() -> None:
        fwd().float().sum().backward()
    f = median_time(fwd, sync, _REPS, _CALLS, warmup=5)
    b = median_time(both, sync, _REPS, _CALLS, warmup=5)
    return f / _CHAIN, max(0.0, b - f) / _CHAIN


def _ops(dev: torch.device) -> dict[str, Callable[[], tuple[Any, torch.Tensor]]]:
    """One maker per kind of :data:`OP_KINDS`: (op, input), shapes kept tiny."""
    lp = torch.bfloat16 if dev.type == "cuda" else torch.float32

    def matmul():
        lin = nn.Linear(16, 16, device=dev, dtype=lp)
        return lin, torch.randn(4, 16, device=dev, dtype=lp, requires_grad=True)

    def attention():
        def op(t):
            return F.scaled_dot_product_attention(t, t, t, is_causal=True)
        return op, torch.randn(1, 2, 16, 16, device=dev, dtype=lp, requires_grad=True)

    def norm():
        ln = nn.LayerNorm(16, device=dev, dtype=lp)
        return ln, torch.randn(4, 16, device=dev, dtype=lp, requires_grad=True)

    def pointwise():
        w = torch.randn(16, device=dev, dtype=lp, requires_grad=True)
        return (lambda t: t * w), torch.randn(4, 16, device=dev, dtype=lp, requires_grad=True)

    def view():
        return (lambda t: t.view(t.shape[1], t.shape[0])), \
            torch.randn(4, 16, device=dev, dtype=lp, requires_grad=True)

    def embedding():
        emb = nn.Embedding(64, 16, device=dev, dtype=lp)
        return emb, torch.randint(0, 64, (4,), device=dev)
    return {"matmul": matmul, "attention": attention, "norm": norm, "pointwise": pointwise,
            "view": view, "embedding": embedding}


def op_dispatch(dev: torch.device, sync: Callable[[], None]) -> dict[str, float]:
    """``op_<kind>_fwd`` / ``op_<kind>_bwd`` for every kind of :data:`OP_KINDS`."""
    out: dict[str, float] = {}
    for kind, make in _ops(dev).items():
        if kind == "embedding":
            out.update(_embedding(make, sync))
            continue
        f, b = _per_op(make, sync)
        out[f"op_{kind}_fwd"], out[f"op_{kind}_bwd"] = f, b
    return out


def _embedding(make: Callable[[], tuple[Any, torch.Tensor]],
               sync: Callable[[], None]) -> dict[str, float]:
    """An embedding cannot feed its output to itself: ``_CHAIN`` lookups of one index
    tensor, stacked and summed."""
    emb, idx = make()

    def fwd() -> list[torch.Tensor]:
        return [emb(idx) for _ in range(_CHAIN)]

    def both() -> None:
        torch.stack(fwd()).float().sum().backward()
    f = median_time(fwd, sync, _REPS, _CALLS, warmup=5)
    b = median_time(both, sync, _REPS, _CALLS, warmup=5)
    return {"op_embedding_fwd": f / _CHAIN, "op_embedding_bwd": max(0.0, b - f) / _CHAIN}


def checkpoint_dispatch(dev: torch.device, sync: Callable[[], None],
                        pointwise_fwd: float) -> dict[str, float]:
    """``ckpt_op_fwd`` / ``ckpt_op_bwd`` and ``sac_op_fwd`` / ``sac_op_bwd``: per op,
    what a full (``torch.utils.checkpoint``, non-reentrant: saved-tensor hooks that pack
    in forward and re-run the region on the first unpack) and a selective checkpoint
    region (the same with the runtime's
    :func:`~autopar.runtime.recompute.selective_context` dispatch mode) add to a chain of
    pointwise ops (module docstring), from paired repetitions; ``pointwise_fwd`` is the
    plain op's forward host time, taken out of the backward's re-run (it is priced as
    the op's forward issued again)."""
    from torch.utils.checkpoint import checkpoint

    from autopar.runtime.recompute import selective_context

    lp = torch.bfloat16 if dev.type == "cuda" else torch.float32
    w = torch.randn(16, device=dev, dtype=lp, requires_grad=True)
    x = torch.randn(4, 16, device=dev, dtype=lp, requires_grad=True)

    def chain(t: torch.Tensor) -> torch.Tensor:
        for _ in range(_CHAIN):
            t = t * w
        return t

    def full(t: torch.Tensor) -> torch.Tensor:
        return checkpoint(chain, t, use_reentrant=False)

    def selective(t: torch.Tensor) -> torch.Tensor:
        return checkpoint(chain, t, use_reentrant=False, context_fn=selective_context)
    fns = [g for fn in (chain, full, selective)
           for g in ((lambda fn=fn: fn(x)), (lambda fn=fn: fn(x).float().sum().backward()))]
    times = paired_times(fns, sync, 2 * _REPS + 1, _CALLS, warmup=5)
    fwd = times[0::2]
    bwd = [backward_times(tf, tb) for tf, tb in zip(times[0::2], times[1::2])]
    out: dict[str, float] = {}
    for k, key in ((1, "ckpt_op"), (2, "sac_op")):
        out[f"{key}_fwd"] = max(0.0, median_difference(fwd[0], fwd[k])) / _CHAIN
        out[f"{key}_bwd"] = max(0.0, median_difference(bwd[0], bwd[k]) / _CHAIN - pointwise_fwd)
    return out


def optimizer_dispatch(mesh: Any, sync: Callable[[], None]) -> dict[str, float]:
    """``optimizer_param`` / ``optimizer_param_fsdp``: host seconds per parameter of a
    fused AdamW step and ``zero_grad`` over a unit of 16 tiny parameters, plain and laid
    out by FSDP2 on ``mesh`` (one process), measured as (backward + step) − backward."""
    from torch.distributed.fsdp import fully_shard

    dev = torch.device(mesh.device_type)
    x = torch.randn(4, 8, device=dev)
    out: dict[str, float] = {}
    for key, wrap in (("optimizer_param", False), ("optimizer_param_fsdp", True)):
        unit = nn.Sequential(*(nn.Linear(8, 8) for _ in range(8))).to(dev)
        if wrap:
            fully_shard(unit, mesh=mesh)
        params = list(unit.parameters())
        opt = torch.optim.AdamW(params, lr=1e-6, fused=True if dev.type == "cuda" else None)

        def grads() -> None:
            unit(x).sum().backward()

        def stepped() -> None:
            grads()
            opt.step()
            opt.zero_grad(set_to_none=True)
        g = median_time(grads, sync, _REPS, _CALLS, warmup=5)
        s = median_time(stepped, sync, _REPS, _CALLS, warmup=5)
        out[key] = max(0.0, s - g) / len(params)
    return out


def dispatch_overhead(mesh: Any, sync: Callable[[], None],
                      say: Callable[[str], None] | None = None) -> dict[str, float]:
    """Every figure of :data:`DISPATCH_KEYS` on ``mesh``'s device (a mesh of this
    process alone, for the FSDP2 figure); ``say(phase)`` as each phase starts."""
    say = say or (lambda phase: None)
    dev = torch.device(mesh.device_type)
    say("dispatch per op")
    out = op_dispatch(dev, sync)
    say("activation checkpointing per op")
    out.update(checkpoint_dispatch(dev, sync, out["op_pointwise_fwd"]))
    say("optimizer step per parameter")
    out.update(optimizer_dispatch(mesh, sync))
    return out
