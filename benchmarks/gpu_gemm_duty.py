"""Does a GEMM run faster between memory-bound kernels than back to back?

``autopar profile`` times each GEMM shape back to back (CUDA-graph replay). In a
training step GEMMs alternate with norms, pointwise ops and copies, which draw less
power, so the clocks under a 700 W limit may stay higher. For each GEMM shape of
:data:`SHAPES` (Llama 3 8B / 70B and GPT-3 175B layer GEMMs at 8,192 tokens), the
device time of the GEMM kernel (torch.profiler, CUDA activity) is measured:

- ``back_to_back``: ``REPS`` GEMMs in a row;
- ``interleaved``: each GEMM followed by an in-place multiply of a 256 MiB bf16 tensor
  (a memory-bound kernel of ~0.2 ms on an H100);
- ``after_idle``: each GEMM after a ~0.3 ms device sleep (``torch.cuda._sleep``).

The SM clock (nvidia-smi) is read before and after. Run on a GPU::

    python benchmarks/gpu_gemm_duty.py --out gemm_duty.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from typing import Any, Callable

import torch

SHAPES = ((8192, 4096, 4096), (8192, 14336, 4096), (8192, 4096, 14336),
          (8192, 28672, 8192), (8192, 8192, 28672), (8192, 12288 * 3, 12288),
          (8192, 49152, 12288))
"""(m, n, k): tokens × out features × in features, as F.linear computes them."""
REPS = 40


def _clock() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw",
                               "--format=csv,noheader"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "?"


def kernel_times(body: Callable[[], None], tag: str) -> list[float]:
    """Device seconds of each kernel whose name looks like a GEMM, over one call."""
    from torch.profiler import ProfilerActivity, profile

    body()  # warm-up
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        body()
        torch.cuda.synchronize()
    gemm = ("gemm", "nvjet", "cutlass", "xmma", "sm90_")
    return [e.device_time_total * 1e-6 for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA
            and any(g in e.name.lower() for g in gemm)]


def measure(m: int, n: int, k: int) -> dict[str, Any]:
    """The three modes of the module docstring for one shape."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    big = torch.randn(2**27, device="cuda", dtype=torch.bfloat16)
    lin = torch.nn.functional.linear

    def back_to_back() -> None:
        for _ in range(REPS):
            lin(x, w)

    def interleaved() -> None:
        for _ in range(REPS):
            lin(x, w)
            big.mul_(1.0)

    def after_idle() -> None:
        for _ in range(REPS):
            torch.cuda._sleep(500_000)  # cycles: ~0.3 ms at 1.7 GHz
            lin(x, w)

    out: dict[str, Any] = {"shape": [m, n, k], "flops": 2.0 * m * n * k}
    for name, body in (("back_to_back", back_to_back), ("interleaved", interleaved),
                       ("after_idle", after_idle)):
        before = _clock()
        ts = kernel_times(body, name)
        out[name] = {"median_s": statistics.median(ts), "mean_s": statistics.fmean(ts),
                     "kernels": len(ts), "clock_before": before, "clock_after": _clock()}
    b = out["back_to_back"]["median_s"]
    out["interleaved_over_back_to_back"] = out["interleaved"]["median_s"] / b
    out["after_idle_over_back_to_back"] = out["after_idle"]["median_s"] / b
    return out


def main() -> int:
    """Measure every shape and write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from autopar.cost_models.profiler_core import provenance

    rows = []
    for shape in SHAPES:
        r = measure(*shape)
        rows.append(r)
        print(f"{shape}: back-to-back {r['back_to_back']['median_s'] * 1e6:8.1f} us "
              f"({r['flops'] / r['back_to_back']['median_s'] / 1e12:5.0f} TFLOP/s)  "
              f"interleaved x{r['interleaved_over_back_to_back']:.3f}  "
              f"after idle x{r['after_idle_over_back_to_back']:.3f}  "
              f"clock {r['back_to_back']['clock_after']} / {r['interleaved']['clock_after']}",
              flush=True)
    with open(args.out, "w") as f:
        json.dump({"provenance": provenance(torch.device("cuda")), "reps": REPS,
                   "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
