"""Patterns of exported programs that capture reads as one simpler op.

``list(x)`` followed by ``torch.cat(..., dim=0)`` (Hugging Face's LLaVA turns its batch of
image features into the flat list of image tokens this way) is ``unbind`` along a dim,
one ``getitem`` per slice and a ``cat`` of every slice in order along the same dim: the
values of ``x.flatten(d, d + 1)``. Read op by op, ``unbind`` along the batch selects
single samples, which data parallelism must refuse; read whole, the flatten keeps each
sample's rows together, which it splits like any reshape.

:func:`without_checks` leaves out of a captured graph the ops that only feed a run-time
check (docs/capture.md, section ``autopar.fx_patterns``).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch

from autopar.graph import OpNode

FLATTEN = "aten.flatten.using_ints"
"""The target the merged ``cat`` is captured as."""


@dataclass(frozen=True)
class Flattened:
    """A ``cat`` that equals ``source.flatten(dim, dim + 1)``."""

    source: torch.fx.Node
    dim: int


def _norm(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def _unbind_of(cat: torch.fx.Node) -> Flattened | None:
    """The flatten ``cat`` equals when its operand is every slice of one ``unbind``, in
    order, each used by it alone, along the unbound dim; else None."""
    if cat.target is not torch.ops.aten.cat.default or not cat.args:
        return None
    pieces = cat.args[0]
    if not isinstance(pieces, (list, tuple)) or not pieces or not all(
            isinstance(p, torch.fx.Node) and p.target is operator.getitem
            and len(p.users) == 1 for p in pieces):
        return None
    unbind = pieces[0].args[0]
    if not isinstance(unbind, torch.fx.Node) or unbind.target is not torch.ops.aten.unbind.int:
        return None
    source = unbind.args[0]
    val = source.meta.get("val") if isinstance(source, torch.fx.Node) else None
    if val is None or val.dim() < 2:
        return None
    dim = _norm(int(unbind.args[1]) if len(unbind.args) > 1 else 0, val.dim())
    cat_dim = _norm(int(cat.args[1]) if len(cat.args) > 1 else 0, val.dim() - 1)
    whole = [p.args[0] is unbind and p.args[1] == k for k, p in enumerate(pieces)]
    if cat_dim != dim or not all(whole) or len(pieces) != val.shape[dim] or \
            len(unbind.users) != len(pieces):
        return None
    return Flattened(source, dim)


def flattened_cats(graph: torch.fx.Graph) -> tuple[dict[torch.fx.Node, Flattened],
                                                    set[torch.fx.Node]]:
    """Each ``cat`` of ``graph`` that equals a flatten (:class:`Flattened`), and the
    ``unbind`` and ``getitem`` nodes that then go unread."""
    merged: dict[torch.fx.Node, Flattened] = {}
    unread: set[torch.fx.Node] = set()
    for node in graph.nodes:
        found = _unbind_of(node) if node.op == "call_function" else None
        if found is not None:
            merged[node] = found
            unread.update(node.args[0])
            unread.add(node.args[0][0].args[0])
    return merged, unread


_CHECK_OPS = frozenset({"aten._is_all_true.default"})
"""Ops that end a run-time check's computation (its value goes to ``item`` and an
assertion only)."""


def without_checks(nodes: list[OpNode], outputs: list[str]) -> list[OpNode]:
    """``nodes`` without the ops that only feed a run-time check (``torch._check_tensor_all``:
    LLaVA counts its image tokens over the whole batch to assert it) and no output of
    the program. Other ops whose values go unused stay: eager PyTorch runs them."""
    live = set(outputs)
    for n in reversed(nodes):
        if n.name in live:
            live.update(n.inputs)
    users: dict[str, int] = {}
    for n in nodes:
        for i in n.inputs:
            users[i] = users.get(i, 0) + 1
    gone: dict[str, int] = {}  # how many of a node's users were dropped
    dropped: set[str] = set()
    for n in reversed(nodes):
        if n.kind != "op" or n.name in live:
            continue
        if (n.target in _CHECK_OPS and not users.get(n.name)) or \
                (users.get(n.name) and gone.get(n.name) == users[n.name]):
            dropped.add(n.name)
            for i in n.inputs:
                gone[i] = gone.get(i, 0) + 1
    return [n for n in nodes if n.name not in dropped]
