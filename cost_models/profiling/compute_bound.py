"""Compute-bound measurements of ``autopar profile``: GEMMs, attention, launch overhead.

FLOP conventions (so achieved rates can be recomputed from the rows):

- GEMM ``C[m, n] = A[m, k] @ B[k, n]`` (row-major, torch.mm): ``2·m·n·k``.
- Causal attention forward, ``scaled_dot_product_attention(q, k, v, is_causal=True)``
  with q of shape (batch, heads, seq, head_dim): the two matrix products QKᵀ and PV,
  ``4·batch·heads·seq²·head_dim``, halved for the causal mask; backward is 2.5× the
  forward (five products instead of two). Both as in FlashAttention-2's benchmarks
  (Dao, "FlashAttention-2", 2023, §4.1), so rates compare with published numbers.
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

import torch
import torch.nn.functional as F

from autopar.cost_models.profiling.timing import DTYPES, Task, Timer, row, sig, summarize

GemmShape = tuple[int, int, int, str, str]
"""(m, n, k, dtype name, tag) of one GEMM point."""

AttnShape = tuple[int, int, int, int, int, str]
"""(batch, heads, kv_heads, seq, head_dim, dtype name) of one attention point."""


@contextlib.contextmanager
def matmul_precision(dtype: str) -> Iterator[None]:
    """TF32 tensor-core matmuls on for ``tf32``, off otherwise; restored on exit."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def gemm_task(m: int, n: int, k: int, dtype: str, tag: str, device: torch.device) -> Task:
    """One forward GEMM point (see module docstring for the FLOP count)."""

    def run(timer: Timer) -> dict:
        dt = DTYPES[dtype]
        a = torch.randn(m, k, device=device, dtype=dt)
        b = torch.randn(k, n, device=device, dtype=dt)
        with matmul_precision(dtype):
            meas = timer.measure(lambda: torch.mm(a, b))
        return row(meas, flops=2.0 * m * n * k)

    params = {"m": m, "n": n, "k": k, "dtype": dtype, "layout": "NN", "tag": tag}
    return Task("gemm", f"{m}x{n}x{k}:{dtype}", params, run)


def attention_flops(batch: int, heads: int, seq: int, head_dim: int, backward: bool) -> float:
    """FLOPs of causal attention (module docstring's convention)."""
    fwd = 4.0 * batch * heads * seq * seq * head_dim / 2
    return 2.5 * fwd if backward else fwd


def attention_tasks(batch: int, heads: int, kv_heads: int, seq: int, head_dim: int,
                    dtype: str, device: torch.device) -> list[Task]:
    """Forward and backward points of causal SDPA, the backend left to torch.

    ``kv_heads < heads`` passes k and v with fewer heads and ``enable_gqa=True``
    (grouped-query attention as torch sees it natively); ``kv_heads == heads`` is
    plain multi-head attention (what a model that expands k and v gives torch).
    """
    gqa = kv_heads != heads
    params = {"batch": batch, "heads": heads, "kv_heads": kv_heads, "seq": seq,
              "head_dim": head_dim, "dtype": dtype, "causal": True, "gqa": gqa}
    key = f"b{batch}h{heads}kv{kv_heads}s{seq}d{head_dim}:{dtype}"

    def inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        dt = DTYPES[dtype]
        q = torch.randn(batch, heads, seq, head_dim, device=device, dtype=dt,
                        requires_grad=True)
        k = torch.randn(batch, kv_heads, seq, head_dim, device=device, dtype=dt,
                        requires_grad=True)
        v = torch.randn_like(k, requires_grad=True)
        return q, k, v

    def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if gqa:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def fwd(timer: Timer) -> dict:
        q, k, v = inputs()
        with torch.no_grad():
            meas = timer.measure(lambda: sdpa(q, k, v))
        return row(meas, flops=attention_flops(batch, heads, seq, head_dim, False))

    def bwd(timer: Timer) -> dict:
        q, k, v = inputs()
        out = sdpa(q, k, v)
        grad = torch.randn_like(out)
        meas = timer.measure(lambda: torch.autograd.grad(out, (q, k, v), grad,
                                                         retain_graph=True))
        return row(meas, flops=attention_flops(batch, heads, seq, head_dim, True))

    return [Task("attention", key + ":fwd", {**params, "pass": "fwd"}, fwd),
            Task("attention", key + ":bwd", {**params, "pass": "bwd"}, bwd)]


def launch_tasks(device: torch.device) -> list[Task]:
    """Per-op overhead of a tiny op (one-element add), three ways:

    - ``host_dispatch``: host seconds per call of a tiny add issued back to back, no
      synchronization (PyTorch dispatch + kernel launch; the rate a Python training
      loop can issue ops at);
    - ``device_back_to_back``: device seconds per tiny add in a long batch, CUDA events
      (what each small kernel costs in an eager program, launch gaps included);
    - ``round_trip``: host seconds of one tiny add followed by a synchronize (launch
      latency plus completion);
    - ``graph_replay`` (CUDA only): device seconds per tiny add replayed from a CUDA
      graph of 100 adds (kernel time with launch gaps removed; median of 50 replays).
    """
    x = torch.ones(1, device=device)
    y = torch.empty_like(x)

    def op() -> None:
        torch.add(x, x, out=y)

    def host(timer: Timer) -> dict:
        for _ in range(100):
            op()
        timer.sync()
        times = []
        for _ in range(15):
            t0 = time.perf_counter()
            for _ in range(200):
                op()
            times.append((time.perf_counter() - t0) / 200)
            timer.sync()
        return row(summarize(times, 200))

    def back_to_back(timer: Timer) -> dict:
        old = timer.max_inner
        timer.max_inner = 1000
        try:
            return row(timer.measure(op))
        finally:
            timer.max_inner = old

    def round_trip(timer: Timer) -> dict:
        times = []
        for i in range(230):
            t0 = time.perf_counter()
            op()
            timer.sync()
            if i >= 30:  # the first 30 are warm-up
                times.append(time.perf_counter() - t0)
        return row(summarize(times))

    def graph(timer: Timer) -> dict:
        op()
        seconds = timer.graph_time(op, 100, 50)
        return {"seconds": sig(seconds), "reps": 50, "inner": 100}

    what = [("host_dispatch", host), ("device_back_to_back", back_to_back),
            ("round_trip", round_trip)]
    if device.type == "cuda":
        what.append(("graph_replay", graph))
    return [Task("launch", name, {"what": name, "op": "add, 1 element, fp32"}, fn)
            for name, fn in what]
