"""Exhaustive reference solver: tries every assignment. For tests on tiny problems."""

from __future__ import annotations

import itertools

from autopar.errors import ConfigError, NoFeasiblePlanError
from autopar.solvers.ilp import Solution
from autopar.solvers.problem import Problem, evaluate


def solve_exhaustive(problem: Problem, max_assignments: int = 2_000_000) -> Solution:
    """Evaluate every combination of one strategy per node and return the cheapest
    feasible one (ties broken by the first found in lexicographic order)."""
    total = 1
    for n in problem.nodes:
        total *= len(n.strategies)
    if total > max_assignments:
        raise ConfigError(f"exhaustive search over {total} assignments exceeds the limit of "
                          f"{max_assignments}; use the ILP for problems this size")
    best: tuple[float, list[int]] | None = None
    for combo in itertools.product(*(range(len(n.strategies)) for n in problem.nodes)):
        ev = evaluate(problem, list(combo))
        if ev.feasible and (best is None or ev.step_time_s < best[0] - 1e-15):
            best = (ev.step_time_s, list(combo))
    if best is None:
        raise NoFeasiblePlanError("no assignment satisfies the edges, ties and memory budget")
    return Solution(best[1], best[0], "Optimal", {"solver": "exhaustive", "assignments": total})
