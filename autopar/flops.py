"""Forward FLOPs and bytes of each aten operator.

:func:`flops_and_bytes` gives one op node's forward FLOPs and bytes, from a formula per
op (a GEMM of (M, K) by (K, N) costs ``2·M·N·K``; :func:`einsum_flops` for einsums)
and the per-element tables ``POINTWISE_FLOPS``, ``ROW_OP_FLOPS`` and
``REDUCTION_FLOPS``. Unknown ops get 0 FLOPs and inputs+outputs bytes;
:func:`is_known_op` tells them apart, and :func:`unknown_ops` lists them for a graph,
so an under-counted model is easy to spot.

The conventions every formula here follows (what counts as a FLOP, per which element,
which ops move bytes) and their sources: docs/capture.md, section ``autopar.flops``.
"""

from __future__ import annotations

from math import prod
from types import MappingProxyType
from typing import Iterable, Mapping, Sequence

from autopar.graph import OpNode, TensorMeta

# Ops that never move data: their output is a view of an input.
VIEW_OPS = frozenset("""view _unsafe_view view_as flatten unflatten squeeze unsqueeze permute
transpose t numpy_T mT expand expand_as slice select split split_with_sizes unsafe_split chunk
tensor_split unbind getitem alias detach narrow movedim moveaxis swapaxes diagonal unfold
as_strided _reshape_alias real imag view_as_real view_as_complex lift_fresh""".split())

# Ops that are a view when the layout allows it and a copy otherwise (the capture says
# which through ``aliases_input``); with no word from the caller they count as views.
MAYBE_VIEW_OPS = frozenset("reshape flatten reshape_as".split())

# Ops that copy their input(s) into a new tensor: 0 FLOPs, inputs + outputs bytes, or 0
# bytes when the capture saw them return their input unchanged (``to`` the same dtype).
COPY_OPS = frozenset("""clone contiguous to _to_copy type_as copy copy_ cat concat concatenate
stack hstack vstack repeat tile flip roll constant_pad_nd pad index_select gather index
take lift_fresh_copy repeat_interleave masked_select""".split())

# Ops that create a tensor from nothing: 0 FLOPs, bytes = the output written ("empty"
# variants write nothing).
CREATION_OPS = frozenset("""arange zeros ones full empty scalar_tensor zeros_like ones_like
full_like empty_like new_zeros new_ones new_full new_empty rand randn randint rand_like
randn_like randint_like linspace eye tensor fill zero""".split())
_NO_WRITE = frozenset("empty empty_like new_empty".split())

# Matrix products and attention (formulas in ``_matmul_flops``).
GROUPED_MM_OPS = frozenset({"_grouped_mm", "grouped_mm", "grouped_mm_fallback"})
"""Grouped matrix products: rows (M, K) sorted by group against stacked weights
(G, K, N), each row multiplied by its group's matrix (``torch._grouped_mm``, and
``transformers``' custom op of the same contract, which runs a per-expert loop)."""

MATMUL_OPS = frozenset("""linear addmm mm bmm baddbmm matmul einsum mv dot vdot outer ger
convolution conv1d conv2d conv3d scaled_dot_product_attention""".split()) | GROUPED_MM_OPS

POINTWISE_FLOPS: Mapping[str, float] = MappingProxyType({
    # one arithmetic operation or comparison per element
    "add": 1, "sub": 1, "rsub": 1, "mul": 1, "div": 1, "true_divide": 1, "floor_divide": 1,
    "remainder": 1, "fmod": 1, "neg": 1, "abs": 1, "sign": 1, "reciprocal": 1,
    "maximum": 1, "minimum": 1, "clamp_min": 1, "clamp_max": 1, "relu": 1, "square": 1,
    "eq": 1, "ne": 1, "lt": 1, "le": 1, "gt": 1, "ge": 1, "logical_not": 1,
    "logical_and": 1, "logical_or": 1, "logical_xor": 1, "bitwise_not": 1,
    "bitwise_and": 1, "bitwise_or": 1, "bitwise_xor": 1, "__and__": 1, "__or__": 1,
    "__xor__": 1, "__invert__": 1, "diff": 1, "where": 1, "masked_fill": 1,
    "triu": 1, "tril": 1, "cumsum": 1, "floor": 1, "ceil": 1, "round": 1, "trunc": 1,
    "isnan": 1, "isinf": 1, "pow": 1,  # pow by a small integer exponent: one multiply
    # one transcendental evaluation per element
    "exp": 1, "exp2": 1, "expm1": 1, "log": 1, "log2": 1, "log1p": 1, "sqrt": 1,
    "rsqrt": 1, "tanh": 1, "sin": 1, "cos": 1, "erf": 1,
    "clamp": 2,        # a lower and an upper comparison
    "leaky_relu": 2,   # compare, multiply
    "hardtanh": 2,     # two comparisons
    "lerp": 3,         # a + w·(b - a): sub, mul, add
    "addcmul": 3,      # a + v·b·c: mul, mul, add
    "addcdiv": 3,      # a + v·b/c: div, mul, add
    "sigmoid": 4,      # 1 / (1 + exp(-x)): neg, exp, add, div
    "silu": 4,         # x / (1 + exp(-x)): neg, exp, add, div
    "softplus": 4,     # log(1 + exp(x)) with a threshold compare: exp, add, log, compare
    "gelu": 8,         # tanh form with u = x·(c0 + c1·x²) (4 ops), tanh (1), 0.5·(1 + t)
                       # (2), ·x (1); the default erf form is charged the same
    "dropout": 3,      # training: one uniform draw, one compare, one scaled multiply
})

# Per input element: norms, softmaxes and losses over a row.
ROW_OP_FLOPS: Mapping[str, float] = MappingProxyType({
    "layer_norm": 5,    # mean (1), x - mean (1), square and sum (2), scale by 1/std (1)
    "group_norm": 5,    # as layer_norm, over groups
    "batch_norm": 5,    # as layer_norm, over the batch (training statistics)
    "instance_norm": 5,
    "rms_norm": 3,      # square and sum (2), scale by 1/rms (1)
    "softmax": 5,       # max (1), x - max (1), exp (1), sum (1), divide (1)
    "_softmax": 5,
    "log_softmax": 5,   # max (1), x - max (1), exp (1), sum (1), subtract log-sum (1)
    "_log_softmax": 5,
    "cross_entropy_loss": 5,  # log_softmax over the classes; + 2 per row for the gather
                              # and the reduction (``_row_op``)
    "mse_loss": 3,      # difference, square, sum
    "l1_loss": 3,       # difference, absolute value, sum
})
_AFFINE_NORMS = frozenset("layer_norm group_norm batch_norm instance_norm rms_norm".split())

REDUCTION_FLOPS: Mapping[str, float] = MappingProxyType({
    "sum": 1, "mean": 1, "amax": 1, "amin": 1, "max": 1, "min": 1, "prod": 1,
    "argmax": 1, "argmin": 1, "all": 1, "any": 1, "count_nonzero": 1, "nansum": 1,
    "var": 4, "std": 4, "var_mean": 4, "std_mean": 4,  # mean (1) + sub, square, add (3)
    "logsumexp": 4,                                    # max, sub, exp, add
    "norm": 2, "linalg_vector_norm": 2,                # square, add
})

_NLL = frozenset({"nll_loss", "nll_loss_forward", "nll_loss2d"})


def op_name(target: str) -> str:
    """The operator's short name: ``"aten.linear.default" -> "linear"``,
    ``"aten.add_.Tensor" -> "add_"``, ``"getitem" -> "getitem"``, and a custom op's
    ``"namespace.name.overload" -> "name"``."""
    parts = target.split(".")
    return parts[1] if len(parts) == 3 or (len(parts) > 3 and parts[0] == "aten") \
        else parts[-1]


def _base(op: str) -> str:
    """In-place variants share their out-of-place formula: ``add_ -> add``."""
    return op[:-1] if op.endswith("_") and not op.endswith("__") and len(op) > 1 else op


_KNOWN = (VIEW_OPS | MAYBE_VIEW_OPS | COPY_OPS | CREATION_OPS | MATMUL_OPS
          | frozenset(POINTWISE_FLOPS) | frozenset(ROW_OP_FLOPS) | frozenset(REDUCTION_FLOPS)
          | _NLL | {"embedding"})


def is_known_op(target: str) -> bool:
    """True when this module has a FLOP and byte formula for the op; unknown ops are
    charged 0 FLOPs and their inputs' and outputs' bytes."""
    return _base(op_name(target)) in _KNOWN or op_name(target) in _KNOWN


def unknown_ops(nodes: Iterable[OpNode]) -> list[str]:
    """Sorted distinct targets of the op nodes whose FLOPs this module does not know."""
    return sorted({n.target for n in nodes if n.kind == "op" and not is_known_op(n.target)})


def _nbytes(metas: Iterable[TensorMeta | None]) -> float:
    return float(sum(m.nbytes for m in metas if m is not None))


def flops_and_bytes(node: OpNode, in_metas: Sequence[TensorMeta | None], *,
                    aliases_input: bool | None = None) -> tuple[float, float]:
    """(forward FLOPs, forward bytes) of one op node.

    ``in_metas`` are the metadata of the node's tensor inputs, in ``node.inputs`` order.
    ``aliases_input`` says whether the capture saw the output share storage with an
    input (None: unknown); it turns a maybe-copy (reshape, contiguous, ``to``) into a view.
    """
    op = op_name(node.target)
    base = _base(op)
    outs = node.outs or ([node.out] if node.out is not None else [])
    moved = _nbytes(in_metas) + _nbytes(outs)
    out_n = float(node.out.numel) if node.out is not None else 0.0
    if op in VIEW_OPS or base in VIEW_OPS:
        return 0.0, 0.0
    if base in MAYBE_VIEW_OPS:
        return 0.0, (moved if aliases_input is False else 0.0)
    if base in COPY_OPS:
        return 0.0, (0.0 if aliases_input else moved)
    if base in CREATION_OPS:
        return 0.0, (0.0 if base in _NO_WRITE else _nbytes(outs))
    if base in MATMUL_OPS:
        return _matmul_flops(base, node, in_metas), moved
    if base == "embedding":
        # gather: read the indices and the rows they name, write the output
        return 0.0, _nbytes(in_metas[1:2]) + 2.0 * _nbytes(outs)
    if base == "dropout":
        identity = _arg(node, 1, 0.5) == 0 or _arg(node, 2, True) is False
        return (0.0, 0.0) if identity else (POINTWISE_FLOPS["dropout"] * out_n, moved)
    if base == "pow":
        return _pow_flops(node) * out_n, moved
    if base in POINTWISE_FLOPS:
        return POINTWISE_FLOPS[base] * out_n, moved
    if base in ROW_OP_FLOPS or base in _NLL:
        return _row_op(base, node, in_metas), moved
    if base in REDUCTION_FLOPS:
        first = in_metas[0] if in_metas else None
        return REDUCTION_FLOPS[base] * float(first.numel if first else 0), moved
    return 0.0, moved


def _arg(node: OpNode, i: int, default: object) -> object:
    return node.args[i] if len(node.args) > i and node.args[i] is not None else default


def _pow_flops(node: OpNode) -> float:
    """x**2 and x**0.5 are one operation, x**3 two, other exponents exp(y·log x): 3."""
    if node.target.endswith("Tensor_Scalar"):
        e = _arg(node, 1, 2)
        if e in (2, 0.5, -1, 1, 2.0):
            return 1.0
        if e in (3, 3.0, -2):
            return 2.0
    return 3.0


def _row_op(op: str, node: OpNode, in_metas: Sequence[TensorMeta | None]) -> float:
    x = in_metas[0] if in_metas else None
    n = float(x.numel) if x is not None else 0.0
    if op in _NLL:
        rows = n / max(x.shape[1], 1) if x is not None and len(x.shape) > 1 else n
        return 2.0 * rows  # gather the target's log-probability, accumulate
    per = ROW_OP_FLOPS[op]
    if op in _AFFINE_NORMS:
        # weight and bias (when present) add one multiply / add each per element;
        # batch_norm's last two tensors are its running statistics
        extra = len(in_metas) - 1 - (2 if op == "batch_norm" and len(in_metas) >= 3 else 0)
        per += min(2, max(0, extra))
    flops = per * n
    if op == "cross_entropy_loss" and x is not None and x.shape:
        classes = x.shape[1] if len(x.shape) >= 2 else x.shape[0]
        flops += 2.0 * n / max(classes, 1)  # per row: gather the target, accumulate
        if float(_arg(node, 5, 0.0) or 0.0) > 0:  # label smoothing sums every log-prob
            flops += n
    return flops


def _matmul_flops(op: str, node: OpNode, m: Sequence[TensorMeta | None]) -> float:
    """FLOPs of matrix products, convolutions and attention.

    linear: 2·M·N·K (+ M·N for the bias); addmm / baddbmm: 2·M·N·K + M·N; mm, bmm,
    matmul and grouped products: 2·(output elements)·K; mv / dot: 2·M·K; outer: M·N; convolution:
    2·(output elements)·(C_in/groups)·prod(kernel) (+ bias); einsum: contracted left to
    right as torch does without opt_einsum, 2·prod(sizes of the pair's labels) per
    contracting step; scaled_dot_product_attention: 2·B·L·S·E for Q·Kᵀ plus 2·B·L·S·Ev
    for P·V (= 4·b·h·s_q·s_kv·d), B the batch and head dims. With ``is_causal`` the
    executed work is half of that: flash kernels skip the tiles above the diagonal, and
    FlashAttention (Dao, 2023, §4) counts causal FLOPs as half. The softmax over the
    scores is not counted (it overlaps the matrix units in fused kernels).
    """
    out = node.out
    o = float(out.numel) if out is not None else 0.0
    if op == "linear":
        k = m[0].shape[-1] if m[0] is not None and m[0].shape else 1
        return 2.0 * o * k + (o if len(m) > 2 and m[2] is not None else 0.0)
    if op in ("addmm", "baddbmm"):
        a = m[1]
        return 2.0 * o * (a.shape[-1] if a is not None else 1) + o
    if op in ("mm", "bmm", "matmul", "mv", "dot", "vdot") or op in GROUPED_MM_OPS:
        a = m[0]
        k = a.shape[-1] if a is not None and a.shape else 1
        return 2.0 * max(o, 1.0) * k
    if op in ("outer", "ger"):
        return o
    if op.startswith("conv"):
        w = m[1]
        per = prod(w.shape[1:]) if w is not None else 1
        return 2.0 * o * per + (o if len(m) > 2 and m[2] is not None else 0.0)
    if op == "einsum":
        return einsum_flops(str(node.args[0]), [x.shape if x else () for x in m])
    # scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale, gqa)
    q, k, v = m[0], m[1], m[2]
    batch = prod(q.shape[:-2])
    full = 2.0 * batch * q.shape[-2] * k.shape[-2] * (q.shape[-1] + v.shape[-1])
    return full / 2.0 if _arg(node, 5, False) is True else full


def _greek(n: int) -> str:
    """``n`` private labels for the dims an ellipsis stands for (never valid einsum
    letters, so they cannot clash with the equation's own)."""
    return "".join(chr(0x3B1 + i) for i in range(n))


def einsum_flops(equation: str, shapes: Sequence[Sequence[int]]) -> float:
    """FLOPs of ``torch.einsum(equation, *operands)`` with operands of ``shapes``,
    contracted pairwise left to right (see ``_matmul_flops``)."""
    lhs, arrow, rhs = equation.replace(" ", "").partition("->")
    terms = lhs.split(",")
    width = max((len(s) - (len(t) - 3) for t, s in zip(terms, shapes) if "..." in t),
                default=0)
    labels = _greek(width)
    terms = [t.replace("...", labels[width - (len(s) - (len(t) - 3)):]) if "..." in t else t
             for t, s in zip(terms, shapes)]
    sizes: dict[str, int] = {}
    for t, s in zip(terms, shapes):
        for c, d in zip(t, s):
            sizes[c] = max(sizes.get(c, 1), int(d))
    if arrow:
        out = set(rhs.replace("...", labels))
    else:
        counts: dict[str, int] = {}
        for t in terms:
            for c in t:
                counts[c] = counts.get(c, 0) + 1
        out = {c for c, k in counts.items() if k == 1} | set(labels)
    if len(terms) == 1:
        summed = set(terms[0]) - out
        return float(prod(sizes[c] for c in set(terms[0]))) if summed else 0.0
    flops = 0.0
    cur = set(terms[0])
    for i in range(1, len(terms)):
        union = cur | set(terms[i])
        later = set().union(*(set(t) for t in terms[i + 1:])) | out
        keep = {c for c in union if c in later}
        work = float(prod(sizes[c] for c in union))
        flops += 2.0 * work if union - keep else work
        cur = keep
    return flops
