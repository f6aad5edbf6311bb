"""Memory planning: the recomputation choice inside the ILP equals exhaustive search,
plans walk through cheaper-memory choices as the budget falls, and GPT-3 175B on 64
A100s prefers sequence parallelism with selective over full recomputation."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autopar
from autopar.capture import capture
from autopar.cost_models.hardware import load_profile
from autopar.errors import NoFeasiblePlanError
from autopar.examples.gpt import GPT, GPTConfig
from autopar.sharding import Mesh
from autopar.solvers.exhaustive import solve_exhaustive
from autopar.solvers.intra_op_ilp import IntraOpILP
from autopar.solvers.intra_op_solve import solve_ilp
from autopar.solvers.problem import evaluate
from autopar.solvers.problem_build import build_problem
from autopar.strategies.analysis import analyze
from autopar.strategies.settings import Settings


class MLPBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return x + torch.nn.functional.gelu(self.fc(x))


class Stack(nn.Module):
    def __init__(self, d: int = 16, n: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MLPBlock(d) for _ in range(n))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def _ilp(problem):
    """The full ILP, without solve_ilp's shortcut for budgets nothing can exceed."""
    return IntraOpILP(problem).solve()


@pytest.mark.parametrize("mesh,zero", [((1, 2), 0), ((2, 1), 3), ((2, 2), 0)])
def test_recompute_choice_ilp_equals_exhaustive(mesh, zero) -> None:
    torch.manual_seed(0)
    g = capture(Stack(), (torch.randn(8, 64, 16),))
    built = build_problem(analyze(g), Settings(Mesh(("dp", "tp"), mesh), 4, 2, zero, "bf16",
                                               "adamw", float("inf"), load_profile("h100-sxm"), 8))
    p = built.problem
    assert len(p.recompute) == 1 and p.recompute[0].name == "blocks.0,blocks.1,blocks.2"
    free = solve_exhaustive(p)
    assert free.modes == [0]
    top = evaluate(p, free.choice, [0]).memory_bytes
    seen = set()
    for frac in (0.995, 0.97, 0.94, 0.9, 0.85, 0.8, 0.7, 0.6, 0.5):
        p.memory_budget = frac * top
        try:
            ref = solve_exhaustive(p)
        except NoFeasiblePlanError:
            with pytest.raises(NoFeasiblePlanError):
                _ilp(p)
            with pytest.raises(NoFeasiblePlanError):
                solve_ilp(p)
            continue
        for sol in (_ilp(p), solve_ilp(p)):  # mode variables; modes enumerated
            ev = evaluate(p, sol.choice, sol.modes)
            assert ev.feasible and ev.step_time_s == pytest.approx(ref.objective_s, rel=1e-6)
        seen.add(ref.modes[0])
    assert seen & {1, 2}, "the budgets never made recomputation necessary"


def gpt(dim: int = 256, layers: int = 8, seq: int = 256, vocab: int = 1024, batch: int = 16):
    """A meta-device GPT and one example batch."""
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=vocab, max_seq_len=seq, dim=dim, n_layers=layers,
                              n_heads=8))
    return model, (torch.randint(0, vocab, (batch, seq), device="meta"),)


def test_budget_walk_moves_through_cheaper_memory_choices() -> None:
    model, x = gpt()
    cluster = autopar.Cluster("h100-sxm", 1, 4)
    fixed = dict(global_batch=16, pp=1, tp=1, microbatch_size=4)
    free = autopar.plan(model, x, cluster=cluster, **fixed)
    assert set(free.recompute.values()) == {"none"} and not free.offload
    budget = free.memory_per_device_bytes
    seen: list[tuple] = []
    last_time = free.step_time_s
    while True:
        budget *= 0.8
        try:
            plan = autopar.plan(model, x, cluster=cluster, memory_budget=budget, **fixed)
        except NoFeasiblePlanError as e:
            assert "the smallest needs at least" in str(e)
            break
        assert plan.memory_per_device_bytes <= budget * (1 + 1e-9)
        assert plan.step_time_s >= last_time * (1 - 1e-9)
        assert len(plan.recompute) == 8
        last_time = plan.step_time_s
        seen.append((plan.zero, plan.offload, plan.recompute["blocks.0"]))
    modes = {m for _, _, m in seen}
    # On the H100 profile this small model is host-bound: selective recomputation's
    # dispatch mode costs more host time than full recomputation's re-run forward
    # (the measured figures, benchmarks/results/README.md), so the walk goes to "full".
    assert "full" in modes and "selective" not in modes, seen
    assert any(z == 3 for z, _, _ in seen), seen
    assert any(off for _, off, _ in seen), seen
    summary = plan.summary() if seen else ""
    assert "recompute" in summary


def test_gpt3_175b_prefers_sequence_parallel_with_selective_recompute() -> None:
    from autopar.examples import zoo

    model, x = zoo.get("gpt3-175b", batch_size=1)
    cluster = autopar.Cluster("a100-80g", 8, 8)
    common = dict(tp=8, pp=8, microbatch_size=1)
    chosen = autopar.estimate(model, x, autopar.Spec(**common, sequence_parallel=True),
                              cluster=cluster, global_batch=64)
    sel = autopar.estimate(model, x, autopar.Spec(**common, sequence_parallel=True,
                                                  recompute="selective"),
                           cluster=cluster, global_batch=64)
    full = autopar.estimate(model, x, autopar.Spec(**common, recompute="full"),
                            cluster=cluster, global_batch=64)
    # with the exact per-rank memory of its stage split, the chosen plan may fit with
    # less recomputation than selective; it never takes full recomputation
    assert chosen.sequence_parallel and "full" not in set(chosen.recompute.values())
    assert chosen.step_time_s <= sel.step_time_s * (1 + 1e-9)
    assert sel.step_time_s < full.step_time_s
    for p in (chosen, sel, full):
        assert p.memory_per_device_bytes <= cluster.hardware().usable_memory_bytes
