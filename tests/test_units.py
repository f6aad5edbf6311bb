"""Pipeline units: their costs are an exact partition of the intra-op objective."""

import pytest
import torch

from autopar.capture import capture
from autopar.cost_models.hardware import load_profile
from autopar.examples.gpt import GPT, GPTConfig
from autopar.sharding import Mesh
from autopar.solvers.intra_op_solve import solve_ilp
from autopar.solvers.problem import evaluate
from autopar.solvers.problem_build import build_problem
from autopar.solvers.units import recompute_transient, unit_costs
from autopar.strategies.analysis import analyze
from autopar.strategies.settings import Settings


def _solved(mesh: tuple[int, int], zero: int):
    """A 3-block GPT with a tied head on a dp × tp mesh, bf16 AdamW, and the ILP's
    solution."""
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=512, max_seq_len=64, dim=128, n_layers=3, n_heads=4))
    g = capture(model, (torch.randint(0, 512, (8, 64), device="meta"),))
    st = Settings(Mesh(("dp", "tp"), mesh), 2, 1, zero, "bf16", "adamw", 1e12,
                  load_profile("h100-sxm"), 8)
    built = build_problem(analyze(g), st)
    return g, built, solve_ilp(built.problem)


@pytest.mark.parametrize("mesh,zero", [((1, 4), 0), ((2, 2), 0), ((4, 1), 3)])
def test_unit_costs_sum_to_the_objective(mesh, zero):
    g, built, sol = _solved(mesh, zero)
    ev = evaluate(built.problem, sol.choice)
    units = unit_costs(g, built, sol.choice)
    assert [u.name for u in units] == ["pre", "blocks.0", "blocks.1", "blocks.2", "post"]
    assert units[0].modules == ["tok_emb", "pos_emb"]
    assert units[-1].modules == ["ln_f", "head"]  # the head reads tok_emb's weight (tied)
    per_micro = sum(u.forward_s + u.backward_s for u in units)
    assert per_micro == pytest.approx(ev.compute_s + ev.comm_s + sum(
        n.multiplicity * n.strategies[c].micro_param_comm_s
        for n, c in zip(built.problem.nodes, sol.choice)), rel=1e-9)
    assert sum(u.step_comm_s for u in units) == pytest.approx(
        sum(n.multiplicity * n.strategies[c].step_param_comm_s
            for n, c in zip(built.problem.nodes, sol.choice)), rel=1e-9)
    mem = sum(u.activation_bytes + u.static_bytes for u in units)
    gathered = sum(n.gather_multiplicity * n.strategies[c].gather_bytes
                   for n, c in zip(built.problem.nodes, sol.choice))
    transient = recompute_transient(built.problem, sol.choice, sol.modes)  # once per rank
    assert mem + gathered + transient == pytest.approx(ev.memory_bytes, rel=1e-9)
    blocks = units[1:-1]
    assert all(b.forward_s == pytest.approx(blocks[0].forward_s) for b in blocks)


@pytest.mark.parametrize("mesh,zero", [((2, 1), 0), ((2, 1), 3), ((1, 2), 0)])
def test_pipeline_units_hold_a_copy_of_the_tied_weight(mesh, zero):
    """Pipelined, the head's unit holds its own copy of the embedding weight it reads:
    the same parameter, gradient and optimizer bytes per device as the embedding's,
    its optimizer step, and the sum of the copies' fp32 gradient shards."""
    g, built, sol = _solved(mesh, zero)
    plain = unit_costs(g, built, sol.choice)
    sums = []
    piped = unit_costs(g, built, sol.choice, tied_sync=lambda b: sums.append(b) or 1e-3)
    k = built.names.index("embedding")
    pieces = 1
    for p, size in zip(built.strategies[k][sol.choice[k]].ins[0], mesh):
        pieces *= size if p.startswith("S(") else 1
    local = 512 * 128 / pieces  # tok_emb.weight's elements on one device
    shard = mesh[0] if zero >= 1 else 1
    own = built.strategies[k][sol.choice[k]].memory  # the embedding op owns only the weight
    assert own["params"] > 0
    assert piped[-1].static_bytes - plain[-1].static_bytes == pytest.approx(
        sum(v for c, v in own.items() if c != "activations"))
    assert sums == [pytest.approx(4.0 * local / shard)]
    emb = built.problem.nodes[k].strategies[sol.choice[k]]
    assert piped[-1].optimizer_s - plain[-1].optimizer_s == pytest.approx(emb.optimizer_s + 1e-3)
    assert [u.static_bytes for u in piped[:-1]] == [u.static_bytes for u in plain[:-1]]


@pytest.mark.parametrize("mesh,zero", [((1, 4), 0), ((2, 2), 3)])
def test_least_unit_costs_bound_every_choice(mesh, zero):
    """Per unit, the least costs are at most the unit costs of any strategy choice
    (random choices and recomputation modes, with and without the tied copy), and
    their sum is at most the ILP optimum's."""
    import random

    from autopar.solvers.pipelined_candidate import tied_sync
    from autopar.solvers.units import least_unit_costs, unit_members
    g, built, sol = _solved(mesh, zero)
    least = least_unit_costs(built, unit_members(g))
    rng = random.Random(0)
    p = built.problem
    for trial in range(30):
        choice = [rng.randrange(len(n.strategies)) for n in p.nodes]
        modes = [rng.choice(grp.allowed) for grp in p.recompute]
        for units in (unit_costs(g, built, choice, modes),
                      unit_costs(g, built, choice, modes, tied_sync(built, 2))):
            for u, lo in zip(units, least):
                assert u.forward_s >= lo.forward_s * (1 - 1e-12)
                assert u.backward_s >= lo.backward_s * (1 - 1e-12)
                assert u.optimizer_s >= lo.optimizer_s * (1 - 1e-12)
    total = sum(lo.forward_s + lo.backward_s for lo in least)
    ev = evaluate(p, sol.choice)
    assert 0 < total <= ev.compute_s + ev.comm_s + sum(
        n.multiplicity * n.strategies[c].micro_param_comm_s for n, c in zip(p.nodes, sol.choice))
