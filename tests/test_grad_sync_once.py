"""Data-parallel gradients reduced once per step where FSDP2 runs them so: ZeRO-1/2
with micro-batches (the runtime's ``set_requires_gradient_sync``) and every pipeline
stage (``torch.distributed.pipelining`` turns the sync off until its last backward).
The runtime is counted reducing once a step, and under ZeRO-1/2 gathering once a step
(``set_reshard_after_backward``); the prices follow it: the reduce-scatter moves from
each micro-batch to the step, the gradients are kept unsharded in fp32 until then, and
the parameters stay gathered."""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar.cost_models.memory import param_bytes
from autopar.examples.gpt import GPT, GPTConfig
from autopar.sharding import Mesh
from autopar.strategies.settings import Settings
from tests.dist_utils import RankPool
from tests.handmade_plans import megatron_plan, pipeline_plan

CONFIG = GPTConfig(vocab_size=128, max_seq_len=16, dim=32, n_layers=2, n_heads=4)


def _settings(zero: int, n: int, pipelined: bool) -> Settings:
    return Settings(Mesh(("dp", "tp"), (4, 1)), 1, n, zero, "bf16", "adamw", 8e10, None, 8,
                    pipelined=pipelined)


@pytest.mark.parametrize("zero, n, pipelined, once, kept", [
    (0, 4, False, False, True), (1, 1, False, False, False), (2, 4, False, True, True),
    (3, 4, False, False, False), (3, 4, True, True, True), (2, 1, True, False, False)])
def test_when_gradients_sync_once(zero: int, n: int, pipelined: bool, once: bool,
                                  kept: bool) -> None:
    st = _settings(zero, n, pipelined)
    assert (st.grad_sync_once, st.keeps_gathered) == (once, kept)


def test_unsharded_gradients_are_counted_in_fp32() -> None:
    """bf16 + AdamW over dp=4: 1 byte of fp32 gradient per element sharded, 4 unsharded;
    a stage that keeps its parameters gathered keeps ZeRO-3's too."""
    assert param_bytes("bf16", "adamw", 2, 4).grad == pytest.approx(1.0)
    assert param_bytes("bf16", "adamw", 2, 4, grads_unsharded=True).grad == 4.0
    assert not param_bytes("bf16", "adamw", 3, 4).gathered_all
    assert param_bytes("bf16", "adamw", 3, 4, True, keeps_gathered=True).gathered_all


def _priced(spec: autopar.Spec, batch: int) -> autopar.Plan:
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=51200, max_seq_len=2048, dim=4096, n_layers=8,
                              n_heads=32))
    x = torch.zeros(1, 2048, dtype=torch.long, device="meta")
    return autopar.estimate(model, (x,), spec, cluster=autopar.Cluster("h100-sxm", 4),
                            global_batch=batch, precision="bf16")


def test_zero2_micro_batches_pay_one_gather_and_one_reduce_scatter() -> None:
    """ZeRO-2 over dp=32 with 8 micro-batches: the data-parallel traffic per step is
    one all-gather and one reduce-scatter, as with one micro-batch of 8, not 8 of each;
    ZeRO-3's stays per micro-batch."""
    z2 = _priced(autopar.Spec(dp=32, zero=2, microbatch_size=1), 256)
    z2_one = _priced(autopar.Spec(dp=32, zero=2, microbatch_size=8), 256)
    # param_comm_s adds the per-micro-batch traffic of every micro-batch and the step's
    ratio = z2.breakdown["param_comm_s"] / z2_one.breakdown["param_comm_s"]
    assert ratio == pytest.approx(1.0, rel=0.05)
    z3 = _priced(autopar.Spec(dp=32, zero=3, microbatch_size=1), 256)
    z3_one = _priced(autopar.Spec(dp=32, zero=3, microbatch_size=8), 256)
    assert z3.breakdown["param_comm_s"] / z3_one.breakdown["param_comm_s"] == \
        pytest.approx(8.0, rel=0.05)


def _fsdp_reductions(plan_kind: str, what: str = "foreach_reduce") -> tuple[int, int]:
    """(FSDP2 gradient reductions, or with ``what`` "foreach_all_gather" parameter
    all-gathers, in one step; FSDP2 parameter groups) on this rank."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    from autopar.runtime import apply_plan

    torch.manual_seed(0)
    model = GPT(CONFIG)
    x = torch.randint(0, 128, (8, 16))
    if plan_kind == "pp2 dp2 zero2":
        plan = pipeline_plan(model, pp=2, dp=2, zero=2, num_microbatches=4)
    elif plan_kind == "pp2 dp2 zero3":
        plan = pipeline_plan(model, pp=2, dp=2, zero=3, num_microbatches=4)
    else:
        zero = 1 if "zero1" in plan_kind else 2
        plan = megatron_plan(model, dp=4, zero=zero, num_microbatches=2)
    pm = apply_plan(model, plan, example_inputs=x)
    calls = []
    original = getattr(_fsdp_param_group, what)
    setattr(_fsdp_param_group, what, lambda *a, **k: calls.append(1) or original(*a, **k))
    try:
        pm.step(x, x.roll(-1, 1))
    finally:
        setattr(_fsdp_param_group, what, original)
    modules, _ = pm.state_modules()
    groups = sum(1 for m in modules for sub in m.modules() if isinstance(sub, FSDPModule))
    return len(calls), groups


@pytest.mark.multirank
@pytest.mark.parametrize("plan_kind", ["dp4 zero2 2 micro-batches", "pp2 dp2 zero2",
                                       "pp2 dp2 zero3"])
def test_the_runtime_reduces_once_a_step(rank_pool: RankPool, plan_kind: str) -> None:
    """Every FSDP2 unit of each rank reduces its gradients once in a step of several
    micro-batches, as the prices assume."""
    for reductions, groups in rank_pool.run(4, _fsdp_reductions, plan_kind):
        assert groups > 0 and reductions == groups, plan_kind


@pytest.mark.multirank
@pytest.mark.parametrize("plan_kind", ["dp4 zero1 2 micro-batches", "dp4 zero2 2 micro-batches"])
def test_the_runtime_gathers_once_a_step(rank_pool: RankPool, plan_kind: str) -> None:
    """Under ZeRO-1/2 every FSDP2 unit gathers its parameters once in a step of several
    micro-batches (kept gathered after each backward but the last), as the prices
    assume; the losses stay those of one process (tests/test_runtime.py)."""
    for gathers, groups in rank_pool.run(4, _fsdp_reductions, plan_kind, "foreach_all_gather"):
        assert groups > 0 and gathers == groups, plan_kind
