"""The code generator on pipelined plans: programs for pp x dp and pp x tp compile,
pass pyflakes, and under ``torchrun`` on 4 CPU processes print the same losses as
``apply_plan`` with the same plan, seed and data."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from autopar.plans import Plan
from autopar.runtime.codegen import emit_program, model_facts
from tests.dist_utils import RankPool
from tests.handmade_plans import pipeline_plan
from tests.test_codegen import (MODELS, SEED, TOL, emit_to, printed_losses, pyflakes,
                                reference_losses, torchrun_outputs, write_batch)

STEPS = 3
CASES = {  # name -> (factory, pipeline_plan arguments, optimizer, lr)
    "gpt pp2 dp2 1f1b (tied embedding across stages)": (
        "tiny_gpt", dict(pp=2, dp=2, schedule="1f1b"), "sgd", 0.1),
    "llama pp2 tp2 interleaved 1f1b, loss on vocabulary-split logits": (
        "tiny_llama", dict(pp=2, tp=2, schedule="interleaved_1f1b", virtual_stages=1,
                           num_microbatches=2, loss_parallel=True), "adamw", 1e-2),
    "llama pp2 dp2 zero3 gpipe full recompute": (
        "tiny_llama", dict(pp=2, dp=2, zero=3, schedule="gpipe", recompute="full"), "sgd", 0.1),
}


def make_plan(factory: str, kwargs: dict) -> Plan:
    """The hand-made pipelined plan of a case."""
    return pipeline_plan(model_facts(f"{MODELS}:{factory}").model, global_batch=8, **kwargs)


def test_pipelined_programs_are_clean(tmp_path: Path) -> None:
    """Pipelined programs for every schedule compile, pass pyflakes and keep lines short."""
    variants = [dict(pp=2, dp=2), dict(pp=2, tp=2, sequence_parallel=True),
                dict(pp=2, dp=2, zero=3, schedule="interleaved_zero_bubble", virtual_stages=1),
                dict(pp=2, schedule="gpipe", precision="bf16")]
    variants += [kw for _, kw, _, _ in CASES.values()]
    for factory in ("tiny_gpt", "tiny_llama"):
        for k, kwargs in enumerate(variants):
            text = emit_program(make_plan(factory, kwargs), f"{MODELS}:{factory}",
                                model_file="codegen_models.py")
            path = tmp_path / f"{factory}_{k}.py"
            path.write_text(text)
            compile(text, str(path), "exec")
            assert pyflakes(path) == "", (kwargs, pyflakes(path))
            assert max(len(line) for line in text.splitlines()) <= 99, kwargs
            assert "PipelineStage(" in text
            assert not re.search(r"^\s*(import|from) autopar", text, re.M)


@pytest.mark.multirank
def test_pipelined_programs_match_apply_plan(rank_pool: RankPool, tmp_path: Path) -> None:
    """Under torchrun, each pipelined program's losses equal apply_plan's (saving and
    resuming, across plans: test_checkpoints.py). (The programs share one torchrun
    job, each in processes of its own.)"""
    data = str(write_batch(tmp_path / "batch.pt"))
    specs = [(f, kw, opt, lr, STEPS) for f, kw, opt, lr in CASES.values()]
    expected = rank_pool.run(4, reference_losses, specs, data)[0]
    common = ["--data", data, "--seed", str(SEED)]
    runs = [(emit_to(tmp_path, f"case{k}", make_plan(factory, kwargs), factory),
             ["--steps", str(STEPS), "--optimizer", opt, "--lr", str(lr), *common])
            for k, (factory, kwargs, opt, lr) in enumerate(CASES.values())]
    outs = torchrun_outputs(runs, tmp_path / "runs")
    for k, (name, out) in enumerate(zip(CASES, outs)):
        assert printed_losses(out) == pytest.approx(expected[k], abs=TOL), name
