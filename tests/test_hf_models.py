"""Hugging Face models built from ``transformers`` configs: they capture (on ``meta``),
their repeated blocks are found, they plan, and their parallel training equals a
single-process run; T5 (its relative-position bias broadcast along the batch) under
auto, dp2 x tp2 and pp2 x dp2. Skipped when ``transformers`` is not installed."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

import autopar
from autopar.capture import capture, default_loss
from autopar.demo import reference_step, sgd_losses
from autopar.strategies.analysis import analyze
from tests.dist_utils import RankPool

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


class _Logits(torch.nn.Module):
    """A user's wrapper returning the logits: the HF config is below the root."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.inner(idx).logits


def test_a_wrapped_model_captures_without_its_kv_cache() -> None:
    """The KV cache is off for the capture wherever the config sits (its updates made
    constants that stopped the two-block fast path: 9.4 s instead of 3.1 s for a
    wrapped 8B Llama), and on again after it."""
    with torch.device("meta"):
        model = llama()
    x = torch.randint(0, VOCAB, (BATCH, SEQ), device="meta")
    g = capture(_Logits(model), (x,))
    assert len(g.layers) == 3
    exported = {str(s.target).split(".layers.")[1].split(".")[0]
                for s in g.fx.graph_signature.input_specs
                if s.kind.name == "PARAMETER" and ".layers." in str(s.target)}
    assert exported == {"0", "1"}  # the fast path: two blocks exported, one replicated
    assert model.config.use_cache is True


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
def test_parallel_training_matches_single_process(rank_pool: RankPool) -> None:
    got = rank_pool.run(2, rank_main, timeout_s=400)[0]
    for (kind, tp), losses in got.items():
        assert losses == pytest.approx(reference(kind), abs=1e-5), (kind, tp)


CASES_4 = [  # (model, forced space) on 4 ranks
    ("gpt2", {"dp": 1, "tp": 4}),
    ("gpt2", {"dp": 2, "tp": 2, "sequence_parallel": True, "zero": 3}),
    ("llama", {"dp": 2, "tp": 2, "sequence_parallel": True, "zero": 3,
               "recompute": "selective"}),
]
CONV1D_SPLITS = {"c_fc.weight": "S(1)", "c_fc.bias": "S(0)", "c_proj.weight": "S(0)"}


def split_mlp_conv1d(plan: "autopar.Plan") -> "autopar.Plan":
    """``plan`` with every block's MLP Conv1D weights split Megatron's way on tp (the
    tiny model's CPU plan keeps them replicated)."""
    for name, placements in plan.params.items():
        local = name.rpartition(".mlp.")[2]
        if ".mlp." in name and local in CONV1D_SPLITS:
            placements[-1] = CONV1D_SPLITS[local]
            path, _, own = name.rpartition(".")
            plan.modules[path].params[own][-1] = CONV1D_SPLITS[local]
    return plan


def train_four(cases: list[tuple[str, dict]]) -> list[tuple[list[float], dict]]:
    """Each case trained (the first with its MLP's Conv1D weights split); with the
    local shapes of those weights."""
    out = []
    for i, (kind, space) in enumerate(cases):
        model = make(kind)
        x, y = data()
        plan = autopar.plan(model, (x,), precision="fp32", **space)
        pm = autopar.parallelize(model, plan=split_mlp_conv1d(plan) if i == 0 else plan)
        losses = sgd_losses(pm.parameters(), lambda: pm.step(x, y), STEPS, LR)
        local = {n: tuple(p.to_local().shape) for n, p in pm.module.named_parameters()
                 if ".0.mlp." in n and hasattr(p, "to_local")}
        out.append((losses, {"local": local, "sp": pm.plan.sequence_parallel}))
    return out


@pytest.mark.multirank
def test_conv1d_and_hf_llama_under_tensor_and_sequence_parallelism(rank_pool: RankPool) -> None:
    """HF GPT-2 trains with its Conv1D weights split (column then row parallel), and
    HF Llama sequence-parallel with ZeRO-3 and selective recomputation (its KV cache
    turned off for training)."""
    got = rank_pool.run(4, train_four, CASES_4, timeout_s=600)[0]
    for (kind, space), (losses, info) in zip(CASES_4, got):
        assert losses == pytest.approx(reference(kind), abs=1e-5), (kind, space, info)
        assert info["sp"] == bool(space.get("sequence_parallel")), (kind, space, info)
    local = got[0][1]["local"]
    assert local["transformer.h.0.mlp.c_fc.weight"] == (32, 32)  # (in, out): 128 / 4 outputs
    assert local["transformer.h.0.mlp.c_proj.weight"] == (32, 32)  # 128 / 4 inputs


def test_gpt2_7b_conv1d_is_split_at_megatrons_layout() -> None:
    """The 7.5B GPT of Megatron's Table 1 written as HF GPT-2 (Conv1D) fits at its
    tp4 x dp32 on 128 A100s: its weights are split over tp as nn.Linear's would be."""
    cfg = transformers.GPT2Config(n_embd=4096, n_layer=36, n_head=32, vocab_size=51200,
                                  n_positions=2048)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(cfg)
    x = torch.zeros(1, 2048, dtype=torch.long, device="meta")
    plan = autopar.estimate(model, (x,), autopar.Spec(dp=32, tp=4, microbatch_size=16,
                                                      recompute="full"),
                            cluster=autopar.Cluster(gpu="a100-80g", nodes=16),
                            global_batch=512, precision="fp16", optimizer="adam")
    assert plan.memory_per_device_bytes < 80e9
    assert plan.params["transformer.h.0.mlp.c_fc.weight"][-1] == "S(1)"
    assert plan.params["transformer.h.0.mlp.c_proj.weight"][-1] == "S(0)"


def t5() -> torch.nn.Module:
    """A T5 of 2 encoder and 2 decoder blocks without dropout, returning the logits for
    (source tokens, decoder input tokens); the same weights on every call."""
    cfg = transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                num_decoder_layers=2, num_heads=4,
                                relative_attention_num_buckets=8,
                                relative_attention_max_distance=SEQ, dropout_rate=0.0,
                                decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
                                use_cache=False)
    torch.manual_seed(0)
    return _Keywords(transformers.T5ForConditionalGeneration(cfg),
                     ("input_ids", "decoder_input_ids"))


class _Keywords(torch.nn.Module):
    """A user's wrapper passing its inputs to a Hugging Face model by keyword (``names``,
    in order): an encoder-decoder's source and teacher-forced decoder ids, LLaVA's ids
    and images; returns the logits."""

    def __init__(self, inner: torch.nn.Module, names: tuple[str, ...]) -> None:
        super().__init__()
        self.inner, self.names = inner, names

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.inner(**dict(zip(self.names, inputs))).logits


def seq2seq_data() -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """(source, decoder input: the targets shifted right after a start token), targets."""
    x, y = data()
    return (x, torch.cat([torch.zeros_like(y[:, :1]), y[:, :-1]], dim=1)), y


def grads_by_name(modules: list[torch.nn.Module],
                  names: tuple[dict[str, str], frozenset[str]]) -> dict[str, torch.Tensor]:
    """The full gradient of each parameter ``modules`` hold, under the plain model's
    name (a ParallelModel's ``state_modules()[0]`` and ``names``; a tied weight under
    its first name): a collective over the ranks that share a parameter."""
    from autopar.runtime.checkpoint_state import canonical_tensors

    out = {}
    for name, held in sorted(canonical_tensors(modules, *names).items()):
        grad = held[0].grad
        if grad is not None:
            out[name] = (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).clone()
    return out


T5_SPACES = {"auto": {}, "dp2tp2": {"dp": 2, "tp": 2}, "pp2dp2": {"pp": 2, "dp": 2}}


def sgd_first_grads(params: Any, step: Callable[[], torch.Tensor],
                    grads: Callable[[], dict[str, torch.Tensor]]
                    ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The losses of :data:`STEPS` SGD steps (``step()`` runs one forward and backward
    and returns the loss) and ``grads()`` after the first backward."""
    opt = torch.optim.SGD(params, lr=LR)
    losses, first = [], {}
    for i in range(STEPS):
        losses.append(float(step()))
        if i == 0:
            first = grads()
        opt.step()
        opt.zero_grad()
    return losses, first


def train_t5() -> dict[str, tuple[list[float], dict[str, torch.Tensor], dict[str, int]]]:
    """On each of 4 ranks, T5 under each of :data:`T5_SPACES`: the losses of 3 SGD steps,
    the first step's gradients this rank holds, and the mesh."""
    xs, y = seq2seq_data()
    out = {}
    for key, space in T5_SPACES.items():
        pm = autopar.parallelize(t5(), xs, precision="fp32", **space)
        losses, grads = sgd_first_grads(pm.parameters(), lambda: pm.step(xs, y),
                                        lambda: grads_by_name(pm.state_modules()[0], pm.names))
        out[key] = (losses, grads, pm.plan.mesh)
    return out


def _t5_step(model: torch.nn.Module, xs: tuple[torch.Tensor, ...],
             y: torch.Tensor) -> torch.Tensor:
    """One single-process forward and backward of T5 with the default loss."""
    loss = default_loss(model(*xs), y)
    loss.backward()
    return loss.detach()


@pytest.mark.multirank
@pytest.mark.slow
def test_t5_trains_under_auto_tensor_and_pipeline_parallelism(rank_pool: RankPool) -> None:
    """T5's relative-position bias, broadcast along the batch, stays replicated while the
    masks it makes follow the batch: auto, dp2 x tp2 and pp2 x dp2 (a stage hands the
    decoder's bias, a permuted view, on contiguous) train as one process does: the
    losses of 3 SGD steps and the first step's gradients to 1e-5."""
    xs, y = seq2seq_data()
    model = t5()
    want, want_grads = sgd_first_grads(
        model.parameters(), lambda: _t5_step(model, xs, y),
        lambda: {n: p.grad.clone() for n, p in model.named_parameters()})
    got = rank_pool.run(4, train_t5, timeout_s=600)
    for key in T5_SPACES:
        losses, _, mesh = got[0][key]
        assert losses == pytest.approx(want, abs=1e-5), (key, mesh)
        grads = {n: g for rank in got for n, g in rank[key][1].items()}
        assert set(grads) == set(want_grads), key
        for name, g in grads.items():
            assert torch.allclose(g, want_grads[name], atol=1e-5, rtol=0), (key, name)
    assert got[0]["dp2tp2"][2] == {"dp": 2, "tp": 2}
    assert got[0]["pp2dp2"][2] == {"pp": 2, "dp": 2, "tp": 1}


def tiny_llava(vision_layers: int) -> torch.nn.Module:
    """A LLaVA (CLIP vision tower, Llama text model) returning the logits for (token ids
    holding 4 image tokens, 8 x 8 images)."""
    cfg = transformers.LlavaConfig(
        vision_config=dict(model_type="clip_vision_model", image_size=8, patch_size=4,
                           hidden_size=32, intermediate_size=64, num_attention_heads=4,
                           num_hidden_layers=vision_layers),
        text_config=dict(model_type="llama", vocab_size=VOCAB, hidden_size=32,
                         intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=SEQ),
        image_token_index=VOCAB - 1)
    torch.manual_seed(0)
    return transformers.LlavaForConditionalGeneration(cfg)


def test_a_cut_capture_leaves_no_partial_hooks_behind() -> None:
    """LLaVA's vision tower records its hidden states with hooks transformers installs on
    the first forward. The fast capture's first forward ran with the block list cut to
    two, so those hooks covered only the kept blocks, and the full export that followed
    found none on the others and failed. What the cut forward installs is now undone:
    the model captures (8 blocks: 6 vision, 2 text) with every vision block hooked alike,
    and still runs."""
    model = _Keywords(tiny_llava(6), ("input_ids", "pixel_values"))
    ids = data()[0] % (VOCAB - 1)  # text tokens, then the image's 4 placeholders first
    ids[:, :4] = VOCAB - 1
    pixels = torch.randn(BATCH, 3, 8, 8)
    g = capture(model, (ids, pixels))
    assert len(g.layers) == 8
    hooked = {len(layer._forward_hooks) for layer in model.inner.model.vision_tower.encoder.layers}
    assert len(hooked) == 1, hooked
    assert first_logits(model, ids, pixels).shape == (BATCH, SEQ, VOCAB)


def first_logits(model: torch.nn.Module, *inputs: torch.Tensor) -> torch.Tensor:
    """The model's output on ``inputs`` without gradients."""
    with torch.no_grad():
        return model(*inputs)
