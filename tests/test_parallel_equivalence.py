"""Losses of parallel runs equal a single-process run (3 SGD steps, fp32, gloo)."""

import pytest
import torch

from autopar.demo import reference_step, sgd_losses
from tests.dist_utils import RankPool

TINY = {
    "gpt": dict(vocab_size=128, max_seq_len=16, dim=32, n_layers=2, n_heads=4),
    "llama": dict(vocab_size=128, max_seq_len=16, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                  ffn_dim=64),
}
BATCH, SEQ, STEPS, LR = 8, 16, 3, 0.1


def make(kind: str):
    torch.manual_seed(0)
    if kind == "gpt":
        from autopar.examples.gpt import GPT, GPTConfig
        return GPT(GPTConfig(**TINY[kind]))
    from autopar.examples.llama import Llama, LlamaConfig
    return Llama(LlamaConfig(**TINY[kind]))


def data():
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 128, (BATCH, SEQ), generator=g)
    y = torch.randint(0, 128, (BATCH, SEQ), generator=g)
    return x, y


def reference(kind: str) -> list[float]:
    model = make(kind)
    x, y = data()
    return sgd_losses(model.parameters(), reference_step(model, x, y), STEPS, LR)


def parallel_run(kind: str, space: dict) -> tuple[list[float], dict]:
    import autopar
    model = make(kind)
    x, y = data()
    pm = autopar.parallelize(model, (x,), precision="fp32", **space)
    losses = sgd_losses(pm.parameters(), lambda: pm.step(x, y), STEPS, LR)
    pipe = pm.plan.pipeline
    axes = [a for a in pm.plan.mesh if a != "pp"]
    weights = [f"{name}.weight" for name, mod in make(kind).named_modules()
               if isinstance(mod, torch.nn.Linear) and name.startswith(("blocks.", "layers."))]
    tp_split = sum(1 for w in weights if "tp" in axes
                   and pm.plan.params[w][axes.index("tp")].startswith("S("))
    return losses, {"mesh": pm.plan.mesh, "zero": pm.plan.zero,
                    "sp": pm.plan.sequence_parallel, "mb": pm.plan.num_microbatches,
                    "schedule": pipe.schedule if pipe else None, "tp_split": tp_split}


def run_many(kind: str, cases: list[dict]):
    return [parallel_run(kind, c) for c in cases]


CASES_4 = [
    {},                                            # auto-chosen plan
    {"dp": 4, "tp": 1, "zero": 0},
    {"dp": 1, "tp": 4, "split_weights": True},
    {"dp": 2, "tp": 2, "zero": 0, "split_weights": True},
    {"dp": 4, "tp": 1, "zero": 3},
    {"dp": 2, "tp": 2, "zero": 3, "split_weights": True},
    {"dp": 2, "tp": 2, "sequence_parallel": True, "zero": 0, "split_weights": True},
    {"dp": 4, "tp": 1, "zero": 0, "microbatch_size": 1},
]


@pytest.mark.multirank
@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_four_ranks_match_single_process(rank_pool: RankPool, kind):
    ref = reference(kind)
    results = rank_pool.run(4, run_many, kind, CASES_4, timeout_s=600)[0]
    for case, (losses, info) in zip(CASES_4, results):
        assert losses == pytest.approx(ref, abs=1e-5), (case, info, losses, ref)
    # the forced layouts really were applied: the tp cases split the blocks' weights
    assert results[2][1]["mesh"] == {"dp": 1, "tp": 4}
    per_block = {"gpt": 6, "llama": 7}[kind]  # q, k, v, proj, fc1, fc2 / wq-wo, w1-w3
    for i in (2, 3, 5, 6):
        assert results[i][1]["tp_split"] == 2 * per_block, (CASES_4[i], results[i][1])
    assert results[4][1]["zero"] == 3
    assert results[6][1]["sp"] is True
    assert results[7][1]["mb"] == 2


@pytest.mark.multirank
@pytest.mark.parametrize("world", [1, 2])
def test_one_and_two_ranks_match_single_process(rank_pool: RankPool, world):
    ref = reference("gpt")
    cases = [{}, {"dp": 1, "tp": world}, {"dp": world, "tp": 1, "zero": 3 if world > 1 else 0}]
    results = rank_pool.run(world, run_many, "gpt", cases, timeout_s=600)[0]
    for case, (losses, _) in zip(cases, results):
        assert losses == pytest.approx(ref, abs=1e-5), (case, losses, ref)


PIPELINES_4 = [
    {"pp": 2, "dp": 2, "tp": 1},
    {"pp": 2, "tp": 2},
    {"pp": 4, "microbatch_size": 2},
    {"pp": 2, "dp": 2, "schedule": "interleaved_1f1b"},
]


@pytest.mark.multirank
@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_planned_pipelines_match_single_process(rank_pool: RankPool, kind):
    """Plans the solver made with pipelining, run by autopar.parallelize."""
    ref = reference(kind)
    results = rank_pool.run(4, run_many, kind, PIPELINES_4, timeout_s=600)[0]
    for case, (losses, info) in zip(PIPELINES_4, results):
        assert losses == pytest.approx(ref, abs=1e-5), (case, info, losses, ref)
        assert info["mesh"]["pp"] == case["pp"] and info["schedule"] is not None
    assert results[3][1]["schedule"] == "interleaved_1f1b"
