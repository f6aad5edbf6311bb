"""The stage split (Alpa's inter-operator pass): a model's units cut into pipeline stages.

:func:`split_stages` cuts the units into ``S = pp · v`` contiguous, non-empty stages
whose ranks fit the memory budget, with the least objective F: the simulated step
plus what follows a rank's last backward (:func:`after_backward`: the dp gradient
synchronization it cannot hide, then its optimizer step), or the busiest rank's host
seconds when longer. It seeds the search with the split of least closed-form T and
improves it by simulation (:mod:`autopar.solvers.stage_split_search`);
:func:`stage_in_flight` gives the micro-batches each stage holds at once.

F, the per-rank memory bound M_r, the closed form T with its bubble terms g_s, and
the two steps of the search are written out in docs/solvers.md, section
``autopar.solvers.stage_split``.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field, replace

from autopar.errors import ConfigError, NoFeasiblePlanError
from autopar.units_text import fmt_bytes
from autopar.solvers.cost_terms import PieceCost
from autopar.solvers.schedule_sim import ZERO_BUBBLE, ScheduleEstimate, Timeline
from autopar.solvers.stage_split_problem import SplitProblem, bubble_g, objective, split_problem
from autopar.solvers.stage_split_search import can_beat, feasible_split, improve_split, min_g_split

_REL = 1e-12


@dataclass
class StageSplit:
    """A split of the units into pipeline stages.

    Attributes:
        bounds: ``[start, end)`` unit indices per stage, in pipeline order.
        estimate: :func:`simulate`'s prediction for the split.
        objective_s: the split's ``F`` of docs/solvers.md: the simulated step time
            plus ``exposed_s``, or ``host_s`` when that is longer.
        stats: method, seconds spent, splits simulated, whether the answer is exact, ...
        exposed_s: the dp gradient synchronization no rank hides,
            ``max_r max(0, comm_r − overlap · bwd_r)``.
        formula_s: the split's closed-form ``T`` (docs/solvers.md).
        timeline: the schedule as compiled for the search (for the next split with the
            same schedule, pp, m and v), or None when it was not needed.
        host_s: the busiest rank's host seconds per step, ``max_r host_r``.
    """

    bounds: list[tuple[int, int]]
    estimate: ScheduleEstimate
    objective_s: float
    stats: dict = field(default_factory=dict)
    exposed_s: float = 0.0
    formula_s: float = 0.0
    timeline: Timeline | None = None
    host_s: float = 0.0


def _finish(prob: SplitProblem, bounds: list[tuple[int, int]], stats: dict) -> StageSplit:
    """Attach the simulated estimate, the exposed synchronization and F to a chosen split."""
    chunks = []
    for i, j in bounds:
        chunks.append(PieceCost(
            forward_s=prob.pre.forward[j] - prob.pre.forward[i],
            backward_s=prob.pre.backward[j] - prob.pre.backward[i],
            backward_weight_s=prob.pre.weight[j] - prob.pre.weight[i],
            activation_bytes=prob.pre.act[j] - prob.pre.act[i],
            static_bytes=prob.pre.static[j] - prob.pre.static[i]))
    est = prob.timeline.estimate(chunks, prob.p2p_s, prob.makespans.get(tuple(bounds)))
    exposed, host = prob.exposed(bounds), prob.host(bounds)
    return StageSplit(bounds, est, max(est.step_time_s + exposed, host), stats, exposed,
                      prob.formula(bounds), prob.timeline, host)


def _no_fit(prob: SplitProblem) -> NoFeasiblePlanError:
    """The error for a budget nothing fits, naming the least memory any split needs."""
    need = _least_memory(prob)
    note = " (search truncated: an upper estimate)" if prob.truncated else ""
    return NoFeasiblePlanError(
        f"no split of {prob.n} units into {prob.stages} pipeline stages ({prob.schedule}, pp="
        f"{prob.pp}, {prob.m} micro-batches) fits {fmt_bytes(prob.budget)} per device; the best split "
        f"needs {fmt_bytes(need)} on its fullest rank ({need:.0f} bytes){note}. Use more "
        f"pipeline stages, fewer micro-batches in flight, recomputation or more devices")


def _least_memory(prob: SplitProblem) -> float:
    """min over splits of max_r M_r, to a relative 1e-9 (bisection on the budget with
    the exact feasibility search)."""
    lo, hi = 0.0, prob.pre.static[-1] + max(prob.k) * prob.pre.act[-1]
    inf_t = float("inf")
    for _ in range(60):
        mid = (lo + hi) / 2
        if feasible_split(prob, inf_t, mid) is None:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-9 * max(1.0, hi):
            break
    found = feasible_split(prob, inf_t, hi)
    return max(prob.rank_memory(found)) if found else hi


def _g_is_additive(schedule: str, units: list[PieceCost]) -> bool:
    """Σ_s g_s is the same for every split (docs/solvers.md)."""
    return schedule not in ZERO_BUBBLE or all(u.backward_s >= 2 * u.backward_weight_s for u in units)


def split_stages(units: list[PieceCost], pp: int, num_microbatches: int, *, schedule: str = "1f1b",
                 virtual_stages: int = 1, p2p_s: float = 0.0,
                 memory_budget: float = float("inf"), overlap: float = 1.0,
                 bound: float = float("inf"), explain: bool = True,
                 timeline: Timeline | None = None,
                 initial: list[tuple[int, int]] | None = None) -> StageSplit | None:
    """The split of ``units`` into ``pp · virtual_stages`` contiguous stages with the
    least ``F`` (docs/solvers.md) whose ranks all fit ``memory_budget`` bytes: the
    least-``T`` seed improved by simulation. ``overlap``: the share of a rank's backward
    its dp gradient synchronization may hide behind. ``bound``: the caller needs only a
    split with F below it: None when the lower bound shows that none can be
    (:func:`~autopar.solvers.stage_split_search.can_beat`), else the best split seen.
    ``timeline``: the schedule already compiled (:attr:`StageSplit.timeline` of an
    earlier split with the same schedule, pp, m and v). ``initial``: a split to improve
    instead of the least-T seed, when it fits the budget (e.g. a similar plan's).

    Raises:
        ConfigError: the schedule cannot run this combination, or too few units.
        NoFeasiblePlanError: no split fits; with ``explain`` the message names the
            least per-rank memory any split needs (a search of its own: the outer
            search, which only needs to know, turns it off).
    """
    start = time.perf_counter()
    prob = split_problem(units, pp, num_microbatches, schedule, virtual_stages, p2p_s, memory_budget,
                    overlap, timeline)
    if bound < float("inf") and not can_beat(prob, bound):
        return None
    if initial is not None and len(initial) == prob.stages and \
            max(prob.rank_memory(initial)) <= memory_budget * (1 + _REL):
        seed, stats = list(initial), {"seed": "given"}
    else:
        seed, stats = _formula_split(prob, units, explain)
    bounds, found = improve_split(prob, seed, bound)
    stats.update(found, seconds=time.perf_counter() - start)
    result = _finish(prob, bounds, stats)
    even = _balanced_if_it_fits(prob, result)
    if even is not None:
        even.stats = {**stats, "seed": "min t_max, fits at its simulated peak",
                      "seconds": time.perf_counter() - start}
        return even
    return result


def _balanced_if_it_fits(prob: SplitProblem, result: StageSplit) -> StageSplit | None:
    """The split of least t_max without a memory limit, where it simulates faster than
    ``result`` and fits the budget at its simulated peak. The search bounds a rank's
    memory by the sum of its stages' own peaks (additive, so the splits can be
    searched stage by stage); the stages of an interleaved rank peak at different
    times, so that bound can shut out the even split of a deep interleaved pipeline
    (NeMo's GPT-3 175B, pp8 x 6 chunks: 87 GB bounded, 74 GB at its simulated peak).
    Looked at only where the bound binds: ``result`` within 2% of the budget."""
    if prob.v == 1 or max(prob.rank_memory(result.bounds)) < prob.budget * 0.98:
        return None
    found = _min_t_max(replace(prob, budget=float("inf"), makespans={}))
    if found is None:
        return None
    bounds = found[0]
    if bounds == result.bounds or prob.simulated(bounds) >= result.objective_s * (1 - _REL):
        return None
    found = _finish(prob, bounds, {})
    return found if max(found.estimate.peak_memory_bytes) <= prob.budget * (1 + _REL) else None


def _min_t_max(prob: SplitProblem) -> tuple[list[tuple[int, int]], list[float], int, int] | None:
    """The split of least t_max (the longest stage) that fits the budget, by binary
    search over the candidate stage times; with those candidates, the index of its t_max
    among them and the feasibility checks made. None when no split fits."""
    pre, n, budget = prob.pre, prob.n, prob.budget
    cands = sorted({pre.work[j] - pre.work[i] for i in range(n) for j in range(i + 1, n + 1)})
    lo, hi = 0, len(cands) - 1
    best = feasible_split(prob, cands[hi], budget)
    checks = 1
    if best is None:
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        found = feasible_split(prob, cands[mid], budget)
        checks += 1
        if found is None:
            lo = mid + 1
        else:
            hi, best = mid, found
    return best, cands, lo, checks


def _formula_split(prob: SplitProblem, units: list[PieceCost],
                   explain: bool) -> tuple[list[tuple[int, int]], dict]:
    """The split with the least closed-form T (step 1 of docs/solvers.md) and how
    it was found; raises NoFeasiblePlanError when no split fits the budget."""
    pre, budget = prob.pre, prob.budget
    found = _min_t_max(prob)
    if found is None:
        raise _no_fit(prob) if explain else NoFeasiblePlanError(
            f"no split of {prob.n} units into {prob.stages} pipeline stages fits the budget")
    best_bounds, cands, lo, checks = found
    method = "min t_max (binary search)"
    if not _g_is_additive(prob.schedule, units):
        method = "min t_max, then min Σg per t_max"
        g_floor = pre.forward[-1] + max(0.0, (pre.backward[-1] - 2 * pre.weight[-1]))
        best_obj = prob.formula(best_bounds)
        for t in cands[lo:]:
            if objective(t, g_floor, prob.pp, prob.m, prob.v, 0, 0.0) \
                    + 2 * prob.hops * prob.p2p_s >= best_obj - 1e-12 * best_obj:
                break
            checks += 1
            found = min_g_split(prob, t, budget, lambda i, j: bubble_g(prob.schedule, pre, i, j))
            if found is not None and prob.formula(found[1]) < best_obj:
                best_obj, best_bounds = prob.formula(found[1]), found[1]
    return best_bounds, {"seed": method, "candidates": len(cands), "checks": checks,
                         "seed_truncated": prob.truncated}


def split_stages_exhaustive(units: list[PieceCost], pp: int, num_microbatches: int, *,
                            schedule: str = "1f1b", virtual_stages: int = 1, p2p_s: float = 0.0,
                            memory_budget: float = float("inf"), overlap: float = 1.0,
                            max_splits: int = 1_000_000) -> StageSplit:
    """Reference solver for tests: every composition of the units into the stages,
    simulated and scored with the same objective F and memory bound as
    :func:`split_stages` (the first found on ties)."""
    start = time.perf_counter()
    prob = split_problem(units, pp, num_microbatches, schedule, virtual_stages, p2p_s, memory_budget,
                    overlap)
    n, S = prob.n, prob.stages
    best: tuple[float, list[tuple[int, int]]] | None = None
    least_mem = float("inf")
    count = 0
    for cuts in itertools.combinations(range(1, n), S - 1):
        count += 1
        if count > max_splits:
            raise ConfigError(f"more than {max_splits} splits; use split_stages")
        edges = (0, *cuts, n)
        bounds = list(zip(edges, edges[1:]))
        need = max(prob.rank_memory(bounds))
        least_mem = min(least_mem, need)
        if need > memory_budget:
            continue
        obj = prob.simulated(bounds)
        if best is None or obj < best[0]:
            best = (obj, bounds)
    if best is None:
        raise NoFeasiblePlanError(f"no split fits {memory_budget:.0f} bytes per device; the best "
                                  f"split needs {least_mem:.0f} bytes on its fullest rank")
    stats = {"method": "exhaustive", "splits": count, "exact": True,
             "seconds": time.perf_counter() - start}
    return _finish(prob, best[1], stats)
