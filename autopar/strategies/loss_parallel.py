"""Loss parallelism: cross-entropy on logits split along their classes over tp.

Each rank takes the maximum and the sum of exponentials of its classes and the target's
logit where it holds the target's class; three all-reduces of one float per row make
the loss whole, and the gradient needs no collective (Megatron-LM's vocabulary-parallel
cross-entropy, torch's ``loss_parallel``). :func:`class_parallel_rules` lets the ops
torch can run so split their class label: ``cross_entropy``, and a user's
``nll_loss(log_softmax(x))`` whose log-softmax feeds that loss alone. The runtime runs
them under :func:`autopar.runtime.dtensor_layout.class_parallel_loss`. Why the pair
and nothing else: docs/strategies.md, section ``autopar.strategies.loss_parallel``.
"""

from __future__ import annotations

from dataclasses import replace

from autopar.graph import Graph, OpNode
from autopar.strategies.rule_base import OpRule, arg, norm_dim, op_of

__all__ = ["class_parallel_rules", "CROSS_ENTROPY", "NLL", "LOG_SOFTMAX"]

CROSS_ENTROPY = frozenset({"cross_entropy_loss"})
NLL = frozenset({"nll_loss", "nll_loss_nd", "nll_loss_forward", "nll_loss2d"})
LOG_SOFTMAX = frozenset({"log_softmax", "_log_softmax"})

_STATISTICS = {"cross_entropy": 3, "nll": 1, "log_softmax": 2}
"""All-reduces of one float per row each op makes with its classes split: the maximum
and the sum of exponentials (log-softmax), the target's logit (NLL), all three
(cross-entropy); torch.distributed.tensor.parallel.loss, torch 2.11-2.13."""


def class_parallel_rules(graph: Graph, rules: dict[str, OpRule]) -> dict[str, OpRule]:
    """``rules`` with the class label of each loss torch can compute class-split made
    splittable (:attr:`OpRule.allreduced`), the others as they are."""
    out = dict(rules)
    for n in graph.nodes:
        if n.kind != "op" or n.name not in out:
            continue
        op = op_of(n.target)
        if op in CROSS_ENTROPY and _class_targets(graph, n) and not arg(n, 5, 0.0):
            out[n.name] = _split_classes(out[n.name], "c", _STATISTICS["cross_entropy"])
        elif op in NLL and _class_targets(graph, n):
            src = graph.node(n.inputs[0])
            if _log_softmax_for(graph, src, n):
                d = norm_dim(int(arg(src, 1, -1)), len(src.out.shape))
                out[src.name] = _split_classes(out[src.name], out[src.name].ins[0][d],
                                               _STATISTICS["log_softmax"])
                out[n.name] = _split_classes(out[n.name], "c", _STATISTICS["nll"])
    return out


def _split_classes(rule: OpRule, label: str, statistics: int) -> OpRule:
    return replace(rule, forbid=rule.forbid - {label}, allreduced=frozenset({label}),
                   statistics=statistics)


def _class_targets(graph: Graph, n: OpNode) -> bool:
    """Whether loss ``n`` reads class indices (an integer target with one dim fewer than
    the logits, classes at dim 1, or dim 0 of 1-d logits), as torch's class-split
    kernels need."""
    if len(n.inputs) < 2:
        return False
    x, t = graph.node(n.inputs[0]).out, graph.node(n.inputs[1]).out
    return x is not None and t is not None and not t.is_float and \
        len(t.shape) == len(x.shape) - 1


def _log_softmax_for(graph: Graph, src: OpNode, loss: OpNode) -> bool:
    """Whether ``src`` is a log-softmax over the classes whose only reader is ``loss``."""
    if src.kind != "op" or op_of(src.target) not in LOG_SOFTMAX or src.out is None:
        return False
    nd = len(src.out.shape)
    d = norm_dim(int(arg(src, 1, -1)), nd)
    return d == (0 if nd == 1 else 1) and [u.name for u in graph.users(src.name)] == [loss.name]
