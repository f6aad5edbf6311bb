"""One-GPU training steps run by autopar's own runtime, beside the plan's prediction.

For the ~1.3B GPT and ~1.5B Llama of ``gpu_measure.py`` (same shapes, batch 4 x 2048):
plan with ``autopar.plan`` for one H100 in bf16, lay the meta-device model out with
``apply_plan`` (which materializes it on the GPU), and time ``ParallelModel.step`` +
``AdamW.step`` + ``zero_grad``. Records, per model: the predicted step time and peak
memory of the plan, the measured median step time (CUDA events, after warm-up) and
``torch.cuda.max_memory_allocated`` over the timed steps. A failure is recorded with
its traceback rather than stopping the run.

Run on a GPU machine (one process; it starts its own one-rank NCCL group)::

    python benchmarks/gpu_runtime_step.py --out h100_runtime_steps.json [--tiny]

Without CUDA it runs on the CPU over gloo, with the ``cpu`` profile and wall-clock
timing and no memory figure (``--tiny`` checks the script that way in seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist


def _configs(tiny: bool) -> list[tuple[str, Any, int, int]]:
    """(kind, config, batch, seq) of the models to run."""
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
    ]


def _model(kind: str, cfg: Any) -> torch.nn.Module:
    from autopar.examples import gpt, llama

    with torch.device("meta"):
        return gpt.GPT(cfg) if kind == "gpt" else llama.Llama(cfg)


def run_one(kind: str, cfg: Any, batch: int, seq: int, steps: int) -> dict[str, Any]:
    """Plan, lay out, and time one model (see the module docstring)."""
    import autopar
    from autopar.runtime import apply_plan

    model = _model(kind, cfg)
    x_meta = torch.randint(0, cfg.vocab_size, (batch, seq), device="meta")
    cuda = torch.cuda.is_available()
    gpu = "h100-sxm" if cuda else "cpu"
    plan = autopar.plan(model, (x_meta,), cluster=autopar.Cluster(gpu, 1, 1),
                        global_batch=batch, precision="bf16" if cuda else "fp32")
    torch.manual_seed(0)
    pm = apply_plan(model, plan)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)
    dev = torch.device("cuda" if cuda else "cpu")
    x = torch.randint(0, cfg.vocab_size, (batch, seq), device=dev)
    y = torch.randint(0, cfg.vocab_size, (batch, seq), device=dev)
    times, losses = [], []
    for i in range(steps + 2):
        if i == 2 and cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = pm.step(x, y)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))  # synchronizes with the device
        if i >= 2:
            times.append(time.perf_counter() - t0)
    n_params = sum(p.numel() for p in model.parameters())
    peak = torch.cuda.max_memory_allocated() if cuda else None
    return {
        "model": kind, "params": n_params, "batch": batch, "seq": seq,
        "plan": {"mesh": plan.mesh, "zero": plan.zero, "microbatch_size": plan.microbatch_size,
                 "num_microbatches": plan.num_microbatches, "precision": plan.precision,
                 "predicted_step_s": plan.step_time_s,
                 "predicted_memory_bytes": plan.memory_per_device_bytes,
                 "predicted_memory": plan.memory, "breakdown": plan.breakdown},
        "measured_step_s": statistics.median(times), "step_times_s": times,
        "measured_peak_bytes": peak,
        "losses": losses,
        "step_error": plan.step_time_s / statistics.median(times) - 1.0,
        "memory_error": plan.memory_per_device_bytes / peak - 1.0 if peak else None,
    }


def main() -> int:
    """Run every model, write the JSON, print one line per model."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--tiny", action="store_true", help="a tiny model, to check the script")
    args = ap.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    if cuda:
        torch.cuda.set_device(0)
    results: list[dict[str, Any]] = []
    for kind, cfg, batch, seq in _configs(args.tiny):
        try:
            results.append(run_one(kind, cfg, batch, seq, args.steps))
        except Exception:  # noqa: BLE001 — record and go on to the next model
            results.append({"model": kind, "error": traceback.format_exc()})
        if cuda:
            torch.cuda.empty_cache()
    info = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
            "cuda": torch.version.cuda, "date": "2026-11-22", "results": results}
    with open(args.out, "w") as f:
        json.dump(info, f, indent=1)
    for r in results:
        if "error" in r:
            print(f"{r['model']}: FAILED\n{r['error']}", file=sys.stderr)
        else:
            print(f"{r['model']} {r['params'] / 1e9:.2f}B mesh {r['plan']['mesh']} "
                  f"step measured {r['measured_step_s'] * 1e3:.1f} ms predicted "
                  f"{r['plan']['predicted_step_s'] * 1e3:.1f} ms ({r['step_error']:+.1%})"
                  + (f"; peak measured {r['measured_peak_bytes'] / 2**30:.2f} GiB predicted "
                     f"{r['plan']['predicted_memory_bytes'] / 2**30:.2f} GiB "
                     f"({r['memory_error']:+.1%})" if r["measured_peak_bytes"] else ""))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
