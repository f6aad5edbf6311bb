"""The outer search: every factorization of the world into pp x dp x tp, every
micro-batch size, ZeRO stage and pipeline schedule; one intra-op ILP per candidate
(and, with pipelining, one stage DP per schedule); the fastest feasible wins.

Candidates are visited in a fixed order and ties keep the first found, so the same
inputs always give the same plan.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from autopar.errors import ConfigError, NoFeasiblePlanError
from autopar.sharding import Mesh
from autopar.solvers.ilp import Solution, solve_ilp
from autopar.solvers.pipeline_search import PipelineOutcome, solve_pipeline
from autopar.solvers.schedules import validate
from autopar.solvers.problem import evaluate
from autopar.strategies.analysis import GraphAnalysis
from autopar.strategies.build import Built, Settings, build_problem


@dataclass(frozen=True)
class Candidate:
    """One point of the outer search space (``pp`` = 1: no pipeline)."""

    dp: int
    tp: int
    microbatch_size: int
    num_microbatches: int
    zero: int
    pp: int = 1
    schedule: str = ""
    virtual_stages: int = 1

    def label(self) -> str:
        """Short readable description."""
        pipe = f"pp={self.pp} {self.schedule}" + (
            f" v={self.virtual_stages}" if self.virtual_stages > 1 else "") + " " \
            if self.pp > 1 else ""
        return (f"{pipe}dp={self.dp} tp={self.tp} mb={self.microbatch_size}x"
                f"{self.num_microbatches} zero={self.zero}")


@dataclass
class Outcome:
    """What one candidate gave: a step time, or why it was dropped."""

    candidate: Candidate
    step_time_s: float | None
    memory_bytes: float | None
    reason: str = ""


@dataclass
class SearchResult:
    """The best candidate's problem and solution (and its pipeline, if any), and every
    candidate's outcome."""

    built: Built
    solution: Solution
    outcomes: list[Outcome] = field(default_factory=list)
    time_s: float = 0.0
    candidate: Candidate | None = None
    pipeline: PipelineOutcome | None = None


def divisors(n: int) -> list[int]:
    """Positive divisors of n, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


AUTO_SCHEDULES = (("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_zero_bubble", 2),
                  ("zbv", 2))
"""Schedules the search tries by itself, with their virtual stages per rank. GPipe is
left out: it takes the time of 1F1B with more activation memory (Narayanan et al.,
SC'21 §2.2), so it never wins; ask for it with ``schedule="gpipe"``."""


def candidates(world: int, global_batch: int, *, dp: int | None = None, tp: int | None = None,
               pp: int | None = None, microbatch_size: int | None = None,
               zero: int | None = None, schedule: str | None = None,
               virtual_stages: int | None = None, num_units: int = 0,
               heads: int | None = None) -> list[Candidate]:
    """Every candidate allowed by the fixed degrees (None = free). ``num_units`` (the
    model's pipeline units) bounds the pipeline: each stage needs one unit. A free
    ``tp`` must divide ``heads`` (the attention heads; None = any), since attention
    cannot split otherwise; a free micro-batch size must leave a pipeline at least
    ``pp`` micro-batches (fewer leave ranks idle for most of the step)."""
    out = []
    for p in divisors(world):
        if (pp is not None and p != pp) or (pp is None and p > 1 and p * 2 > num_units):
            continue
        for t in divisors(world // p):
            d = world // p // t
            if (tp is not None and t != tp) or (dp is not None and d != dp):
                continue
            if tp is None and heads is not None and heads % t:
                continue
            if global_batch % d:
                continue
            local = global_batch // d
            mbs = [microbatch_size] if microbatch_size is not None else divisors(local)
            for mb in mbs:
                if local % mb or (microbatch_size is None and local // mb < p):
                    continue
                m = local // mb
                zs = [zero] if zero is not None else ([0, 3] if d > 1 and p == 1 else
                                                      [0, 1] if d > 1 else [0])
                for z in zs:
                    for sched, v in _schedules(p, m, schedule, virtual_stages, num_units):
                        out.append(Candidate(d, t, mb, m, z, p, sched, v))
    if not out:
        raise ConfigError(
            f"no pipeline x data x tensor parallel layout of {world} devices divides the "
            f"global batch of {global_batch} under the requested degrees (pp={pp}, dp={dp}, "
            f"tp={tp}, microbatch={microbatch_size}); choose a global batch divisible by "
            f"the data-parallel degree, or fewer pipeline stages than the model has blocks")
    return out


def _schedules(pp: int, m: int, schedule: str | None, virtual_stages: int | None,
               num_units: int) -> list[tuple[str, int]]:
    """The (schedule, virtual stages) pairs to try for ``pp`` stages and ``m``
    micro-batches: none without a pipeline, the requested one, or AUTO_SCHEDULES."""
    if pp == 1:
        return [("", 1)]
    if schedule is not None:
        v = virtual_stages or (2 if schedule in ("zbv",) else 1)
        pairs = [(schedule, v)]
    else:
        pairs = list(AUTO_SCHEDULES)
    return [(sc, v) for sc, v in pairs if pp * v <= num_units and validate(sc, pp, m, v) is None]


def search(an: GraphAnalysis, cands: list[Candidate], *, hw, gpus_per_node: int,
           precision: str, optimizer: str, memory_budget: float,
           sequence_parallel: bool | None = None,
           time_limit_s: float | None = None) -> SearchResult:
    """Solve every candidate and return the fastest feasible plan's pieces.

    Raises NoFeasiblePlanError when none fits, naming the least memory a plan needs.
    """
    t0 = time.perf_counter()
    best: tuple[float, Built, Solution, Candidate, PipelineOutcome | None] | None = None
    outcomes: list[Outcome] = []
    infeasible: list[Built] = []
    built_by: dict[tuple, Built | NoFeasiblePlanError] = {}
    for c in cands:
        key = _mesh_key(c)
        if key not in built_by:
            st = Settings(Mesh(("dp", "tp"), (c.dp, c.tp)), c.microbatch_size,
                          c.num_microbatches, c.zero, precision, optimizer, memory_budget, hw,
                          gpus_per_node, sequence_parallel=sequence_parallel)
            try:
                built_by[key] = build_problem(an, st)
            except NoFeasiblePlanError as e:
                built_by[key] = e
    bounds = {key: lower_bounds(b) for key, b in built_by.items() if isinstance(b, Built)}
    order = sorted(range(len(cands)), key=lambda k: (_time_bound(cands[k], bounds), k))
    solved: dict[tuple, object] = {}
    for c in (cands[k] for k in order):
        built = built_by[_mesh_key(c)]
        if isinstance(built, NoFeasiblePlanError):
            outcomes.append(Outcome(c, None, None, str(built)))
            continue
        if best is not None and _time_bound(c, bounds) >= best[0]:
            outcomes.append(Outcome(c, None, None, "pruned: its lower bound on the step time "
                                                    "is no better than the best plan found"))
            continue
        if bounds[_mesh_key(c)][1] / c.pp > memory_budget:
            outcomes.append(Outcome(c, None, None, "does not fit in memory"))
            infeasible.append(built)
            continue
        if c.pp > 1:
            try:
                po = solve_pipeline(an.graph, built, pp=c.pp, schedule=c.schedule,
                                    virtual_stages=c.virtual_stages, solved=solved,
                                    bound=best[0] if best is not None else float("inf"))
            except NoFeasiblePlanError as e:
                outcomes.append(Outcome(c, None, None, str(e)))
                continue
            if po is None:
                outcomes.append(Outcome(c, None, None, "pruned: even without a bubble it is no "
                                                        "better than the best plan found"))
                continue
            outcomes.append(Outcome(c, po.step_time_s, po.memory_bytes))
            if best is None or po.step_time_s < best[0] * (1 - 1e-9):
                best = (po.step_time_s, built, po.solution, c, po)
        else:
            try:
                sol = solve_ilp(built.problem)
            except NoFeasiblePlanError:
                outcomes.append(Outcome(c, None, None, "does not fit in memory"))
                infeasible.append(built)
                continue
            ev = evaluate(built.problem, sol.choice)
            outcomes.append(Outcome(c, ev.step_time_s, ev.memory_bytes))
            if best is None or ev.step_time_s < best[0] * (1 - 1e-9):
                best = (ev.step_time_s, built, sol, c, None)
        if time_limit_s is not None and time.perf_counter() - t0 > time_limit_s:
            break
    if best is None:
        raise NoFeasiblePlanError(_no_fit_message(infeasible, memory_budget, outcomes))
    res = SearchResult(best[1], best[2], outcomes, time.perf_counter() - t0, best[3], best[4])
    res.solution.stats["candidates"] = len(outcomes)
    res.solution.stats["search_s"] = res.time_s
    return res


def _mesh_key(c: Candidate) -> tuple:
    """What a candidate's intra-op problem depends on (pipelined or not)."""
    return (c.dp, c.tp, c.microbatch_size, c.num_microbatches, c.zero)


def lower_bounds(built: Built) -> tuple[float, float]:
    """(seconds per micro-batch, static bytes per device) that no choice of strategies
    can beat: each node's cheapest strategy on its own, ignoring resharding.

    Pipelined over pp ranks, the busiest rank needs at least 1/pp of both."""
    t = mem = 0.0
    for node, details in zip(built.problem.nodes, built.strategies):
        t += node.multiplicity * min(s.compute_s + s.comm_s + s.micro_param_comm_s
                                     for s in node.strategies)
        mem += node.multiplicity * min(
            sc.memory_bytes - ns.memory.get("activations", 0.0)
            for sc, ns in zip(node.strategies, details))
    return t, mem


def _time_bound(c: Candidate, bounds: dict[tuple, tuple[float, float]]) -> float:
    """A lower bound on a candidate's step time: every micro-batch's cheapest
    compute, spread perfectly over the pipeline's ranks."""
    b = bounds.get(_mesh_key(c))
    return float("inf") if b is None else c.num_microbatches * b[0] / c.pp


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
