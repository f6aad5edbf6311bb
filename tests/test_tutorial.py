"""docs/tutorial.md's training script (docs/examples/hf_tutorial.py) runs as the tutorial
runs it: under torchrun on 4 CPU processes, a Hugging Face Llama in the user's own loop
(``pm(x)``, ``loss.backward()``) under dp2 x tp2, printing falling losses and writing
its checkpoints. Skipped without ``transformers``."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from autopar.launch import free_port

pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parent.parent / "docs" / "examples" / "hf_tutorial.py"
TUTORIAL = SCRIPT.parent.parent / "tutorial.md"


def test_the_tutorial_shows_this_script() -> None:
    """The page's commands run this script, and its Python blocks are the script's code."""
    text, script = TUTORIAL.read_text(), SCRIPT.read_text()
    assert "torchrun --nproc-per-node 4 docs/examples/hf_tutorial.py --pp 1 --tp 2" in text
    blocks = re.findall(r"```python\n(.*?)```", text, re.DOTALL)
    assert blocks
    for block in blocks:
        assert block in script, block[:200]


@pytest.mark.multirank
def test_tutorial_script_trains_and_checkpoints_under_torchrun(tmp_path: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
                          "--master-port", str(free_port()), str(SCRIPT), "--steps", "4",
                          "--pp", "1", "--tp", "2", "--checkpoint-dir", "ckpt",
                          "--checkpoint-every", "2"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    assert "mesh dp=2 x tp=2" in run.stdout, run.stdout
    losses = [float(v) for v in re.findall(r"step \d+: loss ([-+0-9.eEnaif]+)", run.stdout)]
    assert len(losses) == 4 and all(math.isfinite(v) for v in losses), run.stdout
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == \
        ["step-00000002", "step-00000004"]
