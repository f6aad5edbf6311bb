"""The ``cpu`` profile's rates per process count and per-kind collective fits."""

from __future__ import annotations

import json

import pytest

from autopar.cost_models.comm import collective_time
from autopar.cost_models.hardware import LinkSpec, load_profile, parse_profile
from autopar.errors import PlanFormatError


def test_oversubscribed_processes_are_slower_each():
    hw = load_profile("cpu")
    # 4 one-thread processes on the measured 2-core machine share the cores
    assert hw.per_process[4]["matmul_flops"] < 0.75 * hw.per_process[2]["matmul_flops"]


def test_per_kind_fits_price_their_collective():
    link = LinkSpec(1e9, 1e-3, (("all_reduce", 1e9, 1e-3), ("all_gather", 5e8, 2e-3)))
    assert collective_time("all_gather", 1e6, 2, link) == pytest.approx(1e6 / 2 / 5e8 + 2e-3)
    assert collective_time("all_reduce", 1e6, 2, link) == pytest.approx(1e6 / 1e9 + 2e-3)
    # a kind without its own fit uses the link's figures
    assert collective_time("all_to_all", 1e6, 2, link) == pytest.approx(1e6 / 2 / 1e9 + 1e-3)
    sel = load_profile("cpu").for_processes(4).intra_node
    assert {k for k, _, _ in sel.kinds} == {"all_reduce", "all_gather", "reduce_scatter"}


def test_malformed_per_process_is_named():
    doc = json.loads(json.dumps(_shipped_cpu()))
    doc["per_process"] = {"two": {}}
    with pytest.raises(PlanFormatError, match="per_process"):
        parse_profile(json.dumps(doc), "bad.json")
    doc["per_process"] = {"2": {"matmul_flops": {"value": -1, "source": "x"}}}
    with pytest.raises(PlanFormatError, match="per_process.2.matmul_flops"):
        parse_profile(json.dumps(doc), "bad.json")


def _shipped_cpu() -> dict:
    from importlib import resources
    return json.loads((resources.files("autopar.cost_models") / "profiles" / "cpu.json").read_text())
