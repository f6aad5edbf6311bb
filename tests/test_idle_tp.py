"""Issue 40, item 5: a tensor-parallel axis that splits nothing. A tiny GPT on 4 CPU
processes was planned ``dp=1 x tp=4`` with every module replicated (its 4 ranks
repeating one rank's step on the same batch), because that layout moves nothing and
splitting the batch costs a gradient all-reduce over gloo. The search now prefers a
layout that uses its ranks and says what the replicated one would take; asked for
(``tp=4``), the replicated layout is planned and the summary says it splits nothing."""

from __future__ import annotations

import re

import pytest
import torch

import autopar
from autopar.examples.gpt import GPT, GPTConfig


def _tp_splits_nothing(plan: autopar.Plan) -> bool:
    """Read off the plan's placements: tp above 1 and every parameter and activation
    replicated along it."""
    if plan.degree("tp") == 1:
        return False
    a = list(plan.stage_mesh).index("tp")
    return all(pl[a] == "R" for pl in [*plan.params.values(), *plan.activations.values()])


def _plan(**space) -> autopar.Plan:
    model = GPT(GPTConfig(vocab_size=128, max_seq_len=16, dim=32, n_layers=2, n_heads=4))
    x = torch.randint(0, 128, (8, 16))
    return autopar.plan(model, (x,), cluster=autopar.Cluster("cpu", 1, 4), **space)


@pytest.fixture(scope="module")
def free() -> autopar.Plan:
    """The plan the solver chooses for the 4 processes."""
    return _plan()


def test_the_plan_uses_its_ranks(free: autopar.Plan) -> None:
    assert not _tp_splits_nothing(free), free.summary()
    assert not free.splits_nothing("tp")


def test_the_faster_replicated_layout_is_named_with_the_reason(free: autopar.Plan) -> None:
    notes = [n for n in free.notes if "splits nothing" in n]
    assert len(notes) == 1, free.notes
    note = notes[0]
    m = re.match(r"(\S+(?: x \S+)*) was predicted ([0-9.]+ [mu]?s), faster than this "
                 r"plan's ([0-9.]+ [mu]?s), but its tp splits nothing: every module "
                 r"replicated, the (\d) ranks of each tp group repeating one rank's work "
                 r"on the same samples\. The planner prefers a layout that uses every "
                 r"rank; this one is slower: (.+)\. The model runs at least as fast on "
                 r"(\d) devices? as on these 4: plan and train on fewer, or pass --tp (\d) "
                 r"\(tp=\d\) for the replicated layout$", note)
    assert m, note
    assert "tp=" + m.group(4) in m.group(1)
    assert int(m.group(6)) * int(m.group(4)) == 4 and m.group(7) == m.group(4)
    assert "more exposed communication" in m.group(5)  # what splitting the work costs


def test_a_tp_asked_for_that_splits_nothing_is_said() -> None:
    p = _plan(tp=4, pp=1)
    assert _tp_splits_nothing(p) and p.splits_nothing("tp")
    line = next(x for x in p.summary().splitlines() if x.startswith("tensor p."))
    assert line == ("tensor p. tp=4 splits nothing: every module replicated, so the 4 "
                    "ranks of each tp group repeat one rank's work on the same samples, "
                    "as 1 rank would")
    assert not any("splits nothing" in n for n in p.notes)  # nothing faster set aside
