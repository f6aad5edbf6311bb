"""Pipelining models written independently of autopar: stages are cut from the model's
exported program at its blocks, so code in the root's forward (nanoGPT's tied head
``F.linear(x, self.wte.weight)`` and ``torch.arange`` positions, rotary tables made in
a Llama's root) and Hugging Face models pipeline.

The planner (``autopar.plan`` on a 4-rank CPU cluster) makes each pipelined plan, and
on 4 gloo ranks the runtime (which exports the stages for the input shapes the plan
records) trains with losses over 3 SGD steps (fp32) equal to a single process within
1e-5; the cut stages chained in one process equal the model's forward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import autopar
from autopar.capture import default_loss, first_tensor
from autopar.demo import sgd_losses
from autopar.plans import Plan
from autopar.runtime import apply_plan
from autopar.runtime.pipeline import split_for_plan
from autopar.pipeline_split import pipeline_blocker
from tests.dist_utils import RankPool
from tests.foreign_models import (BATCH, SEQ, VOCAB, NanoGPT, TinyLlama, lm_loss,
                                   lm_sum_loss, nano_gpt)
from tests.foreign_models import example_batch as data

try:  # the Hugging Face cases are skipped without transformers
    from tests.test_hf_models import gpt2 as hf_gpt2
    from tests.test_hf_models import llama as hf_llama
except pytest.skip.Exception:
    hf_gpt2 = hf_llama = None

STEPS, LR, TOL, SEED = 3, 0.1, 1e-5, 3
MODELS_FILE = Path(__file__).with_name("foreign_models.py")
CPU4 = autopar.Cluster(gpu="cpu", gpus_per_node=4)


MODELS: dict[str, Callable[[], torch.nn.Module]] = {
    "nanogpt": lambda: NanoGPT(vocab_size=VOCAB, block_size=SEQ, n_layer=2),
    "nanogpt-8": lambda: NanoGPT(vocab_size=VOCAB, block_size=SEQ, n_layer=8),
    "tinyllama": lambda: TinyLlama(vocab_size=VOCAB, n_layers=4),
    "hf-gpt2": hf_gpt2,
    "hf-llama": hf_llama,
}
CASES = {  # name -> (model, custom loss, planning options)
    "nanogpt lm_loss pp2 dp2 1f1b": ("nanogpt", lm_loss, dict(pp=2, dp=2, schedule="1f1b")),
    "nanogpt lm_loss pp4 interleaved 1f1b": (
        "nanogpt-8", lm_loss, dict(pp=4, dp=1, schedule="interleaved_1f1b", virtual_stages=2)),
    "tinyllama pp2 dp2 zero3 full recompute interleaved": (
        "tinyllama", None, dict(pp=2, dp=2, zero=3, recompute="full",
                                schedule="interleaved_1f1b", virtual_stages=2)),
    "hf gpt2 pp2 dp2 1f1b": ("hf-gpt2", None, dict(pp=2, dp=2, schedule="1f1b")),
    "hf llama pp2 dp2 1f1b": ("hf-llama", None, dict(pp=2, dp=2, schedule="1f1b")),
    "nanogpt lm_loss pp2 tp2 sequence-parallel 1f1b": (
        "nanogpt", lm_loss, dict(pp=2, dp=1, tp=2, sequence_parallel=True, schedule="1f1b")),
    "nanogpt summed loss pp2 dp2 1f1b": ("nanogpt", lm_sum_loss, dict(pp=2, dp=2,
                                                                       schedule="1f1b")),
}
HF = hf_gpt2 is not None
RUNNABLE = {name: case for name, case in CASES.items() if HF or not case[0].startswith("hf-")}


def make(kind: str) -> torch.nn.Module:
    """The model with the same weights on every call."""
    torch.manual_seed(0)
    return MODELS[kind]()


def loss_of(loss_fn: Callable | None, output, targets: torch.Tensor) -> torch.Tensor:
    """The case's loss, or the default cross-entropy of the output's logits."""
    if loss_fn is not None:
        return loss_fn(output, targets)
    return default_loss(first_tensor(output), targets)


def make_plan(name: str) -> Plan:
    """The planner's plan of a case for 4 CPU ranks (micro-batches of one sample)."""
    kind, loss_fn, options = CASES[name]
    x, y = data()
    return autopar.plan(make(kind), (x,), cluster=CPU4, precision="fp32", optimizer="sgd",
                        microbatch_size=1, global_batch=BATCH, loss_fn=loss_fn,
                        example_targets=y if loss_fn is not None else None,
                        **{"tp": 1, **options})


def reference(name: str) -> list[float]:
    """The single-process losses of a case."""
    kind, loss_fn, _ = CASES[name]
    model = make(kind)
    x, y = data()

    def step() -> torch.Tensor:
        loss = loss_of(loss_fn, model(x), y)
        loss.backward()
        return loss.detach()

    return sgd_losses(model.parameters(), step, STEPS, LR)


def rank_main(plans: dict[str, str]) -> dict[str, list[float]]:
    """Train every case under its plan on this rank; return the losses."""
    out = {}
    for name, text in plans.items():
        kind, loss_fn, _ = CASES[name]
        model = make(kind)
        x, y = data()
        pm = apply_plan(model, Plan.from_json(text), loss_fn=functools.partial(loss_of, loss_fn))
        out[name] = sgd_losses(pm.parameters(), lambda: pm.step(x, y), STEPS, LR)
    return out


@pytest.fixture(scope="module")
def plans() -> dict[str, Plan]:
    """The planner's plan of every runnable case."""
    return {name: make_plan(name) for name in RUNNABLE}


@pytest.mark.parametrize("name", list(RUNNABLE))
def test_planner_offers_the_pipeline(plans, name: str) -> None:
    options = CASES[name][2]
    plan = plans[name]
    assert plan.pipeline is not None and plan.pipeline.schedule == options["schedule"]
    assert plan.mesh == {"pp": options["pp"], "dp": options["dp"], "tp": options.get("tp", 1)}
    assert plan.sequence_parallel == options.get("sequence_parallel", False)
    assert not any("left out" in n for n in plan.notes)
    assert plan.inputs == [{"shape": [BATCH, SEQ], "dtype": "int64"}]  # what stages are cut for


@pytest.mark.parametrize("kind", [k for k in MODELS if HF or not k.startswith("hf-")])
def test_cut_stages_chained_equal_the_model(plans, kind: str) -> None:
    model = make(kind)
    x, _ = data()
    plan = plans[next(n for n, c in CASES.items() if c[0] == kind)]
    assert pipeline_blocker(model, (x,), plan.blocks) is None
    cut, _ = split_for_plan(model, plan, (x,))
    mb = x[:plan.microbatch_size]
    acts: tuple = ()
    for stage in cut.stages:
        out = stage.module(*acts, **dict(zip(cut.input_names, (mb,))))
        acts = out if isinstance(out, tuple) else (out,)
    assert torch.equal(first_tensor(cut.unflatten(out)), first_tensor(model(mb)))
    first_block = plan.blocks[0]
    assert cut.stages[0].module.get_submodule(first_block) is model.get_submodule(first_block)


@pytest.mark.multirank
def test_pipelined_training_matches_single_process(rank_pool: RankPool, plans) -> None:
    got = rank_pool.run(4, rank_main, {n: p.to_json() for n, p in plans.items()},
                          timeout_s=500)
    for name in plans:
        want = reference(name)
        for rank, losses in enumerate(r[name] for r in got):
            # rel 1e-6: a summed loss is large; fp32 rounding grows with it
            assert losses == pytest.approx(want, abs=TOL, rel=1e-6), (name, rank, losses)


def runtime(text: str) -> list[float]:
    """What the emitted program should print: apply_plan on the NanoGPT built under the
    program's seed, trained with lm_loss on the program's batch."""
    torch.manual_seed(SEED)
    model = nano_gpt()[0]
    pm = apply_plan(model, Plan.from_json(text), loss_fn=lm_loss)
    x, y = data()
    return sgd_losses(pm.parameters(), lambda: pm.step(x, y), STEPS, LR)


@pytest.mark.multirank
@pytest.mark.slow
def test_emitted_program_cuts_the_same_stages(rank_pool: RankPool, tmp_path: Path) -> None:
    """The emitted program of NanoGPT under pp2 x dp2 (root code on both end stages,
    wte tied across them) cuts its model by the runtime's code and prints the
    runtime's losses."""
    from autopar.runtime.codegen import emit_program
    from tests.test_codegen import torchrun

    model, (x,), y = nano_gpt()
    plan = autopar.plan(model, (x,), cluster=CPU4, precision="fp32", optimizer="sgd",
                        example_targets=y, loss_fn=lm_loss, tp=1, pp=2, dp=2,
                        schedule="1f1b", microbatch_size=1)
    want = rank_pool.run(4, runtime, plan.to_json(), timeout_s=300)[0]
    data_file = tmp_path / "batch.pt"
    torch.save({"inputs": x, "targets": y}, data_file)
    program = tmp_path / "nanogpt_pp2.py"
    program.write_text(emit_program(plan, f"{MODELS_FILE}:nano_gpt", model_file=str(MODELS_FILE),
                                    loss_spec=f"{MODELS_FILE}:lm_loss"))
    got = torchrun(program, "--steps", str(STEPS), "--optimizer", "sgd", "--lr", str(LR),
                   "--seed", str(SEED), "--data", str(data_file))
    assert got == pytest.approx(want, abs=TOL)
