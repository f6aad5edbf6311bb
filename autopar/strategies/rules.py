"""Sharding rules: each operator described as an einsum-like labelling of its dims.

:func:`rule_for` gives an op's :class:`~autopar.strategies.rule_base.OpRule` from its
node and input metas (a handler per op name; those of mixture-of-experts routing in
:mod:`.rules_moe`): a label per dim of each input and of the output, with the labels
that reduce, that are never split (``forbid``) and that only data parallelism may
split (``per_rank``). :func:`has_rule` says whether an op has one; an op with none gets
:func:`fallback_rule`. :func:`loss_reduction` reads how the loss reduces. The
enumerator (:mod:`autopar.strategies.enumeration`) turns the rules into every legal
strategy of every op.

What a label's split gives the output, and which ops the one description covers:
docs/strategies.md, section ``autopar.strategies.rules``.
"""

from __future__ import annotations

from typing import Callable

from autopar.graph import OpNode, TensorMeta
from autopar.strategies.rule_base import (Fresh as _Fresh, Labels, OpRule, arg as _arg,
                                          base_labels as _base, fallback_rule,
                                          ndims as _dims, norm_dim as _norm_dim,
                                          op_of as _op)
from autopar.strategies.rules_moe import MOE_HANDLERS

__all__ = ["Labels", "OpRule", "broadcast_rule", "constant_rule", "fallback_rule", "has_rule",
           "loss_reduction", "permute_rule", "rule_for", "view_groups", "view_rule"]


def broadcast_rule(in_metas: list[TensorMeta | None], out: TensorMeta, fresh: _Fresh) -> OpRule:
    """Pointwise op with numpy broadcasting: dims aligned from the right share labels."""
    n = len(out.shape)
    out_l = _base(n)
    ins: list[Labels | None] = []
    for m in in_metas:
        if m is None:
            ins.append(None)
            continue
        k = len(m.shape)
        labs = []
        for j in range(k):
            o = n - k + j
            if o >= 0 and m.shape[j] == out.shape[o]:
                labs.append(out_l[o])
            else:
                labs.append(fresh())
        ins.append(tuple(labs))
    return OpRule(tuple(ins), out_l, kind="pointwise")


def view_groups(src: tuple[int, ...], dst: tuple[int, ...]) -> list[tuple[list[int], list[int]]]:
    """The dims of a reshape grouped by equal running products: each (source dims,
    destination dims) pair holds the same elements in the same order."""
    groups = []
    i = j = 0
    while i < len(src) or j < len(dst):
        gi, gj = [i], [j]
        pi = src[i] if i < len(src) else 1
        pj = dst[j] if j < len(dst) else 1
        i, j = i + 1, j + 1
        while pi != pj:
            if pi < pj and i < len(src):
                pi *= src[i]; gi.append(i); i += 1
            elif j < len(dst):
                pj *= dst[j]; gj.append(j); j += 1
            else:
                break
        groups.append(([k for k in gi if k < len(src)], [k for k in gj if k < len(dst)]))
    return groups


def view_rule(src: tuple[int, ...], dst: tuple[int, ...], fresh: _Fresh) -> OpRule:
    """A reshape: dims grouped by equal running products; the leading non-unit dim of
    each group keeps its label across the reshape (so a split of it stays a split of
    the leading dim), the others are unsplittable."""
    in_l = [fresh() for _ in src]
    out_l = [fresh() for _ in dst]
    for gi, gj in view_groups(src, dst):
        a = next((k for k in gi if src[k] != 1), None)
        b = next((k for k in gj if dst[k] != 1), None)
        if a is not None and b is not None:
            out_l[b] = in_l[a]
    return OpRule((tuple(in_l),), tuple(out_l), kind="view")


def permute_rule(ndim: int, perm: list[int]) -> OpRule:
    """Output dim k is input dim perm[k]."""
    base = _base(ndim)
    return OpRule((base,), tuple(base[p % ndim] for p in perm), kind="view")


def _matmul_rule(a: TensorMeta, b: TensorMeta, fresh: _Fresh) -> OpRule:
    """torch.matmul semantics, including 1-d operands and broadcast batch dims."""
    na, nb = len(a.shape), len(b.shape)
    m, k, n = "m", "k", "n"
    la = (k,) if na == 1 else (m, k)
    lb = (k,) if nb == 1 else (k, n)
    batch_a, batch_b = a.shape[:-2] if na > 2 else (), b.shape[:-2] if nb > 2 else ()
    nbatch = max(len(batch_a), len(batch_b))
    bl = [f"b{i}" for i in range(nbatch)]
    pa = tuple(bl[nbatch - len(batch_a) + i] if batch_a[i] == _bcast(batch_a, batch_b, nbatch, i, True)
               else fresh() for i in range(len(batch_a)))
    pb = tuple(bl[nbatch - len(batch_b) + i] if batch_b[i] == _bcast(batch_a, batch_b, nbatch, i, False)
               else fresh() for i in range(len(batch_b)))
    out = tuple(bl) + ((m,) if na > 1 else ()) + ((n,) if nb > 1 else ())
    return OpRule((pa + la, pb + lb), out, reduce=frozenset({k}), kind="matmul")


def _bcast(sa: tuple[int, ...], sb: tuple[int, ...], n: int, i: int, first: bool) -> int:
    """Broadcast size of the batch dim that dim i of the first/second operand maps to."""
    own, other = (sa, sb) if first else (sb, sa)
    pos = n - len(own) + i
    j = pos - (n - len(other))
    o = other[j] if 0 <= j < len(other) else 1
    return max(own[i], o)


def _einsum_rule(eq: str) -> OpRule:
    lhs, _, rhs = eq.replace(" ", "").partition("->")
    ins = tuple(tuple(t) for t in lhs.split(","))
    out = tuple(rhs)
    used = {c for t in ins for c in t}
    return OpRule(ins, out, reduce=frozenset(used - set(out)), kind="matmul")


_POINTWISE = frozenset("""
add sub mul div neg exp log log1p tanh sigmoid gelu silu relu pow rsqrt sqrt where masked_fill
clamp clamp_min clamp_max dropout to _to_copy type_as clone contiguous alias detach abs sin cos
reciprocal erf maximum minimum eq ne lt gt le ge logical_not logical_and logical_or bitwise_not
mish hardtanh leaky_relu softplus elu sign square floor ceil round fill lift_fresh_copy
native_dropout _assert_tensor_metadata zeros_like ones_like full_like empty_like rand_like
rsub true_divide floor_divide remainder fmod trunc isnan isinf nan_to_num logical_xor
bitwise_and bitwise_or bitwise_xor __and__ __or__ __xor__ __invert__ lerp addcmul addcdiv
exp2 expm1 log2 tan atan sinh cosh asin acos atan2 hardswish hardsigmoid relu6 selu celu
copy randn_like randint_like xlogy
""".split())
_CREATION = frozenset("""arange zeros ones full empty scalar_tensor randn rand randint tensor
linspace eye new_zeros new_ones new_full new_empty""".split())
_SUM_REDUCTIONS = frozenset("sum mean".split())
_OTHER_REDUCTIONS = frozenset("amax amin max min var std prod argmax argmin logsumexp all any".split())


def rule_for(node: OpNode, in_metas: list[TensorMeta | None]) -> OpRule:
    """The sharding rule of ``node`` given its tensor inputs' metadata (in order); an
    op no rule describes gets :func:`fallback_rule` (see :func:`has_rule`)."""
    fresh = _Fresh()
    op = _op(node.target)
    out = node.out
    handler = _HANDLERS.get(op) or MOE_HANDLERS.get(op)
    if handler is not None:
        return handler(node, in_metas, fresh)
    if op in _POINTWISE and out is not None:
        return broadcast_rule(in_metas, out, fresh)
    if op in _CREATION:
        return OpRule(tuple(None for _ in in_metas), tuple(fresh() for _ in range(_dims(out))),
                      kind="creation")
    if op in _SUM_REDUCTIONS or op in _OTHER_REDUCTIONS:
        return _reduction_rule(node, in_metas, fresh, op in _SUM_REDUCTIONS)
    return fallback_rule(in_metas, out)


def has_rule(target: str) -> bool:
    """True when an operator has a rule of its own (others get :func:`fallback_rule`)."""
    op = _op(target)
    return (op in _HANDLERS or op in MOE_HANDLERS or op in _POINTWISE or op in _CREATION
            or op in _SUM_REDUCTIONS or op in _OTHER_REDUCTIONS)


def constant_rule(node: OpNode, in_metas: list[TensorMeta | None]) -> OpRule:
    """The rule of an op computed from shapes and buffers alone (see
    :func:`autopar.strategies.analysis.constant_ops`): nothing of it is ever split."""
    fresh = _Fresh()
    return OpRule(tuple(None for _ in in_metas), tuple(fresh() for _ in range(_dims(node.out))),
                  kind="constant")


def _reduction_rule(node: OpNode, in_metas, fresh: _Fresh, summing: bool) -> OpRule:
    x = in_metas[0]
    nd = _dims(x)
    base = _base(nd)
    dims = _arg(node, 1, None)
    if isinstance(dims, int):
        dims = [dims]
    if not isinstance(dims, list) or not dims:
        dims = list(range(nd))
    dims = sorted({_norm_dim(d, nd) for d in dims if isinstance(d, int)})
    keep = bool(_arg(node, 2, False)) if not isinstance(_arg(node, 2), str) else False
    out_l = []
    for i in range(nd):
        if i in dims:
            if keep:
                out_l.append(fresh())
        else:
            out_l.append(base[i])
    red = frozenset(base[d] for d in dims)
    return OpRule((base,) + tuple(None for _ in in_metas[1:]), tuple(out_l)[:_dims(node.out)],
                  reduce=red if summing else frozenset(),
                  forbid=frozenset() if summing else red, kind="reduction")


def _linear(node, in_metas, fresh):
    x = in_metas[0]
    batch = tuple(f"b{i}" for i in range(_dims(x) - 1))
    ins = [batch + ("k",), ("n", "k")]
    if len(in_metas) > 2:
        ins.append(("n",))
    return OpRule(tuple(ins), batch + ("n",), reduce=frozenset({"k"}), kind="matmul")


def _addmm(node, in_metas, fresh):
    bias = in_metas[0]
    bl = ("n",) if _dims(bias) == 1 else ("m", "n")[: _dims(bias)]
    return OpRule((bl, ("m", "k"), ("k", "n")), ("m", "n"), reduce=frozenset({"k"}), kind="matmul")


def _mm(node, in_metas, fresh):
    return OpRule((("m", "k"), ("k", "n")), ("m", "n"), reduce=frozenset({"k"}), kind="matmul")


def _bmm(node, in_metas, fresh):
    ins = (("b", "m", "k"), ("b", "k", "n"))
    if _op(node.target) == "baddbmm":
        ins = (("b", "m", "n"),) + ins
    return OpRule(ins, ("b", "m", "n"), reduce=frozenset({"k"}), kind="matmul")


def _matmul(node, in_metas, fresh):
    return _matmul_rule(in_metas[0], in_metas[1], fresh)


def _einsum(node, in_metas, fresh):
    return _einsum_rule(str(node.args[0]))


def _embedding(node, in_metas, fresh):
    idx = in_metas[1]
    batch = tuple(f"b{i}" for i in range(_dims(idx)))
    return OpRule((("v", "h"), batch), batch + ("h",), reduce=frozenset({"v"}), kind="embedding")


def _norm(node, in_metas, fresh):
    x = in_metas[0]
    nd = _dims(x)
    shape = _arg(node, 1, [])
    k = len(shape) if isinstance(shape, list) else 1
    base = _base(nd)
    normed = base[nd - k:]
    ins: list[Labels | None] = [base]
    for m in in_metas[1:]:
        ins.append(normed[len(normed) - _dims(m):] if m is not None else None)
    return OpRule(tuple(ins), base, forbid=frozenset(normed), kind="norm")


_EVAL_BATCH_NORMS = frozenset({"_native_batch_norm_legit_no_training"})
_TRAINING_ARG = {"batch_norm": 5, "native_batch_norm": 5, "_native_batch_norm_legit": 5,
                 "_native_batch_norm_legit_functional": 5}


def _channel_norm(node, in_metas, fresh):
    """batch_norm / group_norm on (N, C, *spatial): per-channel affine parameters and
    running statistics carry C. A training batch norm normalizes each channel over
    the batch and the spatial dims (a batch statistic: only C may be split); a group
    norm normalizes each sample over its groups (N may be split, C not); a batch
    norm in eval mode is per element."""
    x = in_metas[0]
    nd = _dims(x)
    base = _base(nd)
    op = _op(node.target)
    ins: list[Labels | None] = [base]
    for m in in_metas[1:]:
        ins.append(("d1",) if nd > 1 and _dims(m) == 1 and m.shape[0] == x.shape[1] else None)
    if op == "group_norm":
        forbid = frozenset(base[1:])
    elif op in _EVAL_BATCH_NORMS or (op in _TRAINING_ARG
                                     and _arg(node, _TRAINING_ARG[op], True) is False):
        forbid = frozenset()
    else:
        forbid = frozenset(base) - {"d1"}
    outs = node.outs or [node.out]
    return OpRule(tuple(ins), base[:_dims(outs[0])], forbid=forbid, kind="norm")


def _softmax(node, in_metas, fresh):
    nd = _dims(in_metas[0])
    base = _base(nd)
    d = _norm_dim(int(_arg(node, 1, -1)), nd)
    return OpRule((base,), base, forbid=frozenset({base[d]}), kind="softmax")


def _cross_entropy(node, in_metas, fresh):
    logits = in_metas[0]
    nd = _dims(logits)
    if nd == 1:
        lab: Labels = ("c",)
        tl: Labels = ()
    else:
        lab = ("n", "c") + tuple(f"e{i}" for i in range(nd - 2))
        tl = ("n",) + lab[2:]
    none = _reduction(node) == 0
    out = tl if none else ()
    ins: list[Labels | None] = [lab, tl]
    ins += [None] * (len(in_metas) - 2)
    reduce = frozenset() if none else frozenset(tl)
    return OpRule(tuple(ins), out, reduce=reduce, forbid=frozenset({"c"}), kind="loss")


_POINTWISE_LOSS_REDUCTION_ARG = {
    "mse_loss": 2, "l1_loss": 2, "smooth_l1_loss": 2, "huber_loss": 2, "kl_div": 2,
    "soft_margin_loss": 2, "binary_cross_entropy": 3, "binary_cross_entropy_with_logits": 4,
}
"""Losses computed element by element and then reduced: the position of their
``reduction`` argument (aten schemas: 0 none, 1 mean, 2 sum; mean by default)."""


_LOSS_REDUCTION_ARG = {"cross_entropy_loss": 3, "nll_loss": 3, "nll_loss_nd": 3,
                       "nll_loss2d": 3, "nll_loss_forward": 3,
                       **_POINTWISE_LOSS_REDUCTION_ARG}
"""Losses with a ``reduction`` argument, and its position (cross-entropy and NLL as the
pointwise losses: aten schemas)."""


def loss_reduction(graph) -> str:
    """How the captured loss (the graph's ``loss`` node) reduces over the batch: ``"sum"`` when
    the op that makes it is a sum (``torch.sum``, or a loss with ``reduction="sum"``) to
    one value, else ``"mean"``. Under data parallelism and micro-batches every rank
    computes the loss of its own samples; the runtime averages those (and the
    gradients), which equals the loss of the whole batch for a mean, and for a sum
    only once each is scaled by their count (:func:`autopar.runtime.loss_scale`)."""
    n = graph.node(graph.loss)
    if n.kind != "op" or n.out is None or n.out.numel != 1:
        return "mean"
    op = _op(n.target)
    if op == "sum":
        return "sum"
    if op in _LOSS_REDUCTION_ARG:
        return "sum" if _reduction(n) == 2 else "mean"
    return "mean"


def _reduction(node) -> int:
    """The ``reduction`` argument of a loss op of :data:`_LOSS_REDUCTION_ARG` (0 none,
    1 mean, 2 sum; mean when absent)."""
    red = _arg(node, _LOSS_REDUCTION_ARG[_op(node.target)], 1)
    return red if isinstance(red, int) else 1


def _pointwise_loss(node, in_metas, fresh):
    """An element-wise loss: every dim of the prediction may be split (targets and
    weights broadcast against it); a reduced loss is a partial sum over the split dims."""
    nd = _dims(in_metas[0])
    base = _base(nd)
    ins: list[Labels | None] = []
    for m in in_metas:
        k = _dims(m) if m is not None else 0
        ins.append(None if m is None else tuple(
            base[nd - k + i] if m.shape[i] == in_metas[0].shape[nd - k + i] else fresh()
            for i in range(k)))
    if _reduction(node) == 0:
        return OpRule(tuple(ins), base, kind="loss")
    return OpRule(tuple(ins), (), reduce=frozenset(base), kind="loss")


def _sdpa(node, in_metas, fresh):
    q, k, v = in_metas[:3]
    nd = _dims(q)
    batch = tuple(f"b{i}" for i in range(nd - 2))
    causal = _arg(node, 5, False) is True
    ql, kl, vl = batch + ("L", "E"), batch + ("S", "E"), batch + ("S", "Ev")
    ins: list[Labels | None] = [ql, kl, vl]
    for m in in_metas[3:]:
        if m is None:
            ins.append(None)
        else:
            full = batch + ("L", "S")
            ins.append(tuple(full[len(full) - _dims(m) + i] if m.shape[i] != 1 else fresh()
                             for i in range(_dims(m))))
    forbid = {"S", "E"} | ({"L"} if causal else set())
    return OpRule(tuple(ins), batch + ("L", "Ev"), forbid=frozenset(forbid), kind="attention")


def _view(node, in_metas, fresh):
    return view_rule(in_metas[0].shape, node.out.shape, fresh)


def _permute(node, in_metas, fresh):
    return permute_rule(_dims(in_metas[0]), list(node.args[1]))


def _transpose(node, in_metas, fresh):
    nd = _dims(in_metas[0])
    op = _op(node.target)
    if op in ("t", "numpy_T"):
        perm = list(range(nd))[::-1]
    elif op in ("mT", "mH", "adjoint"):
        perm = list(range(nd - 2)) + [nd - 1, nd - 2]
    else:
        a, b = _norm_dim(node.args[1], nd), _norm_dim(node.args[2], nd)
        perm = list(range(nd))
        perm[a], perm[b] = perm[b], perm[a]
    return permute_rule(nd, perm)


def _expand(node, in_metas, fresh):
    src, dst = in_metas[0].shape, node.out.shape
    off = len(dst) - len(src)
    out_l = [fresh() for _ in dst]
    in_l = []
    for i, s in enumerate(src):
        if s == dst[off + i]:
            out_l[off + i] = f"d{i}"
            in_l.append(f"d{i}")
        else:
            in_l.append(fresh())
    return OpRule((tuple(in_l),), tuple(out_l), kind="view")


def _repeat_interleave(node, in_metas, fresh):
    """``x.repeat_interleave(r, dim)`` with an int ``r``: each slice of ``dim`` repeated
    ``r`` times in place, so a contiguous split of ``dim`` stays one after it (GQA's
    key/value heads: kv head ``j`` serves query heads ``j·r .. j·r + r - 1``, and a
    split of the kv heads is the matching split of the query heads). Without ``dim``
    the input is flattened; with a tensor of repeats the dim cannot be split."""
    x = in_metas[0]
    nd = _dims(x)
    base = _base(nd)
    dim = _arg(node, 2, None)
    if not isinstance(dim, int) or nd == 0:
        return OpRule((base,) + tuple(None for _ in in_metas[1:]),
                      tuple(fresh() for _ in range(_dims(node.out))),
                      forbid=frozenset(base), kind="copy")
    d = _norm_dim(dim, nd)
    per_element = len(in_metas) > 1 or not isinstance(_arg(node, 1, None), int)
    forbid = frozenset({base[d]}) if per_element else frozenset()
    return OpRule((base,) + tuple(None for _ in in_metas[1:]), base, forbid=forbid,
                  kind="copy")


def _triangular(node, in_metas, fresh):
    """triu / tril: which elements stay depends on their row and column, so the last
    two dims are never split; the leading (batch) dims are."""
    nd = _dims(in_metas[0])
    base = _base(nd)
    return OpRule((base,), base, forbid=frozenset(base[-2:]), kind="pointwise")


def _slice(node, in_metas, fresh):
    x = in_metas[0]
    nd = _dims(x)
    base = _base(nd)
    d = _norm_dim(int(_arg(node, 1, 0)), nd)
    if x.shape[d] == node.out.shape[d] and (_arg(node, 4, 1) in (1, None)):
        return OpRule((base,), base, kind="view")
    out = tuple(fresh() if i == d else base[i] for i in range(nd))
    return OpRule((base,), out, forbid=frozenset({base[d]}), kind="view")


def _select(node, in_metas, fresh):
    nd = _dims(in_metas[0])
    base = _base(nd)
    d = _norm_dim(int(node.args[1]), nd)
    return OpRule((base,), base[:d] + base[d + 1:], forbid=frozenset({base[d]}), kind="view")


def _split(node, in_metas, fresh):
    nd = _dims(in_metas[0])
    base = _base(nd)
    op = _op(node.target)
    d = 0 if op == "unbind" and len(node.args) < 2 else _norm_dim(int(_arg(node, 2 if op != "unbind" else 1, 0)), nd)
    out = base if op != "unbind" else base[:d] + base[d + 1:]
    return OpRule((base,), out, forbid=frozenset({base[d]}), kind="view")


def _getitem(node, in_metas, fresh):
    nd = _dims(node.out)
    base = _base(nd)
    return OpRule((base,), base, kind="view")


def _cat(node, in_metas, fresh):
    nd = _dims(node.out)
    base = _base(nd)
    op = _op(node.target)
    d = _norm_dim(int(_arg(node, 1, 0)), nd)
    if op == "stack":
        ins_l = base[:d] + base[d + 1:]
        return OpRule(tuple(ins_l for _ in in_metas), base, forbid=frozenset({base[d]}), kind="view")
    return OpRule(tuple(base for _ in in_metas), base, forbid=frozenset({base[d]}), kind="view")


def _squeeze_unsqueeze(node, in_metas, fresh):
    return view_rule(in_metas[0].shape, node.out.shape, fresh)


def _outer(node, in_metas, fresh):
    return OpRule((("i",), ("j",)), ("i", "j"), kind="matmul")


_HANDLERS: dict[str, Callable[[OpNode, list, _Fresh], OpRule]] = {
    "linear": _linear, "addmm": _addmm, "mm": _mm, "bmm": _bmm, "baddbmm": _bmm,
    "matmul": _matmul, "einsum": _einsum, "outer": _outer, "embedding": _embedding,
    "layer_norm": _norm, "rms_norm": _norm, "group_norm": _channel_norm,
    "batch_norm": _channel_norm, "native_batch_norm": _channel_norm,
    "_native_batch_norm_legit": _channel_norm,
    "_native_batch_norm_legit_functional": _channel_norm,
    "_native_batch_norm_legit_no_training": _channel_norm,
    "_batch_norm_with_update": _channel_norm,
    "softmax": _softmax, "_softmax": _softmax, "log_softmax": _softmax, "_log_softmax": _softmax,
    "cross_entropy_loss": _cross_entropy, "nll_loss": _cross_entropy,
    "nll_loss_nd": _cross_entropy, "nll_loss_forward": _cross_entropy,
    **{op: _pointwise_loss for op in _POINTWISE_LOSS_REDUCTION_ARG},
    "scaled_dot_product_attention": _sdpa,
    "view": _view, "_unsafe_view": _view, "reshape": _view, "flatten": _view, "unflatten": _view,
    "squeeze": _squeeze_unsqueeze, "unsqueeze": _squeeze_unsqueeze,
    "permute": _permute, "transpose": _transpose, "t": _transpose, "numpy_T": _transpose,
    "mT": _transpose, "mH": _transpose, "adjoint": _transpose, "swapaxes": _transpose,
    "swapdims": _transpose, "expand": _expand, "repeat_interleave": _repeat_interleave,
    "triu": _triangular, "tril": _triangular,
    "slice": _slice, "select": _select, "split": _split, "split_with_sizes": _split,
    "chunk": _split, "unbind": _split, "getitem": _getitem, "cat": _cat, "stack": _cat,
}
