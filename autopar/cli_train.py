"""``autopar train``'s command line: the options (:class:`~autopar.train_args.TrainArgs`), and, started
without torchrun, torchrun itself with ``--nproc-per-node`` local processes (gloo on
CPUs, NCCL on GPUs) each running :func:`autopar.train.train`. Imports no torch, so
``autopar --help`` stays fast."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from autopar.cli_options import add_memory_budget_arg, add_spec_args, spec_argv, spec_from_args
from autopar.errors import AutoparError, ConfigError
from autopar.train_args import TrainArgs

__all__ = ["TrainArgs", "add_train_parser", "cmd_train", "main"]


class DefaultsShown(argparse.ArgumentDefaultsHelpFormatter):
    """Help that shows each option's default, except where it is None: there the
    option's own help says what leaving it out means."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


def add_train_parser(sub: argparse._SubParsersAction) -> None:
    """The ``autopar train`` subcommand."""
    d = TrainArgs()
    p = sub.add_parser("train", help="plan and train a language model on local processes "
                       "or under torchrun", formatter_class=DefaultsShown,
                       description="Plan a language model for the processes it runs on "
                       "and train it, each rank reading its own shard of the data, logging "
                       "loss, tokens/s, MFU and memory per step, checkpointing every k steps.")
    p.add_argument("model", nargs="?", default=d.model,
                   help="a zoo name (`autopar models`), path/to/file.py:factory, or a "
                        "Hugging Face causal LM id or folder already on this machine")
    p.add_argument("--steps", type=int, default=d.steps, help="the last step to train")
    p.add_argument("--data", default=d.data,
                   help="'builtin' (small sums as text), a text file (read as bytes), or a "
                        ".pt file of token ids")
    p.add_argument("--global-batch", type=int, default=d.global_batch,
                   help="sequences per step, over all ranks")
    p.add_argument("--seq-len", type=int, default=None,
                   help="tokens per sequence (default: the model's)")
    p.add_argument("--lr", type=float, default=d.lr, help="AdamW's learning rate")
    p.add_argument("--seed", type=int, default=d.seed, help="the weights' seed")
    p.add_argument("--checkpoint-dir", default=None,
                   help="save here every --checkpoint-every steps and resume from here "
                   "(default: no checkpoints)")
    p.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every,
                   help="steps between checkpoints")
    p.add_argument("--keep", type=int, default=d.keep, help="checkpoints kept")
    p.add_argument("--log-every", type=int, default=d.log_every, help="steps between log lines")
    p.add_argument("--precision", choices=["bf16", "fp16", "fp32"], default=d.precision,
                   help="parameters and compute (gradients reduced and kept in fp32)")
    p.add_argument("--nproc-per-node", type=int, default=1,
                   help="outside torchrun: start torchrun with this many local processes")
    plan = p.add_argument_group("the plan (as `autopar plan` takes them; each option fixes "
                                "one choice, left out the solver chooses)")
    add_memory_budget_arg(plan)
    add_spec_args(plan)


def _args(ns: argparse.Namespace) -> TrainArgs:
    for name in ("steps", "global_batch", "checkpoint_every", "keep", "log_every",
                 "nproc_per_node"):
        if getattr(ns, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(ns, name)}: expected a "
                              "positive integer")
    return TrainArgs(model=ns.model, steps=ns.steps, data=ns.data,
                     global_batch=ns.global_batch, seq_len=ns.seq_len, lr=ns.lr, seed=ns.seed,
                     checkpoint_dir=ns.checkpoint_dir, checkpoint_every=ns.checkpoint_every,
                     keep=ns.keep, log_every=ns.log_every, precision=ns.precision,
                     space=spec_from_args(ns),
                     memory_budget=ns.memory_budget)


def _argv(a: TrainArgs) -> list[str]:
    """The command line that gives ``a`` back (what each torchrun rank runs)."""
    out = [a.model, "--steps", str(a.steps), "--data", a.data, "--global-batch",
           str(a.global_batch), "--lr", repr(a.lr), "--seed", str(a.seed),
           "--checkpoint-every", str(a.checkpoint_every), "--keep", str(a.keep),
           "--log-every", str(a.log_every), "--precision", a.precision]
    if a.seq_len is not None:
        out += ["--seq-len", str(a.seq_len)]
    if a.checkpoint_dir is not None:
        out += ["--checkpoint-dir", a.checkpoint_dir]
    if a.memory_budget is not None:
        out += ["--memory-budget", repr(a.memory_budget)]
    return out + (spec_argv(a.space) if a.space is not None else [])


def cmd_train(ns: argparse.Namespace) -> int:
    """Run ``autopar train``: under torchrun, train; else start torchrun on
    ``--nproc-per-node`` local processes running this same command."""
    args = _args(ns)
    from autopar.train import build, load_tokens, shard_batch, train

    if "RANK" in os.environ:
        train(args)
        return 0
    _, vocab, seq = build(args, device="meta")  # what would fail on every rank, once here
    shard_batch(load_tokens(args.data, vocab), 0, args.global_batch, seq, 0, 1)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", str(ns.nproc_per_node), "-m", "autopar.cli_train", *_argv(args)]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    return subprocess.run(cmd, env=env).returncode


def main(argv: list[str] | None = None) -> int:
    """``python -m autopar.cli_train ARGS`` (what torchrun runs on each rank)."""
    ap = argparse.ArgumentParser(prog="autopar")
    add_train_parser(ap.add_subparsers(dest="command", required=True))
    ns = ap.parse_args(["train", *(sys.argv[1:] if argv is None else argv)])
    try:
        return cmd_train(ns)
    except AutoparError as e:
        print(f"autopar: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # what each torchrun rank runs
    sys.exit(main())
