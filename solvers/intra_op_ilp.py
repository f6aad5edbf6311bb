"""The intra-op ILP: one strategy per node, minimizing the step time under memory.

Solved with PuLP's bundled CBC. The formulation follows Alpa (Zheng et al., OSDI'22,
§4.2) with the tighter edge linearization of Meta's autoparallel: a binary ``x[v,i]``
per node strategy and a continuous ``y[e,i,j] ∈ [0, 1]`` per allowed strategy pair of
each edge, tied to the node variables by marginal constraints. Each family of
constraints is its own method whose docstring gives the formula it adds.

Recomputation (:class:`~autopar.solvers.problem.RecomputeGroup`) adds a binary
``z[g,r]`` per group and mode and a continuous ``w[g,k,i,r] ∈ [0, 1]`` per node strategy
of the group and mode, tied by marginals exactly like the edge variables, so that
``w = x·z`` at every integral point: the product of a node's strategy and its layer's
mode stays linear and the ILP stays exact.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

import pulp

from autopar.errors import NoFeasiblePlanError
from autopar.solvers.problem import Problem, evaluate


def _release_import_frames() -> None:
    """Drop the tracebacks of the import errors PuLP keeps.

    Some PuLP solver classes store the exception of a failed optional import as a class
    attribute (``COPT_DLL.err``, ``CPLEX_PY.err`` in pulp 3.3). Its traceback holds every
    frame that was on the stack when PuLP was first imported, which here is inside the
    first ``autopar.plan`` call, so that call's caller's locals (a model, its optimizer,
    gigabytes of GPU memory) would never be freed. The messages stay; only the frames go.
    """
    for name, module in list(sys.modules.items()):
        if not name.startswith("pulp.") or module is None:
            continue
        for obj in vars(module).values():
            err = getattr(obj, "err", None) if isinstance(obj, type) else None
            if isinstance(err, BaseException):
                err.__traceback__ = None
                err.__context__ = None


_release_import_frames()


class SolverTimeout(Exception):
    """CBC reached the time limit it was given before it found any assignment (the
    problem may well fit: it was not solved)."""


@dataclass
class Solution:
    """A solver's answer: one strategy index per node and how it was found."""

    choice: list[int]
    objective_s: float
    status: str
    stats: dict[str, float | int | str] = field(default_factory=dict)
    modes: list[int] = field(default_factory=list)


DEVICE_TIE = 1e-7
"""Weight of the device's seconds added to a host-bound objective: where the host
bounds the step, every layout whose device time stays under the host's is as fast, and
this picks the one that keeps the device least busy (least compute and traffic, the
layout that stays fastest when the host speeds up) at a cost of at most 1e-7 of the
step. A preference, not a cost."""


class IntraOpILP:
    """Builds and solves the ILP for one :class:`Problem`.

    Times enter the model in microseconds and memory in thousandths of the budget, so
    that CBC's absolute tolerances (~1e-6 to 1e-9) are far below every cost that matters.
    """

    TIME = 1e6
    MEMORY = 1e-9

    def __init__(self, problem: Problem, mix: tuple[float, float] | None = None) -> None:
        self.p = problem
        self.mix = mix  # (a, b): minimize a·T + b·(the step's host seconds), not F
        self.model = pulp.LpProblem("autopar_intra_op", pulp.LpMinimize)
        self.x: list[list[pulp.LpVariable]] = []
        self.y: list[dict[tuple[int, int], pulp.LpVariable]] = []
        self.z: list[dict[int, pulp.LpVariable]] = []
        self.w: list[dict[tuple[int, int, int], pulp.LpVariable]] = []
        self.classes: list[list[list[list[int]]]] = []
        self.u: list[dict[tuple[int, int, int], pulp.LpVariable]] = []
        self.pair_classes: list[list[list[list[tuple[int, int]]]]] = []
        self.sums: dict[str, pulp.LpAffineExpression] = {}  # _sum's, by attribute

    def build(self) -> None:
        """Create the variables, the objective and every constraint family."""
        p = self.p
        for v, node in enumerate(p.nodes):
            self.x.append([pulp.LpVariable(f"x_{v}_{i}", cat="Binary")
                           for i in range(len(node.strategies))])
        for k, e in enumerate(p.edges):
            self.y.append({ij: pulp.LpVariable(f"y_{k}_{ij[0]}_{ij[1]}", 0, 1)
                           for ij in e.cost})
        for g, grp in enumerate(p.recompute):
            self.z.append({r: pulp.LpVariable(f"z_{g}_{r}", cat="Binary") for r in grp.allowed})
            self.classes.append([_classes(grp, k, len(p.nodes[v].strategies))
                                 for k, v in enumerate(grp.nodes)])
            self.w.append({(k, c, r): pulp.LpVariable(f"w_{g}_{k}_{c}_{r}", 0, 1)
                           for k in range(len(grp.nodes))
                           for c in range(len(self.classes[g][k])) for r in grp.allowed})
            self.pair_classes.append([_pair_classes(t, p.edges[k].cost)
                                      for k, t in zip(grp.edges, grp.edge_extra_s)])
            self.u.append({(j, c, r): pulp.LpVariable(f"u_{g}_{j}_{c}_{r}", 0, 1)
                           for j, cs in enumerate(self.pair_classes[g])
                           for c in range(len(cs)) for r in grp.allowed})
        self.add_one_strategy_per_node()
        self.add_edge_marginals()
        self.add_ties()
        self.add_one_mode_per_group()
        self.add_recompute_marginals()
        self.add_edge_recompute_marginals()
        self.add_memory_budget()
        self.add_recompute_memory_budget()
        self.set_objective()

    def add_one_strategy_per_node(self) -> None:
        """Σ_i x[v,i] = 1 for every node v."""
        for v, xs in enumerate(self.x):
            self.model += pulp.lpSum(xs) == 1, f"one_{v}"

    def add_edge_marginals(self) -> None:
        """For every edge e = (u, v): Σ_j y[e,i,j] = x[u,i] for all i, and
        Σ_i y[e,i,j] = x[v,j] for all j. Strategies with no allowed partner are
        thereby forbidden (their marginal is an empty sum = 0)."""
        for k, e in enumerate(self.p.edges):
            rows: list[list] = [[] for _ in self.x[e.u]]
            cols: list[list] = [[] for _ in self.x[e.v]]
            for (i, j), y in self.y[k].items():
                rows[i].append(y)
                cols[j].append(y)
            for i, ys in enumerate(rows):
                self.model += pulp.lpSum(ys) == self.x[e.u][i], f"mu_{k}_{i}"
            for j, ys in enumerate(cols):
                self.model += pulp.lpSum(ys) == self.x[e.v][j], f"mv_{k}_{j}"

    def add_ties(self) -> None:
        """For every tie (a, b) and group k: Σ_{i∈A_k} x[a,i] = Σ_{j∈B_k} x[b,j]."""
        for t_i, t in enumerate(self.p.ties):
            for k, (ga, gb) in enumerate(zip(t.groups_a, t.groups_b)):
                self.model += (pulp.lpSum(self.x[t.a][i] for i in ga)
                               == pulp.lpSum(self.x[t.b][j] for j in gb)), f"tie_{t_i}_{k}"

    def add_one_mode_per_group(self) -> None:
        """Σ_r z[g,r] = 1 for every recomputation group g (r over its allowed modes)."""
        for g, zs in enumerate(self.z):
            self.model += pulp.lpSum(zs.values()) == 1, f"mode_{g}"

    def add_recompute_marginals(self) -> None:
        """For group g, its k-th node v and each class C of v's strategies with equal
        recomputation costs: Σ_r w[g,k,C,r] = Σ_{i∈C} x[v,i], and for every mode r
        Σ_C w[g,k,C,r] = z[g,r] (so w[g,k,C,r] = [s_v ∈ C]·z[g,r] when integral)."""
        for g, grp in enumerate(self.p.recompute):
            self._link_modes(g, self.w[g], [(self.x[v], cl) for v, cl in
                                            zip(grp.nodes, self.classes[g])], ("wx", "wz"))

    def add_edge_recompute_marginals(self) -> None:
        """For group g, its j-th edge e and each class P of e's strategy pairs with equal
        re-run seconds: Σ_r u[g,j,P,r] = Σ_{(i,k)∈P} y[e,i,k], and for every mode r
        Σ_P u[g,j,P,r] = z[g,r] (so u[g,j,P,r] = [pair ∈ P]·z[g,r] when x is integral)."""
        for g, grp in enumerate(self.p.recompute):
            self._link_modes(g, self.u[g], [(self.y[e], cl) for e, cl in
                                            zip(grp.edges, self.pair_classes[g])], ("uy", "uz"))

    def _link_modes(self, g: int, lifted: dict, items: list[tuple[dict, list]],
                    tags: tuple[str, str]) -> None:
        """The marginals of group g's lifted variables ``lifted[(k, C, r)]`` for each item
        k = (its choice variables, its classes of choices with equal costs): Σ_r lifted =
        Σ_{i∈C} choice[i] per class, and Σ_C lifted = z[g,r] per mode r."""
        allowed = self.p.recompute[g].allowed
        for k, (chosen, classes) in enumerate(items):
            for c, members in enumerate(classes):
                self.model += (pulp.lpSum(lifted[(k, c, r)] for r in allowed)
                               == pulp.lpSum(chosen[i] for i in members)), \
                    f"{tags[0]}_{g}_{k}_{c}"
            for r in allowed:
                self.model += (pulp.lpSum(lifted[(k, c, r)] for c in range(len(classes)))
                               == self.z[g][r]), f"{tags[1]}_{g}_{k}_{r}"

    def _recompute_sum(self, what: str, scale: float) -> list[tuple[pulp.LpVariable, float]]:
        """Σ_g Σ_{k,C,r} coefficient · w[g,k,C,r] for ``what`` = "time" (m_v·extra_s),
        "host_fwd" / "host_bwd" (m_v times :meth:`RecomputeGroup.host`) or "memory"
        (:meth:`RecomputeGroup.memory`), the coefficient of any member of C, as
        (variable, coefficient) pairs for :func:`_affine`; "time" also Σ_g Σ_{j,P,r}
        m_e·edge_extra_s·u[g,j,P,r] (the edges' conversions run again)."""
        terms = []
        for g, grp in enumerate(self.p.recompute):
            for (k, c, r), w in self.w[g].items():
                i = self.classes[g][k][c][0]
                m = self.p.nodes[grp.nodes[k]].multiplicity
                if what == "time":
                    c = m * grp.extra_s[k][i][r]
                elif what in ("host_fwd", "host_bwd"):
                    c = m * grp.host(k, i, r)[what == "host_bwd"]
                else:
                    c = grp.memory(k, i, r, m)
                if c:
                    terms.append((w, scale * c))
            if what == "time":
                for (j, c, r), u in self.u[g].items():
                    e = self.p.edges[grp.edges[j]]
                    row = grp.edge_extra_s[j].get(self.pair_classes[g][j][c][0])
                    if row and row[r]:
                        terms.append((u, scale * e.multiplicity * row[r]))
        return terms

    def _common_memory(self, k: float) -> list[tuple[pulp.LpVariable, float]]:
        """k·C: fixed + Σ_v Σ_i x[v,i] (m_v·memory[v,i] + g_v·gather[v,i])
        + Σ_g Σ_{k,C,r} w·a_g·m_v·act_delta."""
        p = self.p
        terms = [(x, k * (n.multiplicity * s.total.memory_bytes
                          + n.gather_multiplicity * s.total.gather_bytes))
                 for n, xs in zip(p.nodes, self.x) for s, x in zip(n.strategies, xs)]
        return terms + self._recompute_sum("memory", k)

    def _scale(self) -> float:
        """Memory enters in thousandths of the budget (budget = 1000 units)."""
        b = self.p.memory_budget
        return 1e3 / b if b > 0 else self.MEMORY

    def add_memory_budget(self) -> None:
        """c = k·C (one continuous variable, so the two budgets below share it), and
        c + k·Σ_v Σ_i x[v,i]·m_v·backward_start[v,i] ≤ k·budget (the start of backward);
        k = 1000 / budget."""
        p = self.p
        if p.memory_budget == float("inf"):
            return
        k = self._scale()
        self.common = pulp.LpVariable("memory_common")
        self.model += self.common == _affine(self._common_memory(k)) + k * p.fixed_memory, \
            "memory_common_def"
        start = [(x, k * n.multiplicity * s.total.backward_start_bytes)
                 for n, xs in zip(p.nodes, self.x) for s, x in zip(n.strategies, xs)
                 if s.total.backward_start_bytes]
        self.model += self.common + _affine(start) <= k * p.memory_budget, "memory"

    def add_recompute_memory_budget(self) -> None:
        """c + k·(Σ_v Σ_i x[v,i]·recompute[v,i] + Σ_g Σ_{k,C,r} w[g,k,C,r]·transient)
        ≤ k·budget (while a recomputed block runs its backward)."""
        p = self.p
        if p.memory_budget == float("inf"):
            return
        k = self._scale()
        redo = [(x, k * s.total.recompute_bytes) for n, xs in zip(p.nodes, self.x)
                for s, x in zip(n.strategies, xs) if s.total.recompute_bytes]
        for g, grp in enumerate(p.recompute):
            for (kk, c, r), w in self.w[g].items():
                t = grp.transient[kk][self.classes[g][kk][c][0]][r]
                if t:
                    redo.append((w, k * t))
        if redo:
            self.model += self.common + _affine(redo) <= k * p.memory_budget, \
                "memory_recompute"

    def _sum(self, term: str) -> pulp.LpAffineExpression:
        """Σ_v Σ_i TIME·m_v·term[v,i]·x[v,i] of a term of the cost record
        (:data:`~autopar.solvers.cost_record.TERMS`; device time: plus the recomputed
        forwards); built once per term, a fresh copy per call."""
        if term not in self.sums:
            terms = [(x, self.TIME * n.multiplicity * getattr(s.total, term))
                     for n, xs in zip(self.p.nodes, self.x)
                     for s, x in zip(n.strategies, xs) if getattr(s.total, term)]
            if term in ("device_s", "device_bwd_s"):  # recomputation runs in backward
                terms += self._recompute_sum("time", self.TIME)
                terms += [(self.y[k][ij], self.TIME * e.multiplicity * c)
                          for k, e in enumerate(self.p.edges) for ij, c in e.recompute.items()
                          if ij in self.y[k]]
            self.sums[term] = _affine(terms)
        return self.sums[term].copy()

    def set_objective(self) -> None:
        """min n·(Σ m·(compute + comm) + Σ_e m_e·cost_e·y_e) + E_step + n·E_micro, with
        E_step ≥ Σ m·step_param_comm − overlap·Σ m·bwd_compute, E_micro ≥
        Σ m·micro_param_comm − overlap·Σ m·compute, and E ≥ 0; compute and bwd_compute
        include the recomputation Σ_g Σ m_v·extra_s·w; plus Σ m·optimizer (once per step);
        where the host may bound the step, plus :data:`DEVICE_TIE` times the device's
        part."""
        p = self.p
        n = p.num_microbatches
        edge_cost = _affine((self.y[k][ij], self.TIME * e.multiplicity * c)
                            for k, e in enumerate(p.edges) for ij, c in e.cost.items() if c)
        e_step = pulp.LpVariable("exposed_step", 0)
        e_micro = pulp.LpVariable("exposed_micro", 0)
        self.model += e_step >= self._sum("step_param_comm_s") - p.overlap * self._sum(
            "device_bwd_s"), "exposed_step_def"
        self.model += e_micro >= self._sum("micro_param_comm_s") - p.overlap * self._sum(
            "device_s"), "exposed_micro_def"
        total = n * (self._sum("device_s") + self._sum("comm_s") + edge_cost) \
            + e_step + n * e_micro + self._sum("optimizer_s")
        if self.mix is None:
            exposure = self._host_exposure(total, edge_cost)
            tie = DEVICE_TIE * total if has_host_seconds(p) else 0
            self.model += total + exposure + tie
        else:  # a Lagrangian of max(T, host): see autopar.solvers.intra_op_host
            a, b = self.mix
            self.model += a * total + (b * self._host_total() if b else 0)

    def _host_total(self) -> pulp.LpAffineExpression:
        """n·(h_F + h_B) + h_O: the step's host seconds (the last term of (**))."""
        n = self.p.num_microbatches
        again = _affine(self._recompute_sum("host_fwd", self.TIME)
                        + self._recompute_sum("host_bwd", self.TIME))
        return n * (self._sum("all_host_s") + again) + self._sum("host_step_s")

    def _host_exposure(self, total: pulp.LpAffineExpression,
                       edge_cost: pulp.LpAffineExpression) -> pulp.LpAffineExpression:
        """H of (**) (:mod:`autopar.solvers.problem`): a variable h ≥ 0 with
        h ≥ n·(h_F + h_B) + h_O − T and, unless the problem leaves out the phases
        (``host_phases``), h ≥ h_F − d_F, h ≥ n·δ and h ≥ (n−1)·δ + h_F − d_F; 0 when no
        strategy has host seconds."""
        p = self.p
        if not has_host_seconds(p):
            return pulp.LpAffineExpression()
        h = pulp.LpVariable("exposed_host", 0)
        self.model += h >= self._host_total() - total, "host_step"
        if p.host_phases:
            n = p.num_microbatches
            half = (self._sum("comm_s") + edge_cost) * 0.5
            d_bwd = self._sum("device_bwd_s") + half
            d_fwd = self._sum("device_s") - self._sum("device_bwd_s") + half
            h_bwd = self._sum("all_host_bwd_s") + _affine(
                self._recompute_sum("host_bwd", self.TIME))
            h_fwd = self._sum("all_host_s") - self._sum("all_host_bwd_s") + _affine(
                self._recompute_sum("host_fwd", self.TIME))
            delta = h_fwd + h_bwd - d_fwd - d_bwd
            self.model += h >= h_fwd - d_fwd, "host_first_forward"
            self.model += h >= n * delta, "host_every_pass"
            self.model += h >= (n - 1) * delta + h_fwd - d_fwd, "host_to_last_forward"
        return pulp.LpAffineExpression(h)

    def solve(self, time_limit_s: float | None = None) -> Solution:
        """Run CBC and read back one strategy per node."""
        t0 = time.perf_counter()
        self.build()
        built = time.perf_counter()
        solver = pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s, gapRel=1e-9)
        status = self.model.solve(solver)
        elapsed = time.perf_counter() - t0
        name = pulp.LpStatus[status]
        if time_limit_s is not None and name == "Not Solved":
            raise SolverTimeout(f"the intra-op ILP found no assignment in {time_limit_s:.3g} s")
        if name not in ("Optimal",):
            raise NoFeasiblePlanError(f"the intra-op ILP is {name.lower()}")
        if time_limit_s is not None and self.model.sol_status != pulp.LpSolutionOptimal:
            name = "Stopped"  # the time limit cut CBC short: an assignment, not proven best
        choice = [max(range(len(xs)), key=lambda i: xs[i].value() or 0.0) for xs in self.x]
        modes = [max(zs, key=lambda r: zs[r].value() or 0.0) for zs in self.z]
        self.stats_extra = {"recompute_variables": sum(len(w) for w in self.w)
                            + sum(len(u) for u in self.u)}
        ev = evaluate(self.p, choice, modes)
        stats = {"solver": "ilp-cbc", "status": name, "variables": len(self.model.variables()),
                 "constraints": len(self.model.constraints), "build_s": built - t0,
                 "time_s": elapsed}
        return Solution(choice, ev.step_time_s, name, stats, modes)


def has_host_seconds(p: Problem) -> bool:
    """Whether any strategy or recomputation mode of ``p`` has host seconds (a GPU
    profile's), so that the exposed host time H of (**) can be above 0."""
    return any(s.total.all_host_s or s.total.host_step_s
               for nd in p.nodes for s in nd.strategies) \
        or any(g.host_fwd_s for g in p.recompute)


def _affine(pairs: Iterable[tuple[pulp.LpVariable, float]]) -> pulp.LpAffineExpression:
    """Σ coefficient · variable over ``pairs`` (each variable once), the nonzero terms in
    order: what ``pulp.lpSum`` of ``coefficient * variable`` gives, without building an
    expression per term (that took half of each ILP's build on a 7B model)."""
    return pulp.LpAffineExpression([(v, c) for v, c in pairs if c])


def _classes(grp, k: int, n: int) -> list[list[int]]:
    """Node k's strategies grouped by equal (extra_s, act_delta, transient, host) rows."""
    out: dict[tuple, list[int]] = {}
    for i in range(n):
        key = (tuple(grp.extra_s[k][i]), tuple(grp.act_delta[k][i]), tuple(grp.transient[k][i]),
               tuple(grp.host(k, i, r) for r in range(len(grp.modes))))
        out.setdefault(key, []).append(i)
    return list(out.values())


def _pair_classes(table: dict[tuple[int, int], list[float]],
                  cost: dict[tuple[int, int], float]) -> list[list[tuple[int, int]]]:
    """An edge's allowed strategy pairs grouped by equal re-run seconds per mode
    (``table``; a pair it leaves out re-runs nothing)."""
    out: dict[tuple, list[tuple[int, int]]] = {}
    for ij in cost:
        out.setdefault(tuple(table.get(ij, ())), []).append(ij)
    return list(out.values())


def fold_modes(problem: Problem, modes: list[int]) -> Problem:
    """``problem`` with every recomputation group fixed to ``modes``: each node's
    strategies carry the mode's extra time and memory, and no groups remain."""
    nodes = list(problem.nodes)
    for grp, r in zip(problem.recompute, modes):
        for k, v in enumerate(grp.nodes):
            node = nodes[v]
            m = node.multiplicity
            costs = [replace(sc, compute_s=sc.compute_s + grp.extra_s[k][i][r],
                             bwd_compute_s=sc.bwd_compute_s + grp.extra_s[k][i][r],
                             host_s=sc.host_s + sum(grp.host(k, i, r)),
                             host_bwd_s=sc.host_bwd_s + grp.host(k, i, r)[1],
                             memory_bytes=sc.memory_bytes + grp.memory(k, i, r, m) / m,
                             recompute_bytes=sc.recompute_bytes + grp.transient[k][i][r])
                     for i, sc in enumerate(node.strategies)]
            nodes[v] = replace(node, strategies=costs)
    edges = list(problem.edges)
    for grp, r in zip(problem.recompute, modes):
        for k, table in zip(grp.edges, grp.edge_extra_s):
            e = edges[k]
            redo = dict(e.recompute)
            for ij, row in table.items():
                if row[r]:
                    redo[ij] = redo.get(ij, 0.0) + row[r]
            edges[k] = replace(e, recompute=redo)
    return replace(problem, nodes=nodes, edges=edges, recompute=[])
