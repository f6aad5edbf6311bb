"""Lowering hand-made pipelined plans: pipeline-parallel training equals a
single-process run.

Over 3 SGD steps (lr 0.1, fp32, fixed seeds) the losses of tiny 4-block GPT (tied
embedding and head on the first and last stages) and Llama (RoPE tables computed in
forward) models under every pipeline schedule, alone and combined with data parallel,
ZeRO-3 and tensor parallel on a ("pp", "dp", "tp") mesh, equal a single-process run to
1e-5, and so do the final parameters. One spawned 4-rank gloo group runs every
configuration; the stage cut and the plan checks run in-process.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch.distributed.tensor import DTensor

from autopar.errors import LoweringError
from autopar.examples.gpt import GPT, GPTConfig
from autopar.examples.llama import Llama, LlamaConfig
from autopar.runtime import apply_plan
from autopar.runtime.pipeline import check_pipeline, split_for_plan
from tests.dist_utils import RankPool
from tests.handmade_plans import pipeline_plan
from tests.test_runtime import (BATCH, SEQ, TOL, global_batch, single_process_run,
                                train_steps)

pytestmark = pytest.mark.multirank

LAYERS = 4

CASES = {
    "gpt pp=4 1f1b": ("gpt", dict(pp=4)),
    "llama pp=4 1f1b": ("llama", dict(pp=4)),
    "gpt pp=2 dp=2": ("gpt", dict(pp=2, dp=2)),
    "llama pp=2 dp=2 zero3": ("llama", dict(pp=2, dp=2, zero=3)),
    "gpt pp=2 tp=2 vocab-parallel": ("gpt", dict(pp=2, tp=2)),
    "llama pp=2 tp=2": ("llama", dict(pp=2, tp=2)),
    "gpt pp=2 dp=2 interleaved 1f1b": ("gpt", dict(pp=2, dp=2, schedule="interleaved_1f1b")),
    "llama pp=2 tp=2 zbv": ("llama", dict(pp=2, tp=2, schedule="zbv")),
    "gpt pp=2 dp=2 zero3 interleaved zero-bubble": (
        "gpt", dict(pp=2, dp=2, zero=3, schedule="interleaved_zero_bubble")),
    "llama pp=4 gpipe": ("llama", dict(pp=4, schedule="gpipe")),
}


def make_model(kind: str) -> torch.nn.Module:
    """The tiny model with 4 blocks, with the same weights on every call."""
    torch.manual_seed(0)
    if kind == "gpt":
        return GPT(GPTConfig(vocab_size=128, max_seq_len=SEQ, dim=32, n_layers=LAYERS,
                             n_heads=4))
    return Llama(LlamaConfig(vocab_size=128, max_seq_len=SEQ, dim=32, n_layers=LAYERS,
                             n_heads=4, n_kv_heads=2, ffn_dim=64))


@functools.lru_cache(maxsize=None)
def reference(kind: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses and final parameters (every alias of a tied one) of the single-process run."""
    return single_process_run(make_model(kind), aliases=True)


def train(kind: str, plan_kwargs: dict) -> dict:
    """Train under a hand-made pipelined plan; return the losses and the whole
    tensors of this rank's stages' parameters."""
    model = make_model(kind)
    pm = apply_plan(model, pipeline_plan(model, global_batch=BATCH, **plan_kwargs),
                    example_inputs=global_batch()[0])
    losses = train_steps(pm)
    params = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
              for stage in pm.module for n, p in stage.named_parameters()}
    return {"losses": losses, "params": params}


def train_meta() -> dict:
    """A meta-device GPT under pp=2 x dp=2 with ZeRO-3: which parameters this rank
    allocated, their local sizes, and the losses."""
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=128, max_seq_len=SEQ, dim=32, n_layers=LAYERS,
                              n_heads=4))
    torch.manual_seed(0)
    pm = apply_plan(model, pipeline_plan(model, pp=2, dp=2, zero=3, global_batch=BATCH),
                    example_inputs=global_batch()[0])
    own = {n: (p.to_local().numel(), p.numel(), p.device.type)
           for stage in pm.module for n, p in stage.named_parameters()}
    still_meta = sorted(n for n, p in model.named_parameters() if p.is_meta)
    losses = train_steps(pm, 5)
    return {"own": own, "still_meta": still_meta, "losses": losses}


def error_of(fn, *args) -> str:
    """The message of the LoweringError ``fn(*args)`` raises."""
    try:
        fn(*args)
    except LoweringError as e:
        return str(e)
    return "no error"


def rank_main() -> dict:
    """Everything the spawned group runs."""
    out: dict = {"cases": {name: train(*case) for name, case in CASES.items()}}
    out["meta"] = train_meta()
    model = make_model("gpt")
    out["world"] = error_of(apply_plan, model, pipeline_plan(model, pp=2, global_batch=BATCH))
    return out


@pytest.fixture(scope="module")
def ranks(rank_pool: RankPool) -> list[dict]:
    """Results of every rank of the 4-rank group (run once)."""
    return rank_pool.run(4, rank_main, timeout_s=400)


@pytest.mark.parametrize("name", list(CASES))
def test_pipeline_training_matches_single_process(ranks, name: str) -> None:
    kind = CASES[name][0]
    ref_losses, ref_params = reference(kind)
    params: dict[str, torch.Tensor] = {}
    for rank, res in enumerate(r["cases"][name] for r in ranks):
        assert res["losses"] == pytest.approx(ref_losses, abs=TOL, rel=0), (rank, res["losses"])
        params.update(res["params"])
    # every parameter lives on some stage; a tied one on each stage that uses it
    assert params.keys() == ref_params.keys()
    for n, p in params.items():
        assert (p - ref_params[n]).abs().max().item() <= TOL, n


def test_meta_model_materializes_only_its_stage(ranks) -> None:
    for rank, res in enumerate(r["meta"] for r in ranks):
        first = rank < 2  # pp coordinate 0: ranks 0 and 1 (dp=2)
        assert ("blocks.0.attn.q.weight" in res["own"]) == first
        assert ("blocks.3.attn.q.weight" in res["own"]) == (not first)
        for n, (local, numel, device) in res["own"].items():
            assert (local, device) == (numel // 2, "cpu"), n  # ZeRO-3 shard over dp=2
        assert ("blocks.3.attn.q.weight" in res["still_meta"]) == first
        losses = res["losses"]
        assert losses[-1] < losses[0], losses


def test_world_size_mismatch_is_reported(ranks) -> None:
    assert ranks[0]["world"] == (
        "the plan's mesh {'pp': 2, 'dp': 1, 'tp': 1} has 2 devices but the process group has 4 "
        "ranks; run with 2 processes, or make a plan for 4 devices")


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_stages_chained_equal_the_model(kind: str) -> None:
    model = make_model(kind)
    plan = pipeline_plan(model, pp=2, schedule="interleaved_1f1b")
    x, _ = global_batch()
    cut, _ = split_for_plan(model, plan, x)
    acts: tuple = ()
    mb = x[:plan.microbatch_size]
    for st in cut.stages:
        out = st.module(*acts, idx=mb)
        acts = out if isinstance(out, tuple) else (out,)
    assert torch.equal(cut.unflatten(out), model(mb))
    assert cut.stages[1].module.get_submodule(f"{'blocks' if kind == 'gpt' else 'layers'}.1") \
        is model.get_submodule(f"{'blocks' if kind == 'gpt' else 'layers'}.1")


def test_missing_stage_module_is_reported() -> None:
    model = make_model("gpt")
    plan = pipeline_plan(model, pp=2)
    plan.pipeline.stages[1].units[0] = "blocks.9"
    assert error_of(check_pipeline, model, plan) == (
        "pipeline stage 1 names unit 'blocks.9', which the model does not have; was the plan "
        "made for another model (plan.model = 'GPT')? Re-plan for this model")


def test_too_few_microbatches_are_reported() -> None:
    model = make_model("llama")
    plan = pipeline_plan(model, pp=4, num_microbatches=2, global_batch=8)
    assert error_of(check_pipeline, model, plan) == (
        "the '1f1b' schedule needs at least as many micro-batches as stages (4), but the plan "
        "has num_microbatches=2; use 4 or more micro-batches")


def test_microbatches_not_filling_rounds_are_reported() -> None:
    model = make_model("gpt")
    plan = pipeline_plan(model, pp=2, schedule="interleaved_1f1b", num_microbatches=5,
                         global_batch=10)
    assert error_of(check_pipeline, model, plan) == (
        "the 'interleaved_1f1b' schedule runs micro-batches in rounds of pp=2, so "
        "num_microbatches=5 must be a multiple of 2; use a multiple of 2 micro-batches")


def test_stage_ranks_must_follow_the_schedule() -> None:
    model = make_model("gpt")
    plan = pipeline_plan(model, pp=2, schedule="zbv")
    plan.pipeline.stages[2].rank, plan.pipeline.stages[3].rank = 0, 1
    assert error_of(check_pipeline, model, plan) == (
        "the 'zbv' schedule places stages on pp ranks [0, 1, 1, 0], but the plan places them "
        "on [0, 1, 0, 1]; fix the stages' ranks")


DEEP = {  # (schedule, chunks per rank) on pp=2 over an 8-block GPT
    "interleaved 1f1b v3": ("interleaved_1f1b", 3),
    "interleaved zero-bubble v4": ("interleaved_zero_bubble", 4),
}


def deep_gpt() -> torch.nn.Module:
    """The tiny GPT with 8 blocks, the same weights on every call."""
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=128, max_seq_len=SEQ, dim=32, n_layers=8, n_heads=4))


def train_deep(cases: list[tuple[str, int]]) -> list[tuple[list[float], int]]:
    """Each planned pipeline's losses and its chunks per rank."""
    import autopar
    out = []
    for schedule, v in cases:
        x, _ = global_batch()
        pm = autopar.parallelize(deep_gpt(), (x,), precision="fp32", pp=2, dp=1, tp=1,
                                 schedule=schedule, virtual_stages=v, microbatch_size=2)
        out.append((train_steps(pm), pm.plan.pipeline.virtual_stages))
    return out


def test_deeper_interleaving_trains_as_one_process(rank_pool: RankPool) -> None:
    """Three and four chunks per rank (6 and 8 stages on 2 ranks) as the planner cuts
    them train as one process does."""
    got = rank_pool.run(2, train_deep, list(DEEP.values()), timeout_s=300)[0]
    want, _ = single_process_run(deep_gpt())
    for (name, (_, v)), (losses, chunks) in zip(DEEP.items(), got):
        assert chunks == v, name
        assert losses == pytest.approx(want, abs=TOL), name
