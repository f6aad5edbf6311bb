"""Repeated-layer detection: find the blocks of a ModuleList/Sequential and group the
structurally identical ones, so later passes solve one representative per distinct
layer."""

from __future__ import annotations

import hashlib
from autopar.graph import Graph, Layer


def layer_path(module_path: str) -> str | None:
    """The outermost ``<parent>.<int>`` prefix of a module path, e.g.
    ``"blocks.3.attn.q" -> "blocks.3"``; None when the path has no indexed part."""
    parts = module_path.split(".") if module_path else []
    for i, p in enumerate(parts):
        if p.isdigit() and i > 0:
            return ".".join(parts[: i + 1])
    return None


def _strip_refs(args):
    """Arguments with tensor references (``"%name"``, also inside lists) blanked."""
    if isinstance(args, list):
        return [_strip_refs(a) for a in args]
    return "%" if isinstance(args, str) and args.startswith("%") else args


def _signature(g: Graph, names: list[str], prefix: str) -> str:
    local = {n: k for k, n in enumerate(names)}
    ext: dict[str, int] = {}
    h = hashlib.sha256()
    for n in names:
        node = g.node(n)
        refs = []
        for i in node.inputs:
            src = g.node(i)
            if i in local:
                refs.append(f"L{local[i]}")
            elif src.kind == "param":
                refs.append(f"P{src.out.shape if src.out else ()}")
            else:
                refs.append(f"E{ext.setdefault(i, len(ext))}")
        args = _strip_refs(node.args)
        h.update(repr((node.target, refs, args, node.out, node.module_type,
                       node.module_path[len(prefix):])).encode())
    return h.hexdigest()[:16]


def detect_layers(g: Graph) -> None:
    """Fill ``g.layers``, ``g.canonical`` and each node's ``layer`` in place."""
    groups: dict[str, list[str]] = {}
    order: list[str] = []
    for n in g.nodes:
        if n.kind != "op":
            continue
        lp = layer_path(n.module_path)
        if lp is None:
            continue
        if lp not in groups:
            groups[lp] = []
            order.append(lp)
        groups[lp].append(n.name)
    parents: dict[str, int] = {}
    for lp in order:
        parents[lp.rpartition(".")[0]] = parents.get(lp.rpartition(".")[0], 0) + 1
    layers = [lp for lp in order if parents[lp.rpartition(".")[0]] >= 2]
    g.layers = [Layer(lp, int(lp.rpartition(".")[2]), _signature(g, groups[lp], lp), groups[lp])
                for lp in layers]
    first: dict[str, Layer] = {}
    g.canonical = {n.name: n.name for n in g.nodes}
    for k, lay in enumerate(g.layers):
        rep = first.setdefault(lay.signature, lay)
        for a, b in zip(lay.nodes, rep.nodes):
            g.canonical[a] = b
            g.node(a).layer = k
