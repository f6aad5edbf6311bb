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

The SM clock (nvidia-smi) is read before and after. With ``--layouts`` it measures
instead, per shape and after ``HEAT_S`` of back-to-back GEMMs (the device as warm and
power-limited as in a training step), each operand layout of a layer's three GEMMs
with ``autopar profile``'s own timer (CUDA events and CUDA-graph replay), so the rows
compare with the profile's table, which times ``torch.mm`` of row-major operands
(``NN``) only:

- ``NT``: ``x @ w.T``, the forward of ``F.linear`` (m tokens, n out, k in features);
- ``NN``: ``dy @ w``, its input gradient, timed at the forward's (m, n, k);
- ``TN``: ``dy.T @ x``, its weight gradient, timed at the forward's (m, n, k);
- ``NN`` again at the end, to show the drift of the clocks over the shape's rows.

Run on a GPU::

    python benchmarks/gpu_gemm_duty.py --out gemm_duty.json
    python benchmarks/gpu_gemm_duty.py --layouts --out gemm_layouts.json
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
HEAT_S = 1.0
"""Seconds of back-to-back GEMMs before a shape's layout rows (chosen: the SM clock of an
H100 under a 700 W limit falls from 1980 to ~1500 MHz within ~50 ms of a large GEMM
stream, h100_gemm_duty.json)."""


def gpu_clock() -> str:
    """The GPU's SM clock and power draw as ``nvidia-smi`` reports them ("?" without
    it), recorded beside timings that depend on them."""
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
        before = gpu_clock()
        ts = kernel_times(body, name)
        out[name] = {"median_s": statistics.median(ts), "mean_s": statistics.fmean(ts),
                     "kernels": len(ts), "clock_before": before, "clock_after": gpu_clock()}
    b = out["back_to_back"]["median_s"]
    out["interleaved_over_back_to_back"] = out["interleaved"]["median_s"] / b
    out["after_idle_over_back_to_back"] = out["after_idle"]["median_s"] / b
    return out


def layout_operands(m: int, n: int, k: int, layout: str) -> Callable[[], Any]:
    """The product of :data:`SHAPES`' (m, n, k) in one operand layout (module
    docstring): ``NT`` the forward, ``NN`` and ``TN`` the two backward products."""
    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
    if layout == "NT":
        a, b = rand(m, k), rand(n, k)
        return lambda: torch.mm(a, b.t())
    if layout == "NN":
        a, b = rand(m, k), rand(k, n)
        return lambda: torch.mm(a, b)
    a, b = rand(k, m), rand(k, n)
    return lambda: torch.mm(a.t(), b)


def measure_layouts(m: int, n: int, k: int, operands: bool = False) -> dict[str, Any]:
    """One shape's layout rows (module docstring), seconds per product; with
    ``operands``, its rows per operand values (:data:`OPERANDS`) instead."""
    import time

    from autopar.cost_models.profiling.timing import Timer

    timer = Timer(torch.device("cuda"))
    # every operand made before any CUDA graph is captured (torch.randn after a capture
    # fails: "Offset increment outside graph capture encountered unexpectedly")
    if operands:
        products = operand_products(m, n, k)
        heat, names = products["randn"], OPERANDS + ("randn_again",)
    else:
        products = {name: layout_operands(m, n, k, name) for name in ("NN", "NT", "TN")}
        heat, names = products["NT"], ("NN", "NT", "TN", "NN_again")
    end = time.perf_counter() + HEAT_S
    while time.perf_counter() < end:
        for _ in range(10):
            heat()
        torch.cuda.synchronize()
    out: dict[str, Any] = {"shape": [m, n, k], "flops": 2.0 * m * n * k, "heat_s": HEAT_S}
    with torch.cuda.stream(torch.cuda.Stream()):  # as `autopar profile` times: graphs
        for name in names:  # are captured on a side stream
            clock = gpu_clock()
            meas = timer.measure(products[name.removesuffix("_again")])
            out[name] = {"seconds": meas.seconds, "graph_seconds": meas.graph_seconds,
                         "graph_error": meas.graph_error,
                         "clock_before": clock, "clock_after": gpu_clock()}
    return out


OPERANDS = ("randn", "linear_init", "std_0.02", "zeros")
"""Operand values of ``--operands`` (``x @ w.T``): both standard normal, as ``autopar
profile`` draws them; ``x`` standard normal and ``w`` as ``nn.Linear`` initializes it
(uniform within ±1/√k); ``w`` normal with std 0.02 (GPT-2's and Llama's init); zeros."""


def operand_products(m: int, n: int, k: int) -> dict[str, Callable[[], Any]]:
    """``x @ w.T`` at (m, n, k) for each of :data:`OPERANDS`."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    ws = {"randn": torch.randn(n, k, device="cuda", dtype=torch.bfloat16),
          "linear_init": (torch.rand(n, k, device="cuda") * 2 - 1).mul_(k ** -0.5).bfloat16(),
          "std_0.02": torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02,
          "zeros": torch.zeros(n, k, device="cuda", dtype=torch.bfloat16)}
    zx = torch.zeros_like(x)
    return {name: (lambda w=w, a=(zx if name == "zeros" else x): torch.mm(a, w.t()))
            for name, w in ws.items()}


def main_layouts(out_path: str, operands: bool = False) -> int:
    """``--layouts``: every shape's layout rows, written after each shape."""
    from autopar.cost_models.profiling.timing import provenance

    rows = []
    for shape in SHAPES:
        r = measure_layouts(*shape, operands=operands)
        rows.append(r)
        names = OPERANDS + ("randn_again",) if operands else ("NN", "NT", "TN", "NN_again")
        rates = "  ".join(f"{k} {r['flops'] / (r[k]['graph_seconds'] or r[k]['seconds']) / 1e12:4.0f}"
                          for k in names)
        print(f"{shape}: TFLOP/s (graph) {rates}  clock {r[names[-1]]['clock_after']}",
              flush=True)
        with open(out_path, "w") as f:
            json.dump({"provenance": provenance(torch.device("cuda")), "heat_s": HEAT_S,
                       "rows": rows}, f, indent=1)
    return 0


def main() -> int:
    """Measure every shape and write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--layouts", action="store_true",
                    help="time each operand layout with the profile's timer instead")
    ap.add_argument("--operands", action="store_true",
                    help="as --layouts, for x @ w.T with each kind of operand values")
    args = ap.parse_args()
    if args.layouts or args.operands:
        return main_layouts(args.out, args.operands)
    from autopar.cost_models.profiling.timing import provenance

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
