"""The global batch ``autopar plan`` and ``autopar compare`` give a zoo language model
when ``--global-batch`` is left out, and the words that say where a plan's batch came
from (:attr:`autopar.Plan.batch_source`).

The rule: :data:`TOKENS_PER_DEVICE` tokens per device per optimizer step, in whole
sequences of the model's length (at least one per device), times the devices of the
cluster. Its source is benchmarks/published_runs.json: the 47 published multi-GPU
runs there that state a global batch, a sequence length and a GPU count train with
1,024 to 262,144 tokens per GPU per step, half of them with 4,096 to 32,768 (median
12,288); 8,192 is one whole sequence per GPU at Llama 3's training length (the zoo's
``llama3-*`` entries). Imports no torch.
"""

from __future__ import annotations

TOKENS_PER_DEVICE = 8192
"""Tokens per device per optimizer step of the default global batch (module docstring)."""

def default_global_batch(devices: int, seq_len: int) -> int:
    """Sequences per optimizer step under the default rule: ``devices`` x
    max(1, TOKENS_PER_DEVICE // ``seq_len``) (``autopar plan llama3-8b --nodes 8``:
    64 devices x 1 sequence of 8,192 tokens = 64; GPT-3 at 2,048 tokens: 4 per device)."""
    if devices < 1 or seq_len < 1:
        raise ValueError(f"devices={devices}, seq_len={seq_len}: expected positive integers")
    return devices * max(1, TOKENS_PER_DEVICE // seq_len)


def default_source(devices: int, seq_len: int, option: str = "--global-batch") -> str:
    """The words for a batch set by :func:`default_global_batch`: "autopar's default,
    8,192 tokens per device x 64 devices; --global-batch sets it"."""
    per = max(1, TOKENS_PER_DEVICE // seq_len)
    return (f"autopar's default, {per * seq_len:,} tokens per device x {devices:,} "
            f"devices; {option} sets it")


def example_source(option: str) -> str:
    """The words for a batch taken from the example inputs: "the example inputs' batch;
    --global-batch sets it"."""
    return f"the example inputs' batch; {option} sets it"


def asked_source(option: str) -> str:
    """The words for a batch the user gave: "as asked, --global-batch"."""
    return f"as asked, {option}"
