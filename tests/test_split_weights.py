"""``split_weights``: tensor parallelism that splits every block matrix, as Megatron-LM's."""

import torch

import autopar
from autopar.examples.llama import Llama, LlamaConfig


def test_split_weights_splits_every_block_matrix_over_tp() -> None:
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=128, max_seq_len=16, dim=32, n_layers=2, n_heads=4,
                              n_kv_heads=2, ffn_dim=64))
    x = torch.randint(0, 128, (8, 16))
    cluster = autopar.Cluster("cpu", 1, 4)
    free = autopar.plan(model, (x,), cluster=cluster, dp=1, tp=4, precision="fp32")
    split = autopar.plan(model, (x,), cluster=cluster, dp=1, tp=4, precision="fp32",
                         split_weights=True)
    tp = [a for a in split.mesh if a != "pp"].index("tp")
    matrices = [f"{name}.weight" for name, mod in model.named_modules()
                if isinstance(mod, torch.nn.Linear) and name.startswith("layers.")]
    assert len(matrices) == 14
    assert {w: split.params[w][tp][:2] for w in matrices} == {w: "S(" for w in matrices}
    norms = [w for w in split.params if w.endswith("norm.weight")]
    assert norms and all(split.params[w][tp] == "R" for w in norms)  # vectors: solver's
    assert split.step_time_s >= free.step_time_s  # a narrower search never finds faster
