"""Memory choices, named once for the planner, the Plan and the runtime.

The strategies price them, the solvers choose among them, the Plan records the
choice and the runtime applies it; all of them read these names from here (the
lowest layer, see CONTRIBUTING.md), and :mod:`autopar.plans` re-exports them.
"""

from __future__ import annotations

__all__ = ["RECOMPUTE", "SELECTIVE_SAVE_OPS", "fsdp_unit"]

RECOMPUTE = ("none", "selective", "full")
SELECTIVE_SAVE_OPS = frozenset({
    "mm", "addmm", "bmm", "baddbmm", "linear", "matmul", "einsum", "tensordot",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "scaled_dot_product_attention",
})
"""What "selective" recomputation keeps (aten op names without overload): the outputs
of matrix products and of attention, as torchtitan's operator-level activation
checkpointing does (``einsum`` and ``tensordot`` are captured whole and dispatch to
``bmm``/``mm``, whose outputs the runtime's policy keeps: listed so the pricer sees the
same); everything else in the block (pointwise ops, norms, softmax,
dropout, views) is recomputed in backward. The lowering's checkpoint policy and the
memory model both read this one list."""


def fsdp_unit(blocks: list[str], fqn: str) -> str:
    """The ``fully_shard`` unit that owns parameter ``fqn``: the block containing it,
    or ``""`` (the root)."""
    for block in blocks:
        if fqn.startswith(block + "."):
            return block
    return ""
