"""Hugging Face models built from ``transformers`` configs: they capture (on ``meta``),
their repeated blocks are found, they plan, and their parallel training equals a
single-process run. Skipped when ``transformers`` is not installed."""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar.capture import capture
from autopar.demo import reference_step, sgd_losses
from autopar.strategies.analysis import analyze
from tests.dist_utils import run_distributed

transformers = pytest.importorskip("transformers")

BATCH, SEQ, STEPS, LR, VOCAB = 4, 16, 3, 0.1, 128


def gpt2() -> torch.nn.Module:
    """A 3-block GPT-2 without dropout."""
    cfg = transformers.GPT2Config(n_layer=3, n_embd=32, n_head=4, vocab_size=VOCAB,
                                  n_positions=SEQ, resid_pdrop=0.0, embd_pdrop=0.0,
                                  attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def llama() -> torch.nn.Module:
    """A 3-block Llama with grouped-query attention."""
    cfg = transformers.LlamaConfig(num_hidden_layers=3, hidden_size=32, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=64,
                                   vocab_size=VOCAB, max_position_embeddings=SEQ,
                                   bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.LlamaForCausalLM(cfg)


MODELS = {"gpt2": gpt2, "llama": llama}


def make(kind: str) -> torch.nn.Module:
    """The model with the same weights on every call, in eval-free training mode."""
    torch.manual_seed(0)
    return MODELS[kind]()


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return (torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
            torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_captures_on_meta_with_repeated_blocks_and_plans(kind: str) -> None:
    with torch.device("meta"):
        model = MODELS[kind]()
    x = torch.randint(0, VOCAB, (BATCH, SEQ), device="meta")
    g = capture(model, (x,))
    assert len(g.layers) == 3
    n_params = sum(p.numel() for p in model.parameters())  # tied weights once
    assert g.num_params == n_params
    assert g.forward_flops >= 2 * n_params * BATCH * SEQ * 0.9  # ≈ 2·params·tokens + attention
    an = analyze(g)
    assert an.constants, "position ids and the causal mask are computed from shapes"
    plan = autopar.plan(model, (x,), cluster=autopar.Cluster("h100-sxm", 1, 4), tp=2,
                        global_batch=8)
    assert plan.mesh == {"dp": 2, "tp": 2} and plan.step_time_s > 0


def reference(kind: str) -> list[float]:
    model = make(kind)
    x, y = data()
    return sgd_losses(model.parameters(), reference_step(model, x, y), STEPS, LR)


def train(kind: str, space: dict) -> list[float]:
    model = make(kind)
    x, y = data()
    pm = autopar.parallelize(model, (x,), precision="fp32", **space)
    return sgd_losses(pm.parameters(), lambda: pm.step(x, y), STEPS, LR)


def rank_main() -> dict:
    return {(k, tp): train(k, {"tp": tp}) for k in sorted(MODELS) for tp in (1, 2)}


@pytest.mark.multirank
def test_parallel_training_matches_single_process() -> None:
    got = run_distributed(2, rank_main, timeout_s=400)[0]
    for (kind, tp), losses in got.items():
        assert losses == pytest.approx(reference(kind), abs=1e-5), (kind, tp)
