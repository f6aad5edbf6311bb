"""benchmarks/calibrate.py: the fit recovers parameters that generated the published
figures, a source's held-out predictions never use that source's rows, and a parameter
that explains nothing is not selected."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "calibrate.py"


@pytest.fixture(scope="module")
def cal():
    sys.path.insert(0, str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("calibrate", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["calibrate"] = module
    spec.loader.exec_module(module)
    # a coarse grid holding the values the tests use and one other per parameter: the
    # selection and the leave-one-source-out loops as shipped, in seconds
    values = {"intra_node_efficiency": (0.7, 0.85), "inter_node_efficiency": (0.45, 0.6),
              "tp_overlap": (0.3, 0.6), "overlap_slowdown": (0.3, 0.5),
              "straggler_per_doubling": (0.02, 0.05)}
    module.PARAMETERS = tuple(replace(p, grid=tuple(sorted({p.nominal, *values[p.name]})))
                              for p in module.PARAMETERS)
    return module


def _runs(n: int, sources: int) -> dict:
    """``n`` rows spread over ``sources`` sources, overlapping
    tensor-parallel traffic on every other row; H100 rows of 8 to 1,024 GPUs."""
    rows = [{"id": f"r{i}", "source": f"s{i % sources}",
             "hardware": {"gpu": "H100", "gpus": 8 * 2 ** (i % 8), "power_limit_w": None},
             "parallel": {"dp": 8, "pp": 1, "micro_batch": 1, "global_batch": 64,
                          "async_tp": i % 2 == 0},
             "scoring_assumptions": {}} for i in range(n)]
    return {"rows": rows, "sources": {f"s{k}": {} for k in range(sources)}}


def _results(runs: dict, rng: np.random.Generator) -> list[dict]:
    """Priced rows with random terms (published figures set by :func:`_publish`)."""
    out = []
    for r in runs["rows"]:
        p, ea, ee, comm = rng.uniform(1, 10), rng.uniform(0, 2), rng.uniform(0, 2), rng.uniform(0, 1)
        res = {"id": r["id"], "source": r["source"], "predicted_step_s": p, "error_rel": 0.0,
               "exposed_link_s": {"intra_node": ea, "inter_node": ee},
               "breakdown": {"comm_s": comm, "exposed_param_comm_s": 0.0, "compute_s": p / 2,
                             "param_comm_s": rng.uniform(0, 2)},
               "published_step_s": p}
        out.append(res)
    return out


def _publish(cal, results: list[dict], runs: dict, theta: tuple[float, ...],
             poison: str | None) -> None:
    """Set each row's published step to what ``theta`` predicts; the rows of source
    ``poison`` 3x slower than that."""
    rows = {r["id"]: r for r in runs["rows"]}
    for res in results:
        f = cal.features(res, rows[res["id"]], runs["sources"][res["source"]])
        step = cal.predict({k: np.array([v]) for k, v in f.items()}, np.array([theta]))[0, 0]
        res["published_step_s"] = step * (3.0 if res["source"] == poison else 1.0)
        res["error_rel"] = res["predicted_step_s"] / res["published_step_s"] - 1


def test_fit_recovers_the_parameters_that_made_the_figures(cal) -> None:
    runs, theta = _runs(40, 5), (0.7, 0.45, 0.6, 0.3, 0.02)
    results = _results(runs, np.random.default_rng(0))
    _publish(cal, results, runs, theta, None)
    out = cal.calibrate(results, runs)
    fitted = tuple(p["fitted"] for p in out["parameters"].values())
    assert fitted == pytest.approx(theta)
    assert all(p["selected"] for p in out["parameters"].values()) and out["adopted"]
    assert out["summary"]["held_out_error"]["all"]["max_abs"] < 1e-9
    assert out["summary"]["nominal_error"]["all"]["median_abs"] > 0.05


def test_held_out_source_is_never_fitted_on(cal) -> None:
    runs, theta = _runs(40, 5), (0.7, 0.45, 0.6, 0.3, 0.02)
    results = _results(runs, np.random.default_rng(1))
    _publish(cal, results, runs, theta, poison="s3")
    out = cal.calibrate(results, runs)
    assert tuple(out["folds"]["s3"].values()) == pytest.approx(theta)
    held = {r["id"]: r["held_out_error"] for r in out["rows"]}
    assert all(held[r["id"]] == pytest.approx(-2 / 3) for r in results if r["source"] == "s3")
    assert out["summary"]["held_out_error"]["s3"]["median_abs"] == pytest.approx(2 / 3)


def test_a_parameter_that_explains_nothing_is_not_selected(cal) -> None:
    """Figures made with the nominal straggler term: the straggler is left out, the
    others are fitted."""
    runs, theta = _runs(40, 5), (0.7, 0.45, 0.6, 0.3, 0.0)
    results = _results(runs, np.random.default_rng(2))
    _publish(cal, results, runs, theta, None)
    out = cal.calibrate(results, runs)
    selected = {k for k, p in out["parameters"].items() if p["selected"]}
    assert selected == {"intra_node_efficiency", "inter_node_efficiency", "tp_overlap",
                        "overlap_slowdown"}
