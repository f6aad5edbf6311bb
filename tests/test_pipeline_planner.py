"""The planner and pipelining: it pipelines when nothing else fits and when pipelining
is faster, never for a model that fits on one device, and scores hand-written 3-D
configurations."""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar.errors import NoFeasiblePlanError
from autopar.examples.gpt import GPT, GPTConfig


def gpt(dim: int = 256, layers: int = 8, seq: int = 128, vocab: int = 1024):
    """A meta-device GPT and one example batch of 8."""
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=vocab, max_seq_len=seq, dim=dim, n_layers=layers,
                              n_heads=8))
    return model, (torch.randint(0, vocab, (8, seq), device="meta"),)


def test_pipelines_when_nothing_else_fits() -> None:
    model, x = gpt()
    cluster = autopar.Cluster("h100-sxm", 1, 4)
    fixed = dict(tp=1, zero=0, global_batch=8)
    free = autopar.plan(model, x, cluster=cluster, pp=1, **fixed)
    budget = 0.5 * free.memory_per_device_bytes  # half of what data parallelism needs
    with pytest.raises(NoFeasiblePlanError):
        autopar.plan(model, x, cluster=cluster, pp=1, memory_budget=budget, **fixed)
    plan = autopar.plan(model, x, cluster=cluster, memory_budget=budget, **fixed)
    assert plan.pipeline is not None and plan.degree("pp") > 1
    assert plan.memory_per_device_bytes <= budget
    units = [u for st in plan.pipeline.stages for u in st.units]
    assert units == ["tok_emb", "pos_emb"] + [f"blocks.{i}" for i in range(8)] + ["ln_f", "head"]
    assert "pipeline  pp=" in plan.summary()


def test_pipelines_when_faster_over_slow_links() -> None:
    # two single-GPU nodes on a 0.5 GB/s link: all-reducing 12 MB of gradients costs more
    # than handing 0.5 MB activations along a pipeline
    model, x = gpt(dim=512, layers=4, seq=64)
    cluster = autopar.Cluster("h100-sxm", 2, 1, inter_node_bandwidth=0.5)
    plan = autopar.plan(model, x, cluster=cluster, global_batch=8, tp=1)
    assert plan.mesh == {"pp": 2, "dp": 1, "tp": 1}
    dp = autopar.plan(model, x, cluster=cluster, global_batch=8, tp=1, pp=1)
    assert plan.step_time_s < dp.step_time_s


def test_never_pipelines_a_model_that_fits_on_one_device() -> None:
    """GPT-2 small with micro-batches of 32 or more, where the device's work outweighs
    the host's (at micro-batch 8 an H100 step of it is host-bound: there a pipeline
    splits each rank's host work, optimizer step included, and may win)."""
    model, x = gpt(dim=768, layers=12, seq=1024, vocab=50304)  # GPT-2 small's shape
    for nodes, per_node in ((1, 8), (1, 4)):
        plan = autopar.plan(model, x, cluster=autopar.Cluster("h100-sxm", nodes, per_node),
                            global_batch=256)
        assert plan.pipeline is None, plan.summary()
        assert plan.breakdown["exposed_host_s"] == 0.0


def test_estimate_scores_a_hand_written_pipeline() -> None:
    model, x = gpt()
    cluster = autopar.Cluster("h100-sxm", 1, 8)
    spec = autopar.Spec(tp=2, pp=2, schedule="interleaved_1f1b", virtual_stages=2,
                        microbatch_size=2)
    plan = autopar.estimate(model, x, spec, cluster=cluster, global_batch=32)
    assert plan.mesh == {"pp": 2, "dp": 2, "tp": 2}
    assert plan.pipeline.schedule == "interleaved_1f1b" and len(plan.pipeline.stages) == 4
    assert [st.rank for st in plan.pipeline.stages] == [0, 1, 0, 1]
    assert plan.num_microbatches == 8
    again = autopar.Plan.from_json(plan.to_json())
    assert again == plan


def test_an_interleaved_schedule_without_chunks_gets_the_fastest_count() -> None:
    """``schedule="interleaved_1f1b"`` without ``virtual_stages`` is the search's choice
    of 2 to 4 chunks per rank, the fastest of them (it was 1 chunk: plain 1F1B); asked
    for, each count is what it was asked."""
    model, x = gpt()
    cluster = autopar.Cluster("h100-sxm", 1, 8)
    kw = dict(tp=2, pp=2, schedule="interleaved_1f1b", microbatch_size=1)
    times = {}
    for v in (2, 3, 4):
        plan = autopar.estimate(model, x, autopar.Spec(**kw, virtual_stages=v),
                                cluster=cluster, global_batch=32)
        assert plan.pipeline.virtual_stages == v
        times[v] = plan.step_time_s
    free = autopar.estimate(model, x, autopar.Spec(**kw), cluster=cluster, global_batch=32)
    assert free.pipeline.virtual_stages > 1
    assert free.step_time_s == pytest.approx(min(times.values()), rel=1e-9)
