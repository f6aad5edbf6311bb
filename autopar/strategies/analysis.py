"""Per-graph facts that do not depend on the mesh: each op's rule, which dim of every
tensor is the batch dim, which ops are whole modules the lowering can re-lay out, and
who owns each parameter and each saved activation.

The batch dims come from propagating "split along the batch" from the inputs through
the rules: data parallelism must keep every activation split along its batch dim
without communication, so this also finds the ops that cannot be data-parallel
(e.g. a statistic over the whole batch) and names them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from autopar.errors import UnsupportedOpError
from autopar.graph import Graph, OpNode, TensorMeta
from autopar.plans import fsdp_unit
from autopar.strategies.rules import OpRule, constant_rule, rule_for

# Module classes whose forward is a single operator that PyTorch's parallel styles
# (ColwiseParallel, RowwiseParallel, SequenceParallel) know how to re-lay out.
RELAYOUT_MODULES = frozenset({"Linear", "Embedding", "LayerNorm", "RMSNorm"})


@dataclass
class GraphAnalysis:
    """Mesh-independent facts about a captured graph (see module docstring)."""

    graph: Graph
    rules: dict[str, OpRule]
    in_metas: dict[str, list[TensorMeta | None]]
    batch_label: dict[str, str | None]
    batch_dim: dict[str, int | None]
    module_ops: set[str]
    param_owner: dict[str, tuple[str, int]]
    param_consumers: dict[str, list[tuple[str, int]]]
    saved_by: dict[tuple[str, int], bool] = field(default_factory=dict)
    multiplicity: dict[str, int] = field(default_factory=dict)
    constants: set[str] = field(default_factory=set)
    unit_share: dict[str, float] = field(default_factory=dict)


def _place(labels, label: str | None) -> str:
    if labels is None or label is None or label not in labels:
        return "R"
    return f"S({labels.index(label)})"


def _out_place(rule: OpRule, label: str | None) -> str:
    if label is None:
        return "R"
    if label in rule.out:
        return f"S({rule.out.index(label)})"
    return "P" if label in rule.reduce else "X"


def analyze(graph: Graph) -> GraphAnalysis:
    """Compute the :class:`GraphAnalysis` of ``graph``."""
    rules: dict[str, OpRule] = {}
    in_metas: dict[str, list[TensorMeta | None]] = {}
    dp_place: dict[str, str] = {}
    batch_label: dict[str, str | None] = {}
    kinds = {n.name: n.kind for n in graph.nodes}
    constants = constant_ops(graph)
    for n in graph.nodes:
        if n.kind == "param" or n.name in constants:
            dp_place[n.name] = "*"
            if n.name in constants:
                in_metas[n.name] = [graph.node(i).out for i in n.inputs]
                rules[n.name] = constant_rule(n, in_metas[n.name])
                batch_label[n.name] = None
        elif n.kind == "input":
            has_batch = n.out is not None and len(n.out.shape) > 0 and \
                n.out.shape[0] == graph.batch_size
            dp_place[n.name] = "S(0)" if has_batch else "R"
        elif n.kind == "op":
            metas = [graph.node(i).out for i in n.inputs]
            in_metas[n.name] = metas
            rule = rule_for(n, metas)
            rules[n.name] = rule
            label = _propagate(n, rule, [dp_place[i] for i in n.inputs],
                               ["param" if i in constants else kinds[i] for i in n.inputs],
                               graph)
            batch_label[n.name] = label
            dp_place[n.name] = _out_place(rule, label)
    batch_dim = {k: (int(v[2:-1]) if v.startswith("S(") else None) for k, v in dp_place.items()}
    module_ops = _module_ops(graph)
    owner, consumers = param_users(graph)
    saved = {}
    mult: dict[str, int] = {}
    for n in graph.nodes:
        c = graph.canonical.get(n.name, n.name)
        mult[c] = mult.get(c, 0) + 1
    return GraphAnalysis(graph, rules, in_metas, batch_label, batch_dim, module_ops, owner,
                         consumers, saved, mult, constants, unit_shares(graph))


def unit_shares(g: Graph) -> dict[str, float]:
    """Each trainable parameter's share of the elements of its ``fully_shard`` unit
    (its repeated block, or the root: every parameter outside the blocks; a tied
    parameter counted once). FSDP2 issues one collective per unit and kind, so the
    unit is the bucket a parameter's collectives share
    (:func:`autopar.cost_models.comm.bucketed_time`)."""
    blocks = [lay.path for lay in g.layers]
    unit = {name: fsdp_unit(blocks, name) for name, p in g.params.items() if p.trainable}
    size: dict[str, float] = {}
    for name, u in unit.items():
        size[u] = size.get(u, 0.0) + g.params[name].meta.numel
    return {name: g.params[name].meta.numel / size[u] if size[u] else 1.0
            for name, u in unit.items()}


def constant_ops(graph: Graph) -> set[str]:
    """Ops computed from shapes and buffers alone: no model input and no trainable
    parameter upstream, no gradient (position ids, causal masks, RoPE tables).

    Every rank computes them itself from its local inputs' shapes, so they need no
    sharding rule and no decision: they are replicated on the model-parallel axes, and
    a dim sized like the batch follows each rank's local batch on the data-parallel axis.
    """
    const: set[str] = set()
    for n in graph.nodes:
        if n.kind != "op" or n.requires_grad:
            continue
        ok = True
        for i in n.inputs:
            src = graph.node(i)
            if src.kind == "param":
                info = graph.params.get(src.target)
                ok &= info is not None and not info.trainable
            else:
                ok &= i in const
        if ok:
            const.add(n.name)
    return const


def _propagate(n: OpNode, rule: OpRule, places: list[str], kinds: list[str],
               graph: Graph) -> str | None:
    """The label to split over the data-parallel axis so that every activation input
    keeps the placement its producer gives it. None means replicated."""
    acts = [(i, p) for i, (p, k) in enumerate(zip(places, kinds)) if k != "param"]
    if all(p == "R" for _, p in acts):
        return None
    if any(p == "P" for _, p in acts):
        raise UnsupportedOpError(_dp_message(n, "it reads a value summed over the batch "
                                                "(e.g. a batch statistic)"))
    labels = {lab for labs in rule.ins if labs for lab in labs}
    for lab in sorted(labels):
        if lab in rule.forbid:
            continue
        if all(_place(rule.ins[i], lab) == p for i, p in acts):
            out = _out_place(rule, lab)
            if out == "X":
                continue
            if out == "P" and graph.users(n.name):
                raise UnsupportedOpError(_dp_message(
                    n, "it reduces over the batch dimension (e.g. a batch statistic "
                       "such as BatchNorm's)"))
            return lab
    raise UnsupportedOpError(_dp_message(n, "its rule cannot keep the batch split "
                                            f"(inputs placed {[p for _, p in acts]})"))


def _dp_message(n: OpNode, why: str) -> str:
    return (f"operator {n.target} in module '{n.module_path or '<root>'}' cannot run "
            f"data-parallel: {why}. Compute it per sample, or move it out of the model's "
            f"forward (e.g. into the loss function).")


def _module_ops(graph: Graph) -> set[str]:
    """Ops that are the whole forward of a module the parallel styles can re-lay out."""
    by_module: dict[str, list[OpNode]] = {}
    for n in graph.nodes:
        if n.kind == "op":
            by_module.setdefault(n.module_path, []).append(n)
    result = set()
    for path, ops in by_module.items():
        real = [o for o in ops if o.target != "getitem"]
        if len(real) == 1 and real[0].params and real[0].module_type in RELAYOUT_MODULES:
            p = graph.params.get(real[0].params[0])
            owners = {p.module_path} | {a.rpartition(".")[0] for a in p.aliases} if p else set()
            if path in owners:
                result.add(real[0].name)
    return result


def param_users(graph: Graph) -> tuple[dict[str, tuple[str, int]],
                                       dict[str, list[tuple[str, int]]]]:
    """For every param node: its first consumer (op name, input position), and all."""
    owner: dict[str, tuple[str, int]] = {}
    consumers: dict[str, list[tuple[str, int]]] = {}
    kinds = {n.name: n.kind for n in graph.nodes}
    for n in graph.nodes:
        if n.kind != "op":
            continue
        for pos, i in enumerate(n.inputs):
            if kinds[i] == "param":
                consumers.setdefault(i, []).append((n.name, pos))
                owner.setdefault(i, (n.name, pos))
    return owner, consumers
