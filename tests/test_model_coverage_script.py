"""The family table of ``benchmarks/model_coverage.py``: every family's tiny and full-size
configurations build a model (on ``meta``, so no weights are made), tiny ones without
dropout. The multi-rank runs themselves are the benchmark's, not this test's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from model_coverage import FAMILIES, VOCAB, build_config, build_model  # noqa: E402


def test_at_least_twenty_families() -> None:
    assert len(FAMILIES) >= 20


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_tiny_config_builds_without_dropout(name: str) -> None:
    with torch.device("meta"):
        model = build_model(name)
    cfg = model.config
    assert cfg.vocab_size == VOCAB and not cfg.use_cache
    assert 0 < sum(p.numel() for p in model.parameters()) < 1_000_000
    noise = {k: v for k, v in cfg.to_dict().items()
             if any(n in k for n in ("dropout", "pdrop", "layerdrop", "jitter"))
             and isinstance(v, float) and v != 0.0}
    assert not noise, noise


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_full_config_builds_on_meta(name: str) -> None:
    assert build_config(name, full=True).vocab_size > VOCAB
    with torch.device("meta"):
        model = build_model(name, full=True)
    assert sum(p.numel() for p in model.parameters()) > 1e9
