"""The α-β fit of measured collective times, for every caller.

:func:`fit_alpha_beta` fits ``t = α + B/β`` per collective kind and process count by
least squares on the seconds (β the algorithm bandwidth, B as in :mod:`.collectives`);
:func:`ring_link` reads it per link as the ring model of
:mod:`autopar.cost_models.comm` does (bus bandwidth ``β · traffic/B``, latency per step
``α / steps``, from :func:`~autopar.cost_models.comm.ring_shape`). ``autopar profile``
stores its fits with :func:`fit_table`, the ``cpu`` profile per link (:mod:`.cpu`).
The formula: docs/profiling.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autopar.cost_models.comm import ring_shape
from autopar.cost_models.hardware import LinkSpec
from autopar.cost_models.profiling.timing import sig


@dataclass(frozen=True)
class AlphaBeta:
    """``t = alpha + bytes / beta`` (seconds, bytes/s), with the fit's largest
    relative residual over the points of positive time."""

    alpha: float
    beta: float
    max_rel_error: float


def fit_alpha_beta(sizes: list[float], times: list[float]) -> AlphaBeta:
    """Least squares of ``t = α + B/β`` on the measured ``times`` (seconds) of messages
    of ``sizes`` bytes (module docstring); 1/β is kept at 1e-30 s/byte or more."""
    import numpy as np

    b = np.asarray(sizes, dtype=float)
    t = np.asarray(times, dtype=float)
    if len(b) < 2:
        raise ValueError("an α-β fit needs at least two message sizes")
    x = np.stack([np.ones_like(b), b], axis=1)  # α + B·γ ≈ t, γ = 1/β
    (alpha, gamma), *_ = np.linalg.lstsq(x, t, rcond=None)
    alpha, gamma = max(float(alpha), 0.0), max(float(gamma), 1e-30)
    timed = t > 0  # a time with another's subtracted can be 0 (the ``cpu`` profile's)
    rel = np.abs(alpha + b[timed] * gamma - t[timed]) / t[timed]
    return AlphaBeta(alpha=alpha, beta=1.0 / gamma,
                     max_rel_error=float(rel.max()) if rel.size else 0.0)


def ring_link(fit: AlphaBeta, kind: str, n: int) -> LinkSpec:
    """``fit`` of collective ``kind`` on ``n`` processes as the ring model's link: bus
    bandwidth (bytes/s) and latency per step (seconds)."""
    steps, factor = ring_shape(kind, 1.0, n)
    return LinkSpec(bandwidth=fit.beta * factor, latency=fit.alpha / steps)


FIT_FORMULA = ("t = alpha_s + bytes / beta_bytes_per_s (least squares on the seconds); "
               "ring link bandwidth = beta · ring_factor (bus bandwidth), per-step "
               "latency = alpha / latency_steps")
"""How to read a fit of :func:`fit_table` (stored beside the fits in the profile)."""


def fit_table(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """α-β fits of measured collective rows (:mod:`.collectives`), keyed
    ``"<op>/<world>"``."""
    fits: dict[str, Any] = {}
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in rows:
        if "seconds" in r:
            groups.setdefault((r["op"], r["world"]), []).append(r)
    for (op, n), pts in sorted(groups.items()):
        if len(pts) < 2:
            continue
        ab = fit_alpha_beta([p["bytes"] for p in pts], [p["seconds"] for p in pts])
        steps, factor = ring_shape(op, 1.0, n)
        link = ring_link(ab, op, n)
        fits[f"{op}/{n}"] = {
            "op": op, "world": n, "alpha_s": sig(ab.alpha), "beta_bytes_per_s": sig(ab.beta),
            "max_rel_error": sig(ab.max_rel_error, 2), "ring_factor": sig(factor),
            "latency_steps": steps, "bus_bandwidth_bytes_per_s": sig(link.bandwidth),
            "alpha_per_step_s": sig(link.latency),
        }
    return fits
