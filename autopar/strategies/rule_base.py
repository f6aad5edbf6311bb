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
    (see :mod:`autopar.strategies.rules`).
    """

    ins: tuple[Labels | None, ...]
    out: Labels
    reduce: frozenset[str] = frozenset()
    forbid: frozenset[str] = frozenset()
    kind: str = "generic"
    per_rank: frozenset[str] = frozenset()


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
