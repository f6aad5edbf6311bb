"""Pipeline schedule simulation against closed forms and hand-computed timelines."""

from __future__ import annotations

import pytest

from autopar.errors import ConfigError
from autopar.solvers.schedule_sim import (PieceCost, Timeline, bubble_formula, rank_orders,
                                          simulate, stage_ranks, validate)

UNIFORM = PieceCost(forward_s=1.0, backward_s=2.0, backward_weight_s=1.0, activation_bytes=10.0,
                    static_bytes=100.0)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("m", [8, 9, 16, 32])
def test_single_stage_bubble_is_closed_form(schedule, pp, m):
    est = simulate(schedule, [UNIFORM] * pp, pp, m)
    assert est.bubble_ratio == pytest.approx((pp - 1) / m, rel=1e-9, abs=1e-12)
    assert bubble_formula(schedule, pp, m) == pytest.approx(est.bubble_ratio, rel=1e-9, abs=1e-12)
    t = m * 3.0 * (1 + (pp - 1) / m)
    assert est.bubble_fraction == pytest.approx(1 - m * 3.0 / t, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("pp", [2, 3, 4])
@pytest.mark.parametrize("v", [1, 2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 6, 8, 12, 16])
def test_interleaved_bubble_is_closed_form(pp, v, m):
    if validate("interleaved_1f1b", pp, m, v):
        pytest.skip("torch does not run this combination")
    est = simulate("interleaved_1f1b", [UNIFORM] * (pp * v), pp, m, virtual_stages=v)
    expected = bubble_formula("interleaved_1f1b", pp, m, v)
    if m >= pp:
        assert expected == pytest.approx((pp - 1) / (v * m), rel=1e-12)
    assert est.bubble_ratio == pytest.approx(expected, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("f,b,w", [(1, 2, 1), (1, 3, 1), (2, 2, 1), (1, 2, 1.5), (1, 1.5, 0.25)])
@pytest.mark.parametrize("pp,v,m", [(2, 1, 4), (4, 1, 8), (3, 2, 6), (4, 2, 8), (4, 3, 16)])
def test_interleaved_zero_bubble_closed_form(f, b, w, pp, v, m):
    chunk = PieceCost(f, b, w)
    est = simulate("interleaved_zero_bubble", [chunk] * (pp * v), pp, m, virtual_stages=v)
    assert est.bubble_ratio == pytest.approx(
        bubble_formula("interleaved_zero_bubble", pp, m, v, chunk=chunk), rel=1e-9)


@pytest.mark.parametrize("pp,m", [(2, 3), (2, 8), (3, 5), (4, 7), (4, 16)])
def test_zbv_closed_form_with_equal_f_i_w(pp, m):
    chunk = PieceCost(1.0, 2.0, 1.0)
    est = simulate("zbv", [chunk] * (2 * pp), pp, m, virtual_stages=2)
    assert est.bubble_ratio == pytest.approx(bubble_formula("zbv", pp, m, 2, chunk=chunk), rel=1e-9)
    assert est.bubble_ratio == pytest.approx((pp - 1) / (6 * m), rel=1e-9)


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 16), (8, 32)])
def test_zero_bubble_schedules_beat_1f1b(pp, m):
    one = simulate("1f1b", [UNIFORM] * pp, pp, m)
    half = PieceCost(0.5, 1.0, 0.5, activation_bytes=5.0)
    izb = simulate("interleaved_zero_bubble", [UNIFORM] * pp, pp, m)
    zbv = simulate("zbv", [half] * (2 * pp), pp, m, virtual_stages=2)
    assert izb.bubble_fraction < one.bubble_fraction
    assert zbv.bubble_fraction < one.bubble_fraction
    assert zbv.step_time_s < one.step_time_s


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
def test_in_flight_counts(pp):
    m = 4 * pp
    assert simulate("1f1b", [UNIFORM] * pp, pp, m).in_flight == [pp - r for r in range(pp)]
    assert simulate("gpipe", [UNIFORM] * pp, pp, m).in_flight == [m] * pp
    # ZB-V: every rank holds 2p half-size chunk activations once m >= 2p, the bytes of
    # 1F1B's first rank (Qi et al. §6: peak p·M_B).
    half = PieceCost(0.5, 1.0, 0.5, activation_bytes=5.0, static_bytes=50.0)
    est = simulate("zbv", [half] * (2 * pp), pp, m, virtual_stages=2)
    assert est.in_flight == [2 * pp] * pp
    assert est.peak_memory_bytes == pytest.approx([100.0 + 10.0 * pp] * pp)


def test_non_uniform_stages_hand_computed():
    # 1F1B, p = 2, m = 2: stage 0 (f=1, b=2), stage 1 (f=2, b=4).
    # rank0: F0 [0,1] F1 [1,2]; rank1: F0 [1,3] B0 [3,7] F1 [7,9] B1 [9,13];
    # rank0: B0 [7,9] B1 [13,15]  -> makespan 15.
    chunks = [PieceCost(1, 2), PieceCost(2, 4)]
    est = simulate("1f1b", chunks, 2, 2)
    assert est.step_time_s == pytest.approx(15.0)
    assert est.step_time_s >= 2 * 6  # m x slowest stage
    assert est.busy_s == [6.0, 12.0]
    with_p2p = simulate("1f1b", chunks, 2, 2, p2p_s=0.5)
    assert with_p2p.step_time_s == pytest.approx(16.0)  # one hop down, one hop back


def test_non_uniform_step_time_at_least_slowest_stage_bound():
    chunks = [PieceCost(1, 2), PieceCost(3, 5), PieceCost(0.5, 1), PieceCost(2, 2)]
    for schedule in ("gpipe", "1f1b"):
        est = simulate(schedule, chunks, 4, 8)
        assert est.step_time_s >= 8 * max(c.forward_s + c.backward_s for c in chunks) - 1e-9
        assert est.step_time_s > max(est.busy_s)


def test_stage_ranks_and_validate():
    assert stage_ranks("interleaved_1f1b", 3, 2) == [0, 1, 2, 0, 1, 2]
    assert stage_ranks("zbv", 3, 2) == [0, 1, 2, 2, 1, 0]
    assert validate("zbv", 4, 8, 1) is not None
    assert validate("1f1b", 4, 2) is not None
    assert validate("interleaved_1f1b", 4, 10, 2) is None
    assert validate("interleaved_1f1b", 4, 9, 2) is not None
    assert validate("nope", 2, 2) is not None
    with pytest.raises(ConfigError):
        rank_orders("zbv", 2, 4, 3)


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2),
                                        ("interleaved_zero_bubble", 2), ("zbv", 2)])
def test_every_op_runs_once(schedule, v):
    pp, m = 4, 8
    kinds = {"F", "B"} if "zero" not in schedule and schedule != "zbv" else {"F", "I", "W"}
    ops = [op for order in rank_orders(schedule, pp, m, v) for op in order]
    assert len(ops) == len(set(ops)) == len(kinds) * pp * v * m


def _round_robin(schedule: str, chunks: list[PieceCost], pp: int, m: int, v: int,
                 p2p: float) -> float:
    """Reference makespan: ranks take turns running their next operation once its input
    has arrived (the rules of docs/solvers.md, written out directly)."""
    ranks = stage_ranks(schedule, pp, v)
    orders = rank_orders(schedule, pp, m, v)
    n = pp * v
    dur = {"F": lambda c: c.forward_s, "B": lambda c: c.backward_s,
           "I": lambda c: c.backward_s - c.backward_weight_s, "W": lambda c: c.backward_weight_s}
    end: dict = {}
    pos, free = [0] * pp, [0.0] * pp
    while any(p < len(o) for p, o in zip(pos, orders)):
        for r, order in enumerate(orders):
            while pos[r] < len(order):
                kind, s, j = order[pos[r]]
                dep = (("F", s - 1, j) if s else None) if kind == "F" else \
                    ("I", s, j) if kind == "W" else ("F", s, j) if s == n - 1 else (kind, s + 1, j)
                if dep is not None and dep not in end:
                    break
                ready = end[dep] + (p2p if ranks[dep[1]] != r else 0.0) if dep else 0.0
                free[r] = max(free[r], ready) + dur[kind](chunks[s])
                end[(kind, s, j)] = free[r]
                pos[r] += 1
    return max(end.values())


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2),
                                        ("interleaved_1f1b", 3),
                                        ("interleaved_zero_bubble", 2), ("zbv", 2)])
@pytest.mark.parametrize("pp,m", [(1, 3), (2, 2), (3, 7), (4, 8), (4, 5)])
def test_timeline_matches_round_robin(schedule, v, pp, m):
    """The compiled order gives every operation the end time of the round-robin, for
    uneven chunks and transfers; each operation appears once, after its rank's previous
    one and its input."""
    if validate(schedule, pp, m, v):
        pytest.skip("torch does not run this combination")
    import random
    rng = random.Random(pp * 100 + m)
    chunks = [PieceCost(rng.uniform(0.1, 2), b := rng.uniform(0.2, 3), rng.uniform(0, b))
              for _ in range(pp * v)]
    tl = Timeline.of(schedule, pp, m, v)
    assert sorted(tl.ops) == sorted(op for order in rank_orders(schedule, pp, m, v)
                                    for op in order)
    assert all(a < k or a == len(tl.ops) for k, a in enumerate(tl.after))
    assert all(d < k or d == len(tl.ops) for k, d in enumerate(tl.dep))
    assert all(tl.position(op) == k for k, op in enumerate(tl.ops))
    for p2p in (0.0, 0.3):
        want = _round_robin(schedule, chunks, pp, m, v, p2p)
        assert tl.makespan(Timeline.durations(chunks), p2p) == pytest.approx(want, rel=1e-12)
        assert simulate(schedule, chunks, pp, m, virtual_stages=v,
                        p2p_s=p2p).step_time_s == pytest.approx(want, rel=1e-12)
