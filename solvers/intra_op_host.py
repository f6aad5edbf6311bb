"""The intra-op ILP where the host may bound the step.

On a GPU profile the step is F = T + H (``(**)`` of docs/solvers.md), and where H binds, F
is the larger of two sums that strategies trade against each other; CBC's bound on such
a max is weak (a 7.5B GPT at pp 2 × cp 2 × tp 8 ran for minutes unproven, while each
linear objective of it solves in 0.1 s). :func:`solve_host_aware` solves T alone first
(F ≥ T: proven where the host adds nothing, pruned where T reaches the caller's bound),
then the exact ILP for at most :data:`HOST_PROOF_S`, then, unproven, the best Lagrangian
minimizer of λ·T + (1 − λ)·h (h the step's host seconds, F ≥ max(T, h)), returned as
"Stopped" with its lower bound in ``stats["lower_bound_s"]``. docs/solvers.md has more.
"""

from __future__ import annotations

import time

from autopar.errors import NoFeasiblePlanError
from autopar.solvers.intra_op_ilp import IntraOpILP, Solution, SolverTimeout, has_host_seconds
from autopar.solvers.problem import Problem, evaluate

HOST_PROOF_S = 2.0
"""Seconds the exact ILP gets to prove a host-bound optimum (step 3 above). A search
effort, not a cost: every ILP on the zoo's models at 8 to 1,024 H100 that CBC proves at
all, it proves within about a second, while the pathological ones ran for minutes."""

LAGRANGE_STEPS = 6
"""Bisection steps on λ (step 2 above): λ within 1/64 of the best."""

TOLERANCE = 1e-9
"""Relative gap below which a plan counts as proven optimal (CBC's own ``gapRel``)."""


def solve_host_aware(problem: Problem, time_limit_s: float | None = None,
                     bound: float = float("inf")) -> Solution | None:
    """The assignment minimizing F of ``problem`` (see the module's docstring), None when
    no assignment can be below ``bound`` (seconds of F). ``time_limit_s`` bounds the
    whole call as :meth:`IntraOpILP.solve` bounds one CBC run; raises
    NoFeasiblePlanError when nothing fits and SolverTimeout when the limit left no
    assignment."""
    if not has_host_seconds(problem):
        return IntraOpILP(problem).solve(time_limit_s)
    t0 = time.perf_counter()
    end = None if time_limit_s is None else t0 + time_limit_s

    def left(cap: float | None = None) -> float | None:
        """Seconds left of the call's limit (at least 0.05), capped at ``cap``."""
        rest = None if end is None else max(0.05, end - time.perf_counter())
        return cap if rest is None else rest if cap is None else min(cap, rest)

    first = IntraOpILP(problem, mix=(1.0, 0.0)).solve(left())
    ev = evaluate(problem, first.choice, first.modes)
    first.objective_s = ev.step_time_s
    proven = first.status == "Optimal"
    lower = ev.step_time_s - ev.exposed_host_s if proven else 0.0
    if proven and ev.exposed_host_s <= TOLERANCE * ev.step_time_s:
        return first
    if lower >= bound:
        return None
    best = _exact(problem, first, left(HOST_PROOF_S))
    if best.status == "Optimal":
        return _timed(best, t0)
    lo, hi = 0.0, 1.0
    for _ in range(LAGRANGE_STEPS):
        if best.objective_s <= lower * (1 + TOLERANCE) or _out(end):
            break
        lam = (lo + hi) / 2
        sol = IntraOpILP(problem, mix=(lam, 1.0 - lam)).solve(left())
        e = evaluate(problem, sol.choice, sol.modes)
        sol.objective_s = e.step_time_s
        t = e.step_time_s - e.exposed_host_s
        if sol.status == "Optimal":
            lower = max(lower, lam * t + (1.0 - lam) * e.host_s)
        if sol.objective_s < best.objective_s * (1 - 1e-12):
            best = sol
        if lower >= bound:
            return None
        lo, hi = (lam, hi) if t > e.host_s else (lo, lam)
    if best.objective_s > lower * (1 + TOLERANCE):
        best.status = "Stopped"
        best.stats["lower_bound_s"] = lower
    else:
        best.status = "Optimal"
    return _timed(best, t0)


def _timed(sol: Solution, t0: float) -> Solution:
    """``sol`` with ``stats["time_s"]`` the seconds since ``t0`` (every ILP it took)."""
    sol.stats["time_s"] = time.perf_counter() - t0
    return sol


def _exact(problem: Problem, best: Solution, time_limit_s: float) -> Solution:
    """The exact ILP's answer within ``time_limit_s``, or ``best`` where that is faster
    or the ILP found nothing; "Stopped" unless the ILP proved its optimum."""
    try:
        sol = IntraOpILP(problem).solve(time_limit_s)
    except (SolverTimeout, NoFeasiblePlanError):
        sol = None
    if sol is not None and sol.objective_s <= best.objective_s:
        return sol
    best.status = "Stopped" if sol is None or sol.status != "Optimal" else "Optimal"
    return best


def _out(end: float | None) -> bool:
    """Whether the deadline ``end`` (a perf_counter instant; None: none) has passed."""
    return end is not None and time.perf_counter() >= end
