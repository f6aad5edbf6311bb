"""Activation recomputation as a solver choice: what one group is made of. A group is
one distinct repeated layer (the canonical layer that identical blocks share): its
canonical op nodes, and the block inputs each is charged for (the activations the
layer reads from outside itself, which ``torch.utils.checkpoint`` keeps).

What each mode keeps and re-runs is priced by :mod:`autopar.cost_models.recompute_price`;
:mod:`autopar.solvers.problem_build` puts the groups into the problem.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from autopar.strategies.enumeration import StrategySpace


@dataclass
class RecomputeLayer:
    """One distinct repeated layer: the paths of the blocks that share it, its
    canonical nodes in the problem, and per node the (input position, input name) of
    the block inputs charged to it."""

    paths: list[str]
    names: list[str]
    inputs: dict[str, list[tuple[int, str]]]


def layer_groups(g) -> dict[int, list[str]]:
    """Canonical layer index -> paths of the blocks that share its canonical nodes."""
    out: dict[int, list[str]] = {}
    for lay in g.layers:
        first = next((n for n in lay.nodes if g.node(n).kind == "op"), None)
        if first is None:
            continue
        canon = g.node(g.canonical.get(first, first)).layer
        out.setdefault(canon if canon is not None else lay.index, []).append(lay.path)
    return out


def block_inputs(space: "StrategySpace", names: list[str]) -> dict[tuple[str, int], str]:
    """(node, input position) -> input name for the first reader of each activation the
    layer of nodes ``names`` reads from outside itself."""
    an = space.an
    inside = set(names)
    seen: set[str] = set()
    out: dict[tuple[str, int], str] = {}
    for name in names:
        n = space.node(name)
        if n.kind != "op":
            continue
        for pos, i in enumerate(n.inputs):
            src = space.node(i)
            if i in inside or i in seen or src.kind == "param" or i in an.constants \
                    or an.batch_dim.get(i) is None:
                continue
            seen.add(i)
            out[(name, pos)] = i
    return out


def recompute_layers(space: "StrategySpace", index: dict[str, int]) -> list[RecomputeLayer]:
    """The layers of the graph, each with its nodes among ``index`` (the problem's)."""
    g = space.g
    layers = []
    for layer, paths in layer_groups(g).items():
        names = [n for n in g.layers[layer].nodes if n in index]
        inputs: dict[str, list[tuple[int, str]]] = {}
        for (v, pos), i in block_inputs(space, names).items():
            inputs.setdefault(v, []).append((pos, i))
        layers.append(RecomputeLayer(paths, names, inputs))
    return layers
