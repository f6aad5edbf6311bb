"""What ``autopar train`` runs on each rank (:mod:`autopar.cli_train` is its command
line): plan the model for the job, then train it on your text (or a token tensor, or
the built-in arithmetic text), each rank reading its own shard, logging loss,
tokens/s, MFU and memory per step and checkpointing every k steps, as torchtitan's
trainer does."""

from __future__ import annotations

import logging
import os
import random
import resource
import sys
import time
from pathlib import Path

import torch

from autopar.train_args import TrainArgs
from autopar.errors import ConfigError
from autopar.units_text import fmt_bytes

__all__ = ["builtin_text", "load_tokens", "shard_batch", "build", "train", "memory_text",
           "cpu_memory_note"]


def builtin_text(chars: int = 200_000, seed: int = 0) -> str:
    """The built-in data set: lines of small sums (``"17 + 5 = 22"``), ASCII, made
    from ``seed`` (the same on every rank). A model can learn them, so its loss falls
    for a reason other than memorizing one batch."""
    rng = random.Random(seed)
    lines: list[str] = []
    size = 0
    while size < chars:
        a, b = rng.randrange(100), rng.randrange(100)
        line = f"{a} + {b} = {a + b}\n"
        lines.append(line)
        size += len(line)
    return "".join(lines)


def load_tokens(data: str, vocab_size: int) -> torch.Tensor:
    """The training tokens (1-D int64): ``builtin`` (:func:`builtin_text`, bytes), a
    text file (its bytes), or a ``.pt`` file holding a 1-D integer tensor (or a dict
    with one under ``"tokens"``). Token ids must be below ``vocab_size``."""
    if data == "builtin":
        tokens = torch.tensor(list(builtin_text().encode("ascii")), dtype=torch.long)
    else:
        path = Path(data)
        if not path.is_file():
            raise ConfigError(f"--data {data}: no such file; give a text file, a .pt file of "
                              "token ids, or 'builtin'")
        if path.suffix == ".pt":
            try:
                held = torch.load(path, weights_only=True)
            except Exception as e:  # noqa: BLE001 — torch.load raises many types
                raise ConfigError(f"--data {data}: not a torch.save'd tensor ({e})") from None
            tokens = held.get("tokens") if isinstance(held, dict) else held
            if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1 or \
                    tokens.is_floating_point():
                raise ConfigError(f"--data {data}: expected a 1-D tensor of integer token ids "
                                  "(or a dict with one under 'tokens')")
            tokens = tokens.long()
        else:
            tokens = torch.tensor(list(path.read_bytes()), dtype=torch.long)
    top = int(tokens.max()) if tokens.numel() else 0
    if top >= vocab_size:
        raise ConfigError(f"--data {data}: token id {top} is not below the model's vocabulary "
                          f"of {vocab_size}; text is read as bytes, so use a model with at "
                          "least 256 tokens (128 for ASCII text), or a .pt file of ids")
    return tokens


def shard_batch(tokens: torch.Tensor, step: int, global_batch: int, seq_len: int,
                index: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets of shard ``index`` of ``count`` of step ``step``'s
    global batch: sample i of step s starts at ``(s * global_batch + i) * seq_len``
    (wrapping), so every step reads new text and the shards never overlap."""
    span = tokens.numel() - seq_len - 1
    if span < 1:
        raise ConfigError(f"the data has {tokens.numel()} tokens, fewer than one sequence of "
                          f"{seq_len} + 1")
    per = global_batch // count
    starts = [((step * global_batch + i) * seq_len) % span
              for i in range(index * per, (index + 1) * per)]
    rows = torch.stack([tokens[s:s + seq_len + 1] for s in starts])
    return rows[:, :-1], rows[:, 1:]


def build(args: TrainArgs, device: str = "cpu") -> tuple[torch.nn.Module, int, int]:
    """The model (built on ``device`` from ``args.seed``), its vocabulary and sequence
    length; ConfigError for a model that does not take token ids."""
    from autopar.examples import zoo

    torch.manual_seed(args.seed)
    if ":" in args.model and args.model.split(":")[0].endswith(".py"):
        with torch.device(device):
            model, (x,), _ = zoo.load_with_targets(args.model)
    elif args.model in zoo.names():
        model, (x,) = zoo.get(args.model, seq_len=args.seq_len, device=device)
    else:
        return _hugging_face(args, device)
    if x.is_floating_point():
        raise ConfigError(f"{args.model} takes features, not tokens: autopar train trains "
                          "language models (token ids in, logits out)")
    vocab = next((m.num_embeddings for m in model.modules()
                  if isinstance(m, torch.nn.Embedding)), None)
    if vocab is None:
        raise ConfigError(f"{args.model} has no token embedding; autopar train trains "
                          "language models")
    return model, vocab, args.seq_len or int(x.shape[1])


def _hugging_face(args: TrainArgs, device: str) -> tuple[torch.nn.Module, int, int]:
    """A Hugging Face causal language model by id or folder, from files already on
    this machine (``local_files_only``: no download), with its weights (on ``meta``:
    its config alone); sequences of ``args.seq_len``, else of up to 128 tokens."""
    try:
        import transformers
    except ImportError:
        raise ConfigError(f"unknown model {args.model!r}: not a zoo name, a file:factory, or "
                          "(transformers is not installed) a Hugging Face model") from None
    try:
        config = transformers.AutoConfig.from_pretrained(args.model, local_files_only=True)
        if device == "meta":
            with torch.device("meta"):
                model = transformers.AutoModelForCausalLM.from_config(config)
        else:
            model = transformers.AutoModelForCausalLM.from_pretrained(args.model,
                                                                      local_files_only=True)
    except (OSError, ValueError) as e:
        raise ConfigError(f"unknown model {args.model!r}: not a zoo name (`autopar models`), "
                          f"a path/to/file.py:factory, or a Hugging Face causal language "
                          f"model on this machine ({str(e).splitlines()[0][:200]})") from None
    longest = getattr(config, "max_position_embeddings", None) or \
        getattr(config, "n_positions", None) or 128
    return model, int(config.vocab_size), args.seq_len or min(int(longest), 128)


def memory_text(device: torch.device, predicted_bytes: float) -> str:
    """This rank's peak memory, named for what it measures: on a GPU torch's peak
    allocation, beside the plan's prediction of it ("peak allocated by torch 12.30 GB
    (predicted 13.10 GB)"); on a CPU the process's peak resident set, which holds the
    interpreter and libraries besides the tensors the plan predicts, so it stands alone
    ("process peak RSS 376.46 MB"; :func:`cpu_memory_note` says so once)."""
    if device.type == "cuda":
        return (f"peak allocated by torch {fmt_bytes(torch.cuda.max_memory_allocated(device))}"
                f" (predicted {fmt_bytes(predicted_bytes)})")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: kB
    return f"process peak RSS {fmt_bytes(rss)}"


def cpu_memory_note(predicted_bytes: float) -> str:
    """What a CPU run's logged memory is, against the plan's prediction."""
    return (f"memory: on CPU the log shows the process's peak resident set (RSS: the "
            f"interpreter, torch's libraries and every tensor); the plan's "
            f"{fmt_bytes(predicted_bytes)} per device counts tensors alone (parameters, "
            f"gradients, optimizer state, activations), which a GPU run logs as torch's "
            f"peak allocation")


def train(args: TrainArgs) -> list[float]:
    """Train under torchrun (every rank calls it); return the losses of the steps run."""
    import torch.distributed as dist

    import autopar

    if int(os.environ.get("RANK", "0")) == 0:  # what the runtime applied, as torchtitan logs
        logging.basicConfig(format="%(message)s", level=logging.WARNING, stream=sys.stdout)
        logging.getLogger("autopar.runtime").setLevel(logging.INFO)
    model, vocab, seq = build(args)
    tokens = load_tokens(args.data, vocab)
    example = shard_batch(tokens, 0, args.global_batch, seq, 0, 1)
    pm = autopar.parallelize(model, (example[0],), example_targets=example[1],
                             global_batch=args.global_batch, precision=args.precision,
                             space=args.space,
                             memory_budget=args.memory_budget)
    rank = dist.get_rank()
    pm.plan.batch_source = f"autopar train's --global-batch, default {TrainArgs.global_batch}"
    if rank == 0:
        print(pm.plan.summary(), flush=True)
    opt = torch.optim.AdamW(pm.parameters(), lr=args.lr)
    ckpt = autopar.Checkpointer(args.checkpoint_dir, pm, opt, every=args.checkpoint_every,
                                keep=args.keep) if args.checkpoint_dir else None
    resumed = ckpt.resume() if ckpt is not None else None
    first = resumed.step if resumed is not None else 0
    if rank == 0 and resumed is not None:
        print(f"resumed from step {first} ({args.checkpoint_dir})", flush=True)
    shard, plan = pm.data_shard(), pm.plan
    flops_s = plan.mfu * plan.step_time_s  # model FLOPs / (world x peak), in seconds
    if rank == 0 and pm.device.type != "cuda":
        print(cpu_memory_note(plan.memory_per_device_bytes), flush=True)
    losses = []
    for step in range(first + 1, args.steps + 1):
        x, y = shard_batch(tokens, step, args.global_batch, seq, shard.index, shard.count)
        start = time.perf_counter()
        loss = float(pm.step(x, y, local=True))
        opt.step()
        opt.zero_grad()
        if pm.device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        losses.append(loss)
        if rank == 0 and (step % args.log_every == 0 or step == args.steps):
            tps = args.global_batch * seq / elapsed / dist.get_world_size()
            print(f"step {step:>5}  loss {loss:8.4f}  tokens/s/rank {tps:10,.0f}  "
                  f"mfu {flops_s / elapsed:6.1%}  "
                  f"{memory_text(pm.device, plan.memory_per_device_bytes)}"
                  f"  time {elapsed * 1e3:8.1f} ms (predicted {plan.step_time_s * 1e3:.1f} ms)",
                  flush=True)
        if ckpt is not None:
            ckpt.step(step, extra={"tokens_seen": step * args.global_batch * seq})
    if ckpt is not None:
        ckpt.close()
    return losses
