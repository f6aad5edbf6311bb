"""Forward+backward of full-size transformer layers at their tensor-parallel shard
shapes, run by autopar's own runtime on one GPU, with device time by kernel kind.

For each :class:`~layer_cases.LayerCase` (default: :func:`~layer_cases.default_cases`,
Llama 3 8B / 70B and GPT-3 175B at tp 1-8, sequence 2K-8K, micro-batch 1-4, three
recomputation modes): the case's :class:`~layer_cases.LayerSlice` is scored with
``autopar.estimate`` (one device, ``dp=1``, the case's recomputation, bf16 = autocast
over fp32 parameters, as autopar trains), laid out with ``apply_plan`` and timed:
``ParallelModel.step`` (forward, loss and backward) with a synchronize after it, median
of the timed steps after two warm-up steps, gradients dropped between steps (with
``--sustain S``, steps run back to back for S seconds before the timed ones, so the
device is as warm and power-limited as in a long training run; the SM clock and
power before and after the timed steps are recorded). One more
step runs under ``torch.profiler`` (CUDA activity) for the device time per kernel kind
(:data:`gpu_runtime_step.KERNEL_KINDS`); the step's wall time minus its kernel time is
time the GPU waited on the host. ``torch.cuda.max_memory_allocated`` gives the peak.

    python benchmarks/gpu_layers.py --out h100_layers.json [--cases llama3-8b/tp1/...]
    python benchmarks/gpu_layers.py --tiny --out /tmp/layers.json   # CPU check, seconds

``benchmarks/layer_accuracy.py`` reads the output and prices the same cases again, so a
change of the cost model can be judged without a GPU. A failed case is recorded with
its error and the run goes on.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

# run as a script, this file's folder is on sys.path
from layer_cases import LayerCase, build, default_cases, layer_flops, mse_loss, tiny_cases


def profile_name(cuda: bool) -> str:
    """The hardware profile whose predictions the run records beside its measurements:
    ``h200`` on an H200, ``h100-sxm`` on any other GPU, ``cpu`` without one."""
    if not cuda:
        return "cpu"
    return "h200" if "H200" in torch.cuda.get_device_name() else "h100-sxm"


def predict(case: LayerCase, gpu: str) -> Any:
    """The case's one-device plan (``autopar.estimate``)."""
    import autopar

    model, x, y = build(case)
    precision = "fp32" if gpu == "cpu" else "bf16"
    return autopar.estimate(model, (x,), autopar.Spec(dp=1, recompute=case.recompute),
                            cluster=autopar.Cluster(gpu, 1, 1), global_batch=case.batch,
                            precision=precision, loss_fn=mse_loss, example_targets=y)


def plan_file(folder: Path, case: LayerCase) -> Path:
    """Where ``--write-plans`` keeps the case's plan."""
    return folder / (case.name.replace("/", "_") + ".json")


def load_or_predict(case: LayerCase, gpu: str, plans: Path | None) -> Any:
    """The case's plan from ``plans`` (made beforehand with ``--write-plans``; a plan of
    one device with ``dp=1`` has the same layout on any GPU, and the predictions are
    made again by ``layer_accuracy.py``), else :func:`predict`."""
    from autopar import Plan

    if plans is not None and plan_file(plans, case).exists():
        return Plan.from_json(plan_file(plans, case).read_text())
    return predict(case, gpu)


def run_case(case: LayerCase, gpu: str, steps: int, plans: Path | None = None,
             sustain_s: float = 0.0) -> dict[str, Any]:
    """Plan, lay out, time and profile one case (module docstring)."""
    from autopar.runtime import apply_plan

    cuda = torch.cuda.is_available()
    t0 = time.perf_counter()
    plan = load_or_predict(case, gpu, plans)
    plan_s = time.perf_counter() - t0
    model, _, _ = build(case)
    torch.manual_seed(0)
    pm = apply_plan(model, plan, loss_fn=mse_loss)
    _, x, y = build(case, "cuda" if cuda else "cpu")
    timed = time_steps(pm, x, y, steps, sustain_s)
    flops = layer_flops(case) * case.layers
    return {
        "case": case.as_dict(), "name": case.name, "profile": gpu, "plan_s": plan_s,
        "predicted_fwd_bwd_s": plan.breakdown.get("compute_s", 0.0)
        + plan.breakdown.get("recompute_s", 0.0) + plan.breakdown.get("exposed_host_s", 0.0),
        "predicted_breakdown": plan.breakdown,
        "predicted_peak_bytes": plan.memory_per_device_bytes,
        **timed, "model_flops": flops,
        "tflops_per_s": flops / timed["measured_fwd_bwd_s"] / 1e12,
    }


def time_steps(pm: Any, x: torch.Tensor, y: torch.Tensor, steps: int,
               sustain_s: float = 0.0) -> dict[str, Any]:
    """Time ``pm.step(x, y)`` (a synchronize after each; gradients dropped between
    steps): two warm-up steps, ``sustain_s`` seconds of back-to-back steps, then
    ``steps`` timed ones (median), the SM clock and power before and after them, the
    peak memory, and one more step's device time per kernel kind (module docstring)."""
    from gpu_gemm_duty import gpu_clock
    from gpu_runtime_step import kernel_breakdown

    cuda = torch.cuda.is_available()

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def step() -> None:
        pm.step(x, y)
        sync()

    times = []
    clocks: dict[str, str] = {}
    for i in range(steps + 2):
        if i == 2 and sustain_s > 0:
            end = time.perf_counter() + sustain_s
            while time.perf_counter() < end:
                pm.zero_grad(set_to_none=True)
                step()
        if i == 2 and cuda:
            clocks["before"] = gpu_clock()
            torch.cuda.reset_peak_memory_stats()
        pm.zero_grad(set_to_none=True)
        sync()
        t = time.perf_counter()
        step()
        if i >= 2:
            times.append(time.perf_counter() - t)
    if cuda:
        clocks["after"] = gpu_clock()
    pm.zero_grad(set_to_none=True)
    kernels = kernel_breakdown(step) if cuda else None
    peak = torch.cuda.max_memory_allocated() if cuda else None
    return {"measured_fwd_bwd_s": statistics.median(times), "times_s": times,
            "measured_peak_bytes": peak, "kernels": kernels, "sustain_s": sustain_s,
            "clock_sm_power": clocks}


def guarded_row(name: str, case: dict[str, Any], run: Callable[[], dict[str, Any]],
                describe: Callable[[dict[str, Any]], str]) -> dict[str, Any]:
    """``run()``'s row for one case, printed with ``describe``; a failure becomes a row
    with its error and traceback, so that one failed case does not end the run. The
    device's cached memory is released after each case."""
    try:
        row = run()
        print(f"{name:34s} {describe(row)}", flush=True)
    except Exception as e:  # noqa: BLE001 — one failed case must not end the run
        row = {"case": case, "name": name, "error": f"{type(e).__name__}: {e}"[:400],
               "traceback": traceback.format_exc()[-2000:]}
        print(f"{name:34s} FAILED {row['error']}", flush=True)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row


def main() -> int:
    """Run the cases, write the JSON after each, print one line per case."""
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="JSON of the results (required unless --write-plans)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--tiny", action="store_true", help="three tiny cases, to check the script")
    ap.add_argument("--cases", help="comma-separated case names (default: all)")
    ap.add_argument("--time-limit", type=float, default=0.0,
                    help="start no new case after this many seconds (0: no limit)")
    ap.add_argument("--plans", type=Path, help="folder of plans made with --write-plans")
    ap.add_argument("--sustain", type=float, default=0.0, metavar="S",
                    help="run steps back to back for S seconds before the timed ones")
    ap.add_argument("--write-plans", type=Path, metavar="DIR",
                    help="only plan every case (h100-sxm profile) into DIR, then stop")
    args = ap.parse_args()
    from autopar.cost_models.profiling.timing import provenance

    if args.write_plans:
        args.write_plans.mkdir(parents=True, exist_ok=True)
        for case in tiny_cases() if args.tiny else default_cases():
            plan = predict(case, "cpu" if args.tiny else "h100-sxm")
            plan_file(args.write_plans, case).write_text(plan.to_json())
        return 0

    from gpu_runtime_step import start_one_rank_group

    cuda = start_one_rank_group()
    gpu = profile_name(cuda)
    cases = tiny_cases() if args.tiny else default_cases()
    if args.cases:
        wanted = set(args.cases.split(","))
        cases = [c for c in cases if c.name in wanted]
    doc: dict[str, Any] = {"provenance": provenance(torch.device("cuda" if cuda else "cpu")),
                           "steps": args.steps, "sustain_s": args.sustain, "rows": []}
    start = time.perf_counter()
    for case in cases:
        if args.time_limit and time.perf_counter() - start > args.time_limit:
            doc["stopped_early"] = f"time limit {args.time_limit} s reached before {case.name}"
            break
        doc["rows"].append(guarded_row(
            case.name, case.as_dict(),
            lambda: run_case(case, gpu, args.steps, args.plans, args.sustain),
            lambda r: f"measured {r['measured_fwd_bwd_s'] * 1e3:9.2f} ms  predicted "
                      f"{r['predicted_fwd_bwd_s'] * 1e3:9.2f} ms  "
                      f"{r['tflops_per_s']:6.1f} TFLOP/s"))
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
