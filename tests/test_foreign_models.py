"""Models written independently of autopar, with their own loss, train under every kind
of parallelism exactly as in one process (fp32, gloo, 3 SGD steps), in the runtime and
in the emitted program. See tests/foreign_models.py for how they are written."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from autopar.demo import sgd_losses
from tests.dist_utils import RankPool
from tests.foreign_models import example_batch, lm_loss, nano_gpt, tiny_llama
from tests.test_batch_flow import EncoderLM


def encoder(batch_first: bool):
    """A factory of PyTorch's own nn.TransformerEncoder language model."""
    def make() -> tuple[torch.nn.Module, tuple[torch.Tensor], torch.Tensor]:
        x, y = example_batch()
        return EncoderLM(batch_first), (x,), y
    return make


FACTORIES = {"nano": nano_gpt, "llama": tiny_llama, "encoder": encoder(False),
             "encoder_bf": encoder(True)}
MODELS_FILE = Path(__file__).with_name("foreign_models.py")
STEPS, LR = 3, 0.1

CASES = [  # (model, search space forced on the planner)
    ("nano", {}),
    ("nano", {"dp": 1, "tp": 4}),
    ("nano", {"dp": 2, "tp": 2, "sequence_parallel": True, "zero": 3}),
    ("nano", {"dp": 4, "zero": 3, "recompute": "selective"}),
    ("nano", {"dp": 2, "tp": 2, "recompute": "full"}),
    ("llama", {}),
    ("llama", {"dp": 1, "tp": 4}),  # 2 key/value heads over 4 ranks
    ("llama", {"dp": 2, "tp": 2, "sequence_parallel": True, "recompute": "selective"}),
    ("llama", {"dp": 2, "tp": 2, "zero": 3}),
    ("encoder", {"dp": 2, "tp": 2}),  # sequence-first nn.MultiheadAttention
    ("encoder_bf", {"dp": 1, "tp": 4, "sequence_parallel": True}),
    ("encoder", {"pp": 2, "dp": 2}),  # stages cut from nn.TransformerEncoder's export
    ("encoder_bf", {"pp": 2, "dp": 1, "tp": 2}),
]


def single_process(kind: str, seed: int = 0) -> list[float]:
    """The reference: the model built under ``seed`` and trained alone with its own loss."""
    torch.manual_seed(seed)
    model, (x,), y = FACTORIES[kind]()

    def step() -> torch.Tensor:
        loss = lm_loss(model(x), y)
        loss.backward()
        return loss.detach()

    return sgd_losses(model.parameters(), step, STEPS, LR)


def parallel(cases: list[tuple[str, dict]]) -> list[tuple[list[float], dict]]:
    """Each case planned, laid out and trained on this group's ranks."""
    import autopar

    out = []
    for kind, space in cases:
        torch.manual_seed(0)
        model, (x,), y = FACTORIES[kind]()
        pm = autopar.parallelize(model, (x,), example_targets=y, loss_fn=lm_loss,
                                 precision="fp32", **space)
        losses = sgd_losses(pm.parameters(), lambda: pm.step(x, y), STEPS, LR)
        out.append((losses, {"mesh": pm.plan.mesh, "zero": pm.plan.zero,
                             "sp": pm.plan.sequence_parallel,
                             "recompute": sorted(set(pm.plan.recompute.values()))}))
    return out


@pytest.mark.multirank
def test_foreign_models_train_as_in_one_process(rank_pool: RankPool) -> None:
    refs = {kind: single_process(kind) for kind in FACTORIES}
    results = rank_pool.run(4, parallel, CASES, timeout_s=900)[0]
    for (kind, space), (losses, info) in zip(CASES, results):
        assert losses == pytest.approx(refs[kind], abs=1e-5), (kind, space, info)
        for axis in ("dp", "tp", "pp"):
            if axis in space:
                assert info["mesh"].get(axis, 1) == space[axis], (kind, space, info)
        if space.get("sequence_parallel"):
            assert info["sp"], (kind, space, info)
        if "recompute" in space:
            assert space["recompute"] in info["recompute"], (kind, space, info)


PROGRAM_CASES = [  # (model, search space): the emitted program of each plan
    ("nano", {"dp": 2, "tp": 2, "sequence_parallel": True, "zero": 3, "recompute": "selective"}),
    # TinyLlama's hand-written RMSNorm has no reset_parameters(): it could not start on meta
    ("llama", {"dp": 2, "tp": 2, "sequence_parallel": True, "zero": 3}),
    ("llama", {"pp": 2, "dp": 2}),
]
SEED = 3


def make_plan(kind: str, space: dict):
    """The plan for 4 CPU processes, captured with the model's own loss."""
    import autopar

    model, (x,), y = FACTORIES[kind]()
    return autopar.plan(model, (x,), cluster=autopar.Cluster(gpu="cpu", gpus_per_node=4),
                        example_targets=y, loss_fn=lm_loss, precision="fp32", **space)


@pytest.mark.multirank
@pytest.mark.slow
def test_emitted_programs_train_as_one_process(tmp_path: Path) -> None:
    """Each program builds the factory's model on the CPU under its seed and prints the
    single process's losses, from the first, whatever the model's modules can do on meta.
    (The programs share one torchrun job, each in processes of its own.)"""
    from autopar.runtime.codegen import emit_program
    from tests.test_codegen import printed_losses, torchrun_outputs

    x, y = example_batch()
    data = tmp_path / "batch.pt"
    torch.save({"inputs": x, "targets": y}, data)
    runs = []
    for i, (kind, space) in enumerate(PROGRAM_CASES):
        program = tmp_path / f"{kind}{i}.py"
        program.write_text(emit_program(
            make_plan(kind, space), f"{MODELS_FILE}:{FACTORIES[kind].__name__}",
            model_file=str(MODELS_FILE), loss_spec=f"{MODELS_FILE}:lm_loss"))
        runs.append((program, ["--steps", str(STEPS), "--optimizer", "sgd", "--lr", str(LR),
                               "--seed", str(SEED), "--data", str(data)]))
    outs = torchrun_outputs(runs, tmp_path / "runs")
    for (kind, space), out in zip(PROGRAM_CASES, outs):
        assert printed_losses(out) == pytest.approx(single_process(kind, SEED), abs=1e-5), \
            (kind, space)
        assert "starts on meta" not in out, (kind, space, out[:500])
