"""The plan-quality benchmark's row machinery on small GPTs: the planner's plan is never
slower than the hand-written configuration under the same cost model."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import plan_quality as pq  # noqa: E402

SMALL = (4, 512, 8)  # layers, hidden, heads of a GPT built from GPTConfig


def test_rows_divide_their_clusters() -> None:
    """Every published row factors its GPUs and its global batch exactly."""
    for row in pq.rows():
        assert row.dp * row.tp * row.pp == row.gpus, row.name
        assert row.dp * row.microbatch_size * row.num_microbatches == row.global_batch, \
            row.name
        assert pq.Row.from_dict(asdict(row)) == row


def test_reference_configs_match_the_zoo() -> None:
    """The shapes listed in ``reference_configs.json`` are those of the zoo models the rows
    plan, and each torchtitan pipeline schedule is the one its row runs."""
    from autopar.examples import zoo

    sources = json.loads(pq.REFERENCE_CONFIGS.read_text())["sources"]
    for key in ("megatron", "korthikanti"):
        for c in sources[key]["configurations"]:
            if c["model"] == pq.GPT_22B:
                continue
            cfg = zoo._entry(c["model"]).config
            assert (cfg.n_heads, cfg.dim, cfg.n_layers) == \
                (c["attention_heads"], c["hidden_size"], c["layers"]), c["model"]
    schedules = {None: None, "1F1B": "1f1b", "Interleaved1F1B": "interleaved_1f1b"}
    by_name = {row.name: row for row in pq.rows()}
    for c in sources["torchtitan"]["configurations"]:
        assert by_name[c["name"]].schedule == schedules[c["pipeline_schedule"]], c["name"]


@pytest.mark.parametrize("row", [
    pq.Row("small-dp-tp", "test", "gpt-small", "a100-80g", 8, 16, tp=2, pp=1,
           microbatch_size=4, recompute="full", model_args=SMALL),
    pq.Row("small-interleaved", "test", "gpt-small", "h100-sxm", 8, 16, tp=2, pp=2,
           microbatch_size=1, recompute="selective", sequence_parallel=True,
           virtual_stages=2, precision="bf16", optimizer="adamw", model_args=SMALL),
], ids=lambda r: r.name)
def test_plan_never_slower_than_reference(row: pq.Row) -> None:
    """The row's plan takes no longer than its reference, and both are described."""
    out = pq.measure(row)
    assert "reference_error" not in out and "plan_error" not in out, out
    assert out["plan_step_s"] <= out["reference_step_s"] * (1 + 1e-9)
    assert out["ratio"] >= 1 - 1e-9
    assert out["reference"] == row.describe()
    assert out["plan"].startswith(("dp", "pp"))
