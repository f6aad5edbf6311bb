"""Context parallelism splits each rank's work along the sequence once: an op of a cp=2
mesh costs half what it costs on the cp=1 mesh of the same dp and tp degrees, its
backward stays twice its forward, no plan's MFU exceeds 1, and a pipelined plan's
attention is that of one rank's stages. GPT-2 small at 2,048 tokens on the a100-80g
datasheet profile (roofline), where every matrix product is compute-bound."""

from __future__ import annotations

import pytest

import autopar
from autopar.capture import capture
from autopar.cost_models.strategy_price import StrategyPricer
from autopar.examples import zoo
from autopar.sharding import Mesh
from autopar.strategies.analysis import analyze
from autopar.strategies.settings import Settings

CLUSTER = autopar.Cluster("a100-80g", 1, 8)
HW = CLUSTER.hardware()
BATCH, SEQ = 32, 2048


@pytest.fixture(scope="module")
def gpt2():
    return zoo.get("gpt2-small", batch_size=BATCH, seq_len=SEQ)


@pytest.fixture(scope="module")
def analysis(gpt2):
    model, x = gpt2
    return analyze(capture(model, x))


def pricer(an, cp: int, microbatch: int = 4) -> StrategyPricer:
    """Prices on dp=4/cp x cp x tp=2 (dp=4 x tp=2 for cp=1), attention by the ring (the
    all-gather variant's chunk on its key prefix runs a slower kernel:
    autopar.cost_models.context_parallel.MASKED_SLOWDOWN)."""
    mesh = Mesh(("dp", "cp", "tp"), (4 // cp, cp, 2)) if cp > 1 else Mesh(("dp", "tp"), (4, 2))
    return StrategyPricer(an, Settings(mesh, microbatch, 1, 0, "bf16", "adamw", 80e9, HW, 8,
                                       cp_variant="ring"))


def block_ops(an):
    return [n for n in an.graph.nodes
            if n.kind == "op" and n.module_path.startswith("blocks.0") and n.requires_grad]


def test_the_cp_axis_carries_only_the_sequence(analysis) -> None:
    p = pricer(analysis, 2)
    cp = p.space.cp_axis
    for n in block_ops(analysis):
        for s in p.space.strategies(n):
            assert s.labels[cp] is None, (n.name, s.labels)


def test_each_op_costs_a_cp_th_with_backward_twice_forward(analysis) -> None:
    one, two = pricer(analysis, 1), pricer(analysis, 2)
    checked = 0
    for n in block_ops(analysis):
        terms = {}
        for k, p in ((1, one), (2, two)):
            # the op's cheapest strategy: before the fix, a label on the cp axis cut the
            # work a second time although the placements stayed those of the sequence
            terms[k] = min((p.op_terms(n, s) for s in p.space.strategies(n)),
                           key=lambda t: t.compute_s)
        a, b = terms[1], terms[2]
        if a.compute_s - a.bwd_compute_s < 4 * HW.kernel_overhead_s:
            continue  # its halves near the one-kernel floor
        assert b.compute_s == pytest.approx(a.compute_s / 2, rel=0.02), n.name
        assert b.bwd_compute_s / (b.compute_s - b.bwd_compute_s) == pytest.approx(
            a.bwd_compute_s / (a.compute_s - a.bwd_compute_s), rel=0.05), n.name
        if n.target == "aten.linear.default":
            assert b.bwd_compute_s == pytest.approx(2 * (b.compute_s - b.bwd_compute_s))
        checked += 1
    assert checked >= 8  # q, k, v, proj, fc1, gelu, fc2 and attention


def test_plans_split_the_compute_and_stay_under_the_peak(gpt2) -> None:
    model, x = gpt2
    plans = {cp: autopar.estimate(model, x, autopar.Spec(
        tp=2, cp=cp, dp=4 // cp, pp=1, microbatch_size=8, zero=0, recompute="full"),
        cluster=CLUSTER) for cp in (1, 2)}
    per_microbatch = {cp: p.breakdown["compute_s"] / p.num_microbatches
                      for cp, p in plans.items()}
    assert per_microbatch[2] == pytest.approx(per_microbatch[1] / 2, rel=0.1)
    # every rank runs the same tokens a step: recomputation about the same, not a cp-th
    # (the small ops' one-kernel floor counts twice as often under cp=2)
    assert plans[2].breakdown["recompute_s"] == pytest.approx(
        plans[1].breakdown["recompute_s"], rel=0.15)
    assert all(0 < p.mfu < 1 for p in plans.values())


def test_a_pipelined_plans_attention_is_one_ranks(gpt2) -> None:
    model, x = gpt2
    spec = dict(tp=2, cp=2, microbatch_size=8, zero=0, recompute="full",
                cp_variant="allgather")
    flat = autopar.estimate(model, x, autopar.Spec(dp=2, pp=1, **spec), cluster=CLUSTER)
    piped = autopar.estimate(model, x, autopar.Spec(dp=1, pp=2, schedule="1f1b", **spec),
                             cluster=CLUSTER)
    assert piped.mfu < 1 and piped.context.attention_s < piped.step_time_s
    # twice the micro-batches of the flat plan, on the blocks of one rank's stages
    per_block = 2 * flat.context.attention_s / 12
    blocks = [sum(u.startswith("blocks.") for s in piped.pipeline.stages if s.rank == r
                  for u in s.units) for r in (0, 1)]
    assert sum(blocks) == 12
    assert any(piped.context.attention_s == pytest.approx(per_block * b) for b in blocks)
