"""``plan(..., explain=[...])`` says why a module has its layout: each other layout of
it priced by the solver's own terms with every other choice kept, the terms adding up
to the difference in step time, the faster layouts the plan passed over shown not to
fit, in the summary, the report, the JSON and the CLI."""

from __future__ import annotations

import re

import pytest
import torch

import autopar
from autopar.cli import main
from autopar.errors import ConfigError
from autopar.examples import zoo
from autopar.examples.gpt import GPT, GPTConfig
from autopar.explain_words import EXPLAIN_TERMS
from autopar.report import render_report
from autopar.solvers.explain import price_alternatives
from autopar.solvers.cost_record import StrategyCost
from autopar.solvers.problem import EdgeChoice, NodeChoice, Problem

CLUSTER = autopar.Cluster("cpu", 1, 4)


@pytest.fixture(scope="module")
def plan() -> autopar.Plan:
    """A 2-layer GPT on 4 CPU devices, dp=2 x tp=2 with ZeRO-3, its projections
    explained."""
    model = GPT(GPTConfig(vocab_size=128, max_seq_len=16, dim=64, n_layers=2, n_heads=4))
    x = torch.randint(0, 128, (8, 16))
    return autopar.plan(model, (x,), cluster=CLUSTER, dp=2, tp=2, zero=3,
                        explain=["attn.proj", "blocks.*.mlp.fc1"])


def test_the_solver_prices_each_strategy_with_the_rest_kept() -> None:
    """Node 1 between nodes 0 and 2: strategy 0 solved, 1 faster but over the memory
    budget, 2 slower, 3 not convertible from node 0's strategy."""
    node = NodeChoice("b", [StrategyCost("s0", compute_s=1.0, memory_bytes=10.0),
                            StrategyCost("s1", compute_s=0.5, memory_bytes=100.0),
                            StrategyCost("s2", compute_s=1.0, comm_s=0.5, memory_bytes=5.0),
                            StrategyCost("s3", compute_s=0.1)], multiplicity=2)
    ends = [NodeChoice("a", [StrategyCost("a0", compute_s=3.0)]),
            NodeChoice("c", [StrategyCost("c0", compute_s=3.0)])]
    p = Problem([ends[0], node, ends[1]],
                [EdgeChoice(0, 1, {(0, 0): 0.5, (0, 1): 0.5, (0, 2): 0.0}),
                 EdgeChoice(1, 2, {(0, 0): 0.0, (1, 0): 0.125, (2, 0): 0.0, (3, 0): 0.0})],
                num_microbatches=2, memory_budget=50.0)
    priced = price_alternatives(p, [1], [0, 0, 0])
    assert [(c.strategies, c.blocked) for c in priced] == \
        [((0,), ""), ((3,), "edge"), ((1,), "memory"), ((2,), "")]
    solved, _, fast, slow = priced
    assert (solved.local.compute_s, solved.local.reshard_s, solved.local.memory_bytes) == \
        (4.0, 1.0, 20.0)  # n * m * 1.0; n * (0.5 + 0.0); m * 10
    assert (fast.local.compute_s, fast.local.reshard_s, fast.local.memory_bytes) == \
        (2.0, 1.25, 200.0)
    assert (slow.local.comm_s, slow.local.reshard_s) == (2.0, 0.0)
    assert solved.step_time_s == 2 * (3.0 + 2 * 1.0 + 0.5 + 3.0)
    assert fast.step_time_s < solved.step_time_s < slow.step_time_s


def test_the_terms_add_up_to_the_step_and_the_plan_is_the_fastest_that_fits(plan) -> None:
    assert [e.module for e in plan.explanations] == ["blocks.*.attn.proj", "blocks.*.mlp.fc1"]
    for exp in plan.explanations:
        chosen = exp.chosen
        mp = plan.modules[exp.module.replace("*", "0")]
        assert (chosen.style, chosen.input_layout, chosen.desired_input_layout,
                chosen.output_layout, chosen.params) == \
            (mp.style, mp.input_layout, mp.desired_input_layout, mp.output_layout, mp.params)
        assert exp.count == 2
        assert chosen.step_time_s == pytest.approx(plan.step_time_s, rel=1e-12)
        assert chosen.memory_bytes == pytest.approx(plan.memory_per_device_bytes, rel=1e-12)
        assert exp.alternatives
        for o in exp.alternatives:
            moved = sum(o.terms[k] - chosen.terms[k] for k, _ in EXPLAIN_TERMS)
            assert moved == pytest.approx(o.step_time_s - chosen.step_time_s, rel=1e-9,
                                          abs=1e-12)
            assert o.step_time_s >= chosen.step_time_s * (1 - 1e-9) or not o.fits


def test_the_summary_shows_the_layouts_side_by_side(plan) -> None:
    text = plan.summary()
    exp = plan.explanations[0]
    title = (f"why blocks.*.attn.proj (Linear, 2 modules) is {exp.chosen.style} "
             f"{exp.chosen.input_layout}->{exp.chosen.desired_input_layout}, out "
             f"{exp.chosen.output_layout}: its layouts priced with the plan's other choices "
             f"kept (per step; memory per device)")
    lines = text.splitlines()
    at = lines.index(title)
    assert re.fullmatch(r"  layout +step +compute .*own memory +peak memory *", lines[at + 1])
    assert lines[at + 3].startswith("  * " + f"{exp.chosen.style} ")
    runner = next(s for s in lines[at:] if s.startswith("  runner-up "))
    assert re.fullmatch(r"  runner-up \S+ \S+, out \S+ is [0-9.]+ (s|ms|us) slower per step: "
                        r"more .+", runner), runner
    html = render_report(plan)
    assert "<h2>Why these layouts</h2>" in html and "why blocks.*.attn.proj" in html


def test_explanations_round_trip_through_json(plan) -> None:
    again = autopar.Plan.from_json(plan.to_json())
    assert again.explanations == plan.explanations
    assert again.summary() == plan.summary()


def test_a_name_that_matches_no_module_is_one_clear_error() -> None:
    model = GPT(GPTConfig(vocab_size=128, max_seq_len=16, dim=64, n_layers=2, n_heads=4))
    x = torch.randint(0, 128, (8, 16))
    with pytest.raises(ConfigError) as e:
        autopar.plan(model, (x,), cluster=CLUSTER, explain=["attn.prj"])
    assert str(e.value) == (
        "explain='attn.prj' names no module that owns parameters; give a module path, its "
        "last parts or a glob, one of: tok_emb, pos_emb, blocks.*.ln1, blocks.*.attn.q, "
        "blocks.*.attn.k, blocks.*.attn.v, blocks.*.attn.proj, blocks.*.ln2, "
        "blocks.*.mlp.fc1, blocks.*.mlp.fc2, ln_f, head")
    with pytest.raises(ConfigError, match=r"^explain=3: expected a module path or a list"):
        autopar.plan(model, (x,), cluster=CLUSTER, explain=3)


def test_cli_explain(capsys) -> None:
    args = ["plan", "tiny-gpt", "--gpu", "cpu", "--gpus-per-node", "4", "--tp", "2"]
    assert main(args + ["--explain", "attn.proj", "--explain", "ln_f"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^why blocks\.\*\.attn\.proj \(Linear, 2 modules\) is ", out, re.M)
    assert re.search(r"^why ln_f \(LayerNorm, 1 module\) is ", out, re.M)
    assert main(args + ["--explain", "nope"]) == 2
    assert capsys.readouterr().err.startswith(
        "autopar: error: explain='nope' names no module that owns parameters; give a module "
        "path, its last parts or a glob, one of: tok_emb, ")


def test_gpt3_175b_projection_is_explained() -> None:
    """The case that asked for it: GPT-3 175B on 1,024 A100 (the README's plan, its
    configuration fixed): every layout of ``attn.proj`` faster than the plan's does not
    fit in the memory budget, and the summary says so."""
    model, x = zoo.get("gpt3-175b", batch_size=2)
    plan = autopar.plan(model, x, cluster=autopar.Cluster("a100-80g", 128), global_batch=1536,
                        dp=128, tp=8, pp=1, cp=1, ep=1, zero=3, microbatch_size=6,
                        explain="attn.proj")
    exp, = plan.explanations
    assert (exp.module, exp.count) == ("blocks.*.attn.proj", 96)
    budget = plan.solver["memory_budget_bytes"]
    for o in exp.alternatives:
        assert o.step_time_s >= plan.step_time_s or o.memory_bytes > budget
        if o.step_time_s < plan.step_time_s:
            assert f"{o.style} {o.input_layout}->{o.desired_input_layout}, out " \
                   f"{o.output_layout} would be " in plan.summary()
