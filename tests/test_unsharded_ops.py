"""Operators DTensor cannot shard still run under tensor parallelism, replicated: a
custom operator with no sharding strategy, and Mixtral's ``aten._grouped_mm`` (whose
DTensor shape function asks for bf16 while the CPU kernel runs fp32). Losses equal one
process's (fp32, gloo, 4 ranks, 3 SGD steps)."""

from __future__ import annotations

import pytest
import torch

from autopar.demo import reference_step, sgd_losses
from tests.dist_utils import RankPool
from tests.test_batch_flow import GatedLM

transformers = pytest.importorskip("transformers")

STEPS, LR = 3, 0.1


def mixtral() -> torch.nn.Module:
    """A 2-block Mixtral with 4 experts, 2 per token."""
    cfg = transformers.MixtralConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, max_position_embeddings=32,
        num_local_experts=4, num_experts_per_tok=2, bos_token_id=0, eos_token_id=0)
    return transformers.MixtralForCausalLM(cfg)


MODELS = {"gated": GatedLM, "mixtral": mixtral}


def make(kind: str) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """The model (same weights each call) and one batch."""
    torch.manual_seed(0)
    model = MODELS[kind]()
    g = torch.Generator().manual_seed(1)
    return (model, torch.randint(0, 128, (8, 16), generator=g),
            torch.randint(0, 128, (8, 16), generator=g))


def train(kinds: list[str]) -> list[list[float]]:
    """Each model trained under dp2 x tp2 on this group's ranks."""
    import autopar

    out = []
    for kind in kinds:
        model, x, y = make(kind)
        pm = autopar.parallelize(model, (x,), precision="fp32", dp=2, tp=2)
        out.append(sgd_losses(pm.parameters(), lambda: pm.step(x, y), STEPS, LR))
    return out


@pytest.mark.multirank
def test_ops_dtensor_cannot_shard_run_replicated(rank_pool: RankPool) -> None:
    kinds = sorted(MODELS)
    got = rank_pool.run(4, train, kinds, timeout_s=600)[0]
    for kind, losses in zip(kinds, got):
        model, x, y = make(kind)
        ref = sgd_losses(model.parameters(), reference_step(model, x, y), STEPS, LR)
        assert losses == pytest.approx(ref, abs=1e-5), kind
