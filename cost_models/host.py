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

from dataclasses import dataclass

import numpy as np

from autopar.cost_models.dispatch import KINDS, Dispatches, graph_dispatches, op_kind
from autopar.cost_models.hardware import HardwareProfile
from autopar.cost_models.local_regions import Region, region_candidates
from autopar.graph import Graph, OpNode


@dataclass(frozen=True)
class HostFacts:
    """What a graph's host time on one profile is priced from, found once per search:
    the aten ops each op dispatches
    (:func:`~autopar.cost_models.dispatch.graph_dispatches`), the modules that can run
    on local tensors (:func:`~autopar.cost_models.local_regions.region_candidates`) and
    the profile's seconds per dispatched op (:func:`dispatch_rates`)."""

    dispatches: dict[str, Dispatches]
    regions: dict[str, Region]
    rates: tuple[tuple[float, ...], tuple[float, ...]]

    @classmethod
    def of(cls, g: Graph, expert_paths: frozenset[str], hw: HardwareProfile) -> HostFacts:
        """The facts of graph ``g`` with expert modules at ``expert_paths`` on ``hw``."""
        return cls(graph_dispatches(g), region_candidates(g, expert_paths),
                   dispatch_rates(hw))


def charges_host(hw: HardwareProfile) -> bool:
    """True when ``hw`` runs ahead of its device and measured the per-op host times."""
    return hw.host_runs_ahead and "op_pointwise_fwd" in hw.host_overhead_s


PROFILED_DISPATCHES: dict[str, Dispatches] = {
    "matmul": Dispatches((32, 0, 0, 0, 32, 0), (64, 0, 0, 96, 164, 0)),
    "attention": Dispatches((0, 32, 0, 0, 32, 0), (0, 32, 0, 68, 33, 0)),
    "norm": Dispatches((0, 0, 32, 0, 0, 0), (0, 0, 32, 64, 4, 0)),
    "pointwise": Dispatches((0, 0, 0, 32, 0, 0), (0, 0, 0, 129, 35, 0)),
    "view": Dispatches((0, 0, 0, 0, 32, 0), (0, 0, 0, 4, 33, 0)),
    "embedding": Dispatches((0, 0, 0, 0, 0, 32), (0, 0, 0, 34, 34, 32)),
}
"""The aten ops, by kind of :data:`~autopar.cost_models.dispatch.KINDS`, that the
chain of ``CHAIN`` ops measured for each ``op_<kind>`` figure dispatches
(:func:`autopar.cost_models.profiling.host_dispatch.op_dispatch`; its backward holds
the loss that starts it and the adds that sum the gradients of the weight the chain
shares). Counted with :mod:`~autopar.cost_models.dispatch`'s counting mode on
torch 2.13;
``tests/test_dispatch_count.py`` counts them again with the installed torch."""

CHAIN = 32
"""Ops in each measured chain (``host_dispatch._CHAIN``)."""


def _nonnegative_solve(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The least-squares x >= 0 of ``a x = b`` (six unknowns at most: every set of
    unknowns held at zero is tried)."""
    n = a.shape[1]
    best, best_res = np.zeros(n), float(np.sum(b * b))
    for mask in range(1, 1 << n):
        cols = [i for i in range(n) if mask >> i & 1]
        x, *_ = np.linalg.lstsq(a[:, cols], b, rcond=None)
        if (x < 0).any():
            continue
        res = float(np.sum((a[:, cols] @ x - b) ** 2))
        if res < best_res - 1e-30:
            best, best_res = np.zeros(n), res
            best[cols] = x
    return best


def dispatch_rates(hw: HardwareProfile) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(forward, backward) host seconds per dispatched aten op of each kind of
    :data:`~autopar.cost_models.dispatch.KINDS` on ``hw``: the non-negative solution
    that gives back each ``op_<kind>`` figure from the ops its measured chain
    dispatches (:data:`PROFILED_DISPATCHES`); zeros without figures."""
    if not charges_host(hw):
        return (0.0,) * len(KINDS), (0.0,) * len(KINDS)
    h, out = hw.host_overhead_s, []
    for which in ("fwd", "bwd"):
        rows = [(getattr(PROFILED_DISPATCHES[k], which), h[f"op_{k}_{which}"])
                for k in KINDS if f"op_{k}_{which}" in h]
        a = np.array([r for r, _ in rows], dtype=float) / CHAIN
        x = _nonnegative_solve(a, np.array([m for _, m in rows], dtype=float))
        out.append(tuple(float(v) for v in x))
    return out[0], out[1]


def kind_host_time(hw: HardwareProfile, target: str, flops: float, nbytes: float,
                   requires_grad: bool) -> tuple[float, float]:
    """(forward, backward) host seconds of the measured op of ``target``'s kind
    (:func:`~autopar.cost_models.dispatch.op_kind`; 0 without figures)."""
    if not charges_host(hw):
        return 0.0, 0.0
    kind = op_kind(target, flops, nbytes)
    h = hw.host_overhead_s
    return h.get(f"op_{kind}_fwd", 0.0), h.get(f"op_{kind}_bwd", 0.0) if requires_grad else 0.0


def dispatched_host_time(rates: tuple[tuple[float, ...], tuple[float, ...]],
                         d: Dispatches) -> tuple[float, float]:
    """(forward, backward) host seconds of the aten ops ``d`` at ``rates``
    (:func:`dispatch_rates`)."""
    return (sum(c * r for c, r in zip(d.fwd, rates[0])),
            sum(c * r for c, r in zip(d.bwd, rates[1])))


def op_host_time(hw: HardwareProfile, rates: tuple[tuple[float, ...], tuple[float, ...]],
                 n: OpNode, d: Dispatches) -> tuple[float, float]:
    """(forward, backward) host seconds of one call of op ``n``, which dispatches
    ``d``: its aten ops at ``rates`` (:func:`dispatched_host_time`), never less than
    the measured op of its kind (:func:`kind_host_time`), which holds what one
    dispatched op leaves out (the call into the dispatcher, the autograd node's
    creation and, backward, its run by the engine); an op that dispatches nothing (a
    tuple's ``getitem``) costs nothing."""
    f, b = dispatched_host_time(rates, d)
    kf, kb = kind_host_time(hw, n.target, n.flops, n.bytes, n.requires_grad)
    return (max(f, kf) if d.forward_ops else f,
            max(b, kb) if sum(d.bwd) else b)


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
