"""Memory choices, named once for the planner, the Plan and the runtime.

The strategies price them, the solvers choose among them, the Plan records the
choice and the runtime applies it; all of them read these names from here (the
lowest layer, see CONTRIBUTING.md), and :mod:`autopar.plans` re-exports them.
"""

from __future__ import annotations

__all__ = ["RECOMPUTE", "SELECTIVE_SAVE_COLLECTIVES", "SELECTIVE_SAVE_OPS", "fsdp_unit"]

RECOMPUTE = ("none", "selective", "full")

SELECTIVE_SAVE_COLLECTIVES = {"reduce_scatter": "reduce_scatter_tensor"}
"""The collectives whose outputs "selective" recomputation keeps, by the kind the pricer
names them (:func:`autopar.strategies.edges.collectives`) -> the op the runtime
dispatches (``torch.ops._c10d_functional``; DTensor's Partial -> Shard redistribution
runs it): a reduce-scatter, as torchtitan's operator-level activation checkpointing
keeps it for every model (``_op_sac_save_list`` in its parallelize modules), so the
backward does not run it again. A reduce-scatter arises only where an op's partial
sum is handed on split (a row-split Linear's output under sequence parallelism): an
output handed over an edge is never partial on a free axis."""

SELECTIVE_SAVE_OPS = frozenset({
    "mm", "addmm", "bmm", "baddbmm", "linear", "matmul", "einsum", "tensordot",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "scaled_dot_product_attention", *SELECTIVE_SAVE_COLLECTIVES.values(),
})
"""What "selective" recomputation keeps (aten op names without overload): the outputs
of matrix products, of attention and of :data:`SELECTIVE_SAVE_COLLECTIVES`, as
torchtitan's operator-level activation checkpointing does (``einsum`` and
``tensordot`` are captured whole and dispatch to ``bmm``/``mm``, whose outputs the
runtime's policy keeps: listed so the pricer sees the same); everything else in the
block (pointwise ops, norms, softmax, dropout, views, other collectives) is recomputed
in backward. The lowering's checkpoint policy and the memory model both read this one
list."""


def fsdp_unit(blocks: list[str], fqn: str) -> str:
    """The ``fully_shard`` unit that owns parameter ``fqn``: the block containing it,
    or ``""`` (the root)."""
    for block in blocks:
        if fqn.startswith(block + "."):
            return block
    return ""
