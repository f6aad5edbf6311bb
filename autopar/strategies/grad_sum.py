"""Gradients summed before they are reduced: one collective for a tensor that several
consumers hand back a partial gradient of.

When several column-parallel Linears read one tensor (q, k and v projections of one
normed input; a SwiGLU's gate and up projections), autograd adds their partial
gradients first and the producer's backward reduces the total once, as Megatron-LM and
a fused qkv projection do. A pairwise edge cost cannot say "once if any consumer hands
back a partial sum", so such a producer gets, beside each strategy whose output is
replicated on the summed axes, a twin that takes its gradient as a partial sum
(:attr:`NodeStrategy.grad_sum`) and pays the reduction itself (from
:func:`summed_placement`, priced by :mod:`autopar.cost_models.strategy_price`). Its
edges then cost no gradient collective; the plain strategy accepts no partial gradient
(:func:`edge_backward`). The solver picks the twin exactly when a consumer hands one
back, and pays once.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from autopar.strategies.enumeration import NodeStrategy, StrategySpace

Placements = tuple[str, ...]


def summing_axes(space: "StrategySpace", consumers: list[tuple[int, int]],
                 details: list[list["NodeStrategy"]]) -> list[int]:
    """The free mesh axes on which some consumer strategy reads the tensor as it is
    (replicated) and hands back a partial gradient of it; ``consumers`` are (node
    index, input position) pairs."""
    return [a for a in space.free
            if any(sv.grads[pos][a] == "P" and sv.ins[pos][a] == "R"
                   for v, pos in consumers for sv in details[v])]


def summed_placement(out: Placements, axes: tuple[int, ...]) -> Placements:
    """The placement of a gradient summed partial over ``axes`` before its reduction to
    the output's (replicated) placement ``out``."""
    return tuple("P" if a in axes else p for a, p in enumerate(out))


def add_gradient_sums(space: "StrategySpace", counts: dict[tuple[int, int, int], int],
                      names: list[str], details: list[list["NodeStrategy"]]) -> None:
    """Give every producer read by two or more consumers its summing twins (module
    docstring), in place."""
    consumers: dict[int, list[tuple[int, int]]] = {}
    for u, v, pos in counts:
        consumers.setdefault(u, []).append((v, pos))
    for u, cons in consumers.items():
        if len(cons) < 2 or not space.node(names[u]).requires_grad:
            continue
        axes = summing_axes(space, cons, details)
        if not axes:
            continue
        for ns in list(details[u]):
            summed = tuple(a for a in axes if ns.out[a] == "R")
            if not summed:
                continue
            label = "P" + "".join(str(a) for a in summed)
            details[u].append(replace(ns, name=f"{ns.name}  [grad {label}]", grad_sum=summed))


def edge_backward(back: Placements, out: Placements, grad_sum: tuple[int, ...] | None,
                  free: list[int]) -> Placements | None:
    """The gradient placement an edge converts back to its producer's output, where
    producer and consumer agree on the forward placement: ``back`` as it is for a
    producer without summing twins (``grad_sum`` None); for one with them, a partial
    gradient on a summed axis is left to the producer (seen as ``out``), and None
    when the producer's strategy does not sum the axis (the pair is not allowed)."""
    if grad_sum is None:
        return back
    fixed = list(back)
    for a in free:
        if back[a] == "P":
            if a not in grad_sum:
                return None
            fixed[a] = out[a]
    return tuple(fixed)
