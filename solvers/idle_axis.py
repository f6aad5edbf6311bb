"""A tensor-parallel axis that splits nothing, and the search's preference against it.

On a ``tp`` axis where every chosen strategy keeps its inputs and output whole (``R``),
each rank of a tp group runs the whole model on the same samples: the plain layout on
``world / tp`` ranks, repeated. It moves nothing, so where splitting the work costs
more communication than it saves (a tiny GPT on 4 gloo processes) it was the fastest
candidate. The outer search therefore sets such a candidate aside
(:func:`splits_nothing`) and keeps the fastest layout that uses its ranks, planning
the replicated one only when nothing else exists; the exhaustive reference does the
same. The rule and the figures: docs/solvers.md, ``autopar.solvers.outer_search``.
"""

from __future__ import annotations

from autopar.solvers.problem_build import Built

IDLE_AXIS = "tp"
"""The axis a layout may leave unsplit: dp, cp and ep split the samples, sequences
and experts by construction, pp the blocks, whatever the strategies."""


def splits_nothing(built: Built, choice: list[int]) -> bool:
    """True when ``built``'s mesh has a :data:`IDLE_AXIS` of size above 1 and the
    strategies ``choice`` picks (one index per node of ``built``) keep every input and
    output of every node whole (``R``) along it."""
    mesh = built.settings.mesh
    if mesh.degree(IDLE_AXIS) <= 1:
        return False
    a = mesh.axis(IDLE_AXIS)
    for options, k in zip(built.strategies, choice):
        s = options[k]
        if any(len(pl) > a and pl[a] != "R" for pl in (s.out, *s.ins)):
            return False
    return True
