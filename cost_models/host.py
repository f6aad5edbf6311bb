"""Host time of a training step on a device that the host runs ahead of (a GPU).

Eager PyTorch issues kernels asynchronously, so each op costs device seconds
(:mod:`autopar.cost_models.compute`) and host seconds (here), and a step takes the
longer path through both (:func:`autopar.solvers.problem.evaluate`). Host seconds are
the profile's ``host_overhead_s`` figures: :func:`op_host_time` per op by kind
(:func:`op_kind`), :func:`fsdp_host_time` per parameter FSDP2 lays out,
:func:`optimizer_host_time` per parameter stepped, :func:`checkpoint_host_time` per
op under recomputation; :func:`charges_host` says whether a profile charges any.

Which figure counts what: docs/cost_models.md, section ``autopar.cost_models.host``;
the H100 measurement of host against device time: benchmarks/results/README.md,
"Cost models".
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
