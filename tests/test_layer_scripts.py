"""The layer benchmarks' wiring on a CPU: ``gpu_layers.py --tiny`` plans, lays out and
times its three tiny cases (one process, gloo), and ``layer_accuracy.py`` prices
committed GPU rows again with the predictions and terms it reports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

from layer_accuracy import TERMS, evaluate, measured_terms, summary  # noqa: E402
from layer_cases import LayerCase, build, default_cases, layer_flops  # noqa: E402


def test_gpu_layers_runs_its_tiny_cases_on_a_cpu(tmp_path: Path) -> None:
    out = tmp_path / "layers.json"
    subprocess.run([sys.executable, "gpu_layers.py", "--tiny", "--steps", "1",
                    "--out", str(out)], cwd=BENCH, check=True, timeout=300,
                   capture_output=True)
    rows = json.loads(out.read_text())["rows"]
    assert [r["name"] for r in rows] == ["tiny-llama/tp2/s64/b2/none",
                                         "tiny-gpt/tp2/s64/b2/full",
                                         "tiny-llama/tp1/s64/b1/selective"]
    for r in rows:
        assert "error" not in r, r.get("error")
        assert r["measured_fwd_bwd_s"] > 0 and r["predicted_fwd_bwd_s"] > 0


def test_shard_layers_hold_a_tensor_parallel_share() -> None:
    """A tp-k shard holds 1/k of the attention and MLP weights of the whole layer
    (norms and GPT's output biases stay whole)."""
    def params(case: LayerCase) -> int:
        model, _, _ = build(case)
        return sum(p.numel() for n, p in model.named_parameters()
                   if "norm" not in n and "ln" not in n and not n.endswith(("proj.bias",
                                                                            "out.bias")))
    for arch in ("llama3-8b", "gpt3-175b"):
        whole, shard = (params(LayerCase(arch, tp, 2048, 1, layers=1)) for tp in (1, 8))
        assert shard * 8 == whole
    assert layer_flops(LayerCase("llama3-8b", 1, 2048, 1)) == pytest.approx(
        layer_flops(LayerCase("llama3-8b", 2, 2048, 1)) * 2)
    assert len({c.name for c in default_cases()}) == len(default_cases()) == 60


def test_layer_accuracy_prices_committed_rows_again() -> None:
    doc = json.loads((BENCH / "results" / "h100_layers.json").read_text())
    rows = [r for r in doc["rows"] if r["name"] == "llama3-8b/tp8/s2048/b1/none"]
    records = evaluate(rows, "h100-sxm")
    (r,) = records
    assert r["measured_s"] == rows[0]["measured_fwd_bwd_s"]
    assert set(r["predicted_terms_s"]) == set(TERMS) == set(measured_terms(rows[0]))
    assert r["predicted_terms_s"]["gemm"] > 0 and r["predicted_terms_s"]["attention"] > 0
    assert summary(records)["all"]["cases"] == 1


def test_moe_blocks_priced_near_their_h100_measurement() -> None:
    """The committed H100 run of Mixtral 8x7B's block with 2 experts (an ep-4 rank's
    share) is priced again within 15%: its grouped expert products are matrix work
    (they were priced as free copies before, 57% under)."""
    pytest.importorskip("transformers")
    from gpu_moe import MoECase, predict

    doc = json.loads((BENCH / "results" / "h100_moe.json").read_text())
    (row,) = [r for r in doc["rows"] if r["name"] == "mixtral-8x7b/ep4"]
    plan = predict(MoECase(**row["case"]), "h100-sxm")
    pred = plan.breakdown["compute_s"] + plan.breakdown["exposed_host_s"]
    assert pred == pytest.approx(row["measured_fwd_bwd_s"], rel=0.15)


def test_long_attention_is_priced_near_its_h100_measurement() -> None:
    """Whole causal attention over one sequence of 32K and 128K tokens (Llama 3 8B's
    heads, forward+backward, measured on an H100) is priced within 5% now that the
    attention table reaches those lengths (15-17% fast before)."""
    from gpu_attention_long import reprice

    res = reprice(str(BENCH / "results" / "h100_attention_long.json"), "h100-sxm")
    whole = [r for r in res["cases"] if r["case"] == "full" and r["seq"] >= 32768]
    assert len(whole) == 2 and all(abs(r["error_pct"]) < 5 for r in whole), whole


def test_attention_table_merge_adds_only_missing_rows(tmp_path: Path) -> None:
    from gpu_attention_table import merge

    target = tmp_path / "profile.json"
    rows = tmp_path / "rows.json"
    base = {"format": "autopar-profile/1", "provenance": {"date": "d"},
            "tables": {"attention": [{"key": "a:fwd", "seconds": 1.0}]}}
    target.write_text(json.dumps(base))
    rows.write_text(json.dumps({"provenance": {"date": "e", "device_name": "G"},
                                "tables": {"attention": [{"key": "a:fwd", "seconds": 2.0},
                                                         {"key": "b:fwd", "seconds": 3.0}]}}))
    merge(rows, target)
    merge(rows, target)
    doc = json.loads(target.read_text())
    assert doc["tables"]["attention"] == [{"key": "a:fwd", "seconds": 1.0},
                                          {"key": "b:fwd", "seconds": 3.0}]
    assert [m["rows"] for m in doc["provenance"]["merged"]] == [["b:fwd"]]
