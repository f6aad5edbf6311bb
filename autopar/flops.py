"""Forward FLOPs and bytes of each aten operator (a multiply-add counts 2 FLOPs).

Bytes are the tensor inputs read plus the output written; views move nothing.
Per-element FLOP counts of pointwise ops are first-principles estimates of the
arithmetic in PyTorch's kernels (e.g. tanh-free erf GeLU ~ 8, SiLU ~ 4).
"""

from __future__ import annotations

from math import prod

from autopar.graph import OpNode, TensorMeta

VIEW_OPS = frozenset("""view _unsafe_view reshape flatten unflatten squeeze unsqueeze permute
transpose t expand slice select split split_with_sizes chunk unbind getitem alias detach
contiguous_view""".split())
CREATION_OPS = frozenset("arange zeros ones full empty scalar_tensor".split())
POINTWISE_FLOPS: dict[str, float] = {
    "add": 1, "sub": 1, "mul": 1, "div": 1, "neg": 1, "pow": 1, "rsqrt": 2, "sqrt": 2,
    "exp": 4, "log": 4, "tanh": 6, "sigmoid": 4, "gelu": 8, "silu": 4, "relu": 1,
    "where": 1, "masked_fill": 1, "dropout": 2, "native_dropout": 2, "sin": 4, "cos": 4,
    "reciprocal": 1, "clamp": 1, "maximum": 1, "minimum": 1, "abs": 1, "erf": 6,
}
NORM_FLOPS = {"layer_norm": 8, "rms_norm": 6, "group_norm": 8, "softmax": 5, "_softmax": 5,
              "log_softmax": 6, "_log_softmax": 6, "cross_entropy_loss": 8, "nll_loss": 1}
KNOWN = (VIEW_OPS | CREATION_OPS | set(POINTWISE_FLOPS) | set(NORM_FLOPS) |
         {"linear", "mm", "bmm", "addmm", "baddbmm", "matmul", "einsum", "embedding",
          "scaled_dot_product_attention", "sum", "mean", "amax", "var", "cat", "stack",
          "to", "_to_copy", "clone", "contiguous", "type_as"})


def op_name(target: str) -> str:
    """``"aten.linear.default" -> "linear"``."""
    parts = target.split(".")
    return parts[1] if len(parts) >= 3 and parts[0] == "aten" else parts[-1]


def is_known_op(target: str) -> bool:
    """True when this module has a FLOP formula for the op."""
    return op_name(target) in KNOWN


def flops_and_bytes(node: OpNode, in_metas: list[TensorMeta | None]) -> tuple[float, float]:
    """(forward FLOPs, forward bytes) of ``node``."""
    op = op_name(node.target)
    out = node.out
    if op in VIEW_OPS or op in CREATION_OPS and not in_metas:
        return 0.0, (out.nbytes if op in CREATION_OPS and out is not None else 0.0)
    nbytes = float(sum(m.nbytes for m in in_metas if m is not None)) + sum(
        float(o.nbytes) for o in (node.outs or ([out] if out is not None else [])))
    o = out.numel if out is not None else 0
    if op == "linear":
        k = in_metas[0].shape[-1]
        return 2.0 * o * k + (o if len(in_metas) > 2 else 0), nbytes
    if op in ("mm", "bmm", "matmul", "addmm", "baddbmm"):
        a = in_metas[-2] if op in ("addmm", "baddbmm") else in_metas[0]
        k = a.shape[-1]
        return 2.0 * o * k + (o if op in ("addmm", "baddbmm") else 0), nbytes
    if op == "einsum":
        return _einsum_flops(str(node.args[0]), in_metas), nbytes
    if op == "scaled_dot_product_attention":
        q, k = in_metas[0], in_metas[1]
        batch = prod(q.shape[:-2])
        causal = len(node.args) > 5 and node.args[5] is True
        f = 4.0 * batch * q.shape[-2] * k.shape[-2] * q.shape[-1]
        return (f / 2 if causal else f), nbytes  # causal kernels skip the masked half
    if op == "embedding":
        return 0.0, 2.0 * o * (out.nbytes / max(o, 1))  # read rows, write output
    if op in NORM_FLOPS:
        base = in_metas[0].numel if in_metas and in_metas[0] is not None else o
        return NORM_FLOPS[op] * base, nbytes
    if op in POINTWISE_FLOPS:
        return POINTWISE_FLOPS[op] * o, nbytes
    if op in ("sum", "mean", "amax", "var"):
        return float(in_metas[0].numel if in_metas and in_metas[0] else 0), nbytes
    return 0.0, nbytes


def _einsum_flops(eq: str, metas: list[TensorMeta | None]) -> float:
    lhs, _, _ = eq.replace(" ", "").partition("->")
    sizes: dict[str, int] = {}
    for term, m in zip(lhs.split(","), metas):
        if m is None:
            continue
        for c, s in zip(term, m.shape):
            sizes[c] = max(sizes.get(c, 1), s)
    return 2.0 * prod(sizes.values())
