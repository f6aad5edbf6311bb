"""The job of test_checkpoints' fault test, run under ``torchrun --max-restarts 1``
on 4 ranks: 10 AdamW steps of the float64 Llama under dp2 x tp2, checkpointed after
every step by :class:`autopar.Checkpointer` (keep 2, asynchronous writes) and resumed
from its last complete checkpoint. On the first attempt rank 1 kills itself
(SIGKILL) at step 5, before that step's save. Rank 0 prints ``step N loss L`` per
step and ``resumed from S``, and writes the final full parameters to ``OUT``.

Usage: fault_job.py ROOT OUT
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import autopar  # noqa: E402
from tests import foreign_models  # noqa: E402
from tests.handmade_plans import megatron_plan  # noqa: E402
from tests.test_checkpoints import LR, make  # noqa: E402

STEPS, KILL_AT, KILLED_RANK = 10, 5, 1


def main(root: str, out: str) -> None:
    """Train, checkpoint, get killed once, resume."""
    x, y = foreign_models.example_batch()
    pm = autopar.parallelize(make("llama"), plan=megatron_plan(make("llama"), dp=2, tp=2))
    opt = torch.optim.AdamW(pm.parameters(), lr=LR)
    ckpt = autopar.Checkpointer(root, pm, opt, every=1, keep=2, async_save=True)
    resumed = ckpt.resume()
    first = resumed.step if resumed is not None else 0
    rank, attempt = dist.get_rank(), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if rank == 0:
        print(f"attempt {attempt} resumed from {first}", flush=True)
    for step in range(first + 1, STEPS + 1):
        loss = float(pm.step(x, y))
        opt.step()
        opt.zero_grad()
        if rank == 0:
            print(f"step {step} loss {loss!r}", flush=True)
        if step == KILL_AT and attempt == 0 and rank == KILLED_RANK:
            os.kill(os.getpid(), signal.SIGKILL)
        ckpt.step(step)
    ckpt.close()
    params = {n: p.full_tensor() for n, p in pm.module.named_parameters()}
    if rank == 0:
        torch.save(params, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
