"""``compile=True``: each of the plan's blocks runs under torch.compile (inductor's
CPU code here), and 3 AdamW steps under dp2 with ZeRO-3 (also with selective
recomputation, whose policy then runs while tracing) and under tp2 equal the same loop
uncompiled on one process to 1e-6 in float64 losses and parameters; a pipelined
plan refuses the option with one message."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

import autopar
from autopar.errors import ConfigError
from autopar.plans import Plan
from tests import foreign_models
from tests.dist_utils import RankPool
from tests.handmade_plans import megatron_plan, pipeline_plan
from tests.test_checkpoints import make
from tests.test_user_loop import LR, STEPS, TOL, my_loss, reference


def compiled_loop(text: str) -> dict:
    """The whole batch's step, the plan's blocks compiled; whether they were."""
    x, y = foreign_models.example_batch()
    pm = autopar.parallelize(make("llama"), plan=Plan.from_json(text), loss_fn=my_loss,
                             compile=True)
    compiled = [p for p in pm.plan.blocks
                if getattr(pm.module.get_submodule(p), "_compiled_call_impl", None)]
    opt = torch.optim.AdamW(pm.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        losses.append(float(pm.step(x, y)))
        opt.step()
        opt.zero_grad()
    params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
              for n, p in pm.module.named_parameters()}
    return {"losses": losses, "params": params, "compiled": compiled}


NO_COMPILER = not shutil.which(os.environ.get("CXX", "g++"))
"""Inductor's CPU code needs a C++ compiler (``CXX``, default g++)."""


@pytest.mark.skipif(NO_COMPILER, reason="no C++ compiler for inductor's CPU code: install "
                    "g++ (or set CXX) to run torch.compile on the CPU")
@pytest.mark.multirank
@pytest.mark.parametrize("layout", [dict(dp=2, zero=3), dict(dp=1, tp=2),
                                    dict(dp=2, zero=3, recompute="selective")],
                         ids=["zero3-dp2", "tp2", "zero3-dp2-selective"])
def test_compiled_blocks_train_as_eager_one_process(rank_pool: RankPool, layout) -> None:
    ref_losses, ref_params = reference()
    plan = megatron_plan(make("llama"), **layout)
    got = rank_pool.run(2, compiled_loop, plan.to_json())
    for r in got:
        assert r["compiled"] == plan.blocks and plan.blocks
        assert r["losses"] == pytest.approx(ref_losses, abs=TOL)
        for n, want in ref_params.items():
            assert torch.allclose(r["params"][n], want, atol=TOL, rtol=0), n


def piped(text: str) -> str:
    x, _ = foreign_models.example_batch()
    try:
        autopar.parallelize(make("llama"), (x[:1],), plan=Plan.from_json(text), compile=True)
    except ConfigError as e:
        return str(e)
    return "no error"


@pytest.mark.multirank
def test_a_pipelined_plan_refuses_compile(rank_pool: RankPool) -> None:
    plan = pipeline_plan(make("llama"), pp=2)
    assert rank_pool.run(2, piped, plan.to_json()) == [
        "compile=True applies to plans without a pipeline: a pipeline's stages are cut "
        "from an exported program, not the model's blocks; leave compile off for this "
        "plan"] * 2
