"""Lowering hand-made plans: parallel training equals a single-process run.

Over 3 SGD steps (lr 0.1, fp32, fixed seeds) the losses and the final parameters of
tiny GPT and Llama models under data, tensor, sequence and fully sharded data
parallelism, and gradient accumulation, equal a single-process run on the same global
batch to 1e-5. One spawned gloo group per world size (1, 2, 4) runs all its
configurations; the plan checks run in-process.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from torch.distributed.tensor import DTensor

from autopar.errors import ConfigError, LoweringError
from autopar.examples.gpt import GPT, GPTConfig
from autopar.examples.llama import Llama, LlamaConfig
from autopar.plans import Plan
from autopar.runtime import ParallelModel, apply_plan, check_plan
from tests.dist_utils import RankPool
from tests.handmade_plans import megatron_plan

pytestmark = pytest.mark.multirank

BATCH, SEQ, STEPS, LR, TOL = 8, 16, 3, 0.1, 1e-5
FFN_IN = {"gpt": "blocks.0.mlp.fc1.weight", "llama": "layers.0.ffn.w1.weight"}  # colwise

CASES = {
    4: {
        "gpt dp=4": ("gpt", dict(dp=4)),
        "llama dp=4": ("llama", dict(dp=4)),
        "gpt tp=4 vocab-parallel": ("gpt", dict(tp=4)),
        "llama tp=4 vocab-parallel": ("llama", dict(tp=4)),
        "gpt dp=2 tp=2 replicated embeddings": ("gpt", dict(dp=2, tp=2, vocab_parallel=False)),
        "llama dp=2 tp=2": ("llama", dict(dp=2, tp=2)),
        "gpt zero3 dp=4": ("gpt", dict(dp=4, zero=3)),
        "llama zero3 dp=4": ("llama", dict(dp=4, zero=3)),
    },
    2: {
        "gpt tp=2 sequence-parallel": ("gpt", dict(tp=2, sequence_parallel=True)),
        "llama tp=2 sequence-parallel": ("llama", dict(tp=2, sequence_parallel=True)),
        "gpt dp=2 2 micro-batches": ("gpt", dict(dp=2, num_microbatches=2)),
        "llama dp=2 2 micro-batches": ("llama", dict(dp=2, num_microbatches=2)),
        "gpt zero2 dp=2 2 micro-batches": ("gpt", dict(dp=2, zero=2, num_microbatches=2)),
    },
    1: {
        "gpt single rank": ("gpt", {}),
        "llama single rank 2 micro-batches": ("llama", dict(num_microbatches=2)),
    },
}


def make_model(kind: str) -> torch.nn.Module:
    """The tiny model, with the same weights on every call."""
    torch.manual_seed(0)
    if kind == "gpt":
        return GPT(GPTConfig(vocab_size=128, max_seq_len=16, dim=32, n_layers=2, n_heads=4))
    return Llama(LlamaConfig(vocab_size=128, max_seq_len=16, dim=32, n_layers=2, n_heads=4,
                             n_kv_heads=2, ffn_dim=64))


def global_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """One global batch of token ids and next-token targets."""
    g = torch.Generator().manual_seed(1)
    return (torch.randint(0, 128, (BATCH, SEQ), generator=g),
            torch.randint(0, 128, (BATCH, SEQ), generator=g))


def single_process_run(model: torch.nn.Module, *, aliases: bool = False
                       ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses and final parameters (with every alias of a tied one when ``aliases``)
    of training ``model`` in one process on the global batch."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = global_batch()
    losses = []
    for _ in range(STEPS):
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, -2), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone()
                    for n, p in model.named_parameters(remove_duplicate=not aliases)}


@functools.lru_cache(maxsize=None)
def reference(kind: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses and final parameters of the single-process run."""
    return single_process_run(make_model(kind))


def train_steps(pm: ParallelModel, steps: int = STEPS) -> list[float]:
    """Train ``pm`` with SGD on the global batch; return the losses of its steps."""
    opt = torch.optim.SGD(pm.parameters(), lr=LR)
    x, y = global_batch()
    losses = []
    for _ in range(steps):
        losses.append(pm.step(x, y).item())
        opt.step()
        opt.zero_grad()
    return losses


def full(p: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a (possibly distributed) parameter (a collective)."""
    return (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()


def train(kind: str, plan_kwargs: dict) -> dict:
    """Train under a hand-made plan; every rank returns its losses, rank 0 the final
    parameters too."""
    model = make_model(kind)
    pm = apply_plan(model, megatron_plan(model, global_batch=BATCH, **plan_kwargs))
    losses = train_steps(pm)
    layout = {"ffn_in_local_numel": pm.module.get_parameter(FFN_IN[kind]).to_local().numel()
              if isinstance(pm.module.get_parameter(FFN_IN[kind]), DTensor) else None,
              "tied": kind == "gpt" and pm.module.head.weight is pm.module.tok_emb.weight}
    params = {n: full(p) for n, p in pm.module.named_parameters()}
    rank0 = torch.distributed.get_rank() == 0
    return {"losses": losses, "params": params if rank0 else None, "layout": layout}


def train_meta() -> dict:
    """A meta-device GPT under dp=2 x tp=2 with ZeRO-3: local shard sizes and losses."""
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=128, max_seq_len=16, dim=32, n_layers=2, n_heads=4))
    plan = megatron_plan(model, dp=2, tp=2, zero=3, global_batch=BATCH)
    torch.manual_seed(0)
    pm = apply_plan(model, plan)
    sizes = {}
    for n, p in pm.module.named_parameters():
        split = math.prod(size for size, pl in zip(plan.mesh.values(), plan.params[n])
                          if pl.startswith("S("))
        sizes[n] = (p.to_local().numel(), p.numel() // split, p.device.type)
    losses = train_steps(pm, 5)
    return {"sizes": sizes, "losses": losses}


def error_of(fn, *args) -> str:
    """The message of the autopar error ``fn(*args)`` raises."""
    try:
        fn(*args)
    except (LoweringError, ConfigError) as e:
        return str(e)
    return "no error"


def rank_main(world: int) -> dict:
    """Everything one spawned group runs: its cases, then its extra checks."""
    out: dict = {"cases": {name: train(*case) for name, case in CASES[world].items()}}
    if world == 4:
        out["meta"] = train_meta()
    if world == 2:
        model = make_model("gpt")
        out["world"] = error_of(apply_plan, model, megatron_plan(model, dp=4))
        out["bf16"] = train("gpt", dict(dp=2, zero=3, precision="bf16"))["losses"]
    if world == 1:
        model = make_model("gpt")
        pm = apply_plan(model, megatron_plan(model, global_batch=BATCH))
        x, y = global_batch()
        out["batch"] = error_of(pm.step, x[:6], y[:6])
    return out


@pytest.fixture(scope="module")
def ranks(rank_pool: RankPool) -> dict[int, list[dict]]:
    """Results of every rank of the 1-, 2- and 4-rank groups (each run lazily, once)."""
    cache: dict[int, list[dict]] = {}

    def get(world: int) -> list[dict]:
        if world not in cache:
            cache[world] = rank_pool.run(world, rank_main, world, timeout_s=400)
        return cache[world]
    return get  # type: ignore[return-value]


@pytest.mark.parametrize("world,name", [(w, n) for w, cases in CASES.items() for n in cases])
def test_parallel_training_matches_single_process(ranks, world: int, name: str) -> None:
    kind = CASES[world][name][0]
    ref_losses, ref_params = reference(kind)
    results = [r["cases"][name] for r in ranks(world)]
    for rank, res in enumerate(results):
        assert res["losses"] == pytest.approx(ref_losses, abs=TOL, rel=0), (rank, res["losses"])
    params = results[0]["params"]
    assert params.keys() == ref_params.keys()
    for n, p in params.items():
        assert (p - ref_params[n]).abs().max().item() <= TOL, n
    # the plan was really applied: the colwise FFN weight holds 1/(tp x ZeRO dp) locally
    kw = CASES[world][name][1]
    split = kw.get("tp", 1) * (kw.get("dp", 1) if kw.get("zero", 0) else 1)
    local = results[0]["layout"]["ffn_in_local_numel"]
    if world > 1:
        assert local == ref_params[FFN_IN[kind]].numel() // split
    assert results[0]["layout"]["tied"] == (kind == "gpt")


def test_meta_model_materializes_only_local_shards_and_trains(ranks) -> None:
    for res in (r["meta"] for r in ranks(4)):
        for n, (local, expected, device) in res["sizes"].items():
            assert (local, device) == (expected, "cpu"), n
        assert res["sizes"]["blocks.0.attn.q.weight"][0] == 32 * 32 // 4
        losses = res["losses"]
        assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], losses


def test_world_size_mismatch_is_reported(ranks) -> None:
    assert ranks(2)[0]["world"] == (
        "the plan's mesh {'dp': 4, 'tp': 1} has 4 devices but the process group has 2 ranks; "
        "run with 4 processes, or make a plan for 2 devices")


def test_bf16_zero3_trains_close_to_fp32(ranks) -> None:
    # FSDP2 MixedPrecisionPolicy: bf16 compute, fp32 master weights and reductions
    assert ranks(2)[0]["bf16"] == pytest.approx(reference("gpt")[0], rel=2e-2)


def test_wrong_batch_is_reported(ranks) -> None:
    assert ranks(1)[0]["batch"] == (
        "step() got 6 samples in input 0, but the plan is for a global batch of 8; pass the "
        "whole global batch, the same on every rank (or this rank's shard with local=True)")


def test_apply_plan_needs_a_process_group() -> None:
    model = make_model("gpt")
    assert error_of(apply_plan, model, megatron_plan(model)) == (
        "apply_plan() needs an initialized default process group; run under torchrun, or call "
        "torch.distributed.init_process_group() first")


def _set_style(plan: Plan, path: str, style: str, placements: dict[str, str],
               output: str = "R") -> None:
    """Change one module's style and its parameters' tp placements in a plan."""
    mp = plan.modules[path]
    mp.style, mp.output_layout = style, output
    for local, tp in placements.items():
        plan.params[f"{path}.{local}"][1] = tp
        mp.params[local][1] = tp


def test_unknown_module_is_reported() -> None:
    model = make_model("gpt")
    plan = megatron_plan(model, tp=2)
    plan.modules["blocks.7.attn.q"] = plan.modules.pop("blocks.1.attn.q")
    assert error_of(check_plan, model, plan) == (
        "plan.modules names module 'blocks.7.attn.q', which the model does not have; was the "
        "plan made for another model (plan.model = 'GPT')? Re-plan for this model")


def test_placement_on_a_dim_the_parameter_lacks_is_reported() -> None:
    model = make_model("gpt")
    plan = megatron_plan(model, tp=2)
    plan.params["blocks.0.attn.q.weight"][1] = "S(2)"
    plan.modules["blocks.0.attn.q"].params["weight"][1] = "S(2)"
    assert error_of(check_plan, model, plan) == (
        "parameter 'blocks.0.attn.q.weight' of shape (32, 32) is planned as 'S(2)' on tp, but "
        "it has no dim 2; was the plan made for another model? Re-plan for this model")


def test_zero_placement_mismatch_is_reported() -> None:
    model = make_model("llama")
    plan = megatron_plan(model, dp=2, zero=3)
    plan.params["norm.weight"][0] = plan.modules["norm"].params["weight"][0] = "R"
    assert error_of(check_plan, model, plan) == (
        "parameter 'norm.weight' is planned as ['R', 'R'] on ('dp', 'tp'), but zero=3 over "
        "dp=2 places it as 'S(0)' on dp; make plan.params agree with plan.zero")


def test_tied_weights_with_different_placements_are_rejected() -> None:
    model = make_model("gpt")
    plan = megatron_plan(model, tp=2)
    _set_style(plan, "tok_emb", "replicate", {"weight": "R"})
    plan.params["head.weight"][1] = "S(0)"  # the alias keeps head's colwise placement
    assert error_of(check_plan, model, plan) == (
        "parameters 'tok_emb.weight' and 'head.weight' are one tied tensor, but the plan "
        "places them differently on tp (R, S(0)); give them one placement (re-plan)")


def test_a_meta_model_keeps_its_ties_and_its_own_initialization() -> None:
    """materialize() re-ties what ``to_empty`` would untie (the GPT's head and token
    embedding), runs children's reset_parameters() before their parents' (the GPT's own,
    std-0.02 embeddings, has the last word over nn.Embedding's N(0, 1)), and so a meta
    GPT starts near ln(vocab), as one built on a real device does."""
    from autopar.runtime.materialize import materialize

    cfg = GPTConfig(vocab_size=512, max_seq_len=64, dim=64, n_layers=2, n_heads=4)
    with torch.device("meta"):
        model = GPT(cfg)
    materialize(model, torch.device("cpu"))
    assert model.head.weight is model.tok_emb.weight
    assert len(list(model.parameters())) == len(list(GPT(cfg).parameters()))
    assert model.tok_emb.weight.std().item() == pytest.approx(0.02, rel=0.05)
    x = torch.randint(0, 512, (4, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
    assert abs(loss.item() - math.log(512)) < 0.5
