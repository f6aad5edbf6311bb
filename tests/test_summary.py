"""``Plan.summary()`` reads as a reader needs: the step's terms add up to it and the
parts of exposed communication to that term, the detail figures are labelled as not
added again, the placement notation has a key, the solver record is words, modules come
in the order the forward runs them, and a CPU profile says what it is for."""

from __future__ import annotations

import re

import pytest
import torch

import autopar
from autopar.examples.gpt import GPT, GPTConfig
from autopar.summary import _device_text, fmt_rate

UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}


def seconds(text: str) -> float:
    """``"1.25 ms"`` -> 0.00125."""
    value, unit = text.split()
    return float(value) * UNITS[unit]


def terms(line: str) -> list[float]:
    """The seconds of each ``name 1.25 ms`` term of a ``a + b + c`` line."""
    return [seconds(m) for m in re.findall(r"([0-9.]+ (?:s|ms|us))(?: \+|$)", line)]


@pytest.fixture(scope="module")
def plan() -> autopar.Plan:
    """A 2-layer GPT on 4 CPU processes, dp=2 x tp=2 with ZeRO-3 (its communication has
    two parts)."""
    model = GPT(GPTConfig(vocab_size=128, max_seq_len=16, dim=64, n_layers=2, n_heads=4))
    x = torch.randint(0, 128, (8, 16))
    return autopar.estimate(model, (x,), autopar.Spec(dp=2, tp=2, zero=3),
                            cluster=autopar.Cluster("cpu", 1, 4))


def test_the_terms_add_up_and_the_details_are_labelled(plan: autopar.Plan) -> None:
    lines = plan.summary().splitlines()
    step = next(s for s in lines if s.startswith("predicted step time"))
    total = seconds(re.search(r"predicted step time\s+([0-9.]+ \w+)", step).group(1))
    sum_line = next(s for s in lines if s.startswith("  = "))
    assert sum(terms(sum_line)) == pytest.approx(total, rel=2e-3, abs=2e-5)
    exposed = seconds(re.search(r"exposed communication ([0-9.]+ \w+)", sum_line).group(1))
    parts = next(s for s in lines if s.startswith("    exposed communication = "))
    assert sum(terms(parts)) == pytest.approx(exposed, rel=2e-3, abs=2e-5)
    assert any(s.startswith("    not added again: ") for s in lines)


def test_a_key_to_the_notation_and_the_solver_in_words(plan: autopar.Plan) -> None:
    text = plan.summary()
    assert "layouts   R replicated, S(d) split along dim d" in text
    assert "input a->b: received -> computed on" in text
    solver = next(s for s in text.splitlines() if s.startswith("solver    "))
    assert "solved the chosen layout" in solver and "=" not in solver
    assert "constraints" in solver and "_s " not in solver


def test_modules_come_in_the_order_the_forward_runs_them(plan: autopar.Plan) -> None:
    assert list(plan.modules)[:2] == ["tok_emb", "pos_emb"]
    assert list(plan.modules)[-2:] == ["ln_f", "head"]
    rows = [s.split()[0] for s in plan.summary().splitlines()
            if s.startswith(("tok_emb ", "pos_emb ", "blocks.", "ln_f ", "head "))]
    assert rows[0] == "tok_emb" and rows[-1] == "head"


def test_a_cpu_profile_says_what_it_is_for(plan: autopar.Plan) -> None:
    assert "a CPU profile plans CPU runs" in plan.summary()
    assert "it says nothing about a GPU" in plan.summary()
    assert _device_text({"gpu": "cpu"}) == "cpu"
    assert _device_text({"gpu": "runs/my-cpu.json", "device_name": "AMD EPYC",
                         "device_type": "cpu"}) == "AMD EPYC (CPU, profile my-cpu.json)"
    assert _device_text({"gpu": "h100-sxm", "profile": "/p/h100.json",
                         "device_name": "NVIDIA H100", "device_type": "gpu"}) == \
        "NVIDIA H100 (profile h100.json)"


def test_slow_throughputs_keep_their_digits() -> None:
    assert [fmt_rate(x) for x in (945.844, 11.77, 0.0432, 4.391e-5, 0.0)] == \
        ["945.84", "11.77", "0.0432", "4.39e-05", "0.00"]
