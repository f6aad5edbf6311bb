"""The ``autopar`` command line: ``plan`` a model for a cluster, ``compare`` a hand-written
configuration with the plan, ``codegen`` a plan into a torchrun program, ``train`` a
language model under its plan, convert a ``checkpoint``, ``profile`` this machine,
``demo`` a local run, list the zoo's ``models``."""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from autopar.cli_checkpoint import add_checkpoint_parser, cmd_checkpoint
from autopar.cli_options import (ESTIMATE_DEFAULTS, add_memory_budget_arg, add_spec_args,
                                 spec_from_args)
from autopar.cli_train import add_train_parser, cmd_train
from autopar.batch_default import (TOKENS_PER_DEVICE, asked_source, default_global_batch,
                                   default_source, example_source)
from autopar.cost_models.memory import PRECISIONS
from autopar.errors import AutoparError, ConfigError

if TYPE_CHECKING:
    import torch
    from torch import nn

    from autopar.cluster import Cluster
    from autopar.plans import Plan


ZOO_EXAMPLE_BATCH = 2
"""Samples in the example inputs autopar builds for a zoo model (to capture it; the
plan's global batch is set apart from them, :func:`_global_batch`)."""


def _add_cluster_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpu", default="h100-sxm",
                   help="hardware profile name or JSON path (default: %(default)s)")
    p.add_argument("--nodes", type=int, default=1, help="nodes in the cluster (default: 1)")
    p.add_argument("--gpus-per-node", type=int, default=8,
                   help="devices per node (default: 8)")
    p.add_argument("--intra-node-bandwidth", type=float,
                   help="GB/s per GPU inside a node (default: the profile's)")
    p.add_argument("--inter-node-bandwidth", type=float,
                   help="GB/s per GPU across nodes (default: the profile's)")


def _add_workload_args(p: argparse._ActionsContainer) -> None:
    """Batch, sequence length, precision, optimizer and memory budget options."""
    p.add_argument("--global-batch", type=int,
                   help="sequences (samples) per optimizer step over all devices (default: "
                        f"for a zoo language model {TOKENS_PER_DEVICE:,} tokens per device "
                        "in whole sequences, at least one, times the devices, the middle "
                        "of the published runs in benchmarks/published_runs.json; for a "
                        "factory or the mlp, its example inputs' batch)")
    p.add_argument("--seq-len", type=int,
                   help="sequence length of zoo models (default: the model's training length)")
    p.add_argument("--precision", default="bf16", choices=list(PRECISIONS),
                   help="training precision; bf16 and fp16 keep fp32 master weights; fp8 is "
                        "bf16 with float8 Linear products (priced, not yet run) "
                        "(default: %(default)s)")
    p.add_argument("--optimizer", default="adamw", choices=["adam", "adamw", "sgd"],
                   help="the optimizer whose state is kept and stepped (default: %(default)s)")
    add_memory_budget_arg(p)
    p.add_argument("--expert-imbalance", type=float, default=1.0,
                   help="dropless experts under expert parallelism: the busiest ep rank's "
                        "tokens over the mean (default: %(default)s, an even spread)")


def _cluster_from_args(args: argparse.Namespace) -> Cluster:
    """The :class:`autopar.Cluster` named by the options of :func:`_add_cluster_args`."""
    from autopar.cluster import Cluster

    return Cluster(gpu=args.gpu, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                           intra_node_bandwidth=args.intra_node_bandwidth,
                           inter_node_bandwidth=args.inter_node_bandwidth)


def _add_compare_parser(sub: argparse._SubParsersAction) -> None:
    """``autopar compare MODEL``: the cluster and workload, then the hand-written
    configuration (as :func:`autopar.estimate` scores it)."""
    p = sub.add_parser("compare", help="score a hand-written configuration beside the plan")
    p.add_argument("model", help="a zoo name (see `autopar models`) or path/to/file.py:factory")
    _add_cluster_args(p)
    _add_workload_args(p.add_argument_group("workload"))
    add_spec_args(p.add_argument_group(
        "hand-written configuration (left out, as autopar.estimate fills it: degrees 1, "
        "except --dp, which fills the world; --zero 0; --schedule 1f1b; the largest "
        "micro-batch that gives pp micro-batches; recomputation the solver's)"),
        ESTIMATE_DEFAULTS)


def _build_parser() -> argparse.ArgumentParser:
    from autopar import __version__

    ap = argparse.ArgumentParser(prog="autopar", description=__doc__.replace("``", ""))
    ap.add_argument("--version", action="version", version=f"autopar {__version__}")
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="print the best plan for a model on a cluster")
    p.add_argument("model", help="a zoo name (see `autopar models`) or path/to/file.py:factory "
                   "(returning a model, (model, inputs) or (model, inputs, targets))")
    _add_cluster_args(p)
    _add_workload_args(p.add_argument_group("workload"))
    add_spec_args(p.add_argument_group(
        "search space (each option fixes one choice; left out, the solver chooses)"))
    p.add_argument("--top-k", "--top", type=int, default=1, metavar="N", dest="top_k",
                   help="also list the next N-1 fastest configurations and why they lost "
                        "(default: %(default)s, the plan alone)")
    p.add_argument("--time-limit-s", "--time-limit", type=float, metavar="SECONDS",
                   dest="time_limit_s",
                   help="stop searching after this long with the best plan found and its gap "
                        "(default: no limit)")
    p.add_argument("--explain", metavar="MODULE", action="append",
                   help="also say why MODULE (a path, its last parts or a glob, e.g. "
                        "attn.proj) has its layout: its other layouts priced by term with "
                        "the plan's other choices kept; may be repeated (default: none)")
    p.add_argument("--json", metavar="FILE",
                   help="also write the plan as JSON (default: print the summary only)")
    p.add_argument("--report", metavar="FILE", help="also write the plan as one self-contained "
                   "HTML page: mesh, per-rank timeline, memory, runners-up, layouts (default: none)")
    p.add_argument("--plots", metavar="DIR", help="also write the report's figures as PNG "
                   "files into DIR (needs matplotlib: pip install \"autopar[plots]\"; default: none)")
    _add_compare_parser(sub)
    sub.add_parser("models", help="list the zoo models")
    d = sub.add_parser("demo", help="train a small GPT on local CPU processes under its plan")
    d.add_argument("--ranks", type=int, default=4,
                   help="CPU processes to train on (default: %(default)s)")
    d.add_argument("--steps", type=int, default=3,
                   help="SGD steps to train and compare (default: %(default)s)")
    c = sub.add_parser("codegen", help="write a plan as a standalone torchrun training program")
    c.add_argument("plan", help="plan JSON written by `autopar plan --json`")
    c.add_argument("--model", required=True,
                   help="the model the plan is for: path/to/file.py:factory, or a zoo name "
                        "(its classes are then written beside the program as "
                        "OUTPUT_model.py, so the program needs torch alone)")
    c.add_argument("--loss", metavar="FILE.py:FUNCTION",
                   help="the loss(output, targets) to train with (default: cross-entropy over "
                        "the output's last dim)")
    c.add_argument("-o", "--output", default="train.py",
                   help="the program to write (default: %(default)s)")
    c.add_argument("--build", choices=["auto", "cpu", "meta"], default="auto",
                   help="the program's default --build: cpu (the weights the factory makes), "
                        "meta (each rank initializes its own shards with reset_parameters()) "
                        "or auto (cpu whenever the model fits in memory; default)")
    from autopar.cost_models.profiling.options import build_parser as profile_parser

    profile_parser(sub.add_parser("profile", help="measure this machine's GPU (or CPU) "
                                  "and write a profile JSON"))
    add_checkpoint_parser(sub)
    add_train_parser(sub)
    return ap


def _load_model(spec: str, seq_len: int | None
                ) -> tuple[nn.Module, tuple[torch.Tensor, ...], torch.Tensor | None]:
    """(model, example inputs, example targets or None) of a zoo name or a
    ``path/to/file.py:factory`` (whose factory may also return the targets)."""
    from autopar.examples import zoo

    if ":" in spec and spec.split(":")[0].endswith(".py"):
        return zoo.load_with_targets(spec)
    return (*zoo.get(spec, batch_size=ZOO_EXAMPLE_BATCH, seq_len=seq_len), None)


def cmd_plan(args: argparse.Namespace) -> int:
    """``autopar plan``: capture on meta, search, print the summary, write JSON."""
    import autopar

    t0 = time.perf_counter()
    cluster = _cluster_from_args(args)
    if args.json:
        _check_writable(args.json, "the plan")
    from autopar.report import check_outputs, write_outputs

    check_outputs(args.report, args.plots)
    model, inputs, targets = _load_model(args.model, args.seq_len)
    batch, source = _global_batch(args, cluster, inputs)
    plan = autopar.plan(model, inputs, cluster=cluster, global_batch=batch,
                        precision=args.precision, optimizer=args.optimizer,
                        memory_budget=args.memory_budget, example_targets=targets,
                        space=spec_from_args(args), top_k=args.top_k,
                        expert_imbalance=args.expert_imbalance,
                        time_limit_s=args.time_limit_s, progress=_progress_line(sys.stderr),
                        explain=args.explain)
    if sys.stderr.isatty():
        sys.stderr.write("\n")
    if ":" not in args.model:
        plan.model = args.model
    plan.batch_source = source
    print(plan.summary())
    print(f"\nplanned in {time.perf_counter() - t0:.1f} s")
    if args.json:
        _write(args.json, plan.to_json(), "the plan")
        print(f"plan written to {args.json}")
    for path in write_outputs(plan, args.report, args.plots):
        print(f"wrote {path}")
    return 0


def _global_batch(args: argparse.Namespace, cluster: Cluster,
                  inputs: tuple[torch.Tensor, ...]) -> tuple[int | None, str]:
    """The global batch to plan for and where it came from (:attr:`Plan.batch_source`):
    ``--global-batch``; for a zoo model that reads token ids, the default rule of
    :mod:`autopar.batch_default`; else None, the example inputs' batch."""
    if args.global_batch is not None:
        return args.global_batch, asked_source("--global-batch")
    x = inputs[0] if inputs else None
    if ":" in args.model or x is None or x.is_floating_point() or x.dim() != 2:
        return None, example_source("--global-batch")
    seq = int(x.shape[1])
    return default_global_batch(cluster.world_size, seq), \
        default_source(cluster.world_size, seq)


def _check_writable(path: str, what: str) -> None:
    """ConfigError, before any work, when ``path``'s folder does not exist or
    ``path`` is a folder."""
    import os

    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path) or not os.path.isdir(folder):
        why = "is a folder" if os.path.isdir(path) else f"its folder {folder!r} does not exist"
        raise ConfigError(f"cannot write {what} to {path!r}: {why}; pass a file path in an "
                          f"existing folder")


def _write(path: str, text: str, what: str) -> None:
    """Write ``text`` to ``path``; ConfigError naming ``what`` when the OS refuses."""
    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError as e:
        raise ConfigError(f"cannot write {what} to {path!r}: {e.strerror}") from None


def _check_spec(option: str, spec: str | None, what: str) -> None:
    """``spec`` (when given) is ``path/to/file.py:name``."""
    if spec is not None and not re.fullmatch(r".+\.py:[A-Za-z_]\w*", spec):
        raise ConfigError(f"{option} {spec!r} is not of the form path/to/file.py:{what}")


def _progress_line(stream) -> Callable[[int, int, float | None], None] | None:
    """A progress callback for the search that rewrites one line of ``stream``: the
    configurations scored, the best step so far, the time spent and an estimate of
    the time left (from the mean time per configuration so far). Shown once the search
    has run a second, and on a terminal only: logs get no progress noise. (One line of
    our own rather than rich or tqdm: it needs no dependency.)"""
    if not stream.isatty():
        return None
    from autopar.summary import fmt_time

    start = time.perf_counter()
    last = [0.0]

    def show(done: int, total: int, best: float | None) -> None:
        now = time.perf_counter()
        if now - start < 1.0 or (now - last[0] < 0.1 and done < total):  # 10 a second
            return
        last[0] = now
        spent = now - start
        left = spent / done * (total - done) if done else None
        text = f"searching: {done}/{total} configurations" + (
            f", best {fmt_time(best)} per step" if best is not None else "") + \
            f", {spent:.0f} s" + (f", about {left:.0f} s left" if left is not None else "")
        stream.write("\r" + text.ljust(79))
        stream.flush()

    return show


def cmd_compare(args: argparse.Namespace) -> int:
    """``autopar compare``: plan the model, score the hand-written configuration with the
    same cost model, and print the two term by term."""
    import autopar

    t0 = time.perf_counter()
    cluster = _cluster_from_args(args)
    model, inputs, targets = _load_model(args.model, args.seq_len)
    batch, source = _global_batch(args, cluster, inputs)
    result = autopar.compare(model, inputs, spec_from_args(args), cluster=cluster,
                             global_batch=batch, precision=args.precision,
                             optimizer=args.optimizer, memory_budget=args.memory_budget,
                             example_targets=targets, expert_imbalance=args.expert_imbalance)
    name = args.model if ":" not in args.model else result.planned.model
    print(f"autopar compare for {name} on {cluster.nodes} node(s) x {cluster.gpus_per_node} "
          f"{args.gpu}, global batch {result.planned.global_batch}")
    result.planned.batch_source = source
    from autopar.summary import batch_text

    print(batch_text(result.planned))
    print()
    print(result.table())
    print(f"\ncompared in {time.perf_counter() - t0:.1f} s")
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    """``autopar models``: one line per zoo model."""
    from autopar.examples import zoo

    for name in zoo.names():
        print(f"{name:14s} {zoo.describe(name)}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """``autopar demo``: a small GPT trained under its plan beside a single process."""
    from autopar.demo import run_demo

    for name in ("ranks", "steps"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name} {getattr(args, name)}: expected a positive integer")
    run_demo(ranks=args.ranks, steps=args.steps)
    return 0


def cmd_codegen(args: argparse.Namespace) -> int:
    """``autopar codegen``: emit the plan as a standalone training program."""
    import os

    from autopar.plans import Plan
    from autopar.runtime.codegen import emit_program, model_facts

    if ":" in args.model or args.model.endswith(".py"):
        _check_spec("--model", args.model, "factory")
    _check_spec("--loss", args.loss, "function")
    _check_writable(args.output, "the program")
    try:
        with open(args.plan, "rb") as f:
            plan = Plan.from_json(f.read())
    except OSError as e:
        raise ConfigError(f"cannot read the plan {args.plan!r}: {e.strerror}") from None
    spec = args.model if ":" in args.model else _write_zoo_model(args.model, plan, args.output)
    path = spec.rpartition(":")[0]
    out_dir = os.path.dirname(os.path.abspath(args.output))
    loss_file = None
    if args.loss:
        loss_file = os.path.relpath(args.loss.rpartition(":")[0], out_dir)
    facts = model_facts(spec)
    if facts.note:
        print(f"autopar: {facts.note}", file=sys.stderr)
    text = emit_program(plan, spec, model_file=os.path.relpath(path, out_dir),
                        program_name=os.path.basename(args.output), loss_spec=args.loss,
                        loss_file=loss_file, build=args.build, facts=facts)
    _write(args.output, text, "the program")
    print(f"wrote {args.output}: torchrun --nproc-per-node {plan.world_size} {args.output}")
    return 0


def _write_zoo_model(name: str, plan: Plan, output: str) -> str:
    """Write zoo model ``name`` (at the sequence length of the plan's inputs) as a
    standalone file beside ``output``; return its ``path:build`` spec."""
    from autopar.examples.zoo_source import model_source

    from autopar.summary import sequence_length

    seq_len = sequence_length(plan)
    path = output.removesuffix(".py") + "_model.py"
    _write(path, model_source(name, seq_len), "the model")
    print(f"wrote {path}: the zoo's {name}, which the program builds")
    return f"{path}:build"


def cmd_profile(args: argparse.Namespace) -> int:
    """``autopar profile``: measure GEMMs, attention, memory-bound ops, launch overhead
    (and collectives under torchrun) and write a profile JSON."""
    from autopar.cost_models.profiling.run import main as profile_main

    return profile_main(args)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``autopar`` console script."""
    args = _build_parser().parse_args(argv)
    handler = {"plan": cmd_plan, "models": cmd_models, "demo": cmd_demo,
               "profile": cmd_profile, "codegen": cmd_codegen,
               "compare": cmd_compare, "checkpoint": cmd_checkpoint,
               "train": cmd_train}[args.command]
    try:
        return handler(args)
    except AutoparError as e:
        print(f"autopar: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
