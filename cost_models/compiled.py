"""What ``torch.compile`` of the repeated blocks changes in a step's price, and when it pays.

The runtime compiles each of a plan's blocks after tensor parallelism and recomputation
and before FSDP2 (:mod:`autopar.runtime.compiled`, as torchtitan does). Inside a
compiled block Inductor fuses the memory-bound ops between the matrix products
(:data:`MEMORY_FACTOR` of their eager device time remains) and issues its kernels from
its generated wrapper: the host launches each matrix product and attention kernel and
one fused kernel after it, two launches per product forward and four backward
(:func:`compiled_op_times`), with no aten dispatch, no DTensor dispatch and no
recomputation hooks left at run time. Compilation itself takes
:func:`compile_time_s` once. :func:`compiles_where_it_pays` names the profiles whose
GPUs ran compiled blocks faster. The measurements: docs/cost_models.md, section
``autopar.cost_models.compiled``.
"""

from __future__ import annotations

from autopar.cost_models.hardware import HardwareProfile
from autopar.cost_models.host import charges_host

MEMORY_FACTOR = 0.34
"""Device seconds of a compiled block's memory-bound kernels over their eager price:
the median over the five no-recomputation rows of
benchmarks/results/h100_compile_steps.json and h200_compile_steps.json (GPT 1.3B, Llama
1.5B, Llama 3 8B slice; 2026-11-27, torch 2.11) of 1 − (eager − compiled forward +
backward) / (the blocks' memory-bound ops as priced); leave-one-out medians 0.31–0.51,
the held-out row's time within 5.7% (docs/cost_models.md)."""

LAUNCHES_PER_PRODUCT = (2, 4)
"""Kernels the compiled wrapper launches per matrix product or attention, (forward,
backward): the product and the fused group after it; backward two products and
their groups. First principles, each at the profile's ``kernel_overhead_s``."""

COMPILE_BASE_S, COMPILE_PER_OP_S = 2.95, 0.081
"""Seconds to compile a plan's blocks (one block's graph, forward and backward, reused
by the others): a + b · (captured ops of one block), fitted on the same rows' first
steps less eager's (GPT, 20 ops: 5.3 and 3.8 s; Llama, 56 ops: 8.3, 6.7, 7.4 s);
selective recomputation took 1.5–3.6 s more."""

MEASURED_FASTER = ("h100-sxm", "h100-sxm-500w", "h200")
"""Profiles whose GPUs ran compiled blocks faster than eager in every committed row
(1.00–1.64× per step)."""


def compiles_where_it_pays(hw: HardwareProfile) -> bool:
    """Whether the planner compiles blocks by default on ``hw``: a profile of
    :data:`MEASURED_FASTER` that prices host time (what compiling saves most)."""
    return charges_host(hw) and hw.name in MEASURED_FASTER


def compiled_op_times(hw: HardwareProfile, product: bool, fwd: float, bwd: float,
                      grad: bool) -> tuple[float, float, float, float]:
    """(forward device, backward device, forward host, backward host) seconds of an op
    inside a compiled block, ``fwd`` / ``bwd`` its eager device seconds; ``product``: a
    matrix product or attention (module docstring)."""
    if product:
        k = hw.kernel_overhead_s
        return fwd, bwd, LAUNCHES_PER_PRODUCT[0] * k, LAUNCHES_PER_PRODUCT[1] * k if grad else 0.0
    return fwd * MEMORY_FACTOR, bwd * MEMORY_FACTOR, 0.0, 0.0


def compile_time_s(ops_per_block: int) -> float:
    """Seconds to compile the blocks once, one block holding ``ops_per_block`` ops."""
    return COMPILE_BASE_S + COMPILE_PER_OP_S * ops_per_block
