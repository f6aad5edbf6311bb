"""Issue 40, item 1: without ``--global-batch`` the CLI plans a zoo language model for
a real training batch (:mod:`autopar.batch_default`), and the summary's batch line says
how many sequences of how many tokens the step holds and where that batch came from."""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar.batch_default import TOKENS_PER_DEVICE, default_global_batch
from autopar.cli import main
from autopar.examples.gpt import GPT, GPTConfig

CPU2 = ["--gpu", "cpu", "--gpus-per-node", "2", "--pp", "1", "--tp", "1"]


def test_the_rule_is_tokens_per_device_in_whole_sequences() -> None:
    assert TOKENS_PER_DEVICE == 8192
    assert default_global_batch(64, 8192) == 64        # Llama 3 8B on 8 nodes x 8
    assert default_global_batch(1024, 2048) == 4096    # GPT-3: 4 sequences per device
    assert default_global_batch(8, 131072) == 8        # longer than the rule: one each


def _batch_lines(out: str) -> list[str]:
    lines = out.splitlines()
    at = next(k for k, line in enumerate(lines) if line.startswith("batch "))
    return lines[at:at + 2]


def test_a_zoo_model_without_global_batch_plans_the_default(capsys) -> None:
    assert main(["plan", "tiny-gpt", *CPU2]) == 0
    first, second = _batch_lines(capsys.readouterr().out)
    assert first.startswith("batch     global 1024 = dp 2 x micro-batch ")
    assert second == ("          1,024 sequences x 16 tokens = 16,384 tokens per step "
                      "(autopar's default, 8,192 tokens per device x 2 devices; "
                      "--global-batch sets it)")


def test_a_global_batch_given_is_said_to_be_asked(capsys) -> None:
    assert main(["plan", "tiny-gpt", *CPU2, "--global-batch", "4"]) == 0
    out = capsys.readouterr().out
    assert _batch_lines(out)[1] == ("          4 sequences x 16 tokens = 64 tokens per step "
                                    "(as asked, --global-batch)")
    assert "is the batch of" not in out  # the old note, now said on the batch line


def test_the_api_names_the_example_inputs() -> None:
    model = GPT(GPTConfig(vocab_size=128, max_seq_len=16, dim=32, n_layers=2, n_heads=4))
    x = torch.randint(0, 128, (4, 16))
    p = autopar.plan(model, (x,), cluster=autopar.Cluster("cpu", 1, 1))
    assert p.batch_source == "the example inputs' batch; global_batch= sets it"
    assert "4 sequences x 16 tokens = 64 tokens per step (the example inputs' batch; " \
           "global_batch= sets it)" in p.summary()
    assert autopar.Plan.from_json(p.to_json()).batch_source == p.batch_source


def test_the_help_states_the_rule(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "8,192 tokens per device in whole sequences, at least one, times the devices" \
        in help_text
    assert "benchmarks/published_runs.json" in help_text
