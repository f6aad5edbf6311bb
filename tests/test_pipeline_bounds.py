"""The pipeline bounds of the outer search never exceed what a stage split achieves:
the rank-load bound against every packing of small random instances, the stage bound
against the exhaustive stage split's simulated step for every schedule, and the
per-unit least costs against the unit costs of every strategy choice."""

from __future__ import annotations

import itertools
import random

import pytest

from autopar.solvers.bounds import pipeline_stage_bound, rank_load_bound
from autopar.solvers.schedule_sim import ZERO_BUBBLE
from autopar.solvers.cost_terms import PieceCost
from autopar.solvers.stage_split import split_stages_exhaustive


def _least_makespan(weights: list[float], bins: int) -> float:
    """Every assignment of the weights to the bins (small instances only)."""
    best = float("inf")
    for assign in itertools.product(range(bins), repeat=len(weights)):
        load = [0.0] * bins
        for w, b in zip(weights, assign):
            load[b] += w
        best = min(best, max(load))
    return best


@pytest.mark.parametrize("seed", range(40))
def test_rank_load_bound_never_exceeds_the_least_makespan(seed):
    rng = random.Random(seed)
    bins = rng.choice([2, 3, 4])
    block = rng.uniform(0.5, 2.0)
    weights = [block] * rng.randint(2, 6) + [rng.uniform(0.1, 3.0) for _ in range(rng.randint(0, 2))]
    bound = rank_load_bound(weights, bins)
    best = _least_makespan(weights, bins)
    assert bound <= best * (1 + 1e-9)
    assert bound >= sum(weights) / bins * (1 - 1e-9)


def test_rank_load_bound_sees_whole_blocks():
    """32 equal blocks and a head of two blocks' weight on 8 ranks: some rank has 5
    blocks' weight (the mean is 4.25); on 16 ranks, 3 (the mean is 2.125)."""
    weights = [1.0] * 32 + [2.0]
    assert rank_load_bound(weights, 8) == pytest.approx(5.0, rel=1e-6)
    assert rank_load_bound(weights, 16) == pytest.approx(3.0, rel=1e-6)
    assert rank_load_bound([1.0] * 32, 8) == pytest.approx(4.0, rel=1e-6)


SCHEDULES = [("1f1b", 1), ("gpipe", 1), ("interleaved_1f1b", 2), ("interleaved_zero_bubble", 2),
             ("zbv", 2)]


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("schedule,v", SCHEDULES)
def test_stage_bound_never_exceeds_the_best_split(seed, schedule, v):
    rng = random.Random(100 * seed + len(schedule))
    pp = rng.choice([2, 3]) if v > 1 else rng.choice([2, 3, 4])
    m = pp * rng.choice([1, 2])
    n = pp * v + rng.randint(0, 3)
    units = []
    for k in range(n):
        f = rng.uniform(0.2, 1.0) * (3.0 if k == n - 1 else 1.0)
        b = 2 * f * rng.uniform(0.8, 1.2)
        units.append(PieceCost(f, b, b * rng.uniform(0.3, 0.5),
                               optimizer_s=rng.uniform(0.0, 0.5),
                               step_comm_s=rng.uniform(0.0, 1.0), name=f"u{k}"))
    best = split_stages_exhaustive(units, pp, m, schedule=schedule, virtual_stages=v,
                                   p2p_s=rng.choice([0.0, 0.05]))
    bound = pipeline_stage_bound([u.forward_s for u in units], [u.backward_s for u in units],
                                 [u.optimizer_s for u in units], pp=pp, m=m, v=v,
                                 drains=schedule not in ZERO_BUBBLE)
    assert bound <= best.objective_s * (1 + 1e-9)
    assert bound >= m * sum(u.forward_s + u.backward_s for u in units) / pp * (1 - 1e-9)


def test_one_f_one_b_bound_counts_fill_and_drain():
    """Equal stages, one unit each: 1F1B takes (m + pp − 1) stage times, and the bound
    is exactly that."""
    pp, m = 4, 8
    bound = pipeline_stage_bound([1.0] * pp, [2.0] * pp, [0.0] * pp, pp=pp, m=m, v=1,
                                 drains=True)
    assert bound == pytest.approx((m + pp - 1) * 3.0, rel=1e-6)
    units = [PieceCost(1.0, 2.0, name=f"u{k}") for k in range(pp)]
    assert split_stages_exhaustive(units, pp, m).objective_s == pytest.approx(bound, rel=1e-6)
