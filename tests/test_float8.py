"""Precision "fp8": which products run in float8, what they cost, and where it is refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from autopar.cost_models.float8 import (CAST_BYTES_BACKWARD_GRAD, CAST_BYTES_BACKWARD_WEIGHT,
                                        CAST_BYTES_FORWARD_INPUT, CAST_BYTES_FORWARD_WEIGHT,
                                        NOT_RUN, float8_linear_time, float8_rate_ratio,
                                        runs_float8)
from autopar.cost_models.hardware import load_profile
from autopar.cost_models.tables import gemm_time
from autopar.errors import ConfigError, LoweringError

M, H = 8192, 4096


class ThreeProducts(nn.Module):
    """An aligned Linear (float8), a Linear with a side not a multiple of 16 and a
    product with a root parameter (both bf16), each (M, H) @ (H, H)-ish."""

    def __init__(self) -> None:
        super().__init__()
        self.aligned = nn.Linear(H, H, bias=False)
        self.odd = nn.Linear(H, H - 8, bias=False)
        self.w = nn.Parameter(torch.empty(H, H - 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.odd(self.aligned(x))
        return F.linear(y, self.w).float().pow(2).mean()


def _plan(precision: str, gpu: str = "h100-sxm") -> autopar.Plan:
    with torch.device("meta"):
        model, x = ThreeProducts(), torch.empty(1, M, H)
    return autopar.estimate(model, (x,), autopar.Spec(dp=1), global_batch=1,
                            cluster=autopar.Cluster(gpu, 1, 1), precision=precision,
                            loss_fn=lambda out, _t: out)


def test_only_aligned_linear_products_run_in_float8() -> None:
    assert runs_float8("fp8", "aten.linear.default", "Linear", (4096, 1024))
    assert not runs_float8("fp8", "aten.linear.default", "Linear", (4096, 1000))
    assert not runs_float8("fp8", "aten.linear.default", "GPT", (4096, 1024))  # root F.linear
    assert not runs_float8("fp8", "aten.mm.default", "Conv1D", (4096, 1024))  # HF GPT-2
    assert not runs_float8("bf16", "aten.linear.default", "Linear", (4096, 1024))
    assert not runs_float8("fp8", "aten.add.Tensor", "Linear", (4096, 1024))


def test_a_float8_linear_costs_its_products_at_the_float8_rate_plus_its_casts() -> None:
    hw = load_profile("h100-sxm")
    m, n, k = 8192.0, 4096.0, 4096.0
    bw, ratio = hw.achieved_memory_bandwidth, float8_rate_ratio(hw)
    fwd_bf16 = gemm_time(hw.tables, m, n, k, "bf16")
    bwd_bf16 = [gemm_time(hw.tables, m, k, n, "bf16"), gemm_time(hw.tables, n, k, m, "bf16")]
    fwd = float8_linear_time([fwd_bf16], (m, n, k), backward=False, hw=hw)
    bwd = float8_linear_time(bwd_bf16, (m, n, k), backward=True, hw=hw)
    assert fwd == pytest.approx(fwd_bf16 / ratio + (m * k * CAST_BYTES_FORWARD_INPUT
                                                    + n * k * CAST_BYTES_FORWARD_WEIGHT) / bw)
    assert bwd == pytest.approx(sum(bwd_bf16) / ratio + (m * n * CAST_BYTES_BACKWARD_GRAD
                                                         + n * k * CAST_BYTES_BACKWARD_WEIGHT) / bw)
    assert 1.5 < ratio < 2.0


def test_the_profile_reproduces_torchaos_h100_linear_benchmark() -> None:
    """The float8 rate is derived from torchao's H100 benchmark (a compiled float8 Linear
    of (M, K, N) = (4096, 8192, 16384) ran 1.39x its bf16 forward + backward): with the
    cast model beside it, the profile must give that speedup back."""
    hw = load_profile("h100-sxm")
    m, k, n = 4096.0, 8192.0, 16384.0
    parts = [gemm_time(hw.tables, m, n, k, "bf16"), gemm_time(hw.tables, m, k, n, "bf16"),
             gemm_time(hw.tables, n, k, m, "bf16")]
    fp8 = (float8_linear_time(parts[:1], (m, n, k), backward=False, hw=hw)
           + float8_linear_time(parts[1:], (m, n, k), backward=True, hw=hw))
    assert sum(parts) / fp8 == pytest.approx(1.39, abs=0.01)


def test_fp8_plans_run_only_the_aligned_linear_faster() -> None:
    hw = load_profile("h100-sxm")
    bf16, fp8 = _plan("bf16"), _plan("fp8")
    m, n, k = float(M), float(H), float(H)
    parts = [gemm_time(hw.tables, m, n, k, "bf16"), gemm_time(hw.tables, m, k, n, "bf16"),
             gemm_time(hw.tables, n, k, m, "bf16")]
    saved = sum(parts) - (float8_linear_time(parts[:1], (m, n, k), backward=False, hw=hw)
                          + float8_linear_time(parts[1:], (m, n, k), backward=True, hw=hw))
    got = bf16.breakdown["compute_s"] - fp8.breakdown["compute_s"]
    assert got == pytest.approx(saved, rel=1e-6)
    assert fp8.precision == "fp8" and fp8.mfu > bf16.mfu  # both against the bf16 peak
    assert fp8.memory_per_device_bytes == bf16.memory_per_device_bytes


def test_fp8_is_refused_where_the_gpu_has_no_float8_tensor_cores() -> None:
    with pytest.raises(ConfigError) as e:
        _plan("fp8", gpu="a100-80g")
    assert str(e.value) == ("precision 'fp8' needs float8 tensor cores, and the profile "
                            "'a100-80g' lists none (H100, H200 and later GPUs have them); "
                            "use precision 'bf16'")


def test_an_fp8_plan_is_priced_but_not_run() -> None:
    from autopar.runtime.lower import check_plan

    plan = _plan("fp8")
    with torch.device("meta"):
        model = ThreeProducts()
    with pytest.raises(LoweringError) as e:
        check_plan(model, plan)
    assert str(e.value) == NOT_RUN
    with pytest.raises(ConfigError) as e:
        autopar.parallelize(model, (torch.empty(1, M, H, device="meta"),), precision="fp8")
    assert str(e.value) == NOT_RUN
