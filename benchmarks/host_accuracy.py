"""The priced host time of a training step against the committed GPU measurements
(no GPU needed).

Each eager row of ``results/h100_runtime_steps.json``, ``results/h100_compile_steps.json``
and ``results/h200_compile_steps.json`` (``gpu_runtime_step.py``: autopar's runtime on
one GPU, the ~1.3B GPT, the ~1.5B Llama and an 8-layer Llama 3 8B slice, each with its
plan's micro-batch and recomputation) measured the host's time to issue one step
(forward, backward, optimizer step and ``zero_grad``, up to the synchronize). This
prices the same plan again with :func:`autopar.estimate` on the GPU's shipped profile
and prints the priced host seconds (:attr:`Estimate.breakdown` ``host_s``) beside the
measured ones, per row, with the median and max |error|::

    python benchmarks/host_accuracy.py [--out results/host_accuracy.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results"
SOURCES = (("h100_runtime_steps.json", "h100-sxm"), ("h100_compile_steps.json", "h100-sxm"),
           ("h200_compile_steps.json", "h200"))
"""(committed file, profile it is priced with)."""


def _model(kind: str, config: dict[str, Any]) -> torch.nn.Module:
    from autopar.examples import gpt, llama

    with torch.device("meta"):
        if kind == "gpt":
            return gpt.GPT(gpt.GPTConfig(**config))
        return llama.Llama(llama.LlamaConfig(**config))


def price_row(row: dict[str, Any], profile: str) -> float:
    """The priced host seconds of ``row``'s plan (module docstring)."""
    import autopar

    plan = row["plan"]
    model = _model(row["model"], row["config"])
    x = torch.randint(0, row["config"]["vocab_size"], (row["batch"], row["seq"]),
                      device="meta")
    spec = autopar.Spec(dp=1, microbatch_size=plan["microbatch_size"],
                        recompute=plan["recompute"][0])
    est = autopar.estimate(model, (x,), spec, cluster=autopar.Cluster(profile, 1, 1),
                           global_batch=row["batch"], precision=plan["precision"])
    return float(est.breakdown["host_s"])


def main(argv: list[str] | None = None) -> int:
    """Price every eager row and print the table (module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="write the rows and summary as JSON here")
    args = ap.parse_args(argv)
    rows = []
    for name, profile in SOURCES:
        data = json.loads((RESULTS / name).read_text())
        for row in data["results"]:
            if row.get("compiled"):
                continue
            predicted = price_row(row, profile)
            measured = row["measured_host_s"]
            err = 100.0 * (predicted - measured) / measured
            rows.append({"source": name, "model": row["model"], "case": row["case"],
                         "recompute": row["plan"]["recompute"][0],
                         "microbatch_size": row["plan"]["microbatch_size"],
                         "measured_host_s": measured, "predicted_host_s": predicted,
                         "error_pct": err})
            print(f"{name:26s} {row['model']:8s} {row['case']:12s} measured "
                  f"{measured * 1e3:7.1f} ms  priced {predicted * 1e3:7.1f} ms  {err:+6.1f}%",
                  flush=True)
    errs = [abs(r["error_pct"]) for r in rows]
    summary = {"rows": len(rows), "median_abs_pct": statistics.median(errs),
               "max_abs_pct": max(errs)}
    for rec in ("none", "selective", "full"):
        sub = [abs(r["error_pct"]) for r in rows if r["recompute"] == rec]
        if sub:
            summary[f"median_abs_pct_{rec}"] = statistics.median(sub)
    print(json.dumps(summary, indent=1))
    if args.out:
        out = {"date": str(datetime.date.today()), "torch": torch.__version__,
               "summary": summary, "rows": rows}
        args.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
