"""Why a solved assignment gives some nodes the strategies it does: each other strategy
(or combination, for a few nodes decided together) priced with every other node kept
as solved.

:func:`price_alternatives` lists the assignments of ``nodes`` with the rest fixed, each
with :class:`LocalTerms` (what those nodes cost per step: their own time, the resharding
on their edges to the fixed neighbours, their memory) and the whole step as
:func:`autopar.solvers.problem.evaluate` scores it, so the terms are the ILP's own. The
terms and how they add up: docs/solvers.md, section ``autopar.solvers.explain``.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from autopar.solvers.problem import Problem, edge_recompute_s, evaluate

ENUMERATE_LIMIT = 4096
"""At most this many assignments of the explained nodes are priced; with more, the
nodes that own no parameters keep their solved strategy."""


@dataclass(frozen=True)
class LocalTerms:
    """What the explained nodes cost per step (seconds, bytes per device), the other
    nodes' strategies fixed.

    ``compute_s``: n · Σ m_v · device_s (the ops' forward and backward, FSDP2's copies);
    ``recompute_s``: n · Σ m_v · extra_s under the solved recomputation modes, and the
    forward conversions they run again on the edges that touch the nodes;
    ``comm_s``: n · Σ m_v · comm_s (their own collectives); ``reshard_s``: n · Σ m_e ·
    cost_e over the edges that touch them; ``optimizer_s``: Σ m_v · optimizer_s;
    ``param_comm_s``: their parameter traffic, hidden behind compute where it can be
    (not part of the step sum); ``memory_bytes``: their share of the memory, the
    recomputation modes' change included."""

    compute_s: float
    recompute_s: float
    comm_s: float
    reshard_s: float
    optimizer_s: float
    param_comm_s: float
    memory_bytes: float


@dataclass(frozen=True)
class PricedChoice:
    """One assignment of the explained nodes: their strategy indices (in the order of
    ``nodes``), :class:`LocalTerms`, and the whole step's time, its exposed parameter
    traffic and exposed host time and peak memory per device under it. ``blocked``
    says why the solver could not pick it ("" when it could): "memory" (over the
    budget), "edge" (a neighbour's fixed strategy allows no conversion to it) or "tie"
    (a tied node's strategy disagrees)."""

    strategies: tuple[int, ...]
    local: LocalTerms
    step_time_s: float
    exposed_param_comm_s: float
    exposed_host_s: float
    memory_bytes: float
    blocked: str = ""


def local_terms(p: Problem, nodes: list[int], choice: list[int],
                modes: list[int]) -> LocalTerms:
    """:class:`LocalTerms` of ``nodes`` under the full assignment ``choice`` and
    recomputation ``modes`` (one per group of ``p.recompute``)."""
    n = p.num_microbatches
    picked = set(nodes)
    comp = redo = comm = opt = pc = mem = 0.0
    for v in nodes:
        node, s = p.nodes[v], p.nodes[v].strategies[choice[v]].total
        m = node.multiplicity
        comp += n * m * s.device_s
        comm += n * m * s.comm_s
        opt += m * s.optimizer_s
        pc += m * s.step_param_comm_s + n * m * s.micro_param_comm_s
        mem += m * s.memory_bytes + node.gather_multiplicity * s.gather_bytes
    for grp, r in zip(p.recompute, modes):
        for k, v in enumerate(grp.nodes):
            if v in picked:
                m = p.nodes[v].multiplicity
                redo += n * m * grp.extra_s[k][choice[v]][r]
                mem += grp.memory(k, choice[v], r, m)
    redo += n * edge_recompute_s(p, choice, modes, picked)
    reshard = sum(n * e.multiplicity * e.cost.get((choice[e.u], choice[e.v]), math.inf)
                  for e in p.edges if e.u in picked or e.v in picked)
    return LocalTerms(comp, redo, comm, reshard, opt, pc, mem)


def _blocked(p: Problem, nodes: set[int], choice: list[int], feasible: bool) -> str:
    """Why ``choice`` is not allowed ("" when it is): see :class:`PricedChoice`."""
    if feasible:
        return ""
    if any((choice[e.u], choice[e.v]) not in e.cost for e in p.edges
           if e.u in nodes or e.v in nodes):
        return "edge"
    for t in p.ties:
        ga = next(k for k, g in enumerate(t.groups_a) if choice[t.a] in g)
        gb = next(k for k, g in enumerate(t.groups_b) if choice[t.b] in g)
        if ga != gb:
            return "tie"
    return "memory"


def price_alternatives(p: Problem, nodes: list[int], choice: list[int],
                       modes: list[int] | None = None,
                       owners: list[int] | None = None) -> list[PricedChoice]:
    """Every assignment of ``nodes`` (indices into ``p.nodes``) with the other nodes
    kept at ``choice``, priced; the solved one first, then by step time. Over
    :data:`ENUMERATE_LIMIT` assignments, only the nodes of ``owners`` (those owning
    parameters; all of ``nodes`` when None) vary."""
    modes = list(modes) if modes is not None else [0] * len(p.recompute)
    varied = list(nodes)
    if math.prod(len(p.nodes[v].strategies) for v in varied) > ENUMERATE_LIMIT:
        varied = [v for v in nodes if owners is None or v in owners][:1] or varied[:1]
    ranges = [range(len(p.nodes[v].strategies)) if v in varied else [choice[v]]
              for v in nodes]
    out = []
    for combo in itertools.product(*ranges):
        trial = list(choice)
        for v, i in zip(nodes, combo):
            trial[v] = i
        ev = evaluate(p, trial, modes)
        out.append(PricedChoice(tuple(combo), local_terms(p, nodes, trial, modes),
                                ev.step_time_s, ev.exposed_param_comm_s, ev.exposed_host_s,
                                ev.memory_bytes, _blocked(p, set(nodes), trial, ev.feasible)))
    solved = tuple(choice[v] for v in nodes)
    return sorted(out, key=lambda c: (c.strategies != solved, c.step_time_s))
