"""Attention at long sequences on one GPU: the whole sequence, and the local part of
each context-parallel variant at cp = 2, 4, 8, for pricing context parallelism.

Llama 3 8B's attention (32 query heads, 8 key/value heads, head dim 128, batch 1, bf16,
``F.scaled_dot_product_attention`` with ``enable_gqa``), forward + backward, median of
CUDA-event timings after warm-up. Per sequence length S:

- ``full``: causal attention over S (what one device runs without cp);
- ``allgather/cp{n}``: a rank's share when keys and values are all-gathered and the
  queries are split into 2n chunks, rank r keeping chunks r and 2n-1-r (head-tail load
  balancing): two calls, each chunk of S/2n queries against the key prefix that ends at
  it, masked causally from the bottom right;
- ``ring_block/cp{n}``: one non-causal block of S/n queries against S/n keys, the step
  of a ring exchange away from the diagonal;
- ``ulysses/cp{n}``: causal attention over S with 32/n query and 8/n (at least 1)
  key/value heads, a rank's share after the all-to-all over heads.

FLOPs per call: 4·heads·Lq·Lk·d, less the masked triangle (Lq²/2 of the Lq·Lk pairs when
causal), times 3.5 for forward + backward (the backward recomputes the scores:
FlashAttention-2, Dao 2023)::

    python benchmarks/gpu_attention_long.py --out results/h100_attention_long.json
    python benchmarks/gpu_attention_long.py --tiny --out /tmp/att.json   # CPU check
    python benchmarks/gpu_attention_long.py --reprice results/h100_attention_long.json

``--reprice`` prices each measured case's calls again
(:func:`autopar.cost_models.context_parallel.attention_call_s`, profile ``h100-sxm``)
and prints measured against predicted, per case and per variant (no GPU needed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def attention_flops(heads: int, lq: int, lk: int, causal: bool) -> float:
    """Forward+backward FLOPs of one attention call (module docstring)."""
    pairs = lq * lk - (lq * lq / 2.0 if causal else 0.0)
    return 3.5 * 4.0 * heads * pairs * HEAD_DIM


def timed(fn: Callable[[], None], reps: int, cuda: bool) -> float:
    """Median seconds of ``fn`` over ``reps`` calls after two warm-up calls."""
    times = []
    for i in range(reps + 2):
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def calls(q_len: int, k_len: int, heads: int, kv: int, causal: bool, dev: str,
          dtype: torch.dtype) -> Callable[[], None]:
    """One forward + backward of attention with the given shape."""
    from torch.nn.attention.bias import causal_lower_right

    q = torch.randn(1, heads, q_len, HEAD_DIM, device=dev, dtype=dtype, requires_grad=True)
    k = torch.randn(1, kv, k_len, HEAD_DIM, device=dev, dtype=dtype, requires_grad=True)
    v = torch.randn(1, kv, k_len, HEAD_DIM, device=dev, dtype=dtype, requires_grad=True)
    mask = causal_lower_right(q_len, k_len) if causal and q_len != k_len else None

    def run() -> None:
        if mask is not None:
            kk = k.repeat_interleave(heads // kv, dim=1)
            vv = v.repeat_interleave(heads // kv, dim=1)
            out = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        out.backward(torch.ones_like(out))
        q.grad = k.grad = v.grad = None
    return run


def measure(seqs: list[int], cps: list[int], dev: str, reps: int) -> list[dict[str, Any]]:
    """Every case (module docstring) at every sequence length."""
    cuda = dev == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    rows = []

    def one(name: str, seq: int, parts: list[tuple[int, int, int, int, bool]]) -> None:
        fns = [calls(lq, lk, h, kv, c, dev, dtype) for lq, lk, h, kv, c in parts]
        s = timed(lambda: [f() for f in fns], reps, cuda)
        flops = sum(attention_flops(h, lq, lk, c) for lq, lk, h, kv, c in parts)
        rows.append({"case": name, "seq": seq, "calls": [list(p) for p in parts],
                     "seconds": s, "flops": flops, "tflops_per_s": flops / s / 1e12})
        print(f"{name:22s} S={seq:7d} {s * 1e3:9.2f} ms {flops / s / 1e12:7.1f} TFLOP/s",
              flush=True)
        fns.clear()  # free the tensors before the next case
        if cuda:
            torch.cuda.empty_cache()

    for seq in seqs:
        one("full", seq, [(seq, seq, HEADS, KV_HEADS, True)])
        for n in cps:
            c = seq // (2 * n)
            one(f"allgather/cp{n}", seq, [(c, c, HEADS, KV_HEADS, True),
                                          (c, seq, HEADS, KV_HEADS, True)])
            one(f"ring_block/cp{n}", seq, [(seq // n, seq // n, HEADS, KV_HEADS, False)])
            one(f"ulysses/cp{n}", seq, [(seq, seq, HEADS // n, max(1, KV_HEADS // n), True)])
    return rows


def reprice(path: str, profile: str) -> dict[str, Any]:
    """Measured against predicted seconds of every case of ``path`` (module docstring)."""
    import autopar
    from autopar.cost_models.context_parallel import attention_call_s

    hw = autopar.Cluster(profile, 1, 1).hardware()
    doc = json.loads(open(path).read())
    out, by_variant = [], {}
    for r in doc["rows"]:
        pred = sum(sum(attention_call_s(hw, 1, h, kv, lq, lk, HEAD_DIM, c, "bf16"))
                   for lq, lk, h, kv, c in r["calls"])
        err = (pred / r["seconds"] - 1) * 100
        variant = r["case"].split("/")[0]
        by_variant.setdefault(variant, []).append(abs(err))
        out.append({"case": r["case"], "seq": r["seq"], "measured_s": r["seconds"],
                    "predicted_s": pred, "error_pct": err})
        print(f"{r['case']:18s} S={r['seq']:7d} {r['seconds'] * 1e3:9.2f} ms  predicted "
              f"{pred * 1e3:9.2f} ms ({err:+6.1f}%)")
    mape = {v: statistics.fmean(e) for v, e in by_variant.items()}
    print("MAPE per variant:", {v: round(m, 1) for v, m in mape.items()})
    return {"data": path, "profile": profile, "mape_pct": mape, "cases": out}


def main() -> int:
    """Measure and write the JSON (or reprice committed data)."""
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="JSON to write (required unless --reprice)")
    ap.add_argument("--reprice", help="measurements to price again (no GPU)")
    ap.add_argument("--profile", default="h100-sxm", help="hardware profile for --reprice")
    ap.add_argument("--seqs", default="8192,32768,131072")
    ap.add_argument("--cps", default="2,4,8")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tiny", action="store_true", help="small sequences, to check on a CPU")
    args = ap.parse_args()
    if args.reprice:
        res = reprice(args.reprice, args.profile)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1)
        return 0
    if not args.out:
        ap.error("--out is required unless --reprice")
    from autopar.cost_models.profiling.timing import provenance

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    seqs = [256] if args.tiny else [int(s) for s in args.seqs.split(",")]
    doc = {"provenance": provenance(torch.device(dev)), "heads": HEADS, "kv_heads": KV_HEADS,
           "head_dim": HEAD_DIM, "rows": []}
    doc["rows"] = measure(seqs, [int(c) for c in args.cps.split(",")], dev,
                          2 if args.tiny else args.reps)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
