"""Where the batch is in every tensor: the data-parallel placement of each node, found
by following the batch split from the model inputs through the ops.

Data parallelism runs every op on each rank's own samples, so it needs no sharding rule
for an op that does not mix samples: it needs to know which dim of each tensor carries
the batch. :class:`BatchFlow` finds it op by op (:meth:`~BatchFlow.visit`, then
:meth:`~BatchFlow.finish`) — by the op's rule, through reshapes
(:func:`reshape_batch`), or by size, relabelling the rule so :data:`BATCH` marks the
batch dims (:func:`relabel`) — and refuses only a true cross-sample op, with a message
that says so.

The three ways, the refusal and how parameters and constants are placed:
docs/strategies.md, section ``autopar.strategies.batch_flow``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from autopar.errors import UnsupportedOpError
from autopar.graph import Graph, OpNode, TensorMeta
from autopar.strategies.rule_base import OpRule, op_of
from autopar.strategies.rules import view_groups

BATCH = "batch"
FREE = "*"       # a parameter or constant: placed as its consumer needs
PENDING = "?"    # an op reading only parameters and constants, settled by a consumer
_RESHAPES = frozenset("view _unsafe_view reshape flatten unflatten squeeze unsqueeze".split())


def place_of(labels, label: str | None) -> str:
    """The data-parallel placement of a tensor labelled ``labels`` when ``label`` is
    split: ``S(d)`` where the label sits, else replicated."""
    if labels is None or label is None or label not in labels:
        return "R"
    return f"S({labels.index(label)})"


def out_place(rule: OpRule, label: str | None) -> str:
    """The data-parallel placement of the output when ``label`` is split: ``S(d)``,
    ``R`` (no split, or a per-rank label absent from the output: the rank's own
    result), ``P`` (a summed label) or ``X`` (the label may not be split)."""
    if label is None:
        return "R"
    if label in rule.out:
        return f"S({rule.out.index(label)})"
    if label in rule.per_rank:
        return "R"
    return "P" if label in rule.reduce else "X"


def _dim(place: str) -> int | None:
    return int(place[2:-1]) if place.startswith("S(") else None


def reshape_batch(src: tuple[int, ...], dst: tuple[int, ...], dim: int, inner: int,
                  batch: int) -> tuple[int, int] | None:
    """(dim, inner) of the batch after reshaping ``src`` to ``dst``, the batch of size
    ``batch`` being at ``dim`` striding over ``inner`` elements; None when the reshape
    splits the batch over several dims."""
    for gi, gj in view_groups(src, dst):
        if dim not in gi:
            continue
        below = inner
        for k in gi[gi.index(dim) + 1:]:
            below *= src[k]
        for j in gj:
            stride = 1
            for m in gj[gj.index(j) + 1:]:
                stride *= dst[m]
            if below % stride == 0 and (stride * dst[j]) % (below * batch) == 0:
                return j, below // stride
        return None
    return None


def _message(n: OpNode, why: str) -> str:
    return (f"operator {n.target} in module '{n.module_path or '<root>'}' cannot run "
            f"data-parallel: {why}. Compute it per sample, or move it out of the model's "
            f"forward (e.g. into the loss function).")


def _mixing(n: OpNode, pos: int, fixed: list[tuple[int, str]]) -> str:
    """The refusal of op ``n`` combining the batch with its replicated input ``pos``."""
    return _message(n, f"it combines the batch with input {pos}, which is not split along "
                       f"the batch (inputs placed {[q for _, q in fixed]})")


@dataclass
class BatchFlow:
    """The batch split followed through a graph (docs/strategies.md, section
    ``autopar.strategies.batch_flow``); call :meth:`visit` on each op in order, then
    :meth:`finish`.

    ``place`` is each node's data-parallel placement, ``label`` the rule label of each
    op split over the data-parallel axis, ``inner`` the elements a batch dim strides
    over, and ``rules`` each op's rule, relabelled where the batch was followed by size.
    """

    graph: Graph
    rules: dict[str, OpRule]
    place: dict[str, str] = field(default_factory=dict)
    label: dict[str, str | None] = field(default_factory=dict)
    inner: dict[str, int] = field(default_factory=dict)
    extent: int = 0  # the size of the split dim (0: the graph's batch size)

    def visit(self, n: OpNode) -> None:
        """Place op ``n``, whose inputs are placed."""
        rule = self.rules[n.name]
        acts = [(pos, self.place[i]) for pos, i in enumerate(n.inputs)
                if self.place[i] != FREE]
        fixed = [(pos, p) for pos, p in acts if p != PENDING]
        pending = [pos for pos, p in acts if p == PENDING]
        if not fixed:
            self.place[n.name] = PENDING
            return
        if any(p == "P" for _, p in fixed):
            raise UnsupportedOpError(_message(n, "it reads a value summed over the batch "
                                                 "(e.g. a batch statistic)"))
        if all(p == "R" for _, p in fixed):
            if self._sized_like_batch(n):  # its split, if any, is its consumers' to say
                self.place[n.name] = PENDING
                return
            self._settle(n, rule, None, pending, 1)
            return
        label = self._match(rule, fixed)
        found = label is not None and self._check(n, rule, label, fixed, pending)
        if not found:
            self._follow(n, rule, fixed, pending)

    def _sized_like_batch(self, n: OpNode) -> bool:
        """Whether op ``n`` reads a constant with a dim sized like the batch (a mask made
        from the inputs' shape): each rank makes it from its own samples, so ``n``
        combining it with replicated inputs (broadcast along the batch, such as T5's
        relative-position bias) carries the batch where its consumer needs it."""
        size = self.extent or self.graph.batch_size
        for i in n.inputs:
            node = self.graph.node(i)
            if self.place[i] == FREE and node.kind != "param" and node.out is not None \
                    and size in node.out.shape:
                return True
        return False

    def finish(self) -> None:
        """Replicate what no consumer settled."""
        for name, p in list(self.place.items()):
            if p == PENDING:
                self.place[name], self.label[name] = "R", None

    # ---- by the rule ------------------------------------------------------------------
    @staticmethod
    def _match(rule: OpRule, fixed: list[tuple[int, str]]) -> str | None:
        """The label at every placed input's batch dim whose split the output keeps."""
        labels = {lab for labs in rule.ins if labs for lab in labs}
        for lab in sorted(labels - (rule.forbid - rule.per_rank)):
            if all(place_of(rule.ins[pos], lab) == p for pos, p in fixed) and \
                    out_place(rule, lab) != "X":
                return lab
        return None

    def _check(self, n: OpNode, rule: OpRule, label: str, fixed: list[tuple[int, str]],
               pending: list[int]) -> bool:
        """Settle ``n`` split on ``label``; False when a reshape moves the batch
        elsewhere than the rule's label (then it is followed)."""
        out = out_place(rule, label)
        users = self.graph.users(n.name) if out == "P" else []
        if users:
            raise UnsupportedOpError(
                f"operator {n.target} in module '{n.module_path or '<root>'}' cannot run "
                f"data-parallel: it sums over the batch dimension and {users[0].target} "
                "reads the sum, which each rank would compute from its own samples only. "
                "In a loss, end with the reduction over the batch: a mean (reduction='mean', "
                ".mean()) or the sum itself (reduction='sum', .sum()), not a sum scaled "
                "afterwards; in the model's forward, compute it per sample (a batch "
                "statistic such as BatchNorm's cannot be split).")
        pos, p = next((pos, p) for pos, p in fixed if p != "R")
        inner = self.inner.get(n.inputs[pos], 1)
        if op_of(n.target) in _RESHAPES and out.startswith("S("):
            moved = self._reshape(n, pos, p)
            if moved is None or moved[0] != _dim(out):
                return False
            inner = moved[1]
        self._settle(n, rule, label, pending, inner)
        return True

    def _settle(self, n: OpNode, rule: OpRule, label: str | None, pending: list[int],
                inner: int) -> None:
        self.rules[n.name] = rule
        self.label[n.name] = label
        self.place[n.name] = out_place(rule, label)
        self.inner[n.name] = inner
        for pos in pending:
            self._resolve(n.inputs[pos], place_of(rule.ins[pos], label), inner, n)

    def _resolve(self, name: str, want: str, inner: int, consumer: OpNode) -> None:
        """Settle a pending op so that its output is placed ``want``."""
        have = self.place[name]
        if have == FREE or have == want:
            return
        node = self.graph.node(name)
        if have != PENDING:
            raise UnsupportedOpError(_message(consumer, f"it needs {name} placed {want} over "
                                                        f"the data-parallel axis, another "
                                                        f"consumer needs it {have}"))
        rule = self.rules[name]
        labels = sorted({lab for labs in rule.ins if labs for lab in labs} | set(rule.out))
        label = None if want == "R" else next(
            (lab for lab in labels if lab not in rule.forbid - rule.per_rank
             and out_place(rule, lab) == want), BATCH)
        if label == BATCH:  # its inputs are placed as it needs: the dim is the batch
            rule = relabel(rule, [self.graph.node(i).out for i in node.inputs], {},
                           _dim(want))
        fixed = [(pos, self.place[i]) for pos, i in enumerate(node.inputs)
                 if self.place[i] not in (FREE, PENDING)]
        for pos, p in fixed:  # a replicated input it reads must be broadcast along the split
            if place_of(rule.ins[pos], label) != p:
                raise UnsupportedOpError(_mixing(node, pos, fixed))
        pending = [pos for pos, i in enumerate(node.inputs) if self.place[i] == PENDING]
        self._settle(node, rule, label, pending, inner)

    # ---- through reshapes and by size ---------------------------------------------------
    def _reshape(self, n: OpNode, pos: int, place: str) -> tuple[int, int] | None:
        src, out = self.graph.node(n.inputs[pos]).out, n.out
        d = _dim(place)
        if src is None or out is None or d is None:
            return None
        return reshape_batch(src.shape, out.shape, d, self.inner.get(n.inputs[pos], 1),
                             self.extent or self.graph.batch_size)

    def _follow(self, n: OpNode, rule: OpRule, fixed: list[tuple[int, str]],
                pending: list[int]) -> None:
        """Follow the batch through ``n`` where its rule does not (docs/strategies.md,
        section ``autopar.strategies.batch_flow``, 2 and 3), or refuse a true
        cross-sample op."""
        split = [(pos, p) for pos, p in fixed if p != "R"]
        if rule.kind != "fallback":
            self._refuse_mixing(n, rule, fixed, split)
        found = self._out_dim(n, split)
        if found is None:
            why = ("it has no sharding rule and no dim of its output is sized like its "
                   "inputs' batch dim" if rule.kind == "fallback" else
                   "its rule cannot keep the batch split")
            raise UnsupportedOpError(_message(n, f"{why} (inputs placed "
                                                 f"{[p for _, p in fixed]})"))
        dim, inner = found
        metas = [self.graph.node(i).out for i in n.inputs]
        relabelled = relabel(rule, metas, {pos: _dim(p) for pos, p in split}, dim)
        self._settle(n, relabelled, BATCH, pending, inner)

    @staticmethod
    def _refuse_mixing(n: OpNode, rule: OpRule, fixed: list[tuple[int, str]],
                       split: list[tuple[int, str]]) -> None:
        """Raise for an op whose rule puts the batch on a dim it normalizes, selects,
        slices or reduces over, or lines it up with a replicated input's dim."""
        for lab in sorted(rule.forbid - rule.per_rank):
            if all(place_of(rule.ins[pos], lab) == p for pos, p in fixed):
                raise UnsupportedOpError(_message(
                    n, "it mixes samples: its batch dimension is one the operator "
                       "normalizes, selects, slices or reduces over (e.g. a batch "
                       "statistic such as BatchNorm's)"))
        batch = {rule.ins[pos][d] for pos, p in split
                 if rule.ins[pos] is not None and (d := _dim(p)) is not None}
        for pos, p in fixed:
            if p == "R" and rule.ins[pos] is not None and batch & set(rule.ins[pos]):
                raise UnsupportedOpError(_mixing(n, pos, fixed))

    def _out_dim(self, n: OpNode, split: list[tuple[int, str]]) -> tuple[int, int] | None:
        """(dim, inner) of the output's batch: through a reshape exactly; otherwise the
        dim sized like an input's batch dim at its position, or the only one so sized;
        (-1, 1) for an op with no tensor output."""
        if n.out is None or not n.out.shape:
            return (-1, 1) if n.out is None else None
        if op_of(n.target) in _RESHAPES and len(split) == 1:
            return self._reshape(n, *split[0])
        sized = []
        for pos, p in split:
            src, d = self.graph.node(n.inputs[pos]).out, _dim(p)
            if src is None or d is None:
                continue
            inner = self.inner.get(n.inputs[pos], 1)
            if d < len(n.out.shape) and n.out.shape[d] == src.shape[d]:
                return d, inner
            sized.append(([k for k, s in enumerate(n.out.shape) if s == src.shape[d]], inner))
        return next(((dims[0], inner) for dims, inner in sized if len(dims) == 1), None)


def relabel(rule: OpRule, metas: list[TensorMeta | None], batch_dims: dict[int, int | None],
            out_dim: int) -> OpRule:
    """``rule`` with :data:`BATCH` at input ``pos``'s dim ``batch_dims[pos]`` and at the
    output's ``out_dim`` (-1: none), splittable by data parallelism only; the labels it
    displaces are no longer split on any axis."""
    ins = []
    displaced: set[str] = set()
    for pos, (labs, m) in enumerate(zip(rule.ins, metas)):
        if labs is None and pos in batch_dims and m is not None:
            labs = tuple(f"_r{pos}_{k}" for k in range(len(m.shape)))
            displaced.update(labs)
        d = batch_dims.get(pos)
        if labs is not None and d is not None:
            displaced.add(labs[d])
            labs = labs[:d] + (BATCH,) + labs[d + 1:]
        ins.append(labs)
    out_l = rule.out
    if 0 <= out_dim < len(out_l):
        displaced.add(out_l[out_dim])
        out_l = out_l[:out_dim] + (BATCH,) + out_l[out_dim + 1:]
    return replace(rule, ins=tuple(ins), out=out_l,
                   forbid=rule.forbid | displaced | {BATCH},
                   per_rank=rule.per_rank | {BATCH})
