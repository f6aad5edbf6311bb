"""Sharding rules of the ops mixture-of-experts routing is written with: top-k, sort,
running sums, one-hot, histograms and the gather / scatter / index family.

:data:`MOE_HANDLERS` maps each op name to its rule, as :mod:`.rules` maps the others.
An *indexed* dim (read or written at computed positions) is never split; a *scanned*
dim (a top-k, sort or running sum runs along it, a histogram counts it) is split only
by data parallelism (``per_rank``); every other dim keeps its label.

Both kinds of dim in full: docs/strategies.md, section
``autopar.strategies.rules_moe``.
"""

from __future__ import annotations

from typing import Callable

from autopar.graph import OpNode, TensorMeta
from autopar.strategies.rule_base import (Fresh, Labels, OpRule, arg, base_labels,
                                          fallback_rule, ndims, norm_dim, op_of)

# op -> index of its ``dim`` argument and that argument's default
_SCANS: dict[str, tuple[int, int]] = {
    "topk": (2, -1), "sort": (1, -1), "argsort": (1, -1), "msort": (1, 0),
    "cumsum": (1, 0), "cumprod": (1, 0), "logcumsumexp": (1, 0), "cummax": (1, 0),
    "cummin": (1, 0), "kthvalue": (2, -1),
}


def _scan(node: OpNode, in_metas: list[TensorMeta | None], fresh: Fresh) -> OpRule:
    """An op along one dim (top-k, sort, cumsum, ...): that dim is scanned
    (docs/strategies.md, section ``autopar.strategies.rules_moe``); top-k and kthvalue
    change its size, the others keep it."""
    nd = ndims(in_metas[0])
    base = base_labels(nd)
    pos, default = _SCANS[op_of(node.target)]
    if node.target.endswith(".stable"):  # sort.stable(self, *, stable, dim, descending)
        pos += 1
    d = norm_dim(int(arg(node, pos, default)), nd)
    out = base
    if op_of(node.target) in ("topk", "kthvalue") and nd:
        out = base[:d] + (fresh(),) + base[d + 1:]
        if op_of(node.target) == "kthvalue" and not arg(node, 3, False):
            out = base[:d] + base[d + 1:]
    scanned = frozenset(base[d:d + 1])
    return OpRule((base,), out[:ndims(node.out)] if nd else (), forbid=scanned,
                  per_rank=scanned, kind="routing")


def _count(node: OpNode, in_metas: list[TensorMeta | None], fresh: Fresh) -> OpRule:
    """bincount / histc: counts over every element; the counts are the rank's own
    under data parallelism, and nothing is split on a model-parallel axis."""
    nd = ndims(in_metas[0])
    base = base_labels(nd)
    ins = (base,) + tuple(base if m is not None and ndims(m) == nd else None
                          for m in in_metas[1:])
    return OpRule(ins, tuple(fresh() for _ in range(ndims(node.out))),
                  forbid=frozenset(base), per_rank=frozenset(base), kind="routing")


def _one_hot(node: OpNode, in_metas: list[TensorMeta | None], fresh: Fresh) -> OpRule:
    """one_hot(x, classes): every dim of x passes through, the class dim is new."""
    base = base_labels(ndims(in_metas[0]))
    return OpRule((base,), base + (fresh(),), kind="routing")


def _aligned(x: TensorMeta, m: TensorMeta | None, skip: int, fresh: Fresh) -> Labels | None:
    """Labels of an index or source tensor of a gather/scatter along dim ``skip`` of
    ``x``: a dim sized like x's shares its label, any other dim (the indexed one
    included) is its own."""
    if m is None:
        return None
    base = base_labels(len(x.shape))
    return tuple(base[i] if i != skip and i < len(x.shape) and s == x.shape[i] else fresh()
                 for i, s in enumerate(m.shape))


def _gather_scatter(node: OpNode, in_metas: list[TensorMeta | None], fresh: Fresh) -> OpRule:
    """gather(x, dim, index) and scatter / scatter_add / scatter_reduce(x, dim, index,
    src): dims other than ``dim`` sized alike share a label; ``dim`` and the rest are
    indexed. A gather's output is shaped like the index, a scatter's like x."""
    x = in_metas[0]
    if x is None:
        return fallback_rule(in_metas, node.out)
    base = base_labels(len(x.shape))
    d = norm_dim(int(arg(node, 1, 0)), len(x.shape))
    others = tuple(_aligned(x, m, d, fresh) for m in in_metas[1:])
    out = others[0] if op_of(node.target) == "gather" and others[0] is not None else base
    forbid = frozenset(fresh.made) | {base[d]}
    return OpRule((base,) + others, out, forbid=forbid, kind="routing")


def _index_select(node: OpNode, in_metas: list[TensorMeta | None], fresh: Fresh) -> OpRule:
    """index_select(x, dim, index): the index's dim replaces x's; a split of the index
    is a split of the output (each rank selects its part of the rows)."""
    base = base_labels(ndims(in_metas[0]))
    d = norm_dim(int(arg(node, 1, 0)), len(base))
    return OpRule((base, ("i",)), base[:d] + ("i",) + base[d + 1:],
                  forbid=frozenset({base[d]}), kind="routing")


def _index_add(node: OpNode, in_metas: list[TensorMeta | None], fresh: Fresh) -> OpRule:
    """index_add / index_copy(x, dim, index, source): rows of ``source`` written into
    x at ``index`` along ``dim`` (indexed); the other dims pass through."""
    base = base_labels(ndims(in_metas[0]))
    d = norm_dim(int(arg(node, 1, 0)), len(base))
    ins: list[Labels | None] = [base, (fresh(),)]
    ins += [base[:d] + (fresh(),) + base[d + 1:] if ndims(m) == len(base) else None
            for m in in_metas[2:]]
    return OpRule(tuple(ins), base, forbid=frozenset(fresh.made) | {base[d]},
                  kind="routing")


def _advanced_index(node: OpNode, in_metas: list[TensorMeta | None],
                    fresh: Fresh) -> tuple[Labels, list[Labels], Labels, frozenset[str]] | None:
    """Labels of ``x[i0, i1, ...]`` (aten.index): x's, each index tensor's, the
    result's and x's indexed dims; None when the pattern is not one this reads (a
    boolean mask, indices missing)."""
    x = in_metas[0]
    entries = arg(node, 1, [])
    if x is None or not isinstance(entries, list):
        return None
    positions = [p for p, e in enumerate(entries) if e is not None]
    idx = in_metas[1:1 + len(positions)]
    if not positions or len(idx) < len(positions) or any(m is None or m.dtype == "bool"
                                                         for m in idx):
        return None
    base = base_labels(len(x.shape))
    width = max(len(m.shape) for m in idx)
    shape = [1] * width
    for m in idx:
        for k, s in enumerate(m.shape):
            j = width - len(m.shape) + k
            shape[j] = max(shape[j], s)
    bl = tuple(f"i{k}" for k in range(width))
    idx_l = [tuple(bl[width - len(m.shape) + k] if s == shape[width - len(m.shape) + k]
                   else fresh() for k, s in enumerate(m.shape)) for m in idx]
    rest = tuple(base[d] for d in range(len(x.shape)) if d not in positions)
    if positions == list(range(positions[0], positions[-1] + 1)):
        out = base[:positions[0]] + bl + base[positions[-1] + 1:]
    else:
        out = bl + rest
    return base, idx_l, out, frozenset(base[p] for p in positions)


def _index(node: OpNode, in_metas: list[TensorMeta | None], fresh: Fresh) -> OpRule:
    """x[i0, i1, ...]: the indexed dims of x are replaced by the index tensors'
    broadcast dims; a split of those is a split of the output, x's other dims pass
    through."""
    parts = _advanced_index(node, in_metas, fresh)
    if parts is None or len(parts[2]) != ndims(node.out):
        return fallback_rule(in_metas, node.out)
    base, idx_l, out, indexed = parts
    ins = (base, *idx_l) + tuple(None for _ in in_metas[1 + len(idx_l):])
    return OpRule(ins, out, forbid=indexed | frozenset(fresh.made), kind="routing")


def _index_put(node: OpNode, in_metas: list[TensorMeta | None], fresh: Fresh) -> OpRule:
    """x[i0, i1, ...] = values: the output is shaped like x; the values align with
    the result of ``x[i0, ...]`` from the right, so x's non-indexed dims pass through
    x and values together. The index dims are not in the output: never split."""
    parts = _advanced_index(node, in_metas, fresh)
    if parts is None:
        return fallback_rule(in_metas, node.out)
    base, idx_l, result, indexed = parts
    ins: list[Labels | None] = [base, *idx_l]
    for m in in_metas[1 + len(idx_l):]:
        k = ndims(m)
        ins.append(None if m is None or k > len(result) else tuple(
            result[len(result) - k + j] if m.shape[j] != 1 else fresh() for j in range(k)))
    return OpRule(tuple(ins), base, forbid=indexed | frozenset(fresh.made), kind="routing")


MOE_HANDLERS: dict[str, Callable[[OpNode, list, Fresh], OpRule]] = {
    **{op: _scan for op in _SCANS},
    "bincount": _count, "histc": _count, "one_hot": _one_hot,
    "gather": _gather_scatter, "scatter": _gather_scatter, "scatter_add": _gather_scatter,
    "scatter_reduce": _gather_scatter, "index_select": _index_select,
    "index_add": _index_add, "index_copy": _index_add, "index": _index,
    "index_put": _index_put,
}
