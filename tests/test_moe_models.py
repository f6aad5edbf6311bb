"""Mixture-of-experts models (examples/moe.py: top-k routing to capacity-limited
experts with stacked weights, shared experts, dense first blocks) capture, plan and
train as in one process under data, tensor and pipeline parallelism and ZeRO-3 (fp32,
4 gloo ranks, 3 SGD steps); the full-size Mixtral plans on a 64-GPU cluster."""

from __future__ import annotations

import pytest
import torch

from autopar.demo import sgd_losses
from autopar.examples.moe import MoEConfig, MoETransformer
from tests.dist_utils import RankPool

STEPS, LR = 3, 0.1
CONFIG = MoEConfig(vocab_size=64, max_seq_len=16, dim=32, n_layers=3, n_heads=4,
                   n_kv_heads=2, ffn_dim=64, n_experts=4, top_k=2, expert_ffn_dim=32,
                   n_shared_experts=1, n_dense_layers=1, capacity_factor=1.0)
CASES = [{"dp": 2, "tp": 2}, {"dp": 1, "tp": 4, "sequence_parallel": True},
         {"dp": 4, "zero": 3, "recompute": "full"}, {"pp": 2, "dp": 2}]


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and next-token targets, 8 sequences of 16."""
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, CONFIG.vocab_size, (8, 16), generator=g)
    return x, torch.randint(0, CONFIG.vocab_size, (8, 16), generator=g)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy."""
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def test_capacity_drops_tokens_past_an_experts_buffer():
    """With capacity factor 0.25 some tokens find their experts full: their routed output
    is zero, and only the shared expert's remains."""
    torch.manual_seed(0)
    cfg = MoEConfig(dim=16, n_heads=2, n_kv_heads=1, n_experts=4, top_k=1, expert_ffn_dim=8,
                    n_shared_experts=0, capacity_factor=0.25)
    from autopar.examples.moe import MoE
    moe = MoE(cfg)
    x = torch.randn(1, 16, 16)
    out = moe(x)
    chosen = moe.router(x).softmax(-1).argmax(-1)[0]
    seen: dict[int, int] = {}
    for t in range(16):
        e = int(chosen[t])
        seen[e] = seen.get(e, 0) + 1
        dropped = seen[e] > 1  # capacity ceil(0.25 * 1 * 16 / 4) = 1
        assert bool((out[0, t] == 0).all()) == dropped


def single_process() -> list[float]:
    torch.manual_seed(0)
    model = MoETransformer(CONFIG)
    x, y = batch()

    def step() -> torch.Tensor:
        loss = lm_loss(model(x), y)
        loss.backward()
        return loss.detach()

    return sgd_losses(model.parameters(), step, STEPS, LR)


def parallel(cases: list[dict]) -> list[tuple[list[float], dict]]:
    import autopar

    out = []
    x, y = batch()
    for space in cases:
        torch.manual_seed(0)
        model = MoETransformer(CONFIG)
        pm = autopar.parallelize(model, (x,), example_targets=y, loss_fn=lm_loss,
                                 precision="fp32", **space)
        losses = sgd_losses(pm.parameters(), lambda: pm.step(x, y), STEPS, LR)
        out.append((losses, dict(pm.plan.mesh)))
    return out


@pytest.mark.multirank
def test_moe_trains_as_in_one_process(rank_pool: RankPool) -> None:
    ref = single_process()
    results = rank_pool.run(4, parallel, CASES, timeout_s=900)[0]
    for space, (losses, mesh) in zip(CASES, results):
        assert losses == pytest.approx(ref, abs=1e-5), (space, mesh)
        for axis in ("dp", "tp", "pp"):
            if axis in space:
                assert mesh.get(axis, 1) == space[axis], (space, mesh)


def test_full_size_mixtral_plans():
    """Mixtral 8x7B at its 4096 tokens on 64 H100 (13 s here; DeepSeek-V3, which fits
    64 H100 only with offload, takes 80 s and is left to the benchmarks)."""
    import autopar
    from autopar.examples import zoo

    model, x = zoo.get("mixtral-8x7b", batch_size=1, seq_len=4096)
    plan = autopar.plan(model, x, cluster=autopar.Cluster("h100-sxm", 8, 8), global_batch=64)
    assert 0 < plan.step_time_s < float("inf")
    assert plan.memory_per_device_bytes <= plan.solver["memory_budget_bytes"] * (1 + 1e-9)
