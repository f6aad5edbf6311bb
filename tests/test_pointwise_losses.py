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
CASES = [("mse", {"dp": 2}), ("bce", {"tp": 2}), ("smooth_l1", {"dp": 2, "zero": 3})]
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
        assert losses == pytest.approx(_single(loss), abs=1e-5), (loss, space)


def test_unreduced_loss_keeps_the_batch_split() -> None:
    import autopar

    model, x, y = _data()
    plan = autopar.estimate(model, (x,), autopar.Spec(dp=2),
                            cluster=autopar.Cluster("cpu", 1, 2), precision="fp32",
                            example_targets=y,
                            loss_fn=lambda o, t: F.mse_loss(o, t, reduction="none").mean())
    assert plan.mesh["dp"] == 2 and plan.step_time_s > 0
