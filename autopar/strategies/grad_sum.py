"""Gradients summed before they are reduced: one collective for a tensor that several
consumers hand back a partial gradient of.

A column-parallel Linear reads its input whole and hands its gradient back as a
partial sum over the tensor-parallel axis. When several read the same tensor —
separate q, k and v projections of one normed input, or a SwiGLU's gate and up
projections — autograd adds their partial gradients first (a sum of partial sums is
one) and the producer's backward reduces the total once: one all-reduce, as Megatron-LM
and a fused qkv projection have, not one per consumer.

A pairwise edge cost cannot say "once if any consumer hands back a partial sum", so a
producer read by two or more consumers (of which some can hand back a partial
gradient over a free axis) gets, beside each strategy whose output is replicated on
such axes, a twin that takes its gradient as a partial sum (:attr:`NodeStrategy.
grad_sum`) and pays the reduction itself. Its edges then cost no gradient collective;
the plain strategy accepts no partial gradient from its consumers
(:func:`edge_backward`). The solver picks the twin exactly when a consumer hands one
back, and pays once.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from autopar.solvers.problem import NodeChoice
    from autopar.strategies.build import NodeStrategy, _Builder

Placements = tuple[str, ...]


def summing_axes(b: "_Builder", consumers: list[tuple[int, int]],
                 details: list[list["NodeStrategy"]]) -> list[int]:
    """The free mesh axes on which some consumer strategy reads the tensor as it is
    (replicated) and hands back a partial gradient of it; ``consumers`` are (node
    index, input position) pairs."""
    return [a for a in b._free_axes()
            if any(sv.grads[pos][a] == "P" and sv.ins[pos][a] == "R"
                   for v, pos in consumers for sv in details[v])]


def grad_sum_time(b: "_Builder", name: str, out: Placements, axes: tuple[int, ...]) -> float:
    """Seconds per micro-batch to reduce node ``name``'s summed partial gradient over
    ``axes`` to its output's (replicated) placement, once."""
    if not axes or not b.node(name).requires_grad:
        return 0.0
    partial = tuple("P" if a in axes else p for a, p in enumerate(out))
    return b.convert(partial, out, b.out_bytes(name))


def add_gradient_sums(b: "_Builder", counts: dict[tuple[int, int, int], int],
                      names: list[str], details: list[list["NodeStrategy"]],
                      nodes: list["NodeChoice"]) -> None:
    """Give every producer read by two or more consumers its summing twins (module
    docstring), in place."""
    consumers: dict[int, list[tuple[int, int]]] = {}
    for u, v, pos in counts:
        consumers.setdefault(u, []).append((v, pos))
    for u, cons in consumers.items():
        if len(cons) < 2 or not b.node(names[u]).requires_grad:
            continue
        axes = summing_axes(b, cons, details)
        if not axes:
            continue
        for ns, sc in list(zip(details[u], nodes[u].strategies)):
            summed = tuple(a for a in axes if ns.out[a] == "R")
            if not summed:
                continue
            label = "P" + "".join(str(a) for a in summed)
            details[u].append(replace(ns, name=f"{ns.name}  [grad {label}]", grad_sum=summed))
            nodes[u].strategies.append(replace(
                sc, name=f"{sc.name}  [grad {label}]",
                comm_s=sc.comm_s + grad_sum_time(b, names[u], ns.out, summed)))


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
