"""The step-time terms (compute, recomputation, exposed communication, bubble, host step)
add up to the step time with and without a pipeline, and ``autopar compare`` scores a
hand-written configuration beside the plan: the plan is never slower, an over-budget
configuration gives a message, the CLI prints the table."""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar.cli import main
from autopar.compare import Comparison
from autopar.examples.gpt import GPT, GPTConfig
from autopar.plans import Plan
from autopar.summary import STEP_TERMS

CLUSTER = autopar.Cluster("a100-80g", 1, 8)


def gpt(dim: int = 256, layers: int = 4, seq: int = 128, vocab: int = 1024):
    """A small meta-device GPT and one example batch of 8."""
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=vocab, max_seq_len=seq, dim=dim, n_layers=layers,
                              n_heads=8))
    return model, (torch.randint(0, vocab, (8, seq), device="meta"),)


@pytest.fixture(scope="module")
def small():
    """The model, its inputs and the plan for 32 samples on 8 A100s."""
    model, x = gpt()
    return model, x, autopar.plan(model, x, cluster=CLUSTER, global_batch=32)


def assert_terms_add_up(plan: Plan) -> None:
    """The STEP_TERMS of the breakdown sum to the step time (1e-9 relative), none < 0."""
    b = plan.breakdown
    assert set(STEP_TERMS) <= set(b)
    assert sum(b[k] for k in STEP_TERMS) == pytest.approx(plan.step_time_s, rel=1e-9, abs=0)
    assert all(b[k] >= -1e-12 * plan.step_time_s for k in STEP_TERMS), b


SPECS = [
    autopar.Spec(tp=2, recompute="full"),
    autopar.Spec(tp=2, zero=3, recompute="selective", sequence_parallel=True),
    autopar.Spec(tp=2, pp=2, microbatch_size=1, recompute="full"),
    autopar.Spec(tp=2, pp=2, schedule="interleaved_1f1b", virtual_stages=2, microbatch_size=2,
                 recompute="full"),
    autopar.Spec(pp=2, schedule="zbv", virtual_stages=2, microbatch_size=2, zero=2),
    autopar.Spec(pp=4, schedule="gpipe", microbatch_size=1, recompute="selective"),
]


@pytest.mark.parametrize("spec", SPECS, ids=repr)
def test_terms_add_up_to_the_step_time(small, spec: autopar.Spec) -> None:
    model, x, _ = small
    plan = autopar.estimate(model, x, spec, cluster=CLUSTER, global_batch=32)
    pipelined = (spec.pp or 1) > 1
    assert (plan.pipeline is not None) == pipelined
    assert_terms_add_up(plan)
    b = plan.breakdown
    assert b["recompute_s"] > 0 if spec.recompute in ("selective", "full") else \
        b["recompute_s"] == 0
    if pipelined:  # a zero-bubble schedule may fill every idle slot
        zero_bubble = spec.schedule in ("zbv", "interleaved_zero_bubble")
        assert b["bubble_s"] >= -1e-12 if zero_bubble else b["bubble_s"] > 0
        assert b["exposed_p2p_s"] >= 0
    else:
        assert b["bubble_s"] == 0
        assert b["exposed_comm_s"] == pytest.approx(b["comm_s"] + b["exposed_param_comm_s"])


def test_terms_add_up_with_cpu_offload_and_across_nodes() -> None:
    model, x = gpt(dim=512, layers=4, seq=64)
    off = autopar.estimate(model, x, autopar.Spec(zero=3, offload=True, recompute="full"),
                           cluster=CLUSTER, global_batch=32)
    assert off.breakdown["optimizer_s"] > 0
    assert_terms_add_up(off)
    slow = autopar.Cluster("h100-sxm", 2, 1, inter_node_bandwidth=0.5)
    pipe = autopar.estimate(model, x, autopar.Spec(pp=2, microbatch_size=1), cluster=slow,
                            global_batch=8)
    assert pipe.breakdown["exposed_p2p_s"] > 0
    assert_terms_add_up(pipe)
    assert_terms_add_up(Plan.from_json(pipe.to_json()))


def test_the_summary_shows_the_terms(small) -> None:
    text = small[2].summary()
    assert "  = compute " in text and " + exposed communication " in text


@pytest.mark.parametrize("spec", SPECS, ids=repr)
def test_the_plan_is_never_slower_than_a_spec(small, spec: autopar.Spec) -> None:
    model, x, planned = small
    hand = autopar.estimate(model, x, spec, cluster=CLUSTER, global_batch=32)
    assert planned.step_time_s <= hand.step_time_s * (1 + 1e-9)
    verdict = Comparison(planned, spec, hand, 80e9).verdict()
    assert verdict.startswith(("the plan is", "the hand-written configuration is as fast"))


def test_compare_lines_up_the_terms() -> None:
    model, x = gpt(layers=2)
    spec = autopar.Spec(tp=2, pp=2, microbatch_size=1, recompute="full")
    result = autopar.compare(model, x, spec, cluster=CLUSTER, global_batch=16)
    assert isinstance(result, autopar.Comparison) and result.handwritten is not None
    assert result.speedup is not None and result.speedup >= 1
    labels = [r.label for r in result.rows()]
    for label in ("mesh", "micro-batch x count", "schedule", "ZeRO", "recompute", "step time",
                  "compute", "recomputation", "exposed communication", "bubble",
                  "memory per device", "MFU"):
        assert label in labels
    rows = {r.label: r for r in result.rows()}
    assert rows["mesh"].handwritten == "pp=2 x dp=2 x tp=2"
    assert rows["schedule"].handwritten == "1f1b"
    assert rows["recompute"].handwritten == "full, every block"
    assert rows["step time"].ratio == f"{result.speedup:.2f}x"
    assert rows["recomputation"].handwritten_value == result.handwritten.breakdown["recompute_s"]
    text = result.table()
    assert "hand / planned" in text and result.verdict() in text


def test_an_over_budget_spec_gives_a_message_not_an_exception() -> None:
    model, x = gpt(dim=512, layers=2)
    spec = autopar.Spec(zero=0, recompute="none")
    need = autopar.estimate(model, x, spec, cluster=CLUSTER, global_batch=32)
    budget = 0.7 * need.memory_per_device_bytes
    result = autopar.compare(model, x, spec, cluster=CLUSTER, global_batch=32,
                             memory_budget=budget)
    assert result.handwritten is None and result.planned.memory_per_device_bytes <= budget
    assert "no plan fits" in result.error
    assert result.needs_bytes is not None and result.needs_bytes > budget
    verdict = result.verdict()
    assert verdict.startswith("the hand-written configuration does not fit: needs at least")
    assert "budget" in verdict
    rows = {r.label: r for r in result.rows()}
    assert "over budget" in rows["memory per device"].handwritten
    assert rows["mesh"].handwritten == "dp=8 x tp=1" and rows["step time"].handwritten == "-"
    assert result.error in result.table()


def _plan(**terms: float) -> Plan:
    b = {k: terms.get(k, 0.0) for k in STEP_TERMS}
    return Plan(model="m", graph_hash="h", cluster={}, mesh={"dp": 8, "tp": 1}, global_batch=8,
                microbatch_size=1, step_time_s=sum(b.values()), breakdown=b,
                memory={"total": 1e9})


def test_the_verdict_names_the_largest_differing_terms() -> None:
    planned = _plan(compute_s=1.0, recompute_s=0.05, exposed_comm_s=0.2)
    hand = _plan(compute_s=1.0, exposed_comm_s=0.32, bubble_s=0.41)
    verdict = Comparison(planned, autopar.Spec(), hand, 80e9).verdict()
    assert verdict.startswith("the plan is 1.38x faster (1.250 s against 1.730 s per step): "
                              "less bubble (-410.00 ms) and less exposed communication "
                              "(-120.00 ms), despite more recomputation (+50.00 ms)")
    backwards = Comparison(hand, autopar.Spec(), planned, 80e9).verdict()
    assert backwards.startswith("the hand-written configuration is 1.38x faster than the plan")
    same = Comparison(planned, autopar.Spec(), planned, 80e9).verdict()
    assert same.startswith("the hand-written configuration is as fast as the plan")


def test_compare_rejects_what_is_not_a_spec(small) -> None:
    with pytest.raises(autopar.ConfigError, match="autopar.Spec"):
        autopar.compare(small[0], small[1], {"tp": 2}, cluster=CLUSTER)


def test_the_cli_prints_the_table(capsys) -> None:
    rc = main(["compare", "tiny-gpt", "--gpu", "a100-80g", "--gpus-per-node", "4",
               "--global-batch", "8", "--tp", "2", "--pp", "2", "--microbatch", "1",
               "--schedule", "interleaved_1f1b", "--recompute", "full",
               "--no-sequence-parallel"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "autopar compare for tiny-gpt on 1 node(s) x 4 a100-80g, global batch 8" in out
    for label in ("mesh", "step time", "recomputation", "exposed communication", "bubble",
                  "memory per device", "hand / planned"):
        assert label in out
    assert "pp=2 x dp=1 x tp=2" in out and "interleaved_1f1b" in out
    assert "the plan is" in out or "as fast as the plan" in out


def test_the_cli_reports_a_bad_configuration(capsys) -> None:
    rc = main(["compare", "tiny-gpt", "--gpu", "a100-80g", "--gpus-per-node", "4", "--tp", "3"])
    assert rc == 2
    assert "autopar: error:" in capsys.readouterr().err
