"""Compute time of one operator: measured tables where they reach, else a roofline.

:func:`op_time` prices one op, forward or backward, on its local shapes
(:class:`OpShapes`, :func:`local_shape`): the profile's measured tables
(:mod:`autopar.cost_models.tables`) where they reach, else :func:`compute_time`'s
roofline, and never less than the host's dispatch time of one op.
:func:`backward_factors` gives an op's backward work from its forward work;
:func:`is_matmul` and :func:`is_norm` sort ops by kind.

The formulas, t = max(t_device, t_launch) and the roofline with the profile's
constants: docs/cost_models.md, section ``autopar.cost_models.compute``; the H100
measurements behind the max: benchmarks/results/README.md, "Cost models".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autopar.cost_models.float8 import FP8, float8_linear_time, linear_products
from autopar.cost_models.hardware import HardwareProfile
from autopar.flops import GROUPED_MM_OPS, op_name
from autopar.cost_models.tables import (ELEMENT_BYTES, attention_time, gemm_time,
                                        memory_bound_time)

_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "fp32": "fp32",
           "bf16": "bf16", "fp16": "fp16", "tf32": "tf32", FP8: FP8}

MATMUL_OPS = frozenset({"linear", "mm", "bmm", "addmm", "matmul", "einsum", "baddbmm",
                        "scaled_dot_product_attention", "conv1d", "conv2d",
                        "convolution"}) | GROUPED_MM_OPS


def is_matmul(target: str) -> bool:
    """True for ops that run on the matrix units (GEMMs and attention)."""
    return op_name(target) in MATMUL_OPS


NORM_OPS = frozenset({"layer_norm", "native_layer_norm", "rms_norm", "_fused_rms_norm",
                      "group_norm"})


def is_norm(target: str) -> bool:
    """True for normalization ops (the modules sequence parallelism shards)."""
    return op_name(target) in NORM_OPS


def compute_time(flops: float, nbytes: float, *, matmul: bool, dtype: str,
                 hw: HardwareProfile) -> float:
    """Roofline seconds of one op (docs/cost_models.md, section
    ``autopar.cost_models.compute``). fp32 matrix products use the fp32 peak (PyTorch's
    default keeps TF32 off for matmuls)."""
    key = _DTYPES.get(dtype, "fp32")
    if matmul:
        peak = hw.matmul_flops.get(key, hw.matmul_flops.get("fp32", 1.0))
        eff = hw.matmul_efficiency.get(key, hw.matmul_efficiency.get("fp32", 1.0))
    else:
        peak = hw.vector_flops.get(key, hw.vector_flops.get("fp32", 1.0))
        eff = 1.0
    t_flops = flops / (peak * eff) if flops else 0.0
    t_bytes = nbytes / hw.achieved_memory_bandwidth if nbytes else 0.0
    return max(t_flops, t_bytes, hw.kernel_overhead_s)


Shape = tuple[int, ...]


@dataclass(frozen=True)
class OpShapes:
    """What the measured tables need to know about one op: its target, the local shapes
    of its tensor inputs (node.inputs order; None for a non-tensor) and output, and
    whether an attention op is causal."""

    target: str
    inputs: tuple[Shape | None, ...]
    output: Shape | None
    causal: bool = False


# Memory-bound op kinds of the profile's tables, by aten op name. Binary arithmetic is
# timed as ``add``/``mul`` (read two tensors, write one), other elementwise functions
# as ``silu`` (read one, write one, a few flops per element), copies as ``copy``.
_MEMORY_KIND: dict[str, str] = {
    **{op: "add" for op in "add sub rsub div true_divide where masked_fill maximum minimum".split()},
    **{op: "mul" for op in ("mul",)},
    **{op: "silu" for op in """silu sigmoid tanh exp log neg relu rsqrt sqrt reciprocal pow
        dropout cos sin abs erf clamp clamp_min clamp_max""".split()},
    "gelu": "gelu",
    **{op: "copy" for op in "clone contiguous _to_copy to copy cat stack repeat".split()},
    "layer_norm": "layer_norm", "group_norm": "layer_norm", "rms_norm": "rms_norm",
    **{op: "softmax" for op in "softmax _softmax log_softmax _log_softmax".split()},
    "embedding": "embedding", "cross_entropy_loss": "cross_entropy",
}
_MAIN_IS_OUTPUT = frozenset({"add", "mul", "silu", "gelu", "copy", "embedding"})
_GEMM_OPS = frozenset({"linear", "mm", "addmm", "bmm", "matmul"}) | GROUPED_MM_OPS
"""Products priced from the GEMM table. A grouped product of M rows against G stacked
(K, N) weights is priced as one (M, N, K) GEMM: a grouped kernel tiles each group's
rows as a GEMM would (measured on an H100: benchmarks/results/h100_moe.json)."""


def local_shape(shape: Shape | None, placements: tuple[str, ...],
                mesh_sizes: tuple[int, ...]) -> Shape | None:
    """``shape`` as one device holds it: each dim named ``S(d)`` (or ``S(d)/k``, split
    piecewise) on a mesh axis divided by that axis' size (``R`` and ``P`` keep the
    full shape)."""
    if shape is None:
        return None
    out = list(shape)
    for p, size in zip(placements, mesh_sizes):
        if p.startswith("S(") and size > 1:
            d = int(p[2:p.index(")")])
            if d < len(out):
                out[d] = max(1, out[d] // size)
    return tuple(out)


def _gemm_dims(op: str, ins: tuple[Shape | None, ...]) -> tuple[float, float, float] | None:
    """(m, n, k) of a matrix product from its local input shapes (batch dims of bmm /
    matmul folded into m)."""
    if op == "linear" and len(ins) >= 2 and ins[0] and ins[1] and len(ins[1]) == 2:
        k = ins[0][-1]
        return math.prod(ins[0]) / max(k, 1), float(ins[1][0]), float(k)
    first = 1 if op == "addmm" else 0
    if len(ins) < first + 2:
        return None
    a, b = ins[first], ins[first + 1]
    if not a or not b or len(a) < 2 or len(b) < 2:
        return None
    return math.prod(a) / a[-1], float(b[-1]), float(a[-1])


def _table_time(op: str, shapes: OpShapes, flops: float, backward: bool, dtype: str,
                hw: HardwareProfile) -> float | None:
    t = hw.tables
    if t is None:
        return None
    if op in _GEMM_OPS:
        dims = _gemm_dims(op, shapes.inputs)
        if dims is None:
            return None
        m, n, k = dims
        if not backward:
            return gemm_time(t, m, n, k, dtype)
        # dX = dY·W: (m, k, n); dW = dYᵀ·X (weight) or dB = Aᵀ·dY: (n, k, m) / (k, n, m)
        second = (n, k, m) if op in ("linear", "addmm") else (k, n, m)
        parts = [gemm_time(t, m, k, n, dtype), gemm_time(t, *second, dtype)]
        return None if None in parts else sum(parts)  # type: ignore[arg-type]
    if op == "scaled_dot_product_attention":
        q = shapes.inputs[0] if shapes.inputs else None
        if not q or len(q) < 3:
            return None
        return attention_time(t, float(math.prod(q[:-2])), float(q[-2]), float(q[-1]),
                              flops, dtype, "bwd" if backward else "fwd")
    kind = _MEMORY_KIND.get(op.rstrip("_"))
    if kind is None:
        return None
    main = shapes.output if kind in _MAIN_IS_OUTPUT or not shapes.inputs else shapes.inputs[0]
    if main is None:
        return None
    return memory_bound_time(t, kind, math.prod(main) * ELEMENT_BYTES.get(dtype, 4), dtype,
                             "bwd" if backward else "fwd")


def op_time(shapes: OpShapes, flops: float, nbytes: float, *, backward: bool, dtype: str,
            hw: HardwareProfile) -> float:
    """Seconds of one op, forward or (``backward``) its backward, on local shapes:
    the profile's measured tables where they reach, else the roofline of ``flops`` and
    ``nbytes`` (which the caller has already scaled for the backward); see
    docs/cost_models.md, section ``autopar.cost_models.compute``. Ops with no work
    cost 0."""
    if not (flops or nbytes):
        return 0.0
    key = _DTYPES.get(dtype, "fp32")
    if key == FP8:
        found = _float8_time(shapes, backward, hw)
        if found is not None:
            return found
        key = "bf16"
    measured = _table_time(op_name(shapes.target), shapes, flops, backward, key, hw)
    if measured is not None:
        return max(measured, hw.kernel_overhead_s)
    return compute_time(flops, nbytes, matmul=is_matmul(shapes.target), dtype=dtype, hw=hw)


def _float8_time(shapes: OpShapes, backward: bool, hw: HardwareProfile) -> float | None:
    """Seconds of a float8 Linear product (:mod:`autopar.cost_models.float8`) from its
    bf16 products' times (table, else roofline); None when its dims are unknown."""
    dims = _gemm_dims(op_name(shapes.target), shapes.inputs)
    if dims is None:
        return None

    def bf16(a: float, b: float, c: float) -> float:
        found = gemm_time(hw.tables, a, b, c, "bf16") if hw.tables is not None else None
        if found is None:
            found = compute_time(2 * a * b * c, 0.0, matmul=True, dtype="bf16", hw=hw)
        return found
    return float8_linear_time([bf16(*p) for p in linear_products(dims, backward)], dims,
                              backward=backward, hw=hw)


# Backward-pass work relative to the forward pass (FLOPs factor, bytes factor).
# Matrix products: grad of input and grad of weight are each one product of the same
# size (2x). Attention (flash-style): the backward recomputes the scores and computes
# dQ, dK, dV: 2.5x the forward FLOPs (Dao, FlashAttention-2, 2023, §3.1 counts 5 vs 2
# matmuls of the same size). Elementwise/norm/softmax: read the saved input and the
# output grad, write the input grad: about 1.5x-2x the forward bytes; 2x is used.
# Embedding: a scatter-add of the output grad (1x bytes). Views and creation ops: 0.
_BACKWARD: dict[str, tuple[float, float]] = {
    "scaled_dot_product_attention": (2.5, 2.5),
    "embedding": (0.0, 1.0),
}
_NO_BACKWARD = frozenset("""view _unsafe_view reshape flatten unflatten squeeze unsqueeze permute
transpose t expand slice select split split_with_sizes chunk unbind getitem alias detach
arange zeros ones full empty scalar_tensor""".split())


def backward_factors(target: str) -> tuple[float, float]:
    """(FLOPs, bytes) multipliers giving an op's backward cost from its forward cost."""
    op = op_name(target)
    if op in _BACKWARD:
        return _BACKWARD[op]
    if op in _NO_BACKWARD:
        return (0.0, 0.0)
    if op in MATMUL_OPS:
        return (2.0, 2.0)
    return (2.0, 2.0)
