"""Which Hugging Face model families autopar plans and runs: a pass/fail table.

For each family of :data:`FAMILIES` (a tiny configuration built from ``transformers``:
2 layers, hidden 64, 4 heads, vocabulary 128, no dropout, fp32) four cells are run:

- ``auto``: ``autopar.parallelize(model, inputs, precision="fp32")`` on 4 gloo ranks,
  the plan autopar chooses for the 4-process CPU cluster it detects;
- ``dp2tp2``: the same with ``dp=2, tp=2``;
- ``pp2dp2``: the same with ``pp=2, dp=2``;
- ``meta``: ``autopar.plan`` of the family's full-size configuration (about 7B where the
  family has one, else its largest published size or the config's default), built on the
  ``meta`` device, for 64 H100 (8 nodes of 8) and a global batch of 128 samples of
  2,048 tokens (the family's longest where that is less).

Families are of six tasks (:data:`TASKS`), each with the inputs its model takes and the
targets its loss compares with: causal and masked language models (token ids), encoder-
decoders (source ids and the decoder's teacher-forced ids), speech encoder-decoders
(log-mel features and decoder ids), image classifiers (pixels, a class per image) and
vision-language models (pixels and token ids holding the image's placeholder tokens).
Models whose forward takes these as keywords are wrapped in :class:`KeywordLogits`, the
few lines a user writes to pass them positionally.

A run cell passes when the losses of 3 SGD steps (lr 0.1, batch 8, sequence 16) equal a
single-process run of the same model and data within 1e-5; it fails with the exception's
type and first line, or with the largest loss difference. A meta cell passes when a plan
comes back; it records the planning time, mesh and predicted step time.

Every cell runs in its own process group with a timeout, so that a hang or a crash costs
one cell and not the table::

    python benchmarks/model_coverage.py [--families gpt2,llama] [--plans auto,meta]
                                        [--timeout 300] [--out benchmarks/results] [--merge]

It writes ``model_coverage.json`` (every cell, with the date, versions and machine) and
``model_coverage.md`` (one row per family) into ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

VOCAB, BATCH, SEQ, STEPS, LR, TOL = 128, 8, 16, 3, 0.1, 1e-5
RANKS = 4
PLANS: dict[str, dict[str, int]] = {"auto": {}, "dp2tp2": {"dp": 2, "tp": 2},
                                    "pp2dp2": {"pp": 2, "dp": 2}}
META_CLUSTER = dict(gpu="h100-sxm", nodes=8, gpus_per_node=8)
META_BATCH, META_SEQ, META_GLOBAL_BATCH = 2, 2048, 128
ALL_PLANS = (*PLANS, "meta")
RESULTS = Path(__file__).resolve().parent / "results"


TASKS = ("causal", "masked", "seq2seq", "speech", "image", "vlm")
"""What a family's model computes, which sets its inputs and targets (:func:`example`)."""

IMAGE, CLASSES, MEL_BINS, IMAGE_TOKEN = 16, 10, 8, VOCAB - 1
"""Tiny inputs: images of 16 x 16 pixels in 10 classes; 8 mel bins; the vision-language
model's image placeholder token."""


@dataclass(frozen=True)
class Family:
    """One model family: ``transformers`` class names and configuration overrides.

    ``tiny`` is the configuration of the 4-rank runs (on top of :data:`TINY_COMMON`);
    ``full`` overrides the config class's defaults for the meta-device plan (empty where
    the defaults already are the family's model of that size). ``task`` is one of
    :data:`TASKS`; ``keywords`` names the forward's keyword arguments where the model is
    wrapped in :class:`KeywordLogits` (None: called positionally as it is).
    """

    config: str
    model: str
    tiny: dict[str, Any]
    full: dict[str, Any] = field(default_factory=dict)
    attn: str = "sdpa"
    task: str = "causal"
    keywords: tuple[str, ...] | None = None


TINY_COMMON: dict[str, Any] = dict(vocab_size=VOCAB, use_cache=False, bos_token_id=0,
                                   eos_token_id=0, pad_token_id=0)
_DECODER = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=64)
_GQA = dict(_DECODER, num_key_value_heads=2)
_GPT2 = dict(n_embd=64, n_layer=2, n_head=4, n_positions=64)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)
_BART = dict(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
             decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
             max_position_embeddings=64, decoder_start_token_id=0)
_BERT = dict(_DECODER, type_vocab_size=1)
_VIT = dict(image_size=IMAGE, patch_size=4, num_channels=3, hidden_size=64,
            num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
            num_labels=CLASSES)
_SEQ2SEQ = ("input_ids", "decoder_input_ids")

FAMILIES: dict[str, Family] = {
    "gpt2": Family("GPT2Config", "GPT2LMHeadModel", _GPT2,
                   dict(n_embd=1600, n_layer=48, n_head=25)),                      # GPT-2 XL
    "gptj": Family("GPTJConfig", "GPTJForCausalLM", dict(_GPT2, rotary_dim=8)),     # GPT-J 6B
    "gpt_neox": Family("GPTNeoXConfig", "GPTNeoXForCausalLM", _DECODER,             # Pythia 6.9B
                       dict(hidden_size=4096, num_hidden_layers=32,
                            num_attention_heads=32, intermediate_size=16384,
                            vocab_size=50432)),
    "llama": Family("LlamaConfig", "LlamaForCausalLM", _GQA,                        # Llama 3 8B
                    dict(intermediate_size=14336, num_key_value_heads=8,
                         vocab_size=128256, rope_theta=500000.0)),
    "mistral": Family("MistralConfig", "MistralForCausalLM", dict(_GQA, sliding_window=8)),
    "mixtral": Family("MixtralConfig", "MixtralForCausalLM",                        # 8x7B
                      dict(_GQA, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2": Family("Qwen2Config", "Qwen2ForCausalLM", _GQA,                        # Qwen2 7B
                    dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                         num_attention_heads=28, num_key_value_heads=4,
                         vocab_size=152064)),
    "qwen2_moe": Family("Qwen2MoeConfig", "Qwen2MoeForCausalLM",                    # 14B-A2.7B
                        dict(_GQA, **_MOE, shared_expert_intermediate_size=128)),
    "qwen3": Family("Qwen3Config", "Qwen3ForCausalLM", dict(_GQA, head_dim=16),      # Qwen3 8B
                    dict(intermediate_size=12288, num_hidden_layers=36,
                         num_key_value_heads=8, head_dim=128, tie_word_embeddings=False)),
    "qwen3_moe": Family("Qwen3MoeConfig", "Qwen3MoeForCausalLM",                    # 30B-A3B
                        dict(_GQA, **_MOE, head_dim=16),
                        dict(num_hidden_layers=48, num_attention_heads=32,
                             num_key_value_heads=4, num_experts=128, num_experts_per_tok=8,
                             moe_intermediate_size=768, head_dim=128)),
    "phi": Family("PhiConfig", "PhiForCausalLM", _DECODER),                          # Phi-2
    "phi3": Family("Phi3Config", "Phi3ForCausalLM", _DECODER),                       # Phi-3 mini
    "gemma": Family("GemmaConfig", "GemmaForCausalLM", dict(_GQA, head_dim=16)),     # Gemma 7B
    "gemma2": Family("Gemma2Config", "Gemma2ForCausalLM",                            # Gemma 2 9B
                     dict(_GQA, head_dim=16, sliding_window=8, query_pre_attn_scalar=16),
                     dict(hidden_size=3584, num_hidden_layers=42, num_attention_heads=16,
                          num_key_value_heads=8, intermediate_size=14336,
                          query_pre_attn_scalar=256), attn="eager"),
    "opt": Family("OPTConfig", "OPTForCausalLM",                                     # OPT 6.7B
                  dict(hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                       num_attention_heads=4, max_position_embeddings=64,
                       word_embed_proj_dim=64),
                  dict(hidden_size=4096, ffn_dim=16384, num_hidden_layers=32,
                       num_attention_heads=32, word_embed_proj_dim=4096)),
    "bloom": Family("BloomConfig", "BloomForCausalLM", dict(hidden_size=64, n_layer=2,
                                                           n_head=4),
                    dict(hidden_size=4096, n_layer=30, n_head=32, vocab_size=250880),   # 7B1
                    attn="eager"),
    "falcon": Family("FalconConfig", "FalconForCausalLM",                            # Falcon 7B
                     dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                          max_position_embeddings=64)),
    "stablelm": Family("StableLmConfig", "StableLmForCausalLM", _GQA),               # 3B-4E1T
    "gpt_bigcode": Family("GPTBigCodeConfig", "GPTBigCodeForCausalLM", _GPT2,        # StarCoder
                          dict(n_embd=6144, n_layer=40, n_head=48, n_positions=8192,
                               vocab_size=49152)),
    "codegen": Family("CodeGenConfig", "CodeGenForCausalLM",                         # CodeGen 6B
                      dict(_GPT2, rotary_dim=8, n_ctx=64)),
    "cohere": Family("CohereConfig", "CohereForCausalLM", _GQA),                     # Command-R
    "olmo": Family("OlmoConfig", "OlmoForCausalLM", _DECODER),                       # OLMo 7B
    "olmo2": Family("Olmo2Config", "Olmo2ForCausalLM", _DECODER),                    # OLMo 2 7B
    "granite": Family("GraniteConfig", "GraniteForCausalLM", _GQA),                  # Granite 7B
    # encoder-decoders
    "t5": Family("T5Config", "T5ForConditionalGeneration",                           # T5 v1.1 XL
                 dict(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2,
                      num_heads=4, relative_attention_num_buckets=8,
                      relative_attention_max_distance=16, decoder_start_token_id=0),
                 dict(d_model=2048, d_kv=64, d_ff=5120, num_layers=24, num_heads=32,
                      feed_forward_proj="gated-gelu", tie_word_embeddings=False),
                 task="seq2seq", keywords=_SEQ2SEQ),
    "bart": Family("BartConfig", "BartForConditionalGeneration", _BART,                # large
                   task="seq2seq", keywords=_SEQ2SEQ),
    "mbart": Family("MBartConfig", "MBartForConditionalGeneration", _BART,             # large
                    task="seq2seq", keywords=_SEQ2SEQ),
    "pegasus": Family("PegasusConfig", "PegasusForConditionalGeneration", _BART,       # large
                      task="seq2seq", keywords=_SEQ2SEQ),
    "marian": Family("MarianConfig", "MarianMTModel", _BART,                           # Opus-MT
                     task="seq2seq", keywords=_SEQ2SEQ),
    "whisper": Family("WhisperConfig", "WhisperForConditionalGeneration",             # large-v3
                      dict(_BART, num_mel_bins=MEL_BINS, max_source_positions=8,
                           max_target_positions=64, begin_suppress_tokens=None,
                           suppress_tokens=None),
                      dict(d_model=1280, encoder_layers=32, decoder_layers=32,
                           encoder_attention_heads=20, decoder_attention_heads=20,
                           encoder_ffn_dim=5120, decoder_ffn_dim=5120, num_mel_bins=128,
                           vocab_size=51866),
                      task="speech", keywords=("input_features", "decoder_input_ids")),
    # encoders
    "bert": Family("BertConfig", "BertForMaskedLM", _BERT,                              # large
                   dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                        intermediate_size=4096), task="masked"),
    "roberta": Family("RobertaConfig", "RobertaForMaskedLM", _BERT,                     # large
                      dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                           intermediate_size=4096, vocab_size=50265,
                           max_position_embeddings=514, pad_token_id=1), task="masked"),
    "distilbert": Family("DistilBertConfig", "DistilBertForMaskedLM",                   # base
                         dict(dim=64, n_layers=2, n_heads=4, hidden_dim=128,
                              max_position_embeddings=64), task="masked"),
    "electra": Family("ElectraConfig", "ElectraForMaskedLM",                            # large
                      dict(_BERT, embedding_size=64),
                      dict(embedding_size=1024, hidden_size=1024, num_hidden_layers=24,
                           num_attention_heads=16, intermediate_size=4096), task="masked"),
    "vit": Family("ViTConfig", "ViTForImageClassification", _VIT,                       # ViT-H/14
                  dict(hidden_size=1280, num_hidden_layers=32, num_attention_heads=16,
                       intermediate_size=5120, patch_size=14, num_labels=1000),
                  task="image"),
    "deit": Family("DeiTConfig", "DeiTForImageClassification", _VIT,                    # base
                   dict(num_labels=1000), task="image"),
    # state space and vision-language
    "mamba": Family("MambaConfig", "MambaForCausalLM",                                  # 2.8B
                    dict(hidden_size=64, state_size=8, num_hidden_layers=2, expand=2,
                         conv_kernel=4),
                    dict(hidden_size=2560, num_hidden_layers=64, vocab_size=50280),
                    attn="eager"),
    "mamba2": Family("Mamba2Config", "Mamba2ForCausalLM",                               # 2.7B
                     dict(hidden_size=64, num_heads=8, head_dim=16, state_size=8, n_groups=1,
                          num_hidden_layers=2, expand=2, chunk_size=8),
                     dict(hidden_size=2560, num_heads=80, head_dim=64, num_hidden_layers=64,
                          vocab_size=50288), attn="eager"),
    "llava": Family("LlavaConfig", "LlavaForConditionalGeneration",                     # 1.5 7B
                    dict(vision_config=dict(model_type="clip_vision_model", image_size=8,
                                            patch_size=4, hidden_size=64,
                                            intermediate_size=128, num_hidden_layers=2,
                                            num_attention_heads=4),
                         text_config=dict(model_type="llama", **TINY_COMMON, **_GQA),
                         image_token_index=IMAGE_TOKEN),
                    dict(text_config=dict(model_type="llama", vocab_size=32064),
                         image_token_index=32000),
                    task="vlm", keywords=("input_ids", "pixel_values")),
    # more decoders
    "gpt_neo": Family("GPTNeoConfig", "GPTNeoForCausalLM",                              # 2.7B
                      dict(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128,
                           attention_types=[[["global", "local"], 1]], window_size=8,
                           max_position_embeddings=64),
                      dict(hidden_size=2560, num_layers=32, num_heads=20,
                           attention_types=[[["global", "local"], 16]]), attn="eager"),
    "starcoder2": Family("Starcoder2Config", "Starcoder2ForCausalLM", _GQA),            # 3B
    "olmoe": Family("OlmoeConfig", "OlmoeForCausalLM",                                  # 1B-7B
                    dict(_GQA, num_experts=4, num_experts_per_tok=2)),
    "nemotron": Family("NemotronConfig", "NemotronForCausalLM", _GQA,                   # 4 15B
                       dict(num_key_value_heads=8)),
    "persimmon": Family("PersimmonConfig", "PersimmonForCausalLM", _DECODER),           # 8B
    "deepseek_v3": Family("DeepseekV3Config", "DeepseekV3ForCausalLM",                  # 671B
                          dict(_DECODER, num_key_value_heads=4, moe_intermediate_size=64,
                               n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                               first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16,
                               qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                               n_group=2, topk_group=1)),
    "gpt_oss": Family("GptOssConfig", "GptOssForCausalLM",                              # 120B
                      dict(_GQA, head_dim=16, intermediate_size=64, num_local_experts=4,
                           num_experts_per_tok=2, sliding_window=8), attn="eager"),
}

_NOISE = ("dropout", "pdrop", "layerdrop", "jitter")


def build_config(name: str, full: bool = False) -> Any:
    """The ``transformers`` config of family ``name``: tiny (every dropout, layer drop and
    router jitter set to 0) or full-size."""
    import transformers

    fam = FAMILIES[name]
    kwargs = dict(fam.full) if full else {**TINY_COMMON, **fam.tiny}
    cfg = getattr(transformers, fam.config)(**kwargs, attn_implementation=fam.attn)
    cfg.use_cache = False
    for key, value in cfg.to_dict().items():
        if any(n in key for n in _NOISE) and isinstance(value, float):
            setattr(cfg, key, 0.0)
    return cfg


def build_model(name: str, full: bool = False) -> torch.nn.Module:
    """Family ``name``'s ``transformers`` model on the current default device, seeded so
    that every process builds the same weights."""
    import transformers

    torch.manual_seed(0)
    return getattr(transformers, FAMILIES[name].model)(build_config(name, full))


class KeywordLogits(torch.nn.Module):
    """A model whose forward takes its inputs as keywords (``names``), called with them
    in that order; returns its logits: the few lines a user wraps such a model in."""

    def __init__(self, inner: torch.nn.Module, names: tuple[str, ...]) -> None:
        super().__init__()
        self.inner, self.names = inner, names

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.inner(**dict(zip(self.names, inputs))).logits


def trainable(name: str, model: torch.nn.Module) -> torch.nn.Module:
    """``model`` as it is trained: wrapped in :class:`KeywordLogits` where the family
    names keywords."""
    keywords = FAMILIES[name].keywords
    return KeywordLogits(model, keywords) if keywords else model


def model_config(model: torch.nn.Module) -> Any:
    """The ``transformers`` config of ``model`` or of the model it wraps."""
    return getattr(model, "config", None) or model.inner.config


def _text(cfg: Any) -> Any:
    """The config that holds the vocabulary (a vision-language model's text config)."""
    return getattr(cfg, "text_config", None) or cfg


def _longest(cfg: Any, decoder: bool = False) -> int:
    """The longest sequence the (text or decoder) config allows, at most ``META_SEQ``."""
    cfg = _text(cfg)
    keys = (("max_target_positions",) if decoder else ()) + (
        "max_position_embeddings", "n_positions")
    found = [getattr(cfg, k) for k in keys if isinstance(getattr(cfg, k, None), int)]
    return min(META_SEQ, found[0]) if found else META_SEQ


def example(name: str, cfg: Any, batch: int, seq: int | None = None,
            device: str = "cpu") -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """(inputs, targets) of ``batch`` samples for family ``name`` with config ``cfg``, as
    its :data:`TASKS` entry takes them: token ids of ``seq`` tokens (the config's longest
    where None, at most :data:`META_SEQ`); the decoder's input is the targets shifted right
    after a start token; images and mel features of the config's size. Seeded on the CPU
    (the same data in every process); shapes only on ``meta``."""
    task = FAMILIES[name].task
    gen = torch.Generator().manual_seed(1) if device == "cpu" else None

    def ids(high: int, *shape: int) -> torch.Tensor:
        return torch.randint(0, high, shape, generator=gen, device=device)

    def floats(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device)

    if task == "image":
        pixels = floats(batch, cfg.num_channels, cfg.image_size, cfg.image_size)
        return (pixels,), ids(cfg.num_labels, batch)
    seq = seq or _longest(cfg, decoder=task == "speech")
    if task == "vlm":
        vision = cfg.vision_config
        n_image = (vision.image_size // vision.patch_size) ** 2
        x, y = ids(cfg.image_token_index, batch, seq), ids(cfg.image_token_index, batch, seq)
        x[:, :n_image] = cfg.image_token_index
        return (x, floats(batch, vision.num_channels, vision.image_size, vision.image_size)), y
    vocab = _text(cfg).vocab_size
    x, y = ids(vocab, batch, seq), ids(vocab, batch, seq)
    if task in ("causal", "masked"):
        return (x,), y
    decoder = torch.cat([torch.zeros_like(y[:, :1]), y[:, :-1]], dim=1)
    if task == "speech":
        x = floats(batch, cfg.num_mel_bins, 2 * cfg.max_source_positions)
    return (x, decoder), y


class CellError(RuntimeError):
    """Raised by a rank with ``{"type", "message"}`` as JSON, so that the parent reads the
    original exception out of :class:`autopar.launch.RankFailure`'s traceback."""


def _error(exc: BaseException) -> dict[str, str]:
    lines = str(exc).strip().splitlines()
    return {"type": type(exc).__name__, "message": lines[0] if lines else ""}


def rank_train(name: str, space: dict[str, int]) -> dict[str, Any]:
    """On one rank: parallelize the tiny model under ``space``, train 3 SGD steps."""
    import autopar
    from autopar.demo import sgd_losses

    try:
        model = trainable(name, build_model(name))
        xs, y = example(name, model_config(model), BATCH, SEQ)
        pm = autopar.parallelize(model, xs, precision="fp32", **space)
        losses = sgd_losses(pm.parameters(), lambda: pm.step(xs, y), STEPS, LR)
    except Exception as exc:
        raise CellError(json.dumps(_error(exc))) from None
    p = pm.plan
    return {"losses": losses, "mesh": p.mesh, "zero": p.zero,
            "schedule": p.pipeline.schedule if p.pipeline else None,
            "sequence_parallel": p.sequence_parallel}


def run_cell(name: str, plan: str, timeout_s: float) -> dict[str, Any]:
    """One cell in this process (4 spawned ranks for a run, or one meta plan)."""
    import autopar
    from autopar.demo import reference_step, sgd_losses
    from autopar.launch import RankFailure, run_distributed

    if plan == "meta":
        with torch.device("meta"):
            model = trainable(name, build_model(name, full=True))
        xs, _ = example(name, model_config(model), META_BATCH, device="meta")
        t0 = time.perf_counter()
        try:
            p = autopar.plan(model, xs, cluster=autopar.Cluster(**META_CLUSTER),
                             global_batch=META_GLOBAL_BATCH)
        except Exception as exc:
            return {"ok": False, **_error(exc), "seconds": time.perf_counter() - t0}
        return {"ok": True, "seconds": time.perf_counter() - t0,
                "shapes": [list(x.shape) for x in xs],
                "params": sum(t.numel() for t in model.parameters()), "mesh": p.mesh,
                "zero": p.zero, "schedule": p.pipeline.schedule if p.pipeline else None,
                "step_time_s": p.step_time_s, "mfu": p.mfu,
                "memory_per_device_gb": p.memory_per_device_bytes / 1e9}
    torch.set_num_threads(1)
    model = trainable(name, build_model(name))
    xs, y = example(name, model_config(model), BATCH, SEQ)
    ref = sgd_losses(model.parameters(), reference_step(model, xs, y), STEPS, LR)
    try:
        got = run_distributed(RANKS, rank_train, name, PLANS[plan], timeout_s=timeout_s)[0]
    except RankFailure as exc:
        found = re.search(r"CellError: (\{.*\})\s*$", str(exc), re.M)
        if found:
            return {"ok": False, **json.loads(found.group(1)), "reference": ref}
        text = str(exc).strip().splitlines()
        return {"ok": False, "type": "RankFailure", "message": text[-1] if text else "",
                "reference": ref}
    diff = max(abs(a - b) for a, b in zip(got["losses"], ref))
    return {"ok": diff <= TOL, "max_diff": diff, "reference": ref, **got}


def spawn_cell(name: str, plan: str, timeout_s: float) -> dict[str, Any]:
    """Run one cell in a fresh interpreter and its own process group; kill the group when
    it outlives ``timeout_s``."""
    cmd = [sys.executable, __file__, "--cell", f"{name}:{plan}", "--timeout", str(timeout_s)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s + 30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return {"ok": False, "type": "Timeout", "message": f"no result in {timeout_s:.0f} s",
                "wall_s": time.perf_counter() - t0}
    wall = time.perf_counter() - t0
    try:
        return {**json.loads(out.strip().splitlines()[-1]), "wall_s": wall}
    except (IndexError, json.JSONDecodeError):
        lines = err.strip().splitlines() or [f"exit status {proc.returncode}"]
        return {"ok": False, "type": "Crash", "message": lines[-1], "wall_s": wall}


def _mesh(cell: dict[str, Any]) -> str:
    """``dp2 tp2 z3`` (degrees above 1, the ZeRO stage, the pipeline schedule if any)."""
    mesh = " ".join(f"{k}{v}" for k, v in cell["mesh"].items() if v > 1) or "1 device"
    return f"{mesh} z{cell['zero']}" + (f" {cell['schedule']}" if cell.get("schedule") else "")


def _short(cell: dict[str, Any], width: int = 110) -> str:
    """A cell of the Markdown table."""
    if cell.get("ok"):
        if "step_time_s" in cell:
            return (f"pass: {_mesh(cell)}, {cell['step_time_s']:.2f} s/step, "
                    f"planned in {cell['seconds']:.0f} s")
        return f"pass ({_mesh(cell)})"
    if "max_diff" in cell:
        return f"FAIL ({_mesh(cell)}): loss differs by {cell['max_diff']:.1e}"
    text = f"{cell['type']}: {cell['message']}".replace("|", "\\|")
    return "FAIL: " + (text if len(text) <= width else text[:width - 1] + "…")


def machine() -> str:
    """The CPU model and count, and the operating system."""
    cpu = platform.processor() or platform.machine()
    info = Path("/proc/cpuinfo")
    if info.exists():
        names = [ln.split(":", 1)[1].strip() for ln in info.read_text().splitlines()
                 if ln.startswith("model name")]
        cpu = names[0] if names else cpu
    return f"{cpu}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}"


def autopar_source() -> str:
    """Where autopar was imported from: its git commit, with a note when the library's
    tracked files differ from it, or else its folder."""
    import autopar

    folder = Path(os.path.realpath(autopar.__file__)).parent
    git = ["git", "-C", str(folder)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, check=False)
    if head.returncode:
        return str(folder)
    dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no", "--",
                            ":/autopar", ":/cost_models", ":/solvers", ":/runtime",
                            ":/examples"], capture_output=True, text=True, check=False)
    return f"commit {head.stdout.strip()}" + (" with uncommitted changes"
                                              if dirty.stdout.strip() else "")


def causes(doc: dict[str, Any]) -> list[tuple[str, list[str]]]:
    """The distinct errors of the failed cells (the family's model class written
    ``<model>``), each with its ``family:plan`` cells, the most frequent first."""
    seen: dict[str, list[str]] = {}
    for name, cells in doc["families"].items():
        for plan, cell in cells.items():
            if not cell.get("ok"):
                text = (f"{cell['type']}: {cell['message']}" if "type" in cell
                        else "losses differ from the single process")
                text = text.replace(FAMILIES[name].model if name in FAMILIES else "\0",
                                    "<model>")
                seen.setdefault(text, []).append(f"{name}:{plan}")
    return sorted(seen.items(), key=lambda kv: -len(kv[1]))


def markdown(doc: dict[str, Any]) -> str:
    """The matrix (one row per family, one column per plan, a count of passes below),
    then the failures grouped by error."""
    plans = [p for p in ALL_PLANS if any(p in c for c in doc["families"].values())]
    heads = {"auto": "auto (4 ranks)", "dp2tp2": "dp2 × tp2", "pp2dp2": "pp2 × dp2",
             "meta": "full size on 64 H100 (meta)"}
    rows = [f"# Model coverage ({doc['date']})", "",
            f"autopar {doc['autopar']}, torch {doc['torch']}, transformers "
            f"{doc['transformers']}, {doc['machine']}. Run cells: {STEPS} SGD steps of a "
            f"tiny fp32 model on {RANKS} gloo ranks against one process, pass within "
            f"{TOL:g}. Meta cells: `autopar.plan` on 8 x 8 H100, global batch "
            f"{META_GLOBAL_BATCH}. Command: `{doc['command']}` ({doc['wall_s'] / 60:.0f} min)."
            + (" Cells this command did not redo come from earlier runs, newest first: "
               + "; ".join(f"{k.get('date', '?')}, autopar {k.get('autopar', '?')}: "
                           f"`{k.get('command', '?')}`" for k in doc["kept_from"][::-1]) + "."
               if doc.get("kept_from") else ""),
            "", "| family | " + " | ".join(heads[p] for p in plans) + " |",
            "|---" * (len(plans) + 1) + "|"]
    for name, cells in doc["families"].items():
        rows.append(f"| {name} | "
                    + " | ".join(_short(cells[p]) if p in cells else "" for p in plans) + " |")
    passed = [sum(bool(c.get(p, {}).get("ok")) for c in doc["families"].values())
              for p in plans]
    rows.append("| **passing** | " + " | ".join(f"**{n} / {len(doc['families'])}**"
                                                 for n in passed) + " |")
    rows += ["", "## Failures by error", ""]
    rows += [f"- {len(where)} cells: `{text}` ({', '.join(where)})"
             for text, where in causes(doc)]
    return "\n".join(rows) + "\n"


def main() -> int:
    """Run the selected cells one after another and write the JSON and Markdown."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", help="comma-separated families (default: all)")
    ap.add_argument("--plans", default=",".join(ALL_PLANS), help="comma-separated plans")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per cell")
    ap.add_argument("--out", type=Path, default=RESULTS, help="folder of the results")
    ap.add_argument("--merge", action="store_true",
                    help="keep the existing JSON's cells that this run does not redo")
    ap.add_argument("--cell", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.cell:
        name, plan = args.cell.split(":")
        print(json.dumps(run_cell(name, plan, args.timeout)))
        return 0
    names = args.families.split(",") if args.families else list(FAMILIES)
    plans = args.plans.split(",")
    unknown = sorted(set(names) - set(FAMILIES)) + sorted(set(plans) - set(ALL_PLANS))
    if unknown:
        ap.error(f"unknown family or plan {unknown}; families: {', '.join(FAMILIES)}; "
                 f"plans: {', '.join(ALL_PLANS)}")
    import transformers

    json_path = args.out / "model_coverage.json"
    families: dict[str, dict[str, Any]] = {}
    kept_from: list[dict[str, str]] = []
    if args.merge and json_path.exists():
        prev = json.loads(json_path.read_text())
        families = prev["families"]
        kept_from = prev.get("kept_from", []) + [
            {k: prev[k] for k in ("date", "autopar", "command") if k in prev}]
    t0 = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    source = autopar_source()
    for name in names:
        for plan in plans:
            cell = spawn_cell(name, plan, args.timeout)
            families.setdefault(name, {})[plan] = cell
            print(f"{name:<12} {plan:<7} {cell['wall_s']:6.0f} s  {_short(cell, 200)}",
                  flush=True)
            # written after every cell, so that a run stopped early keeps what it found
            doc = {"date": datetime.date.today().isoformat(), "autopar": source,
                   "torch": torch.__version__, "transformers": transformers.__version__,
                   "python": platform.python_version(), "machine": machine(),
                   "command": "python benchmarks/model_coverage.py " + " ".join(sys.argv[1:]),
                   "wall_s": time.perf_counter() - t0, "kept_from": kept_from,
                   "families": {n: families[n] for n in [*FAMILIES, *families]
                                if n in families}}
            json_path.write_text(json.dumps(doc, indent=1) + "\n")
            (args.out / "model_coverage.md").write_text(markdown(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
