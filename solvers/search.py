"""The outer search: every factorization of the world into dp x tp, every micro-batch
size, ZeRO-0 and ZeRO-3; one intra-op ILP per candidate; the fastest feasible wins.

Candidates are visited in a fixed order and ties keep the first found, so the same
inputs always give the same plan.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from autopar.errors import ConfigError, NoFeasiblePlanError
from autopar.sharding import Mesh
from autopar.solvers.ilp import Solution, solve_ilp
from autopar.solvers.problem import evaluate
from autopar.strategies.analysis import GraphAnalysis
from autopar.strategies.build import Built, Settings, build_problem


@dataclass(frozen=True)
class Candidate:
    """One point of the outer search space."""

    dp: int
    tp: int
    microbatch_size: int
    num_microbatches: int
    zero: int

    def label(self) -> str:
        """Short readable description."""
        return (f"dp={self.dp} tp={self.tp} mb={self.microbatch_size}x{self.num_microbatches}"
                f" zero={self.zero}")


@dataclass
class Outcome:
    """What one candidate gave: a step time, or why it was dropped."""

    candidate: Candidate
    step_time_s: float | None
    memory_bytes: float | None
    reason: str = ""


@dataclass
class SearchResult:
    """The best candidate's problem and solution, and every candidate's outcome."""

    built: Built
    solution: Solution
    outcomes: list[Outcome] = field(default_factory=list)
    time_s: float = 0.0


def divisors(n: int) -> list[int]:
    """Positive divisors of n, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(world: int, global_batch: int, *, dp: int | None = None, tp: int | None = None,
               microbatch_size: int | None = None, zero: int | None = None) -> list[Candidate]:
    """Every candidate allowed by the fixed degrees (None = free)."""
    out = []
    for t in divisors(world):
        d = world // t
        if (tp is not None and t != tp) or (dp is not None and d != dp):
            continue
        if global_batch % d:
            continue
        local = global_batch // d
        mbs = [microbatch_size] if microbatch_size is not None else divisors(local)
        for mb in mbs:
            if local % mb:
                continue
            zs = [zero] if zero is not None else ([0, 3] if d > 1 else [0])
            for z in zs:
                out.append(Candidate(d, t, mb, local // mb, z))
    if not out:
        raise ConfigError(
            f"no data x tensor parallel layout of {world} devices divides the global batch of "
            f"{global_batch} under the requested degrees (dp={dp}, tp={tp}, "
            f"microbatch={microbatch_size}); choose a global batch divisible by the "
            f"data-parallel degree")
    return out


def search(an: GraphAnalysis, cands: list[Candidate], *, hw, gpus_per_node: int,
           precision: str, optimizer: str, memory_budget: float,
           sequence_parallel: bool | None = None,
           time_limit_s: float | None = None) -> SearchResult:
    """Solve every candidate and return the fastest feasible plan's pieces.

    Raises NoFeasiblePlanError when none fits, naming the least memory a plan needs.
    """
    t0 = time.perf_counter()
    best: tuple[float, Built, Solution] | None = None
    outcomes: list[Outcome] = []
    infeasible: list[Built] = []
    for c in cands:
        st = Settings(Mesh(("dp", "tp"), (c.dp, c.tp)), c.microbatch_size, c.num_microbatches,
                      c.zero, precision, optimizer, memory_budget, hw, gpus_per_node,
                      sequence_parallel=sequence_parallel)
        try:
            built = build_problem(an, st)
        except NoFeasiblePlanError as e:
            outcomes.append(Outcome(c, None, None, str(e)))
            continue
        if lower_bound_memory(built) > memory_budget:
            outcomes.append(Outcome(c, None, None, "does not fit in memory"))
            infeasible.append(built)
            continue
        try:
            sol = solve_ilp(built.problem)
        except NoFeasiblePlanError:
            outcomes.append(Outcome(c, None, None, "does not fit in memory"))
            infeasible.append(built)
            continue
        ev = evaluate(built.problem, sol.choice)
        outcomes.append(Outcome(c, ev.step_time_s, ev.memory_bytes))
        if best is None or ev.step_time_s < best[0] * (1 - 1e-9):
            best = (ev.step_time_s, built, sol)
        if time_limit_s is not None and time.perf_counter() - t0 > time_limit_s:
            break
    if best is None:
        raise NoFeasiblePlanError(_no_fit_message(infeasible, memory_budget, outcomes))
    res = SearchResult(best[1], best[2], outcomes, time.perf_counter() - t0)
    res.solution.stats["candidates"] = len(outcomes)
    res.solution.stats["search_s"] = res.time_s
    return res


def lower_bound_memory(built: Built) -> float:
    """Σ over nodes of the smallest memory any of its strategies needs (a lower bound)."""
    p = built.problem
    return p.fixed_memory + sum(
        min(n.multiplicity * s.memory_bytes + n.gather_multiplicity * s.gather_bytes
            for s in n.strategies) for n in p.nodes)


def _no_fit_message(infeasible: list[Built], budget: float, outcomes: list[Outcome]) -> str:
    if not infeasible:
        reasons = "; ".join(sorted({o.reason for o in outcomes if o.reason}))
        return f"no candidate plan could be built ({reasons})"
    best = min(infeasible, key=lower_bound_memory)
    need = lower_bound_memory(best)
    cats: dict[str, float] = {}
    for k, n in enumerate(best.problem.nodes):
        i = min(range(len(n.strategies)), key=lambda j: n.strategies[j].memory_bytes)
        for cat, v in best.strategies[k][i].memory.items():
            cats[cat] = cats.get(cat, 0.0) + n.multiplicity * v
    top = ", ".join(f"{k} {v / 1e9:.2f} GB" for k, v in
                    sorted(cats.items(), key=lambda kv: -kv[1]) if v > 0)
    st = best.settings
    return (f"no plan fits in {budget / 1e9:.2f} GB per device: the smallest needs at least "
            f"{need / 1e9:.2f} GB (dp={st.mesh.sizes[0]}, tp={st.mesh.sizes[1]}, "
            f"micro-batch {st.microbatch_size}, ZeRO-{st.zero}; largest consumers: {top}). "
            f"Raise memory_budget, use more devices, or a smaller global batch.")
