"""Calibrate the multi-GPU terms on published runs, validated leave-one-source-out.

One GPU shows compute, memory and a link's bandwidth; it cannot show how much of that
bandwidth a training step achieves with several collectives in flight, how much
communication a runtime hides behind its GEMMs, or how much the slowest of many ranks
holds the others back. Those are :data:`PARAMETERS`, five physically named numbers
fitted on ``benchmarks/published_runs.json`` as priced by
``benchmarks/published_accuracy.py --terms`` (each row's step at the profile's nominal
figures, its terms, and the seconds of exposed communication on each link level).

A row's step under parameters θ (:func:`predict`)::

    step(θ) = (P + E_intra·(1/η_intra − 1) + E_inter·(1/η_inter − 1)
               − ρ·T/η_intra·[run overlaps tensor-parallel traffic]
               − H·[run overlaps gradient reduction with the last backward]
               + σ·C)
              · (1 + κ·log2(nodes))

with P the nominal step, E the exposed seconds on each link, C the parameter traffic
hidden behind compute (``param_comm_s − exposed_param_comm_s``; 0 where a pipeline's
breakdown does not give it), T the tensor-parallel
collectives and resharding (``comm_s`` less the expert all-to-all) and H the
gradient reduction a pipelined run hides behind its last micro-batch's backward
(``min(exposed_param_comm_s, ⅔ compute_s / micro-batches)``: Megatron-LM's
``--overlap-grad-reduce`` starts each bucket's reduction when its gradients are ready,
from first principles, not fitted). Which runs overlap what is read from the rows
(:func:`runtime_features`).

Validation: for each source, the parameters to fit are chosen (:func:`select`: the
subset whose own leave-one-source-out error is least) and fitted on the other sources'
rows, and the source's rows are predicted; the held-out errors are reported, never the
fitted ones. A fit minimizes the mean |log(predicted / published)| over a grid of θ in
physical ranges; parameters left out stay at their nominal values.

::

    python benchmarks/published_accuracy.py --terms --jobs 2 --json terms.json
    python benchmarks/calibrate.py terms.json [--json OUT] [--md OUT.md]
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from published_accuracy import load, profile_of  # noqa: E402  (the script beside this one)


@dataclass(frozen=True)
class Parameter:
    """One calibrated number: its name, its grid (physical range), its nominal value
    (what the profile assumes without calibration) and what it means."""

    name: str
    grid: tuple[float, ...]
    nominal: float
    meaning: str


def _steps(lo: float, hi: float, step: float) -> tuple[float, ...]:
    return tuple(round(lo + i * step, 4) for i in range(int(round((hi - lo) / step)) + 1))


PARAMETERS = (
    Parameter("intra_node_efficiency", _steps(0.4, 1.0, 0.05), 1.0,
              "share of the profile's intra-node bus bandwidth (nccl-tests, one collective "
              "alone) that a training step's collectives achieve"),
    Parameter("inter_node_efficiency", _steps(0.2, 1.0, 0.05), 1.0,
              "the same across nodes (InfiniBand / RoCE, several rings in flight)"),
    Parameter("tp_overlap", _steps(0.0, 1.0, 0.1), 0.0,
              "share of tensor-parallel collectives hidden behind GEMMs where the run "
              "overlaps them (Megatron-LM --tp-comm-overlap, torchtitan async TP)"),
    Parameter("overlap_slowdown", _steps(0.0, 1.0, 0.1), 0.0,
              "seconds of compute lost per second of communication hidden behind it "
              "(NCCL's kernels share the SMs and HBM with the GEMMs they overlap)"),
    Parameter("straggler_per_doubling", _steps(0.0, 0.1, 0.01), 0.0,
              "step slowdown per doubling of the node count (the slowest rank at each "
              "synchronization)"),
)


def runtime_features(row: dict[str, Any], source: dict[str, Any]) -> dict[str, bool]:
    """What the run's software overlaps, as its source states it: ``tp_overlap`` (the
    row's ``async_tp``, or the source's ``runtime.tp_comm_overlap``) and
    ``grad_overlap`` (the source's ``runtime.grad_reduce_overlap``: gradient
    reduction started per bucket during the last backward). Not stated: False, as
    autopar's own runtime (eager DTensor, FSDP2 reducing once after a pipeline)."""
    rt = source.get("runtime", {})
    return {"tp_overlap": bool(row["parallel"].get("async_tp") or rt.get("tp_comm_overlap")),
            "grad_overlap": bool(rt.get("grad_reduce_overlap"))}


def features(result: dict[str, Any], row: dict[str, Any],
             source: dict[str, Any]) -> dict[str, float]:
    """The numbers :func:`predict` needs for one priced row (seconds, counts)."""
    b, p = result["breakdown"], row["parallel"]
    rt = runtime_features(row, source)
    micro = p["micro_batch"] or row["scoring_assumptions"].get("micro_batch") or 1
    per_replica = p["global_batch"] / (p["dp"] * micro)
    hidden_grad = 0.0
    if rt["grad_overlap"] and p["pp"] > 1:
        hidden_grad = min(b["exposed_param_comm_s"],
                          2 / 3 * b["compute_s"] / max(1.0, per_replica))
    return {"P": result["predicted_step_s"],
            "Ea": max(0.0, result["exposed_link_s"]["intra_node"]),
            "Ee": max(0.0, result["exposed_link_s"]["inter_node"]),
            "T": (b["comm_s"] - (b.get("all_to_all_s") or 0.0)) * rt["tp_overlap"],
            "H": hidden_grad,
            "C": max(0.0, (b.get("param_comm_s") or 0.0) - b["exposed_param_comm_s"]),
            "doublings": math.log2(max(1.0, row["hardware"]["gpus"] / 8)),
            "published": result["published_step_s"]}


def predict(f: dict[str, np.ndarray], theta: np.ndarray) -> np.ndarray:
    """Predicted steps, shape ``(len(theta), rows)``, for parameter sets ``theta``
    (shape ``(k, 5)``, in :data:`PARAMETERS` order) and row features ``f``."""
    ea, ee, rho, sigma, kappa = (theta[:, i:i + 1] for i in range(5))
    base = f["P"] + f["Ea"] * (1 / ea - 1) + f["Ee"] * (1 / ee - 1) - rho * f["T"] / ea - f["H"]
    return (base + sigma * f["C"]) * (1 + kappa * f["doublings"])


def _grid(free: tuple[int, ...]) -> np.ndarray:
    """Every parameter set with the parameters ``free`` (indices into
    :data:`PARAMETERS`) over their grids and the others at their nominal values."""
    axes = [p.grid if i in free else (p.nominal,) for i, p in enumerate(PARAMETERS)]
    return np.array(list(itertools.product(*axes)))


def fit(f: dict[str, np.ndarray], grid: np.ndarray) -> np.ndarray:
    """The parameter set of ``grid`` with the least mean |log(predicted / published)|
    over the rows of ``f`` (ties: the first, nearest the grid's lower corner)."""
    err = np.abs(np.log(predict(f, grid) / f["published"])).mean(axis=1)
    return grid[int(np.argmin(err))]


def held_out(f: dict[str, np.ndarray], sources: np.ndarray,
             grid_of: Callable[[dict[str, np.ndarray], np.ndarray], np.ndarray],
             ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Every row's step predicted leave-one-source-out: for each source, the parameters
    fitted on the other sources' rows over the grid ``grid_of(their features, their
    sources)`` gives; the predictions and each source's parameters."""
    out, folds = np.empty(len(sources)), {}
    for s in sorted(set(sources)):
        rest = _subset(f, sources != s)
        folds[s] = fit(rest, grid_of(rest, sources[sources != s]))
        out[sources == s] = predict(_subset(f, sources == s), folds[s][None])[0]
    return out, folds


def select(f: dict[str, np.ndarray], sources: np.ndarray) -> tuple[int, ...]:
    """Which parameters to fit: the subset of :data:`PARAMETERS` whose own
    leave-one-source-out error over ``f`` is least (ties: fewer parameters), so a
    parameter is fitted only where it predicts sources it was not fitted on."""
    subsets = sorted((c for k in range(len(PARAMETERS) + 1)
                      for c in itertools.combinations(range(len(PARAMETERS)), k)), key=len)
    scores = [np.abs(np.log(held_out(f, sources, lambda *_: _grid(c))[0] / f["published"])).mean()
              for c in subsets]
    return subsets[int(np.argmin(np.array(scores) + 1e-12 * np.arange(len(subsets))))]


def _subset(f: dict[str, np.ndarray], mask: np.ndarray) -> dict[str, np.ndarray]:
    return {k: v[mask] for k, v in f.items()}


def calibrate(results: list[dict[str, Any]], runs: dict[str, Any]) -> dict[str, Any]:
    """The fit on every scored row, the leave-one-source-out held-out errors, and the
    nominal (uncalibrated) errors, per row and per source."""
    rows = {r["id"]: r for r in runs["rows"]}
    scored = [r for r in results if "error_rel" in r and "exposed_link_s" in r]
    feats = [features(r, rows[r["id"]], runs["sources"][r["source"]]) for r in scored]
    f = {k: np.array([x[k] for x in feats]) for k in feats[0]}
    sources = np.array([r["source"] for r in scored])
    nominal = np.array([[p.nominal for p in PARAMETERS]])
    # the selection and the fit both without the source predicted
    held, thetas = held_out(f, sources, lambda rest, src: _grid(select(rest, src)))
    folds = {s: dict(zip((p.name for p in PARAMETERS), map(float, t))) for s, t in thetas.items()}
    free = select(f, sources)
    theta_all = fit(f, _grid(free))
    nominal_pred = predict(f, nominal)[0]
    per_row = [{"id": r["id"], "source": r["source"], "profile": profile_of(rows[r["id"]]),
                "published_step_s": r["published_step_s"],
                "priced_step_s": r["predicted_step_s"], "nominal_step_s": float(n),
                "held_out_step_s": float(h), "held_out_error": float(h / r["published_step_s"] - 1),
                "nominal_error": float(n / r["published_step_s"] - 1),
                "priced_error": r["error_rel"]}
               for r, n, h in zip(scored, nominal_pred, held)]
    adopt = adopted(per_row)
    return {"parameters": {p.name: {"fitted": float(v), "nominal": p.nominal,
                                    "selected": i in free, "meaning": p.meaning}
                           for i, (p, v) in enumerate(zip(PARAMETERS, theta_all))},
            "folds": folds, "rows": per_row,
            "summary": {k: error_table(per_row, k)
                        for k in ("priced_error", "nominal_error", "held_out_error")},
            "adopted": adopt,
            "per_profile": error_table(per_row, "held_out_error" if adopt else "priced_error",
                                       by="profile")}


def adopted(rows: list[dict[str, Any]]) -> bool:
    """Whether the fitted parameters earn their place: their held-out median |error|
    over all rows below the uncalibrated (nominal) one, and their max no higher. If not, the
    profiles keep their nominal figures, and the errors they carry are the priced ones,
    every row out of sample since nothing was fitted."""
    held = [abs(r["held_out_error"]) for r in rows]
    nominal = [abs(r["nominal_error"]) for r in rows]
    return statistics.median(held) < statistics.median(nominal) and \
        max(held) <= max(nominal) + 1e-9


def error_table(rows: list[dict[str, Any]], key: str,
                by: str = "source") -> dict[str, dict[str, float]]:
    """Per value of ``by`` (source or profile) and ``all``: rows, sources, median and
    max |error| of ``key``."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(r[by], []).append(r)
        groups.setdefault("all", []).append(r)
    return {g: {"rows": len(rs), "sources": len({r["source"] for r in rs}),
                "median_abs": statistics.median(abs(r[key]) for r in rs),
                "max_abs": max(abs(r[key]) for r in rs)}
            for g, rs in groups.items()}


def markdown(out: dict[str, Any], meta: dict[str, str]) -> str:
    """The calibration as a markdown report."""
    lines = ["# Multi-GPU terms calibrated on published runs (leave one source out)", "",
             *(f"- {k}: {v}" for k, v in meta.items()), "",
             "| parameter | nominal | selected and fitted on all sources | meaning |",
             "|---|---:|---:|---|"]
    for name, p in out["parameters"].items():
        fitted = f"{p['fitted']:g}" if p["selected"] else "not selected"
        lines.append(f"| {name} | {p['nominal']:g} | {fitted} | {p['meaning']} |")
    lines += ["", "Errors: priced = autopar.estimate as is; nominal = with the runs' stated "
              "overlaps (first principles) at nominal parameters; held out = each source "
              "predicted with parameters fitted on the other sources.", "",
              "| source | rows | priced median / max | nominal median / max | "
              "held-out median / max | selected and fitted without it |", "|---|---:|---:|---:|---:|---|"]
    s = out["summary"]
    for name in s["held_out_error"]:
        cells = [f"{100 * s[k][name]['median_abs']:.0f}% / {100 * s[k][name]['max_abs']:.0f}%"
                 for k in ("priced_error", "nominal_error", "held_out_error")]
        fold = out["folds"].get(name)
        theta = ", ".join(f"{v:g}" for v in fold.values()) if fold else "-"
        lines.append(f"| {name} | {s['held_out_error'][name]['rows']} | " + " | ".join(cells)
                     + f" | {theta} |")
    verdict = ("adopted: held-out errors below the nominal ones" if out["adopted"] else
               "not adopted: fitting them does not lower the held-out errors, so the "
               "profiles keep their nominal figures and the errors below are the priced "
               "ones (nothing fitted, every row out of sample)")
    lines += ["", f"Fitted parameters {verdict}.", "",
              "By GPU profile (the figure `Plan.summary()` quotes):", "",
              "| profile | rows | sources | median | max |", "|---|---:|---:|---:|---:|"]
    for name, t in out["per_profile"].items():
        lines.append(f"| {name} | {t['rows']} | {t['sources']} | {100 * t['median_abs']:.0f}% | "
                     f"{100 * t['max_abs']:.0f}% |")
    lines += ["", "| row | published s | priced s | held-out s | held-out error |",
              "|---|---:|---:|---:|---:|"]
    for r in out["rows"]:
        lines.append(f"| {r['id']} | {r['published_step_s']:.3f} | {r['priced_step_s']:.3f} | "
                     f"{r['held_out_step_s']:.3f} | {100 * r['held_out_error']:+.0f}% |")
    return "\n".join(lines) + "\n"


def main() -> int:
    """Fit, validate and write the reports."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("terms", help="JSON written by published_accuracy.py --terms")
    ap.add_argument("--json", help="write the fit and the held-out errors here")
    ap.add_argument("--md", help="write the markdown report here")
    args = ap.parse_args()
    results = json.loads(Path(args.terms).read_text())
    out = calibrate(results["rows"], load())
    meta = {"date": datetime.date.today().isoformat(),
            "priced_at": f"commit {results['meta']['commit']}, {results['meta']['date']}",
            "command": "python " + " ".join(sys.argv)}
    text = markdown(out, meta)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, **out}, indent=1))
    if args.md:
        Path(args.md).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
