"""NCCL's size-dependent collective pricing (cost_models/comm.py), the derived
``h100-sxm-500w`` profile and the α-β fallback the CPU profile keeps."""

from __future__ import annotations

import math

import pytest

from autopar.cost_models.comm import bucketed_time, collective_time, ring_shape
from autopar.cost_models.compute import compute_time
from autopar.cost_models.hardware import (LinkSpec, available_profiles, load_profile,
                                          parse_profile)
from autopar.cost_models.tables import gemm_time
from autopar.errors import PlanFormatError

MB = 2 ** 20


def _busbw(kind: str, nbytes: float, n: int, link: LinkSpec) -> float:
    """nccl-tests' bus bandwidth of one collective as priced."""
    _, traffic = ring_shape(kind, nbytes, n)
    return traffic / collective_time(kind, nbytes, n, link)


def test_a_large_all_gather_on_nvlink_is_the_simple_ring_at_its_achieved_bandwidth() -> None:
    """64 MiB gathered over 8 H100s: NCCL's Simple ring, 8.4 us + 7 steps of 3.4 us
    plus 7/8 of the buffer at 370 GB/s (by hand: 190.9 us, bus bandwidth 307.6 GB/s)."""
    link = load_profile("h100-sxm").intra_node
    t = collective_time("all_gather", 64 * MB, 8, link)
    assert t == pytest.approx(8.4e-6 + 7 * 3.4e-6 + 7 / 8 * 64 * MB / 370e9, rel=1e-12)
    assert t == pytest.approx(190.9e-6, abs=0.1e-6)
    assert collective_time("reduce_scatter", 64 * MB, 8, link) == t


def test_a_small_all_gather_takes_the_low_latency_protocol() -> None:
    """1 MiB over 8 H100s: LL (6.6 us + 7 x 0.6 us, 87.7 GB/s) beats LL128 and Simple."""
    link = load_profile("h100-sxm").intra_node
    want = 6.6e-6 + 7 * 0.6e-6 + 7 / 8 * MB / 87.7e9
    assert collective_time("all_gather", MB, 8, link) == pytest.approx(want, rel=1e-12)


def test_a_large_all_reduce_on_eight_h100s_runs_on_nvlink_sharp() -> None:
    """1 GiB all-reduce over 8: 23 us + the buffer at NVLS's 275 GB/s algorithm
    bandwidth, a bus bandwidth of ~480 GB/s as nccl-tests reports; over 2 GPUs the
    ring's 370 GB/s algorithm bandwidth wins."""
    link = load_profile("h100-sxm").intra_node
    t = collective_time("all_reduce", 1024 * MB, 8, link)
    assert t == pytest.approx(23e-6 + 1024 * MB / 275e9, rel=1e-12)
    assert 470e9 < _busbw("all_reduce", 1024 * MB, 8, link) < 482e9
    two = collective_time("all_reduce", 1024 * MB, 2, link)
    assert two == pytest.approx(8.4e-6 + 2 * 3.4e-6 + 1024 * MB / 370e9, rel=1e-12)


@pytest.mark.parametrize("profile", ["h100-sxm", "h200", "a100-80g"])
@pytest.mark.parametrize("level", ["intra_node", "inter_node"])
@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter", "all_reduce"])
def test_time_and_bus_bandwidth_grow_with_size_and_saturate_below_line_rate(
        profile: str, level: str, kind: str) -> None:
    """From 1 KiB to 8 GiB the time and the bus bandwidth never fall, and the ring
    collectives stay below the link's line rate (NCCL's protocol overhead)."""
    link = getattr(load_profile(profile), level)
    n = 8 if level == "intra_node" else 16
    sizes = [2.0 ** e for e in range(10, 34)]
    times = [collective_time(kind, s, n, link) for s in sizes]
    bws = [_busbw(kind, s, n, link) for s in sizes]
    assert all(b >= a for a, b in zip(times, times[1:]))
    assert all(b >= a * (1 - 1e-12) for a, b in zip(bws, bws[1:]))
    if kind != "all_reduce" or not link.algorithms or profile == "a100-80g":
        assert bws[-1] < link.bandwidth
    assert bws[-1] > 0.75 * link.bandwidth


def test_across_nodes_a_ring_saturates_at_the_nics_achieved_bandwidth() -> None:
    """16 H100s across 2+ nodes: 1 GiB all-gathers at ~46.5 GB/s bus bandwidth (47 GB/s
    achieved per 400 Gb/s NIC), 1 MiB at about a fifth of it."""
    link = load_profile("h100-sxm").inter_node
    assert _busbw("all_gather", 1024 * MB, 16, link) == pytest.approx(46.5e9, rel=0.01)
    assert _busbw("all_gather", MB, 16, link) < 0.25 * 47e9


def test_the_parts_of_one_bucket_add_up_to_the_bucket() -> None:
    """FSDP2 issues one collective per unit: its tensors' parts sum to one collective
    of the unit's bytes, whichever protocol that size takes."""
    link = load_profile("h100-sxm").intra_node
    for total in (MB, 64 * MB, 2048 * MB):
        parts = sum(bucketed_time("all_gather", total * s, 8, link, s) for s in (0.1, 0.3, 0.6))
        assert parts == pytest.approx(collective_time("all_gather", total, 8, link), rel=1e-9)


def test_the_cpu_profiles_measured_gloo_fits_still_price_alpha_beta() -> None:
    """No algorithms on the CPU profile: its per-kind α-β fits price as before."""
    hw = load_profile("cpu").for_processes(4)
    link = hw.intra_node
    assert not link.algorithms
    for kind in ("all_reduce", "all_gather", "reduce_scatter"):
        k = link.for_kind(kind)
        steps, traffic = ring_shape(kind, 4 * MB, 4)
        want = steps * k.latency + traffic / k.bandwidth
        assert collective_time(kind, 4 * MB, 4, link) == pytest.approx(want, rel=1e-12)


def test_a_bandwidth_override_scales_the_achieved_bandwidths() -> None:
    """--intra-node-bandwidth 225 (half the line rate) halves every algorithm's rate."""
    hw = load_profile("h100-sxm")
    half = hw.with_overrides(intra_node_bandwidth=225).intra_node
    assert [a.bandwidth for a in half.algorithms] == pytest.approx(
        [a.bandwidth / 2 for a in hw.intra_node.algorithms])


def test_a_malformed_algorithm_names_its_field() -> None:
    text = ('{"base": "h100-sxm", "name": "x", "intra_node": {"algorithms": '
            '{"ring": {"base_latency": 1e-6, "step_latency": 1e-6}}}}')
    with pytest.raises(PlanFormatError, match="intra_node.algorithms.ring"):
        parse_profile(text)


def test_the_500w_profile_prices_tensor_core_work_at_the_stated_clock_factor() -> None:
    """h100-sxm-500w derives from h100-sxm: GEMMs (measured tables and roofline alike)
    and attention at 0.890 of the 700 W rate, memory-bound ops and links unchanged."""
    full, capped = load_profile("h100-sxm"), load_profile("h100-sxm-500w")
    factor = 0.890
    assert capped.provenance["base_profile"] == "h100-sxm"
    # none of the 700 W profile's one-GPU checks carried over: only its own record
    assert set(capped.accuracy) == {"source", "published_runs"}
    t700 = gemm_time(full.tables, 8192, 8192, 8192, "bf16")
    t500 = gemm_time(capped.tables, 8192, 8192, 8192, "bf16")
    assert t500 == pytest.approx(t700 / factor, rel=1e-9)
    flops = 2 * 16384.0 ** 3  # beyond the tables: the roofline
    r700 = compute_time(flops, 0.0, matmul=True, dtype="bf16", hw=full)
    r500 = compute_time(flops, 0.0, matmul=True, dtype="bf16", hw=capped)
    assert r700 / r500 == pytest.approx(capped.matmul_efficiency["bf16"]
                                        / full.matmul_efficiency["bf16"], rel=1e-9)
    assert math.isclose(capped.matmul_efficiency["bf16"], 0.674 * factor, abs_tol=1e-3)
    assert capped.memory_bandwidth == full.memory_bandwidth
    assert capped.tables.memory_bound == full.tables.memory_bound
    assert capped.intra_node == full.intra_node and capped.host_overhead_s == full.host_overhead_s
    assert "h100-sxm-500w" in available_profiles()
