"""Local tensors inside tensor-parallel regions (:mod:`autopar.runtime.local_tensors`):
attention and feed-forward modules run on local tensors where their code allows it, keep
DTensors where it does not (a view by the global head count, a reduction over the split
features), and train to the single-process losses and parameters either way."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from autopar.examples.gpt import GPT, GPTConfig
from autopar.runtime import apply_plan
from autopar.runtime.local_tensors import LocalRegion
from tests.dist_utils import RankPool
from tests.handmade_plans import megatron_plan
from tests.test_runtime import BATCH, TOL, full, make_model, single_process_run, train_steps

pytestmark = pytest.mark.multirank

N_HEADS = 4


def _global_heads(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """GPT attention viewing its projections by the global head count."""
    b, t, _ = x.shape
    q = self.q(x).view(b, t, N_HEADS, self.head_dim).transpose(1, 2)
    k = self.k(x).view(b, t, N_HEADS, self.head_dim).transpose(1, 2)
    v = self.v(x).view(b, t, N_HEADS, self.head_dim).transpose(1, 2)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return self.proj(y.transpose(1, 2).reshape(b, t, -1))


def _centred(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """GPT MLP centring its hidden features (a mean over the features tp splits)."""
    h = self.fc1(x)
    return self.fc2(F.gelu(h - h.mean(-1, keepdim=True)))


def odd_gpt() -> GPT:
    """The tiny GPT with block 0's attention and MLP rewritten as above."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=128, max_seq_len=16, dim=32, n_layers=2,
                          n_heads=N_HEADS))
    model.blocks[0].attn.forward = types.MethodType(_global_heads, model.blocks[0].attn)
    model.blocks[0].mlp.forward = types.MethodType(_centred, model.blocks[0].mlp)
    return model


def _train(build: str, kwargs: dict) -> dict:
    """Train under the Megatron layout; the losses, rank 0's parameters and which
    regions ran on local tensors."""
    model = odd_gpt() if build == "odd" else make_model(build)
    pm = apply_plan(model, megatron_plan(model, global_batch=BATCH, **kwargs))
    losses = train_steps(pm)
    local = {path: m.forward.local for path, m in pm.module.named_modules()
             if isinstance(m.__dict__.get("forward"), LocalRegion)}
    params = {n: full(p) for n, p in pm.module.named_parameters()}
    return {"losses": losses, "local": local,
            "params": params if torch.distributed.get_rank() == 0 else None}


def _cases() -> dict:
    return {name: _train(build, kw) for name, (build, kw) in CASES.items()}


CASES = {
    "gpt sp": ("gpt", dict(tp=2, sequence_parallel=True)),
    "llama sp": ("llama", dict(tp=2, sequence_parallel=True)),
    "gpt dp2 tp1": ("gpt", dict(dp=2)),
    "odd gpt sp": ("odd", dict(tp=2, sequence_parallel=True)),
}


@pytest.fixture(scope="module")
def results(rank_pool: RankPool) -> list[dict]:
    """Every case on the 2-rank group, once."""
    return rank_pool.run(2, _cases, timeout_s=300)


@pytest.mark.parametrize("name", list(CASES))
def test_regions_match_single_process(results: list[dict], name: str) -> None:
    """Losses on every rank and final parameters equal the single-process run."""
    build = CASES[name][0]
    ref_losses, ref_params = single_process_run(odd_gpt() if build == "odd"
                                                else make_model(build))
    for res in results:
        assert res[name]["losses"] == pytest.approx(ref_losses, abs=TOL, rel=0)
    params = results[0][name]["params"]
    assert params.keys() == ref_params.keys()
    for n, p in params.items():
        assert (p - ref_params[n]).abs().max().item() <= TOL, n


def test_attention_and_ffn_run_on_local_tensors(results: list[dict]) -> None:
    """Under the Megatron layout every attention and feed-forward module is a region
    and runs locally; without tensor parallelism there is none."""
    for res in results:
        assert res["gpt sp"]["local"] == {f"blocks.{i}.{m}": True for i in (0, 1)
                                          for m in ("attn", "mlp")}
        assert res["llama sp"]["local"] == {f"layers.{i}.{m}": True for i in (0, 1)
                                            for m in ("attn", "ffn")}
        assert res["gpt dp2 tp1"]["local"] == {}


def test_code_that_needs_global_shapes_keeps_dtensors(results: list[dict]) -> None:
    """A view by the global head count fails on local tensors and a mean over the
    split features differs there: those regions keep DTensors, the others do not."""
    for res in results:
        assert res["odd gpt sp"]["local"] == {"blocks.0.attn": False, "blocks.0.mlp": False,
                                              "blocks.1.attn": True, "blocks.1.mlp": True}
