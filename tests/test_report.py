"""The plan report (``autopar plan --report/--plots``): one self-contained page whose
numbers are the plan JSON's own, figures that rerun the solver's schedule simulation,
PNG files, and the page rendered in a real headless Chromium without a console error."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import autopar
from autopar.errors import ConfigError
from autopar.examples.gpt import GPT, GPTConfig
from autopar.plans import Plan
from autopar.report import check_outputs, render_report, write_outputs
from autopar.report_figures import (axis_groups, memory_figure, mesh_figure, ranks_text,
                                    timeline_figure)
from autopar.summary import fmt_time
from autopar.units_text import fmt_bytes

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def _plan_json(**space) -> str:
    """A plan of an 8-block GPT on a meta device for 2 nodes of 8 H100, with three
    runners-up, written as JSON (the report reads what ``--json`` writes)."""
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=8192, max_seq_len=1024, dim=1024, n_layers=8,
                              n_heads=16))
    inputs = torch.zeros(2, 1024, dtype=torch.long, device="meta")
    cluster = autopar.Cluster(gpu="h100-sxm", nodes=2, gpus_per_node=8)
    return autopar.plan(model, (inputs,), cluster=cluster, global_batch=64, top_k=4,
                        **space).to_json()


@pytest.fixture(scope="module")
def pipelined() -> str:
    return _plan_json(pp=4, tp=2, schedule="interleaved_1f1b", virtual_stages=2,
                      recompute="selective")


@pytest.fixture(scope="module")
def flat() -> str:
    return _plan_json(pp=1, tp=2)


def _expected_texts(plan: Plan) -> list[str]:
    """What the page must show, formatted from the plan as the summary formats it."""
    out = [fmt_time(plan.step_time_s), f"{plan.throughput:.2f} samples/s",
           f"{plan.mfu * 100:.1f}%", fmt_bytes(plan.memory_per_device_bytes),
           " x ".join(f"{k}={v}" for k, v in plan.mesh.items()),
           fmt_bytes(plan.solver["memory_budget_bytes"])]
    out += [fmt_bytes(v) for v in plan.memory.values()]
    out += [fmt_time(plan.breakdown[k]) for k in ("compute_s", "exposed_comm_s")]
    for axis, size in plan.mesh.items():
        if size > 1:
            out.append("{" + ranks_text(axis_groups(plan.mesh, axis)[0]) + "}")
    for r in plan.runners_up:
        out += [fmt_time(r["step_time_s"]), fmt_bytes(r["memory_bytes"]), r["why"]]
    if plan.pipeline:
        out.append(f"{plan.pipeline.bubble_fraction * 100:.1f}%")
        for st in plan.pipeline.stages:
            out += [fmt_time(st.forward_s), fmt_time(st.backward_s), fmt_bytes(st.memory_bytes)]
    return out


def test_page_is_one_file_without_outside_references(pipelined: str, tmp_path: Path):
    plan = Plan.from_json(pipelined)
    assert write_outputs(plan, str(tmp_path / "plan.html"), None) == [str(tmp_path / "plan.html")]
    assert [p.name for p in tmp_path.iterdir()] == ["plan.html"]
    page = (tmp_path / "plan.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and page.count("<svg") >= 4
    for outside in ("http:", "https:", "//cdn", "<link", "src=", "@import"):
        assert outside not in page, outside
    assert set(re.findall(r"url\(([^)]*)\)", page)) == {"#hatch"}


@pytest.mark.parametrize("which", ["pipelined", "flat"])
def test_page_shows_the_plan_json_numbers(which: str, request: pytest.FixtureRequest):
    plan = Plan.from_json(request.getfixturevalue(which))
    page = render_report(plan)
    missing = [t for t in _expected_texts(plan) if t not in page]
    assert missing == []


def test_timeline_reruns_the_solvers_simulation(pipelined: str):
    plan = Plan.from_json(pipelined)
    fig = timeline_figure(plan)
    pp = plan.degree("pp")
    # the ranks' mean idle share is the bubble the solver predicted
    assert sum(1 - s for s in fig.busy_share) / pp == pytest.approx(
        plan.pipeline.bubble_fraction, rel=1e-9)
    # the busiest rank's computation boxes add up to the breakdown's compute term
    busiest = max(range(pp), key=lambda r: fig.busy_share[r])
    compute = sum(b.end_s - b.start_s for b in fig.boxes[busiest]
                  if b.kind in ("forward", "backward", "input_grad", "weight_grad"))
    recompute = sum(b.end_s - b.start_s for b in fig.boxes[busiest] if b.kind == "recompute")
    assert compute == pytest.approx(plan.breakdown["compute_s"], rel=1e-9)
    assert recompute == pytest.approx(plan.breakdown["recompute_s"], rel=1e-9)
    assert recompute > 0
    # every rank runs F and B of each micro-batch on each of its chunks; the tail ends the step
    m, v = plan.num_microbatches, plan.pipeline.virtual_stages
    for boxes in fig.boxes:
        assert sum(b.kind == "forward" for b in boxes) == m * v
    assert fig.span_s == pytest.approx(plan.step_time_s, rel=1e-9)


def test_memory_bars_match_the_plan(pipelined: str, flat: str):
    plan = Plan.from_json(pipelined)
    fig = memory_figure(plan)
    fullest = max(fig.bars, key=lambda b: b.total_bytes)
    assert fullest.total_bytes == plan.memory_per_device_bytes
    parts = dict(fullest.parts)
    for key in ("static", "activations", "backward_transient"):
        assert parts.get(key, 0.0) == pytest.approx(plan.memory[key], rel=1e-9, abs=1.0)
    assert fig.budget_bytes == plan.solver["memory_budget_bytes"]
    plain = Plan.from_json(flat)
    (bar,) = memory_figure(plain).bars
    assert dict(bar.parts) == {k: v for k, v in plain.memory.items() if k != "total" and v}


def test_flat_step_adds_up(flat: str):
    plan = Plan.from_json(flat)
    (boxes,) = timeline_figure(plan).boxes
    assert sum(b.end_s - b.start_s for b in boxes) == pytest.approx(plan.step_time_s, rel=1e-9)


def test_mesh_groups_are_the_runtimes():
    mesh = {"pp": 2, "dp": 2, "tp": 2}  # rank = 4 pp + 2 dp + tp
    assert axis_groups(mesh, "tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert axis_groups(mesh, "dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert axis_groups(mesh, "pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    plan = Plan(model="m", graph_hash="h", cluster={"gpu": "cpu", "nodes": 2,
                                                    "gpus_per_node": 4},
                mesh={"dp": 4, "tp": 2}, global_batch=4, microbatch_size=1)
    fig = mesh_figure(plan)
    assert [(a.name, a.stride, a.groups, a.within_node, a.shown[0]) for a in fig.axes] == [
        ("dp", 2, 2, False, "{0, 2, 4, 6}"), ("tp", 1, 4, True, "{0, 1}")]


def _tiny_plan() -> str:
    """A plan written by hand, with no predicted costs (as tests and old plans have)."""
    return Plan(model="m", graph_hash="h", cluster={"gpu": "cpu", "nodes": 1,
                                                      "gpus_per_node": 8},
                mesh={"dp": 1}, global_batch=1, microbatch_size=1).to_json()


def test_a_plan_without_predictions_still_renders():
    page = render_report(Plan.from_json(_tiny_plan()))
    assert "None recorded" in page and "<svg" in page


def test_pngs(pipelined: str, tmp_path: Path):
    pytest.importorskip("matplotlib", reason="--plots needs matplotlib (autopar[plots])")
    paths = write_outputs(Plan.from_json(pipelined), None, str(tmp_path / "plots"))
    assert [Path(p).name for p in paths] == ["mesh.png", "timeline.png", "memory.png",
                                             "alternatives.png"]
    for p in paths:
        data = Path(p).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, p


def test_bad_outputs_are_refused_before_planning(tmp_path: Path, monkeypatch):
    with pytest.raises(ConfigError, match="its folder .* does not exist"):
        check_outputs(str(tmp_path / "no" / "plan.html"), None)
    (tmp_path / "file").write_text("")
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)
    with pytest.raises(ConfigError,
                       match=r'--plots needs matplotlib.*pip install "autopar\[plots\]"'):
        check_outputs(None, str(tmp_path / "file"))


def _browser() -> str | None:
    """A Chromium on PATH, or None."""
    return next((shutil.which(b) for b in BROWSERS if shutil.which(b)), None)


def _render_with_playwright(page_path: Path, browser: str, shot: Path) -> tuple[str, list[str]]:
    """(the rendered body's text, console errors and page errors), after exercising the
    page's script (an axis button, a hover on a timeline box)."""
    from playwright.sync_api import sync_playwright

    errors: list[str] = []
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=browser)
        try:
            page = b.new_page(viewport={"width": 1280, "height": 900})
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(page_path.as_uri())
            page.wait_for_load_state("load")
            fills = "g => [0, 1].map(r => g[r].querySelector('rect').getAttribute('fill'))"
            before = page.eval_on_selector_all("g.dev", fills)
            page.click("button.axisbtn[data-axis=tp]")
            after = page.eval_on_selector_all("g.dev", fills)
            # ranks 0 and 1 are in one tp group, not in one pp group
            assert before[0] != before[1] and after[0] == after[1], (before, after)
            page.hover("rect.op[data-mb='1']")
            assert page.locator("rect.op.hl").count() > 1
            sizes = page.eval_on_selector_all(
                "svg.figure", "s => s.map(x => x.getBoundingClientRect().height)")
            assert len(sizes) >= 4 and min(sizes) > 20, sizes
            page.screenshot(path=str(shot), full_page=True)
            return page.inner_text("body"), errors
        finally:
            b.close()


def _render_with_command_line(page_path: Path, browser: str) -> tuple[str, list[str]]:
    """(the DOM Chromium's ``--dump-dom`` gives, console lines from its log)."""
    run = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu",
                          "--enable-logging=stderr", "--v=0", "--dump-dom", page_path.as_uri()],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    text = re.sub(r"<[^>]+>", " ", run.stdout).replace("&amp;", "&")
    return text, [line for line in run.stderr.splitlines() if ":CONSOLE" in line]


def test_page_in_headless_chromium(pipelined: str, tmp_path: Path):
    browser = _browser()
    if browser is None:
        pytest.skip("no Chromium found on PATH (" + ", ".join(BROWSERS) + "); install it "
                    "with `apt-get install chromium` (.ci/run does)")
    plan = Plan.from_json(pipelined)
    path = tmp_path / "plan.html"
    write_outputs(plan, str(path), None)
    if importlib.util.find_spec("playwright") is None:
        text, errors = _render_with_command_line(path, browser)
    else:
        text, errors = _render_with_playwright(path, browser, tmp_path / "plan.png")
        assert (tmp_path / "plan.png").stat().st_size > 50_000
    assert errors == []
    flat_text = " ".join(text.split())
    missing = [t for t in _expected_texts(plan) if " ".join(t.split()) not in flat_text]
    assert missing == []
