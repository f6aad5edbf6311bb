"""The search's pruning bounds never exceed what an assignment can achieve: checked
against every assignment of random problems with recomputation groups, flat and on
a pipeline rank."""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

import pytest

from autopar.solvers.bounds import (combo_bounds, hull_exchanges, knapsack_bound, step_bound,
                                    tree_bound)
from autopar.solvers.problem import RecomputeGroup, evaluate
from tests.test_solver_random import random_problem


def _with_group(seed: int):
    """A random problem whose nodes 1 and 2 form one recomputation group."""
    rng = random.Random(1000 + seed)
    p = random_problem(seed, n_nodes=5, budget_frac=rng.choice([0.6, 0.8, 1.2]))
    nodes = [1, 2]
    extra, delta, trans = [], [], []
    for v in nodes:
        n = len(p.nodes[v].strategies)
        extra.append([[0.0, rng.uniform(0, .3), rng.uniform(.3, .6)] for _ in range(n)])
        d = [[0.0, -rng.uniform(0, 2), -rng.uniform(2, 4)] for _ in range(n)]
        delta.append(d)
        trans.append([[-x for x in row] for row in d])
    grp = RecomputeGroup("g", nodes, extra, delta, trans)
    nodes_ = [replace(n, strategies=[replace(s, backward_start_bytes=rng.uniform(0, 1),
                                             recompute_bytes=rng.uniform(0, 1))
                                     for s in n.strategies]) for n in p.nodes]
    return replace(p, nodes=nodes_, recompute=[grp])


def _assignments(p):
    yield from itertools.product(*(range(len(n.strategies)) for n in p.nodes))


@pytest.mark.parametrize("seed", range(12))
def test_combo_bounds_never_exceed_any_assignment(seed):
    p = _with_group(seed)
    for cb in combo_bounds(p):
        times, mems = [], []
        for choice in _assignments(p):
            ev = evaluate(replace(p, memory_budget=float("inf")), list(choice), list(cb.modes))
            if not ev.feasible:  # an edge or tie rules it out
                continue
            mems.append(ev.memory_bytes)
            if ev.memory_bytes <= p.memory_budget:
                times.append(ev.step_time_s)
        assert cb.memory_bytes <= min(mems) * (1 + 1e-12)
        if times:  # (with none fitting, any bound holds)
            assert p.num_microbatches * cb.time_s <= min(times) * (1 + 1e-12)


@pytest.mark.parametrize("seed", range(6))
def test_pipeline_rank_bounds_match_the_scaled_problem(seed):
    p = _with_group(seed)
    rng = random.Random(seed)
    acts = [[rng.uniform(0, s.memory_bytes) for s in n.strategies] for n in p.nodes]
    pp, held = 4, 3
    scaled = replace(p, nodes=[replace(n, strategies=[
        replace(s, memory_bytes=(s.memory_bytes - a + a * held) / pp)
        for s, a in zip(n.strategies, acts[v])]) for v, n in enumerate(p.nodes)],
        recompute=[replace(g, activation_scale=held / pp) for g in p.recompute])
    for cb, ref in zip(combo_bounds(p, acts, pp, held), combo_bounds(scaled)):
        assert cb.memory_bytes == pytest.approx(ref.memory_bytes, rel=1e-12)
        assert cb.time_s == pytest.approx(ref.time_s, rel=1e-12)


def test_tree_bound_is_exact_on_a_tree():
    """On a problem whose edges form a tree and with no memory term, the forest bound is
    the optimum itself."""
    p = replace(random_problem(3, n_nodes=6), ties=[], memory_budget=float("inf"))
    p = replace(p, nodes=[replace(n, strategies=[replace(s, micro_param_comm_s=0.0,
                                                         step_param_comm_s=0.0)
                                                 for s in n.strategies]) for n in p.nodes])
    best = min(evaluate(p, list(c)).step_time_s for c in _assignments(p)
               if evaluate(p, list(c)).feasible)
    assert p.num_microbatches * tree_bound(p) == pytest.approx(best, rel=1e-12)


def test_hull_and_knapsack_on_a_known_instance():
    # node A: (memory, time) points; the middle one lies above the hull and is skipped
    t, m, segs = hull_exchanges([(10.0, 1.0), (6.0, 3.0), (2.0, 4.0)])
    assert (t, m) == (1.0, 10.0) and segs == [(0.375, 8.0)]
    # buying 4 bytes at 0.375 s/byte costs 1.5 s; more than the hull frees is infeasible
    assert knapsack_bound(segs, t, m, capacity=6.0) == pytest.approx(2.5)
    assert knapsack_bound(segs, t, m, capacity=1.0) == float("inf")


@pytest.mark.parametrize("seed", range(8))
def test_combo_bounds_hold_with_host_time(seed):
    """With host figures (a GPU profile) the bound also counts the host's least share
    per micro-batch, and still never exceeds any assignment; on some seeds the host
    share is what bounds the step."""
    rng = random.Random(2000 + seed)
    p = _with_group(seed)
    scale = rng.choice([0.5, 2.0, 8.0])
    p = replace(p, nodes=[replace(n, strategies=[
        replace(s, host_s=rng.uniform(0, scale), host_bwd_s=0.0,
                param_host_s=rng.uniform(0, scale / 4)) for s in n.strategies])
        for n in p.nodes])
    host_bound_binds = False
    for cb in combo_bounds(p):
        host_bound_binds |= cb.host_time_per_microbatch_s > cb.time_per_microbatch_s
        times = [ev.step_time_s for choice in _assignments(p)
                 for ev in [evaluate(p, list(choice), list(cb.modes))]
                 if ev.feasible and ev.memory_bytes <= p.memory_budget]
        if times:
            assert p.num_microbatches * cb.time_s <= min(times) * (1 + 1e-12)
    assert host_bound_binds or scale < 8.0


@pytest.mark.parametrize("seed", range(12))
def test_step_bound_never_exceeds_any_assignment(seed):
    """The per-step terms (optimizer, gradient traffic the backward cannot hide) keep
    the whole-step bound below every assignment that fits, for each mode combination;
    on some seeds the exposed traffic is what lifts it."""
    rng = random.Random(3000 + seed)
    p = _with_group(seed)
    scale = rng.choice([0.5, 4.0, 20.0])
    p = replace(p, overlap=rng.choice([0.0, 0.5, 1.0]), nodes=[replace(n, strategies=[
        replace(s, optimizer_s=rng.uniform(0, 0.5), step_param_comm_s=rng.uniform(0, scale),
                bwd_compute_s=s.compute_s * rng.uniform(0.3, 0.7)) for s in n.strategies])
        for n in p.nodes])
    lifted = False
    for cb in combo_bounds(p):
        times = [ev.step_time_s for choice in _assignments(p)
                 for ev in [evaluate(p, list(choice), list(cb.modes))]
                 if ev.feasible and ev.memory_bytes <= p.memory_budget]
        whole = step_bound([cb], p.memory_budget, p.num_microbatches)
        if times:
            assert whole <= min(times) * (1 + 1e-12)
        lifted |= cb.exposed_step_s > 0
    assert lifted or scale < 20.0
