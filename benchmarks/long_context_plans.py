"""Plans for Llama 3 8B at long sequences: 32K, 128K and 1M tokens per sequence on 8,
64 and 1,024 H100 (8 per node), each with context parallelism left to the search and
with ``cp=1``, to show where cp is chosen and why.

Each cell records the plan (mesh, cp variant, micro-batching, ZeRO stage,
recomputation), its predicted step time, MFU and memory per device, the planner's
note saying why cp was chosen, and what the search says without cp (its plan, or why
none fits). The global batch holds about 4M tokens (at least one sequence)::

    python benchmarks/long_context_plans.py --out benchmarks/results/long_context_plans.json

writes the JSON and a markdown table beside it (``.md``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from pathlib import Path

import torch

import autopar
from autopar.errors import AutoparError
from autopar.examples import zoo
from autopar.summary import fmt_time
from autopar.units_text import fmt_bytes

SEQS = (32768, 131072, 1048576)
GPUS = (8, 64, 1024)
TOKENS = 4 * 1024 * 1024  # tokens per step: Llama 3's long-context stage used about 4M


def cell(seq: int, gpus: int, **space) -> dict:
    """One plan (or why none fits) for ``seq`` tokens per sequence on ``gpus`` H100."""
    model, x = zoo.get("llama3-8b", batch_size=1, seq_len=seq)
    gb = max(1, TOKENS // seq)
    cluster = autopar.Cluster("h100-sxm", max(1, gpus // 8), min(gpus, 8))
    t0 = time.perf_counter()
    try:
        p = autopar.plan(model, x, cluster=cluster, global_batch=gb, **space)
    except AutoparError as e:  # no plan fits, or no layout divides the batch
        return {"fits": False, "why": str(e), "plan_s": time.perf_counter() - t0}
    return {"fits": True, "mesh": p.mesh, "cp_variant": p.context.variant if p.context else None,
            "microbatch": [p.microbatch_size, p.num_microbatches], "zero": p.zero,
            "offload": p.offload,
            "recompute": sorted(set(p.recompute.values()) or {"none"}),
            "schedule": p.pipeline.schedule if p.pipeline else None,
            "step_time_s": p.step_time_s, "mfu": p.mfu, "memory_bytes": p.memory_per_device_bytes,
            "memory": p.memory, "notes": p.notes, "global_batch": gb,
            "plan_s": time.perf_counter() - t0}


def table(rows: list[dict]) -> str:
    """The markdown table of the cells."""
    out = ["| tokens/seq | H100 | global batch | plan | cp variant | step | MFU | memory | "
           "without cp |", "|---:|---:|---:|---|---|---:|---:|---:|---|"]
    for r in rows:
        a, b = r["auto"], r["no_cp"]
        if a["fits"]:
            mesh = " x ".join(f"{k}{v}" for k, v in a["mesh"].items())
            plan = (f"{mesh}, mb {a['microbatch'][0]}x{a['microbatch'][1]}, ZeRO-{a['zero']}"
                    f"{' offload' if a['offload'] else ''}, recompute {'/'.join(a['recompute'])}")
            cells = [plan, a["cp_variant"] or "–", fmt_time(a["step_time_s"]),
                     f"{a['mfu'] * 100:.1f}%", fmt_bytes(a["memory_bytes"])]
        else:
            cells = [a["why"].split(" (")[0], "–", "–", "–", "–"]
        if b["fits"]:
            nocp = (f"{' x '.join(f'{k}{v}' for k, v in b['mesh'].items())}, "
                    f"{fmt_time(b['step_time_s'])}")
        else:
            nocp = b["why"].split(" (")[0]
        out.append(f"| {r['seq']:,} | {r['gpus']} | {a.get('global_batch', '–')} | "
                   + " | ".join(cells) + f" | {nocp} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/long_context_plans.json"))
    ap.add_argument("--seqs", type=int, nargs="*", default=list(SEQS))
    ap.add_argument("--gpus", type=int, nargs="*", default=list(GPUS))
    args = ap.parse_args()
    rows = []
    for seq in args.seqs:
        for gpus in args.gpus:
            rows.append({"seq": seq, "gpus": gpus, "auto": cell(seq, gpus),
                         "no_cp": cell(seq, gpus, cp=1)})
            print(json.dumps(rows[-1], default=str)[:400], flush=True)
    meta = {"date": datetime.date.today().isoformat(), "torch": torch.__version__,
            "profile": "h100-sxm (shipped)", "model": "llama3-8b", "tokens_per_step": TOKENS}
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str) + "\n")
    args.out.with_suffix(".md").write_text(
        f"# Llama 3 8B at long sequences ({meta['date']}, torch {meta['torch']}, "
        f"profile {meta['profile']})\n\n" + table(rows) + "\n")


if __name__ == "__main__":
    main()
