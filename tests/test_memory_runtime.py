"""Lowering the memory choices of a plan: activation recomputation (full and
selective), ZeRO-1/2/3, CPU offload and mixed precision train exactly as a
single-process run does.

One spawned 4-rank gloo group trains tiny GPT and Llama models for 3 SGD steps (lr
0.1, fixed seeds) under each configuration; in fp32 the losses (and, without a
pipeline, the final parameters) equal a single-process fp32 run to 1e-5. Each run
also counts the forward calls of every block's first attention projection during a
step: a block whose forward is recomputed in backward runs it twice per micro-batch,
so a wrapper that silently did nothing fails the test. In-process tests check that
selective recomputation keeps strictly fewer bytes for backward than none and more
than full, the checks of ``plan.recompute``, and the memory probe.
"""

from __future__ import annotations

import functools
from typing import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from autopar.errors import LoweringError
from autopar.runtime import apply_plan, check_plan
from autopar.runtime.memory_probe import measure_step_memory, retained_bytes
from autopar.runtime.precision import precision_reference, single_rank_mesh
from autopar.runtime.recompute import (CheckpointedForward, checkpoint_block,
                                       recompute_mode, selective_policy)
from tests import test_pipeline_runtime as pipe_tests
from tests.dist_utils import RankPool
from tests.handmade_plans import megatron_plan, pipeline_plan
from tests.test_runtime import (BATCH, TOL, full, global_batch, make_model, reference,
                                train_steps)

pytestmark = pytest.mark.multirank

STEPS, LR = 3, 0.1
BF16_TOL, BF16_FIRST_TOL = 1e-3, 1e-4
"""Losses of a bf16 run against the bf16 single-process reference (the same FSDP2
``MixedPrecisionPolicy``, loss computed in fp32 from the logits). Both do the same ops
in bf16, but on different splits: each data-parallel rank's weight gradient is a bf16
matmul over its own samples, rounded to bf16 (relative error up to 2^-8) before the
fp32 reduction sums the ranks, where the reference rounds one sum over the whole
batch; tensor parallelism sums bf16 partial products in another order. Those
roundings move the losses of steps 2 and 3 by up to ~4e-4 here — as much as bf16
moves them from fp32 on these tiny models (whose initial loss is ~log(vocab)) — so the
steps agree to 1e-3 (about 2x that margin, 1/5000 of the loss). The first step's loss
(same weights, forward only) differs only by the order of tensor-parallel sums:
1e-4."""

CASES = {  # name -> (model, plan keywords); 2 blocks, 1 micro-batch
    "gpt full dp=2 tp=2": ("gpt", dict(dp=2, tp=2, recompute="full")),
    "llama full dp=2 tp=2": ("llama", dict(dp=2, tp=2, recompute="full")),
    "gpt selective dp=4": ("gpt", dict(dp=4, recompute="selective")),
    "llama selective dp=4": ("llama", dict(dp=4, recompute="selective")),
    "gpt selective dp=2 tp=2 sequence-parallel": (
        "gpt", dict(dp=2, tp=2, sequence_parallel=True, recompute="selective")),
    "llama selective dp=2 tp=2 sequence-parallel": (
        "llama", dict(dp=2, tp=2, sequence_parallel=True, recompute="selective")),
    "gpt zero1 dp=4": ("gpt", dict(dp=4, zero=1)),
    "llama zero2 dp=4 selective": ("llama", dict(dp=4, zero=2, recompute="selective")),
    "gpt zero3 dp=4 full": ("gpt", dict(dp=4, zero=3, recompute="full")),
    "llama zero3 dp=4 mixed recomputation": (
        "llama", dict(dp=4, zero=3, recompute={"layers.0": "full", "layers.1": "selective"})),
    "gpt zero3 offload dp=4": ("gpt", dict(dp=4, zero=3, offload=True)),
    "llama zero3 offload dp=4 full": ("llama", dict(dp=4, zero=3, offload=True,
                                                    recompute="full")),
}
PIPELINE_CASES = {  # 4 blocks, 2 stages of 2, 2 micro-batches per dp rank
    "gpt pp=2 dp=2 full": ("gpt", dict(pp=2, dp=2, recompute="full")),
    "llama pp=2 dp=2 zero3 selective": ("llama", dict(pp=2, dp=2, zero=3,
                                                      recompute="selective")),
}
BF16_CASES = {  # every path: ZeRO-3, replicated dp x tp, tp only, pipeline
    "gpt bf16 zero3 dp=4 selective": ("gpt", dict(dp=4, zero=3, recompute="selective")),
    "llama bf16 dp=2 tp=2 full": ("llama", dict(dp=2, tp=2, recompute="full")),
    "gpt bf16 tp=4": ("gpt", dict(tp=4)),
    "llama bf16 pp=2 dp=2": ("llama", dict(pp=2, dp=2)),
}
PROBES = {"q", "wq"}  # a block's first attention projection


def fp32_loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy computed in fp32 from (possibly bf16) logits."""
    return F.cross_entropy(output.float().flatten(0, -2), targets.flatten())


def count_block_forwards(modules: list[torch.nn.Module]) -> tuple[list[int], set[str]]:
    """Install a forward hook on every block's first attention projection; return a
    one-element list counting their calls and the set of their output dtypes."""
    calls, dtypes = [0], set()

    def hook(_m: object, _i: object, out: torch.Tensor) -> None:
        calls[0] += 1
        dtypes.add(str(out.dtype))
    for root in modules:
        for path, m in root.named_modules():
            if path.rpartition(".")[2] in PROBES and ".attn." in path:
                m.register_forward_hook(hook)
    return calls, dtypes


def train(kind: str, kw: dict, *, pipelined: bool = False, precision: str = "fp32") -> dict:
    """Train under a hand-made plan; return the losses, the forward calls of the
    probed projections per (probe x micro-batch) in the second step, the dtypes they
    computed in, and (rank 0, no pipeline) the final parameters."""
    model = pipe_tests.make_model(kind) if pipelined else make_model(kind)
    build = pipeline_plan if pipelined else megatron_plan
    plan = build(model, global_batch=BATCH, precision=precision, **kw)
    pm = apply_plan(model, plan, loss_fn=fp32_loss, example_inputs=(global_batch()[0],))
    stages = list(pm.module) if pipelined else [pm.module]
    calls, dtypes = count_block_forwards(stages)
    probes = sum(1 for s in stages for p, _ in s.named_modules()
                 if p.rpartition(".")[2] in PROBES and ".attn." in p)
    opt = torch.optim.SGD(pm.parameters(), lr=LR)
    x, y = global_batch()
    losses = []
    for step in range(STEPS):
        before = calls[0]
        losses.append(pm.step(x, y).item())
        if step == 1:  # the first step of a pipeline also runs its shape inference
            ratio = (calls[0] - before) / (probes * plan.num_microbatches)
        opt.step()
        opt.zero_grad()
    params = None
    if not pipelined:
        params = {n: full(p) for n, p in pm.module.named_parameters()}
        if torch.distributed.get_rank() != 0:
            params = None
    return {"losses": losses, "ratio": ratio, "params": params, "dtypes": dtypes}


class ReferenceStep:
    """A single-process model with ``step(x, y)`` and ``parameters()``, so
    :func:`tests.test_runtime.train_steps` trains it as it trains a ParallelModel."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        """The model's parameters."""
        return self.model.parameters()

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Forward and backward of the whole batch; the loss."""
        loss = fp32_loss(self.model(x), y)
        loss.backward()
        return loss.detach()


def bf16_reference(kind: str, pipelined: bool) -> list[float]:
    """Losses of the single-process bf16 run: the same model under ``fully_shard``
    with the same MixedPrecisionPolicy on a mesh of this rank alone."""
    model = pipe_tests.make_model(kind) if pipelined else make_model(kind)
    plan = megatron_plan(model, global_batch=BATCH, precision="bf16")
    return train_steps(ReferenceStep(precision_reference(model, plan, single_rank_mesh("cpu"))))


def probe_zero3() -> dict:
    """The memory probe on a ZeRO-3 GPT step over dp=4 (DTensor shards, FSDP2)."""
    model = make_model("gpt")
    pm = apply_plan(model, megatron_plan(model, dp=4, zero=3, global_batch=BATCH))
    opt = torch.optim.SGD(pm.parameters(), lr=LR)
    x, y = global_batch()

    def step() -> None:
        pm.step(x, y)
        opt.step()
        opt.zero_grad()
    mem = measure_step_memory(step, modules=[pm], optimizers=[opt])
    local = sum(p.to_local().numel() * p.element_size() for p in pm.parameters()
                if isinstance(p, DTensor))
    whole = sum(p.numel() * p.element_size() for p in pm.parameters())
    return {"peak": mem.peak_bytes, "breakdown": mem.breakdown, "local": local, "whole": whole}


def rank_main() -> dict:
    """Everything the spawned group runs."""
    out: dict = {"cases": {n: train(*c) for n, c in CASES.items()}}
    out["pipeline"] = {n: train(*c, pipelined=True) for n, c in PIPELINE_CASES.items()}
    out["bf16"] = {n: train(k, kw, pipelined="pp" in kw, precision="bf16")
                   for n, (k, kw) in BF16_CASES.items()}
    out["bf16_ref"] = {(k, "pp" in kw): bf16_reference(k, "pp" in kw)
                       for k, kw in BF16_CASES.values()}
    out["probe"] = probe_zero3()
    return out


@pytest.fixture(scope="module")
def ranks(rank_pool: RankPool) -> list[dict]:
    """Results of every rank of the 4-rank group (run once)."""
    return rank_pool.run(4, rank_main, timeout_s=400)


@functools.lru_cache(maxsize=None)
def fp32_reference(kind: str, pipelined: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The single-process fp32 run (2 blocks, or 4 for the pipeline cases)."""
    return pipe_tests.reference(kind) if pipelined else reference(kind)


def expected_ratio(kw: dict) -> float:
    """Forward calls per block and micro-batch in a step: 2 when every block is
    recomputed, 1 without recomputation."""
    return 1.0 if kw.get("recompute", "none") == "none" else 2.0


def check_runs(results: list[dict], ref: list[float], tol: float, kw: dict,
               dtype: str) -> None:
    """Every rank's losses equal ``ref`` to ``tol``, its blocks were recomputed as
    ``kw`` says and computed in ``dtype``."""
    for rank, res in enumerate(results):
        assert res["losses"] == pytest.approx(ref, abs=tol, rel=0), (rank, res["losses"], ref)
        assert res["ratio"] == expected_ratio(kw), rank
        assert res["dtypes"] == {dtype}, rank


@pytest.mark.parametrize("name", list(CASES))
def test_memory_choices_train_like_single_process(ranks, name: str) -> None:
    kind, kw = CASES[name]
    ref_losses, ref_params = fp32_reference(kind, False)
    check_runs([r["cases"][name] for r in ranks], ref_losses, TOL, kw, "torch.float32")
    params = ranks[0]["cases"][name]["params"]
    assert params.keys() == ref_params.keys()  # recomputation keeps parameter names
    for n, p in params.items():
        assert (p - ref_params[n]).abs().max().item() <= TOL, n


@pytest.mark.parametrize("name", list(PIPELINE_CASES))
def test_recomputation_inside_pipeline_stages(ranks, name: str) -> None:
    kind, kw = PIPELINE_CASES[name]
    check_runs([r["pipeline"][name] for r in ranks], fp32_reference(kind, True)[0], TOL, kw,
               "torch.float32")


@pytest.mark.parametrize("name", list(BF16_CASES))
def test_bf16_matches_bf16_single_process(ranks, name: str) -> None:
    kind, kw = BF16_CASES[name]
    ref = ranks[0]["bf16_ref"][(kind, "pp" in kw)]
    results = [r["bf16"][name] for r in ranks]
    check_runs(results, ref, BF16_TOL, kw, "torch.bfloat16")  # the blocks really ran in bf16
    for res in results:
        assert res["losses"][0] == pytest.approx(ref[0], abs=BF16_FIRST_TOL, rel=0)


def test_memory_probe_counts_zero3_shards(ranks) -> None:
    for res in (r["probe"] for r in ranks):
        assert res["local"] * 4 == res["whole"]
        assert res["breakdown"]["params"] >= res["local"]
        assert res["peak"] >= res["local"] + res["breakdown"]["activations"]


# ---- in-process checks -------------------------------------------------------------


def kept_for_backward(kind: str, mode: str) -> int:
    """Bytes one forward of the tiny model keeps alive with every block under ``mode``."""
    model = make_model(kind)
    for block in model.get_submodule("blocks" if kind == "gpt" else "layers"):
        checkpoint_block(block, mode)
    x, _ = global_batch()
    return retained_bytes(lambda: model(x))[1]


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_selective_keeps_less_than_none_and_more_than_full(kind: str) -> None:
    none, selective, whole = (kept_for_backward(kind, m) for m in ("none", "selective", "full"))
    assert none > selective > whole, (none, selective, whole)


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recomputed_gradients_equal_and_names_stay(mode: str) -> None:
    x, y = global_batch()
    grads = []
    for m in ("none", mode):
        model = make_model("llama")
        names = list(model.state_dict())
        for block in model.layers:
            checkpoint_block(block, m)
        assert list(model.state_dict()) == names
        fp32_loss(model(x), y).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for n, g in grads[0].items():
        assert torch.allclose(g, grads[1][n], atol=1e-6, rtol=0), n
    assert recompute_mode(model.layers[0]) == mode
    assert isinstance(model.layers[0].forward, CheckpointedForward)
    checkpoint_block(model.layers[0], "none")
    assert recompute_mode(model.layers[0]) == "none"


def test_selective_policy_saves_matmuls_and_attention() -> None:
    from torch.utils.checkpoint import CheckpointPolicy
    aten = torch.ops.aten
    for op in (aten.mm.default, aten.addmm.default, aten.bmm.default,
               aten._scaled_dot_product_flash_attention_for_cpu.default):
        assert selective_policy(None, op) == CheckpointPolicy.MUST_SAVE, op
    for op in (aten.gelu.default, aten.native_layer_norm.default, aten.add.Tensor):
        assert selective_policy(None, op) == CheckpointPolicy.PREFER_RECOMPUTE, op


def test_recompute_of_an_unknown_block_is_reported() -> None:
    model = make_model("gpt")
    plan = megatron_plan(model, recompute={"blocks.5": "full"})
    with pytest.raises(LoweringError) as e:
        check_plan(model, plan)
    assert str(e.value) == (
        "plan.recompute names 'blocks.5', which is not one of plan.blocks; recomputation is "
        "chosen per block (e.g. 'blocks.0'), re-plan or list the block in plan.blocks")


def test_memory_probe_measures_a_known_allocation_exactly() -> None:
    def step() -> None:
        a = torch.empty(1 << 20, dtype=torch.uint8)
        b = torch.empty(1000, dtype=torch.float32)
        del a, b
        torch.empty(10, dtype=torch.float64)
    mem = measure_step_memory(step, device="cpu")
    assert mem.peak_bytes == (1 << 20) + 4000
    model = torch.nn.Linear(64, 32)
    mem = measure_step_memory(lambda: model(torch.randn(4, 64)).sum().backward(),
                              modules=[model], device="cpu")
    assert mem.breakdown["params"] == (64 * 32 + 32) * 4
