"""The intra-op ILP: one strategy per node, minimizing the step time under memory.

Solved with PuLP's bundled CBC. The formulation follows Alpa (Zheng et al., OSDI'22,
§4.2) with the tighter edge linearization of Meta's autoparallel: a binary ``x[v,i]``
per node strategy and a continuous ``y[e,i,j] ∈ [0, 1]`` per allowed strategy pair of
each edge, tied to the node variables by marginal constraints. Each family of
constraints is its own method whose docstring gives the formula it adds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import pulp

from autopar.errors import NoFeasiblePlanError
from autopar.solvers.problem import Problem, evaluate


@dataclass
class Solution:
    """A solver's answer: one strategy index per node and how it was found."""

    choice: list[int]
    objective_s: float
    status: str
    stats: dict[str, float | int | str] = field(default_factory=dict)


class IntraOpILP:
    """Builds and solves the ILP for one :class:`Problem`.

    Times enter the model in microseconds and memory in thousandths of the budget, so
    that CBC's absolute tolerances (~1e-6 to 1e-9) are far below every cost that matters.
    """

    TIME = 1e6
    MEMORY = 1e-9

    def __init__(self, problem: Problem) -> None:
        self.p = problem
        self.model = pulp.LpProblem("autopar_intra_op", pulp.LpMinimize)
        self.x: list[list[pulp.LpVariable]] = []
        self.y: list[dict[tuple[int, int], pulp.LpVariable]] = []

    def build(self) -> None:
        """Create the variables, the objective and every constraint family."""
        p = self.p
        for v, node in enumerate(p.nodes):
            self.x.append([pulp.LpVariable(f"x_{v}_{i}", cat="Binary")
                           for i in range(len(node.strategies))])
        for k, e in enumerate(p.edges):
            self.y.append({ij: pulp.LpVariable(f"y_{k}_{ij[0]}_{ij[1]}", 0, 1)
                           for ij in e.cost})
        self.add_one_strategy_per_node()
        self.add_edge_marginals()
        self.add_ties()
        self.add_memory_budget()
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
            ys = self.y[k]
            for i in range(len(self.x[e.u])):
                self.model += (pulp.lpSum(y for (a, _), y in ys.items() if a == i)
                               == self.x[e.u][i]), f"mu_{k}_{i}"
            for j in range(len(self.x[e.v])):
                self.model += (pulp.lpSum(y for (_, b), y in ys.items() if b == j)
                               == self.x[e.v][j]), f"mv_{k}_{j}"

    def add_ties(self) -> None:
        """For every tie (a, b) and group k: Σ_{i∈A_k} x[a,i] = Σ_{j∈B_k} x[b,j]."""
        for t_i, t in enumerate(self.p.ties):
            for k, (ga, gb) in enumerate(zip(t.groups_a, t.groups_b)):
                self.model += (pulp.lpSum(self.x[t.a][i] for i in ga)
                               == pulp.lpSum(self.x[t.b][j] for j in gb)), f"tie_{t_i}_{k}"

    def add_memory_budget(self) -> None:
        """fixed + Σ_v Σ_i x[v,i] (m_v·memory[v,i] + g_v·gather[v,i]) ≤ budget."""
        p = self.p
        if p.memory_budget == float("inf"):
            return
        k = 1e3 / p.memory_budget if p.memory_budget > 0 else self.MEMORY  # budget = 1000 units
        terms = [k * (n.multiplicity * s.memory_bytes + n.gather_multiplicity * s.gather_bytes)
                 * x for n, xs in zip(p.nodes, self.x) for s, x in zip(n.strategies, xs)]
        self.model += pulp.lpSum(terms) + k * p.fixed_memory <= k * p.memory_budget, "memory"

    def _sum(self, attr: str) -> pulp.LpAffineExpression:
        return pulp.lpSum(self.TIME * n.multiplicity * getattr(s, attr) * x
                          for n, xs in zip(self.p.nodes, self.x)
                          for s, x in zip(n.strategies, xs) if getattr(s, attr))

    def set_objective(self) -> None:
        """min n·(Σ m·(compute + comm) + Σ_e m_e·cost_e·y_e) + E_step + n·E_micro, with
        E_step ≥ Σ m·step_param_comm − overlap·Σ m·bwd_compute, E_micro ≥
        Σ m·micro_param_comm − overlap·Σ m·compute, and E ≥ 0."""
        p = self.p
        n = p.num_microbatches
        edge_cost = pulp.lpSum(self.TIME * e.multiplicity * c * self.y[k][ij]
                               for k, e in enumerate(p.edges) for ij, c in e.cost.items() if c)
        e_step = pulp.LpVariable("exposed_step", 0)
        e_micro = pulp.LpVariable("exposed_micro", 0)
        self.model += e_step >= self._sum("step_param_comm_s") - p.overlap * self._sum(
            "bwd_compute_s"), "exposed_step_def"
        self.model += e_micro >= self._sum("micro_param_comm_s") - p.overlap * self._sum(
            "compute_s"), "exposed_micro_def"
        self.model += n * (self._sum("compute_s") + self._sum("comm_s") + edge_cost) \
            + e_step + n * e_micro

    def solve(self, time_limit_s: float | None = None) -> Solution:
        """Run CBC and read back one strategy per node."""
        t0 = time.perf_counter()
        self.build()
        built = time.perf_counter()
        solver = pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s, gapRel=1e-9)
        status = self.model.solve(solver)
        elapsed = time.perf_counter() - t0
        name = pulp.LpStatus[status]
        if name not in ("Optimal",):
            raise NoFeasiblePlanError(f"the intra-op ILP is {name.lower()}")
        choice = [max(range(len(xs)), key=lambda i: xs[i].value() or 0.0) for xs in self.x]
        ev = evaluate(self.p, choice)
        stats = {"solver": "ilp-cbc", "status": name, "variables": len(self.model.variables()),
                 "constraints": len(self.model.constraints), "build_s": built - t0,
                 "time_s": elapsed}
        return Solution(choice, ev.step_time_s, name, stats)


def solve_ilp(problem: Problem, time_limit_s: float | None = None) -> Solution:
    """Solve ``problem`` to optimality with the ILP; raises NoFeasiblePlanError."""
    return IntraOpILP(problem).solve(time_limit_s)
