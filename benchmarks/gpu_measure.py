"""Per-operator and whole-step measurements on one GPU, kept as data so that a later
CPU-only session can recompute the cost model's predictions for the same shapes and
compare.

    python benchmarks/gpu_measure.py --out-dir benchmarks/results --prefix h100
    python benchmarks/gpu_measure.py --device cpu --tiny --out-dir /tmp/x   # smoke test

Writes ``<prefix>_ops.json`` (part a) and ``<prefix>_steps.json`` (part b).

(a) Forward and backward device time of each operator of one Llama-3 8B layer (hidden
4096, 32 heads, 8 KV heads, FFN 14336; Meta's Llama 3 release config) at sequence 8192,
micro-batch 1, and of one GPT-2 small layer (hidden 768, 12 heads, FFN 3072; Radford
et al. 2019) at sequence 1024, batch 8, each in bf16 parameters and activations (no
autocast), as the models in ``autopar.examples`` compute them; plus the token
embedding, output head and cross-entropy at vocabularies 128256 (Llama 3) and 50257
(GPT-2; 50304 as padded by nanoGPT beside it), and each whole block (the examples'
``Block``) for comparing the sum of operators with the block.
Backward = ``torch.autograd.grad`` of the op's output with respect to its floating
inputs and parameters. Bytes are the sum of the tensors an op reads and writes once
(forward: inputs, parameters, output; backward: output grad, inputs, parameters and the
grads it produces); FLOPs are counted for GEMMs (2mnk forward, 4mnk backward) and
attention (:func:`autopar.cost_models.profiling.compute_bound.attention_flops`), None elsewhere.

(b) One-device training step (zero_grad, forward, cross-entropy, backward, AdamW step)
of a ~1.3B GPT (GPT-3 XL's 24 layers × 2048, Brown et al. 2020, Table 2.1, with 16
heads of 128) and a ~1.5B Llama (Llama 3.2 1B's shape, Meta's release config: 16
layers × 2048, 32 heads, 8 KV, FFN 8192, vocab 128256; the example's output head is
untied, hence 1.5B), without and with activation checkpointing per block
(``torch.utils.checkpoint``, non-reentrant). Precision: fp32 parameters, gradients and
AdamW moments with ``torch.autocast(bfloat16)`` — PyTorch AMP, as
``autopar.cost_models.memory`` counts "bf16". AdamW is the fused CUDA implementation.
Memory: ``torch.cuda.memory_allocated`` deltas give parameters, gradients and
optimizer state; ``max_memory_allocated`` per step gives the peak.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from autopar.cost_models.profiling.timing import Timer, compact_json, provenance, row, sig
from autopar.examples import gpt, llama

# run as a script, this file's folder is on sys.path
from gpu_measure_ops import Op, gpt2_layer_ops, head_ops, llama_layer_ops


def _nbytes(ts: tuple[torch.Tensor, ...] | list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def measure_op(op: Op, timer: Timer) -> dict[str, Any]:
    """Forward (no_grad) and backward seconds of ``op``, with its shapes and work."""
    with torch.no_grad():
        out = op.fn(*op.inputs)
        fwd = timer.measure(lambda: op.fn(*op.inputs))
    wrt = [t for t in op.inputs if t.is_floating_point()] + list(op.params)
    flags = [t.requires_grad for t in wrt]
    for t in wrt:
        t.requires_grad_(True)
    y = op.fn(*op.inputs)
    g = torch.randn_like(y)
    bwd = timer.measure(lambda: torch.autograd.grad(y, wrt, g, retain_graph=True))
    for t, flag in zip(wrt, flags):
        t.requires_grad_(flag)
    base = {"op": op.name, "count": op.count, "note": op.note,
            "inputs": [[list(t.shape), str(t.dtype).removeprefix("torch.")] for t in op.inputs],
            "params": [list(p.shape) for p in op.params],
            "output": [list(out.shape), str(out.dtype).removeprefix("torch.")]}
    io = _nbytes(op.inputs) + _nbytes(op.params)
    return {**base,
            "fwd": row(fwd, flops=op.flops_fwd, nbytes=float(io + _nbytes([out]))),
            "bwd": row(bwd, flops=op.flops_bwd,
                       nbytes=float(2 * _nbytes([out]) + io + _nbytes(wrt)))}


def measure_block(block: nn.Module, args: tuple[torch.Tensor, ...], timer: Timer) -> dict:
    """Whole-block seconds: forward under no_grad, forward with autograd, and forward +
    backward (``out.backward(g)`` with respect to the input and parameters)."""
    x = args[0].detach().requires_grad_(True)
    rest = args[1:]
    with torch.no_grad():
        fwd_ng = timer.measure(lambda: block(x, *rest), graph=False)
    fwd = timer.measure(lambda: block(x, *rest), graph=False)
    g = torch.randn_like(x)

    def step() -> None:
        block(x, *rest).backward(g)

    fb = timer.measure(step, graph=False)
    return {"fwd_no_grad": row(fwd_ng), "fwd": row(fwd), "fwd_bwd": row(fb),
            "bwd_derived_seconds": sig(fb.seconds - fwd.seconds)}


def layer_section(name: str, cfg: dict, ops: list[Op], block: nn.Module,
                  block_args: tuple[torch.Tensor, ...], timer: Timer) -> dict[str, Any]:
    """Rows for ``ops``, the whole block, and the count-weighted sums of op times."""
    rows = []
    for op in ops:
        sys.stderr.write(f"gpu_measure: {name} {op.name}\n")
        rows.append(measure_op(op, timer))
    total = {p: sig(sum(r[p]["seconds"] * r["count"] for r in rows)) for p in ("fwd", "bwd")}
    graphs = {p: sig(sum(r[p].get("graph_seconds", r[p]["seconds"]) * r["count"]
                         for r in rows)) for p in ("fwd", "bwd")}
    return {"config": cfg, "ops": rows, "sum_of_ops_seconds": total,
            "sum_of_ops_graph_seconds": graphs,
            "block": measure_block(block, block_args, timer)}


def gemm_check(device: torch.device, tiny: bool, timer: Timer) -> dict[str, Any]:
    """The n×n×n bf16 GEMM (n = 8192) in the layouts and data a reader may compare with
    other reports: torch.mm (NN) and F.linear (x @ wᵀ, what nn.Linear runs), normal and
    uniform random data, eager and graph-replayed; then 2 s of back-to-back products
    timed one by one, with the SM clock (MHz) and power draw (W) read through NVML
    before and after, to show clock or power throttling under sustained load."""
    n = 64 if tiny else 8192
    flops = 2.0 * n**3
    rows = []
    for data in ("randn", "uniform(-1,1)"):
        def make() -> torch.Tensor:
            t = torch.randn(n, n, device=device, dtype=torch.bfloat16)
            return t if data == "randn" else torch.rand_like(t) * 2 - 1
        a, b = make(), make()
        for layout, fn in (("NN torch.mm", lambda: torch.mm(a, b)),
                           ("TN F.linear", lambda: F.linear(a, b))):
            rows.append({"n": n, "data": data, "layout": layout,
                         **row(timer.measure(fn), flops=flops)})
    sustained: dict[str, Any] = {}
    if device.type == "cuda":
        sustained["before"] = _nvml(device)
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        times: list[float] = []
        t_end = time.perf_counter() + 2.0
        while time.perf_counter() < t_end:
            ev[0].record()
            torch.mm(a, b)
            ev[1].record()
            ev[1].synchronize()
            times.append(ev[0].elapsed_time(ev[1]) / 1e3)
        sustained["after"] = _nvml(device)
        k = max(1, len(times) // 10)
        sustained.update(count=len(times), first_tenth_flop_per_s=sig(flops * k / sum(times[:k])),
                         last_tenth_flop_per_s=sig(flops * k / sum(times[-k:])),
                         median_flop_per_s=sig(flops / statistics.median(times)))
    return {"rows": rows, "sustained_uniform": sustained}


def _nvml(device: torch.device) -> dict[str, Any]:
    """SM clock (MHz) and power draw (W) now, through torch.cuda's NVML helpers."""
    try:
        return {"sm_clock_mhz": torch.cuda.clock_rate(device),
                "power_w": torch.cuda.power_draw(device) / 1e3}
    except Exception as e:  # noqa: BLE001 — pynvml missing: say so
        return {"error": f"{type(e).__name__}: {e}"[:200]}


# -- (b) training steps --------------------------------------------------------------

class Checkpointed(nn.Module):
    """Runs ``inner`` under non-reentrant activation checkpointing."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.inner, *args, use_reentrant=False)


def step_run(kind: str, cfg: Any, batch: int, seq: int, recompute: bool, steps: int,
             device: torch.device) -> dict[str, Any]:
    """Train ``steps`` timed steps (after 3 warm-up steps) and report times and memory."""
    cuda = device.type == "cuda"
    alloc = torch.cuda.memory_allocated if cuda else (lambda: 0)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    m0 = alloc()
    with torch.device(device):
        model = gpt.GPT(cfg) if kind == "gpt" else llama.Llama(cfg)
    blocks = model.blocks if kind == "gpt" else model.layers
    if recompute:
        for i, b in enumerate(blocks):
            blocks[i] = Checkpointed(b)
    n_params = sum(p.numel() for p in model.parameters())
    m_params = alloc()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)  # lr: any; not trained
    x = torch.randint(0, cfg.vocab_size, (batch, seq), device=device)
    y = torch.randint(0, cfg.vocab_size, (batch, seq), device=device)

    def fwd_bwd() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(x)
            loss = F.cross_entropy(logits.view(-1, cfg.vocab_size), y.view(-1))
        loss.backward()

    opt.zero_grad(set_to_none=True)
    fwd_bwd()
    m_grads = alloc()
    opt.step()
    m_opt = alloc()
    opt.zero_grad(set_to_none=True)
    m_steady = alloc()
    times, peaks, parts = [], [], []
    for i in range(2 + steps):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        if cuda:
            ev[0].record()
        fwd_bwd()
        if cuda:
            ev[1].record()
        opt.step()
        if cuda:
            ev[2].record()
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if i >= 2:
            times.append(dt)
            if cuda:
                peaks.append(torch.cuda.max_memory_allocated())
                parts.append((ev[0].elapsed_time(ev[1]) / 1e3, ev[1].elapsed_time(ev[2]) / 1e3))
    tokens = batch * seq
    med = statistics.median(times)
    res = {
        "model": kind, "config": asdict(cfg), "params": n_params, "batch": batch, "seq": seq,
        "recompute": "per block (torch.utils.checkpoint, non-reentrant)" if recompute else "none",
        "step_seconds": [sig(t) for t in times], "step_seconds_median": sig(med),
        "fwd_bwd_seconds_median": sig(statistics.median(p[0] for p in parts)) if parts else None,
        "optimizer_step_seconds_median": sig(statistics.median(p[1] for p in parts))
        if parts else None,
        "tokens_per_s": sig(tokens / med),
        "model_flops_per_step": 6.0 * n_params * tokens,
        "model_flop_per_s": sig(6.0 * n_params * tokens / med),
        "model_flops_note": "6·params·tokens (Kaplan et al. 2020), attention and "
                            "recomputation not counted",
        "memory_bytes": {
            "baseline_before_model": m0, "params": m_params - m0, "grads": m_grads - m_params,
            "optimizer_state": m_opt - m_grads, "after_step_grads_freed": m_steady - m0,
            "peak_per_step": peaks, "peak_median": int(statistics.median(peaks)) if peaks else None,
            "peak_minus_params_and_optimizer": int(statistics.median(peaks)) - m_steady
            if peaks else None,
            "max_reserved": torch.cuda.max_memory_reserved() if cuda else None,
            "how": "torch.cuda.memory_allocated deltas: params after building the model; "
                   "grads after the first backward; optimizer_state after the first "
                   "AdamW step; peak_per_step = max_memory_allocated over one step, "
                   "absolute (it includes baseline_before_model, what earlier "
                   "measurements in the process still held); "
                   "peak_minus_params_and_optimizer = peak less everything allocated "
                   "after the step (parameters, optimizer state, inputs) and less the "
                   "baseline: activations, gradients and temporaries at the peak"},
    }
    return res


def steps_section(device: torch.device, tiny: bool) -> dict[str, Any]:
    """The four runs of part (b): GPT and Llama, with and without recompute."""
    if tiny:
        gcfg = gpt.GPTConfig(vocab_size=256, max_seq_len=64, dim=64, n_layers=2, n_heads=4)
        lcfg = llama.LlamaConfig(vocab_size=256, max_seq_len=64, dim=64, n_layers=2,
                                 n_heads=4, n_kv_heads=2, ffn_dim=128)
        batch, seq, steps = 2, 64, 2
    else:
        gcfg = gpt.GPTConfig(vocab_size=50304, max_seq_len=2048, dim=2048, n_layers=24,
                             n_heads=16)
        lcfg = llama.LlamaConfig(vocab_size=128256, max_seq_len=2048, dim=2048, n_layers=16,
                                 n_heads=32, n_kv_heads=8, ffn_dim=8192, rope_theta=500000.0)
        # 8192 tokens a step; the Llama without recompute peaked at 45.5 GiB of 80 here
        batch, seq, steps = 4, 2048, 5
    runs = []
    for kind, cfg in (("gpt", gcfg), ("llama", lcfg)):
        for rc in (False, True):
            sys.stderr.write(f"gpu_measure: step {kind} recompute={rc}\n")
            b = batch
            while b >= 1:
                try:
                    runs.append(step_run(kind, cfg, b, seq, rc, steps, device))
                    break
                except torch.OutOfMemoryError:  # record it, retry with half the batch
                    runs.append({"model": kind, "recompute": rc, "batch": b, "error": "OOM"})
                except Exception as e:  # noqa: BLE001 — keep the other runs
                    runs.append({"model": kind, "recompute": rc, "batch": b,
                                 "error": f"{type(e).__name__}: {e}"[:300]})
                    break
                gc.collect()  # after the except block, so the traceback's frames are gone
                torch.cuda.empty_cache()
                b //= 2
    return {"precision": "fp32 parameters, gradients and AdamW moments; forward and "
                         "backward under torch.autocast(bfloat16) (PyTorch AMP)",
            "optimizer": "torch.optim.AdamW(lr=1e-4, fused=True on CUDA)",
            "timing": "time.perf_counter around zero_grad+forward+loss+backward+step, "
                      "synchronized; median of the timed steps after 2 warm-up steps "
                      "(plus the first step that created gradients and optimizer state)",
            "runs": runs}


def main() -> int:
    """Measure parts (a) and (b) and write the two JSON files."""
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", default="benchmarks/results")
    ap.add_argument("--prefix", default="h100")
    ap.add_argument("--device", choices=["cuda", "cpu"])
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (a smoke test)")
    ap.add_argument("--skip", choices=["ops", "steps"], action="append", default=[])
    args = ap.parse_args()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    prov = provenance(device, script="benchmarks/gpu_measure.py", tiny=args.tiny)
    timer = Timer(device, budget_s=0.02 if args.tiny else 0.2)  # timed seconds per point
    if "ops" not in args.skip:
        torch.manual_seed(0)
        side = torch.cuda.stream(torch.cuda.Stream()) if device.type == "cuda" else nullcontext()
        with side:  # forward, backward and graph capture on one stream (Timer.graph_time)
            doc = {"provenance": prov, "dtype": "bf16 parameters and activations",
                   "timing": "seconds: eager (CUDA events, back-to-back calls); "
                             "graph_seconds: the same calls replayed from a CUDA graph",
                   "llama3_8b_layer": layer_section(
                       "llama", *llama_layer_ops(device, args.tiny), timer),
                   "gpt2_layer": layer_section(
                       "gpt2", *gpt2_layer_ops(device, args.tiny), timer),
                   "embedding_head_loss": [measure_op(op, timer)
                                           for op in head_ops(device, args.tiny)],
                   "gemm_check": gemm_check(device, args.tiny, timer)}
        (out / f"{args.prefix}_ops.json").write_text(compact_json(doc) + "\n")
    if "steps" not in args.skip:
        doc = {"provenance": prov, **steps_section(device, args.tiny)}
        (out / f"{args.prefix}_steps.json").write_text(compact_json(doc) + "\n")
    print_summary(out, args.prefix)
    return 0


def print_summary(out: Path, prefix: str) -> None:
    """A short table of what was written (the end of the output is what a remote run
    shows)."""
    ops = out / f"{prefix}_ops.json"
    if ops.exists():
        d = json.loads(ops.read_text())
        for sec in ("llama3_8b_layer", "gpt2_layer"):
            print(f"{sec}: sum of ops {d[sec]['sum_of_ops_seconds']}, block fwd "
                  f"{d[sec]['block']['fwd']['seconds']}, fwd+bwd "
                  f"{d[sec]['block']['fwd_bwd']['seconds']}")
            print(f"  graph-replayed sum of ops {d[sec]['sum_of_ops_graph_seconds']}")
            for r in d[sec]["ops"]:
                rate = r["fwd"].get("flop_per_s") or r["fwd"].get("bytes_per_s")
                print(f"  {r['op'][:30]:30s} x{r['count']} fwd {r['fwd']['seconds']:.2e} "
                      f"({r['fwd'].get('graph_seconds', 0):.2e}) bwd {r['bwd']['seconds']:.2e} "
                      f"({r['bwd'].get('graph_seconds', 0):.2e}) s  fwd rate {rate:.2e}")
        for r in d["gemm_check"]["rows"]:
            print(f"gemm {r['n']} {r['data']} {r['layout']}: {r['flop_per_s'] / 1e12:.0f} "
                  f"TFLOP/s eager, graph {r.get('graph_seconds')}")
        print(f"gemm sustained: {d['gemm_check']['sustained_uniform']}")
    steps = out / f"{prefix}_steps.json"
    if steps.exists():
        for r in json.loads(steps.read_text())["runs"]:
            if "error" in r:
                print(f"step {r['model']} recompute={r['recompute']}: {r['error']}")
                continue
            mem = r["memory_bytes"]
            print(f"step {r['model']} {r['params'] / 1e9:.2f}B b={r['batch']} s={r['seq']} "
                  f"recompute={r['recompute'][:8]}: {r['step_seconds_median']} s, "
                  f"{r['model_flop_per_s'] / 1e12:.0f} model TFLOP/s, peak "
                  f"{(mem['peak_median'] or 0) / 2**30:.1f} GiB")


if __name__ == "__main__":
    sys.exit(main())
