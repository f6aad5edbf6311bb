"""Where a one-GPU step waits for its host: a timeline of one profiled step.

For each model of ``gpu_runtime_step.py`` under one plan (default: micro-batch 4, no
recomputation), one step is profiled with host and device activity. From the trace:
the device's busy and idle time inside the step; the idle gaps charged to the host op
that issued the kernel ending each gap (outermost and innermost op on the host
thread); and the host calls that block (CUDA runtime calls of 100 µs or more).

    python benchmarks/gpu_host_timeline.py --out host_timeline.json
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_runtime_step import _configs, _model  # noqa: E402

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def _setup(kind: str, cfg: Any, batch: int, seq: int, spec: dict[str, Any]):
    import autopar
    from autopar.runtime import apply_plan

    model = _model(kind, cfg)
    x_meta = torch.randint(0, cfg.vocab_size, (batch, seq), device="meta")
    plan = autopar.estimate(model, (x_meta,), autopar.Spec(**spec),
                            cluster=autopar.Cluster("h100-sxm", 1, 1), global_batch=batch,
                            precision="bf16")
    torch.manual_seed(0)
    pm = apply_plan(model, plan)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-4, fused=True)
    x = torch.randint(0, cfg.vocab_size, (batch, seq), device="cuda")
    y = torch.randint(0, cfg.vocab_size, (batch, seq), device="cuda")

    def step() -> None:
        pm.step(x, y)
        with torch.profiler.record_function("optimizer"):
            opt.step()
            opt.zero_grad(set_to_none=True)
    return step


def _time(step, n: int = 5) -> float:
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def analyze(trace: dict[str, Any]) -> dict[str, Any]:
    """The summary of one step's trace (module docstring), times in seconds."""
    ev = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    dev = [e for e in ev if e.get("cat") in DEVICE_CATS]
    runtime = [e for e in ev if e.get("cat") == "cuda_runtime"]
    cpu = [e for e in ev if e.get("cat") == "cpu_op" or e.get("cat") == "user_annotation"]
    busy = _merge([(e["ts"], e["ts"] + e["dur"]) for e in dev])
    start = min(e["ts"] for e in cpu + runtime)
    end = max(b for _, b in busy)
    launch = {e["args"].get("correlation"): e for e in runtime}
    by_tid: dict[Any, list[dict]] = defaultdict(list)
    for e in cpu:
        by_tid[e["tid"]].append(e)
    for lst in by_tid.values():
        lst.sort(key=lambda e: e["ts"])

    def enclosing(r: dict) -> tuple[str, str]:
        lst = by_tid.get(r["tid"], [])
        i = bisect.bisect_right([e["ts"] for e in lst], r["ts"])
        outer = inner = "?"
        for e in lst[:i]:
            if e["ts"] <= r["ts"] <= e["ts"] + e["dur"]:
                if outer == "?":
                    outer = e["name"]
                inner = e["name"]
        return outer, inner
    gaps_outer: dict[str, float] = defaultdict(float)
    gaps_inner: dict[str, float] = defaultdict(float)
    first = {}
    for e in sorted(dev, key=lambda e: e["ts"]):
        first.setdefault(e["ts"], e)
    idle = 0.0
    prev_end = start
    for a, b in busy:
        gap = a - prev_end
        if gap > 0:
            idle += gap
            k = first.get(a)
            r = launch.get(k["args"].get("correlation")) if k else None
            o, i = enclosing(r) if r else ("?", "?")
            gaps_outer[o] += gap
            gaps_inner[i] += gap
        prev_end = b
    blocking: dict[str, list[float]] = defaultdict(list)
    for r in runtime:
        if r["dur"] >= 100:
            blocking[r["name"]].append(r["dur"])

    def top(d: dict[str, float], k: int = 15) -> list[list]:
        return [[n, v / 1e6] for n, v in sorted(d.items(), key=lambda kv: -kv[1])[:k]]
    return {"step_s": (end - start) / 1e6, "device_busy_s": sum(b - a for a, b in busy) / 1e6,
            "device_idle_s": idle / 1e6,
            "idle_by_outer_host_op_s": top(gaps_outer), "idle_by_inner_host_op_s": top(gaps_inner),
            "blocking_calls": [[n, len(v), sum(v) / 1e6, max(v) / 1e6]
                               for n, v in sorted(blocking.items(), key=lambda kv: -sum(kv[1]))]}


def profile_step(step) -> dict[str, Any]:
    """Profile one step after warm-up; the trace's summary (:func:`analyze`)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    return trace


def main() -> int:
    """Profile each model's step; write the summaries (and, with --traces, the traces)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--traces", help="folder for the gzipped traces")
    ap.add_argument("--microbatch", type=int, default=4)
    args = ap.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29518")
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                           "date": time.strftime("%Y-%m-%d"), "models": {}}
    spec = {"dp": 1, "microbatch_size": args.microbatch, "recompute": "none"}
    for kind, cfg, batch, seq in _configs(False):
        step = _setup(kind, cfg, batch, seq, spec)
        entry: dict[str, Any] = {"spec": spec, "step_s": _time(step)}
        trace = profile_step(step)
        entry["timeline"] = analyze(trace)
        if args.traces:
            with gzip.open(os.path.join(args.traces, f"{kind}.trace.json.gz"), "wt") as f:
                json.dump(trace, f)
        out["models"][kind] = entry
        print(kind, json.dumps({k: v for k, v in entry.items() if k != "timeline"}),
              json.dumps(entry["timeline"])[:1500], flush=True)
        del step
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
