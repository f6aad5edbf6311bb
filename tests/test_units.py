"""Pipeline units: their costs are an exact partition of the intra-op objective."""

import pytest
import torch

from autopar.capture import capture
from autopar.cost_models.hardware import load_profile
from autopar.examples.gpt import GPT, GPTConfig
from autopar.sharding import Mesh
from autopar.solvers.ilp import solve_ilp
from autopar.solvers.problem import evaluate
from autopar.solvers.units import recompute_transient, unit_costs
from autopar.strategies.analysis import analyze
from autopar.strategies.build import Settings, build_problem


@pytest.mark.parametrize("mesh,zero", [((1, 4), 0), ((2, 2), 0), ((4, 1), 3)])
def test_unit_costs_sum_to_the_objective(mesh, zero):
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=512, max_seq_len=64, dim=128, n_layers=3, n_heads=4))
    g = capture(model, (torch.randint(0, 512, (8, 64), device="meta"),))
    st = Settings(Mesh(("dp", "tp"), mesh), 2, 1, zero, "bf16", "adamw", 1e12,
                  load_profile("h100-sxm"), 8)
    built = build_problem(analyze(g), st)
    sol = solve_ilp(built.problem)
    ev = evaluate(built.problem, sol.choice)
    memory = [[s.memory for s in ss] for ss in built.strategies]
    units = unit_costs(g, built.problem, built.names, memory, sol.choice)
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
