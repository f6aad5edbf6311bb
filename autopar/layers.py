"""Repeated layers: find the blocks of a ModuleList / Sequential, group the structurally
identical ones, and replicate a captured block to a model's full depth.

A *layer instance* is a module whose path is ``<parent>.<int>`` where ``<parent>`` (not
the root) holds at least two indexed children that run ops in the graph. An op belongs
to the outermost such module on its module path, so lists nested inside a block (a MoE
layer's experts) belong to that block. Structurally identical layers share a
``signature``; :func:`detect_layers` maps every node of a layer to the node at the same
position of the first layer with its signature (``Graph.canonical``), so the planner
solves one representative per distinct layer.

:func:`replicate_layers` is the other half of capture's fast path: the model is captured
with each long homogeneous block list cut to its first two blocks, and the second block
is copied to the full depth here (checked to give the graph a full capture gives).
"""

from __future__ import annotations

import contextlib
import hashlib
import re
from collections.abc import Iterator
from dataclasses import replace
from itertools import chain
from typing import Any, NamedTuple

from torch import nn

from autopar.graph import Graph, Layer, OpNode, ParamInfo


def indexed_prefixes(module_path: str) -> list[str]:
    """The ``<parent>.<int>`` prefixes of a module path, outermost first (the root's own
    children are not counted): ``"blocks.3.moe.experts.1.w" -> ["blocks.3",
    "blocks.3.moe.experts.1"]``."""
    parts = module_path.split(".") if module_path else []
    return [".".join(parts[: i + 1]) for i in range(1, len(parts)) if parts[i].isdigit()]


def _parent(path: str) -> str:
    return path.rpartition(".")[0]


def _rel(path: str, prefix: str) -> str:
    if path == prefix:
        return ""
    return path[len(prefix) + 1:] if path.startswith(prefix + ".") else path


def layer_signature(g: Graph, names: list[str], prefix: str,
                    known: set[str] | None = None) -> str:
    """Hash of a layer's op sequence: per node its target, inputs renamed relative to the
    layer (``L<k>`` = the layer's k-th node, ``ext:<k>`` = the k-th distinct outside
    tensor by first use, parameters by shape and dtype), its arguments with tensor
    references renamed the same way, output metadata, and module path relative to the
    layer. Structurally identical layers get equal signatures."""
    local = {n: k for k, n in enumerate(names)}
    ext: dict[str, int] = {}
    known = known if known is not None else {n.name for n in g.nodes}

    def ref(name: str) -> str:
        if name in local:
            return f"L{local[name]}"
        src = g.node(name)
        if src.kind == "param" and src.out is not None:
            return f"param:{src.out.shape}:{src.out.dtype}"
        return f"ext:{ext.setdefault(name, len(ext))}"

    h = hashlib.sha256()
    for n in names:
        node = g.node(n)
        refs = [ref(i) for i in node.inputs]
        args = rename_refs(node.args, lambda s: "%" + ref(s) if s in known else None)
        h.update(repr((node.target, refs, args, node.out, node.outs,
                       _rel(node.module_path, prefix), node.module_type)).encode())
    return h.hexdigest()[:16]


def rename_refs(args: Any, fn) -> Any:
    """``args`` with every tensor reference ``"%name"`` (also inside lists) replaced by
    ``fn(name)``; references for which ``fn`` returns None are kept."""
    if isinstance(args, list):
        return [rename_refs(a, fn) for a in args]
    if isinstance(args, str) and args.startswith("%"):
        new = fn(args[1:])
        return args if new is None else new
    return args


def detect_layers(g: Graph) -> None:
    """Fill ``g.layers``, ``g.canonical`` and each op node's ``layer`` in place (and
    forget what passes derived from the graph before: ``g.memo``)."""
    g.memo.clear()
    children: dict[str, set[str]] = {}
    for n in g.nodes:
        if n.kind == "op":
            for p in indexed_prefixes(n.module_path):
                children.setdefault(_parent(p), set()).add(p)
    groups: dict[str, list[str]] = {}
    for n in g.nodes:
        n.layer = None
        if n.kind != "op":
            continue
        lp = next((p for p in indexed_prefixes(n.module_path)
                   if len(children[_parent(p)]) >= 2), None)
        if lp is not None:
            groups.setdefault(lp, []).append(n.name)
    known = {n.name for n in g.nodes}
    g.layers = [Layer(lp, int(lp.rpartition(".")[2]), layer_signature(g, names, lp, known),
                      names) for lp, names in groups.items()]
    g.canonical = {n.name: n.name for n in g.nodes}
    first: dict[str, Layer] = {}
    for k, lay in enumerate(g.layers):
        rep = first.setdefault(lay.signature, lay)
        for a, b in zip(lay.nodes, rep.nodes):
            g.canonical[a] = b
            g.node(a).layer = k


class _Names:
    """Fresh node names: ``linear_12`` -> ``linear_13``, ``linear_14``, ... never reused."""

    def __init__(self, used: set[str]) -> None:
        self.used = set(used)
        self.next: dict[str, int] = {}
        for name in used:
            base, num = _split_name(name)
            self.next[base] = max(self.next.get(base, 1), num + 1)

    def fresh(self, name: str) -> str:
        base, _ = _split_name(name)
        while True:
            k = self.next.get(base, 1)
            self.next[base] = k + 1
            cand = f"{base}_{k}"
            if cand not in self.used:
                self.used.add(cand)
                return cand

    def take(self, preferred: str, fallback: str) -> str:
        """``preferred`` when unused, else a fresh name derived from ``fallback``."""
        if preferred not in self.used:
            self.used.add(preferred)
            return preferred
        return self.fresh(fallback)


def _split_name(name: str) -> tuple[str, int]:
    m = re.fullmatch(r"(.*?)_(\d+)", name)
    return (m.group(1), int(m.group(2))) if m else (name, 0)


def _reindex(path: str, list_path: str, src: int, dst: int) -> str:
    """``blocks.1.attn.q -> blocks.<dst>.attn.q`` (paths outside ``list_path.src`` kept)."""
    old = f"{list_path}.{src}"
    if path == old:
        return f"{list_path}.{dst}"
    if path.startswith(old + "."):
        return f"{list_path}.{dst}" + path[len(old):]
    return path


def replicate_layers(g: Graph, list_path: str, count: int, start: int = 0) -> Graph | None:
    """The graph of the same model with ``count`` blocks in the list at ``list_path``,
    built from ``g``, a capture holding only its blocks up to ``start`` + 1 (the
    identical run begins at ``start``): block s+1's nodes and parameters are copied for
    blocks s+2..count-1, each copy reading the previous block's outputs where block s+1
    reads block s's. Returns None (capture then exports the full model) unless blocks s
    and s+1 have equal signatures, run back to back, block s+1 reads nothing of block s
    but the tensors block s carries forward, and nothing after the list reads block s."""
    by_path = {lay.path: lay for lay in g.layers}
    l0, l1 = by_path.get(f"{list_path}.{start}"), by_path.get(f"{list_path}.{start + 1}")
    if l0 is None or l1 is None or l0.signature != l1.signature or len(l0.nodes) != len(l1.nodes):
        return None
    pos = {n.name: k for k, n in enumerate(g.nodes)}
    i0, i1 = [pos[x] for x in l0.nodes], [pos[x] for x in l1.nodes]
    m = len(i0)
    if i0 != list(range(i0[0], i0[0] + m)) or i1 != list(range(i0[0] + m, i0[0] + 2 * m)):
        return None
    at0 = {x: k for k, x in enumerate(l0.nodes)}
    at1 = {x: k for k, x in enumerate(l1.nodes)}
    pfx0, pfx1 = f"{list_path}.{start}.", f"{list_path}.{start + 1}."
    for a, b in zip(l0.nodes, l1.nodes):
        na, nb = g.node(a), g.node(b)
        if (na.target, na.out, na.outs, len(na.inputs)) != (nb.target, nb.out, nb.outs,
                                                            len(nb.inputs)):
            return None
        for x, y in zip(na.inputs, nb.inputs):
            if y in at1:
                ok = at0.get(x) == at1[y]
            elif y in at0:
                ok = x not in at0 and x not in at1  # block 0 carries x's role forward
            elif g.node(y).kind == "param" and x != y:
                tx, ty = g.node(x).target, g.node(y).target
                ok = tx.startswith(pfx0) and ty == pfx1 + tx[len(pfx0):]
            else:
                ok = x == y  # a tensor from before the list, read by every block
            if not ok:
                return None
    end = i1[-1]
    if any(i in at0 for n in g.nodes[end + 1:] for i in n.inputs):
        return None
    block_params = [n for n in g.nodes if n.kind == "param" and n.target.startswith(pfx1)]
    if any(g.params[p.target].aliases for p in block_params if p.target in g.params):
        return None
    return _expand(g, list_path, count, l1.nodes, at0, block_params, end, start + 1)


def _expand(g: Graph, list_path: str, count: int, block: list[str], at0: dict[str, int],
            block_params: list[OpNode], end: int, one: int) -> Graph | None:
    """``g`` with block ``one`` (the captured second block of the run) copied for
    blocks one+1..count-1 (:func:`replicate_layers`)."""
    names = _Names({n.name for n in g.nodes})
    fx_tag = list_path.replace(".", "_")
    # renamed[k][old name] = name of the copy in block k (k = one is the captured block)
    renamed: dict[int, dict[str, str]] = {one: {x: x for x in block}}
    for p in block_params:
        renamed[one][p.name] = p.name
    for k in range(one + 1, count):
        ren: dict[str, str] = {}
        for p in block_params:
            ren[p.name] = names.take(p.name.replace(f"{fx_tag}_{one}_", f"{fx_tag}_{k}_", 1),
                                     p.name)
        for x in block:
            ren[x] = names.fresh(x)
        renamed[k] = ren

    def source(name: str, k: int) -> str:
        """What block k reads where block ``one`` reads ``name``."""
        if name in renamed[one]:
            return renamed[k][name]
        if name in at0:
            return renamed[k - 1][block[at0[name]]]
        return name

    last = dict(renamed[count - 1])
    pos = {n.name: k for k, n in enumerate(g.nodes)}
    param_last = {p.name for i, p in enumerate(block_params)
                  if i + 1 == len(block_params) or pos[block_params[i + 1].name] != pos[p.name] + 1}
    run: list[OpNode] = []
    nodes: list[OpNode] = []
    params: dict[str, ParamInfo] = {}
    for idx, n in enumerate(g.nodes):
        if idx > end:
            n = replace(n, inputs=[last.get(i, i) for i in n.inputs],
                        args=rename_refs(n.args, lambda s: "%" + last[s] if s in last else None))
        nodes.append(n)
        if n.kind == "param":
            params[n.target] = g.params[n.target]
        if n.name in renamed[one] and n.kind == "param":
            run.append(n)
            if n.name in param_last:
                for k in range(one + 1, count):
                    for p in run:
                        fqn = _reindex(p.target, list_path, one, k)
                        info = g.params[p.target]
                        params[fqn] = replace(info, name=fqn, aliases=[],
                                              module_path=_reindex(info.module_path,
                                                                   list_path, one, k))
                        nodes.append(replace(p, name=renamed[k][p.name], target=fqn))
                run = []
        if idx == end:
            for k in range(one + 1, count):
                for x in block:
                    b = g.node(x)
                    nodes.append(replace(
                        b, name=renamed[k][x], inputs=[source(i, k) for i in b.inputs],
                        args=rename_refs(b.args, lambda s, k=k: "%" + source(s, k)),
                        params=[_reindex(p, list_path, one, k) for p in b.params],
                        module_path=_reindex(b.module_path, list_path, one, k), layer=None))
    out = Graph(nodes, params, [], {}, list(g.inputs), g.loss, g.batch_size, g.seq_len,
                g.model_name, g.fx)
    detect_layers(out)
    sigs = {lay.signature for lay in out.layers if _parent(lay.path) == list_path
            and int(lay.path.rpartition(".")[2]) >= one}
    count_found = sum(1 for lay in out.layers if _parent(lay.path) == list_path)
    return out if len(sigs) == 1 and count_found == count else None


# --- cutting block lists for the capture's fast path ---------------------------------------

_CONTAINERS = (nn.ModuleList, nn.Sequential)


class RepeatedList(NamedTuple):
    """A block list whose blocks from ``start`` on are identical
    (:func:`repeated_lists`): the capture keeps blocks 0..start+1 and copies the rest."""

    path: str
    container: nn.Module
    count: int
    start: int = 0


MAX_LEADING = 8
"""How many leading blocks may differ from an identical run (a mixture of experts' dense
first blocks: DeepSeek-V3 has 3)."""


def _run_start(kids: list[nn.Module]) -> int | None:
    """The first index from which every block is identical with more than two of them
    left, trying the first :data:`MAX_LEADING` + 1 starts; None if none is."""
    for s in range(min(MAX_LEADING, len(kids) - 3) + 1):
        if _same_blocks(kids[s:]):
            return s
    return None


def repeated_lists(model: nn.Module) -> list[RepeatedList]:
    """Every outermost ModuleList / Sequential (not the root, not inside another list's
    block) indexed 0..n-1 whose blocks are distinct objects, with a run of more than two
    blocks from ``start`` on of one class with identical submodules, parameters,
    buffers, hooks and plain attributes (an index-like int such as ``layer_idx`` may
    differ), and whose tensors belong to their own block only."""
    owners: dict[int, list[str]] = {}
    for n, t in chain(model.named_parameters(remove_duplicate=False),
                      model.named_buffers(remove_duplicate=False)):
        owners.setdefault(id(t), []).append(n)
    mods = dict(model.named_modules())
    found = []
    for path, m in mods.items():
        if not path or not isinstance(m, _CONTAINERS) or len(m) <= 2:
            continue
        parts = path.split(".")
        ancestors = (mods.get(".".join(parts[:i])) for i in range(1, len(parts)))
        if any(isinstance(a, _CONTAINERS) and len(a) >= 2 for a in ancestors):
            continue
        kids = list(m)
        if list(m._modules) != [str(i) for i in range(len(kids))] or \
                len({id(k) for k in kids}) != len(kids):
            continue
        start = _run_start(kids)
        if start is None:
            continue
        if all(o.startswith(f"{path}.{k}.") for k, kid in enumerate(kids)
               for t in chain(kid.parameters(), kid.buffers()) for o in owners[id(t)]):
            found.append(RepeatedList(path, m, len(kids), start))
    return found


def _structure(m: nn.Module) -> tuple:
    return (tuple((n, type(x), len(x._forward_hooks), len(x._forward_pre_hooks))
                  for n, x in m.named_modules()),
            tuple((n, tuple(p.shape), p.dtype, p.requires_grad)
                  for n, p in m.named_parameters()),
            tuple((n, tuple(b.shape), b.dtype) for n, b in m.named_buffers()))


def _plain(v: Any) -> bool:
    if isinstance(v, (tuple, list)):
        return all(_plain(x) for x in v)
    return v is None or isinstance(v, (bool, int, float, str))


def _same_blocks(kids: list[nn.Module]) -> bool:
    """True when every block matches block 0 (see :func:`repeated_lists`)."""
    ref = kids[0]
    shape = _structure(ref)
    for k, kid in enumerate(kids[1:], start=1):
        if type(kid) is not type(ref) or _structure(kid) != shape:
            return False
        for (_, a), (_, b) in zip(ref.named_modules(), kid.named_modules()):
            va = {key: v for key, v in vars(a).items() if not key.startswith("_")}
            vb = {key: v for key, v in vars(b).items() if not key.startswith("_")}
            if va.keys() != vb.keys():
                return False
            for key, x in va.items():
                y = vb[key]
                if _plain(x) != _plain(y):
                    return False
                index_like = type(x) is int and type(y) is int and y - x == k
                if _plain(x) and x != y and not index_like:
                    return False
    return True


_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs",
               "_forward_hooks_always_called", "_forward_pre_hooks_with_kwargs",
               "_backward_hooks", "_backward_pre_hooks")


@contextlib.contextmanager
def restored_modules(model: nn.Module) -> Iterator[None]:
    """Undo on exit what a forward installs lazily on ``model``'s modules (hooks, and
    attributes it sets, such as Hugging Face's output-capturing hooks and their
    ``_output_capturing_hooks_installed`` flag): installed while blocks are cut
    (:func:`cut_lists`), they would cover only the kept blocks ever after."""
    saved = [(m, {k: dict(getattr(m, k)) for k in _HOOK_DICTS if hasattr(m, k)},
              set(m.__dict__)) for m in model.modules()]
    try:
        yield
    finally:
        for m, hooks, keys in saved:
            for k, d in hooks.items():
                live = getattr(m, k)
                live.clear()
                live.update(d)
            for k in set(m.__dict__) - keys:
                del m.__dict__[k]


@contextlib.contextmanager
def cut_lists(lists: list[RepeatedList]) -> Iterator[list[int]]:
    """Cut each container after the second block of its identical run for the duration
    of the block; yields a list that becomes non-empty if anything calls ``len()`` on a
    cut container (the forward's shapes may then depend on the depth). Everything is
    restored on exit."""
    used_len: list[int] = []
    saved = []
    try:
        for _, m, _, start in lists:
            saved.append((m, m.__class__, list(m._modules.items())))
            for key in list(m._modules)[start + 2:]:
                del m._modules[key]
            m.__class__ = _len_spy(m.__class__, used_len, m)
        yield used_len
    finally:
        for m, cls, items in saved:
            m.__class__ = cls
            m._modules.clear()
            m._modules.update(items)


def _len_spy(cls: type, hits: list[int], watched: nn.Module) -> type:
    """A subclass of ``cls`` (same names) whose ``__len__`` records calls on ``watched``
    (a slice of it, a new container, may take its length freely)."""

    def __len__(self) -> int:
        if self is watched:
            hits.append(1)
        return cls.__len__(self)

    return type(cls.__name__, (cls,), {"__len__": __len__, "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__})
