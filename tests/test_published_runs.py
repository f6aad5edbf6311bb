"""The calibration set of published runs (benchmarks/published_runs.json): every row
complete and sourced, none from the held-out sources, and the conversion of published
figures to seconds per step checked by hand."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "published_accuracy.py"
ARCH = ("family", "layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab", "seq_len",
        "moe")
PARALLEL = ("dp", "tp", "pp", "vp", "cp", "ep", "micro_batch", "global_batch", "recompute",
            "zero", "distributed_optimizer", "fsdp", "sequence_parallel", "precision", "fp8")
UNITS = ("s/step", "tokens/s/GPU", "TFLOP/s/GPU", "MFU")
HELD_OUT = ("narayanan", "sc'21", "2104.04473", "korthikanti", "2205.05198")


def _module():
    spec = importlib.util.spec_from_file_location("published_accuracy", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def pa():
    return _module()


@pytest.fixture(scope="module")
def data(pa):
    return pa.load()


def _row(data: dict, row_id: str) -> dict:
    return next(r for r in data["rows"] if r["id"] == row_id)


def test_every_row_is_complete_and_sourced(data) -> None:
    rows, sources = data["rows"], data["sources"]
    assert len(rows) >= 30 and len({r["source"] for r in rows}) >= 6
    assert len({r["id"] for r in rows}) == len(rows)
    for r in rows:
        assert r["source"] in sources and r["where"], r["id"]
        assert set(ARCH) <= set(r["architecture"]), r["id"]
        assert set(PARALLEL) <= set(r["parallel"]), r["id"]
        assert r["hardware"]["gpu"] and r["hardware"]["gpus"] > 0, r["id"]
        assert r["measured"]["unit"] in UNITS and r["measured"]["value"] > 0, r["id"]
        if r["architecture"]["moe"] is not None:
            assert set(r["architecture"]["moe"]) == {"experts", "top_k", "expert_ffn",
                                                     "shared_experts", "dense_layers"}
    for s in sources.values():
        assert s["reference"] and s["label"] and "not_stated" in s


def test_no_row_comes_from_a_held_out_source(data) -> None:
    for key, s in data["sources"].items():
        text = (s["label"] + s["reference"]).lower()
        assert not any(h in text for h in HELD_OUT), key
    for r in data["rows"]:
        text = (r["where"] + r["source"]).lower()
        assert not any(h in text for h in HELD_OUT), r["id"]
        if r["source"] == "torchtitan":  # its Llama 3.1 8B rows are held out
            assert r["architecture"]["layers"] != 32 and r["architecture"]["hidden"] != 4096


def test_tokens_per_second_converts_to_a_step_time(pa, data) -> None:
    # Megatron-Bridge GPT-OSS 120B: 1280 sequences x 4096 tokens / (5824 tok/s x 64 GPUs)
    r = _row(data, "mbr-2604.01-gptoss-120b-bf16")
    assert pa.published_step_s(r, data["sources"]) == pytest.approx(
        1280 * 4096 / (5824 * 64), rel=1e-12)
    assert pa.published_step_s(r, data["sources"]) == pytest.approx(14.0659, abs=1e-4)


def test_tflops_convert_through_the_megatron_count(pa, data) -> None:
    # Megatron-LM 1.7B: 12 L h^2 (2 + s/h + 4) + 6 h V FLOPs per token (full attention),
    # 192 x 4096 tokens at 408.8 TFLOP/s on 48 GPUs.
    r = _row(data, "mlm-weak-1.7b")
    L, h, s, V = 24, 2048, 4096, 131072
    per_token = 12 * L * h * h * (2 + s / h + 4) + 6 * h * V
    assert per_token == pytest.approx(11.274289152e9, rel=1e-12)
    expected = 192 * 4096 * per_token / (408.8e12 * 48)
    assert pa.published_step_s(r, data["sources"]) == pytest.approx(expected, rel=1e-12)
    assert expected == pytest.approx(0.45185, abs=1e-4)


def test_the_flops_count_matches_rows_that_give_two_figures(pa, data) -> None:
    # NeMo 24.07 Llama 3 70B: 734 TFLOP/s at 1524 tokens/s is 481.6 GFLOP per token.
    a = _row(data, "nemo-2407-llama3-70b")["architecture"]
    assert pa.flops_per_token(a, causal=False) == pytest.approx(734e12 / 1524, rel=2e-3)
    # Model zoo Qwen3-235B: 245 TFLOP/s at 19.7 s per 2048 x 4096 tokens on 256 GPUs.
    a = _row(data, "zoo-qwen3-235b-ep32-pp8")["architecture"]
    tokens_per_gpu_s = 2048 * 4096 / 19.7 / 256
    assert pa.flops_per_token(a, causal=True) == pytest.approx(245e12 / tokens_per_gpu_s,
                                                               rel=1e-2)


def test_unscoreable_rows_say_why(pa, data) -> None:
    src = data["sources"]
    assert pa.why_not_scored(_row(data, "tt-70b-2d-fp8"), src) is None  # priced as fp8
    assert pa.precision_of(_row(data, "tt-70b-2d-fp8")) == "fp8"
    assert pa.why_not_scored(_row(data, "mbr-2604.01-llama3-70b-fp8"), src) is None  # ep null
    assert "context and expert" in pa.why_not_scored(_row(data, "zoo-qwen3-235b-32k-cp2"), src)
    assert "global batch" in pa.why_not_scored(_row(data, "opt-175b"), src)
    folded = _row(data, "zoo-qwen3-235b-ep8-fsdp")  # EP 8 over TP 2 x DP, expert TP 1
    assert pa.why_not_scored(folded, src) is None
    assert pa.spec_of(folded).expert_tp == 1 and pa.spec_of(folded).ep == 8
    stacked = {**folded, "scoring_assumptions": {
        k: v for k, v in folded["scoring_assumptions"].items() if k != "model"}}
    assert pa.why_not_scored(stacked, src) == (
        "EP 8 folds over TP x DP (expert TP 1), which autopar does for routed experts only; "
        "autopar's MoE example routes through stacked experts: name a routed model in "
        "scoring_assumptions.model")
    assert pa.spec_of(_row(data, "mbr-2509-deepseek-v3-fp8")).expert_tp is None  # EP | DP
    assert pa.why_not_scored(_row(data, "bloom-176b"), src) is None


def test_a_scored_row_reports_its_error(pa, data) -> None:
    row = _row(data, "bloom-176b")
    [res] = pa.score([row], data["sources"], 1, pa.RUNS,
                     price=lambda r: {"predicted_step_s": 52.35, "fits": True})
    assert res["published_step_s"] == 104.70
    assert res["error_rel"] == pytest.approx(-0.5)
    assert pa.spec_of(row).given() == {"dp": 8, "tp": 4, "pp": 12, "cp": 1, "ep": 1,
                                       "microbatch_size": 2, "schedule": "1f1b",
                                       "recompute": "full", "zero": 1,
                                       "sequence_parallel": False, "split_weights": True}
