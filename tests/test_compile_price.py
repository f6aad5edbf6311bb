"""Compile where it pays: the planner compiles the blocks on GPUs measured faster,
prices them so (fused memory-bound kernels, kernel launches for host time), reports the
compile time, and leaves pipelines, hand-written configurations and CPUs eager."""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar.capture import capture
from autopar.cost_models.compiled import (COMPILE_BASE_S, COMPILE_PER_OP_S,
                                          LAUNCHES_PER_PRODUCT, MEMORY_FACTOR)
from autopar.cost_models.compute import is_matmul
from autopar.cost_models.hardware import load_profile
from autopar.errors import ConfigError
from autopar.examples.gpt import GPT, GPTConfig
from autopar.sharding import Mesh
from autopar.solvers.problem_build import build_problem
from autopar.strategies.analysis import analyze
from autopar.strategies.settings import Settings

H100 = autopar.Cluster("h100-sxm", 1, 2)


@pytest.fixture(scope="module")
def gpt():
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=512, max_seq_len=256, dim=256, n_layers=4,
                              n_heads=4))
    return model, (torch.randint(0, 512, (8, 256), device="meta"),)


def _ops(compiled: bool):
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=512, max_seq_len=64, dim=256, n_layers=2,
                              n_heads=4))
    g = capture(model, (torch.randint(0, 512, (8, 64), device="meta"),))
    hw = load_profile("h100-sxm")
    st = Settings(Mesh(("dp",), (1,)), 8, 1, 0, "bf16", "adamw", 1e12, hw, 8,
                  recompute_modes=("none",), compiled=compiled)
    built = build_problem(analyze(g), st)
    return g, hw, {n.name: n.strategies[0] for n in built.problem.nodes}


def test_compiled_blocks_fuse_memory_bound_ops_and_only_launch_kernels() -> None:
    """Inside a compiled block a memory-bound op keeps MEMORY_FACTOR of its eager
    device time and costs the host nothing; a matrix product keeps its device time and
    costs two kernel launches forward and four backward; ops outside the blocks (the
    embedding, the head, the loss) and FSDP2's per-parameter hooks are priced as
    eager."""
    g, hw, eager = _ops(False)
    _, _, compiled = _ops(True)
    inside = outside = 0
    for n in g.nodes:
        if n.kind != "op" or n.name not in eager:
            continue
        e, c = eager[n.name], compiled[n.name]
        assert c.param_host_s == e.param_host_s  # FSDP2's hooks stay outside the graph
        if n.layer is None:
            assert (c.compute_s, c.host_s) == (e.compute_s, e.host_s), n.name
            outside += 1
        elif is_matmul(n.target):
            assert c.compute_s == pytest.approx(e.compute_s)
            launches = LAUNCHES_PER_PRODUCT[0] + LAUNCHES_PER_PRODUCT[1] * n.requires_grad
            assert c.host_s == pytest.approx(launches * hw.kernel_overhead_s)
            inside += 1
        else:
            assert c.compute_s == pytest.approx(MEMORY_FACTOR * e.compute_s, rel=1e-9)
            assert c.host_s == 0.0
            inside += 1
    assert inside and outside


def test_the_planner_compiles_on_h100_and_reports_the_compile_time(gpt) -> None:
    """On the H100 profile (measured faster compiled) the plan compiles its blocks,
    is priced faster than the same configuration run eager, and says how long
    compiling takes: COMPILE_BASE_S + COMPILE_PER_OP_S per op of one block."""
    model, x = gpt
    plan = autopar.plan(model, x, cluster=H100, dp=2, tp=1, zero=3, recompute="none")
    eager = autopar.plan(model, x, cluster=H100, dp=2, tp=1, zero=3, recompute="none",
                         compile=False)
    assert plan.compile_blocks and not eager.compile_blocks
    assert plan.step_time_s < eager.step_time_s
    ops = sum(1 for n in capture(model, x).nodes if n.kind == "op" and n.layer == 0)
    assert plan.compile_s == pytest.approx(COMPILE_BASE_S + COMPILE_PER_OP_S * ops)
    assert any("compiled with torch.compile" in note for note in plan.notes)
    assert "blocks compiled (torch.compile" in plan.summary()
    assert autopar.Plan.from_json(plan.to_json()).compile_blocks


def test_estimate_pipelines_and_cpus_stay_eager(gpt) -> None:
    """A hand-written configuration is scored eager unless it says compile=True; a
    pipeline (cut from an exported program, not the blocks) is never compiled; the CPU
    profile (not measured faster) plans eager."""
    model, x = gpt
    scored = autopar.estimate(model, x, autopar.Spec(dp=2), cluster=H100)
    asked = autopar.estimate(model, x, autopar.Spec(dp=2, compile=True), cluster=H100)
    assert not scored.compile_blocks and asked.compile_blocks
    assert asked.step_time_s < scored.step_time_s
    piped = autopar.plan(model, x, cluster=H100, pp=2, dp=1, tp=1)
    assert piped.pipeline is not None and not piped.compile_blocks
    cpu = autopar.plan(model, x, cluster=autopar.Cluster("cpu", 1, 2), dp=2)
    assert not cpu.compile_blocks and cpu.compile_s == 0.0


def test_compile_asked_of_a_model_without_blocks_is_refused() -> None:
    """A single Linear has no repeated blocks to compile: one message saying so."""
    model = torch.nn.Sequential(torch.nn.Linear(16, 4))
    with pytest.raises(ConfigError) as err:
        autopar.plan(model, (torch.randn(8, 16),), cluster=H100, compile=True)
    assert str(err.value) == ("compile=True compiles the model's repeated blocks, and "
                              "autopar found none in this model; leave compile out")
