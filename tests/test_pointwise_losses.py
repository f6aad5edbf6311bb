"""Element-wise losses (mean-squared error, binary cross-entropy with logits, smooth L1) are
planned and run like cross-entropy: a model trained with one equals one process."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autopar.demo import sgd_losses
from tests.dist_utils import RankPool

LOSSES = {
    "mse": lambda out, y: F.mse_loss(out, y),
    "bce": lambda out, y: F.binary_cross_entropy_with_logits(out, (y > 0).float()),
    "smooth_l1": lambda out, y: F.smooth_l1_loss(out, y, beta=0.5),
}
LOSSES["l1_sum"] = lambda out, y: F.l1_loss(out, y, reduction="sum")
LOSSES["sum"] = lambda out, y: (out - y).square().sum()
CASES = [("mse", {"dp": 2}), ("bce", {"tp": 2}), ("smooth_l1", {"dp": 2, "zero": 3}),
         ("l1_sum", {"dp": 2, "microbatch_size": 2}), ("sum", {"dp": 2, "zero": 3})]
"""A summed loss (the last two) is the sum over ranks and micro-batches, not their mean."""
STEPS, LR = 3, 0.1


def _data() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    return model, x, y


def _single(loss: str) -> list[float]:
    model, x, y = _data()

    def step() -> torch.Tensor:
        out = LOSSES[loss](model(x), y)
        out.backward()
        return out.detach()

    return sgd_losses(model.parameters(), step, STEPS, LR)


def _parallel(cases: list[tuple[str, dict]]) -> list[list[float]]:
    import autopar

    out = []
    for loss, space in cases:
        model, x, y = _data()
        pm = autopar.parallelize(model, (x,), example_targets=y, loss_fn=LOSSES[loss],
                                 precision="fp32", **space)
        out.append(sgd_losses(pm.parameters(), lambda: pm.step(x, y), STEPS, LR))
    return out


@pytest.mark.multirank
def test_pointwise_losses_train_as_in_one_process(rank_pool: RankPool) -> None:
    results = rank_pool.run(2, _parallel, CASES, timeout_s=300)[0]
    for (loss, space), losses in zip(CASES, results):
        # fp32: 1e-5 absolute, or relative 1e-6 where a summed loss grows large
        assert losses == pytest.approx(_single(loss), abs=1e-5, rel=1e-6), (loss, space)


def test_unreduced_loss_keeps_the_batch_split() -> None:
    import autopar

    model, x, y = _data()
    plan = autopar.estimate(model, (x,), autopar.Spec(dp=2),
                            cluster=autopar.Cluster("cpu", 1, 2), precision="fp32",
                            example_targets=y,
                            loss_fn=lambda o, t: F.mse_loss(o, t, reduction="none").mean())
    assert plan.mesh["dp"] == 2 and plan.step_time_s > 0


SUM_LOSS_MODEL = '''\
import torch
import torch.nn.functional as F
from torch import nn


class Gain(nn.Module):
    """A parameter with no reset_parameters(): the program builds the model on the CPU."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(8))

    def forward(self, x):
        return x * self.w


def make():
    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8), Gain())
    return model, (torch.zeros(8, 8),)


def l1_sum(out, y):
    return F.l1_loss(out, y, reduction="sum")
'''


@pytest.mark.multirank
def test_emitted_program_keeps_a_summed_loss(tmp_path) -> None:
    """The program of a dp4 plan with two micro-batches per rank, trained with a loss
    that sums over the batch, prints the single process's losses."""
    import importlib.util

    import autopar
    from autopar.runtime.codegen import emit_program
    from tests.test_codegen import printed_losses, torchrun_output

    path = tmp_path / "summed.py"
    path.write_text(SUM_LOSS_MODEL)
    spec = importlib.util.spec_from_file_location("summed", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    torch.manual_seed(1)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    plan = autopar.estimate(mod.make()[0], (x,), autopar.Spec(dp=4, microbatch_size=1),
                            cluster=autopar.Cluster("cpu", 1, 4), precision="fp32",
                            loss_fn=mod.l1_sum, example_targets=y)
    assert (plan.loss_reduction, plan.num_microbatches) == ("sum", 2)
    torch.save({"inputs": x, "targets": y}, tmp_path / "batch.pt")
    program = tmp_path / "program.py"
    program.write_text(emit_program(plan, f"{path}:make", model_file=str(path),
                                    loss_spec=f"{path}:l1_sum"))
    out = torchrun_output(program, "--steps", str(STEPS), "--optimizer", "sgd", "--lr",
                          str(LR), "--seed", "7", "--data", str(tmp_path / "batch.pt"))
    torch.manual_seed(7)
    model = mod.make()[0]

    def step() -> torch.Tensor:
        loss = mod.l1_sum(model(x), y)
        loss.backward()
        return loss.detach()
    assert printed_losses(out) == pytest.approx(sgd_losses(model.parameters(), step, STEPS, LR),
                                                abs=1e-5, rel=1e-6)
