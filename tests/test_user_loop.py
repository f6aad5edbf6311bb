"""A user's own loop: each of 4 gloo ranks takes its data-parallel shard of every
global batch (``pm.data_shard()``, as a ``DistributedSampler`` would), runs
``out = pm(x)``, its own loss, ``loss.backward()`` and ``opt.step()``; under dp4,
dp2 x tp2 (vocabulary-parallel, heads split, sequence parallel), ZeRO-3 dp4 and
tp4 with sequence parallelism (no FSDP: partial gradients reduced by hooks),
with two micro-batches accumulated under ``pm.no_sync()``, the losses and the final
parameters equal a single-process run's to 1e-6 (float64). A pipelined plan's
``step(x, y, local=True)`` takes per-rank shards the same way."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import autopar
from autopar.plans import Plan
from tests import foreign_models
from tests.dist_utils import RankPool
from tests.handmade_plans import megatron_plan, pipeline_plan
from tests.test_checkpoints import make

STEPS, LR, TOL = 3, 1e-2, 1e-6


def my_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The user's loss: mean token cross-entropy."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    """3 AdamW steps of the whole batch in one process."""
    x, y = foreign_models.example_batch()
    model = make("llama")
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        loss = my_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach() for n, p in model.named_parameters()}


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def my_loop(text: str, accumulate: int) -> dict:
    """On each rank: this rank's shard of the global batch, ``accumulate`` micro-batches
    a step, the loop a PyTorch user writes."""
    x, y = foreign_models.example_batch()
    pm = autopar.parallelize(make("llama"), plan=Plan.from_json(text))
    shard = pm.data_shard()
    mine = slice(shard.index * shard.batch_size, (shard.index + 1) * shard.batch_size)
    x, y = x[mine], y[mine]
    opt = torch.optim.AdamW(pm.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        total = 0.0
        parts = zip(x.chunk(accumulate), y.chunk(accumulate))
        for i, (xi, yi) in enumerate(parts):
            with pm.no_sync() if i < accumulate - 1 else contextlib.nullcontext():
                loss = my_loss(pm(xi), yi) / accumulate
                loss.backward()
            total += float(loss)
        opt.step()
        opt.zero_grad()
        mean = torch.tensor(total, dtype=torch.float64)  # the global batch's loss
        dist.all_reduce(mean, group=pm.mesh.get_group("dp"))
        losses.append(float(mean) / shard.count)
    params = {n: _full(p) for n, p in pm.module.named_parameters()}
    return {"losses": losses, "params": params, "shard": (shard.index, shard.count)}


def piped_loop(text: str) -> list[float]:
    """A pipelined plan's step on this rank's shard (``local=True``)."""
    x, y = foreign_models.example_batch()
    pm = autopar.parallelize(make("llama"), (x[:1],), plan=Plan.from_json(text),
                             loss_fn=my_loss)
    shard = pm.data_shard()
    mine = slice(shard.index * shard.batch_size, (shard.index + 1) * shard.batch_size)
    opt = torch.optim.AdamW(pm.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        losses.append(float(pm.step(x[mine], y[mine], local=True)))
        opt.step()
        opt.zero_grad()
    return losses


PLANS = {"dp4": dict(dp=4), "dp2xtp2-sp": dict(dp=2, tp=2, sequence_parallel=True),
         "zero3-dp4": dict(dp=4, zero=3), "tp4-sp": dict(dp=1, tp=4, sequence_parallel=True)}


@pytest.mark.multirank
@pytest.mark.parametrize("name", list(PLANS))
def test_a_users_loop_equals_one_process(rank_pool: RankPool, name: str) -> None:
    ref_losses, ref_params = reference()
    plan = megatron_plan(make("llama"), **PLANS[name])
    got = rank_pool.run(4, my_loop, plan.to_json(), 2)
    dp = PLANS[name]["dp"]
    assert [r["shard"] for r in got] == [(r // (4 // dp), dp) for r in range(4)]
    for r in got:
        assert r["losses"] == pytest.approx(ref_losses, abs=TOL)
        for n, want in ref_params.items():
            assert torch.allclose(r["params"][n], want, atol=TOL, rtol=0), (name, n)


@pytest.mark.multirank
def test_a_pipelined_step_takes_per_rank_shards(rank_pool: RankPool) -> None:
    ref_losses, _ = reference()
    plan = pipeline_plan(make("llama"), pp=2, dp=2)
    got = rank_pool.run(4, piped_loop, plan.to_json())
    for losses in got:
        assert losses == pytest.approx(ref_losses, abs=TOL)
