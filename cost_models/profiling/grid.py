"""The points ``autopar profile`` measures: full and ``--quick`` grids on a GPU, and the
same structure with small shapes on a CPU. Shapes come from the models autopar plans for:

- hidden sizes 4096, 8192, 12288 with FFN sizes 14336 / 28672 (Llama 3 8B / 70B,
  Meta's release configs), 4h = 16384 / 32768 / 49152 (GPT-style MLPs; GPT-3 175B has
  h = 12288, Brown et al. 2020, Table 2.1), each sharded by tensor-parallel degree
  1/2/4/8 (Megatron-LM: column-parallel splits n, row-parallel splits k; Shoeybi et
  al. 2019), at 2048 and 8192 tokens per micro-batch;
- the weight-gradient GEMMs of those layers (n × k output, inner dimension = tokens);
- attention head_dim 64 / 128 and 8..64 heads over sequences 512..8192 with
  8192 tokens per batch, and Llama 3 8B's grouped-query 32 heads / 8 KV heads, also
  on one sequence of 16K-128K tokens (context parallelism's range);
- memory-bound ops over 1 MiB..512 MiB tensors (beyond the 50 MB L2 of an H100),
  rows of hidden 4096, vocabularies 50304 (GPT-2 padded, nanoGPT) and 128256 (Llama 3).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from autopar.cost_models.profiling.timing import Task
from autopar.cost_models.profiling.compute_bound import (AttnShape, GemmShape, attention_tasks,
                                                         gemm_task, launch_tasks)
from autopar.cost_models.profiling.memory_bound import (cross_entropy_tasks, embedding_tasks,
                                                        pointwise_tasks, row_tasks)


@dataclass(frozen=True)
class Grid:
    """Everything one profile run measures (plain data; see module docstring)."""

    gemm: tuple[GemmShape, ...]
    attention: tuple[AttnShape, ...]
    pointwise: tuple[tuple[int, str], ...]          # (numel, dtype)
    rows: tuple[tuple[int, int, str], ...]          # (rows, hidden, dtype)
    embedding: tuple[tuple[int, int, int, str], ...]  # (tokens, vocab, hidden, dtype)
    cross_entropy: tuple[tuple[int, int, str], ...]  # (tokens, vocab, dtype)
    comm_sizes: tuple[int, ...]                     # bytes
    launch: bool = True
    host: bool = True                               # host overheads (host_wrappers)
    host_rounds: int = 3                            # their median over this many rounds
    budget_s: float = 0.25                          # timed seconds per point (Timer)

    def tasks(self, device: torch.device) -> list[Task]:
        """The grid's points as tasks, in measuring order (collectives excluded), each
        key once (the first tag wins)."""
        out: list[Task] = []
        if self.launch:
            out += launch_tasks(device)
        out += [gemm_task(*g, device=device) for g in self.gemm]
        for a in self.attention:
            out += attention_tasks(*a, device=device)
        for numel, dt in self.pointwise:
            out += pointwise_tasks(numel, dt, device)
        for r, h, dt in self.rows:
            out += row_tasks(r, h, dt, device)
        for t, v, h, dt in self.embedding:
            out += embedding_tasks(t, v, h, dt, device)
        for t, v, dt in self.cross_entropy:
            out += cross_entropy_tasks(t, v, dt, device)
        seen: set[tuple[str, str]] = set()  # a shape listed twice (square = TP shard) once
        unique = []
        for task in out:
            if (task.table, task.key) not in seen:
                seen.add((task.table, task.key))
                unique.append(task)
        return unique


def tp_gemms(tokens: tuple[int, ...], models: tuple[tuple[int, int], ...],
             tps: tuple[int, ...], wgrad_tokens: tuple[int, ...], dtype: str) -> list[GemmShape]:
    """Tensor-parallel shard GEMMs: for hidden h and FFN f, column-parallel (n split)
    and row-parallel (k split) shapes of the attention (h×h) and MLP (h×f) layers, and
    the weight-gradient GEMMs (m = out features, n = in features, k = tokens)."""
    seen: set[tuple[int, int, int]] = set()
    out: list[GemmShape] = []

    def add(m: int, n: int, k: int, tag: str) -> None:
        if (m, n, k) not in seen:
            seen.add((m, n, k))
            out.append((m, n, k, dtype, tag))

    for h, f in models:
        for tp in tps:
            layer = [(h // tp, h, "attn_col"), (h, h // tp, "attn_row"),
                     (f // tp, h, "ffn_col"), (h, f // tp, "ffn_row")]
            for m in tokens:
                for n_out, k_in, tag in layer:
                    add(m, n_out, k_in, f"{tag}_tp{tp}")
            for m in wgrad_tokens:
                for n_out, k_in, tag in layer:
                    add(n_out, k_in, m, f"{tag}_tp{tp}_wgrad")
    return out


def squares(sizes: tuple[int, ...], dtypes: tuple[str, ...]) -> list[GemmShape]:
    """Square GEMMs n³ for each dtype."""
    return [(n, n, n, dt, "square") for dt in dtypes for n in sizes]


def skinny(ms: tuple[int, ...], nks: tuple[int, ...], dtypes: tuple[str, ...]) -> list[GemmShape]:
    """GEMMs with few rows (m × n·k, n = k): small batches and decode-like shapes."""
    return [(m, nk, nk, dt, "skinny") for dt in dtypes for nk in nks for m in ms]


LLAMA_GPT = ((4096, 14336), (4096, 16384), (8192, 28672), (8192, 32768), (12288, 49152))
"""(hidden, FFN) pairs of the module docstring."""


LONG_ATTENTION = [(1, 32, kv, s, 128, "bf16") for kv in (8, 32)
                  for s in (16384, 32768, 65536, 131072)]
"""Attention of one long sequence (Llama 3 8B's heads, grouped and not), 16K to 128K
tokens: where context parallelism is planned."""


def gpu_grid(quick: bool) -> Grid:
    """The GPU grid: a few hundred points in full mode, about a hundred in quick."""
    if quick:
        gemm = (squares((1024, 4096, 8192), ("bf16", "fp16", "fp32"))
                + skinny((1, 64), (4096,), ("bf16",))
                + tp_gemms((8192,), (LLAMA_GPT[0], LLAMA_GPT[2]), (1, 2, 4, 8), (), "bf16"))
        attn = [(8192 // s, 32, 32, s, 128, "bf16") for s in (1024, 4096, 8192)]
        attn += [(8, 12, 12, 1024, 64, "bf16"), (1, 32, 8, 8192, 128, "bf16")]
        return Grid(gemm=tuple(gemm), attention=tuple(attn),
                    pointwise=((2**24, "bf16"), (2**28, "bf16")),
                    rows=((8192, 4096, "bf16"),), embedding=((8192, 128256, 4096, "bf16"),),
                    cross_entropy=((8192, 128256, "bf16"),),
                    comm_sizes=tuple(2**k for k in range(16, 31, 4)), budget_s=0.1,
                    host_rounds=1)
    gemm = (squares((256, 512, 1024, 2048, 4096, 8192, 16384), ("bf16", "fp16"))
            + squares((256, 1024, 4096, 8192), ("fp32", "tf32"))
            + skinny((1, 16, 64, 256), (4096, 8192), ("bf16", "fp16", "fp32"))
            + [(8192, 8192, k, "bf16", "small_k") for k in (128, 512)]
            + tp_gemms((2048, 8192), LLAMA_GPT, (1, 2, 4, 8), (8192,), "bf16"))
    attn = [(8192 // s, h, h, s, d, "bf16") for d in (64, 128) for h in (8, 16, 32, 64)
            for s in (512, 1024, 2048, 4096, 8192)]
    attn += [(8192 // s, 32, 8, s, 128, "bf16") for s in (1024, 2048, 4096, 8192)]
    attn += LONG_ATTENTION
    attn += [(1, 32, 32, s, 128, "fp16") for s in (2048, 8192)]
    sizes = tuple(2**k for k in (19, 21, 23, 25, 27))  # 1 MiB .. 256 MiB in bf16
    return Grid(gemm=tuple(gemm), attention=tuple(attn),
                pointwise=tuple((n, "bf16") for n in sizes) + ((2**27, "fp32"),),
                rows=tuple((r, h, "bf16") for h in (4096, 8192) for r in (1024, 8192, 32768))
                + ((8192, 4096, "fp32"),),
                embedding=tuple((t, v, h, "bf16") for v, h in ((50304, 768), (128256, 4096))
                                for t in (2048, 8192, 32768)),
                cross_entropy=tuple((t, v, dt) for v in (50304, 128256) for t in (2048, 8192)
                                    for dt in ("bf16", "fp32")),
                comm_sizes=tuple(2**k for k in range(10, 31, 2)))


def cpu_grid(quick: bool) -> Grid:
    """The same structure with small shapes, for a CPU run (gloo for collectives)."""
    if quick:
        return Grid(gemm=tuple(squares((64, 256), ("fp32", "bf16"))
                               + skinny((1,), (256,), ("fp32",))
                               + tp_gemms((128,), ((128, 512),), (1, 4), (), "fp32")),
                    attention=((2, 4, 4, 128, 64, "fp32"), (1, 4, 2, 128, 64, "fp32")),
                    pointwise=((2**16, "fp32"),), rows=((64, 256, "fp32"),),
                    embedding=((64, 1024, 128, "fp32"),), cross_entropy=((64, 1024, "fp32"),),
                    comm_sizes=tuple(2**k for k in range(10, 21, 5)), budget_s=0.02)
    return Grid(gemm=tuple(squares((64, 128, 256, 512, 1024), ("fp32", "bf16"))
                           + skinny((1, 16), (512, 1024), ("fp32",))
                           + tp_gemms((512,), ((256, 1024), (512, 2048)), (1, 2, 4, 8),
                                      (512,), "fp32")),
                attention=tuple((4096 // s, h, h, s, 64, "fp32") for h in (4, 8)
                                for s in (128, 256, 512)),
                pointwise=tuple((2**k, "fp32") for k in (16, 18, 20, 22)),
                rows=((256, 512, "fp32"), (1024, 1024, "fp32")),
                embedding=((512, 8192, 256, "fp32"),), cross_entropy=((512, 8192, "fp32"),),
                comm_sizes=tuple(2**k for k in range(10, 23, 2)), budget_s=0.1)
