"""Materializing a meta model on CPU ranks (:mod:`autopar.runtime.materialize`): each
rank's shards are slices of the weights one process draws, not copies of each other,
with no DTensor random-number warning; a model with its own initialization is warned
that a meta start replaces it."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from autopar.examples.gpt import GPT, GPTConfig
from autopar.runtime import apply_plan
from autopar.runtime.materialize import (check_materializable, custom_initialization,
                                         materialize)
from tests.dist_utils import RankPool
from tests.handmade_plans import megatron_plan

CONFIG = GPTConfig(vocab_size=128, max_seq_len=16, dim=32, n_layers=2, n_heads=4)


def one_process_weights() -> dict[str, torch.Tensor]:
    """A meta GPT materialized in one process under seed 0."""
    with torch.device("meta"):
        model = GPT(CONFIG)
    torch.manual_seed(0)
    materialize(model, torch.device("cpu"))
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def sharded_weights() -> dict:
    """A meta GPT laid out as dp=2 x tp=2 with ZeRO-3 and materialized under seed 0:
    its full weights, whether any fc1 shard repeats another, and the warnings seen."""
    with torch.device("meta"):
        model = GPT(CONFIG)
    plan = megatron_plan(model, dp=2, tp=2, zero=3, global_batch=8)
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        pm = apply_plan(model, plan)
    full = {n: p.full_tensor().detach() if isinstance(p, DTensor) else p.detach()
            for n, p in pm.module.named_parameters()}
    w = full["blocks.0.mlp.fc1.weight"]
    quarter = w.shape[0] // 4
    repeats = any(torch.equal(w[:quarter], w[k * quarter:(k + 1) * quarter])
                  for k in range(1, 4))
    return {"full": full, "repeats": repeats, "warnings": [str(m.message) for m in seen]}


@pytest.mark.multirank
def test_cpu_shards_are_slices_of_one_process_weights(rank_pool: RankPool) -> None:
    results = rank_pool.run(4, sharded_weights)
    reference = one_process_weights()
    for res in results:
        assert not res["repeats"]
        assert not [m for m in res["warnings"] if "DTensor random operators" in m]
        assert res["full"].keys() == reference.keys()
        for name, value in reference.items():
            assert torch.equal(res["full"][name], value), name


class _OwnInit(nn.Module):
    """A model that initializes its Linear itself, as nanoGPT does."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return self.fc(x)


def test_a_model_with_its_own_initialization_is_warned_on_meta() -> None:
    with torch.device("meta"):
        model = _OwnInit()
    assert custom_initialization(model) == "'the root module' (_OwnInit) defines _init_weights()"
    with pytest.warns(UserWarning, match=r"defines _init_weights\(\), which does not run\); "
                                         r"build the model on the CPU before apply_plan"):
        check_materializable(model)
    with torch.device("meta"):
        plain = GPT(CONFIG)
    assert custom_initialization(plain) is None


def pipelined_embeddings() -> dict[str, float]:
    """On each rank of pp2: the std of the embedding and head weights of its stage,
    a meta GPT materialized stage by stage."""
    from tests.handmade_plans import pipeline_plan

    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=128, max_seq_len=16, dim=32, n_layers=2, n_heads=4))
    pm = apply_plan(model, pipeline_plan(model, pp=2),
                    example_inputs=torch.zeros(1, 16, dtype=torch.long))
    modules, _ = pm.state_modules()
    return {n: float(p.detach().std()) for m in modules for n, p in m.named_parameters()
            if n.endswith(("emb.weight", "head.weight"))}


@pytest.mark.multirank
def test_each_pipeline_stage_keeps_the_models_own_initialization(rank_pool: RankPool) -> None:
    """GPT.reset_parameters() draws its embeddings with std 0.02 over nn.Embedding's
    N(0, 1); a stage materialized apart from the model runs it too (the tied head on
    the last stage is a copy of the embedding)."""
    stds = {n: s for r in rank_pool.run(2, pipelined_embeddings) for n, s in r.items()}
    assert set(stds) == {"tok_emb.weight", "pos_emb.weight", "head.weight"}
    for name, std in stds.items():
        assert 0.015 < std < 0.025, (name, std)
