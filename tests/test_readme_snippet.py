"""The README's training-script snippet runs as written under torchrun on 4 CPU ranks."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from autopar.launch import free_port

README = Path(__file__).resolve().parent.parent / "README.md"
SECTION = "In a training script started with `torchrun`"


def readme_snippet() -> str:
    """The first Python code block after the README's torchrun sentence."""
    text = README.read_text()
    start = text.index(SECTION)
    match = re.search(r"```python\n(.*?)```", text[start:], re.DOTALL)
    assert match, f"no Python code block after {SECTION!r} in README.md"
    return match.group(1)


@pytest.mark.multirank
def test_readme_snippet_trains_under_torchrun(tmp_path: Path):
    script = tmp_path / "train.py"
    script.write_text(readme_snippet())
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
                          "--master-port", str(free_port()), str(script)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    losses = [float(v) for v in re.findall(r"loss ([-+0-9.eEnaif]+)", run.stdout)]
    assert len(losses) == 5, run.stdout
    assert all(math.isfinite(v) for v in losses), losses
    assert losses[-1] < losses[0], losses
