"""The vocabulary of sharding rules: :class:`OpRule`, fresh labels, and the helpers
every family of rules (:mod:`.rules`, :mod:`.rules_moe`) reads an op's arguments with."""

from __future__ import annotations

from dataclasses import dataclass, field

from autopar.flops import op_name
from autopar.graph import OpNode, TensorMeta

Labels = tuple[str, ...]


@dataclass(frozen=True)
class OpRule:
    """Labels per dim of each tensor input (node.inputs order) and of the output.

    ``ins[i] is None`` means the input must stay replicated on every axis. Labels in
    ``forbid`` are never split on a model-parallel axis; those also in ``per_rank``
    may be split by data parallelism, each rank running the op on its own samples
    (docs/strategies.md, section ``autopar.strategies.rules``).

    A label written ``"x/k"`` at a dim is label ``x`` split *piecewise* there: the dim
    is cut into k equal pieces and every piece split over the axis (placed
    ``S(d)/k``) — the input of a split into k pieces whose outputs carry plain ``x``.
    ``pieces`` holds (label, k) pairs whose label may also be split so at every dim
    that carries it (the ops from a fused projection to its split). Both come from
    :mod:`autopar.strategies.fused`.

    Labels in ``allreduced`` may be split although the op reduces them in a way that is
    no sum (loss parallelism: a log-softmax over classes split across ranks): each rank
    computes on its part, and ``statistics`` all-reduces of one float per row (a
    maximum, a sum of exponentials, the target's logit) make the result whole. Its
    output is then replicated where it lacks the label (:mod:`.loss_parallel`).
    """

    ins: tuple[Labels | None, ...]
    out: Labels
    reduce: frozenset[str] = frozenset()
    forbid: frozenset[str] = frozenset()
    kind: str = "generic"
    per_rank: frozenset[str] = frozenset()
    pieces: frozenset[tuple[str, int]] = frozenset()
    allreduced: frozenset[str] = frozenset()
    statistics: int = 0


@dataclass
class Fresh:
    """Generator of labels that occur once (never shardable together with others)."""

    n: int = 0
    made: set[str] = field(default_factory=set)

    def __call__(self) -> str:
        self.n += 1
        name = f"_{self.n}"
        self.made.add(name)
        return name


def split_label(label: str) -> tuple[str, int]:
    """A label or a strategy's choice of label as (label, pieces): ``"x/3" -> ("x",
    3)``, ``"x" -> ("x", 1)``."""
    name, slash, k = label.partition("/")
    return (name, int(k)) if slash else (label, 1)


def placement_of(labels: Labels | None, choice: str | None) -> str:
    """The placement of a tensor labelled ``labels`` when ``choice`` (a label, or
    ``"x/k"``: label x split piecewise in k pieces) is split over an axis: ``"R"``
    where no dim carries the label, else ``"S(d)"``, or ``"S(d)/k"`` where the dim is
    split piecewise (by the choice, or by the label written ``"x/k"`` at that dim)."""
    if labels is None or choice is None:
        return "R"
    name, k = split_label(choice)
    for d, lab in enumerate(labels):
        here, j = split_label(lab)
        if here == name:
            return f"S({d})" if j * k == 1 else f"S({d})/{j * k}"
    return "R"


def carries(labels: Labels | None, choice: str | None) -> bool:
    """Whether a tensor labelled ``labels`` has a dim that ``choice`` splits."""
    return placement_of(labels, choice) != "R"


def op_of(target: str) -> str:
    """``"aten.linear.default" -> "linear"``, ``"aten.add_.Tensor" -> "add"`` (an
    in-place variant has its out-of-place rule), ``"ns.my_op.default" -> "my_op"``."""
    op = op_name(target)
    return op[:-1] if op.endswith("_") and not op.endswith("__") and len(op) > 1 else op


def ndims(meta: TensorMeta | None) -> int:
    """Number of dims of a tensor (0 for no tensor)."""
    return len(meta.shape) if meta is not None else 0


def norm_dim(d: int, ndim: int) -> int:
    """A possibly negative dim index as a non-negative one."""
    return d % ndim if ndim else 0


def base_labels(n: int) -> Labels:
    """The labels ``d0 .. d{n-1}`` of an n-dim tensor."""
    return tuple(f"d{i}" for i in range(n))


def arg(node: OpNode, i: int, default=None):
    """Non-tensor argument ``i`` of ``node`` (``default`` when absent or None)."""
    return node.args[i] if len(node.args) > i and node.args[i] is not None else default


def fallback_rule(in_metas: list[TensorMeta | None], out: TensorMeta | None) -> OpRule:
    """The rule of an op no rule describes: every dim its own label, none split on a
    model-parallel axis (the op runs whole, replicated, and is priced so); the graph
    analysis relabels the batch dims it can follow so data parallelism still splits
    them."""
    fresh = Fresh()
    ins = tuple(None if m is None else tuple(fresh() for _ in m.shape) for m in in_metas)
    out_l = tuple(fresh() for _ in range(ndims(out)))
    return OpRule(ins, out_l, forbid=frozenset(fresh.made), kind="fallback")
