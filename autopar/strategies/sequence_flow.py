"""Where the sequence is in every tensor: the context-parallel placement of each node,
found by following "split along the sequence" from the model inputs through the ops
(:func:`sequence_split`).

Context parallelism runs every op but attention on each rank's own tokens, so, as for
the batch (:mod:`autopar.strategies.batch_flow`, whose flow this reuses), it needs to
know which dim of each tensor carries the sequence. Attention
(``scaled_dot_product_attention``) is the one op allowed to combine positions: its
queries keep their split and the chosen variant brings it the keys and values
(:mod:`autopar.runtime.context_parallel`). Any other op that combines positions — an
attention written out by hand, a shift of the targets, a cumulative sum, a pooling
over the sequence — makes the model unsplittable along its sequence, and
:attr:`SequenceSplit.refusal` says where. Rules, refusals and the runtime's side:
docs/strategies.md, section ``autopar.strategies.sequence_flow``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from autopar.errors import UnsupportedOpError
from autopar.graph import Graph, OpNode
from autopar.strategies.batch_flow import FREE, PENDING, BatchFlow, place_of
from autopar.strategies.rule_base import OpRule

__all__ = ["SequenceSplit", "sequence_split"]

CAUSAL_ARG = 5
"""Position of ``is_causal`` in ``scaled_dot_product_attention``'s arguments."""


@dataclass(frozen=True)
class SequenceSplit:
    """The sequence followed through a graph.

    Attributes:
        length: tokens per sequence (the graph's ``seq_len``).
        place: node -> placement of its output along the sequence (``"S(d)"`` or
            ``"R"``; parameters and constants are absent).
        ins: op -> placement of each of its inputs along the sequence.
        attention: the attention ops, each with whether it is causal.
        inputs: graph input -> its sequence dim (the inputs the runtime splits).
        refusal: why the model cannot be split along its sequence ("" when it can).
        masked: whether an attention op reads a mask (one the capture found causal: a
            traced Hugging Face model's), which a pipeline stage, run from the exported
            program, would compute from the rank's positions.
    """

    length: int
    place: dict[str, str] = field(default_factory=dict)
    ins: dict[str, tuple[str, ...]] = field(default_factory=dict)
    attention: dict[str, bool] = field(default_factory=dict)
    inputs: dict[str, int] = field(default_factory=dict)
    refusal: str = ""
    masked: bool = False

    @property
    def splittable(self) -> bool:
        """Whether context parallelism can split this model."""
        return not self.refusal and bool(self.attention)


@dataclass
class _SequenceFlow(BatchFlow):
    """:class:`BatchFlow` over the sequence dim: attention keeps its queries' split
    (``attention``: each attention op, whether causal), and an op whose split inputs
    carry the sequence at different labels of its rule (positions combined with
    positions) is refused rather than followed by size."""

    attention: dict[str, bool] = field(default_factory=dict)

    def visit(self, n: OpNode) -> None:
        """Place op ``n`` (attention by :meth:`_attend`)."""
        if self.rules[n.name].kind == "attention":
            self._attend(n)
        else:
            super().visit(n)

    def _attend(self, n: OpNode) -> None:
        """Queries, keys and values split at their sequence dims; the output keeps the
        queries' split."""
        nd = None if n.out is None else len(n.out.shape)
        want = None if nd is None else f"S({nd - 2})"
        places = [self.place.get(i) for i in n.inputs[:3]]
        if want is None or any(p != want for p in places):
            raise UnsupportedOpError(
                f"its queries, keys and values are not split along their sequence dim "
                f"(placed {places})")
        causal = len(n.args) > CAUSAL_ARG and n.args[CAUSAL_ARG] is True
        if any(self.place.get(i) not in (FREE, None) for i in n.inputs[3:]) or \
                (not causal and len(n.inputs) > 3):
            raise UnsupportedOpError("it reads an attention mask that is not causal; "
                                     "the context-parallel variants run causal or "
                                     "unmasked attention only")
        self.attention[n.name] = causal
        self.label[n.name] = "L"
        self.place[n.name] = want
        self.inner[n.name] = 1

    def _follow(self, n: OpNode, rule: OpRule, fixed: list[tuple[int, str]],
                pending: list[int]) -> None:
        """Refuse an op whose split inputs carry the sequence at different labels
        (e.g. ``q @ k.transpose(-2, -1)``); follow the rest as the batch is followed."""
        labels = set()
        for pos, p in fixed:
            if p.startswith("S(") and rule.ins[pos] is not None:
                labels.add(rule.ins[pos][int(p[2:-1])])
        if len(labels) > 1:
            raise UnsupportedOpError("it combines positions of the sequence with each "
                                     "other (attention written out by hand?)")
        super()._follow(n, rule, fixed, pending)


def sequence_split(graph: Graph, rules: dict[str, OpRule], constants: set[str]) -> SequenceSplit:
    """Follow the sequence (dim 1 of every input sized like ``graph.seq_len``) through
    ``graph`` under its ops' ``rules`` (not changed: the flow works on a copy)."""
    seq = graph.seq_len or 0
    if seq < 2:
        return SequenceSplit(seq, refusal="the model's inputs have no sequence dim")
    flow = _SequenceFlow(graph, dict(rules), extent=seq)
    inputs: dict[str, int] = {}
    current: OpNode | None = None
    try:
        for n in graph.nodes:
            if n.kind == "param" or n.name in constants:
                flow.place[n.name] = FREE
            elif n.kind == "input":
                split = n.out is not None and len(n.out.shape) > 1 and n.out.shape[1] == seq
                flow.place[n.name] = "S(1)" if split else "R"
                if split:
                    inputs[n.name] = 1
            elif n.kind == "op":
                current = n
                flow.visit(n)
        flow.finish()
    except UnsupportedOpError as e:
        where = "" if current is None else (f" at operator {current.target} in module "
                                            f"'{current.module_path or '<root>'}'")
        why = str(e).split("data-parallel: ")[-1].split(". Compute it per sample")[0]
        return SequenceSplit(seq, inputs=inputs, refusal=(
            f"the sequence cannot be split{where}: {why}. Context parallelism needs "
            f"attention through F.scaled_dot_product_attention and every other op to "
            f"work token by token"))
    if not flow.attention:
        return SequenceSplit(seq, inputs=inputs, refusal=(
            "the model has no F.scaled_dot_product_attention call for context "
            "parallelism to split"))
    place = {k: v for k, v in flow.place.items() if v not in (FREE, PENDING)}
    ins = {}
    for n in graph.nodes:
        if n.kind != "op" or n.name not in place:
            continue
        if n.name in flow.attention:
            ins[n.name] = tuple(place[i] if k < 3 else "R" for k, i in enumerate(n.inputs))
        else:
            rule, label = flow.rules[n.name], flow.label.get(n.name)
            ins[n.name] = tuple(place_of(labs, label) for labs in rule.ins)
    masked = any(len(graph.node(name).inputs) > 3 for name in flow.attention)
    return SequenceSplit(seq, place, ins, dict(flow.attention), inputs, masked=masked)
