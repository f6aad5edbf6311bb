"""``autopar train`` as the README runs it: the built-in tiny GPT on 4 CPU processes
started by the command itself, each rank reading its own shard of the built-in
text; 3 steps checkpointed, then resumed to step 6: every logged loss (fp32) equals
one process training on the same batches, and the data helpers shard without overlap."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from autopar.capture import default_loss
from autopar.errors import ConfigError
from autopar.train_args import TrainArgs
from autopar.train import builtin_text, load_tokens, shard_batch


def test_shards_split_each_global_batch_without_overlap() -> None:
    tokens = load_tokens("builtin", 128)
    assert builtin_text()[:200] == builtin_text()[:200] and tokens.max() < 128
    whole = shard_batch(tokens, 5, 8, 16, 0, 1)
    parts = [shard_batch(tokens, 5, 8, 16, i, 4) for i in range(4)]
    assert torch.equal(torch.cat([p[0] for p in parts]), whole[0])
    assert torch.equal(whole[0][:, 1:], whole[1][:, :-1])  # targets are the next tokens
    assert not torch.equal(shard_batch(tokens, 6, 8, 16, 0, 1)[0], whole[0])


def test_bad_data_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="token id 200 is not below the model's vocabulary"):
        load_tokens(str(_write(tmp_path / "t.txt", bytes([200] * 40))), 128)
    torch.save(torch.randn(10), tmp_path / "f.pt")
    with pytest.raises(ConfigError, match="expected a 1-D tensor of integer token ids"):
        load_tokens(str(tmp_path / "f.pt"), 128)


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def one_process(steps: int) -> list[float]:
    """The losses of ``steps`` AdamW steps of the tiny GPT in one process."""
    from autopar.examples import zoo

    args = TrainArgs()
    torch.manual_seed(args.seed)
    model, _ = zoo.get("tiny-gpt", device="cpu")
    tokens = load_tokens("builtin", 128)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses = []
    for step in range(1, steps + 1):
        x, y = shard_batch(tokens, step, args.global_batch, 16, 0, 1)
        loss = default_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _train(*args: str) -> str:
    cmd = [sys.executable, "-m", "autopar.cli", "train", "tiny-gpt", "--nproc-per-node", "4",
           "--precision", "fp32", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stdout


@pytest.mark.multirank
def test_train_runs_resumes_and_matches_one_process(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")
    first = _train("--steps", "3", "--checkpoint-dir", ckpt, "--checkpoint-every", "3")
    second = _train("--steps", "6", "--checkpoint-dir", ckpt, "--checkpoint-every", "3")
    assert "resumed from step 3" in second
    assert re.search(r"^Built the device mesh .+ on cpu$", first, re.M)  # the runtime's log
    assert re.search(r"^Applied (FSDP2|tensor parallelism|pipeline stage) ", first, re.M)
    logged = [(int(s), float(v)) for s, v in
              re.findall(r"^step +(\d+) +loss +(\S+) +tokens/s/rank", first + second, re.M)]
    assert [s for s, _ in logged] == [1, 2, 3, 4, 5, 6]
    assert [v for _, v in logged] == pytest.approx(one_process(6), abs=1e-4)
    assert sorted(p.name for p in Path(ckpt).iterdir()) == ["step-00000003", "step-00000006"]


@pytest.mark.multirank
def test_train_a_hugging_face_model_from_its_folder(tmp_path: Path) -> None:
    """A model saved with save_pretrained trains from its folder (no download) on 2
    processes; its losses equal one process's on the same batches."""
    transformers = pytest.importorskip("transformers")
    from autopar.capture import first_tensor

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256,
                                  n_positions=64)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(tmp_path / "gpt2")
    cmd = [sys.executable, "-m", "autopar.cli", "train", str(tmp_path / "gpt2"), "--steps",
           "2", "--nproc-per-node", "2", "--precision", "fp32", "--seq-len", "32"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    logged = [float(v) for v in re.findall(r"^step +\d+ +loss +(\S+)", proc.stdout, re.M)]
    model = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=TrainArgs().lr)
    tokens, want = load_tokens("builtin", 256), []
    for step in (1, 2):
        x, y = shard_batch(tokens, step, TrainArgs().global_batch, 32, 0, 1)
        loss = default_loss(first_tensor(model(x)), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(loss.item())
    assert logged == pytest.approx(want, abs=1e-4)


def test_each_rank_gets_back_the_options_it_was_started_with() -> None:
    """What ``autopar train`` hands each torchrun rank (``_argv``) parses back to the
    same options, ``--compile`` and the checkpoint folder included."""
    import argparse

    from autopar.cli_train import _args, _argv, add_train_parser

    ap = argparse.ArgumentParser(prog="autopar")
    add_train_parser(ap.add_subparsers(dest="command", required=True))
    first = _args(ap.parse_args(["train", "tiny-gpt", "--steps", "7", "--compile",
                                 "--checkpoint-dir", "ck", "--seq-len", "64"]))
    assert first.space.compile and first.steps == 7 and first.checkpoint_dir == "ck"
    assert _args(ap.parse_args(["train", *_argv(first)])) == first
    assert _args(ap.parse_args(["train"])).space.compile is None  # the plan's choice
    off = _args(ap.parse_args(["train", "--no-compile"]))
    assert _args(ap.parse_args(["train", *_argv(off)])).space.compile is False
