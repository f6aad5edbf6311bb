"""The family table of ``benchmarks/model_coverage.py``: at least 40 families of every task
the issue names; each family's tiny and full-size configurations build a model (on
``meta``, so no weights are made), tiny ones without dropout; the inputs it makes fit
the model. The multi-rank runs themselves are the benchmark's,
not this test's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from autopar.capture import first_tensor

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from model_coverage import (FAMILIES, TASKS, VOCAB, build_model,  # noqa: E402
                            example, model_config, trainable)


def test_at_least_forty_families_of_every_task() -> None:
    assert len(FAMILIES) >= 40
    assert {f.task for f in FAMILIES.values()} == set(TASKS)
    for name in ("t5", "bart", "whisper", "bert", "vit", "mamba", "llava"):
        assert name in FAMILIES


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_tiny_config_builds_without_dropout(name: str) -> None:
    with torch.device("meta"):
        model = build_model(name)
    cfg = model.config
    text = getattr(cfg, "text_config", None) or cfg
    if FAMILIES[name].task != "image":
        assert text.vocab_size == VOCAB
    assert not cfg.use_cache
    assert 0 < sum(p.numel() for p in model.parameters()) < 1_000_000
    noise = {k: v for k, v in cfg.to_dict().items()
             if any(n in k for n in ("dropout", "pdrop", "layerdrop", "jitter"))
             and isinstance(v, float) and v != 0.0}
    assert not noise, noise


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_tiny_inputs_fit_the_model(name: str) -> None:
    """The tiny model's logits on its example: one row of class scores per target."""
    model = trainable(name, build_model(name))
    xs, y = example(name, model_config(model), 2, 16)
    with torch.no_grad():
        logits = first_tensor(model(*xs))
    assert logits.shape[:-1] == y.shape


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_full_config_builds_on_meta(name: str) -> None:
    with torch.device("meta"):
        model = build_model(name, full=True)
    params = sum(p.numel() for p in model.parameters())
    assert params > (1e9 if FAMILIES[name].task == "causal" else 5e7), params
    xs, y = example(name, model.config, 2, device="meta")  # the meta cell's inputs
    assert all(x.device.type == "meta" and x.shape[0] == 2 for x in xs) and y.shape[0] == 2
