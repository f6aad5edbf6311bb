"""Enumerate every op's strategies on a mesh: what each op may do, named and inspectable.

For each canonical op node (one per distinct layer position) a strategy picks, per
mesh axis, one label of the op's rule to split (or none). The ``dp`` axis is fixed to
the batch label (data parallelism); the other axes are free. Module ops (a Linear,
Embedding or norm module) may also convert their output (reduce a partial sum, gather
or slice) and their input, which is where the parallel styles of the lowering put
collectives; everywhere else producer and consumer must agree, since the code between
modules runs on plain local tensors (:mod:`autopar.strategies.edges`).

Nothing here prices: :mod:`autopar.cost_models.strategy_price` does, and
:mod:`autopar.solvers.problem_build` puts both together into a solver problem.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from autopar.graph import OpNode, TensorMeta
from autopar.sharding import (data_parallel_degree, layout_name, shard_count, shard_dim,
                               shard_pieces)
from autopar.strategies.analysis import GraphAnalysis
from autopar.strategies.rule_base import carries, placement_of, split_label
from autopar.strategies.rules import OpRule
from autopar.strategies.settings import Settings

Placements = tuple[str, ...]


@dataclass
class NodeStrategy:
    """One strategy of one node, with everything the plan needs to record."""

    name: str
    out: Placements
    raw_out: Placements
    ins: tuple[Placements, ...]
    grads: tuple[Placements, ...]
    memory: dict[str, float] = field(default_factory=dict)  # bytes by category, once priced
    grad_sum: tuple[int, ...] = ()  # axes its gradient arrives partial on (grad_sum.py)
    labels: tuple[str | None, ...] = ()  # the rule label each mesh axis splits, or None

    def with_memory(self, memory: dict[str, float]) -> "NodeStrategy":
        """This strategy with its memory by category (a copy: the cached one stays)."""
        return NodeStrategy(self.name, self.out, self.raw_out, self.ins, self.grads, memory,
                            self.grad_sum, self.labels)


def _placements(labels, assign: tuple[str | None, ...]) -> Placements:
    return tuple(placement_of(labels, lab) for lab in assign)


def _choices(rule: OpRule) -> list[str]:
    """The labels a model-parallel axis may split: those of the inputs that are not
    forbidden and that the output keeps, sums over or all-reduces statistics of (loss
    parallelism), and the piecewise splits (``"x/k"``) the rule allows."""
    outs = {split_label(lab)[0] for lab in rule.out}
    names = {split_label(lab)[0] for labs in rule.ins if labs for lab in labs} - rule.forbid
    labels = [lab for lab in sorted(names)
              if lab in outs or lab in rule.reduce or lab in rule.allreduced]
    return labels + [f"{lab}/{k}" for lab, k in sorted(rule.pieces) if lab in labels]


@dataclass(frozen=True)
class OwnedParam:
    """A parameter node an op owns (it is the parameter's first reader), with what the
    pricing of its placement reads."""

    pos: int        # the op's input position that reads it
    numel: int
    nbytes: int
    trainable: bool
    share: float    # its share of its ``fully_shard`` unit's collectives
    root: bool      # in the root unit (outside every block)
    routed: bool = False  # an expert weight of a routed expert module: split over ep


class GraphFacts:
    """Facts of one graph analysis that no setting changes, worked out once per node
    and shared by every build and repricing of a search (kept in the caller's build
    cache under ``"facts"``)."""

    def __init__(self, an: GraphAnalysis) -> None:
        self.an = an
        self.nodes: dict[str, OpNode] = {n.name: n for n in an.graph.nodes}
        self._owned: dict[str, tuple[OwnedParam, ...]] = {}
        self._kinds: dict[str, tuple[str, ...]] = {}
        self.routed = frozenset(f for em in an.experts.values() if em.kind == "routed"
                                for f in em.params)

    def owned(self, n: OpNode) -> tuple[OwnedParam, ...]:
        """The parameters op ``n`` owns, in input order."""
        found = self._owned.get(n.name)
        if found is None:
            found = self._owned[n.name] = tuple(self._find_owned(n))
        return found

    def _find_owned(self, n: OpNode) -> list[OwnedParam]:
        an, g = self.an, self.an.graph
        out = []
        for pos, i in enumerate(n.inputs):
            node = self.nodes[i]
            if node.kind != "param" or an.param_owner.get(i) != (n.name, pos):
                continue
            info = g.params.get(node.target)
            out.append(OwnedParam(pos, node.out.numel, node.out.nbytes,
                                  info is None or info.trainable,
                                  an.unit_share.get(node.target, 1.0),
                                  node.target in an.root_params, node.target in self.routed))
        return out

    def input_kinds(self, n: OpNode) -> tuple[str, ...]:
        """The kinds of the nodes op ``n`` reads, in input order."""
        found = self._kinds.get(n.name)
        if found is None:
            found = self._kinds[n.name] = tuple(self.nodes[i].kind for i in n.inputs)
        return found


class StrategySpace:
    """The strategies of analysis ``an``'s nodes under settings ``st`` (module
    docstring), with the local shapes they are sized by."""

    def __init__(self, an: GraphAnalysis, st: Settings, facts: GraphFacts | None = None) -> None:
        self.an, self.st, self.g = an, st, an.graph
        self.facts = facts if facts is not None else GraphFacts(an)
        self.node = self.facts.nodes.__getitem__
        self.mesh = st.mesh
        self.dp_axis = self.mesh.names.index("dp") if "dp" in self.mesh.names else None
        self.ep_axis = self.mesh.names.index("ep") if "ep" in self.mesh.names else None
        # the context-parallel axis: every activation split along its sequence
        self.cp_axis = self.mesh.axis("cp") if self.mesh.degree("cp") > 1 else None
        # the data-parallel axes: dp, and ep, which splits the batch outside the experts
        self.data_axes = tuple(a for a in (self.dp_axis, self.ep_axis) if a is not None)
        self.dp = data_parallel_degree(self.mesh)
        # tensors are sized for one micro-batch on every data-parallel rank together;
        # the split then leaves microbatch_size samples per device
        self.factor = st.microbatch_size * self.dp / self.g.batch_size
        # the model-parallel axes: those of size > 1 other than dp, ep and cp
        self.free = [a for a, s in enumerate(self.mesh.sizes)
                     if s > 1 and a not in self.data_axes and a != self.cp_axis]
        self._metas: dict[str, TensorMeta | None] = {}
        self._degrees: dict[Placements, int] = {}
        self._names: dict[tuple[Placements, int], str] = {}

    # ---- shapes ---------------------------------------------------------------
    def meta(self, name: str) -> TensorMeta | None:
        """Output metadata of node ``name`` at the micro-batch size."""
        if name not in self._metas:
            self._metas[name] = self._meta(name)
        return self._metas[name]

    def _meta(self, name: str) -> TensorMeta | None:
        m = self.node(name).out
        bd = self.an.batch_dim.get(name)
        if m is None or bd is None or bd >= len(m.shape):
            return m
        shape = list(m.shape)
        shape[bd] = max(1, round(shape[bd] * self.factor))
        return TensorMeta(tuple(shape), m.dtype)

    def scaled(self, n: OpNode) -> float:
        """Batch factor of an op's work (1 for ops that see no batch dim)."""
        touches = self.an.batch_dim.get(n.name) is not None or any(
            self.an.batch_dim.get(i) is not None for i in n.inputs)
        return self.factor if touches else 1.0

    def degree(self, pl: Placements) -> int:
        """How many pieces placements ``pl`` cut a tensor into on this mesh
        (:func:`~autopar.sharding.shard_count`, memoized)."""
        found = self._degrees.get(pl)
        if found is None:
            found = self._degrees[pl] = shard_count(pl, self.mesh.sizes)
        return found

    def layout(self, pl: Placements, ndim: int) -> str:
        """:func:`~autopar.sharding.layout_name` of ``pl``, memoized."""
        found = self._names.get((pl, ndim))
        if found is None:
            found = self._names[(pl, ndim)] = layout_name(pl, ndim)
        return found

    # ---- enumeration ------------------------------------------------------------
    def input_strategies(self, n: OpNode) -> list[NodeStrategy]:
        """The one strategy of graph input ``n``: split along its batch over ``dp``
        (and along its sequence over ``cp``)."""
        pl = tuple("S(0)" if a in self.data_axes and self.an.batch_dim.get(n.name) == 0
                   and size > 1 else "R" for a, size in enumerate(self.mesh.sizes))
        if self.cp_axis is not None:
            pl = self._on_cp(pl, self.an.sequence.place.get(n.name, "R"))
        return [NodeStrategy(self.layout(pl, len(n.out.shape) if n.out else 0), pl, pl, (), ())]

    def strategies(self, n: OpNode) -> list[NodeStrategy]:
        """All strategies of op ``n``: per legal label assignment, one per placement its
        output may be handed on in."""
        rule = self.an.rules[n.name]
        out_meta = self.meta(n.name)
        nd = len(out_meta.shape) if out_meta is not None else 0
        strategies = []
        for combo in self.assignments(n, rule):
            raw = []
            for lab in combo:
                name = split_label(lab)[0] if lab is not None else None
                if lab is None or (name in rule.per_rank and not carries(rule.out, lab)):
                    raw.append("R")  # a per-rank label's output is the rank's own result
                elif carries(rule.out, lab):
                    raw.append(placement_of(rule.out, lab))
                elif name in rule.allreduced:
                    raw.append("R")  # made whole by the op's own all-reduces
                else:
                    raw.append("P")
            raw_t = tuple(raw)
            ins = tuple(_placements(labs, combo) for labs in rule.ins)
            grads = tuple(self._grad(labs, combo, rule, p) for labs, p in zip(rule.ins, ins))
            if self.st.fold_experts and n.name in self.an.routed_ops:
                grads = self._folded(grads, ins)
            if self.cp_axis is not None:
                raw_t, ins, grads = self._sequence(n, raw_t, ins, grads)
                if not self._shard_counts_ok(raw_t, out_meta):
                    continue
            if not self._sp_allowed(n, rule, ins) or self._local_partial_grad(n, grads):
                continue
            for out in self._deliveries(n, raw_t, nd):
                strategies.append(NodeStrategy(self._name(rule, raw_t, out, ins), out, raw_t,
                                               ins, grads, labels=combo))
        return self._weights_split(n, strategies) if self.st.split_weights else strategies

    def _weights_split(self, n: OpNode, strategies: list[NodeStrategy]) -> list[NodeStrategy]:
        """With the settings' ``split_weights``: of op ``n``'s strategies, those that split
        each weight matrix of the blocks it owns over every model-parallel axis
        (Megatron's and torchtitan's tensor parallelism), where any does. Stacked expert
        weights stay the solver's choice (Megatron-Core's expert tensor parallelism is
        set apart from attention's, often 1)."""
        mats = [o.pos for o in self.facts.owned(n) if o.trainable and not o.root
                and not o.routed
                and (m := self.meta(n.inputs[o.pos])) is not None and len(m.shape) == 2]
        if not mats or not self.free:
            return strategies
        split = [s for s in strategies
                 if all(s.ins[pos][a].startswith("S(") for pos in mats for a in self.free)]
        return split or strategies

    def _name(self, rule: OpRule, raw: Placements, out: Placements,
              ins: tuple[Placements, ...]) -> str:
        """``out = in x in ...``, and the conversion of the output where it has one."""
        name = f"{self.layout(out, len(rule.out))} = " + " x ".join(
            self.layout(p, len(labs) if labs else 0) for p, labs in zip(ins, rule.ins))
        if out != raw:
            name += f"  [{self.layout(raw, len(rule.out))} -> {self.layout(out, len(rule.out))}]"
        return name

    def assignments(self, n: OpNode, rule: OpRule) -> list[tuple[str | None, ...]]:
        """Every legal label-per-axis assignment of op ``n``."""
        labels = _choices(rule)
        if self.st.loss_parallel is False:  # no loss on class-split logits
            labels = [lab for lab in labels if lab not in rule.allreduced]
        per_axis: list[list[str | None]] = []
        for a, size in enumerate(self.mesh.sizes):
            if size == 1:
                per_axis.append([None])
            elif a == self.dp_axis:
                per_axis.append([self.an.batch_label.get(n.name)])
            elif a == self.ep_axis:  # experts split over ep, the rest of the model dp
                per_axis.append(self._ep_choices(n))
            elif a == self.cp_axis:  # the sequence split, which _sequence places there
                per_axis.append([None])
            elif rule.kind in ("creation", "constant"):
                per_axis.append([None])
            elif n.name == self.g.loss:  # whole on every tp rank, or class-split
                per_axis.append(self._loss_choices(rule, labels))
            elif self.st.fold_experts and n.name in self.an.routed_ops:
                per_axis.append([self.an.batch_label.get(n.name)])  # tokens split: _folded
            else:
                per_axis.append([None] + labels)
        result = []
        for combo in itertools.product(*per_axis):
            if self._divisible(n, rule, combo):
                result.append(combo)
        return result

    def _folded(self, grads: tuple[Placements, ...], ins: tuple[Placements, ...]
                ) -> tuple[Placements, ...]:
        """The gradients of a routed expert module's op where the experts fold over the
        model-parallel axes (:attr:`~autopar.strategies.settings.Settings.fold_experts`):
        the op runs on its rank's tokens (split along the batch there) with its rank's
        own experts, so a weight's gradient is that rank's alone, never partial there."""
        return tuple(tuple(p if a in self.free else gp for a, (gp, p) in
                           enumerate(zip(g, i))) for g, i in zip(grads, ins))

    def _loss_choices(self, rule: OpRule, labels: list[str]) -> list[str | None]:
        """What a model-parallel axis may split of the loss, of ``labels`` (those the
        settings allow): nothing (it is computed whole on every rank), or its classes
        (loss parallelism); with the settings' ``loss_parallel`` True, the classes
        alone where the loss can split them."""
        classes: list[str | None] = [lab for lab in labels if lab in rule.allreduced]
        return classes if self.st.loss_parallel and classes else [None] + classes

    def _on_cp(self, pl: Placements, place: str) -> Placements:
        """Placements ``pl`` with ``place`` on the context-parallel axis."""
        a = self.cp_axis
        return pl[:a] + (place,) + pl[a + 1:]

    def _sequence(self, n: OpNode, raw: Placements, ins: tuple[Placements, ...],
                  grads: tuple[Placements, ...]) -> tuple[Placements, tuple[Placements, ...],
                                                          tuple[Placements, ...]]:
        """(raw output, inputs, gradients) of op ``n`` with their sequence split on the
        context-parallel axis (:mod:`autopar.strategies.sequence_flow`): a parameter's
        gradient comes out partial there, summed with the data-parallel ones."""
        seq = self.an.sequence
        places = seq.ins.get(n.name, ("R",) * len(ins))
        kinds = self.facts.input_kinds(n)
        new_ins = tuple(self._on_cp(p, q) for p, q in zip(ins, places))
        new_grads = tuple(self._on_cp(g, "P" if k == "param" else q)
                          for g, q, k in zip(grads, places, kinds))
        return self._on_cp(raw, seq.place.get(n.name, "R")), new_ins, new_grads

    def sequence_split(self, n: OpNode) -> int:
        """How many ways context parallelism splits op ``n``'s work: ``cp`` where it
        reads or makes a tensor split along the sequence, else 1."""
        a = self.cp_axis
        if a is None:
            return 1
        seq = self.an.sequence
        split = seq.place.get(n.name, "R").startswith("S(") or any(
            p.startswith("S(") for p in seq.ins.get(n.name, ()))
        return self.mesh.sizes[a] if split else 1

    def _divisible(self, n: OpNode, rule: OpRule, combo) -> bool:
        """Every dim a combo splits divides evenly (each piece, for a piecewise split),
        and a label split piecewise is split over one axis only."""
        degree: dict[str, int] = {}
        pieces: dict[str, int] = {}
        axes: dict[str, int] = {}
        for choice, size in zip(combo, self.mesh.sizes):
            if choice is not None:
                lab, k = split_label(choice)
                degree[lab] = degree.get(lab, 1) * size
                pieces[lab] = max(pieces.get(lab, 1), k)
                axes[lab] = axes.get(lab, 0) + 1
        if not degree:
            return True
        tensors = [(labs, self.meta(i)) for labs, i in zip(rule.ins, n.inputs)
                   if i not in self.an.constants]  # sized by each rank's local shapes
        tensors.append((rule.out, self.meta(n.name)))
        for labs, m in tensors:
            if labs is None or m is None:
                continue
            for label, size in zip(labs, m.shape):
                lab, j = split_label(label)
                if lab not in degree:
                    continue
                k = j * pieces[lab]
                if size % (degree[lab] * k) or (k > 1 and axes[lab] > 1):
                    return False
        return True

    def _local_partial_grad(self, n: OpNode, grads: tuple[Placements, ...]) -> bool:
        """A partial gradient of a replicated input is reduced where the lowering
        re-lays out, at a module's boundary (priced on the edge): in a module's own op,
        or where the input is a module's output (a tied head applied with ``F.linear``
        in the root reads the final norm's output: its gradient is reduced as it
        enters the norm's backward); strategies that leave one elsewhere are not
        offered."""
        if n.name in self.an.module_ops or n.name in self.an.output_ops:
            return False
        bounded = self.an.module_ops | self.an.output_ops
        return any(self.node(i).requires_grad and i not in bounded
                   and any(g[a] == "P" for a in self.free)
                   for i, g in zip(n.inputs, grads) if self.node(i).kind != "param")

    def _sp_allowed(self, n: OpNode, rule: OpRule, ins: tuple[Placements, ...]) -> bool:
        """Honour a forced sequence-parallel choice for norms (None = free): a norm op,
        or any op of a norm module written out by hand (a class named ``*Norm``), has
        its activation inputs split on a model-parallel axis exactly when forced on.
        Norms nested inside a block's submodules (multi-head latent attention's norms
        of its low-rank projections) are free: sequence parallelism is about the
        residual stream's."""
        sp = self.st.sequence_parallel
        in_norm = rule.kind == "norm" or n.module_type.lower().endswith("norm")
        acts = [p for i, p in zip(n.inputs, ins) if p is not None and
                self.node(i).kind != "param" and i not in self.an.constants]
        if sp is None or not in_norm or not acts or self._nested(n):
            return True
        split = any(p[a].startswith("S(") for p in acts for a in self.free)
        return split == sp

    def _nested(self, n: OpNode) -> bool:
        """Whether op ``n`` runs inside a submodule of a block's submodule (its module
        path two or more levels below its repeated block's)."""
        if n.layer is None:
            return False
        block = self.an.graph.layers[n.layer].path
        rest = n.module_path[len(block) + 1:] if n.module_path.startswith(block + ".") else ""
        return "." in rest

    def _grad(self, labs, combo, rule: OpRule, place: Placements) -> Placements:
        g = []
        for lab, p in zip(combo, place):
            lacks = not carries(labs, lab)
            g.append("P" if p == "R" and lab is not None and lacks
                     and split_label(lab)[0] not in rule.reduce | rule.allreduced else p)
        return tuple(g)

    def _deliveries(self, n: OpNode, raw: Placements, nd: int) -> list[Placements]:
        """Output placements a module's output op may hand on (its raw one, converted on
        the free axes); other ops hand on their raw output."""
        if n.name not in self.an.module_ops and n.name not in self.an.output_ops:
            return [raw] if "P" not in [raw[a] for a in self.free] else []
        opts = []
        m = self.meta(n.name)
        per_axis = []
        em = self.an.expert_of(n.name)
        for a in range(self.mesh.ndim):
            if a == self.ep_axis and em is not None and em.output == n.name:
                per_axis.append(self._ep_deliveries(n, raw[a]))
                continue
            if a not in self.free:
                per_axis.append([raw[a]])
                continue
            cand = ["R"] + [f"S({d})" for d in range(nd)
                            if m is not None and m.shape[d] % self.mesh.sizes[a] == 0]
            per_axis.append(cand + [raw[a]] if shard_pieces(raw[a]) > 1 else cand)
        for combo in itertools.product(*per_axis):
            if self._shard_counts_ok(combo, m):
                opts.append(tuple(combo))
        return opts

    def _ep_choices(self, n: OpNode) -> list[str | None]:
        """The labels op ``n`` may split over ``ep``: its batch, or, in an expert module,
        its experts (only its experts when the settings split every expert module)."""
        batch = self.an.batch_label.get(n.name)
        expert = self.an.expert_label.get(n.name)
        if expert is None:
            return [batch]
        return [expert] if self.st.split_experts else [batch, expert]

    def _ep_deliveries(self, n: OpNode, raw: str) -> list[str]:
        """What an expert module's output op may hand on over ``ep``: its raw output,
        or, split by expert, the tokens sent back to their ranks by an all-to-all (split
        along the batch again)."""
        bd = self.an.batch_dim.get(n.name)
        back = f"S({bd})" if bd is not None else raw
        return [raw] if back == raw else [raw, back]

    def _shard_counts_ok(self, pl: Placements, m: TensorMeta | None) -> bool:
        deg: dict[int, int] = {}
        for p, s in zip(pl, self.mesh.sizes):
            d = shard_dim(p)
            if d is not None:
                deg[d] = deg.get(d, 1) * s * shard_pieces(p)
        return m is None or all(m.shape[d] % k == 0 for d, k in deg.items())
