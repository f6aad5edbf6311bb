"""The intra-op ILP's optimum equals exhaustive search on random problems."""

import random

import pytest

from autopar.errors import NoFeasiblePlanError
from autopar.solvers.exhaustive import solve_exhaustive
from autopar.solvers.intra_op_solve import solve_ilp
from autopar.solvers.cost_record import StrategyCost
from autopar.solvers.problem import EdgeChoice, NodeChoice, Problem, Tie, evaluate


def random_problem(seed: int, n_nodes: int = 5, budget_frac: float = 0.8) -> Problem:
    rng = random.Random(seed)
    nodes = []
    for v in range(n_nodes):
        k = rng.randint(1, 4)
        nodes.append(NodeChoice(f"n{v}", [
            StrategyCost(f"s{i}", compute_s=rng.uniform(0, 1), bwd_compute_s=rng.uniform(0, .5),
                         comm_s=rng.uniform(0, .3), micro_param_comm_s=rng.uniform(0, .4),
                         step_param_comm_s=rng.uniform(0, 2), memory_bytes=rng.uniform(1, 10),
                         gather_bytes=rng.uniform(0, 2))
            for i in range(k)], multiplicity=rng.randint(1, 3), gather_multiplicity=rng.randint(0, 2)))
    edges = []
    for v in range(1, n_nodes):
        u = rng.randrange(v)
        cost = {}
        for i in range(len(nodes[u].strategies)):
            for j in range(len(nodes[v].strategies)):
                if rng.random() < 0.8 or i == 0:
                    cost[(i, j)] = rng.choice([0.0, rng.uniform(0, 1)])
        edges.append(EdgeChoice(u, v, cost, rng.randint(1, 2)))
    ties = []
    if n_nodes >= 3 and len(nodes[0].strategies) >= 2 and len(nodes[2].strategies) >= 2:
        ties.append(Tie(0, 2, [[0], list(range(1, len(nodes[0].strategies)))],
                        [[0], list(range(1, len(nodes[2].strategies)))]))
    max_mem = sum(n.multiplicity * max(s.memory_bytes for s in n.strategies)
                  + n.gather_multiplicity * max(s.gather_bytes for s in n.strategies) for n in nodes)
    return Problem(nodes, edges, ties, num_microbatches=rng.randint(1, 3),
                   memory_budget=budget_frac * max_mem, overlap=rng.choice([1.0, 0.5]))


@pytest.mark.parametrize("seed", range(8))
def test_ilp_equals_exhaustive(seed):
    p = random_problem(seed)
    try:
        ref = solve_exhaustive(p)
    except NoFeasiblePlanError:
        with pytest.raises(NoFeasiblePlanError):
            solve_ilp(p)
        return
    sol = solve_ilp(p)
    ev = evaluate(p, sol.choice)
    assert ev.feasible
    assert ev.step_time_s == pytest.approx(ref.objective_s, rel=1e-6, abs=1e-9)


def test_evaluate_counts_overlap_exactly():
    s = StrategyCost("a", compute_s=1.0, bwd_compute_s=0.6, comm_s=0.1, micro_param_comm_s=1.5,
                     step_param_comm_s=1.0, memory_bytes=5.0)
    p = Problem([NodeChoice("n", [s], multiplicity=2)], [], num_microbatches=3, overlap=1.0)
    ev = evaluate(p, [0])
    # per micro-batch: 2*(1.0+0.1); exposed step comm: max(0, 2*1.0 - 2*0.6) = 0.8;
    # exposed micro comm: 3 * max(0, 2*1.5 - 2*1.0) = 3.0
    assert ev.step_time_s == pytest.approx(3 * 2.2 + 0.8 + 3.0)
    assert ev.memory_bytes == pytest.approx(10.0)
