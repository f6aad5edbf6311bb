"""What connects the strategies of two ops: the collectives that re-lay a tensor out
from one placement to another, the strategy pairs each edge of the graph allows with
the conversion each pair needs, and the ties between the readers of one parameter.

A conversion, per mesh axis whose placement changes, is one collective over that axis
(:func:`collectives`: S→R all-gather, P→R all-reduce, P→S reduce-scatter, S(i)→S(j)
all-to-all; R→S is a local slice), forward and, for tensors that need gradients, the
dual conversion of the gradient backward. :mod:`autopar.cost_models.strategy_price`
prices them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from autopar.strategies.enumeration import NodeStrategy, StrategySpace
from autopar.strategies.grad_sum import edge_backward

Placements = tuple[str, ...]


def collectives(src: Placements, dst: Placements, nbytes: float,
                sizes: tuple[int, ...]) -> tuple[tuple[str, int, float], ...] | None:
    """The collectives that re-lay a tensor of ``nbytes`` (whole) out from ``src`` to
    ``dst`` on a mesh of ``sizes``, in axis order: (kind, mesh axis, bytes of its
    buffer: each device's piece of the other axes' splits, and for an all-to-all the
    bytes each device holds). None where no collective can: a split turned into a
    partial sum."""
    steps = []
    for a, (s, d) in enumerate(zip(src, dst)):
        if s == d:
            continue
        local = nbytes
        for b, p in enumerate(src):
            if b != a and p.startswith("S("):
                local /= sizes[b]
        if s.startswith("S(") and d == "R":
            kind, size = "all_gather", local
        elif s == "P" and d == "R":
            kind, size = "all_reduce", local
        elif s == "P" and d.startswith("S("):
            kind, size = "reduce_scatter", local
        elif s.startswith("S(") and d.startswith("S("):
            kind, size = "all_to_all", local / sizes[a]
        elif s.startswith("S(") and d == "P":
            return None
        else:
            continue  # a local slice or a partial view: no collective
        steps.append((kind, a, size))
    return tuple(steps)


def with_axis(pl: Placements, other: Placements, axis: int) -> Placements:
    """``pl`` with ``other``'s placement on mesh axis ``axis``."""
    return tuple(other[a] if a == axis else p for a, p in enumerate(pl))


def shared_conversion(c: "Conversion", axis: int) -> "Conversion":
    """Conversion ``c`` without its collectives over ``axis``, which an earlier edge
    runs (its destination and gradient placed there as its source)."""
    return Conversion(c.src, with_axis(c.dst, c.src, axis), with_axis(c.grad, c.src, axis))


def reachable(src: Placements, dst: Placements) -> bool:
    """Whether some collectives turn ``src`` into ``dst`` (:func:`collectives`)."""
    return not any(s != d and s.startswith("S(") and d == "P" for s, d in zip(src, dst))


class Conversion(NamedTuple):
    """What an edge converts between a pair of strategies: the producer's output from
    ``src`` to the consumer's input ``dst`` forward and, when gradients flow, the
    gradient the consumer hands back from ``grad`` to ``src`` (partial sums reduced)."""

    src: Placements
    dst: Placements
    grad: Placements


@dataclass
class EdgeOptions:
    """The strategy pairs one edge of canonical nodes allows: (producer strategies,
    consumer strategies, the conversion every pair of them needs)."""

    producer: int
    consumer: int
    count: int      # how many graph edges the pair of nodes stands for
    tensor: str     # the producer's node name
    needs_grad: bool
    pairs: list[tuple[list[int], list[int], Conversion]]
    shared_axis: int | None = None  # an axis whose conversion an earlier edge runs
    entry: bool = False  # into an expert module: over ep, an all-to-all to the experts


def _repeat_entry(space: StrategySpace, producer: str, consumer: str) -> bool:
    """Whether ``consumer`` is an expert module's entry and an earlier entry of that
    module reads ``producer`` too: the tokens cross ``ep`` once, on the first."""
    em = space.an.expert_of(consumer)
    if em is None:
        return False
    for op in em.entries:
        if producer in space.node(op).inputs:
            return op != consumer
    return False


def edge_counts(g, index: dict[str, int]) -> dict[tuple[int, int, int], int]:
    """(producer, consumer, input position) of canonical nodes (positions in ``index``)
    -> how many graph edges the pair stands for."""
    canon = g.canonical
    counts: dict[tuple[int, int, int], int] = {}
    for n in g.nodes:
        if n.kind != "op":
            continue
        v = index[canon.get(n.name, n.name)]
        for pos, i in enumerate(n.inputs):
            if g.node(i).kind == "param":
                continue
            u = index[canon.get(i, i)]
            counts[(u, v, pos)] = counts.get((u, v, pos), 0) + 1
    return counts


def edge_options(space: StrategySpace, counts: dict[tuple[int, int, int], int],
                 details: list[list[NodeStrategy]], names: list[str]) -> list[EdgeOptions]:
    """The strategy pairs of every edge in ``counts``, strategies grouped by what the
    edge sees of them (the producer's output, the consumer's input and gradient
    placements): a module consumer converts whatever it is handed; elsewhere producer
    and consumer agree, but for a gradient that comes back partial."""
    an, free = space.an, space.free
    edges = []
    for (u, v, pos), mult in counts.items():
        un, vn = space.node(names[u]), space.node(names[v])
        # a module's first op converts what it is handed; so does a routed expert
        # module's op reading from outside it where the experts fold over tp (the
        # runtime splits its tokens, indices and weights over tp on entry)
        module_consumer = vn.name in an.module_ops or (
            space.st.fold_experts and vn.name in an.routed_ops and un.name not in an.routed_ops)
        em = an.expert_of(vn.name)
        # an expert module's entry takes the tokens over ep by an all-to-all
        entry = em is not None and space.ep_axis is not None and vn.name in em.entries \
            and un.name not in em.labels
        sums = any(su.grad_sum for su in details[u])
        outs: dict[tuple[Placements, tuple[int, ...]], list[int]] = {}
        for i, su in enumerate(details[u]):
            outs.setdefault((su.out, su.grad_sum), []).append(i)
        needs: dict[tuple[Placements, Placements], list[int]] = {}
        for j, sv in enumerate(details[v]):
            needs.setdefault((sv.ins[pos], sv.grads[pos]), []).append(j)
        pairs: list[tuple[list[int], list[int], Conversion]] = []
        # a constant is computed on each rank from its local shapes (and positions): it
        # is whatever the consumer needs on the data- and context-parallel axes
        fixed = [a for a in range(space.mesh.ndim) if a not in free
                 and not (un.name in an.constants and
                          (a in space.data_axes or a == space.cp_axis))]
        axes = free + fixed
        strict = [a for a in fixed if not (entry and a == space.ep_axis)]
        for (out, summed), ii in outs.items():
            for (need, grad), jj in needs.items():
                if any(out[a] != need[a] for a in strict):
                    continue
                if entry and not module_consumer and any(out[a] != need[a] for a in free):
                    continue
                if all(out[a] == need[a] for a in axes):
                    # no forward collective, but a gradient that comes back partial over
                    # a tensor-parallel axis (a column-wise Linear's replicated input) is
                    # all-reduced at the module boundary; partial over data parallelism,
                    # it is a parameter's, reduced with the parameter gradients
                    back = edge_backward(tuple(grad[a] if a in free else "R" if p == "P" else p
                                               for a, p in enumerate(out)), out,
                                         summed if sums else None, free)
                    if back is not None:
                        pairs.append((ii, jj, Conversion(out, need, back)))
                elif (module_consumer or entry) and reachable(out, need):
                    pairs.append((ii, jj, Conversion(out, need, grad)))
        shared = space.ep_axis if entry and _repeat_entry(space, un.name, vn.name) else None
        edges.append(EdgeOptions(u, v, mult, un.name, un.requires_grad, pairs, shared, entry))
    return edges


def tied_groups(space: StrategySpace, index: dict[str, int], details: list[list[NodeStrategy]]
                ) -> list[tuple[int, int, list[list[int]], list[list[int]]]]:
    """Ops that read the same parameter must agree on its placement: per pair of
    readers (node indices a, c), the groups of each one's strategies, one group per
    placement of the parameter, that go together."""
    ties = []
    canon = space.g.canonical
    for p, users in space.an.param_consumers.items():
        first = users[0]
        a = index[canon.get(first[0], first[0])]
        for other in users[1:]:
            c = index[canon.get(other[0], other[0])]
            if c == a and other[1] == first[1]:
                continue
            keys = sorted({s.ins[first[1]] for s in details[a]} |
                          {s.ins[other[1]] for s in details[c]})
            ga = [[i for i, s in enumerate(details[a]) if s.ins[first[1]] == k] for k in keys]
            gb = [[j for j, s in enumerate(details[c]) if s.ins[other[1]] == k] for k in keys]
            ties.append((a, c, ga, gb))
    return ties
