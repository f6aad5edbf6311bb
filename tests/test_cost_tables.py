"""Measured compute tables: interpolation exact at measured points and monotone in size,
measured profiles load through Cluster(profile=...), malformed ones fail clearly."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import autopar
from autopar.cost_models.compute import OpShapes, compute_time, op_time
from autopar.cost_models.hardware import load_profile
from autopar.cost_models.profiling.run import run_profile
from autopar.cost_models.tables import (ComputeTables, attention_time, gemm_time,
                                        isotonic_gemm, memory_bound_time, tables_from_profile)
from autopar.errors import PlanFormatError

H100 = load_profile("h100-sxm")


def test_gemm_exact_at_measured_points():
    t = H100.tables
    for m, n, k, s in t.gemm["bf16"][::7]:
        assert gemm_time(t, m, n, k, "bf16") == pytest.approx(s, rel=1e-12)


@pytest.mark.parametrize("n,k", [(4096, 4096), (8192, 8192), (4096, 14336)])
def test_gemm_monotone_in_size(n, k):
    t = H100.tables
    times = [gemm_time(t, m, n, k, "bf16") for m in [2 ** e for e in range(0, 14)] + [12000]]
    times = [x for x in times if x is not None]
    assert len(times) >= 8
    # strictly monotone from m = 64 on; among skinny shapes (m < 64, latency-bound, not
    # measured at every (n, k)) the weighted rates of neighbours may dip by up to 25%
    big = times[6:]
    assert all(b >= a * (1 - 1e-9) for a, b in zip(big, big[1:]))
    assert all(b >= 0.75 * a for a, b in zip(times, times[1:]))


def test_synthetic_gemm_grid_exact_and_monotone():
    rows = tuple((float(m), float(n), float(k), 1e-6 + 2 * m * n * k / (1e12 * (1 + math.log(m))))
                 for m in (64, 256, 1024) for n in (64, 256, 1024) for k in (64, 1024))
    t = ComputeTables(gemm={"fp32": isotonic_gemm(rows)})
    for m, n, k, s in rows:
        assert gemm_time(t, m, n, k, "fp32") == pytest.approx(s, rel=1e-12)
    line = [gemm_time(t, m, 300, 500, "fp32") for m in range(64, 1025, 32)]
    assert all(b >= a for a, b in zip(line, line[1:]))
    assert gemm_time(t, 4096, 64, 64, "fp32") is None  # outside the table: roofline


def test_memory_bound_exact_and_monotone():
    t = H100.tables
    rows = t.memory_bound[("rms_norm", "fwd", "bf16")]
    for b, s in rows:
        assert memory_bound_time(t, "rms_norm", b, "bf16", "fwd") == pytest.approx(s)
    sizes = [2.0 ** e for e in range(16, 34)]
    times = [memory_bound_time(t, "rms_norm", b, "bf16", "fwd") for b in sizes]
    assert all(b >= a for a, b in zip(times, times[1:]))


def test_attention_exact_at_measured_points():
    t = H100.tables
    rows = t.attention[("bf16", "fwd")]
    coords = [r[:3] for r in rows]
    unique = [r for r in rows if coords.count(r[:3]) == 1]  # GQA rows share coordinates
    for bh, seq, d, rate in unique[::5]:
        flops = 2.0 * bh * seq * seq * 2 * d / 2
        assert attention_time(t, bh, seq, d, flops, "bf16", "fwd") == pytest.approx(flops / rate)


def test_op_time_uses_tables_and_launch_floor():
    x, w = (8192, 4096), (4096, 4096)
    shapes = OpShapes("aten.linear.default", (x, w), (8192, 4096))
    flops = 2.0 * 8192 * 4096 * 4096
    t = op_time(shapes, flops, 0.0, backward=False, dtype="bf16", hw=H100)
    assert t == pytest.approx(gemm_time(H100.tables, 8192, 4096, 4096, "bf16"))
    tiny = OpShapes("aten.linear.default", ((1, 8), (8, 8)), (1, 8))
    assert op_time(tiny, 128.0, 100.0, backward=False, dtype="bf16", hw=H100) == \
        pytest.approx(H100.kernel_overhead_s)



@pytest.fixture(scope="module")
def quick_profile(tmp_path_factory):
    """A measured CPU profile written by the profiler on a small grid (seconds), its host
    figures measured once (their median over rounds: test_profiler.py)."""
    from autopar.cost_models.profiling.grid import Grid

    grid = Grid(gemm=tuple((m, m, m, "fp32", "square") for m in (32, 64, 128, 256)),
                attention=((2, 4, 4, 64, 16, "fp32"),), pointwise=((4096, "fp32"), (65536, "fp32")),
                rows=((64, 128, "fp32"),), embedding=((64, 128, 64, "fp32"),),
                cross_entropy=((64, 128, "fp32"),), comm_sizes=(), budget_s=0.002,
                host_rounds=1)
    out = tmp_path_factory.mktemp("prof") / "cpu.profile.json"
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run_profile(out, grid=grid, device=torch.device("cpu"))
    finally:
        torch.set_num_threads(old)
    return out


def test_quick_profile_loads_and_plans_like_shipped(quick_profile):
    from autopar.examples.gpt import GPT, GPTConfig

    measured = autopar.Cluster("cpu", 1, 2, profile=str(quick_profile))
    hw = measured.hardware()
    assert hw.tables is not None and hw.tables.gemm["fp32"]
    assert "autopar profile" in hw.sources["tables"]
    shipped = autopar.Cluster("cpu", 1, 2)
    assert hw.intra_node == shipped.hardware().intra_node  # no collectives measured: base's
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=128, max_seq_len=32, dim=64, n_layers=2, n_heads=4))
    x = torch.randint(0, 128, (4, 32), device="meta")
    a = autopar.plan(model, (x,), cluster=measured, precision="fp32")
    b = autopar.plan(model, (x,), cluster=shipped, precision="fp32")
    # Same machine kind: the measured profile's choice, scored with the shipped
    # profile, costs at most 50% more than the shipped profile's own choice.
    mesh = autopar.Spec(**{k: a.mesh.get(k, 1) for k in ("dp", "tp", "pp", "cp", "ep")})
    again = autopar.estimate(model, (x,), mesh, cluster=shipped, precision="fp32")
    assert again.step_time_s <= 1.5 * b.step_time_s
    # If every op's time changes by a factor in [lo, hi] (communication: 1), every
    # plan's step time does too, and so does the fastest one. The factors are the
    # measured rows' times over the shipped profile's times for the same ops (x1.5 for
    # shapes between measured rows).
    ratios = _measured_over_shipped(json.loads(quick_profile.read_text()), shipped.hardware())
    lo, hi = min(ratios + [1.0]) / 1.5, max(ratios + [1.0]) * 1.5
    assert lo <= a.step_time_s / b.step_time_s <= hi


def _measured_over_shipped(doc: dict, shipped) -> list[float]:
    """Each measured row's time over the shipped profile's time for the same op."""
    t = doc["tables"]
    out = [r["seconds"] / compute_time(r["flops"], 4.0 * (r["m"] * r["k"] + r["k"] * r["n"]
                                                          + r["m"] * r["n"]),
                                       matmul=True, dtype="fp32", hw=shipped)
           for r in t["gemm"]]
    out += [r["seconds"] / compute_time(r["flops"], 0.0, matmul=True, dtype="fp32", hw=shipped)
            for r in t["attention"]]
    out += [r["seconds"] / compute_time(0.0, r["bytes"], matmul=False, dtype="fp32", hw=shipped)
            for r in t["memory_bound"]]
    return out + [t["launch"][0]["seconds"] / shipped.kernel_overhead_s]


def test_malformed_profile_one_clear_error(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "autopar-profile/1", "provenance": {"device_type": "cpu"},
                               "tables": {"gemm": [{"m": 1, "seconds": 1.0}]}}))
    with pytest.raises(PlanFormatError, match="table 'gemm' has a malformed row"):
        autopar.Cluster("cpu", 1, 1, profile=str(bad))
    with pytest.raises(PlanFormatError, match="'tables' must be an object"):
        tables_from_profile({"tables": 3}, "x.json")


def test_h200_profile_prices_memory_bound_ops_at_its_own_bandwidth():
    """The H200 profile reads its own measured tables: a 1 GiB copy (4.21 TB/s there,
    2.95 on the H100, measured) is priced faster; the layer GEMMs (same tensor cores,
    same clocks) agree within 5% on average, as one point of a table moves by up to ~5%
    between runs of one GPU (benchmarks/results/README.md)."""
    h200 = load_profile("h200-sxm")
    assert h200.name == "h200" and h200.tables is not None
    copy = [memory_bound_time(p.tables, "copy", 2**30, "bf16", "fwd") for p in (h200, H100)]
    assert copy[0] < 0.8 * copy[1]
    shapes = ((4096, 4096, 4096), (8192, 8192, 8192), (8192, 14336, 4096),
              (8192, 4096, 14336), (8192, 28672, 8192), (8192, 49152, 12288))
    ratios = [gemm_time(h200.tables, *s, "bf16") / gemm_time(H100.tables, *s, "bf16")
              for s in shapes]
    assert math.prod(ratios) ** (1 / len(ratios)) == pytest.approx(1.0, rel=0.05)


def test_plan_summary_states_the_profiles_measured_error():
    """A plan on a profile checked against runs says how far its figures held; one on
    a datasheet-only profile says it was never measured, and each how far the prices
    of published multi-GPU runs on its GPU fell from their step times."""
    from autopar.examples.mlp import MLP

    x = torch.randn(8, 784)
    lines = {}
    for gpu in ("h100-sxm", "a100-80g"):
        plan = autopar.estimate(MLP(), (x,), autopar.Spec(dp=1), precision="bf16",
                                cluster=autopar.Cluster(gpu, 1, 1))
        lines[gpu] = plan.summary()
    acc = H100.accuracy
    assert (f"(profile h100-sxm measured {acc['date']}: one-GPU steps within "
            f"{acc['step_error_pct']:.1f}%; layers MAPE {acc['layer_mape_pct']:.1f}%") \
        in lines["h100-sxm"]
    runs = H100.accuracy["published_runs"]
    assert (f"; published multi-GPU runs priced within {runs['median_abs_pct']}% (median; max "
            f"{runs['max_abs_pct']}%) over {runs['runs']} run(s) from {runs['sources']} "
            "source(s))") in lines["h100-sxm"]
    assert ("(profile a100-80g: datasheet and first-principles figures, never measured on its "
            "GPU; published multi-GPU runs priced within 32% (median; max 34%) over 4 run(s) "
            "from 2 source(s))") in lines["a100-80g"]


def test_accuracy_record_needs_its_source(tmp_path):
    from autopar.cost_models import hardware

    data = json.loads((Path(hardware.__file__).parent / "profiles" / "a100-80g.json").read_text())
    data["accuracy"] = {"layer_mape_pct": 5.0}
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanFormatError, match="'accuracy' must be an object with a 'source'"):
        load_profile(str(path))
