"""docs/tutorial.md's script: a Hugging Face Llama built from a config (no download),
planned by autopar for 4 CPU processes and trained in a plain PyTorch loop.

    python docs/examples/hf_tutorial.py --plan-only --pp 1 --tp 2      # print the plan
    torchrun --nproc-per-node 4 docs/examples/hf_tutorial.py --pp 1 --tp 2 --checkpoint-dir ckpt

Each rank loads its own data-parallel shard (``pm.data_shard()``), runs ``pm(x)`` and
``loss.backward()`` (or, under a pipelined plan, ``pm.step(x, y, local=True)``), and
``autopar.Checkpointer`` saves every ``--checkpoint-every`` steps and resumes from the
last complete checkpoint when the job starts again.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import autopar

VOCAB, SEQ, GLOBAL_BATCH, SAMPLES = 256, 32, 16, 512


def build_model() -> torch.nn.Module:
    """A 2-block Llama (grouped-query attention: 8 query heads, 4 key/value heads) with
    random weights."""
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=512, num_attention_heads=8,
                                   num_key_value_heads=4, intermediate_size=1024,
                                   vocab_size=VOCAB, max_position_embeddings=SEQ,
                                   bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.LlamaForCausalLM(cfg)


def dataset() -> TensorDataset:
    """Arithmetic sequences of token ids (start and stride random, mod VOCAB), each
    paired with its next-token targets: a pattern a small model learns in a few steps."""
    g = torch.Generator().manual_seed(0)
    start = torch.randint(0, VOCAB, (SAMPLES, 1), generator=g)
    stride = torch.randint(1, 8, (SAMPLES, 1), generator=g)
    tokens = (start + stride * torch.arange(SEQ + 1)) % VOCAB
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def my_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over this rank's samples."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def logits_loss(output, targets: torch.Tensor) -> torch.Tensor:
    """``my_loss`` on the logits of a Hugging Face output (a pipelined step calls this)."""
    return my_loss(output.logits if hasattr(output, "logits") else output, targets)


def example_batch() -> tuple[torch.Tensor]:
    """One global batch of inputs: what autopar captures and plans for."""
    return (dataset().tensors[0][:GLOBAL_BATCH],)


def plan_only(space: dict[str, int]) -> None:
    """Plan for 1 node of 4 CPU processes, without starting them, and print the plan."""
    torch.manual_seed(0)
    plan = autopar.plan(build_model(), example_batch(), cluster=autopar.Cluster("cpu", 1, 4),
                        precision="fp32", **space)
    print(plan.summary())


def train(steps: int, lr: float, space: dict[str, int], checkpoint_dir: str | None,
          checkpoint_every: int) -> None:
    """The per-rank loop; run under ``torchrun --nproc-per-node 4``."""
    torch.manual_seed(0)  # every rank builds the same weights
    pm = autopar.parallelize(build_model(), example_batch(), precision="fp32",
                             loss_fn=logits_loss, **space)
    rank = dist.get_rank()
    if rank == 0:
        print("mesh", " x ".join(f"{a}={n}" for a, n in pm.plan.mesh.items()), flush=True)
    opt = torch.optim.AdamW(pm.parameters(), lr=lr)
    ckpt = autopar.Checkpointer(checkpoint_dir, pm, opt, every=checkpoint_every) \
        if checkpoint_dir else None
    resumed = ckpt.resume() if ckpt else None
    first = resumed.step + 1 if resumed else 1
    if rank == 0 and resumed:
        print(f"resumed from step {resumed.step}", flush=True)

    data = dataset()
    shard = pm.data_shard()  # which samples of every global batch this rank trains on
    sampler = DistributedSampler(data, shuffle=True, seed=0, drop_last=True,
                                 **shard.sampler_kwargs())
    loader = DataLoader(data, batch_size=shard.batch_size, sampler=sampler, drop_last=True)
    per_epoch = len(loader)

    def batches(after: int):
        """This rank's batches from step ``after + 1`` on, epoch after epoch."""
        for epoch in itertools.count(after // per_epoch):
            sampler.set_epoch(epoch)
            skip = after - epoch * per_epoch if epoch == after // per_epoch else 0
            yield from itertools.islice(loader, skip, None)

    for step, (x, y) in zip(range(first, steps + 1), batches(first - 1)):
        if pm.pipeline is None:
            loss = my_loss(pm(x).logits, y)  # the mean over this rank's shard
            loss.backward()                  # gradients reduced over dp as the plan says
            mean = loss.detach().clone()
            dist.all_reduce(mean, group=pm.mesh.get_group("dp"))
            mean /= shard.count              # the global batch's mean loss
        else:
            mean = pm.step(x, y, local=True)  # a pipeline runs its schedule; global mean
        opt.step()
        opt.zero_grad()
        if rank == 0:
            print(f"step {step}: loss {mean.item():.4f}", flush=True)
        if ckpt:
            ckpt.step(step)
    if ckpt:
        ckpt.close()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description="Plan a small Hugging Face Llama for 4 CPU "
                                 "processes, or train it under torchrun (docs/tutorial.md).")
    ap.add_argument("--plan-only", action="store_true",
                    help="print the plan for 4 CPU processes and exit (no torchrun)")
    ap.add_argument("--steps", type=int, default=20, help="train up to this step (default 20)")
    ap.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    ap.add_argument("--pp", type=int, default=None,
                    help="pipeline degree (default: the planner's choice)")
    ap.add_argument("--tp", type=int, default=None,
                    help="tensor-parallel degree (default: the planner's choice)")
    ap.add_argument("--checkpoint-dir", default=None,
                    help="save and resume here (default: no checkpoints)")
    ap.add_argument("--checkpoint-every", type=int, default=10,
                    help="save every this many steps (default 10)")
    args = ap.parse_args()
    space = {k: v for k, v in (("pp", args.pp), ("tp", args.tp)) if v is not None}
    if args.plan_only:
        plan_only(space)
    else:
        train(args.steps, args.lr, space, args.checkpoint_dir, args.checkpoint_every)


if __name__ == "__main__":
    main()
