"""``autopar demo``: a small GPT trained on local CPU processes under its plan, beside a
single-process run of the same model and data."""

from __future__ import annotations

import torch

from typing import Callable, Iterable

from autopar.capture import default_loss, first_tensor

CONFIG = dict(vocab_size=128, max_seq_len=32, dim=64, n_layers=2, n_heads=4)
BATCH, SEQ, LR = 8, 32, 0.1


def _model():
    from autopar.examples.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(**CONFIG))


def _data():
    g = torch.Generator().manual_seed(1)
    return (torch.randint(0, 128, (BATCH, SEQ), generator=g),
            torch.randint(0, 128, (BATCH, SEQ), generator=g))


def sgd_losses(params: Iterable[torch.Tensor], step: Callable[[], torch.Tensor], steps: int,
               lr: float) -> list[float]:
    """The losses of ``steps`` plain SGD steps; ``step()`` runs one forward and backward
    and returns the loss (``ParallelModel.step`` or :func:`reference_step`)."""
    opt = torch.optim.SGD(params, lr=lr)
    out = []
    for _ in range(steps):
        out.append(float(step()))
        opt.step()
        opt.zero_grad()
    return out


def reference_step(model: torch.nn.Module, inputs: torch.Tensor | tuple[torch.Tensor, ...],
                   targets: torch.Tensor) -> Callable[[], torch.Tensor]:
    """One single-process forward and backward with the default loss (the loss a
    ParallelModel computes), as a step function for :func:`sgd_losses`; ``inputs`` a
    tensor or a tuple of the model's positional inputs, as ``ParallelModel.step`` takes."""
    xs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)

    def step() -> torch.Tensor:
        loss = default_loss(first_tensor(model(*xs)), targets)
        loss.backward()
        return loss.detach()
    return step


def _single(steps: int) -> list[float]:
    model, (x, y) = _model(), _data()
    return sgd_losses(model.parameters(), reference_step(model, x, y), steps, LR)


def _parallel(steps: int):
    import autopar

    (x, y) = _data()
    pm = autopar.parallelize(_model(), (x,), precision="fp32")
    return sgd_losses(pm.parameters(), lambda: pm.step(x, y), steps, LR), pm.plan.summary()


def run_demo(ranks: int = 4, steps: int = 3) -> None:
    """Print the plan and both loss curves."""
    from autopar.launch import run_distributed

    par, summary = run_distributed(ranks, _parallel, steps, timeout_s=600)[0]
    ref = _single(steps)
    print(summary)
    print(f"\n{'step':>4}  {'parallel loss':>14}  {'single-process':>14}  {'|diff|':>8}")
    for i, (a, b) in enumerate(zip(par, ref)):
        print(f"{i:>4}  {a:14.6f}  {b:14.6f}  {abs(a - b):8.1e}")
