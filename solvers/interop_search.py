"""Searches under a stage-time bound for :mod:`autopar.solvers.interop`.

Given ``t`` and a memory budget B, a stage s over units [i, j) is *allowed* when
``c(i, j) ≤ t`` and its own memory ``static + k_s·act ≤ B``. Both grow with the range,
so the allowed ends from i form an interval ``[i+1, J_s(i)]`` found by bisection on
prefix sums, and ``J_s`` is non-decreasing in i.

* :func:`feasible_split` — some split with every stage allowed and every rank's
  memory ≤ B. With one stage per rank the per-stage test is the whole constraint, and
  a backward reachability table (O(S·n)) decides it. With v > 1 the stages of a rank
  share B, and a depth-first search over the table's choices checks the rank sums.
* :func:`min_g_split` — among those, the least Σ g (a DP over (stage, start) in
  O(S·n·width); the same depth-first search, bounded by the DP, when ranks share B).
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from autopar.solvers.interop import _Problem

Bounds = list[tuple[int, int]]
_NODE_LIMIT = 4_000  # keeps one split under ~0.1 s for 128 units; past it the split is feasible, maybe not optimal


def _ends(prob: "_Problem", t: float, budget: float) -> list[list[int]]:
    """J_s(i) for every stage s and start i (i+1 > J means no stage starts at i)."""
    pre, n, S = prob.pre, prob.n, prob.stages
    tol_t = 1e-12 * max(1.0, pre.c[-1])
    by_time = [bisect.bisect_right(pre.c, pre.c[i] + t + tol_t) - 1 for i in range(n)]
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


def _finishable(prob: "_Problem", ends: list[list[int]]) -> list[list[bool]]:
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


def _coupled(prob: "_Problem", budget: float) -> bool:
    """True when a rank holds several stages under a finite budget."""
    return prob.v > 1 and budget != float("inf")


def feasible_split(prob: "_Problem", t: float, budget: float) -> Bounds | None:
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


def min_g_split(prob: "_Problem", t: float, budget: float, g) -> tuple[float, Bounds] | None:
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


def _dfs(prob: "_Problem", ends, fin, budget: float, sum_g) -> tuple[float, Bounds] | None:
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
        for j in range(i + 1, ends[s][i] + 1):
            if not fin[s + 1][j]:
                continue
            add = prob.stage_memory(s, i, j)
            if mem[r] + add > budget + tol:
                break
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
    return (result[0], result[1]) if result[1] is not None else None
