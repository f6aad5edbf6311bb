"""Hugging Face's mixtures of experts (``transformers`` 5.x Mixtral, Qwen2-MoE and
GPT-OSS, whose experts carry biases, built from configs: dropless routing, experts
stacked in one module fed tokens, indices and weights) train under expert parallelism
as in one process: every routed expert module is found, each rank keeps its share of
the experts, and the losses equal a single-process run (fp32, gloo, 4 ranks, 3 SGD
steps)."""

from __future__ import annotations

import pytest
import torch

from autopar.demo import reference_step, sgd_losses
from tests.dist_utils import RankPool
from tests.test_batch_flow import hf
from tests.test_moe_models import experts_held

pytest.importorskip("transformers")

STEPS, LR, EXPERTS = 3, 0.1, 4
CASES = [("mixtral", {"dp": 4, "ep": 4}), ("mixtral", {"dp": 2, "ep": 2, "tp": 2}),
         ("qwen2moe", {"dp": 4, "ep": 2, "zero": 3}), ("qwen2moe", {"pp": 2, "dp": 2, "ep": 2}),
         ("gpt_oss", {"dp": 4, "ep": 2})]


def deepseek_v3() -> torch.nn.Module:
    """A tiny Hugging Face DeepSeek-V3: multi-head latent attention (its down projections'
    norms inside the attention), one dense block, then routed experts with a shared
    one, group-limited top-2 of 4."""
    import transformers as t

    return t.DeepseekV3ForCausalLM(t.DeepseekV3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
        max_position_embeddings=32, q_lora_rank=16, kv_lora_rank=8, qk_rope_head_dim=4,
        qk_nope_head_dim=8, v_head_dim=8, n_group=2, topk_group=1))


def gpt_oss() -> torch.nn.Module:
    """A tiny Hugging Face GPT-OSS: attention sinks, sliding windows on alternate
    layers, and routed experts with per-expert biases, top-2 of 4."""
    import transformers as t

    return t.GptOssForCausalLM(t.GptOssConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=32, sliding_window=8))


BUILDERS = {"deepseek_v3": deepseek_v3, "gpt_oss": gpt_oss}


def make(kind: str) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """The model (same weights each call) and one batch of 8 sequences of 16."""
    torch.manual_seed(0)
    model = BUILDERS[kind]() if kind in BUILDERS else hf(kind)
    g = torch.Generator().manual_seed(1)
    return (model, torch.randint(0, 64, (8, 16), generator=g),
            torch.randint(0, 64, (8, 16), generator=g))


def train(cases: list[tuple[str, dict]]) -> list[tuple[list[float], dict, int, list[int]]]:
    """Each case trained on this group's ranks: losses, mesh, expert modules split and
    the experts each rank holds of each."""
    import autopar

    out = []
    for kind, space in cases:
        model, x, y = make(kind)
        pm = autopar.parallelize(model, (x,), precision="fp32", **space)
        held = experts_held(pm, "gate_up_proj")
        out.append((sgd_losses(pm.parameters(), lambda: pm.step(x, y), STEPS, LR),
                    dict(pm.plan.mesh), len(pm.plan.experts), held))
    return out


@pytest.mark.multirank
def test_hf_experts_train_as_in_one_process(rank_pool: RankPool) -> None:
    got = rank_pool.run(4, train, CASES, timeout_s=900)[0]
    for (kind, space), (losses, mesh, split, held) in zip(CASES, got):
        model, x, y = make(kind)
        ref = sgd_losses(model.parameters(), reference_step(model, x, y), STEPS, LR)
        assert losses == pytest.approx(ref, abs=1e-5), (kind, space)
        assert mesh["ep"] == space["ep"] and mesh["dp"] * space["ep"] == space["dp"]
        assert split == model.config.num_hidden_layers, (kind, space)  # every MoE block
        assert held == [EXPERTS // space["ep"]], (kind, space, held)


def test_emitted_program_for_routed_experts_is_clean(tmp_path) -> None:
    """The program for an expert-parallel plan of Hugging Face's Mixtral carries the
    routed exchange (its uneven all-to-all included) and the experts' weights as
    DTensors split over ep (so --save and --load keep every expert), and passes
    pyflakes."""
    import autopar
    from autopar.runtime.codegen import emit_program
    from tests.test_codegen import pyflakes

    factory = tmp_path / "models.py"
    factory.write_text("from tests.test_batch_flow import hf\n\n\ndef mixtral():\n"
                       "    return hf('mixtral')\n")
    model, x, y = make("mixtral")
    plan = autopar.plan(model, (x,), example_targets=y, cluster=autopar.Cluster("cpu", 1, 4),
                        precision="fp32", dp=4, ep=2)
    assert {xp.kind for xp in plan.experts.values()} == {"routed"}
    program = tmp_path / "train.py"
    program.write_text(emit_program(plan, f"{factory}:mixtral"))
    text = program.read_text()
    assert "def route_tokens(" in text and "all_to_all_single_autograd" in text
    assert "shard_experts(model, build_expert_mesh(device_type), mesh[\"tp\"])" in text
    assert pyflakes(program) == ""


def test_load_imbalance_is_priced_on_routed_experts_only_under_ep() -> None:
    """``expert_imbalance`` makes the busiest ep rank's expert GEMMs and all-to-alls
    longer; without expert parallelism it changes nothing; below 1 it is refused."""
    import autopar
    from autopar.errors import ConfigError

    model, x, y = make("mixtral")
    kw = dict(cluster=autopar.Cluster("h100-sxm", 1, 4), example_targets=y)

    def scored(spec: autopar.Spec, imbalance: float) -> dict:
        return autopar.estimate(model, (x,), spec, expert_imbalance=imbalance, **kw).breakdown

    even, skewed = scored(autopar.Spec(dp=4, ep=4), 1.0), scored(autopar.Spec(dp=4, ep=4), 2.0)
    assert skewed["compute_s"] > even["compute_s"]
    assert skewed["all_to_all_s"] > even["all_to_all_s"]
    assert scored(autopar.Spec(dp=4), 2.0) == scored(autopar.Spec(dp=4), 1.0)
    with pytest.raises(ConfigError, match=r"expert_imbalance=0\.5: expected a number of at "
                                          r"least 1"):
        autopar.plan(model, (x,), expert_imbalance=0.5, **kw)


def test_grouped_expert_products_are_matrix_work() -> None:
    """A standalone sparse block (it views its input, here a batch of one) captures, and
    transformers' grouped products, the experts' GEMMs, count 2·rows·K·N FLOPs each."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    from autopar.capture import capture
    from autopar.cost_models.compute import is_matmul

    cfg = MixtralConfig(hidden_size=32, intermediate_size=48, num_local_experts=4,
                        num_experts_per_tok=2)
    cfg._experts_implementation = "grouped_mm"
    g = capture(MixtralSparseMoeBlock(cfg), (torch.randn(1, 16, 32),))
    grouped = [n for n in g.nodes if n.kind == "op" and "grouped_mm" in n.target]
    rows = g.batch_size * 16 * 2
    assert sorted(n.flops for n in grouped) == [2 * rows * 48 * 32, 2 * rows * 32 * 96]
    assert all(is_matmul(n.target) for n in grouped)


SEQUENCE_CASES = [("qwen2moe", {"dp": 2, "tp": 2}), ("mixtral", {"dp": 2, "ep": 2, "tp": 2}),
                  ("deepseek_v3", {"dp": 2, "tp": 2})]


def train_plain(cases: list[tuple[str, dict]]) -> list[tuple[list[float], dict, int]]:
    """Each case trained on this group's ranks: losses, mesh and expert modules split."""
    import autopar

    out = []
    for kind, space in cases:
        model, x, y = make(kind)
        pm = autopar.parallelize(model, (x,), precision="fp32", **space)
        out.append((sgd_losses(pm.parameters(), lambda: pm.step(x, y), STEPS, LR),
                    dict(pm.plan.mesh), len(pm.plan.experts)))
    return out


@pytest.mark.multirank
def test_sequence_parallel_blocks_of_one_sequence_train_as_in_one_process(
        rank_pool: RankPool) -> None:
    """Under sequence parallelism with micro-batches of one sequence, a mixture-of-experts
    block that flattens batch and sequence into tokens (and owns no parameter itself)
    hands its output back split along the sequence, re-laid out after its last reshape
    (or the shared expert's sum after it), where no op could before (no plan was found);
    DeepSeek-V3's norms inside its attention are free of the forced split: 4
    micro-batches of one sequence, the losses of one process."""
    spaces = [(kind, {**space, "sequence_parallel": True, "microbatch_size": 1})
              for kind, space in SEQUENCE_CASES]
    got = rank_pool.run(4, train_plain, spaces, timeout_s=900)[0]
    for (kind, space), (losses, mesh, split) in zip(spaces, got):
        model, x, y = make(kind)
        ref = sgd_losses(model.parameters(), reference_step(model, x, y), STEPS, LR)
        assert losses == pytest.approx(ref, abs=1e-5), (kind, space)
        assert mesh["tp"] == 2 and split == (model.config.num_hidden_layers if "ep" in space
                                             else 0), (kind, space)
