"""Host time of a training step on a device that the host runs ahead of (a GPU).

Eager PyTorch issues kernels asynchronously: the host runs Python, autograd, the
parallel wrappers' hooks and the kernel launches while the device runs the kernels
issued before. Each op thus costs two times, device seconds (the tables of
:mod:`autopar.cost_models.compute`) and host seconds (here), and a step takes the
longer path through both (:func:`autopar.solvers.problem.evaluate`). On the H100
measured 2026-11-23 the host of a 1.3B GPT's forward+backward at micro-batch 1 took
about 130 ms against 48 ms of kernels (benchmarks/results/h100_runtime_steps.json).

Host seconds come from the profile's ``host_overhead_s``
(:mod:`autopar.cost_models.profiling.host_dispatch`,
:mod:`autopar.cost_models.profiling.host_wrappers`),
each measured on chains of tiny ops, where the wall time is the host's:

* per op, forward and backward, by kind (:func:`op_kind`): ``op_<kind>_fwd`` /
  ``op_<kind>_bwd``; an op whose forward moves no bytes (a view) is of kind ``view``;
* per parameter FSDP2 lays out, per micro-batch: ``fsdp_param_fwd`` / ``fsdp_param_bwd``;
* per parameter per step, the optimizer step and ``zero_grad``: ``optimizer_param`` on
  plain tensors, ``optimizer_param_fsdp`` on DTensors (FSDP2's or tensor parallelism's);
* per op under full recomputation: ``ckpt_op_fwd`` / ``ckpt_op_bwd`` (the checkpoint's
  saved-tensor hooks and re-run bookkeeping), and under selective recomputation:
  ``sac_op_fwd`` / ``sac_op_bwd`` (:mod:`autopar.strategies.recompute`).

A profile without these figures (or a CPU profile, where the host is the device and the
figures add to the op times instead) charges no host time.
"""

from __future__ import annotations

from autopar.cost_models.compute import is_matmul, is_norm
from autopar.cost_models.hardware import HardwareProfile
from autopar.flops import op_name

ATTENTION_OPS = ("scaled_dot_product_attention",)
"""Op names priced as attention (the rest of the matrix products are ``matmul``)."""


def op_kind(target: str, flops: float, nbytes: float) -> str:
    """The host-time kind of an op: ``attention``, ``matmul``, ``norm``, ``embedding``,
    ``view`` (moves no bytes) or ``pointwise`` (everything else)."""
    name = op_name(target)
    if any(a in name for a in ATTENTION_OPS):
        return "attention"
    if is_matmul(target):
        return "matmul"
    if is_norm(target):
        return "norm"
    if name == "embedding":
        return "embedding"
    if not flops and not nbytes:
        return "view"
    return "pointwise"


def charges_host(hw: HardwareProfile) -> bool:
    """True when ``hw`` runs ahead of its device and measured the per-op host times."""
    return hw.host_runs_ahead and "op_pointwise_fwd" in hw.host_overhead_s


def op_host_time(hw: HardwareProfile, target: str, flops: float, nbytes: float,
                 requires_grad: bool) -> tuple[float, float]:
    """(forward, backward) host seconds of one call of the op (0 without figures)."""
    if not charges_host(hw):
        return 0.0, 0.0
    kind = op_kind(target, flops, nbytes)
    h = hw.host_overhead_s
    return h.get(f"op_{kind}_fwd", 0.0), h.get(f"op_{kind}_bwd", 0.0) if requires_grad else 0.0


def fsdp_host_time(hw: HardwareProfile, params: int) -> tuple[float, float]:
    """(forward, backward) host seconds per micro-batch of FSDP2's hooks for ``params``
    parameters it lays out."""
    if not charges_host(hw):
        return 0.0, 0.0
    h = hw.host_overhead_s
    return params * h.get("fsdp_param_fwd", 0.0), params * h.get("fsdp_param_bwd", 0.0)


def optimizer_host_time(hw: HardwareProfile, params: int, dtensor: bool) -> float:
    """Host seconds per step of the optimizer step and ``zero_grad`` over ``params``
    parameters (DTensors when ``dtensor``)."""
    if not charges_host(hw):
        return 0.0
    key = "optimizer_param_fsdp" if dtensor else "optimizer_param"
    return params * hw.host_overhead_s.get(key, 0.0)


def checkpoint_host_time(hw: HardwareProfile, mode: str) -> tuple[float, float]:
    """(forward, backward) host seconds recomputation ``mode`` (``full`` or
    ``selective``) adds per op of the checkpointed region beyond the recomputed op's own
    forward: the checkpoint's hooks, and under ``selective`` its dispatch mode, in both
    passes (0 where the profile lacks the figure)."""
    if not charges_host(hw):
        return 0.0, 0.0
    h, key = hw.host_overhead_s, "sac_op" if mode == "selective" else "ckpt_op"
    return h.get(f"{key}_fwd", 0.0), h.get(f"{key}_bwd", 0.0)
