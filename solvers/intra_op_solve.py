"""The intra-op solver's entry point, :func:`solve_ilp`: the ILP of
:mod:`autopar.solvers.intra_op_ilp` (with host time, :mod:`autopar.solvers.intra_op_host`)
solved once, or once per combination of recomputation modes, with the shortcuts its
docstring gives."""

from __future__ import annotations

import itertools
import time
from dataclasses import replace

from autopar.errors import NoFeasiblePlanError
from autopar.solvers.intra_op_host import solve_host_aware
from autopar.solvers.intra_op_ilp import Solution, SolverTimeout, fold_modes
from autopar.solvers.problem import Problem, evaluate, least_memory

__all__ = ["ENUMERATE_MODES", "solve_ilp"]


def _recompute_only_adds_time(problem: Problem) -> bool:
    """True when no strategy pays both per-step and per-micro-batch parameter traffic
    (then T(s, r) ≥ T(s, none) for every assignment s and modes r)."""
    step = any(s.total.step_param_comm_s for n in problem.nodes for s in n.strategies)
    micro = any(s.total.micro_param_comm_s for n in problem.nodes for s in n.strategies)
    return not (step and micro)


def _least_time(problem: Problem) -> float:
    """n·(the forest bound of :func:`autopar.solvers.bounds.tree_bound`) + Σ_v m_v min_i
    optimizer: no assignment is faster (the dropped edges and the exposed parameter
    traffic are ≥ 0)."""
    from autopar.solvers.bounds import tree_bound

    return problem.num_microbatches * tree_bound(problem) + sum(
        n.multiplicity * min(s.total.optimizer_s for s in n.strategies) for n in problem.nodes)


ENUMERATE_MODES = 9
"""Up to this many combinations of recomputation modes, :func:`solve_ilp` solves one
ILP per combination with the modes folded in (smaller models that CBC solves faster
than one model with the mode variables); above it, one ILP with ``z`` and ``w``."""


def solve_ilp(problem: Problem, time_limit_s: float | None = None,
              bound: float = float("inf")) -> Solution | None:
    """Solve ``problem`` to optimality with the ILP; raises NoFeasiblePlanError.

    Recomputation only adds time (when no strategy has both per-step and per-micro-batch
    parameter communication, as the builder makes them: then the recomputed forward
    can hide at most the micro-batch term it adds to), and a memory budget only removes
    assignments, so when the fastest assignment without recomputation and without the
    budget fits the budget it is the optimum. Otherwise, with few groups, every
    combination of modes is solved as its own ILP (skipping a combination whose least
    memory exceeds the budget, or whose least time n·Σ_v m_v min_i(compute + comm +
    extra) cannot beat the best found), and the fastest wins; with many groups, one ILP
    with the mode variables decides.

    ``time_limit_s`` bounds each CBC run: one it cuts short returns its best assignment
    with ``status`` "Stopped" (not proven optimal), and one that found none raises
    :class:`SolverTimeout`.

    ``bound``: the caller needs only an objective below it. Combinations whose least
    time reaches it are skipped, and when that leaves none, None is returned (the
    problem may well fit: it just cannot beat the bound).
"""
    end = None if time_limit_s is None else time.perf_counter() + time_limit_s

    def left() -> float | None:
        """The seconds left of ``time_limit_s``, at least 0.05 for CBC to return the
        assignment it has (None: no limit)."""
        return None if end is None else max(0.05, end - time.perf_counter())

    groups = problem.recompute
    combos = list(itertools.product(*(g.allowed for g in groups)))
    if not groups or len(combos) > ENUMERATE_MODES or not all(0 in g.allowed for g in groups):
        if len(combos) == 1:
            folded = fold_modes(problem, list(combos[0]))
            if _least_time(folded) >= bound:
                return None
            sol = solve_host_aware(folded, left(), bound)
            if sol is not None:
                sol.modes = list(combos[0])
            return sol
        return solve_host_aware(problem, left(), bound)
    none = (0,) * len(groups)
    if _recompute_only_adds_time(problem):
        if _least_time(fold_modes(problem, list(none))) >= bound:
            return None
        if least_memory(fold_modes(problem, list(none))) <= problem.memory_budget:
            plain = replace(fold_modes(problem, list(none)), memory_budget=float("inf"))
            free = solve_host_aware(plain, left(), bound)
            if free is None:  # recomputation and the budget only add time
                return None
            free.modes = list(none)
            if evaluate(problem, free.choice, free.modes).feasible:
                return free
    best: Solution | None = None
    beaten = False
    stopped = False
    lows: list[float] = []  # each solved combination's lower bound
    for modes in combos:
        folded = fold_modes(problem, list(modes))
        if least_memory(folded) > problem.memory_budget:
            continue
        if _least_time(folded) >= min(bound, best.objective_s if best else float("inf")):
            beaten = beaten or best is None
            continue
        if end is not None and time.perf_counter() >= end:
            if best is None:
                raise SolverTimeout(f"no combination of recomputation modes was solved in "
                                    f"{time_limit_s:.3g} s")
            stopped = True  # the combinations not solved may hold a faster one
            break
        try:
            sol = solve_host_aware(folded, left(), min(bound, best.objective_s if best else bound))
        except NoFeasiblePlanError:
            continue
        if sol is None:
            beaten = beaten or best is None
            continue
        sol.modes = list(modes)
        sol.objective_s = evaluate(problem, sol.choice, sol.modes).step_time_s
        stopped = stopped or sol.status == "Stopped"
        lows.append(sol.stats.get("lower_bound_s", sol.objective_s))
        if best is None or sol.objective_s < best.objective_s * (1 - 1e-12):
            best = sol
    if best is None:
        if beaten:
            return None
        raise NoFeasiblePlanError("the intra-op ILP is infeasible")
    if stopped:  # one combination's ILP was cut short: the best is not proven
        best.status = "Stopped"
        best.stats["lower_bound_s"] = min(lows)
    return best

