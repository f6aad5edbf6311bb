"""One-GPU training steps run by autopar's own runtime, beside the plans' predictions.

For the ~1.3B GPT and ~1.5B Llama of ``gpu_measure.py`` (same shapes, batch 4 x 2048),
in bf16 on one H100, the plans of :data:`CASES`: the planner's own choice, then
recomputation none / selective / full and four micro-batches of one, each scored with
``autopar.estimate``. Each plan is laid out on the meta-device model with
``apply_plan`` (which materializes it on the GPU) and timed: ``ParallelModel.step``
(forward and backward), then ``AdamW.step`` + ``zero_grad``, with one device
synchronize, at the end, as a training loop that reads its loss each step does;
medians over the timed steps after two warm-up steps (the host's share: the time until
the synchronize; and, over as many more steps synchronized after the backward, the
forward+backward and optimizer times apart). Records, per plan:
the predicted step time, breakdown and peak memory, the measured times,
``torch.cuda.max_memory_allocated`` over the timed steps and, for the plans named by
``--profile``, the device time per kernel kind and the busiest host ops of one step
(:func:`kernel_breakdown`), for those named by ``--trace-memory`` the allocations live
at the peak by source line (:func:`peak_composition`). A failure is recorded with its
traceback rather than stopping the run. ``--compile`` runs each plan twice, eager and
laid out with ``apply_plan(..., compile=True)`` (``h200_compile_steps.json``).

Run on a GPU machine (one process; it starts its own one-rank NCCL group); the
committed results were made with::

    python benchmarks/gpu_runtime_step.py --out h100_runtime_steps.json --fused \
        --profile none,selective,full,microbatch1 --trace-memory none

Without CUDA it runs on the CPU over gloo, with the ``cpu`` profile and wall-clock
timing and no memory figure (``--tiny`` checks the script that way in seconds).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist


def _configs(tiny: bool, slice_layers: int = 8) -> list[tuple[str, Any, int, int]]:
    """(kind, config, batch, seq) of the models to run: the ~1.3B GPT and ~1.5B Llama
    (module docstring), and ``llama8b``: ``slice_layers`` layers of Llama 3 8B (Meta's
    release config) with its whole embedding and head, at one sequence of 8,192."""
    from autopar.examples import gpt, llama

    if tiny:
        return [("gpt", gpt.GPTConfig(vocab_size=256, max_seq_len=64, dim=64, n_layers=2,
                                      n_heads=4), 2, 64)]
    return [
        ("gpt", gpt.GPTConfig(vocab_size=50304, max_seq_len=2048, dim=2048, n_layers=24,
                              n_heads=16), 4, 2048),
        ("llama", llama.LlamaConfig(vocab_size=128256, max_seq_len=2048, dim=2048,
                                    n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192,
                                    rope_theta=500000.0), 4, 2048),
        ("llama8b", llama.LlamaConfig(vocab_size=128256, max_seq_len=8192, dim=4096,
                                      n_layers=slice_layers, n_heads=32, n_kv_heads=8,
                                      ffn_dim=14336, rope_theta=500000.0), 1, 8192),
    ]


def _model(kind: str, cfg: Any) -> torch.nn.Module:
    from autopar.examples import gpt, llama

    with torch.device("meta"):
        return gpt.GPT(cfg) if kind == "gpt" else llama.Llama(cfg)  # llama, llama8b


CASES: tuple[tuple[str, dict[str, Any] | None], ...] = (
    ("plan", None),
    ("none", dict(dp=1, recompute="none")),
    ("selective", dict(dp=1, recompute="selective")),
    ("full", dict(dp=1, recompute="full")),
    ("microbatch1", dict(dp=1, microbatch_size=1, recompute="none")),
)
"""(name, Spec keywords) of the plans run per model: the planner's own choice, then
hand-forced recomputation modes and gradient accumulation over four micro-batches."""

KERNEL_KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("optimizer", ("adam", "multi_tensor")),
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "sm90_")),
    ("norm", ("layer_norm", "layernorm", "rms")),
    ("softmax_loss", ("softmax", "nll", "cross_entropy", "log_softmax")),
    ("embedding", ("embedding", "index", "scatter", "gather")),
    ("copy_cast", ("copy", "memcpy", "memset", "cast", "fill")),
)
"""Substrings (lower case) that put a CUDA kernel's name in a kind; the first match
wins, anything else counts as "elementwise"."""


def kernel_breakdown(step) -> dict[str, Any]:
    """Device seconds per kernel kind over one call of ``step`` (a CUDA-only
    torch.profiler trace) with the call's wall time (the gap between the two is time the
    GPU waited on the host), then the host ops with the most self time over a second
    call (a CPU-only trace, so that no kernel is counted twice)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    kinds: dict[str, float] = {}
    top: dict[str, float] = {}
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = ev.name.lower()
        kind = next((k for k, subs in KERNEL_KINDS if any(x in name for x in subs)),
                    "elementwise")
        dt = ev.device_time_total * 1e-6
        kinds[kind] = kinds.get(kind, 0.0) + dt
        top[ev.name[:80]] = top.get(ev.name[:80], 0.0) + dt
    busiest = sorted(top.items(), key=lambda kv: -kv[1])[:25]
    with profile(activities=[ProfilerActivity.CPU]) as host_prof:
        step()
        torch.cuda.synchronize()
    host = sorted(((e.key, e.self_cpu_time_total * 1e-6, e.count)
                   for e in host_prof.key_averages()), key=lambda r: -r[1])[:30]
    return {"wall_s": wall, "kernel_s": sum(kinds.values()), "by_kind_s": kinds,
            "top_kernels_s": dict(busiest),
            "top_host_self_s": [{"op": k, "self_s": t, "calls": c} for k, t, c in host]}


def peak_composition(step, top: int = 30) -> dict[str, Any]:
    """The blocks live at the peak of one call of ``step``, grouped by where they were
    allocated (CUDA caching-allocator history with Python stacks): the innermost frame
    in the model or autopar (file:line function), and the innermost frame overall.
    Blocks allocated before the call count as "before the step"."""
    import torch.cuda.memory as cm

    before = torch.cuda.memory_allocated()
    cm._record_memory_history(max_entries=1_000_000, stacks="python")
    try:
        step()
        torch.cuda.synchronize()
        snap = cm._snapshot()
    finally:
        cm._record_memory_history(enabled=None)
    trace = snap["device_traces"][torch.cuda.current_device()]

    def replay(stop: int | None) -> tuple[float, int, dict[int, dict]]:
        live: dict[int, dict] = {}
        total, peak, at = float(before), float(before), -1
        for i, ev in enumerate(trace[:stop]):
            if ev["action"] == "alloc":
                live[ev["addr"]] = ev
                total += ev["size"]
            elif ev["action"] == "free_requested" and ev["addr"] in live:
                total -= live.pop(ev["addr"])["size"]
            elif ev["action"] == "free_requested":
                total -= ev["size"]  # allocated before the trace started
            if total > peak:
                peak, at = total, i
        return peak, at, live

    peak, at, _ = replay(None)
    _, _, live = replay(at + 1)

    def where(frames: list[dict]) -> str:
        own = next((f for f in frames if any(k in f["filename"] for k in
                                                ("/examples/", "/autopar/", "/runtime/"))), None)
        inner = frames[0] if frames else {"filename": "?", "line": 0, "name": "?"}
        fmt = lambda f: f"{f['filename'].rsplit('/', 2)[-1]}:{f['line']} {f['name']}"
        return (fmt(own) + " <- " if own else "") + fmt(inner)

    groups: dict[str, list[float]] = {}
    for ev in live.values():
        g = groups.setdefault(where(ev.get("frames", [])), [0.0, 0])
        g[0] += ev["size"]
        g[1] += 1
    biggest = sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]
    traced = sum(g[0] for g in groups.values())
    return {"peak_bytes": peak, "before_step_bytes": before, "events": len(trace),
            "peak_event": at, "live_traced_bytes": traced,
            "groups": [{"where": k, "bytes": v[0], "blocks": v[1]} for k, v in biggest]}


def run_one(kind: str, cfg: Any, batch: int, seq: int, steps: int, case: str,
            spec: dict[str, Any] | None, profile_it: bool,
            trace_memory: bool = False, fused: bool = False,
            compiled: bool = False) -> dict[str, Any]:
    """Plan (or score ``spec``), lay out, and time one model (module docstring);
    ``compiled``: lay it out with ``apply_plan(..., compile=True)``."""
    import autopar
    from autopar.runtime import apply_plan

    model = _model(kind, cfg)
    x_meta = torch.randint(0, cfg.vocab_size, (batch, seq), device="meta")
    cuda = torch.cuda.is_available()
    cluster = autopar.Cluster("h100-sxm" if cuda else "cpu", 1, 1)
    precision = "bf16" if cuda else "fp32"
    if spec is None:
        plan = autopar.plan(model, (x_meta,), cluster=cluster, global_batch=batch,
                            precision=precision)
    else:
        plan = autopar.estimate(model, (x_meta,), autopar.Spec(**spec), cluster=cluster,
                                global_batch=batch, precision=precision)
    torch.manual_seed(0)
    pm = apply_plan(model, plan, compile=compiled)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-4, fused=fused or None)
    dev = torch.device("cuda" if cuda else "cpu")
    x = torch.randint(0, cfg.vocab_size, (batch, seq), device=dev)
    y = torch.randint(0, cfg.vocab_size, (batch, seq), device=dev)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    times, host, fwd_bwd, optim, losses, warmup = [], [], [], [], [], []
    for i in range(steps + 2):  # a training loop's step: one synchronize, at its end
        if i == 2 and cuda:
            sync()
            torch.cuda.reset_peak_memory_stats()
        sync()
        t0 = time.perf_counter()
        loss = pm.step(x, y)
        opt.step()
        opt.zero_grad(set_to_none=True)
        t1 = time.perf_counter()
        sync()
        t2 = time.perf_counter()
        losses.append(float(loss))
        if i >= 2:
            times.append(t2 - t0)
            host.append(t1 - t0)
        else:
            warmup.append(t2 - t0)
    for _ in range(steps):  # the same, synchronized between backward and optimizer
        sync()
        t0 = time.perf_counter()
        pm.step(x, y)
        sync()
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        fwd_bwd.append(t1 - t0)
        optim.append(time.perf_counter() - t1)
    n_params = sum(p.numel() for p in model.parameters())
    peak = torch.cuda.max_memory_allocated() if cuda else None

    def full_step() -> None:
        pm.step(x, y)
        opt.step()
        opt.zero_grad(set_to_none=True)

    kernels = kernel_breakdown(full_step) if profile_it and cuda else None
    memory = peak_composition(full_step) if trace_memory and cuda else None
    med = statistics.median(times)
    return {
        "model": kind, "case": case, "spec": spec, "fused_adamw": fused,
        "compiled": compiled, "warmup_step_s": warmup, "params": n_params, "batch": batch,
        "seq": seq, "config": dict(vars(cfg)),
        "plan": {"mesh": plan.mesh, "zero": plan.zero, "microbatch_size": plan.microbatch_size,
                 "num_microbatches": plan.num_microbatches, "precision": plan.precision,
                 "recompute": sorted(set(plan.recompute.values())),
                 "predicted_step_s": plan.step_time_s,
                 "predicted_memory_bytes": plan.memory_per_device_bytes,
                 "predicted_memory": plan.memory, "breakdown": plan.breakdown},
        "measured_step_s": med, "step_times_s": times,
        "measured_host_s": statistics.median(host),
        "measured_fwd_bwd_s": statistics.median(fwd_bwd),
        "measured_optimizer_s": statistics.median(optim),
        "measured_peak_bytes": peak, "losses": losses, "kernels": kernels,
        "peak_composition": memory,
        "step_error": plan.step_time_s / med - 1.0,
        "memory_error": plan.memory_per_device_bytes / peak - 1.0 if peak else None,
    }


def start_one_rank_group() -> bool:
    """Start a process group of this process alone (NCCL on a GPU, else gloo) and
    return whether CUDA is in use."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    if cuda:
        torch.cuda.set_device(0)
    return cuda


def main() -> int:
    """Run every model, write the JSON, print one line per model."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--tiny", action="store_true", help="a tiny model, to check the script")
    ap.add_argument("--models", default="gpt,llama", help="comma-separated: gpt, llama, llama8b")
    ap.add_argument("--cases", default=",".join(c for c, _ in CASES),
                    help="comma-separated names from CASES")
    ap.add_argument("--fused", action="store_true", help="AdamW(fused=True)")
    ap.add_argument("--profile", default="none",
                    help="comma-separated cases whose kernels are profiled")
    ap.add_argument("--trace-memory", default="",
                    help="comma-separated cases whose peak is broken down by allocation site")
    ap.add_argument("--compile", action="store_true",
                    help="run each case twice: eager, then with apply_plan(compile=True)")
    ap.add_argument("--slice-layers", type=int, default=8,
                    help="layers of the llama8b slice (embedding and head kept whole)")
    args = ap.parse_args()
    cuda = start_one_rank_group()
    results: list[dict[str, Any]] = []
    cases = args.cases.split(",")
    for kind, cfg, batch, seq in _configs(args.tiny, args.slice_layers):
        if kind not in args.models.split(","):
            continue
        for (case, spec), compiled in [(c, k) for c in CASES if c[0] in cases
                                       for k in ((False, True) if args.compile else (False,))]:
            try:
                results.append(run_one(kind, cfg, batch, seq, args.steps, case, spec,
                                       profile_it=case in args.profile.split(","),
                                       trace_memory=case in args.trace_memory.split(","),
                                       fused=args.fused, compiled=compiled))
            except Exception:  # noqa: BLE001 — record and go on to the next case
                results.append({"model": kind, "case": case, "compiled": compiled,
                                "error": traceback.format_exc()})
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
    info = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
            "cuda": torch.version.cuda, "date": time.strftime("%Y-%m-%d"),
            "timing": "step: forward, backward, optimizer step and zero_grad, then one "
                      "device synchronize (a training loop that reads its loss every "
                      "step); host: the same step up to the synchronize; fwd_bwd and "
                      "optimizer: separate steps synchronized between the two",
            "results": results}
    with open(args.out, "w") as f:
        json.dump(info, f, indent=1)
    for r in results:
        if "error" in r:
            print(f"{r['model']} {r['case']}: FAILED\n{r['error']}", file=sys.stderr)
        else:
            print(f"{r['model']} {r['case']}{' compiled' if r['compiled'] else ''} "
                  f"warm-up {', '.join(f'{t:.1f}' for t in r['warmup_step_s'])} s; "
                  f"{r['params'] / 1e9:.2f}B mesh {r['plan']['mesh']} "
                  f"mb {r['plan']['microbatch_size']} recompute {r['plan']['recompute']} "
                  f"step measured {r['measured_step_s'] * 1e3:.1f} ms predicted "
                  f"{r['plan']['predicted_step_s'] * 1e3:.1f} ms ({r['step_error']:+.1%})"
                  + (f"; peak measured {r['measured_peak_bytes'] / 2**30:.2f} GiB predicted "
                     f"{r['plan']['predicted_memory_bytes'] / 2**30:.2f} GiB "
                     f"({r['memory_error']:+.1%})" if r["measured_peak_bytes"] else ""))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
