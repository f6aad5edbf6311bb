"""How many aten ops each op of the captured graph dispatches in eager PyTorch, by kind.

The graph holds ops as ``torch.export`` records them before dispatch (``aten.linear``
on a 3-D input, ``aten.rms_norm``); run eagerly each dispatches one to a dozen aten
ops, and the host pays per dispatched op. :func:`count_op` counts them by running the
op once on meta tensors of its shapes under a counting dispatch mode, forward and
backward, each sorted into a kind of :data:`KINDS` (:func:`dispatch_kind`);
:func:`graph_dispatches` counts a whole graph, once per distinct call. Ops a GPU runs
fused and the meta device decomposes: :data:`GPU_FUSED`. How the counts are priced:
docs/cost_models.md, section ``autopar.cost_models.host``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from autopar.cost_models.compute import is_matmul, is_norm
from autopar.flops import op_name
from autopar.graph import Graph, OpNode, TensorMeta

KINDS = ("matmul", "attention", "norm", "pointwise", "view", "embedding")
"""Kinds of dispatched aten ops, each with its own host seconds per op."""

_MATMUL = frozenset({"mm", "addmm", "bmm", "baddbmm", "addbmm", "_scaled_mm",
                     "_grouped_mm", "_scaled_grouped_mm", "convolution",
                     "convolution_backward"})
_NORM = frozenset({"native_layer_norm", "native_layer_norm_backward", "_fused_rms_norm",
                   "_fused_rms_norm_backward", "native_batch_norm",
                   "native_batch_norm_backward", "native_group_norm",
                   "native_group_norm_backward"})
_EMBEDDING = frozenset({"embedding", "embedding_dense_backward", "embedding_backward"})


@dataclass(frozen=True)
class Dispatches:
    """Aten ops dispatched by one call of an op, per kind of :data:`KINDS`, in its
    forward and in its backward."""

    fwd: tuple[int, ...]
    bwd: tuple[int, ...]

    @property
    def forward_ops(self) -> int:
        """Aten ops dispatched in the forward, of every kind."""
        return sum(self.fwd)


def _counts(kinds: Counter) -> tuple[int, ...]:
    return tuple(kinds.get(k, 0) for k in KINDS)


GPU_FUSED: dict[str, Dispatches] = {
    "rms_norm": Dispatches(_counts(Counter(norm=1)), _counts(Counter(norm=1))),
    "scaled_dot_product_attention": Dispatches(_counts(Counter(attention=1)),
                                               _counts(Counter(attention=1))),
}
"""Composite ops a GPU runs as one fused kernel each way (module docstring)."""


def dispatch_kind(func: Any) -> str:
    """The kind of :data:`KINDS` of a dispatched aten op (an ``OpOverload``)."""
    name = func.overloadpacket.__name__
    if name in _MATMUL:
        return "matmul"
    if "attention" in name:
        return "attention"
    if name in _NORM:
        return "norm"
    if name in _EMBEDDING:
        return "embedding"
    if getattr(func, "is_view", False) or name in ("t", "detach", "_unsafe_view"):
        return "view"
    return "pointwise"


class _Counting(TorchDispatchMode):
    """Counts the aten ops dispatched while it is active, by kind."""

    def __init__(self) -> None:
        super().__init__()
        self.kinds: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        self.kinds[dispatch_kind(func)] += 1
        return func(*args, **(kwargs or {}))


def _resolve(target: str) -> Any:
    """The ``OpOverload`` of an ``aten.<name>.<overload>`` target, or None."""
    parts = target.split(".")
    if len(parts) != 3 or parts[0] != "aten":
        return None
    packet = getattr(torch.ops.aten, parts[1], None)
    return getattr(packet, parts[2], None) if packet is not None else None


def _tensor(meta: TensorMeta, grad: bool) -> torch.Tensor:
    dtype = getattr(torch, meta.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(meta.dtype)
    t = torch.empty(tuple(meta.shape), dtype=dtype, device="meta")
    return t.requires_grad_(grad and dtype.is_floating_point)


ATTENTION_OPS = ("scaled_dot_product_attention",)
"""Op names priced as attention (the rest of the matrix products are ``matmul``)."""


def op_kind(target: str, flops: float, nbytes: float) -> str:
    """The host-time kind of a captured op, when it is not counted as dispatched:
    ``attention``, ``matmul``, ``norm``, ``embedding``, ``view`` (moves no bytes) or
    ``pointwise`` (everything else)."""
    name = op_name(target)
    if any(a in name for a in ATTENTION_OPS):
        return "attention"
    if is_matmul(target):
        return "matmul"
    if is_norm(target):
        return "norm"
    if name == "embedding":
        return "embedding"
    if not flops and not nbytes:
        return "view"
    return "pointwise"


def _fallback(target: str, flops: float, nbytes: float, grad: bool) -> Dispatches:
    one = _counts(Counter({op_kind(target, flops, nbytes): 1}))
    return Dispatches(one, one if grad else _counts(Counter()))


def count_op(n: OpNode, metas: dict[str, TensorMeta | None],
             grads: dict[str, bool]) -> Dispatches:
    """The aten ops one call of op ``n`` dispatches (module docstring); ``metas`` and
    ``grads``: each input node's output metadata and whether a gradient reaches it."""
    name = n.target.split(".")[1] if n.target.startswith("aten.") else n.target
    if name in GPU_FUSED:
        fused = GPU_FUSED[name]
        return fused if n.requires_grad else Dispatches(fused.fwd, _counts(Counter()))
    func = _resolve(n.target)
    if func is None:
        return Dispatches(_counts(Counter()), _counts(Counter()))  # getitem, Python ops
    try:
        return _run(func, n, metas, grads)
    except Exception:  # noqa: BLE001 — an op meta tensors cannot run: one op each way
        return _fallback(n.target, n.flops, n.bytes, n.requires_grad)


def _run(func: Any, n: OpNode, metas: dict[str, TensorMeta | None],
         grads: dict[str, bool]) -> Dispatches:
    leaves: list[torch.Tensor] = []

    def arg(a: Any) -> Any:
        if isinstance(a, str) and a.startswith("%"):
            meta = metas.get(a[1:])
            if meta is None:
                raise ValueError(a)
            t = _tensor(meta, grads.get(a[1:], False) and n.requires_grad)
            if t.requires_grad:
                leaves.append(t)
            return t
        if isinstance(a, list):
            return [arg(x) for x in a]
        return a
    args = [arg(a) for a in n.args]
    with _Counting() as fwd:
        out = func(*args)
    outs = [t for t in tree_flatten(out)[0]
            if isinstance(t, torch.Tensor) and t.requires_grad]
    bwd = _Counting()
    if outs and leaves:
        seeds = [torch.ones_like(t) for t in outs]
        with bwd:
            torch.autograd.grad(outs, leaves, seeds, allow_unused=True)
    return Dispatches(_counts(fwd.kinds), _counts(bwd.kinds))


def _signature(n: OpNode, g: Graph) -> tuple:
    ins = []
    for i in n.inputs:
        src = g.node(i)
        meta = src.out
        ins.append((i, None if meta is None else (tuple(meta.shape), meta.dtype),
                    src.requires_grad))
    key_args = [a if not (isinstance(a, str) and a.startswith("%")) else "%" for a in
                tree_flatten(n.args)[0]]
    return (n.target, tuple(x[1:] for x in ins), repr(key_args), n.requires_grad)


def graph_dispatches(g: Graph) -> dict[str, Dispatches]:
    """:func:`count_op` of every op of ``g`` by name, each distinct call (target,
    input shapes, arguments) run once."""
    seen: dict[tuple, Dispatches] = {}
    out: dict[str, Dispatches] = {}
    for n in g.nodes:
        if n.kind != "op":
            continue
        key = _signature(n, g)
        if key not in seen:
            metas = {i: g.node(i).out for i in n.inputs}
            grads = {i: g.node(i).requires_grad for i in n.inputs}
            seen[key] = count_op(n, metas, grads)
        out[n.name] = seen[key]
    return out
