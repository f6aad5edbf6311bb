"""Targets and losses: a custom loss captures without example targets (int64 class
targets first, then float targets shaped like the output), ``example_targets`` reaches
capture from every entry point, and ``ParallelModel.step`` trains on the real targets."""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autopar
from autopar.api import _join_torchrun_job
from autopar.capture import capture
from autopar.cli import main as cli_main
from autopar.demo import sgd_losses
from autopar.examples import zoo
from tests.dist_utils import RankPool
from tests.foreign_models import NanoGPT, lm_loss

CPU2 = autopar.Cluster(gpu="cpu", gpus_per_node=2)
BATCH, SEQ, VOCAB, STEPS, LR = 8, 16, 128, 3, 0.1


def tokens(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of token ids and its targets."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
            torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))


def nanogpt() -> NanoGPT:
    """The same NanoGPT weights on every call."""
    torch.manual_seed(0)
    return NanoGPT(vocab_size=VOCAB, block_size=SEQ)


def target_inputs(g) -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, shape) of the graph's inputs after the example inputs: the targets."""
    return [(n.out.dtype, n.out.shape) for n in g.nodes if n.kind == "input"][1:]


def last_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the last position only: needs targets of shape (B,)."""
    return F.cross_entropy(logits[:, -1], targets)


def test_lm_loss_captures_with_class_targets():
    x, _ = tokens()
    g = capture(nanogpt(), (x,), loss_fn=lm_loss)
    assert target_inputs(g) == [("int64", (BATCH, SEQ))]


def test_plan_and_estimate_with_lm_loss_and_no_targets():
    x, _ = tokens()
    p = autopar.plan(nanogpt(), (x,), loss_fn=lm_loss, cluster=CPU2, precision="fp32")
    assert p.world_size == 2 and p.step_time_s > 0
    e = autopar.estimate(nanogpt(), (x,), autopar.Spec(dp=2), loss_fn=lm_loss, cluster=CPU2,
                         precision="fp32")
    assert e.mesh["dp"] == 2 and e.step_time_s > 0


def test_explicit_example_targets_reach_capture():
    x, y = tokens()
    onehot = F.one_hot(y, VOCAB).float()  # soft targets shaped like the logits

    def soft_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))

    g = capture(nanogpt(), (x,), loss_fn=soft_loss, example_targets=onehot)
    assert target_inputs(g) == [("float32", (BATCH, SEQ, VOCAB))]
    p = autopar.plan(nanogpt(), (x,), loss_fn=lm_loss, example_targets=y, cluster=CPU2,
                     precision="fp32")
    e = autopar.estimate(nanogpt(), (x,), autopar.Spec(dp=2), loss_fn=lm_loss,
                         example_targets=y, cluster=CPU2, precision="fp32")
    c = autopar.compare(nanogpt(), (x,), autopar.Spec(dp=2), loss_fn=last_token_loss,
                        example_targets=y[:, 0], cluster=CPU2, precision="fp32")
    assert p.step_time_s > 0 and e.step_time_s > 0 and c.handwritten is not None


@pytest.mark.parametrize("outputs", [3, 1])
def test_a_loss_on_float_targets_still_captures(outputs: int):
    """MSE needs targets shaped like the output; with (B, 1) outputs class targets of
    shape (B,) would broadcast to (B, B) silently, and are refused."""
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, outputs))
    g = capture(mlp, (torch.randn(BATCH, 16),), loss_fn=F.mse_loss)
    assert target_inputs(g) == [("float32", (BATCH, outputs))]


def span_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """A loss on the first two positions: needs int64 targets of shape (B, 2)."""
    if targets.shape != (logits.shape[0], 2):
        raise ValueError(f"span targets must be (batch, 2), got {tuple(targets.shape)}")
    return F.cross_entropy(logits[:, :2].transpose(1, 2), targets)


def test_an_impossible_loss_says_to_pass_example_targets():
    x, y = tokens()
    with pytest.raises(autopar.CaptureError) as err:
        autopar.plan(nanogpt(), (x,), loss_fn=span_loss, cluster=CPU2, precision="fp32")
    assert str(err.value) == (
        "cannot capture the loss function without example targets: with int64 class targets "
        "of shape (8, 16) it raised ValueError: span targets must be (batch, 2), got (8, 16); "
        "with float targets shaped like the output of shape (8, 16, 128) it raised "
        "ValueError: span targets must be (batch, 2), got (8, 16, 128). Hint: pass "
        "example_targets, one global batch of the targets loss_fn takes (e.g. "
        "example_targets=targets beside example_inputs)")
    p = autopar.plan(nanogpt(), (x,), loss_fn=span_loss, example_targets=y[:, :2],
                     cluster=CPU2, precision="fp32")
    assert p.step_time_s > 0


@pytest.mark.parametrize("targets, got", [
    (torch.zeros(4, SEQ, dtype=torch.long), "a tensor of shape (4, 16)"),
    ([0] * BATCH, "list"),
])
def test_example_targets_are_checked(targets, got: str):
    x, _ = tokens()
    with pytest.raises(autopar.CaptureError) as err:
        autopar.plan(nanogpt(), (x,), loss_fn=lm_loss, example_targets=targets, cluster=CPU2)
    assert str(err.value) == (
        f"example_targets must be a tensor whose dim 0 is the batch of example_inputs "
        f"(8 samples), got {got}; pass the targets of the same example batch, as "
        f"loss_fn(output, targets) takes them")


def test_a_factory_may_return_targets(tmp_path: Path, capsys):
    path = tmp_path / "model.py"
    path.write_text(textwrap.dedent(f"""
        import torch
        from tests.foreign_models import NanoGPT

        def build():
            x = torch.randint(0, 128, ({BATCH}, {SEQ}))
            return NanoGPT(), (x,), x.roll(-1, 1)

        def broken():
            return NanoGPT(), (torch.zeros(2, 4, dtype=torch.long),), "targets"
        """))
    model, inputs, targets = zoo.load_with_targets(f"{path}:build")
    assert targets.shape == (BATCH, SEQ) and zoo.load(f"{path}:build")[1][0].shape == (BATCH, SEQ)
    assert cli_main(["plan", f"{path}:build", "--gpu", "cpu", "--gpus-per-node", "2",
                     "--precision", "fp32"]) == 0
    assert "dp=" in capsys.readouterr().out
    with pytest.raises(autopar.ConfigError, match=r"\(model, example_inputs, example_targets\)"):
        zoo.load_with_targets(f"{path}:broken")


def test_parallelize_outside_torchrun_says_how_to_start(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(autopar.ConfigError) as err:
        _join_torchrun_job()
    assert str(err.value) == (
        "parallelize() must run inside a distributed job, but no process group exists and "
        "RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT are not set: start the script with "
        "torchrun (e.g. torchrun --nproc-per-node 4 train.py), or call "
        "torch.distributed.init_process_group first")


def lm_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Callable[[], torch.Tensor]:
    """One single-process forward and backward with ``lm_loss``."""
    def step() -> torch.Tensor:
        loss = lm_loss(model(x), y)
        loss.backward()
        return loss.detach()
    return step


def parallel_lm_losses(space: dict) -> tuple[list[float], dict[str, int], str]:
    """NanoGPT with ``lm_loss`` and no example targets, parallelized and trained; and
    the error every rank gets when rank 0 cannot plan."""
    x, y = tokens()
    try:
        autopar.parallelize(nanogpt(), (x,), loss_fn=span_loss, precision="fp32", **space)
        error = ""
    except autopar.CaptureError as e:
        error = str(e)
    pm = autopar.parallelize(nanogpt(), (x,), loss_fn=lm_loss, precision="fp32", **space)
    return sgd_losses(pm.parameters(), lambda: pm.step(x, y), STEPS, LR), pm.plan.mesh, error


@pytest.mark.multirank
def test_lm_loss_under_data_parallelism_matches_single_process(rank_pool: RankPool):
    model = nanogpt()
    x, y = tokens()
    ref = sgd_losses(model.parameters(), lm_step(model, x, y), STEPS, LR)
    ranks = rank_pool.run(2, parallel_lm_losses, {"dp": 2, "tp": 1, "zero": 0}, timeout_s=300)
    for losses, mesh, error in ranks:
        assert mesh == {"dp": 2, "tp": 1}
        assert losses == pytest.approx(ref, abs=1e-5)
        assert error.startswith("cannot capture the loss function without example targets")
