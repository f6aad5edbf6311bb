"""Exhaustive reference solver: tries every assignment. For tests on tiny problems."""

from __future__ import annotations

import itertools

from autopar.errors import ConfigError, NoFeasiblePlanError
from autopar.solvers.ilp import Solution
from autopar.solvers.problem import Problem, evaluate


def solve_exhaustive(problem: Problem, max_assignments: int = 2_000_000) -> Solution:
    """Evaluate every combination of one strategy per node (and one recomputation mode
    per group) and return the cheapest
    feasible one (ties broken by the first found in lexicographic order)."""
    total = 1
    for n in problem.nodes:
        total *= len(n.strategies)
    for grp in problem.recompute:
        total *= len(grp.allowed)
    if total > max_assignments:
        raise ConfigError(f"exhaustive search over {total} assignments exceeds the limit of "
                          f"{max_assignments}; use the ILP for problems this size")
    best: tuple[float, list[int], list[int]] | None = None
    mode_sets = list(itertools.product(*(g.allowed for g in problem.recompute)))
    for combo in itertools.product(*(range(len(n.strategies)) for n in problem.nodes)):
        for modes in mode_sets:
            ev = evaluate(problem, list(combo), list(modes))
            if ev.feasible and (best is None or ev.step_time_s < best[0] - 1e-15):
                best = (ev.step_time_s, list(combo), list(modes))
    if best is None:
        raise NoFeasiblePlanError("no assignment satisfies the edges, ties and memory budget")
    return Solution(best[1], best[0], "Optimal", {"solver": "exhaustive", "assignments": total},
                    best[2])
