"""Capture with a batch of one: the batch dim must survive reshapes that merge it with
unit dims, so a plan can still split the batch."""

import torch

import autopar
from autopar.capture import capture
from autopar.examples.llama import Llama, LlamaConfig


def test_batch_of_one_keeps_the_batch_split() -> None:
    with torch.device("meta"):
        model = Llama(LlamaConfig(vocab_size=128, max_seq_len=16, dim=32, n_layers=2,
                                  n_heads=4, n_kv_heads=2, ffn_dim=64))
    x = torch.randint(0, 128, (1, 16), device="meta")
    g = capture(model, (x,))
    assert g.batch_size == 2  # captured as a batch of two
    plan = autopar.plan(model, (x,), cluster=autopar.Cluster("cpu", 1, 4), global_batch=4,
                        dp=4, tp=1, precision="fp32")
    assert plan.mesh == {"dp": 4, "tp": 1} and plan.microbatch_size == 1
