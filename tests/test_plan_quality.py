"""The plan-quality benchmark's row machinery on small GPTs: the planner's plan is never
slower than the hand-written configuration under the same cost model."""

from __future__ import annotations

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
