"""The optimizer step and FSDP2's parameter copies in the step time."""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar.cost_models.param_work import OPTIMIZER_STEP_BYTES, fsdp_copy_bytes
from autopar.examples.gpt import GPT, GPTConfig


def _gpt(meta: bool = False, **kw) -> tuple[GPT, torch.Tensor]:
    cfg = GPTConfig(**{**dict(vocab_size=512, max_seq_len=64, dim=128, n_layers=2,
                              n_heads=4), **kw})
    with torch.device("meta" if meta else "cpu"):
        model = GPT(cfg)
    return model, torch.randint(0, cfg.vocab_size, (8, cfg.max_seq_len),
                                device="meta" if meta else "cpu")


def test_optimizer_step_is_priced_over_each_devices_shard() -> None:
    """ZeRO-0 steps every parameter on every rank; ZeRO-1 a dp-th of them; CPU
    offload moves the step to the host's memory bandwidth."""
    model, x = _gpt()
    cluster = autopar.Cluster("h100-sxm", 1, 4)
    hw = cluster.hardware()
    n = sum(p.numel() for p in model.parameters())  # the tied embedding once
    full = autopar.estimate(model, (x,), autopar.Spec(dp=4), cluster=cluster)
    z1 = autopar.estimate(model, (x,), autopar.Spec(dp=4, zero=1), cluster=cluster)
    off = autopar.estimate(model, (x,), autopar.Spec(dp=4, zero=3, offload=True),
                           cluster=cluster)
    rate = hw.memory_bandwidth * hw.memory_efficiency
    assert full.breakdown["optimizer_s"] == pytest.approx(28.0 * n / rate, rel=1e-9)
    assert z1.breakdown["optimizer_s"] == pytest.approx(full.breakdown["optimizer_s"] / 4,
                                                        rel=1e-9)
    assert off.breakdown["optimizer_s"] > 10 * z1.breakdown["optimizer_s"]
    sgd = autopar.estimate(model, (x,), autopar.Spec(dp=4), cluster=cluster, optimizer="sgd")
    assert sgd.breakdown["optimizer_s"] / full.breakdown["optimizer_s"] == pytest.approx(
        OPTIMIZER_STEP_BYTES["sgd"] / OPTIMIZER_STEP_BYTES["adamw"])


def test_fsdp_copies_follow_the_zero_stage_and_micro_batches() -> None:
    """Bytes per element (param_work docstring): one device in bf16 copies 14 in the
    forward and 22 in the backward; ZeRO-3 gathers again in the backward; several
    micro-batches without ZeRO-3 accumulate instead of reducing all but once."""
    assert fsdp_copy_bytes(2, 1, 0, 1) == (14.0, 22.0)
    f3, b3 = fsdp_copy_bytes(2, 4, 3, 1)
    f1, b1 = fsdp_copy_bytes(2, 4, 1, 1)
    assert f3 == f1 and b3 == pytest.approx(b1 + f1)
    _, acc = fsdp_copy_bytes(2, 1, 0, 4)
    assert acc == pytest.approx((22.0 + 3 * 10.0) / 4)
    # kept gathered between micro-batches: ZeRO-0/1/2 gather on the first only, ZeRO-3
    # (a pipeline stage) in forward only
    assert fsdp_copy_bytes(2, 4, 2, 4, keeps_gathered=True)[0] == pytest.approx(f1 / 4)
    kept3 = fsdp_copy_bytes(2, 4, 3, 4, keeps_gathered=True)
    assert kept3 == pytest.approx((f1, fsdp_copy_bytes(2, 4, 2, 4)[1]))


def test_one_device_bf16_pays_fsdp_copies_per_micro_batch() -> None:
    """In bf16 FSDP2's MixedPrecisionPolicy copies every parameter each micro-batch, so
    four micro-batches cost more than one of four times the size, and the planner keeps
    one (measured on one H100: a 1.32B GPT steps in 175 ms with one micro-batch of 4,
    in 475 ms with four of 1; benchmarks/results/h100_runtime_steps.json)."""
    model, x = _gpt(meta=True, vocab_size=50304, max_seq_len=2048, dim=2048, n_layers=24,
                    n_heads=16)
    x = x[:4]
    one = autopar.Cluster("h100-sxm", 1, 1)
    plan = autopar.plan(model, (x,), cluster=one, global_batch=4, precision="bf16")
    assert plan.microbatch_size == 4
    compute = {mb: autopar.estimate(model, (x,), autopar.Spec(dp=1, microbatch_size=mb,
                                                                recompute="none"),
                                    cluster=one, precision="bf16").breakdown["compute_s"]
               for mb in (1, 4)}
    assert compute[1] > compute[4]


def test_fsdp_copy_is_counted_wherever_the_runtime_applies_fsdp() -> None:
    """One rule decides where FSDP2 lays parameters out (data parallelism, low
    precision, offload): there the model counts its unsharded compute copy, and the
    runtime wraps the model; on one fp32 device without offload neither does."""
    from types import SimpleNamespace

    from autopar.cost_models.memory import param_bytes
    from autopar.runtime.mesh import needs_fsdp
    cases = {("fp32", 1, False): 0.0, ("fp32", 1, True): 4.0, ("bf16", 1, False): 2.0,
             ("fp32", 2, False): 4.0}
    for (precision, dp, offload), gathered in cases.items():
        zero = 3 if offload else 0
        assert param_bytes(precision, "adamw", zero, dp, offload).gathered == gathered
        plan = SimpleNamespace(precision=precision, offload=offload, data_parallel=dp,
                               degree=lambda axis: 1)
        assert needs_fsdp(plan) == (gathered > 0)
    # context parallelism's ranks hold replicas too: FSDP2 runs on dp x cp
    assert needs_fsdp(SimpleNamespace(precision="fp32", offload=False, data_parallel=1,
                                      degree=lambda axis: 2 if axis == "cp" else 1))
