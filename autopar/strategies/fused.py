"""Fused projections split per head: the rules that let one ``qkv = Linear(h, 3h)``
followed by ``.split(h, -1)`` (or ``.chunk(3, -1)``; a fused ``gate_up`` split in two
alike) shard as Megatron-LM shards it.

:func:`piecewise_rules` finds every split of a dim into ``k`` equal pieces whose input
comes from a parameter carrying the dim (the fused weight), and rewrites the rules of
the split and of the ops back to the parameter so the dim may be split *piecewise*
(``S(d)/k``, :mod:`autopar.sharding`): each rank gets its chunk of every piece, and
attention runs on the rank's heads with no collective.

Why a plain split does not do, the labels ``x/k`` and :attr:`OpRule.pieces`, and what
is not handled yet (a fused dim viewed as ``(3, heads, head_dim)`` and unbound):
docs/strategies.md, section ``autopar.strategies.fused``.
"""

from __future__ import annotations

from dataclasses import replace

from autopar.graph import Graph
from autopar.strategies.rule_base import OpRule, op_of, split_label

_SPLITS = frozenset({"split", "split_with_sizes", "chunk"})


def piecewise_rules(graph: Graph, rules: dict[str, OpRule],
                    batch_dim: dict[str, int | None]) -> dict[str, OpRule]:
    """``rules`` with the piecewise splits of fused projections (docs/strategies.md,
    section ``autopar.strategies.fused``):
    the rules of the splits and of the ops between each split and its parameter
    replaced, the others as they are."""
    out = dict(rules)
    for n in graph.nodes:
        if n.kind != "op" or op_of(n.target) not in _SPLITS or not n.inputs or \
                out[n.name].ins[0] is None:
            continue
        found = _pieces(graph, n.name, batch_dim)
        if found is None:
            continue
        dim, k = found
        marks = _walk(graph, out, n.inputs[0], dim, k, set())
        if not marks:
            continue
        rule = out[n.name]
        label = rule.ins[0][dim]
        ins0 = rule.ins[0][:dim] + (f"{label}/{k}",) + rule.ins[0][dim + 1:]
        out[n.name] = replace(rule, ins=(ins0,) + rule.ins[1:], forbid=rule.forbid - {label})
        for name, lab in marks.items():
            out[name] = replace(out[name], pieces=out[name].pieces | {(lab, k)})
    return out


def _pieces(graph: Graph, name: str, batch_dim: dict[str, int | None]) -> tuple[int, int] | None:
    """(dim, k) of a split of its input's dim into k >= 2 equal pieces, the input's
    batch dim excepted; None for any other split."""
    n = graph.node(name)
    src = graph.node(n.inputs[0]).out
    if src is None or not n.outs or len(n.outs) < 2:
        return None
    nd = len(src.shape)
    raw = n.args[2] if len(n.args) > 2 else 0
    if not isinstance(raw, int) or nd == 0:
        return None
    dim = raw % nd
    sizes = [m.shape[dim] for m in n.outs if len(m.shape) == nd]
    if len(sizes) != len(n.outs) or len(set(sizes)) != 1 or sum(sizes) != src.shape[dim]:
        return None
    if batch_dim.get(n.inputs[0]) == dim:
        return None
    return dim, len(sizes)


def _walk(graph: Graph, rules: dict[str, OpRule], name: str, dim: int, k: int,
          seen: set[str]) -> dict[str, str]:
    """The ops from node ``name`` back to a parameter along its output dim ``dim``
    (op -> its label there) when the dim reaches a parameter unchanged in size;
    empty when it does not."""
    n = graph.node(name)
    rule = rules.get(name)
    if n.kind != "op" or rule is None or n.out is None or name in seen or \
            dim >= len(rule.out) or n.out.shape[dim] % k:
        return {}
    seen.add(name)
    label = rule.out[dim]
    if split_label(label)[1] != 1 or label in rule.forbid:
        return {}
    marks: dict[str, str] = {}
    reached = False
    for labs, i in zip(rule.ins, n.inputs):
        if labs is None or label not in labs:
            continue
        e = labs.index(label)
        src = graph.node(i)
        if src.out is None or e >= len(src.out.shape) or src.out.shape[e] != n.out.shape[dim]:
            continue
        if src.kind == "param":
            reached = True
        elif src.kind == "op":
            sub = _walk(graph, rules, i, e, k, seen)
            reached |= bool(sub)
            marks.update(sub)
    if not reached:
        return {}
    marks[name] = label
    return marks
