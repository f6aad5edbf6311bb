"""The first plan of a process (which imports the ILP solver) frees its caller's objects."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import gc, weakref, torch, autopar
from autopar.examples import gpt

def plan_in_a_function():
    model = gpt.GPT(gpt.GPTConfig(vocab_size=64, max_seq_len=16, dim=32, n_layers=2, n_heads=2))
    x = torch.randint(0, 64, (2, 16))
    autopar.plan(model, (x,), cluster=autopar.Cluster("cpu", 1, 1))
    return weakref.ref(model)

ref = plan_in_a_function()
gc.collect()
print("alive" if ref() is not None else "freed")
"""


def test_first_plan_keeps_no_reference_to_the_callers_locals() -> None:
    """PuLP keeps its optional solvers' import errors; their tracebacks held the frames
    of the first ``autopar.plan`` call's callers (with a model and its GPU memory)."""
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         timeout=300, check=True)
    assert out.stdout.strip().splitlines()[-1] == "freed", out.stdout + out.stderr
