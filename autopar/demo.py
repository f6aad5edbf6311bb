"""``autopar demo``: a small GPT trained on local CPU processes under its plan, beside a
single-process run of the same model and data."""

from __future__ import annotations

import torch

from autopar.capture import default_loss

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


def _single(steps: int) -> list[float]:
    model, (x, y) = _model(), _data()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out = []
    for _ in range(steps):
        loss = default_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def _parallel(steps: int):
    import autopar

    (x, y) = _data()
    pm = autopar.parallelize(_model(), (x,), precision="fp32")
    opt = torch.optim.SGD(pm.parameters(), lr=LR)
    out = []
    for _ in range(steps):
        out.append(float(pm.step(x, y)))
        opt.step()
        opt.zero_grad()
    return out, pm.plan.summary()


def run_demo(ranks: int = 4, steps: int = 3) -> None:
    """Print the plan and both loss curves."""
    from autopar.launch import run_distributed

    par, summary = run_distributed(ranks, _parallel, steps, timeout_s=600)[0]
    ref = _single(steps)
    print(summary)
    print(f"\n{'step':>4}  {'parallel loss':>14}  {'single-process':>14}  {'|diff|':>8}")
    for i, (a, b) in enumerate(zip(par, ref)):
        print(f"{i:>4}  {a:14.6f}  {b:14.6f}  {abs(a - b):8.1e}")
