"""Cheap lower bounds on a candidate's step time and memory, for pruning the outer
search before any ILP is built.

:func:`combo_bounds` bounds every combination of recomputation modes (one per group)
of a :class:`~autopar.solvers.problem.Problem` in one pass, and :func:`step_bound` a
step of n micro-batches from them; :func:`knapsack_bound` bounds the time within a
memory capacity, :func:`tree_bound` with the resharding on edges, and
:func:`pipeline_stage_bound` and :func:`rank_load_bound` a pipeline's step whatever
its stage split.

The per-micro-batch bound T_lb, the per-step S_lb and the memory bound M_lb (also on
a pipeline rank) are derived in docs/solvers.md, section ``autopar.solvers.bounds``.
"""

from __future__ import annotations

import itertools
import math
import operator
from dataclasses import dataclass

from autopar.solvers.problem import Problem


@dataclass(frozen=True)
class ComboBound:
    """Lower bounds for one combination of recomputation modes (indices per group)."""

    modes: tuple[int, ...]
    time_per_microbatch_s: float
    param_time_per_microbatch_s: float
    memory_bytes: float
    host_time_per_microbatch_s: float = 0.0
    optimizer_s: float = 0.0
    exposed_step_s: float = 0.0

    @property
    def time_s(self) -> float:
        """The per-micro-batch time bound: the largest of the three sums."""
        return max(self.time_per_microbatch_s, self.param_time_per_microbatch_s,
                   self.host_time_per_microbatch_s)


def combo_bounds(p: Problem, activations: list[list[float]] | None = None, pp: int = 1,
                 held: int = 1, tree: bool = True) -> list[ComboBound]:
    """The bounds of every allowed combination of modes (docs/solvers.md), in
    ``itertools.product`` order. ``activations[v][i]`` are the bytes strategy i of
    node v keeps for backward (needed only with ``pp`` > 1)."""
    grouped: dict[int, tuple[int, int]] = {}
    for g, grp in enumerate(p.recompute):
        for k, v in enumerate(grp.nodes):
            grouped[v] = (g, k)
    scale = held / pp

    def mem(v: int, i: int) -> float:
        node = p.nodes[v]
        s = node.strategies[i].total
        if pp == 1:
            own = s.memory_bytes
        else:
            act = activations[v][i] if activations is not None else 0.0
            own = (s.memory_bytes - act + act * held) / pp
        return node.multiplicity * own + node.gather_multiplicity * s.gather_bytes

    base = _Sums()
    per_group = [{r: _Sums() for r in grp.allowed} for grp in p.recompute]
    param_time = host_time = optimizer = step_comm = bwd = 0.0
    bwd_by_mode = [{r: 0.0 for r in grp.allowed} for grp in p.recompute]
    for v, node in enumerate(p.nodes):
        m = node.multiplicity
        ss = [c.total for c in node.strategies]
        param_time += m * min(s.micro_param_comm_s + s.comm_s for s in ss)
        host_time += m * min(s.all_host_s for s in ss)
        optimizer += m * min(s.optimizer_s for s in ss)
        step_comm += m * min(s.step_param_comm_s for s in ss)
        mems = [mem(v, i) for i in range(len(ss))]
        starts = [m * s.backward_start_bytes for s in ss]
        if v not in grouped:
            bwd += m * max(s.device_bwd_s for s in ss)
            base.add([m * (s.device_s + s.comm_s) for s in ss], mems, starts,
                     [s.recompute_bytes for s in ss])
            continue
        g, k = grouped[v]
        grp = p.recompute[g]
        f = scale if pp > 1 else 1.0
        # the terms every mode shares, then each mode's
        times = [s.device_s + s.comm_s for s in ss]
        bwds = [s.device_bwd_s for s in ss]
        redos = [s.recompute_bytes for s in ss]
        extra, transient = grp.extra_s[k], grp.transient[k]
        for r in grp.allowed:
            bwd_by_mode[g][r] += m * max(b + e[r] for b, e in zip(bwds, extra))
            per_group[g][r].add(
                [m * (t + e[r]) for t, e in zip(times, extra)],
                [x + grp.memory(k, i, r, m) * f for i, x in enumerate(mems)],
                starts,
                [x + tr[r] for x, tr in zip(redos, transient)])
    out = []
    for modes in itertools.product(*(grp.allowed for grp in p.recompute)):
        parts = [base] + [per_group[g][r] for g, r in enumerate(modes)]
        start = sum(x.start for x in parts)
        redo = sum(x.redo for x in parts)
        least = p.fixed_memory + max(sum(x.least_start for x in parts),
                                     sum(x.least_redo for x in parts))
        capacity = p.memory_budget - p.fixed_memory - max(start, redo)
        t = knapsack_bound([seg for x in parts for seg in x.segments],
                           sum(x.fast_time for x in parts), sum(x.fast_memory for x in parts),
                           capacity)
        if t < float("inf") and tree:
            t = max(t, tree_bound(p, mode_extra(p, modes)))
        most_bwd = bwd + sum(bwd_by_mode[g][r] for g, r in enumerate(modes))
        out.append(ComboBound(modes, t, param_time, least, host_time, optimizer,
                              max(0.0, step_comm - p.overlap * most_bwd)))
    return out


class _Sums:
    """Per-node terms of :func:`combo_bounds` summed over a set of nodes: the fastest
    strategies' time and memory, the exchanges that trade time for memory, and the
    least transient and total memory."""

    def __init__(self) -> None:
        self.fast_time = self.fast_memory = 0.0
        self.start = self.redo = 0.0            # least transient terms, each on its own
        self.least_start = self.least_redo = 0.0  # least memory with each transient
        self.segments: list[tuple[float, float]] = []

    def add(self, times: list[float], mems: list[float], starts: list[float],
            redos: list[float]) -> None:
        """One node with strategies of these times, memories and transients."""
        self.start += min(starts)
        self.redo += min(redos)
        self.least_start += min(map(operator.add, mems, starts))
        self.least_redo += min(map(operator.add, mems, redos))
        t0, m0, segs = hull_exchanges(list(zip(mems, times)))
        self.fast_time += t0
        self.fast_memory += m0
        self.segments += segs


def hull_exchanges(points: list[tuple[float, float]]) -> tuple[float, float,
                                                               list[tuple[float, float]]]:
    """(time, memory) of the fastest point (the least memory among ties) of one node's
    (memory, time) points, and the exchanges along their lower convex hull towards less
    memory: (seconds added per byte saved, bytes saved), slopes ascending."""
    pts = sorted(set(points))
    hull: list[tuple[float, float]] = []
    for q in pts:  # lower hull by memory ascending (Andrew's monotone chain)
        while len(hull) >= 2 and _cross(hull[-2], hull[-1], q) <= 0:
            hull.pop()
        hull.append(q)
    fast = min(range(len(hull)), key=lambda i: (hull[i][1], hull[i][0]))
    segs = []
    for a in range(fast, 0, -1):  # from the fastest point towards less memory
        (m1, t1), (m0, t0) = hull[a], hull[a - 1]
        if t0 > t1 and m1 > m0:
            segs.append(((t0 - t1) / (m1 - m0), m1 - m0))
    return hull[fast][1], hull[fast][0], segs


def _cross(o: tuple[float, float], a: tuple[float, float], b: tuple[float, float]) -> float:
    return (a[0] - o[0]) * (b[1] - o[1]) - (a[1] - o[1]) * (b[0] - o[0])


def knapsack_bound(segments: list[tuple[float, float]], fast_time: float, fast_memory: float,
                   capacity: float) -> float:
    """The linear relaxation of choosing one strategy per node at least time within
    ``capacity`` bytes (Sinha and Zoltners, Oper. Res. 1979): start from every node's
    fastest strategy and buy the missing memory at the cheapest exchange rates along
    the nodes' hulls, the last one fractionally. inf when even every exchange does not
    free enough."""
    need = fast_memory - capacity
    if need <= 0:
        return fast_time
    t = fast_time
    for slope, saved in sorted(segments):
        take = min(saved, need)
        t += slope * take
        need -= take
        if need <= 0:
            return t
    return float("inf")


def step_bound(bounds: list[ComboBound], budget: float, n: int, pp: int = 1) -> float:
    """The least bound on a step of ``n`` micro-batches over the combinations whose
    memory bound fits ``budget`` (inf when none does).

    Without a pipeline: max(n·max(compute, parameter sums) + S_lb, n·host)
    (docs/solvers.md). On ``pp`` ranks each rank runs its stages' n micro-batches one
    operation at a time, so the schedule takes at least the mean rank's share, and
    then each rank steps its optimizer: max((n·max(compute, parameter sums) +
    Σ optimizer) / pp, n·host / pp). (The gradient traffic of a pipeline rank hides
    behind its own stages' backward, which this bound does not know, so it is left
    out there.)"""
    def one(b: ComboBound) -> float:
        dev = n * max(b.time_per_microbatch_s, b.param_time_per_microbatch_s)
        host = n * b.host_time_per_microbatch_s
        if pp == 1:
            return max(dev + b.optimizer_s + b.exposed_step_s, host)
        return max(dev + b.optimizer_s, host) / pp

    return min((one(b) for b in bounds if b.memory_bytes <= budget * (1 + 1e-9)),
               default=float("inf"))


def tree_bound(p: Problem, extra: list[list[float]] | None = None) -> float:
    """Σ_v m_v (compute + comm + extra) plus the resharding of a spanning forest of the
    edges, minimized exactly: per micro-batch, a lower bound on the objective's
    compute, communication and resharding terms.

    Each node keeps the first edge from a lower-numbered producer as its parent (nodes
    are numbered in graph order, so the parents form a forest); the other edges, the
    ties and the memory budget are dropped, which only lowers the optimum. On the
    forest, best_v(i) = m_v c_v,i + Σ_children min_j (m_e cost_e(i, j) + best_w(j)) is
    exact (dynamic programming from the leaves). ``extra[v][i]``: seconds added to
    strategy i of node v (a recomputation mode's forward, per instance)."""
    n = len(p.nodes)
    parent_edge: dict[int, int] = {}
    children: list[list[int]] = [[] for _ in range(n)]
    for k, e in enumerate(p.edges):
        if e.u < e.v and e.v not in parent_edge:
            parent_edge[e.v] = k
            children[e.u].append(k)
    best: list[list[float]] = [[] for _ in range(n)]
    for v in range(n - 1, -1, -1):
        node = p.nodes[v]
        add = extra[v] if extra is not None else None
        row = [node.multiplicity * (c.total.device_s + c.total.comm_s)
               + (add[i] if add else 0.0) for i, c in enumerate(node.strategies)]
        for k in children[v]:
            e = p.edges[k]
            sub = best[e.v]
            cheapest = [float("inf")] * len(row)
            for (i, j), c in e.cost.items():
                t = e.multiplicity * c + sub[j]
                if t < cheapest[i]:
                    cheapest[i] = t
            row = [a + b for a, b in zip(row, cheapest)]
        best[v] = row
    return sum(min(best[v]) for v in range(n) if v not in parent_edge)


def mode_extra(p: Problem, modes: tuple[int, ...]) -> list[list[float]]:
    """Per node and strategy, the recomputed forward seconds of all its instances under
    one mode per group (``extra`` for :func:`tree_bound`)."""
    out = [[0.0] * len(node.strategies) for node in p.nodes]
    for grp, r in zip(p.recompute, modes):
        for k, v in enumerate(grp.nodes):
            m = p.nodes[v].multiplicity
            out[v] = [m * grp.extra_s[k][i][r] for i in range(len(p.nodes[v].strategies))]
    return out


def pipeline_stage_bound(forward: list[float], backward: list[float], optimizer: list[float],
                         *, pp: int, m: int, v: int, drains: bool) -> float:
    """A lower bound on the step of a pipeline of ``pp`` ranks and ``m`` micro-batches
    over units with at least these forward and backward seconds per micro-batch and
    optimizer seconds per step, whatever the stage split (``v`` stages per rank).

    Each rank runs its units' m·(f + b) seconds one operation at a time, then its
    optimizer step, so the step is at least the least *makespan* of the units' weights
    ``m·(f_u + b_u) + o_u`` over pp ranks (:func:`rank_load_bound`: a relaxation that
    lets any unit go to any rank). With one stage per rank the stages are contiguous,
    the rank of the stage starting at unit i first waits for micro-batch 0's forward
    through the units before i, and where the backward is not split (``drains``:
    gpipe, 1f1b) micro-batch m−1's backward through them follows its last operation
    (the chains of :mod:`autopar.solvers.stage_split_search`), so

        step ≥ min over splits max_s (Σ_{u<i_s} (f_u + drains·b_u) + m·c_s + o_s)

    found exactly by bisection on a greedy cut (each term grows with the stage's end
    faster than it falls with its start, as m ≥ 1). Both bounds ignore memory, the
    resharding between units and the stage-to-stage transfers, which only add."""
    weights = [m * (f + b) + o for f, b, o in zip(forward, backward, optimizer)]
    best = rank_load_bound(weights, pp)
    if v == 1 and len(weights) >= pp:
        lead = [f + (b if drains else 0.0) for f, b in zip(forward, backward)]
        best = max(best, _chain_bound(lead, weights, pp))
    return best


def _chain_bound(lead: list[float], weights: list[float], pp: int) -> float:
    """min over splits of the units into ≤ pp contiguous stages of
    max_s (Σ_{u<i_s} lead_u + Σ_{u∈s} weights_u), by bisection on greedy cuts (the
    largest value shown infeasible)."""
    n = len(weights)
    before = list(itertools.accumulate(lead, initial=0.0))
    upto = list(itertools.accumulate(weights, initial=0.0))

    def fits(theta: float) -> bool:
        i = stages = 0
        while i < n:
            j = i
            while j < n and before[i] + upto[j + 1] - upto[i] <= theta:
                j += 1
            if j == i or stages == pp:
                return False
            i, stages = j, stages + 1
        return True

    return _largest_too_small(max(upto[n] / pp, max(weights)), before[n] + upto[n],
                              lambda theta: not fits(theta))


def _largest_too_small(lo: float, hi: float, too_small) -> float:
    """Bisect [lo, hi] for the edge of ``too_small`` (true at lo, taken false at hi):
    the largest value shown too small, to a relative width of :data:`_PRECISION`."""
    while hi - lo > _PRECISION * hi:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if too_small(mid) else (lo, mid)
    return lo


_PRECISION = 1e-7
"""Relative width at which the bisections stop (returning the low end, which they have
shown infeasible): far below any cost's precision."""


def rank_load_bound(weights: list[float], bins: int) -> float:
    """A lower bound on the least makespan of ``weights`` packed into ``bins`` bins:
    the largest capacity θ at which some dual feasible function of Fekete and
    Schepers (Math. Program. 91, 2001) shows the items need more than ``bins`` bins.

    For an integer k ≥ 1, u_k(x) = x/θ when (k+1)·x/θ is an integer and
    ⌊(k+1)·x/θ⌋ / k otherwise sums to at most 1 over any bin of capacity θ, so
    Σ_items u_k > bins proves θ too small. This sees what the mean load does not:
    32 equal blocks and a head on 8 ranks need a rank with 5 blocks (k = 4), 17% above
    the mean. Equal weights are counted once, so the cost is in distinct weights."""
    if not weights:
        return 0.0
    counts: dict[float, int] = {}
    for w in weights:
        counts[w] = counts.get(w, 0) + 1
    items = [(w, c) for w, c in counts.items() if w > 0]
    if not items:
        return 0.0
    total = sum(w * c for w, c in items)
    bulk = max(items, key=lambda wc: wc[0] * wc[1])[0]  # the weight of most of the load

    def too_small(theta: float) -> bool:
        for k in range(1, min(_MAX_K, int(theta / bulk) + 1) + 1):
            need = 0.0
            for w, c in items:
                t = (k + 1) * w / theta
                whole = math.floor(t)
                u = whole / k
                if abs(t - round(t)) <= 1e-9 * max(1.0, t):  # on an integer: x/θ is u_k
                    u = min(u, w / theta)
                need += c * u
            if need > bins * (1 + 1e-9):
                return True
        return False

    lo = max(total / bins, max(w for w, _ in items))
    hi = lo + max(w for w, _ in items)  # list scheduling's makespan is below mean + max
    if not too_small(lo):
        return lo
    return _largest_too_small(lo, hi, too_small)


_MAX_K = 256
"""Largest k of the dual feasible functions tried. The k that counts is about the
number of the bulk weight's items per bin (k + 1 of them overfill θ): ⌊θ / bulk⌋ + 1
are tried, at most this many (past any model's depth)."""
