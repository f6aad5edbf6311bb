"""Host time on a GPU: the step as the longer path through host and device (formula (**)
of autopar.solvers.problem), the ILP's optimum with it equal to exhaustive search, and
the builder charging exactly the measured figures per op, parameter and mode."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from autopar.capture import capture
from autopar.cost_models.hardware import load_profile
from autopar.cost_models.dispatch import graph_dispatches
from autopar.cost_models.host import dispatch_rates, op_host_time
from autopar.cost_models.memory import saved_for_backward
from autopar.examples.gpt import GPT, GPTConfig
from autopar.flops import op_name
from autopar.plans import RECOMPUTE, SELECTIVE_SAVE_OPS
from autopar.sharding import Mesh
from autopar.solvers.exhaustive import solve_exhaustive
from autopar.solvers import intra_op_host
from autopar.solvers.cost_record import StrategyCost
from autopar.solvers.intra_op_ilp import IntraOpILP
from autopar.solvers.intra_op_solve import solve_ilp
from autopar.solvers.problem import (NodeChoice, Problem, RecomputeGroup, evaluate,
                                     host_exposure)
from autopar.solvers.problem_build import build_problem
from autopar.strategies.analysis import analyze
from autopar.strategies.settings import Settings
from tests.test_solver_random import random_problem


def _simulate(n: int, d_fwd: float, d_bwd: float, h_fwd: float, h_bwd: float,
              h_step: float, d_after: float) -> float:
    """Phases F1 B1 ... Fn Bn O one by one: the host issues each after the last; the
    device runs it after its previous phase, and ends no earlier than its issue."""
    host = device = 0.0
    for h, d in [(h_fwd, d_fwd), (h_bwd, d_bwd)] * n + [(h_step, d_after)]:
        host += h
        device = max(device + d, host)
    return device


@pytest.mark.parametrize("seed", range(200))
def test_host_exposure_equals_the_phase_simulation(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(1, 6)
    d_fwd, d_bwd, d_after = (rng.uniform(0, 1) for _ in range(3))
    h_fwd, h_bwd, h_step = (rng.choice([0.0, rng.uniform(0, 1.5)]) for _ in range(3))
    total = n * (d_fwd + d_bwd) + d_after
    got = total + host_exposure(n, d_fwd, d_bwd, h_fwd, h_bwd, h_step, total)
    assert got == pytest.approx(_simulate(n, d_fwd, d_bwd, h_fwd, h_bwd, h_step, d_after),
                                rel=1e-12, abs=1e-12)


def _with_host(p: Problem, seed: int) -> Problem:
    """``p`` with random host seconds on every strategy, some large enough to bind."""
    rng = random.Random(seed + 1000)
    nodes = []
    for node in p.nodes:
        costs = []
        for s in node.strategies:
            h_bwd = rng.uniform(0, 1.0)
            costs.append(replace(s, host_s=h_bwd + rng.uniform(0, 0.8), host_bwd_s=h_bwd,
                                 param_host_s=rng.choice([0.0, 0.3]), param_host_bwd_s=0.0,
                                 host_step_s=rng.uniform(0, 0.5)))
        nodes.append(replace(node, strategies=costs))
    return replace(p, nodes=nodes)


@pytest.mark.parametrize("phases", [True, False])
@pytest.mark.parametrize("seed", range(8))
def test_ilp_with_host_time_equals_exhaustive(seed: int, phases: bool) -> None:
    """Also with the whole-step host term alone (``host_phases`` False, a pipeline rank's
    problem), where H = max(0, n·(h_F + h_B) + h_O − T)."""
    p = replace(_with_host(random_problem(seed, budget_frac=10.0), seed), host_phases=phases)
    ref = solve_exhaustive(p)
    sol = solve_ilp(p)
    ev = evaluate(p, sol.choice)
    assert ev.step_time_s == pytest.approx(ref.objective_s, rel=1e-6, abs=1e-9)
    assert ev.exposed_host_s >= 0.0
    if not phases:
        device = ev.step_time_s - ev.exposed_host_s
        assert ev.step_time_s == pytest.approx(max(device, ev.host_s), rel=1e-12)


def _group_problem(seed: int) -> Problem:
    """Two nodes in one recomputation group whose modes trade device time against host
    time, as selective and full recomputation do on a GPU."""
    rng = random.Random(seed)
    nodes = [NodeChoice(f"n{v}", [StrategyCost(f"s{i}", compute_s=rng.uniform(0.2, 1),
                                               bwd_compute_s=0.1, memory_bytes=1.0,
                                               host_s=rng.uniform(0, 1.5), host_bwd_s=0.2)
                                  for i in range(2)]) for v in range(2)]

    def table(lo: float, hi: float) -> list[list[list[float]]]:
        return [[[0.0] + [rng.uniform(lo, hi) for _ in range(2)] for _ in range(2)]
                for _ in range(2)]
    grp = RecomputeGroup("block", [0, 1], table(0, 0.6), table(-1, -0.5), table(0, 0.3),
                         RECOMPUTE, (0, 1, 2), host_fwd_s=table(0, 0.8),
                         host_bwd_s=table(0, 1.2))
    return Problem(nodes, [], num_microbatches=rng.randint(1, 3), memory_budget=1.8,
                   recompute=[grp])  # "none" (2.0) does not fit: a mode must be chosen


@pytest.mark.parametrize("seed", range(6))
def test_recomputation_host_time_equals_exhaustive(seed: int) -> None:
    """With the modes enumerated and with the mode variables in one ILP."""
    p = _group_problem(seed)
    ref = solve_exhaustive(p)
    for sol in (solve_ilp(p), IntraOpILP(p).solve()):
        ev = evaluate(p, sol.choice, sol.modes)
        assert ev.feasible
        assert ev.step_time_s == pytest.approx(ref.objective_s, rel=1e-6, abs=1e-9)


FIGURES = {"op_matmul_fwd": 11e-6, "op_matmul_bwd": 13e-6, "op_attention_fwd": 17e-6,
           "op_attention_bwd": 19e-6, "op_norm_fwd": 23e-6, "op_norm_bwd": 29e-6,
           "op_pointwise_fwd": 31e-6, "op_pointwise_bwd": 37e-6, "op_view_fwd": 41e-6,
           "op_view_bwd": 43e-6, "op_embedding_fwd": 47e-6, "op_embedding_bwd": 53e-6,
           "fsdp_param_fwd": 59e-6, "fsdp_param_bwd": 61e-6, "sac_op_fwd": 67e-6,
           "sac_op_bwd": 71e-6, "optimizer_param": 73e-6, "optimizer_param_fsdp": 79e-6,
           "ckpt_op_fwd": 83e-6, "ckpt_op_bwd": 89e-6}
"""Distinct host figures (seconds), so that every count shows in the sum."""


def _gpt(mode: str, n_mb: int):
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=512, max_seq_len=64, dim=256, n_layers=2, n_heads=4))
    g = capture(model, (torch.randint(0, 512, (8, 64), device="meta"),))
    hw = replace(load_profile("h100-sxm"), host_overhead_s=FIGURES)
    st = Settings(Mesh(("dp",), (1,)), 8 // n_mb, n_mb, 0, "bf16", "adamw", 1e12, hw, 8,
                  recompute_modes=(mode,))
    built = build_problem(analyze(g), st)
    return g, built, len(list(model.parameters()))


def _ops_host(g, mode: str) -> tuple[float, float]:
    """(forward + backward per micro-batch, of it the recomputation's) host seconds of
    every op instance of ``g``: the aten ops it dispatches at the figures' seconds per
    dispatched op of each kind, at least its kind's figure, under recomputation
    ``mode``."""
    hw = replace(load_profile("h100-sxm"), host_overhead_s=FIGURES)
    rates = dispatch_rates(hw)
    counts = graph_dispatches(g)
    total = extra = 0.0
    last: dict[int, str] = {}  # layer -> its last op that saves a tensor (early stop)
    for n in g.nodes:
        if n.kind == "op" and n.layer is not None and n.requires_grad \
                and saved_for_backward(n.target, len(n.inputs)):
            last[n.layer] = n.name
    reached: set[int] = set()
    for n in g.nodes:
        if n.kind != "op":
            continue
        fwd, bwd = op_host_time(hw, rates, n, counts[n.name])
        total += fwd + bwd
        if mode != "none" and n.layer is not None:
            hook = "sac_op" if mode == "selective" else "ckpt_op"
            per = counts[n.name].forward_ops if mode == "selective" else 1
            extra += per * (FIGURES[f"{hook}_fwd"] + FIGURES[f"{hook}_bwd"])
            stops = last.get(n.layer) == n.name
            issued = n.layer not in reached and (
                not stops or -1 in saved_for_backward(n.target, len(n.inputs)))
            if issued and (mode == "full" or op_name(n.target) not in SELECTIVE_SAVE_OPS):
                extra += fwd
            if stops:
                reached.add(n.layer)
    return total, extra


@pytest.mark.parametrize("mode,n_mb", [("none", 1), ("none", 4), ("selective", 2),
                                        ("full", 2)])
def test_builder_charges_each_op_parameter_and_mode(mode: str, n_mb: int) -> None:
    """One bf16 device (FSDP2 lays the parameters out): per micro-batch every op's
    dispatched aten ops at their kind's seconds and FSDP2's per parameter, per step
    the optimizer's per DTensor parameter; selective recomputation adds its dispatch
    figures to every aten op the blocks' ops dispatch and re-issues the forward of the
    ops it recomputes; full recomputation adds
    the checkpoint's hook figures to every op of the blocks and re-issues every forward,
    each up to the block's last op that saves a tensor (torch's early stop)."""
    g, built, params = _gpt(mode, n_mb)
    sol = solve_ilp(built.problem)
    assert sol.modes == [RECOMPUTE.index(mode)] * len(built.problem.recompute)
    ev = evaluate(built.problem, sol.choice, sol.modes)
    ops, extra = _ops_host(g, mode)
    fsdp = params * (FIGURES["fsdp_param_fwd"] + FIGURES["fsdp_param_bwd"])
    expect = n_mb * (ops + extra + fsdp) + params * FIGURES["optimizer_param_fsdp"]
    assert ev.host_s == pytest.approx(expect, rel=1e-9)
    assert ev.step_time_s == pytest.approx(
        ev.compute_s + ev.comm_s + ev.exposed_param_comm_s + ev.optimizer_s
        + ev.exposed_host_s, rel=1e-12)


def test_a_host_bound_step_takes_the_host_time() -> None:
    """Tiny ops on a slow host: the device waits, and the step is the host's time plus
    the optimizer's last kernels at most (the device's own time being far less)."""
    g, built, _ = _gpt("none", 4)
    ev = evaluate(built.problem, solve_ilp(built.problem).choice)
    assert ev.exposed_host_s > 0
    device = ev.step_time_s - ev.exposed_host_s
    assert ev.host_s > device
    assert ev.host_s <= ev.step_time_s <= ev.host_s + ev.optimizer_s + 1e-12


def test_no_host_figures_no_host_time() -> None:
    """The CPU profile (host is the device) and a GPU profile without dispatch figures
    charge no host time."""
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=512, max_seq_len=64, dim=256, n_layers=2, n_heads=4))
    an = analyze(capture(model, (torch.randint(0, 512, (8, 64), device="meta"),)))
    for hw in (load_profile("cpu"), replace(load_profile("h100-sxm"), host_overhead_s={})):
        st = Settings(Mesh(("dp",), (1,)), 8, 1, 0, "bf16", "adamw", 1e12, hw, 8)
        built = build_problem(an, st)
        ev = evaluate(built.problem, solve_ilp(built.problem).choice)
        assert ev.host_s == 0.0 and ev.exposed_host_s == 0.0


@pytest.mark.parametrize("seed", range(8))
def test_unproven_host_bound_brackets_the_optimum(seed: int, monkeypatch) -> None:
    """With no time for the exact ILP (:data:`HOST_PROOF_S` 0), a host-bound problem
    returns the fastest Lagrangian minimizer as "Stopped", with a lower bound at most the
    exhaustive optimum; a proven answer is the optimum."""
    monkeypatch.setattr(intra_op_host, "HOST_PROOF_S", 0.0)
    p = replace(_with_host(random_problem(seed, budget_frac=10.0), seed), host_phases=False)
    ref = solve_exhaustive(p).objective_s
    sol = solve_ilp(p)
    got = evaluate(p, sol.choice).step_time_s
    assert got == pytest.approx(sol.objective_s, rel=1e-12)
    if sol.status == "Optimal":
        assert got == pytest.approx(ref, rel=1e-6)
    else:
        assert sol.status == "Stopped"
        assert sol.stats["lower_bound_s"] <= ref * (1 + 1e-9) <= got * (1 + 2e-9)


@pytest.mark.parametrize("seed", range(4))
def test_host_bound_problem_keeps_the_callers_bound(seed: int) -> None:
    """``bound`` below the optimum: None or an assignment no faster than the optimum
    (the caller needs only one below the bound); just above: the optimum."""
    p = replace(_with_host(random_problem(seed, budget_frac=10.0), seed), host_phases=False)
    ref = solve_exhaustive(p).objective_s
    low = solve_ilp(p, bound=ref * (1 - 1e-6))
    assert low is None or evaluate(p, low.choice).step_time_s >= ref * (1 - 1e-9)
    sol = solve_ilp(p, bound=ref * (1 + 1e-6))
    assert evaluate(p, sol.choice).step_time_s == pytest.approx(ref, rel=1e-6)
