"""Per-graph facts that do not depend on the mesh: each op's rule, which dim of every
tensor is the batch dim, which ops are whole modules the lowering can re-lay out, and
who owns each parameter and each saved activation.

The batch dims come from following "split along the batch" from the inputs through
the ops (:mod:`autopar.strategies.batch_flow`): data parallelism must keep every
activation split along its batch dim without communication, so this also finds the
ops that cannot be data-parallel (e.g. a statistic over the whole batch) and names them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from autopar.graph import Graph, OpNode, TensorMeta
from autopar.memory_choices import fsdp_unit
from autopar.strategies.batch_flow import FREE, BatchFlow
from autopar.strategies.experts import ExpertModule, expert_modules
from autopar.strategies.fused import piecewise_rules
from autopar.strategies.loss_parallel import class_parallel_rules
from autopar.strategies.rules import OpRule, constant_rule, rule_for
from autopar.strategies.sequence_flow import SequenceSplit, sequence_split



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
    output_ops: set[str] = field(default_factory=set)
    root_params: frozenset[str] = frozenset()
    """Parameters of the root ``fully_shard`` unit: outside every block."""
    experts: dict[str, ExpertModule] = field(default_factory=dict)
    """The expert modules by path (:mod:`autopar.strategies.experts`)."""
    expert_label: dict[str, str] = field(default_factory=dict)
    """Each op of an expert module -> its expert label."""
    routed_ops: frozenset[str] = frozenset()
    """The ops of routed expert modules (and of their submodules)."""
    sequence: SequenceSplit | None = None
    """Where the sequence is in every tensor, for context parallelism
    (:mod:`autopar.strategies.sequence_flow`)."""

    def expert_of_output(self, op: str) -> ExpertModule | None:
        """The expert module whose output op ``op`` makes, or None."""
        em = self.experts.get(self.graph.node(op).module_path)
        return em if em is not None and em.output == op else None

    def expert_of(self, op: str) -> ExpertModule | None:
        """The expert module op ``op`` belongs to, or None."""
        if op not in self.expert_label:
            return None
        return self.experts[self.graph.node(op).module_path]


def analyze(graph: Graph) -> GraphAnalysis:
    """Compute the :class:`GraphAnalysis` of ``graph``."""
    rules: dict[str, OpRule] = {}
    in_metas: dict[str, list[TensorMeta | None]] = {}
    flow = BatchFlow(graph, rules)
    constants = constant_ops(graph)
    for n in graph.nodes:
        if n.kind == "param" or n.name in constants:
            flow.place[n.name] = FREE
            if n.name in constants:
                in_metas[n.name] = [graph.node(i).out for i in n.inputs]
                rules[n.name] = constant_rule(n, in_metas[n.name])
                flow.label[n.name] = None
        elif n.kind == "input":
            has_batch = n.out is not None and len(n.out.shape) > 0 and \
                n.out.shape[0] == graph.batch_size
            flow.place[n.name] = "S(0)" if has_batch else "R"
        elif n.kind == "op":
            in_metas[n.name] = [graph.node(i).out for i in n.inputs]
            rules[n.name] = rule_for(n, in_metas[n.name])
            flow.visit(n)
    flow.finish()
    sequence = sequence_split(graph, rules, constants)
    batch_label = flow.label
    batch_dim = {k: (int(v[2:-1]) if v.startswith("S(") else None)
                 for k, v in flow.place.items()}
    rules = class_parallel_rules(graph, piecewise_rules(graph, rules, batch_dim))
    module_ops = _module_ops(graph)
    owner, consumers = param_users(graph)
    saved = {}
    mult: dict[str, int] = {}
    for n in graph.nodes:
        c = graph.canonical.get(n.name, n.name)
        mult[c] = mult.get(c, 0) + 1
    outputs = module_outputs(graph, rules)
    experts = expert_modules(graph, rules, batch_label, outputs, batch_dim)
    labels = {op: lab for em in experts.values() for op, lab in em.labels.items()}
    routed = frozenset(op for em in experts.values() for op in em.members)
    return GraphAnalysis(graph, rules, in_metas, batch_label, batch_dim, module_ops, owner,
                         consumers, saved, mult, constants, unit_shares(graph), outputs,
                         root_params(graph), experts, labels, routed, sequence)


def root_params(g: Graph) -> frozenset[str]:
    """The parameters outside every block: the root ``fully_shard`` unit's."""
    blocks = [lay.path for lay in g.layers]
    return frozenset(name for name in g.params if fsdp_unit(blocks, name) == "")


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


def _owners(graph: Graph) -> set[str]:
    """Paths of the modules that own parameters (every name of a tied one)."""
    owners = set()
    for fqn, p in graph.params.items():
        for name in [fqn, *p.aliases]:
            owners.add(name.rpartition(".")[0])
    return owners


def _module_ops(graph: Graph) -> set[str]:
    """Ops that are the whole forward of a module owning parameters: the lowering
    re-lays out their input and their output at the module's boundary."""
    by_module: dict[str, list[OpNode]] = {}
    for n in graph.nodes:
        if n.kind == "op":
            by_module.setdefault(n.module_path, []).append(n)
    owners = _owners(graph)
    result = set()
    for path, ops in by_module.items():
        real = [o for o in ops if o.target != "getitem"]
        if len(real) == 1 and real[0].params and path in owners:
            result.add(real[0].name)
    return result


def module_outputs(graph: Graph, rules: dict[str, OpRule]) -> set[str]:
    """The op that makes each parameter-owning module's output, when that module
    computes it itself (not a submodule): the lowering re-lays out the module's output
    after it. Trailing views do not count: Hugging Face's ``Conv1D`` (view, addmm,
    view) is re-laid out after its addmm, whose partial sum the view passes on. A
    module that owns no parameter counts where its last op rejoins dims it had merged
    (:func:`_rejoins`)."""
    owners = _owners(graph)
    last: dict[str, OpNode] = {}
    for n in graph.nodes:
        if n.kind != "op" or n.target == "getitem":
            continue
        path = n.module_path
        while True:  # n is, so far, the last op of every module on its path
            last[path] = n
            if not path:
                break
            path = path.rpartition(".")[0]
    out = set()
    for path, op in last.items():
        if path and path not in owners and op.module_path == path and _rejoins(graph, rules, op):
            out.add(op.name)
            continue
        if not path or path not in owners or op.module_path != path:
            continue
        while rules.get(op.name) is not None and rules[op.name].kind == "view" and op.inputs:
            src = graph.node(op.inputs[0])
            if src.kind != "op" or src.module_path != path or len(graph.users(src.name)) != 1:
                break
            op = src
        out.add(op.name)
    return out


def _unmerges(graph: Graph, rules: dict[str, OpRule], op: OpNode) -> bool:
    """Whether ``op`` is a view that splits a dim of its input apart."""
    rule = rules.get(op.name)
    if rule is None or rule.kind != "view" or not op.inputs or op.out is None:
        return False
    src = graph.node(op.inputs[0]).out
    return src is not None and len(op.out.shape) > len(src.shape)


def _rejoins(graph: Graph, rules: dict[str, OpRule], op: OpNode) -> bool:
    """Whether ``op``, the last op of a module that owns no parameter, is a view that
    splits a dim apart, or reads one made in the same module (a mixture of experts'
    tokens, batch and sequence flattened, reshaped back, and a shared expert's output
    added): the module's output is re-laid out after it, the one place a micro-batch
    of one sequence can be split along the sequence again."""
    return _unmerges(graph, rules, op) or any(
        graph.node(i).kind == "op" and graph.node(i).module_path == op.module_path
        and _unmerges(graph, rules, graph.node(i)) for i in op.inputs)


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
