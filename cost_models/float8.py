"""Float8 matrix products: which ops run them under ``precision="fp8"`` and their seconds.

Under ``"fp8"`` a model trains as under ``"bf16"``, except that every ``nn.Linear`` whose
weight sides are multiples of 16 runs its three products in float8 with dynamic
tensorwise scales (torchao's ``Float8Linear`` under ``torch.compile``, as torchtitan's
float8 converter installs it; Transformer Engine's float8 Linears in Megatron-LM).
:func:`runs_float8` picks the ops; :func:`float8_linear_time` prices one, forward or
backward: the products at the profile's float8 rate plus the casts to float8. Formulas,
sources and what is not priced (float8 all-gathers, float8 copies kept for backward):
docs/cost_models.md, section ``autopar.cost_models.float8``.
"""

from __future__ import annotations

from typing import Protocol

from autopar.flops import op_name


class Rates(Protocol):
    """What these prices read of a :class:`~autopar.cost_models.hardware.HardwareProfile`
    (named structurally: the profile module reads :func:`float8_rate_ratio`)."""

    name: str
    matmul_flops: dict[str, float]
    matmul_efficiency: dict[str, float]
    kernel_overhead_s: float

    @property
    def achieved_memory_bandwidth(self) -> float:
        """Bytes per second the profile's kernels move."""


FP8 = "fp8"
"""The precision name of bf16 training with float8 Linear products."""

NOT_RUN = ("precision 'fp8' is priced (plan, estimate, compare) but not run: the runtime does "
           "not yet swap Linears for torchao's Float8Linear; plan with precision 'bf16' to "
           "train, or apply torchao's convert_to_float8_training to the model yourself")
"""The message where a float8 plan would be run."""

LINEAR_OPS = frozenset({"linear", "addmm", "mm", "matmul"})
"""Ops an ``nn.Linear`` dispatches its product to."""

ALIGN = 16
"""torchao converts a Linear only when both weight dimensions are multiples of 16 (the
float8 GEMM's alignment; torchtitan's float8 converter docs)."""

# Bytes moved per element by the casts of one Linear, dynamic tensorwise scaling with
# the amax of an activation fused into the op that produced it (torch.compile), as
# torchao's roofline model counts them (torchao/testing/training/roofline_utils.py,
# get_tensor_memory_traffic_ovhd_s, recipe "tensorwise"): the input is read in bf16 (2)
# and written in float8 twice, row- and column-major (2); the weight's amax reads it
# (2), its forward cast reads it and writes float8 (3) and its backward cast, in the
# other layout, again (3); the output gradient as the input (4).
CAST_BYTES_FORWARD_INPUT = 4.0
CAST_BYTES_FORWARD_WEIGHT = 5.0
CAST_BYTES_BACKWARD_WEIGHT = 3.0
CAST_BYTES_BACKWARD_GRAD = 4.0


def element_dtype(precision: str) -> str:
    """The dtype activations and every op but a float8 product run in."""
    return "bf16" if precision == FP8 else precision


def runs_float8(precision: str, target: str, module_type: str,
                weight_shape: tuple[int, ...] | None) -> bool:
    """Whether an op runs as a float8 product: ``precision`` is ``"fp8"``, the op is the
    product of an ``nn.Linear`` (``module_type``) and its weight's (global) shape is
    2-D with both sides multiples of :data:`ALIGN`."""
    return (precision == FP8 and module_type == "Linear" and op_name(target) in LINEAR_OPS
            and weight_shape is not None and len(weight_shape) == 2
            and all(d % ALIGN == 0 for d in weight_shape))


def linear_products(dims: tuple[float, float, float],
                    backward: bool) -> list[tuple[float, float, float]]:
    """The (m, n, k) of a Linear's products for forward product ``dims``: the output
    product forward; the input-gradient and weight-gradient products backward."""
    m, n, k = dims
    return [(m, k, n), (n, k, m)] if backward else [(m, n, k)]


def float8_rate_ratio(hw: Rates) -> float:
    """Achieved float8 over achieved bf16 tensor-core rate of the profile
    (``matmul_flops`` × ``matmul_efficiency`` of each); raises ``ConfigError`` where the
    profile lists no float8 rate."""
    from autopar.errors import ConfigError

    if FP8 not in hw.matmul_flops:
        raise ConfigError(f"precision 'fp8' needs float8 tensor cores, and the profile "
                          f"{hw.name!r} lists none (H100, H200 and later GPUs have them); "
                          "use precision 'bf16'")
    fp8 = hw.matmul_flops[FP8] * hw.matmul_efficiency.get(FP8, 1.0)
    bf16 = hw.matmul_flops["bf16"] * hw.matmul_efficiency.get("bf16", 1.0)
    return fp8 / bf16


def float8_gemm_time(bf16_s: float, m: float, n: float, k: float,
                     hw: Rates) -> float:
    """Seconds of one (m, n, k) float8 product whose bf16 time is ``bf16_s``: the bf16
    time over :func:`float8_rate_ratio`, at least the time to read both operands in
    float8 and write the bf16 output at the achieved memory bandwidth."""
    traffic = (m * k + k * n) * 1.0 + m * n * 2.0
    return max(bf16_s / float8_rate_ratio(hw), traffic / hw.achieved_memory_bandwidth,
               hw.kernel_overhead_s)


def cast_time(elements: list[tuple[float, float]], hw: Rates) -> float:
    """Seconds of cast kernels given as (elements, bytes per element), each at the
    achieved memory bandwidth and at least one kernel launch."""
    return sum(max(e * b / hw.achieved_memory_bandwidth, hw.kernel_overhead_s)
               for e, b in elements)


def float8_linear_time(bf16_parts: list[float], dims: tuple[float, float, float], *,
                       backward: bool, hw: Rates) -> float:
    """Seconds of a float8 Linear's forward (``bf16_parts`` = [the output product's
    bf16 seconds]) or backward ([input-gradient, weight-gradient products]) with
    ``dims`` = (m, n, k) of the forward product: :func:`float8_gemm_time` of each
    product plus the casts of that pass (the constants above)."""
    m, n, k = dims
    gemms = sum(float8_gemm_time(t, a, b, c, hw)
                for t, (a, b, c) in zip(bf16_parts, linear_products(dims, backward)))
    if backward:
        casts = [(m * n, CAST_BYTES_BACKWARD_GRAD), (n * k, CAST_BYTES_BACKWARD_WEIGHT)]
    else:
        casts = [(m * k, CAST_BYTES_FORWARD_INPUT), (n * k, CAST_BYTES_FORWARD_WEIGHT)]
    return gemms + cast_time(casts, hw)
