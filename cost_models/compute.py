"""Compute time of one operator: a roofline with per-dtype efficiencies.

    t = max(F / (P_dtype · e_dtype), B / (W · e_W)) + t_launch

F = floating-point operations, B = bytes read and written, P = peak FLOP/s of the
matrix units (``matmul_flops``) for matrix products and attention, or of the vector
units (``vector_flops``) for everything else, e = achievable fraction of peak
(``matmul_efficiency``, measured on large GEMMs), W = memory bandwidth with its
achievable fraction ``memory_efficiency`` (measured with a large copy), and t_launch
the per-kernel launch and dispatch overhead. Every constant comes from the hardware
profile, which names its sources.
"""

from __future__ import annotations

from autopar.cost_models.hardware import HardwareProfile

_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "fp32": "fp32",
           "bf16": "bf16", "fp16": "fp16", "tf32": "tf32"}

MATMUL_OPS = frozenset({"linear", "mm", "bmm", "addmm", "matmul", "einsum", "baddbmm",
                        "scaled_dot_product_attention", "conv1d", "conv2d", "convolution"})


def _op_name(target: str) -> str:
    parts = target.split(".")
    return parts[1] if len(parts) >= 3 and parts[0] == "aten" else parts[-1]


def is_matmul(target: str) -> bool:
    """True for ops that run on the matrix units (GEMMs and attention)."""
    return _op_name(target) in MATMUL_OPS


def compute_time(flops: float, nbytes: float, *, matmul: bool, dtype: str,
                 hw: HardwareProfile) -> float:
    """Roofline seconds of one op (see module docstring). fp32 matrix products use the
    fp32 peak (PyTorch's default keeps TF32 off for matmuls)."""
    key = _DTYPES.get(dtype, "fp32")
    if matmul:
        peak = hw.matmul_flops.get(key, hw.matmul_flops.get("fp32", 1.0))
        eff = hw.matmul_efficiency.get(key, hw.matmul_efficiency.get("fp32", 1.0))
    else:
        peak = hw.vector_flops.get(key, hw.vector_flops.get("fp32", 1.0))
        eff = 1.0
    t_flops = flops / (peak * eff) if flops else 0.0
    t_bytes = nbytes / (hw.memory_bandwidth * hw.memory_efficiency) if nbytes else 0.0
    return max(t_flops, t_bytes) + hw.kernel_overhead_s


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
    op = _op_name(target)
    if op in _BACKWARD:
        return _BACKWARD[op]
    if op in _NO_BACKWARD:
        return (0.0, 0.0)
    if op in MATMUL_OPS:
        return (2.0, 2.0)
    return (2.0, 2.0)
