"""Exhaustive reference solvers, for tests on tiny problems.

* :func:`solve_exhaustive` — every assignment of one strategy per node and one
  recomputation mode per group of an intra-op :class:`~autopar.solvers.problem.Problem`.
* :func:`solve_pipeline_exhaustive` — one pipelined candidate: every intra-op
  assignment, every recomputation mode combination and every split of the units into
  stages, each scored by the schedule's simulator (:func:`score_pipeline`).
* :func:`brute_force_search` — the outer search's whole space, candidate by candidate,
  with no lower bounds, no pruning and no ILP.

They share the planner's objective only, never the way it searches. The pipelined
objective T(s, r, B) and its per-rank memory check are written out in
docs/solvers.md, section ``autopar.solvers.exhaustive``.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field

from autopar.errors import ConfigError, NoFeasiblePlanError
from autopar.graph import Graph
from autopar.solvers.idle_axis import splits_nothing
from autopar.solvers.intra_op_ilp import Solution
from autopar.solvers.search_space import Candidate, candidate_settings, problem_key, tiers
from autopar.solvers.pipelined_candidate import (boundary_p2p, rank_host_time, rank_transients,
                                                 shared_cores_time, tied_sync)
from autopar.solvers.problem import Problem, evaluate
from autopar.solvers.problem_build import Built, build_problem
from autopar.solvers.cost_terms import PieceCost
from autopar.solvers.schedule_sim import simulate, stage_ranks
from autopar.solvers.stage_split_problem import after_backward, stage_in_flight
from autopar.solvers.units import Unit, unit_costs, unit_of_nodes
from autopar.strategies.analysis import GraphAnalysis

_TOL = 1e-12
"""Relative slack on a memory budget, as the stage split allows it."""


def consistent_assignments(problem: Problem) -> Iterator[list[int]]:
    """Every choice of one strategy per node that every edge allows and every tie
    accepts, in lexicographic order (a depth-first walk over the nodes that drops a
    partial choice as soon as an edge or tie between two chosen nodes rejects it: the
    rejected choices are exactly the ones :func:`evaluate` calls infeasible)."""
    n = len(problem.nodes)
    edges_at: list[list] = [[] for _ in range(n)]
    for e in problem.edges:
        edges_at[max(e.u, e.v)].append(e)
    ties_at: list[list] = [[] for _ in range(n)]
    for t in problem.ties:
        ties_at[max(t.a, t.b)].append(t)
    choice = [0] * n

    def group(groups: list[list[int]], i: int) -> int:
        return next((k for k, g in enumerate(groups) if i in g), -1)

    def fits(v: int) -> bool:
        return all((choice[e.u], choice[e.v]) in e.cost for e in edges_at[v]) and all(
            group(t.groups_a, choice[t.a]) == group(t.groups_b, choice[t.b])
            for t in ties_at[v])

    def walk(v: int) -> Iterator[list[int]]:
        if v == n:
            yield list(choice)
            return
        for i in range(len(problem.nodes[v].strategies)):
            choice[v] = i
            if fits(v):
                yield from walk(v + 1)

    yield from walk(0)


def mode_combinations(problem: Problem) -> list[tuple[int, ...]]:
    """Every combination of one allowed recomputation mode per group."""
    return list(itertools.product(*(g.allowed for g in problem.recompute)))


def solve_exhaustive(problem: Problem, max_assignments: int = 2_000_000) -> Solution:
    """Evaluate every combination of one strategy per node (and one recomputation mode
    per group) and return the cheapest feasible one (ties broken by the first found in
    lexicographic order). Only the choices that edges and ties allow are visited
    (:func:`consistent_assignments`); raises ConfigError past ``max_assignments`` of
    them times the mode combinations."""
    mode_sets = mode_combinations(problem)
    best: tuple[float, list[int], list[int]] | None = None
    total = 0
    for combo in consistent_assignments(problem):
        total += len(mode_sets)
        if total > max_assignments:
            raise ConfigError(f"exhaustive search over more than {max_assignments} "
                              f"assignments; use the ILP for problems this size")
        for modes in mode_sets:
            ev = evaluate(problem, combo, list(modes))
            if ev.feasible and (best is None or ev.step_time_s < best[0] - 1e-15):
                best = (ev.step_time_s, combo, list(modes))
    if best is None:
        raise NoFeasiblePlanError("no assignment satisfies the edges, ties and memory budget")
    return Solution(best[1], best[0], "Optimal", {"solver": "exhaustive", "assignments": total},
                    best[2])


@dataclass
class PipelineScore:
    """One pipelined plan (assignment, modes, split) as docs/solvers.md scores it."""

    step_time_s: float
    memory_bytes: float
    feasible: bool
    bounds: list[tuple[int, int]]
    choice: list[int] = field(default_factory=list)
    modes: list[int] = field(default_factory=list)


@dataclass
class _Assigned:
    """What every split of one (assignment, modes) shares: units, p2p time, transients."""

    units: list[Unit]
    p2p_s: float
    extra: list[float]


def _assigned(g: Graph, built: Built, choice: list[int], modes: list[int], *, pp: int,
              schedule: str, virtual_stages: int) -> _Assigned:
    """Units, stage-to-stage transfer time and per-rank transients of one assignment."""
    return _Assigned(unit_costs(g, built, choice, modes, tied_sync(built, pp)),
                     boundary_p2p(g, built, choice, pp),
                     rank_transients(g, built, choice, modes, pp=pp, schedule=schedule,
                                     virtual_stages=virtual_stages))


@dataclass(frozen=True)
class _Layout:
    """What the schedule fixes for every split: micro-batches, stages' ranks and
    in-flight counts, and the dp overlap and memory budget."""

    pp: int
    m: int
    schedule: str
    virtual_stages: int
    overlap: float
    budget: float
    ranks: tuple[int, ...]
    k: tuple[int, ...]
    shared: float = 1.0

    @classmethod
    def of(cls, built: Built, pp: int, schedule: str, virtual_stages: int) -> "_Layout":
        """The layout of ``built``'s candidate pipelined over ``pp`` ranks."""
        st = built.settings
        m = st.num_microbatches
        return cls(pp, m, schedule, virtual_stages, st.overlap, st.memory_budget,
                   tuple(stage_ranks(schedule, pp, virtual_stages)),
                   tuple(stage_in_flight(schedule, pp, m, virtual_stages)),
                   st.hw.oversubscription)


def _score(a: _Assigned, bounds: list[tuple[int, int]], lay: _Layout, *,
           skip_infeasible: bool = True) -> PipelineScore:
    """T(s, r, B), its feasibility and its memory (docs/solvers.md); with
    ``skip_infeasible`` a split that does not fit is not simulated (time: infinite)."""
    chunks, held = [], [0.0] * lay.pp
    comm, bwd, opt = [0.0] * lay.pp, [0.0] * lay.pp, [0.0] * lay.pp
    for s, (i, j) in enumerate(bounds):
        part = a.units[i:j]
        chunk = PieceCost.total(part)
        chunks.append(chunk)
        r = lay.ranks[s]
        held[r] += chunk.static_bytes + lay.k[s] * chunk.activation_bytes
        comm[r] += chunk.step_comm_s
        opt[r] += chunk.optimizer_s
        bwd[r] += chunk.backward_s
    room = lay.budget - max(a.extra)
    feasible = max(held) <= room + _TOL * max(1.0, abs(room))
    if not feasible and skip_infeasible:
        return PipelineScore(float("inf"), max(held) + max(a.extra), False, list(bounds))
    est = simulate(lay.schedule, chunks, lay.pp, lay.m, virtual_stages=lay.virtual_stages,
                   p2p_s=a.p2p_s)
    exposed = after_backward(comm, bwd, opt, lay.overlap)
    memory = max(p + e for p, e in zip(est.peak_memory_bytes, a.extra))
    step = shared_cores_time(est.step_time_s + exposed, est.busy_s, exposed, lay.shared)
    host = rank_host_time(a.units, bounds, list(lay.ranks), lay.pp, lay.m)
    return PipelineScore(max(step, host), memory, feasible, list(bounds))


def stage_splits(n: int, stages: int) -> Iterator[list[tuple[int, int]]]:
    """Every split of ``n`` units into ``stages`` contiguous non-empty stages, as
    ``[start, end)`` bounds, in lexicographic order of the cuts."""
    for cuts in itertools.combinations(range(1, n), stages - 1):
        edges = (0, *cuts, n)
        yield list(zip(edges, edges[1:]))


def score_pipeline(g: Graph, built: Built, choice: list[int], modes: list[int],
                   bounds: list[tuple[int, int]], *, pp: int, schedule: str,
                   virtual_stages: int) -> PipelineScore:
    """Score one pipelined plan: assignment ``choice``, recomputation ``modes`` and
    stage ``bounds`` (docs/solvers.md), e.g. to re-score a plan the planner chose."""
    a = _assigned(g, built, choice, modes, pp=pp, schedule=schedule,
                  virtual_stages=virtual_stages)
    out = _score(a, bounds, _Layout.of(built, pp, schedule, virtual_stages),
                 skip_infeasible=False)
    out.choice, out.modes = list(choice), list(modes)
    return out


def solve_pipeline_exhaustive(g: Graph, built: Built, *, pp: int, schedule: str,
                              virtual_stages: int,
                              max_plans: int = 2_000_000) -> PipelineScore:
    """The fastest feasible pipelined plan of one candidate over every consistent
    assignment, every mode combination and every stage split (first found on ties);
    raises NoFeasiblePlanError when none fits, ConfigError past ``max_plans`` plans."""
    lay = _Layout.of(built, pp, schedule, virtual_stages)
    n_units = len(unit_of_nodes(g)[0])
    splits = list(stage_splits(n_units, pp * virtual_stages))
    if not splits:
        raise NoFeasiblePlanError(f"{n_units} units cannot fill {pp * virtual_stages} stages")
    mode_sets = mode_combinations(built.problem)
    best: PipelineScore | None = None
    count = 0
    for choice in consistent_assignments(built.problem):
        for modes in mode_sets:
            count += len(splits)
            if count > max_plans:
                raise ConfigError(f"more than {max_plans} pipelined plans; too large for "
                                  f"the exhaustive reference")
            a = _assigned(g, built, choice, list(modes), pp=pp, schedule=schedule,
                          virtual_stages=virtual_stages)
            for bounds in splits:
                sc = _score(a, bounds, lay)
                if sc.feasible and (best is None or sc.step_time_s < best.step_time_s):
                    sc.choice, sc.modes = list(choice), list(modes)
                    best = sc
    if best is None:
        raise NoFeasiblePlanError("no assignment, recomputation and stage split fits")
    return best


@dataclass
class BruteForceResult:
    """The best candidate of :func:`brute_force_search` and every candidate's best time.

    Attributes:
        candidate: the fastest feasible candidate (the first in the given order on ties).
        step_time_s: its step time.
        choice: its strategy index per node of its built problem.
        modes: its recomputation mode per group.
        bounds: its stage split (None without a pipeline).
        memory_bytes: its memory per device.
        built: its built problem.
        times: per candidate, its best step time (None: nothing fits).
    """

    candidate: Candidate
    step_time_s: float
    choice: list[int]
    modes: list[int]
    bounds: list[tuple[int, int]] | None
    memory_bytes: float
    built: Built
    times: dict[Candidate, float | None] = field(default_factory=dict)


def _best_of(an: GraphAnalysis, cands: list[Candidate], **kw) -> BruteForceResult | None:
    """Every candidate of ``cands`` solved exhaustively; the fastest whose layout splits
    something over tp (:mod:`autopar.solvers.idle_axis`), else the fastest; None when
    none fits."""
    best: BruteForceResult | None = None
    best_idle = False
    times: dict[Candidate, float | None] = {}
    built_by: dict[tuple, Built | NoFeasiblePlanError] = {}
    for c in cands:
        key = problem_key(c)
        if key not in built_by:  # one intra-op problem for every pipeline shape
            try:
                built_by[key] = build_problem(an, candidate_settings(c, **kw))
            except NoFeasiblePlanError as e:
                built_by[key] = e
        built = built_by[key]
        try:
            if isinstance(built, NoFeasiblePlanError):
                raise built
            if c.pp > 1:
                sc = solve_pipeline_exhaustive(an.graph, built, pp=c.pp, schedule=c.schedule,
                                               virtual_stages=c.virtual_stages)
                found = (sc.step_time_s, sc.choice, sc.modes, sc.bounds, sc.memory_bytes)
            else:
                sol = solve_exhaustive(built.problem)
                ev = evaluate(built.problem, sol.choice, sol.modes)
                found = (ev.step_time_s, sol.choice, sol.modes, None, ev.memory_bytes)
        except NoFeasiblePlanError:
            times[c] = None
            continue
        times[c] = found[0]
        idle = splits_nothing(built, found[1])
        if best is None or (idle, found[0]) < (best_idle, best.step_time_s):
            best, best_idle = BruteForceResult(c, *found, built=built), idle
    if best is not None:
        best.times = times
    return best


def brute_force_search(an: GraphAnalysis, cands: list[Candidate], *, hw, gpus_per_node: int,
                       precision: str, optimizer: str, memory_budget: float,
                       sequence_parallel: bool | None = None,
                       loss_parallel: bool | None = None,
                       recompute: tuple[str, ...] | None = None,
                       offload: bool | None = None) -> BruteForceResult:
    """The fastest feasible plan over the whole space of ``cands``, as
    :func:`autopar.solvers.outer_search.search` defines it, by enumeration: every candidate's
    problem is built and solved by :func:`solve_exhaustive` (no pipeline) or
    :func:`solve_pipeline_exhaustive` (pipeline), one list of
    :func:`~autopar.solvers.search_space.tiers` after another, as the search tries them.

    Raises NoFeasiblePlanError when no candidate fits."""
    kw = dict(hw=hw, gpus_per_node=gpus_per_node, precision=precision, optimizer=optimizer,
              memory_budget=memory_budget, sequence_parallel=sequence_parallel,
              loss_parallel=loss_parallel,
              recompute=recompute)
    best = None
    for tier in tiers(cands, gpus_per_node, offload):
        best = _best_of(an, tier, **kw)
        if best is not None:
            break
    if best is None:
        raise NoFeasiblePlanError("no candidate fits the memory budget")
    return best
