"""Context parallelism in the planner: where the sequence is (and a model that cannot be
split along it, refused with where), the search turning to cp when nothing else fits
and saying so, and attention priced at the variant's cost."""

from __future__ import annotations

import pytest

import autopar
from autopar.capture import capture
from autopar.cost_models.comm import group_link
from autopar.cost_models.context_parallel import VARIANTS, AttentionShape, cp_attention
from autopar.errors import ConfigError, NoFeasiblePlanError
from autopar.examples import zoo
from autopar.planner import RING_NOTE
from autopar.plans import Plan
from autopar.strategies.analysis import analyze
from tests import foreign_models as fm

CLUSTER = autopar.Cluster("h100-sxm", 1, 4)
SEQ, BUDGET = 32768, 12e9
"""GPT-2 small at 32K tokens on 4 H100 with 12 GB each: with its logits whole on every tp
rank (no loss parallelism, :data:`WHOLE_LOGITS`) it fits only with cp."""
WHOLE_LOGITS = {"loss_parallel": False}

HANDWRITTEN = ("cp=2: the sequence cannot be split at operator aten.matmul.default in module "
               "'layers.0.attention': it combines positions of the sequence with each other "
               "(attention written out by hand?). Context parallelism needs attention through "
               "F.scaled_dot_product_attention and every other op to work token by token")


@pytest.fixture(scope="module")
def gpt2():
    return zoo.get("gpt2-small", batch_size=1, seq_len=SEQ)


def test_the_sequence_is_followed_to_every_attention_call() -> None:
    model, (x,), y = fm.nano_gpt()
    an = analyze(capture(model, (x,), loss_fn=fm.lm_loss, example_targets=y))
    seq = an.sequence
    assert seq.splittable and seq.refusal == ""
    assert list(seq.attention.values()) == [True] * len(an.graph.layers)
    assert seq.inputs == {name: 1 for name in an.graph.inputs}  # tokens and targets
    assert set(seq.place.values()) >= {"S(1)", "S(2)"}  # (b, s, d) and (b, h, s, d)


def test_attention_written_by_hand_is_refused_with_where() -> None:
    model, (x,), y = fm.tiny_llama()
    with pytest.raises(ConfigError) as err:
        autopar.plan(model, (x,), loss_fn=fm.lm_loss, example_targets=y, cp=2,
                     cluster=autopar.Cluster("cpu", 1, 2), precision="fp32")
    assert str(err.value) == HANDWRITTEN


def test_long_sequences_turn_to_cp_when_nothing_else_fits(gpt2) -> None:
    model, x = gpt2
    with pytest.raises(NoFeasiblePlanError) as err:
        autopar.plan(model, x, cluster=CLUSTER, memory_budget=BUDGET, cp=1, **WHOLE_LOGITS)
    assert str(err.value).startswith("no plan fits in 12.00 GB per device")
    assert str(err.value).endswith("Context parallelism (leave cp out, or cp > 1) would split "
                                   "each sequence's activations over cp ranks.")
    plan = autopar.plan(model, x, cluster=CLUSTER, memory_budget=BUDGET, **WHOLE_LOGITS)
    assert plan.degree("cp") > 1 and plan.memory_per_device_bytes <= BUDGET
    assert plan.context is not None and plan.context.seq_len == SEQ
    assert plan.context.inputs == [1, 1]
    assert plan.notes[-1].startswith(
        "context parallelism, because without it (and without tensor parallelism across "
        "nodes or offload) no plan fits in 12.00 GB per device: the smallest needs at least")
    text = plan.summary()
    assert f"context p. cp={plan.degree('cp')}, {plan.context.variant}: " in text
    assert f"each sequence of 32,768 tokens in {2 * plan.degree('cp')} head-tail chunks" in text
    assert Plan.from_json(plan.to_json()) == plan


def test_runners_up_rank_the_plans_with_and_without_cp(gpt2) -> None:
    """At 18 GB the best plan without cp recomputes every block, so the search tries cp
    as well: the runners-up rank the plans of both searches, the one without cp
    included, and a short list is the head of the long one."""
    model, x = gpt2
    every = autopar.plan(model, x, cluster=CLUSTER, memory_budget=18e9, top_k=10_000,
                         **WHOLE_LOGITS)
    three = autopar.plan(model, x, cluster=CLUSTER, memory_budget=18e9, top_k=3, **WHOLE_LOGITS)
    assert every.degree("cp") > 1 and three.degree("cp") > 1
    without = [r for r in every.runners_up if r["mesh"].get("cp", 1) == 1]
    assert [r["recompute"] for r in without] == [["full"]]
    times = [every.step_time_s] + [r["step_time_s"] for r in every.runners_up]
    assert times == sorted(times)
    assert [three.step_time_s] + [r["step_time_s"] for r in three.runners_up] == \
        pytest.approx(times[:3], rel=1e-12)
    assert every.solver["candidates"] == len(times)  # both searches' configurations


def test_a_time_limit_that_cuts_the_cp_search_says_so(gpt2) -> None:
    """With no time at all the search still finds a plan without cp (it recomputes
    every block), and then builds no cp problem: a note says how many it left."""
    model, x = gpt2
    every = autopar.plan(model, x, cluster=CLUSTER, memory_budget=18e9, top_k=10_000,
                         **WHOLE_LOGITS)
    cp = sum(r["mesh"].get("cp", 1) > 1 for r in every.runners_up) + 1  # the plan has cp
    plan = autopar.plan(model, x, cluster=CLUSTER, memory_budget=18e9, time_limit_s=0.0,
                        **WHOLE_LOGITS)
    assert plan.degree("cp") == 1 and set(plan.recompute.values()) == {"full"}
    assert (f"the time limit ended the search of context parallelism before it built the "
            f"problems of {cp} of {cp} configurations: they are not scored, and the gap "
            f"bounds them by their FLOPs at the GPU's peak; a longer limit searches "
            f"them") in plan.notes


@pytest.mark.parametrize("variant", VARIANTS)
def test_planned_attention_costs_what_the_variant_does(gpt2, variant: str) -> None:
    """12 layers of 12 heads of 64 over 32K tokens, causal, bf16, cp=4 in one node."""
    model, x = gpt2
    plan = autopar.plan(model, x, cluster=CLUSTER, memory_budget=BUDGET, cp=4, tp=1,
                        cp_variant=variant)
    hw = CLUSTER.hardware()
    one = cp_attention(variant, 4, AttentionShape(1, SEQ, 12, 12, 64, True, "bf16"), hw,
                       group_link((1, 4, 1), 1, 4, hw))
    assert plan.context.variant == variant
    assert plan.context.attention_s == pytest.approx(12 * (one.compute_s + one.exposed_s),
                                                     rel=1e-9)
    assert (RING_NOTE in plan.notes) == (variant == "ring")


def test_the_cli_plans_long_sequences_with_cp_and_says_why(capsys) -> None:
    from autopar.cli import main

    common = ["plan", "gpt2-small", "--seq-len", str(SEQ), "--gpu", "h100-sxm",
              "--gpus-per-node", "4", "--memory-budget", "12GB", "--no-loss-parallel"]
    assert main(common) == 0
    out = capsys.readouterr().out
    assert "\ncontext p. cp=" in out and "\nnote      context parallelism, because" in out
    assert main([*common, "--cp", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("autopar: error: no plan fits in 12.00 GB per device")
    assert "Context parallelism (leave cp out, or cp > 1)" in err
