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


def _with_entries(entries: dict) -> "object":
    """The shipped cpu profile with its per-process entries replaced."""
    doc = _shipped_cpu()
    doc["per_process"] = entries
    return parse_profile(json.dumps(doc), "test.json")


def _entry(flops: float, overlap: float | None = None) -> dict:
    e = {k: {"value": v, "source": "test"} for k, v in
         (("matmul_flops", flops), ("memory_bandwidth", 1e10), ("kernel_overhead_s", 3e-6))}
    if overlap is not None:
        e["comm_overlap"] = {"value": overlap, "source": "test"}
    return e


def test_cluster_selects_its_process_count_entry():
    import autopar
    hw = autopar.Cluster("cpu", 1, 4).hardware()
    shipped = load_profile("cpu")
    assert hw.matmul_flops["fp32"] == pytest.approx(shipped.per_process[4]["matmul_flops"])
    assert hw.comm_overlap == pytest.approx(shipped.per_process[4]["comm_overlap"])
    # 4 processes on the measured machine's cores take turns
    assert hw.oversubscription == pytest.approx(4 / shipped.provenance["cpus"])
    assert load_profile("h100-sxm").comm_overlap == 1.0
    assert load_profile("h100-sxm").oversubscription == 1.0


def test_comm_overlap_entry_is_read_and_checked():
    hw = _with_entries({"2": _entry(5e10, 0.25)}).for_processes(2)
    assert hw.comm_overlap == 0.25
    assert "per_process[2]" in hw.sources["comm_overlap"]
    doc = _shipped_cpu()
    doc["per_process"] = {"2": {**_entry(5e10), "comm_overlap": {"value": "all", "source": "x"}}}
    with pytest.raises(PlanFormatError, match="per_process.2.comm_overlap"):
        parse_profile(json.dumps(doc), "bad.json")


def test_no_overlap_exposes_all_gradient_traffic(tmp_path):
    """With comm_overlap 0 every second of ZeRO-3 traffic adds to the step; with 1 the
    compute hides it."""
    import torch

    import autopar
    from autopar.examples.gpt import GPT, GPTConfig

    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=256, max_seq_len=64, dim=128, n_layers=2, n_heads=4))
    x = torch.randint(0, 256, (8, 64), device="meta")
    times = {}
    for overlap in (0.0, 1.0):
        doc = _shipped_cpu()
        doc["per_process"] = {"2": {**doc["per_process"]["2"],
                                    "comm_overlap": {"value": overlap, "source": "test"}}}
        path = tmp_path / f"cpu{overlap}.json"
        path.write_text(json.dumps(doc))
        cluster = autopar.Cluster("cpu", 1, 2, profile=str(path))
        plan = autopar.estimate(model, (x,), autopar.Spec(dp=2, zero=3), cluster=cluster,
                                precision="fp32")
        times[overlap] = plan.breakdown
    none, full = times[0.0], times[1.0]
    assert none["param_comm_s"] > 0
    assert none["exposed_param_comm_s"] == pytest.approx(none["param_comm_s"])
    assert full["exposed_param_comm_s"] < none["exposed_param_comm_s"]


def test_shared_cores_time():
    from autopar.solvers.pipelined_candidate import shared_cores_time

    # one process per core: the schedule's own time
    assert shared_cores_time(1.5, [1.0, 1.0], 0.0, 1.0) == 1.5
    # two per core, a large bubble: the cores' total work decides
    assert shared_cores_time(1.6, [1.0, 1.0], 0.1, 2.0) == pytest.approx(1.1)
    # two per core, unbalanced stages: the critical path at full speed decides
    assert shared_cores_time(4.0, [3.0, 0.2], 0.0, 2.0) == pytest.approx(2.0)
