"""The profilers (``autopar profile``, the ``cpu`` profile): the α-β fit, a tiny CPU run,
resume, collectives."""

from __future__ import annotations

import io
import json
from dataclasses import replace
from importlib import resources
import socket
from pathlib import Path

import numpy as np
import pytest
import torch

from autopar.cost_models.comm import ring_shape
from autopar.cost_models.hardware import CPU_PROFILE_NOTE, load_profile
from autopar.cost_models.profiling.cpu import SIZES, per_process_entry
from autopar.cost_models.profiling.fit import fit_alpha_beta, fit_table, ring_link
from autopar.cost_models.profiling.grid import Grid
from autopar.cost_models.profiling.host_dispatch import DISPATCH_KEYS
from autopar.cost_models.profiling.host_wrappers import (DTENSOR_OP_KEYS, HOST_KEYS,
                                                         REDISTRIBUTE_KEYS)
from autopar.cost_models.profiling.run import (load_partial, partial_path, run_profile,
                                               summary_lines)
from autopar.errors import PlanFormatError
from tests.dist_utils import RankPool

TINY = Grid(gemm=((32, 32, 32, "fp32", "square"), (64, 16, 32, "fp32", "ffn_col_tp2")),
            attention=((1, 2, 2, 32, 16, "fp32"),), pointwise=((1024, "fp32"),),
            rows=((8, 32, "fp32"),), embedding=((8, 64, 16, "fp32"),),
            cross_entropy=((8, 64, "fp32"),), comm_sizes=(1024, 65536), budget_s=0.002,
            host=False)


@pytest.fixture
def one_thread():
    """One intra-op thread: keeps the tiny timings quick on a shared machine."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def test_fit_recovers_alpha_beta_exactly():
    alpha, beta = 7e-6, 120e9
    sizes = [2.0**k for k in range(10, 31, 2)]
    fit = fit_alpha_beta(sizes, [alpha + s / beta for s in sizes])
    assert fit.alpha == pytest.approx(alpha, rel=1e-6)
    assert fit.beta == pytest.approx(beta, rel=1e-6)
    assert fit.max_rel_error < 1e-9


def test_fit_is_least_squares_on_the_seconds():
    """Three points off a line, by hand: B = 1, 2, 3 MB at 3, 5, 6 ms; the line through
    their means (2 MB, 14/3 ms) with slope 3 ms / 2 MB gives α = 5/3 ms and
    β = 1/(1.5e-9 s/B); the largest relative residual is 1/3 ms on 5 ms."""
    fit = fit_alpha_beta([1e6, 2e6, 3e6], [3e-3, 5e-3, 6e-3])
    assert fit.alpha == pytest.approx(5e-3 / 3, rel=1e-9)
    assert fit.beta == pytest.approx(1 / 1.5e-9, rel=1e-9)
    assert fit.max_rel_error == pytest.approx((1e-3 / 3) / 5e-3, rel=1e-9)


def test_the_cpu_profiles_fits_keep_their_ring_least_squares():
    """The shipped ``cpu`` profile's gloo fits were least squares of the ring model,
    ``t = steps·α + traffic/β`` with α per step and β per link: the one fit read per
    link gives the same figures on its stored seconds."""
    doc = json.loads((resources.files("autopar.cost_models") / "profiles" / "cpu.json")
                     .read_text())
    checked = 0
    for n, entry in doc["per_process"].items():
        for kind in ("all_reduce", "all_gather", "reduce_scatter"):
            if kind not in entry:
                continue
            times = entry[kind]["seconds"]
            steps, traffic = ring_shape(kind, 1.0, int(n))
            x = np.array([[steps, traffic * s] for s in SIZES], dtype=float)
            (alpha, inv_beta), *_ = np.linalg.lstsq(x, np.array(times), rcond=None)
            link = ring_link(fit_alpha_beta([float(s) for s in SIZES], times), kind, int(n))
            assert link.latency == pytest.approx(max(alpha, 0.0), rel=1e-9)
            assert link.bandwidth == pytest.approx(1 / inv_beta, rel=1e-9)
            checked += 1
    assert checked == 6


def test_the_cpu_profile_names_every_host_figure():
    """Each host figure the ``cpu`` profile measures at 2 processes gets its value and a
    source saying where it was measured (made-up values)."""
    keys = HOST_KEYS + DTENSOR_OP_KEYS + REDISTRIBUTE_KEYS
    measured = {"gemm_flops": 1e9, "copy_bandwidth": 1e10, "op_overhead_s": 1e-5,
                "host_overhead_s": {k: 1e-6 for k in keys}, "comm_overlap": 0.5,
                "collectives": {"all_reduce": {"bandwidth": 1e9, "latency": 1e-3,
                                               "seconds": [1e-3, 2e-3]}}}
    host = per_process_entry(2, measured, "here")["host_overhead_s"]
    assert set(host) == set(keys)
    assert all(h["value"] == 1e-6 and h["source"].startswith("here, 2 concurrent one-thread "
                                                             "processes: ")
               for h in host.values())
    assert "DTensor (per pointwise op run on it) adds per backward" in \
        host["dtensor_op_bwd"]["source"]


def test_fit_table_applies_ring_factor():
    alpha, beta, n = 10e-6, 100e9, 4
    rows = [{"op": "all_reduce", "world": n, "bytes": s, "seconds": alpha + s / beta}
            for s in (1e3, 1e5, 1e7, 1e9)]
    fit = fit_table(rows)["all_reduce/4"]
    assert (fit["ring_factor"], fit["latency_steps"]) == (1.5, 6)
    assert fit["bus_bandwidth_bytes_per_s"] == pytest.approx(beta * 1.5, rel=1e-3)
    assert fit["alpha_per_step_s"] == pytest.approx(alpha / 6, rel=1e-3)


def test_tiny_cpu_run_writes_profile(tmp_path: Path, one_thread):
    out = tmp_path / "cpu.profile.json"
    progress = io.StringIO()
    doc = run_profile(out, grid=replace(TINY, host=True, host_rounds=1),
                      device=torch.device("cpu"), stream=progress)
    assert doc is not None and out.exists() and not partial_path(out).exists()
    said = progress.getvalue().splitlines()  # a line per phase, with the time so far
    assert said[0].startswith("profile: ") and said[0].endswith(f"; writing {out}")
    phases = [s for s in said if s.startswith("profile: host overheads: ")]
    assert len(phases) == 5 and all(s.endswith("s elapsed") for s in phases)
    assert doc["provenance"]["purpose"] == CPU_PROFILE_NOTE
    lines = summary_lines(doc)
    assert lines[0].startswith("device ") and lines[1].startswith("best GEMM fp32 ")
    text = out.read_text()
    assert socket.gethostname() not in text
    d = json.loads(text)
    assert d["format"] == "autopar-profile/1"
    prov = d["provenance"]
    for key in ("date", "torch", "device_name", "device_type", "timing"):
        assert prov[key], key
    assert prov["torch"] == torch.__version__ and prov["device_type"] == "cpu"
    t = d["tables"]
    assert [r["key"] for r in t["gemm"]] == ["32x32x32:fp32", "64x16x32:fp32"]
    for r in t["gemm"]:
        assert r["flops"] == 2 * r["m"] * r["n"] * r["k"]
        assert r["seconds"] > 0 and r["flop_per_s"] == pytest.approx(r["flops"] / r["seconds"],
                                                                     rel=1e-3)
    assert {r["pass"] for r in t["attention"]} == {"fwd", "bwd"}
    ops = {(r["op"], r["pass"]) for r in t["memory_bound"]}
    assert {("copy", "fwd"), ("mul", "bwd"), ("layer_norm", "bwd"), ("rms_norm", "fwd"),
            ("softmax", "bwd"), ("embedding", "bwd"), ("cross_entropy", "bwd")} <= ops
    assert all(r["bytes_per_s"] > 0 for r in t["memory_bound"])
    assert {r["what"] for r in t["launch"]} == {"host_dispatch", "device_back_to_back",
                                                "round_trip"}
    assert t["collectives"] == [] and d["errors"] == []
    assert d["summary"]["gemm_peak_flop_per_s"]["fp32"]["flop_per_s"] > 0
    host = d["host_overhead_s"]
    assert set(host) == set(HOST_KEYS) | set(DTENSOR_OP_KEYS) | set(DISPATCH_KEYS)
    assert all(v >= 0.0 for v in host.values())
    assert host["op_matmul_fwd"] > 0 and host["op_matmul_bwd"] > 0
    assert load_profile(str(out)).host_overhead_s == pytest.approx(host)


def test_resume_skips_finished_points(tmp_path: Path, one_thread):
    out = tmp_path / "p.json"
    # a run stopped by its time limit before any point leaves only the header
    assert run_profile(out, grid=TINY, device=torch.device("cpu"), time_limit=0.0) is None
    part = partial_path(out)
    header = json.loads(part.read_text().splitlines()[0])
    assert "provenance" in header and not out.exists()
    # pretend two points were measured before the interruption, with marker values
    done = [{"table": "gemm", "key": "32x32x32:fp32", "m": 32, "n": 32, "k": 32,
             "dtype": "fp32", "seconds": 123.0, "flop_per_s": 1.0},
            {"table": "launch", "key": "round_trip", "what": "round_trip", "seconds": 456.0}]
    with part.open("a") as f:
        for r in done:
            f.write(json.dumps(r) + "\n")
    doc = run_profile(out, grid=TINY, device=torch.device("cpu"), resume=True)
    assert doc is not None and not part.exists()
    gemm = {r["key"]: r for r in doc["tables"]["gemm"]}
    assert gemm["32x32x32:fp32"]["seconds"] == 123.0          # kept, not re-measured
    assert gemm["64x16x32:fp32"]["seconds"] < 1.0             # measured now
    launch = {r["key"]: r["seconds"] for r in doc["tables"]["launch"]}
    assert launch["round_trip"] == 456.0 and launch["host_dispatch"] < 1.0
    assert [r["key"] for r in doc["tables"]["gemm"]] == ["32x32x32:fp32", "64x16x32:fp32"]


def test_resume_refuses_another_device(tmp_path: Path):
    part = tmp_path / "p.json.partial.jsonl"
    part.write_text(json.dumps({"provenance": {"device_name": "NVIDIA H100"}}) + "\n")
    with pytest.raises(PlanFormatError, match="NVIDIA H100"):
        load_partial(part, "some CPU")


def _comm_rows() -> list[dict]:
    """Run inside each rank: the profiler's timing rows of every collective."""
    from autopar.cost_models.profiling.collectives import measure_collectives

    return measure_collectives([1024, 16384, 262144], torch.device("cpu"), reps=3)


@pytest.mark.multirank
def test_collectives_on_two_gloo_ranks(rank_pool: RankPool):
    rows = rank_pool.run(2, _comm_rows)[0]
    assert {r["op"] for r in rows} == {"all_reduce", "all_gather", "reduce_scatter",
                                       "all_to_all", "send_recv"}
    assert all("error" not in r and r["seconds"] > 0 and r["world"] == 2 for r in rows)
    fits = fit_table(rows)
    assert set(fits) == {f"{op}/2" for op in ("all_reduce", "all_gather", "reduce_scatter",
                                             "all_to_all", "send_recv")}
    assert all(f["beta_bytes_per_s"] > 0 for f in fits.values())


def test_host_figures_are_the_median_of_their_rounds(monkeypatch) -> None:
    """``measure_host`` keeps each figure's median over its rounds."""
    from autopar.cost_models.profiling import host_wrappers

    rounds = iter([{"a": 1.0, "b": 9.0}, {"a": 5.0, "b": 7.0}, {"a": 2.0, "b": 8.0}])
    monkeypatch.setattr(host_wrappers, "host_overhead", lambda *a, **k: next(rounds))
    got = host_wrappers.measure_host(torch.device("cpu"), rounds=3)
    assert got == {"a": 2.0, "b": 8.0}


def test_a_measured_profile_does_not_claim_its_bases_accuracy() -> None:
    """The shipped h100-sxm profile carries how its figures were checked on runs; a
    file `autopar profile` measured is completed from it but was never checked so."""
    import warnings

    from autopar.cost_models.hardware import accuracy_text, load_profile

    path = Path(__file__).resolve().parent.parent / "benchmarks/results/h100_quick_profile.json"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # measured under another torch release
        measured = load_profile(str(path))
    assert load_profile("h100-sxm").accuracy and measured.accuracy == {}
    assert accuracy_text(measured.name, measured.accuracy).endswith(
        "(measured: " + str(path) + "): kernel rates measured on its GPU, never checked "
        "against whole training steps there")
