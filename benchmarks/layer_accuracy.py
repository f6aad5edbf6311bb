"""The cost model against full-size layers measured on a GPU, per layer and per term,
from committed data (no GPU needed).

Reads the results of ``gpu_layers.py`` (default ``results/h100_layers_steady.json``:
Llama 3 8B / 70B and GPT-3 175B layers at tensor-parallel shard shapes, run by
autopar's runtime on one H100 after 1 s of back-to-back steps each, measured in the
call that measured the h100-sxm profile) and prices every case again with the current cost model and the
hardware profile named by ``--profile`` (default: the one the data was measured for).
Per case it prints the measured and predicted forward+backward time and, per term:

- ``gemm``, ``attention``: device time of matrix products and of attention kernels;
- ``memory``: every other kernel (norms, pointwise, casts, FSDP2's copy-in/out);
- ``host``: the time the GPU waited for the host (measured: the profiled step's wall
  time minus its kernel time; predicted: the exposed host time of the plan).

The predicted terms come from the planner's own per-node prices
(:func:`autopar.solvers.problem_build.build_problem` on the one-device mesh), grouped by
:func:`autopar.cost_models.host.op_kind`; their sum plus recomputation and exposed host
time is the plan's forward+backward time, which is what the case's total compares.
The MAPE is over the cases that ran, and apart for the device-bound ones (measured
host wait under 10% of the step) and the host-bound ones::

    python benchmarks/layer_accuracy.py [--data results/h100_layers_steady.json]
                                        [--profile h100-sxm] [--out results/layer_accuracy.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

# run as a script, this file's folder is on sys.path
from gpu_layers import predict
from layer_cases import LayerCase, build, mse_loss

RESULTS = Path(__file__).resolve().parent / "results"
TERMS = ("gemm", "attention", "memory", "host")
MEASURED_KIND = {"gemm": "gemm", "attention": "attention"}
"""Kernel kinds of ``gpu_runtime_step.KERNEL_KINDS`` that are a term of their own; the
other kinds are ``memory``."""


def measured_terms(row: dict[str, Any]) -> dict[str, float]:
    """Seconds per term of the profiled step (module docstring)."""
    k = row["kernels"]
    out = dict.fromkeys(TERMS, 0.0)
    for kind, s in k["by_kind_s"].items():
        out[MEASURED_KIND.get(kind, "memory")] += s
    out["host"] = max(0.0, k["wall_s"] - k["kernel_s"])
    return out


def node_prices(model: Any, x: Any, y: Any, batch: int, hw: Any, *, zero: int = 0,
                precision: str = "bf16", optimizer: str = "adamw",
                recompute: str = "none") -> list[tuple[Any, Any, float]]:
    """(op node, its price, multiplicity) of every op of ``model`` as the planner prices
    it on one device (:func:`autopar.solvers.problem_build.build_problem`, the op's
    first strategy), with ``mse_loss`` against ``y``."""
    from autopar.capture import capture
    from autopar.sharding import Mesh
    from autopar.strategies.analysis import analyze
    from autopar.solvers.problem_build import build_problem
    from autopar.strategies.settings import Settings

    graph = capture(model, (x,), loss_fn=mse_loss, example_targets=y)
    st = Settings(Mesh(("dp", "tp"), (1, 1)), batch, 1, zero, precision, optimizer,
                  float("inf"), hw, 1, recompute_modes=(recompute,))
    built = build_problem(analyze(graph), st)
    return [(graph.node(c.name), c.strategies[0], c.multiplicity) for c in built.problem.nodes]


def predicted_terms(case: LayerCase, profile: str, plan: Any) -> dict[str, float]:
    """Seconds per term by the planner's per-node prices on one device."""
    import autopar
    from autopar.cost_models.host import op_kind

    model, x, y = build(case)
    hw = autopar.Cluster(profile, 1, 1).hardware()
    out = dict.fromkeys(TERMS, 0.0)
    for n, cost, mult in node_prices(model, x, y, case.batch, hw, zero=plan.zero,
                                     precision=plan.precision, optimizer=plan.optimizer,
                                     recompute=case.recompute):
        kind = op_kind(n.target, n.flops, n.bytes)
        term = {"matmul": "gemm", "attention": "attention"}.get(kind, "memory")
        out[term] += cost.compute_s * mult
        out["memory"] += cost.param_copy_s * mult
    out["host"] = plan.breakdown.get("exposed_host_s", 0.0)
    return out


def ape(pred: float, meas: float) -> float:
    """Absolute percentage error of ``pred`` against ``meas``."""
    return abs(pred - meas) / meas * 100.0


def evaluate(rows: list[dict[str, Any]], profile: str) -> list[dict[str, Any]]:
    """One record per case that ran: measured and predicted total and terms."""
    out = []
    for row in rows:
        if "error" in row:
            continue
        case = LayerCase(**row["case"])
        plan = predict(case, profile)
        b = plan.breakdown
        pred = b.get("compute_s", 0.0) + b.get("recompute_s", 0.0) + b.get("exposed_host_s", 0.0)
        meas = row["measured_fwd_bwd_s"]
        mt = measured_terms(row)
        out.append({"case": case.name, "measured_s": meas, "predicted_s": pred,
                    "error_pct": (pred / meas - 1.0) * 100.0, "ape": ape(pred, meas),
                    "host_bound": mt["host"] > 0.1 * row["kernels"]["wall_s"],
                    "measured_terms_s": mt,
                    "predicted_terms_s": predicted_terms(case, profile, plan)})
        print(_line(out[-1]), flush=True)
    return out


def _line(r: dict[str, Any]) -> str:
    m, p = r["measured_terms_s"], r["predicted_terms_s"]
    terms = "  ".join(f"{t} {m[t] * 1e3:6.2f}/{p[t] * 1e3:6.2f}" for t in TERMS)
    return (f"{r['case']:36s} {r['measured_s'] * 1e3:8.2f} ms  pred {r['predicted_s'] * 1e3:8.2f}"
            f" ({r['error_pct']:+6.1f}%)  [{'host' if r['host_bound'] else 'dev '}]  {terms}")


def summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    """MAPE and worst case over all cases, the device-bound and the host-bound ones,
    and the per-term MAPE over the device-bound cases without recomputation (terms
    above 1 ms; the predicted terms leave the recomputed forward out)."""
    def group(rs: list[dict[str, Any]]) -> dict[str, Any]:
        if not rs:
            return {"cases": 0}
        worst = max(rs, key=lambda r: r["ape"])
        return {"cases": len(rs), "mape_pct": statistics.fmean(r["ape"] for r in rs),
                "worst_pct": worst["error_pct"], "worst_case": worst["case"]}

    dev = [r for r in records if not r["host_bound"]]
    per_term = {}
    for t in ("gemm", "attention", "memory"):
        errs = [ape(r["predicted_terms_s"][t], r["measured_terms_s"][t]) for r in dev
                if r["measured_terms_s"][t] > 1e-3 and r["case"].endswith("/none")]
        per_term[t] = statistics.fmean(errs) if errs else None
    return {"all": group(records), "device_bound": group(dev),
            "host_bound": group([r for r in records if r["host_bound"]]),
            "term_mape_pct_device_bound": per_term}


def main() -> int:
    """Price the measured cases again and print/write the comparison."""
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=RESULTS / "h100_layers_steady.json")
    ap.add_argument("--profile", help="hardware profile (default: the data's own)")
    ap.add_argument("--out", type=Path, help="JSON to write (default: print only)")
    args = ap.parse_args()
    doc = json.loads(args.data.read_text())
    rows = doc["rows"]
    profile = args.profile or next(r["profile"] for r in rows if "profile" in r)
    print(f"{args.data.name}: {doc['provenance'].get('device_name')}, torch "
          f"{doc['provenance'].get('torch')}, {doc['provenance'].get('date')}; profile "
          f"{profile}\nper term: measured/predicted ms")
    records = evaluate(rows, profile)
    s = summary(records)
    print(json.dumps(s, indent=1))
    if args.out:
        args.out.write_text(json.dumps({"data": args.data.name, "profile": profile,
                                        "summary": s, "cases": records}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
