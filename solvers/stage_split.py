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
from autopar.solvers.schedule_sim import (ZERO_BUBBLE, Op, ScheduleEstimate, Timeline,
                                          rank_orders, stage_ranks, validate)
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


def after_backward(comm: list[float], bwd: list[float], opt: list[float],
                   overlap: float) -> float:
    """Seconds of a step after the last backward of the slowest rank r:
    max_r (max(0, comm_r − overlap · bwd_r) + opt_r), the gradient synchronization its
    backward did not hide, then its optimizer step (docs/solvers.md)."""
    return max(max(0.0, c - overlap * w) + o for c, w, o in zip(comm, bwd, opt))


@dataclass
class _Prefix:
    """Prefix sums of the unit costs; ``x[j] − x[i]`` is the sum over units i..j−1."""

    c: list[float]
    f: list[float]
    b: list[float]
    w: list[float]
    static: list[float]
    act: list[float]
    comm: list[float]
    opt: list[float]
    host: list[float]

    @classmethod
    def of(cls, units: list[PieceCost], m: int) -> "_Prefix":
        """Build the prefix sums (host: seconds per step of ``m`` micro-batches)."""
        acc = [[0.0] for _ in range(9)]
        for u in units:
            vals = (u.forward_s + u.backward_s, u.forward_s, u.backward_s, u.backward_weight_s,
                    u.static_bytes, u.activation_bytes, u.step_comm_s, u.optimizer_s,
                    u.host_per_step(m))
            for a, x in zip(acc, vals):
                a.append(a[-1] + x)
        return cls(*acc)


def stage_in_flight(schedule: str, pp: int, num_microbatches: int, virtual_stages: int = 1) -> list[int]:
    """k_s: the most micro-batch activations stage s holds at once in the schedule's
    op order (held from F to B, or to W on zero-bubble schedules)."""
    return _in_flight(schedule, rank_orders(schedule, pp, num_microbatches, virtual_stages),
                      pp * virtual_stages)


def _in_flight(schedule: str, orders: list[list[Op]], n: int) -> list[int]:
    """:func:`stage_in_flight` of the ranks' ``orders`` over ``n`` stages."""
    release = "W" if schedule in ZERO_BUBBLE else "B"
    most, now = [0] * n, [0] * n
    for order in orders:
        for kind, s, _ in order:
            if kind == "F":
                now[s] += 1
                most[s] = max(most[s], now[s])
            elif kind == release:
                now[s] -= 1
    return most


def cross_rank_hops(ranks: list[int]) -> int:
    """H: adjacent stage pairs on different ranks along the pipeline (``ranks``: each
    stage's rank)."""
    return sum(1 for a, b in zip(ranks, ranks[1:]) if a != b)


def _bubble_g(schedule: str, pre: _Prefix, i: int, j: int) -> float:
    """g of a stage over units [i, j) (docs/solvers.md)."""
    if schedule in ZERO_BUBBLE:
        return (pre.f[j] - pre.f[i]) + max(0.0, (pre.b[j] - pre.b[i]) - 2 * (pre.w[j] - pre.w[i]))
    return pre.c[j] - pre.c[i]


def _objective(t_max: float, g_sum: float, pp: int, m: int, v: int, hops: int, p2p_s: float) -> float:
    """T = m·v·t_max + (p−1)/(p·v)·Σg + 2·H·p2p_s."""
    return m * v * t_max + (pp - 1) / (pp * v) * g_sum + 2 * hops * p2p_s


@dataclass
class _Problem:
    """Everything both solvers read, computed once per call."""

    schedule: str
    pre: _Prefix
    n: int
    pp: int
    m: int
    v: int
    p2p_s: float
    budget: float
    k: list[int]
    ranks: list[int]
    hops: int
    orders: list[list[Op]]
    overlap: float = 1.0
    truncated: bool = False
    makespans: dict = field(default_factory=dict)
    compiled: list[Timeline] = field(default_factory=list)

    @property
    def timeline(self) -> Timeline:
        """The schedule compiled for simulation (on first use: a split that does not fit
        is found without it)."""
        if not self.compiled:
            self.compiled.append(Timeline.of(self.schedule, self.pp, self.m, self.v, self.orders))
        return self.compiled[0]

    @property
    def stages(self) -> int:
        """S = pp · v."""
        return self.pp * self.v

    def stage_memory(self, s: int, i: int, j: int) -> float:
        """static + k_s · activations of stage s over units [i, j)."""
        return (self.pre.static[j] - self.pre.static[i]) + self.k[s] * (self.pre.act[j] - self.pre.act[i])

    def rank_memory(self, bounds: list[tuple[int, int]]) -> list[float]:
        """M_r for every rank."""
        mem = [0.0] * self.pp
        for s, (i, j) in enumerate(bounds):
            mem[self.ranks[s]] += self.stage_memory(s, i, j)
        return mem

    def exposed(self, bounds: list[tuple[int, int]]) -> float:
        """max_r (max(0, comm_r − overlap · bwd_r) + opt_r) (docs/solvers.md)."""
        pre = self.pre
        return after_backward(self.per_rank(pre.comm, bounds), self.per_rank(pre.b, bounds),
                              self.per_rank(pre.opt, bounds), self.overlap)

    def host(self, bounds: list[tuple[int, int]]) -> float:
        """max_r host_r: the busiest rank's host seconds per step (docs/solvers.md)."""
        return max(self.per_rank(self.pre.host, bounds))

    def per_rank(self, prefix: list[float], bounds: list[tuple[int, int]]) -> list[float]:
        """Each rank's sum of one unit cost (``prefix``: its prefix sums) over its stages."""
        out = [0.0] * self.pp
        for s, (i, j) in enumerate(bounds):
            out[self.ranks[s]] += prefix[j] - prefix[i]
        return out

    def durations(self, bounds: list[tuple[int, int]]) -> list[float]:
        """Every stage's F, B, I and W seconds, as :meth:`Timeline.durations` lays them out."""
        pre, out = self.pre, []
        for i, j in bounds:
            b, w = pre.b[j] - pre.b[i], pre.w[j] - pre.w[i]
            out += [pre.f[j] - pre.f[i], b, b - w, w]
        return out

    def simulated(self, bounds: list[tuple[int, int]]) -> float:
        """F(split): the simulated step time (kept in ``makespans`` by split) plus the
        exposed dp synchronization, or the busiest rank's host time when longer."""
        step = self.timeline.makespan(self.durations(bounds), self.p2p_s)
        self.makespans[tuple(bounds)] = step
        return max(step + self.exposed(bounds), self.host(bounds))

    def formula(self, bounds: list[tuple[int, int]]) -> float:
        """T(split), the closed form of docs/solvers.md (step 1)."""
        t_max = max(self.pre.c[j] - self.pre.c[i] for i, j in bounds)
        g_sum = sum(_bubble_g(self.schedule, self.pre, i, j) for i, j in bounds)
        return _objective(t_max, g_sum, self.pp, self.m, self.v, self.hops, self.p2p_s)


def _problem(units: list[PieceCost], pp: int, m: int, schedule: str, v: int, p2p_s: float,
             budget: float, overlap: float = 1.0, timeline: Timeline | None = None) -> _Problem:
    """Validate the arguments and precompute the problem (``timeline``: the schedule
    compiled already)."""
    reason = validate(schedule, pp, m, v)
    if reason:
        raise ConfigError(reason)
    if len(units) < pp * v:
        raise ConfigError(f"{len(units)} units cannot fill pp={pp} x virtual_stages={v} = "
                          f"{pp * v} stages; lower pp or virtual_stages")
    orders = timeline.orders if timeline is not None else rank_orders(schedule, pp, m, v)
    ranks = stage_ranks(schedule, pp, v)
    prob = _Problem(schedule, _Prefix.of(units, m), len(units), pp, m, v, p2p_s, budget,
                    _in_flight(schedule, orders, pp * v), ranks, cross_rank_hops(ranks), orders,
                    overlap)
    if timeline is not None:
        prob.compiled.append(timeline)
    return prob


def _finish(prob: _Problem, bounds: list[tuple[int, int]], stats: dict) -> StageSplit:
    """Attach the simulated estimate, the exposed synchronization and F to a chosen split."""
    chunks = []
    for i, j in bounds:
        chunks.append(PieceCost(
            forward_s=prob.pre.f[j] - prob.pre.f[i], backward_s=prob.pre.b[j] - prob.pre.b[i],
            backward_weight_s=prob.pre.w[j] - prob.pre.w[i],
            activation_bytes=prob.pre.act[j] - prob.pre.act[i],
            static_bytes=prob.pre.static[j] - prob.pre.static[i]))
    est = prob.timeline.estimate(chunks, prob.p2p_s, prob.makespans.get(tuple(bounds)))
    exposed, host = prob.exposed(bounds), prob.host(bounds)
    return StageSplit(bounds, est, max(est.step_time_s + exposed, host), stats, exposed,
                      prob.formula(bounds), prob.timeline, host)


def _no_fit(prob: _Problem) -> NoFeasiblePlanError:
    """The error for a budget nothing fits, naming the least memory any split needs."""
    need = _least_memory(prob)
    note = " (search truncated: an upper estimate)" if prob.truncated else ""
    return NoFeasiblePlanError(
        f"no split of {prob.n} units into {prob.stages} pipeline stages ({prob.schedule}, pp="
        f"{prob.pp}, {prob.m} micro-batches) fits {fmt_bytes(prob.budget)} per device; the best split "
        f"needs {fmt_bytes(need)} on its fullest rank ({need:.0f} bytes){note}. Use more "
        f"pipeline stages, fewer micro-batches in flight, recomputation or more devices")


def _least_memory(prob: _Problem) -> float:
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
    prob = _problem(units, pp, num_microbatches, schedule, virtual_stages, p2p_s, memory_budget,
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


def _balanced_if_it_fits(prob: _Problem, result: StageSplit) -> StageSplit | None:
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


def _min_t_max(prob: _Problem) -> tuple[list[tuple[int, int]], list[float], int, int] | None:
    """The split of least t_max (the longest stage) that fits the budget, by binary
    search over the candidate stage times; with those candidates, the index of its t_max
    among them and the feasibility checks made. None when no split fits."""
    pre, n, budget = prob.pre, prob.n, prob.budget
    cands = sorted({pre.c[j] - pre.c[i] for i in range(n) for j in range(i + 1, n + 1)})
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


def _formula_split(prob: _Problem, units: list[PieceCost],
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
        g_floor = pre.f[-1] + max(0.0, (pre.b[-1] - 2 * pre.w[-1]))
        best_obj = prob.formula(best_bounds)
        for t in cands[lo:]:
            if _objective(t, g_floor, prob.pp, prob.m, prob.v, 0, 0.0) \
                    + 2 * prob.hops * prob.p2p_s >= best_obj - 1e-12 * best_obj:
                break
            checks += 1
            found = min_g_split(prob, t, budget, lambda i, j: _bubble_g(prob.schedule, pre, i, j))
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
    prob = _problem(units, pp, num_microbatches, schedule, virtual_stages, p2p_s, memory_budget,
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
