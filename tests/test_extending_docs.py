"""docs/extending.md's examples, run: a sharding rule for a custom operator (the planner
then splits it; DTensor runs it split once its own sharding is registered), a pipeline
schedule's op order priced by the simulator, a heuristic in place of the intra-op ILP,
and a cost model swapped on the solver's problem. Every Python block of the page is
taken verbatim from this file."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.experimental import register_sharding

import autopar
from autopar.capture import capture
from autopar.examples.gpt import GPT, GPTConfig
from autopar.graph import Graph
from autopar.sharding import Mesh
from autopar.solvers.bounds import tree_bound
from autopar.solvers.cost_record import StrategyCost, term
from autopar.solvers.cost_terms import PieceCost
from autopar.solvers.intra_op_solve import solve_ilp
from autopar.solvers.problem import Problem, evaluate
from autopar.solvers.problem_build import Built, build_problem
from autopar.solvers.schedule_sim import Timeline, simulate
from autopar.solvers.units import unit_costs
from autopar.strategies import rules
from autopar.strategies.analysis import analyze
from autopar.strategies.settings import Settings
from tests.dist_utils import RankPool

PAGE = Path(__file__).resolve().parent.parent / "docs" / "extending.md"


# -- a custom operator and its sharding rule ------------------------------------------

@torch.library.custom_op("autopar_docs::gate", mutates_args=())
def gate(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(w)``, ``w`` broadcast over the last dim of ``x``."""
    return x * torch.sigmoid(w)


@gate.register_fake
def _gate_fake(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _gate_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _gate_backward(ctx, grad: torch.Tensor):
    x, w = ctx.saved_tensors
    s = torch.sigmoid(w)
    return grad * s, (grad * x * s * (1 - s)).reshape(-1, w.shape[-1]).sum(0)


gate.register_autograd(_gate_backward, setup_context=_gate_setup)


class GatedMLP(nn.Module):
    """An embedding, a gated MLP around the custom op, and a head."""

    def __init__(self, vocab: int = 128, dim: int = 64, hidden: int = 256) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.up = nn.Linear(dim, hidden)
        self.gate = nn.Parameter(torch.zeros(hidden))
        self.down = nn.Linear(hidden, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        return self.head(h + self.down(gate(F.gelu(self.up(h)), self.gate)))


def gate_rule(node, in_metas, fresh):
    """gate is pointwise with broadcasting: the dims of x and the output share labels
    d0, d1, d2, and w's one dim carries d2."""
    return rules.broadcast_rule(in_metas, node.out, fresh)


@register_sharding(torch.ops.autopar_docs.gate.default)
def gate_sharding(x, w):
    """DTensor's side: (output placements, input placements) pairs gate may run under."""
    last = x.ndim - 1
    pairs = [([Replicate()], [Replicate(), Replicate()]),
             ([Shard(last)], [Shard(last), Shard(0)])]
    return pairs + [([Shard(d)], [Shard(d), Replicate()]) for d in range(last)]


def gate_strategies() -> tuple[str, set[tuple]]:
    """The gate node's rule kind and its strategies' (x, w, output) placements on a
    dp2 x tp2 mesh of CPU processes."""
    x = torch.randint(0, 128, (8, 16))
    an = analyze(capture(GatedMLP(), (x,)))
    st = Settings(mesh=Mesh(("dp", "tp"), (2, 2)), microbatch_size=4, num_microbatches=1,
                  zero=0, precision="fp32", optimizer="adamw", memory_budget=1e12,
                  hw=autopar.Cluster("cpu", 1, 4).hardware(), gpus_per_node=4)
    built = build_problem(an, st)
    k = next(i for i, name in enumerate(built.names)
             if an.graph.node(name).target == "autopar_docs.gate.default")
    return (an.rules[built.names[k]].kind,
            {(s.ins[0], s.ins[1], s.out) for s in built.strategies[k]})


def test_a_rule_lets_tensor_parallelism_split_the_operator(monkeypatch) -> None:
    kind, before = gate_strategies()
    assert kind == "fallback"
    assert before == {(("S(0)", "R"), ("R", "R"), ("S(0)", "R"))}  # batch over dp only
    monkeypatch.setitem(rules._HANDLERS, "gate", gate_rule)
    kind, after = gate_strategies()
    assert kind == "pointwise"
    assert (("S(0)", "S(2)"), ("R", "S(0)"), ("S(0)", "S(2)")) in after  # hidden over tp
    assert before < after


def test_the_rule_agrees_with_running_the_operator_on_shards() -> None:
    """Equal to the last bit but for sigmoid's vectorized kernel, which may round a
    16-wide vector and two 8-wide halves one ulp apart."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(4, 8, 16, generator=g), torch.randn(16, generator=g)
    whole = gate(x, w)
    split_hidden = [gate(xs, ws) for xs, ws in zip(x.chunk(2, dim=2), w.chunk(2))]
    torch.testing.assert_close(torch.cat(split_hidden, dim=2), whole, rtol=3e-7, atol=0.0)
    split_batch = [gate(xs, w) for xs in x.chunk(2, dim=0)]
    assert torch.equal(torch.cat(split_batch, dim=0), whole)


def test_the_planner_splits_the_operator_once_it_has_a_rule(monkeypatch) -> None:
    with torch.device("meta"):
        model = GatedMLP(vocab=32000, dim=2048, hidden=8192)
    x = torch.randint(0, 32000, (8, 2048), device="meta")
    h100x2 = autopar.Cluster("h100-sxm", 1, 2)
    without = autopar.plan(model, (x,), cluster=h100x2, dp=1, tp=2)
    monkeypatch.setitem(rules._HANDLERS, "gate", gate_rule)
    with_rule = autopar.plan(model, (x,), cluster=h100x2, dp=1, tp=2)
    assert without.params["gate"] == ["R", "R"] and with_rule.params["gate"] == ["R", "S(0)"]
    assert with_rule.params["up.weight"] == ["R", "S(0)"]      # colwise
    assert with_rule.params["down.weight"] == ["R", "S(1)"]    # rowwise
    assert with_rule.step_time_s < without.step_time_s


def dtensor_gate() -> tuple[str, tuple[int, ...], bool]:
    """On each of 2 ranks: gate on x split along its hidden dim and w split alike."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    x, w = torch.randn(4, 8, 16), torch.randn(16)
    out = gate(distribute_tensor(x, mesh, [Shard(2)]), distribute_tensor(w, mesh, [Shard(0)]))
    return str(out.placements), tuple(out.to_local().shape), \
        torch.allclose(out.full_tensor(), gate(x, w))


@pytest.mark.multirank
def test_dtensor_runs_the_operator_split(rank_pool: RankPool) -> None:
    got = rank_pool.run(2, dtensor_gate)
    assert got == [("(Shard(dim=2),)", (4, 8, 8), True)] * 2


# -- a pipeline schedule's op order -----------------------------------------------------

def eager_1f1b(pp: int, m: int) -> list[list[tuple[str, int, int]]]:
    """1F1B with one more warm-up forward per rank than torch's Schedule1F1B:
    rank r runs min(m, pp - r + 1) forwards, then alternates backward and forward."""
    orders = []
    for r in range(pp):
        warm = min(m, pp - r + 1)
        ops = [("F", r, j) for j in range(warm)]
        for j in range(m):
            ops.append(("B", r, j))
            if warm + j < m:
                ops.append(("F", r, warm + j))
        orders.append(ops)
    return orders


def test_a_new_op_order_runs_through_the_simulator() -> None:
    pp, m = 4, 8
    chunks = [PieceCost(forward_s=1.0, backward_s=2.0, activation_bytes=1.0)
              for _ in range(pp)]
    eager = Timeline.of("1f1b", pp, m, 1, orders=eager_1f1b(pp, m))
    for p2p_s, torch_1f1b, mine in [(0.0, 33.0, 33.0), (0.25, 37.0, 36.5), (0.5, 41.0, 40.0)]:
        assert simulate("1f1b", chunks, pp, m, p2p_s=p2p_s).step_time_s == torch_1f1b
        assert eager.estimate(chunks, p2p_s).step_time_s == mine
    assert simulate("1f1b", chunks, pp, m).in_flight == [4, 3, 2, 1]
    assert eager.estimate(chunks, 0.0).in_flight == [5, 4, 3, 2]


# -- a heuristic in place of the intra-op ILP, and a cost model swapped -----------------

def gpt_built(microbatch_size: int = 8) -> tuple[Graph, Built]:
    """A 2-block GPT's graph and its intra-op problem on dp2 x tp4 of one 8-GPU H100
    node, each data-parallel rank's 8 sequences cut into micro-batches of
    ``microbatch_size``."""
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=50304, max_seq_len=2048, dim=4096, n_layers=2,
                              n_heads=32))
    x = torch.randint(0, 50304, (16, 2048), device="meta")
    g = capture(model, (x,))
    st = Settings(mesh=Mesh(("dp", "tp"), (2, 4)), microbatch_size=microbatch_size,
                  num_microbatches=8 // microbatch_size, zero=0, precision="bf16",
                  optimizer="adamw", memory_budget=70e9,
                  hw=autopar.Cluster("h100-sxm", 1, 8).hardware(), gpus_per_node=8)
    return g, build_problem(analyze(g), st)


def gpt_problem() -> tuple[Problem, list]:
    """The intra-op problem of a 2-block GPT on dp2 x tp4 of one 8-GPU H100 node."""
    _, built = gpt_built()
    return built.problem, built.strategies


def greedy(p: Problem) -> list[int]:
    """Nodes in order, each trying its strategies cheapest first (its own time plus the
    resharding from the nodes chosen before it), backing up where none agrees with the
    edges and ties to earlier nodes: the first complete choice wins."""
    edges_at, ties_at = [[] for _ in p.nodes], [[] for _ in p.nodes]
    for e in p.edges:
        edges_at[max(e.u, e.v)].append(e)
    for t in p.ties:
        ties_at[max(t.a, t.b)].append(t)
    choice: list[int] = []

    def group(groups: list[list[int]], i: int) -> int:
        return next((k for k, g in enumerate(groups) if i in g), -1)

    def cost(v: int, i: int) -> float:
        s = p.nodes[v].strategies[i].total
        total = p.nodes[v].multiplicity * (s.device_s + s.comm_s)
        for e in edges_at[v]:
            pair = (choice[e.u], i) if e.v == v else (i, choice[e.v])
            if pair not in e.cost:
                return float("inf")
            total += e.multiplicity * e.cost[pair]
        for t in ties_at[v]:
            a, b = (choice[t.a], i) if t.b == v else (i, choice[t.b])
            if group(t.groups_a, a) != group(t.groups_b, b):
                return float("inf")
        return total

    def walk(v: int) -> bool:
        if v == len(p.nodes):
            return True
        for c, i in sorted((cost(v, i), i) for i in range(len(p.nodes[v].strategies))):
            if c == float("inf"):
                return False
            choice.append(i)
            if walk(v + 1):
                return True
            choice.pop()
        return False

    if not walk(0):
        raise RuntimeError("no assignment agrees with the edges and ties")
    return choice


def test_a_heuristic_solver_is_scored_by_the_same_objective() -> None:
    p, _ = gpt_problem()
    ilp = solve_ilp(p)
    mine = greedy(p)
    by_ilp = evaluate(p, ilp.choice, ilp.modes)
    by_greedy = evaluate(p, mine, [0] * len(p.recompute))  # no recomputation
    assert by_ilp.feasible and by_greedy.feasible
    assert by_ilp.step_time_s <= by_greedy.step_time_s


def with_comm_scaled(p: Problem, k: float) -> Problem:
    """``p`` priced by another communication model: every collective and resharding
    ``k`` times what the shipped model says."""
    nodes = [replace(n, strategies=[replace(s, comm_s=k * s.comm_s,
                                            micro_param_comm_s=k * s.micro_param_comm_s,
                                            step_param_comm_s=k * s.step_param_comm_s)
                                    for s in n.strategies]) for n in p.nodes]
    edges = [replace(e, cost={pair: k * c for pair, c in e.cost.items()}) for e in p.edges]
    return replace(p, nodes=nodes, edges=edges)


def test_a_swapped_cost_model_is_solved_and_compared() -> None:
    p, _ = gpt_problem()
    shipped = solve_ilp(p)
    slow_links = with_comm_scaled(p, 4.0)
    resolved = solve_ilp(slow_links)
    old = evaluate(slow_links, shipped.choice, shipped.modes)
    new = evaluate(slow_links, resolved.choice, resolved.modes)
    assert new.feasible and new.step_time_s <= old.step_time_s
    assert new.comm_s < old.comm_s  # it trades communication away


@dataclass
class WithLaunches(StrategyCost):
    """The solver's record with one more term: kernel launches the pricer left out
    (seconds per micro-batch, forward + backward), part of the device's time."""

    launch_s: float = term("device_s")


def with_launches(built: Built, seconds: Callable[[int, int], float]) -> Built:
    """``built`` with strategy i of node v paying ``seconds(v, i)`` of launches."""
    def more(v: int, i: int, s: StrategyCost) -> WithLaunches:
        given = {f.name: getattr(s, f.name) for f in fields(s) if f.init}
        return WithLaunches(**given, launch_s=seconds(v, i))

    nodes = [replace(n, strategies=[more(v, i, s) for i, s in enumerate(n.strategies)])
             for v, n in enumerate(built.problem.nodes)]
    return replace(built, problem=replace(built.problem, nodes=nodes))


def test_a_new_term_reaches_the_objective_the_bounds_and_the_units() -> None:
    g, built = gpt_built(microbatch_size=4)  # 2 micro-batches
    more = with_launches(built, lambda v, i: 1e-4)
    p, q = built.problem, more.problem
    per_microbatch = 1e-4 * sum(n.multiplicity for n in p.nodes)
    shipped = solve_ilp(p)
    before = evaluate(p, shipped.choice, shipped.modes)
    after = evaluate(q, shipped.choice, shipped.modes)
    assert after.compute_s == pytest.approx(before.compute_s + 2 * per_microbatch)
    assert tree_bound(q) == pytest.approx(tree_bound(p) + per_microbatch)
    v = max(range(len(p.nodes)), key=lambda k: len(p.nodes[k].strategies))
    avoid = with_launches(built, lambda k, i: 1.0 if (k, i) == (v, shipped.choice[v]) else 0.0)
    assert solve_ilp(avoid.problem).choice[v] != shipped.choice[v]  # the ILP sees it too
    units = [unit_costs(g, b, shipped.choice, shipped.modes) for b in (built, more)]
    forward = [sum(u.forward_s for u in us) for us in units]
    assert forward[1] == pytest.approx(forward[0] + per_microbatch)


def test_every_python_block_of_the_page_is_code_of_this_file() -> None:
    text = Path(__file__).read_text()
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.DOTALL)
    assert blocks
    for block in blocks:
        assert block in text, block[:200]
