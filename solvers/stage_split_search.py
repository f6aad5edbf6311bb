"""Searches for :mod:`autopar.solvers.stage_split`: the closed-form seed under a stage-time
bound, and the split with the least simulated objective F.

* :func:`feasible_split` — some split with every stage within a stage-time bound and
  every rank within the memory budget;
* :func:`min_g_split` — among those, the least Σ g;
* :func:`improve_split` — from a seed, the split with the least
  F = simulate + exposed dp sync, pruned by :func:`lower_bound` (:func:`can_beat`
  tells, without simulating, whether any split can beat a bound).

Which stages are allowed and admitted, the searches' costs, and the lower bound
L ≤ F from the chains of operations every schedule runs in turn (Λ_r, P_s) are
written out in docs/solvers.md, section ``autopar.solvers.stage_split_search``.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from autopar.solvers.schedule_sim import ZERO_BUBBLE

if TYPE_CHECKING:
    from autopar.solvers.stage_split_problem import SplitProblem

Bounds = list[tuple[int, int]]
_NODE_LIMIT = 4_000  # keeps one split under ~0.1 s for 128 units; past it the split is feasible, maybe not optimal
_REL = 1e-12  # relative slack on "beats": a split must be faster by more than this

ENUMERATE_SPLITS = 2_000
"""Admitted splits (docs/solvers.md) are all enumerated, bounded and, where the bound
allows, simulated when there are at most this many: each costs one O(S·v) evaluation of
:func:`lower_bound`, so 2,000 of them take ~50 ms at 64 stages. Past it the search
moves single stage boundaries, which may stop short of the optimum."""

SIMULATED_OPS = 300_000
"""Pipeline operations :func:`improve_split` may simulate beyond the seed's: one split
costs the schedule's 2·m·S (3·m·S on zero-bubble schedules) operations at ~0.15 µs each,
so this is ~50 ms of simulation per candidate — e.g. 50 splits of a 32-rank 1F1B step
of 96 micro-batches, or one of a 64-rank ZB-V step of 512. Evaluating the lower bound
of a neighbouring split counts as S operations."""


def _ends(prob: "SplitProblem", t: float, budget: float) -> list[list[int]]:
    """J_s(i) for every stage s and start i (i+1 > J means no stage starts at i)."""
    pre, n, S = prob.pre, prob.n, prob.stages
    tol_t = 1e-12 * max(1.0, pre.work[-1])
    by_time = [bisect.bisect_right(pre.work, pre.work[i] + t + tol_t) - 1 for i in range(n)]
    by_k: dict[int, list[int]] = {}
    out = []
    for s in range(S):
        cap = n - (S - s - 1)
        k = prob.k[s]
        if budget != float("inf") and k not in by_k:
            mem = [a + k * b for a, b in zip(pre.static, pre.act)]
            tol_m = 1e-12 * max(1.0, mem[-1])
            by_k[k] = [bisect.bisect_right(mem, mem[i] + budget + tol_m) - 1 for i in range(n)]
        lim = by_k.get(k)
        out.append([min(by_time[i], cap, lim[i] if lim else n) for i in range(n)])
    return out


def _finishable(prob: "SplitProblem", ends: list[list[int]]) -> list[list[bool]]:
    """fin[s][i]: units [i, n) can be cut into stages s..S−1, each allowed."""
    n, S = prob.n, prob.stages
    fin = [[False] * (n + 1) for _ in range(S + 1)]
    fin[S][n] = True
    for s in range(S - 1, -1, -1):
        count = [0] * (n + 2)  # count[j] = #finishable positions < j at stage s+1
        for j in range(n + 1):
            count[j + 1] = count[j] + fin[s + 1][j]
        row, nxt = fin[s], ends[s]
        for i in range(n):
            hi = nxt[i]
            if hi >= i + 1 and count[hi + 1] - count[i + 1] > 0:
                row[i] = True
    return fin


def _coupled(prob: "SplitProblem", budget: float) -> bool:
    """True when a rank holds several stages under a finite budget."""
    return prob.v > 1 and budget != float("inf")


def feasible_split(prob: "SplitProblem", t: float, budget: float) -> Bounds | None:
    """A split with every stage ≤ t and every rank ≤ budget, or None. Among the
    choices it cuts each stage as short as it can, leaving later stages — which hold
    fewer micro-batches in flight on 1F1B-like schedules — the longer runs."""
    ends = _ends(prob, t, budget)
    fin = _finishable(prob, ends)
    if not fin[0][0]:
        return None
    if not _coupled(prob, budget):
        bounds, i = [], 0
        for s in range(prob.stages):
            j = next(j for j in range(i + 1, ends[s][i] + 1) if fin[s + 1][j])
            bounds.append((i, j))
            i = j
        return bounds
    found = _dfs(prob, ends, fin, budget, None)
    return found[1] if found else None


def min_g_split(prob: "SplitProblem", t: float, budget: float, g) -> tuple[float, Bounds] | None:
    """The least Σ_s g(i, j) over splits with every stage ≤ t and rank ≤ budget."""
    ends = _ends(prob, t, budget)
    n, S = prob.n, prob.stages
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(S + 1)]
    best[S][n] = 0.0
    for s in range(S - 1, -1, -1):
        for i in range(n):
            row = best[s + 1]
            val = min((g(i, j) + row[j] for j in range(i + 1, ends[s][i] + 1) if row[j] < inf),
                      default=inf)
            best[s][i] = val
    if best[0][0] == inf:
        return None
    if _coupled(prob, budget):
        return _dfs(prob, ends, [[x < inf for x in r] for r in best], budget, (g, best))
    bounds, i = [], 0
    for s in range(S):
        target = best[s][i]
        j = min(range(i + 1, ends[s][i] + 1),
                key=lambda j: (abs(g(i, j) + best[s + 1][j] - target), j))
        bounds.append((i, j))
        i = j
    return best[0][0], bounds


def _fitting_ends(prob: "SplitProblem", ends: list[list[int]], fin: list[list[bool]],
                  mem: list[float], s: int, i: int, room: float) -> Iterator[tuple[int, float]]:
    """(j, bytes) for each end j of stage s from i within ``ends`` from which the rest can
    be finished, in increasing order, while the stage's rank stays within ``room`` bytes
    (``mem``: each rank's bytes so far, read afresh at every step)."""
    r = prob.ranks[s]
    for j in range(i + 1, ends[s][i] + 1):
        if not fin[s + 1][j]:
            continue
        add = prob.stage_memory(s, i, j)
        if mem[r] + add > room:
            return
        yield j, add


def _dfs(prob: "SplitProblem", ends, fin, budget: float, sum_g) -> tuple[float, Bounds] | None:
    """Depth-first search over allowed stage ends, tracking each rank's memory; with
    ``sum_g = (g, best)`` it is a branch and bound on Σ g (``best`` — the DP without the
    shared-budget constraint — is the admissible bound), else it stops at the first
    feasible split. Prunes a state when the units left need more memory than the
    ranks still to receive a stage have free (Σ static + min k · Σ act of the rest),
    and remembers states (stage, start, those ranks' memory) that failed. Gives up
    (returns None and sets ``prob.truncated``) after ``_NODE_LIMIT`` nodes."""
    S, n, pre = prob.stages, prob.n, prob.pre
    tol = 1e-12 * max(1.0, budget)
    pending = [sorted(set(prob.ranks[s:])) for s in range(S + 1)]
    k_min = [min(prob.k[s:], default=0) for s in range(S + 1)]
    mem = [0.0] * prob.pp
    path: Bounds = []
    result: list = [float("inf"), None]
    failed: set = set()
    nodes = [0]

    def hopeless(s: int, i: int) -> bool:
        need = (pre.static[n] - pre.static[i]) + k_min[s] * (pre.act[n] - pre.act[i])
        return need > sum(budget - mem[r] for r in pending[s]) + tol * prob.pp

    def visit(s: int, i: int, acc: float) -> bool:
        nodes[0] += 1
        if nodes[0] > _NODE_LIMIT:
            prob.truncated = True
            return True
        if s == S:
            if i == n and acc < result[0]:
                result[0], result[1] = acc, list(path)
            return sum_g is None
        key = (s, i, tuple(mem[r] for r in pending[s])) if sum_g is None else None
        if key in failed or hopeless(s, i):
            return False
        r = prob.ranks[s]
        for j, add in _fitting_ends(prob, ends, fin, mem, s, i, budget + tol):
            step = 0.0
            if sum_g is not None:
                step = sum_g[0](i, j)
                if acc + step + sum_g[1][s + 1][j] >= result[0] - 1e-15:
                    continue
            mem[r] += add
            path.append((i, j))
            stop = visit(s + 1, j, acc + step)
            path.pop()
            mem[r] -= add
            if stop:
                return True
        if key is not None:
            failed.add(key)
        return False

    visit(0, 0, 0.0)
    visit = None  # the recursive closure refers to itself: free it (and prob) now, not at GC
    return (result[0], result[1]) if result[1] is not None else None


@dataclass(frozen=True)
class PathBound:
    """What :func:`lower_bound` reads of the schedule (docs/solvers.md), per split:

    Attributes:
        first: per rank, σ with F(σ, 0) its first operation (−1: none).
        last_b: per rank, σ' with B(σ', m−1) its last operation (−1: none, e.g. a W).
        hops: per stage s, H(s) — cross-rank hops among stages 0..s.
        before: per stage s, (u, #F, #B, #I, #W) of each stage u on s's rank run
            before F(s, m−1).
        zero_bubble: the backward is split into I and W.
    """

    first: list[int]
    last_b: list[int]
    hops: list[int]
    before: list[list[tuple[int, int, int, int, int]]]
    zero_bubble: bool

    @classmethod
    def of(cls, prob: "SplitProblem", paths: bool = True) -> "PathBound":
        """Read the schedule's orders (``paths``: also ``before``, from the compiled
        schedule; without it, enough for :func:`can_beat`). Each stage runs its F, B, I
        and W in micro-batch order, so the count of one kind before a position is found
        by bisection on the micro-batch."""
        m, S = prob.m, prob.stages
        first, last_b = [], []
        for order in prob.orders:
            first.append(order[0][1] if order and order[0][0] == "F" and order[0][2] == 0 else -1)
            end = order[-1] if order else None
            last_b.append(end[1] if end and end[0] == "B" and end[2] == m - 1 else -1)
        on_rank: list[list[int]] = [[] for _ in range(prob.pp)]
        for s, r in enumerate(prob.ranks):
            on_rank[r].append(s)
        before = []
        tl = prob.timeline if paths else None
        for s in range(S if paths else 0):
            here = tl.position(("F", s, m - 1))
            counts = []
            for u in on_rank[prob.ranks[s]]:
                row = []
                for kind in "FBIW":
                    lo, hi = 0, m  # the first micro-batch whose op is not before `here`
                    while lo < hi:
                        mid = (lo + hi) // 2
                        at = tl.position((kind, u, mid))
                        if 0 <= at < here:
                            lo = mid + 1
                        else:
                            hi = mid
                    row.append(lo)
                counts.append((u, *row))
            before.append(counts)
        hops = [0]
        for a, b in zip(prob.ranks, prob.ranks[1:]):
            hops.append(hops[-1] + (a != b))
        return cls(first, last_b, hops, before, prob.schedule in ZERO_BUBBLE)


def lower_bound(prob: "SplitProblem", pb: PathBound, bounds: Bounds) -> float:
    """L(split) ≤ F(split) (docs/solvers.md), in O(S·v)."""
    pre, m, p2p, n, pp = prob.pre, prob.m, prob.p2p_s, prob.n, prob.pp
    f = [pre.forward[j] - pre.forward[i] for i, j in bounds]
    b = [pre.backward[j] - pre.backward[i] for i, j in bounds]
    w = [pre.weight[j] - pre.weight[i] for i, j in bounds]
    load = prob.per_rank(pre.work, bounds)
    comm, bwd = prob.per_rank(pre.comm, bounds), prob.per_rank(pre.backward, bounds)
    start = [0.0] * pp
    best = 0.0
    for r in range(pp):
        a, z = pb.first[r], pb.last_b[r]
        start[r] = pre.forward[bounds[a][0]] + pb.hops[a] * p2p if a >= 0 else 0.0
        tail = pre.backward[bounds[z][0]] + pb.hops[z] * p2p if z >= 0 else 0.0
        best = max(best, start[r] + m * load[r] + tail)
    back = pre.backward[n] - pre.weight[n] + w[0] if pb.zero_bubble else pre.backward[n]
    total_hops = pb.hops[-1]
    for s, counts in enumerate(pb.before):
        t = start[prob.ranks[s]] + pre.forward[n] - pre.forward[bounds[s][0]] + back + \
            (2 * total_hops - pb.hops[s]) * p2p
        for u, nf, nb, ni, nw in counts:
            t += nf * f[u] + nb * b[u] + ni * (b[u] - w[u]) + nw * w[u]
        best = max(best, t)
    return max(best + max(max(0.0, c - prob.overlap * x) for c, x in zip(comm, bwd)),
               prob.host(bounds))


def _admitted(prob: "SplitProblem", pb: PathBound, theta: float) -> list[list[int]]:
    """J_s(i): the last end of a stage s starting at i whose own memory fits and whose
    rank term and host seconds can stay below ``theta`` (docs/solvers.md); i+1 > J:
    none."""
    pre, n, S, m, p2p = prob.pre, prob.n, prob.stages, prob.m, prob.p2p_s
    mem_ends = _ends(prob, float("inf"), prob.budget)
    limit = theta * (1 + _REL) + 1e-300
    out = []
    for s in range(S):
        r = prob.ranks[s]
        a, z = pb.first[r], pb.last_b[r]
        fixed = (pb.hops[a] if a >= 0 else 0) * p2p + (pb.hops[z] if z >= 0 else 0) * p2p
        row = []
        for i in range(n):
            lead = (pre.forward[i] if a == s else 0.0) + (pre.backward[i] if z == s else 0.0)
            room = (limit - fixed - lead) / m
            j = bisect.bisect_right(pre.work, pre.work[i] + room) - 1 if room >= 0 else i
            by_host = bisect.bisect_left(pre.host, pre.host[i] + limit) - 1
            row.append(min(j, mem_ends[s][i], by_host))
        out.append(row)
    return out


def can_beat(prob: "SplitProblem", bound: float) -> bool:
    """False when no split that fits can have F below ``bound``: every split has a stage
    that the admission of docs/solvers.md rejects at θ = bound (its own memory
    over the budget, or its rank's term with it alone already at ``bound``). O(S·n·log n),
    without simulating."""
    ends = _admitted(prob, PathBound.of(prob, paths=False), bound)
    return _finishable(prob, ends)[0][0]


def _count(prob: "SplitProblem", ends: list[list[int]], cap: int) -> int:
    """The number of splits with every stage's end within ``ends`` (at most cap + 1)."""
    n, S = prob.n, prob.stages
    cnt = [0] * (n + 1)
    cnt[n] = 1
    for s in range(S - 1, -1, -1):
        acc = [0] * (n + 2)  # acc[j] = Σ cnt[j'] for j' < j
        for j in range(n + 1):
            acc[j + 1] = acc[j] + cnt[j]
        row = ends[s]
        cnt = [min(cap + 1, acc[row[i] + 1] - acc[i + 1]) if row[i] > i else 0
               for i in range(n)] + [0]
    return cnt[0]


def _splits(prob: "SplitProblem", ends: list[list[int]]) -> list[Bounds]:
    """Every split with every stage's end within ``ends`` and every rank's memory within
    the budget."""
    S, budget = prob.stages, prob.budget
    tol = 1e-12 * max(1.0, budget)
    fin = _finishable(prob, ends)
    mem = [0.0] * prob.pp
    path: Bounds = []
    out: list[Bounds] = []

    def walk(s: int, i: int) -> None:
        if s == S:
            out.append(list(path))
            return
        r = prob.ranks[s]
        for j, add in _fitting_ends(prob, ends, fin, mem, s, i, budget + tol):
            mem[r] += add
            path.append((i, j))
            walk(s + 1, j)
            path.pop()
            mem[r] -= add

    if fin[0][0]:
        walk(0, 0)
    walk = None  # the recursive closure refers to itself: free it now, not at GC
    return out


def _move(prob: "SplitProblem", pb: PathBound, cur: Bounds, best: float, bound: float,
          budget: list[int], stats: dict) -> tuple[Bounds, float] | None:
    """The first split one boundary step away from ``cur`` (in increasing order of
    :func:`lower_bound`) that simulates faster than ``best``; None when none does or
    ``budget`` (operations left, updated) runs out. Counts ``stats["simulations"]``."""
    S, tol = prob.stages, prob.budget * 1e-12
    theta = min(best, bound) * (1 - _REL)
    near = []
    for k in range(S - 1):
        (i, j), (_, e) = cur[k], cur[k + 1]
        for nj in (j - 1, j + 1):
            if not i < nj < e:
                continue
            nb = cur[:k] + [(i, nj), (nj, e)] + cur[k + 2:]
            budget[0] -= S
            if max(prob.rank_memory(nb)) > prob.budget + tol:
                continue
            low = lower_bound(prob, pb, nb)
            if low < theta:
                near.append((low, nb))
    near.sort()
    cost = len(prob.timeline.ops)
    for low, nb in near:
        if low >= min(best, bound) * (1 - _REL) or budget[0] < cost:
            return None
        budget[0] -= cost
        stats["simulations"] += 1
        f = prob.simulated(nb)
        if f < best * (1 - _REL):
            return nb, f
    return None


def improve_split(prob: "SplitProblem", seed: Bounds,
                  bound: float = float("inf")) -> tuple[Bounds, dict]:
    """The split with the least F = simulate + exposed dp sync, from ``seed`` (which fits
    the budget), and stats: ``exact`` is True when the answer is proven to be the least F
    over every split that fits — or, when that is ``bound`` or more, that no split beats
    ``bound``.

    Each round bounds from below every split that could beat θ = min(best F, bound) by
    the per-stage admission of docs/solvers.md. When the admitted splits number at
    most :data:`ENUMERATE_SPLITS`, each gets :func:`lower_bound`, and those below θ are
    simulated in increasing order of it until the next bound reaches the best F: exact,
    unless :data:`SIMULATED_OPS` runs out first. Otherwise the round moves one stage
    boundary by one unit (the first neighbour that simulates faster) and starts again
    with the lower θ; with no faster neighbour, the answer is a local optimum (not
    exact)."""
    pb = PathBound.of(prob)
    cost = len(prob.timeline.ops)
    best, f_best = list(seed), prob.simulated(seed)
    budget = [SIMULATED_OPS]
    stats = {"method": "least simulated F", "seed_s": f_best, "moves": 0, "simulations": 1}
    while True:
        theta = min(f_best, bound)
        ends = _admitted(prob, pb, theta)
        admitted = _count(prob, ends, ENUMERATE_SPLITS)
        if admitted <= ENUMERATE_SPLITS:
            ranked = sorted((lower_bound(prob, pb, b), b) for b in _splits(prob, ends))
            exact = True
            for low, b in ranked:
                if low >= min(f_best, bound) * (1 - _REL):
                    break
                if b == best:
                    continue
                if budget[0] < cost:
                    exact = False
                    break
                budget[0] -= cost
                stats["simulations"] += 1
                f = prob.simulated(b)
                if f < f_best * (1 - _REL):
                    best, f_best = b, f
            stats.update(admitted=admitted, exact=exact)
            return best, stats
        step = _move(prob, pb, best, f_best, bound, budget, stats)
        if step is None:
            stats.update(admitted=admitted, exact=False)
            return best, stats
        best, f_best = step
        stats["moves"] += 1
