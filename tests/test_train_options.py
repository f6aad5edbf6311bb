"""Issue 40, item 5: ``autopar train`` takes the plan's options (``--dp``, ``--tp``,
``--pp``, ... and ``--memory-budget``), defined once for ``plan``, ``compare`` and
``train`` (:mod:`autopar.cli_options`), hands them to every torchrun rank, and logs
memory as what it measures."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

import pytest
import torch

from autopar.cli import _build_parser
from autopar.cli_train import _args, _argv, add_train_parser
from autopar.spec import Spec
from autopar.train import memory_text


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _options(parser: argparse.ArgumentParser) -> dict[str, tuple]:
    """Option string -> (dest, type's name, choices, help) of every option of
    ``parser``."""
    return {s: (a.dest, getattr(a.type, "__name__", None), a.choices, a.help)
            for a in parser._actions for s in a.option_strings}


def test_train_has_every_plan_option_of_the_search_space() -> None:
    subs = _subparsers(_build_parser())
    plan, train = _options(subs["plan"]), _options(subs["train"])
    shared = ["--dp", "--tp", "--pp", "--cp", "--cp-variant", "--ep", "--microbatch-size",
              "--schedule", "--virtual-stages", "--recompute", "--zero",
              "--sequence-parallel", "--no-sequence-parallel", "--loss-parallel",
              "--offload", "--memory-budget"]
    for option in shared:
        assert option in train, option
        assert train[option] == plan[option], option


def test_each_rank_gets_the_plan_options_back() -> None:
    ap = argparse.ArgumentParser(prog="autopar")
    add_train_parser(ap.add_subparsers(dest="command", required=True))
    args = _args(ap.parse_args(["train", "tiny-gpt", "--dp", "2", "--tp", "2",
                                "--no-sequence-parallel", "--recompute", "full",
                                "--memory-budget", "40GB"]))
    assert args.space == Spec(dp=2, tp=2, sequence_parallel=False, recompute="full")
    assert args.memory_budget == 40e9
    assert _args(ap.parse_args(["train", *_argv(args)])) == args
    assert _args(ap.parse_args(["train"])).space == Spec()


def test_bad_plan_options_are_named_before_any_process_starts() -> None:
    from autopar.cli import main

    with pytest.raises(SystemExit):  # argparse's own line: not an integer
        main(["train", "tiny-gpt", "--tp", "two"])


def test_cpu_memory_says_it_is_the_process_rss() -> None:
    text = memory_text(torch.device("cpu"), 881e3)
    assert re.fullmatch(r"process peak RSS [0-9.]+ (MB|GB)", text), text


@pytest.mark.multirank
def test_train_runs_the_layout_asked_for() -> None:
    cmd = [sys.executable, "-m", "autopar.cli", "train", "tiny-gpt", "--nproc-per-node", "2",
           "--steps", "2", "--precision", "fp32", "--dp", "2", "--pp", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = proc.stdout
    assert re.search(r"^mesh +dp=2 x tp=1$", out, re.M), out[-3000:]
    assert re.search(r"^memory: on CPU the log shows the process's peak resident set \(RSS: "
                     r"the interpreter, torch's libraries and every tensor\); the plan's "
                     r"[0-9.]+ [kMG]?B per device counts tensors alone", out, re.M), out[-3000:]
    steps = re.findall(r"^step +\d+ +loss .* process peak RSS [0-9.]+ [MG]B +time ", out, re.M)
    assert len(steps) == 2, out[-3000:]
