"""The report's figures as PNG files with matplotlib: ``autopar plan ... --plots DIR``.

:func:`write_plots` draws the figures of :mod:`autopar.report_figures` (mesh.png,
timeline.png, memory.png, alternatives.png) with matplotlib's object API and the Agg
canvas (no pyplot, no global state); :func:`require_matplotlib` says how to install it
when it is missing (``pip install "autopar[plots]"``).
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

from autopar.errors import ConfigError
from autopar.plans import Plan
from autopar.report_figures import (KINDS, MEMORY_KINDS, TERM_COLOURS, alternatives,
                                    axis_groups, colour, legend_text, memory_figure,
                                    mesh_figure, shade, timeline_figure)
from autopar.report_svg import MAX_NODES_DRAWN, PALETTE, coordinates
from autopar.summary import fmt_time, term_label
from autopar.units_text import fmt_bytes

DPI = 110
"""Resolution of the PNG files."""


def require_matplotlib() -> None:
    """ConfigError naming the install command when matplotlib cannot be imported."""
    if importlib.util.find_spec("matplotlib") is None:
        raise ConfigError("--plots needs matplotlib, which is not installed: "
                          "pip install \"autopar[plots]\" (or pip install matplotlib), or "
                          "leave out --plots; --report writes the same figures as HTML "
                          "without it")


def _figure(width: float, height: float) -> Any:
    """A matplotlib Figure on an Agg canvas."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _legend(ax: Any, items: list[tuple[str, str]]) -> None:
    """A legend of (text, colour) patches under the axes; the colour "hatch" draws the
    bubble's hatching."""
    from matplotlib.patches import Patch

    handles = [Patch(facecolor="#f3f3f3", edgecolor="#bbb", hatch="///", label=t)
               if c == "hatch" else Patch(facecolor=c, edgecolor="#888", label=t)
               for t, c in items]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.18),
              ncol=min(len(handles), 5), frameon=False, fontsize=8)


def _time_axis(ax: Any, span: float) -> None:
    """Tick labels in the report's time units."""
    from autopar.report_svg import nice_ticks

    ticks = nice_ticks(span)
    ax.set_xticks(ticks)
    ax.set_xticklabels([fmt_time(t) if t else "0" for t in ticks], fontsize=8)
    ax.set_xlim(0, span * 1.01 if span else 1)


def draw_timeline(plan: Plan, path: str) -> None:
    """The per-rank timeline of one step (:func:`timeline_figure`)."""
    tf = timeline_figure(plan)
    fig = _figure(12, 1.6 + 0.42 * len(tf.rows))
    ax = fig.add_subplot()
    for r, boxes in enumerate(tf.boxes):
        if tf.busy_share:
            ax.barh(r, tf.schedule_end_s, left=0, height=0.8, color="#f3f3f3",
                    edgecolor="#c8c8c8", hatch="///", linewidth=0)
        for b in boxes:
            ax.barh(r, b.end_s - b.start_s, left=b.start_s, height=0.8,
                    color=shade(colour(KINDS, b.kind), b.chunk), linewidth=0)
            if b.label and (b.end_s - b.start_s) > 0.008 * len(b.label) * tf.span_s:
                ax.text((b.start_s + b.end_s) / 2, r, b.label, ha="center", va="center",
                        fontsize=7, color="white")
    ax.set_yticks(range(len(tf.rows)))
    labels = [f"{row}  (busy {s * 100:.1f}%)" for row, s in zip(tf.rows, tf.busy_share)] \
        if tf.busy_share else tf.rows
    ax.set_yticklabels(labels, fontsize=8)
    ax.invert_yaxis()
    _time_axis(ax, tf.span_s)
    kinds: list[str] = []
    for boxes in tf.boxes:
        kinds += [b.kind for b in boxes if b.kind not in kinds]
    items = [(legend_text(KINDS, k), colour(KINDS, k)) for k, _, _ in KINDS if k in kinds]
    if tf.busy_share:
        items.append((legend_text(KINDS, "bubble"), "hatch"))
    _legend(ax, items)
    ax.set_title(f"{plan.model}: one step, predicted {fmt_time(plan.step_time_s)}", fontsize=10)
    fig.savefig(path)


def draw_memory(plan: Plan, path: str) -> None:
    """Peak memory per rank by category against the budget (:func:`memory_figure`)."""
    mf = memory_figure(plan)
    fig = _figure(12, 1.6 + 0.42 * len(mf.bars))
    ax = fig.add_subplot()
    keys: list[str] = []
    for r, bar in enumerate(mf.bars):
        left = 0.0
        for key, n in bar.parts or [("total", bar.total_bytes)]:
            ax.barh(r, n, left=left, height=0.7, color=colour(MEMORY_KINDS, key))
            keys += [key] if key not in keys else []
            left += n
        ax.text(left, r, "  " + fmt_bytes(bar.total_bytes), va="center", fontsize=8)
    if mf.budget_bytes and mf.budget_bytes <= mf.scale_bytes:
        ax.axvline(mf.budget_bytes, color="#c0392b", linestyle="--", linewidth=1.2)
        ax.text(mf.budget_bytes, -0.6, f"budget {fmt_bytes(mf.budget_bytes)} ", ha="right",
                va="bottom", fontsize=8, color="#c0392b")
    elif mf.budget_bytes:
        ax.text(mf.scale_bytes, -0.6, f"budget {fmt_bytes(mf.budget_bytes)} (beyond the axis) →",
                ha="right", va="bottom", fontsize=8, color="#c0392b")
    ax.set_xlim(0, mf.scale_bytes)
    ax.set_yticks(range(len(mf.bars)))
    ax.set_yticklabels([b.label for b in mf.bars], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("bytes per device", fontsize=8)
    ax.xaxis.set_major_formatter(lambda x, _: fmt_bytes(x) if x else "0")
    _legend(ax, [(legend_text(MEMORY_KINDS, k), colour(MEMORY_KINDS, k)) for k in keys])
    ax.set_title(f"{plan.model}: peak memory per device", fontsize=10)
    fig.savefig(path)


def draw_alternatives(plan: Plan, path: str) -> None:
    """The plan and its runners-up as stacked bars of their step-time terms."""
    alts = alternatives(plan)
    fig = _figure(12, 1.6 + 0.42 * len(alts))
    ax = fig.add_subplot()
    used: list[str] = []
    for r, a in enumerate(alts):
        left = 0.0
        for key, s in a.terms:
            if s > 0:
                ax.barh(r, s, left=left, height=0.7, color=colour(TERM_COLOURS, key))
                used += [key] if key not in used else []
                left += s
        ax.text(left, r, "  " + fmt_time(a.step_time_s), va="center", fontsize=8)
    ax.set_yticks(range(len(alts)))
    ax.set_yticklabels([f"{a.label}: {a.config}" for a in alts], fontsize=7)
    ax.invert_yaxis()
    _time_axis(ax, max(a.step_time_s for a in alts) * 1.12)
    _legend(ax, [(term_label(k), colour(TERM_COLOURS, k)) for k, _ in TERM_COLOURS if k in used])
    ax.set_title(f"{plan.model}: step time of the plan and its runners-up", fontsize=10)
    fig.savefig(path)


def draw_mesh(plan: Plan, path: str) -> None:
    """The devices node by node, coloured by their group on the first axis of size > 1."""
    mf = mesh_figure(plan)
    first = next((a.name for a in mf.axes if a.size > 1), mf.axes[0].name)
    group_of = {r: k for k, g in enumerate(axis_groups(plan.mesh, first)) for r in g}
    nodes = min(mf.nodes, MAX_NODES_DRAWN)
    fig = _figure(min(12, 1.5 + 0.9 * mf.gpus_per_node), 1.0 + 0.45 * nodes)
    ax = fig.add_subplot()
    for r in range(min(mf.world, nodes * mf.gpus_per_node)):
        n, d = divmod(r, mf.gpus_per_node)
        ax.add_patch(_box(d, n, PALETTE[group_of[r] % len(PALETTE)]))
        ax.text(d + 0.5, n + 0.3, str(r), ha="center", va="center", color="white",
                fontsize=8, fontweight="bold")
        where = coordinates(plan.mesh, r)
        ax.text(d + 0.5, n + 0.55, " ".join(f"{a}{c}" for a, c in where.items()
                                            if plan.mesh[a] > 1),
                ha="center", va="center", color="white", fontsize=7)
    ax.set_xlim(-0.1, mf.gpus_per_node + 0.1)
    ax.set_ylim(nodes, -0.1)
    ax.set_yticks([n + 0.4 for n in range(nodes)])
    ax.set_yticklabels([f"node {n}" for n in range(nodes)], fontsize=8)
    ax.set_xticks([])
    for side in ("top", "right", "bottom", "left"):
        ax.spines[side].set_visible(False)
    mesh = " x ".join(f"{k}={v}" for k, v in plan.mesh.items())
    ax.set_title(f"mesh {mesh}: devices coloured by their {first} group", fontsize=10)
    fig.savefig(path)


def _box(x: float, y: float, fill: str) -> Any:
    """One device's rounded box."""
    from matplotlib.patches import FancyBboxPatch

    return FancyBboxPatch((x + 0.06, y + 0.06), 0.88, 0.68,
                          boxstyle="round,pad=0,rounding_size=0.08", facecolor=fill,
                          edgecolor="none")


def write_plots(plan: Plan, folder: str) -> list[str]:
    """Write mesh.png, timeline.png, memory.png and alternatives.png into ``folder``
    (created if missing); the paths written."""
    require_matplotlib()
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot create the plots folder {folder!r}: {e.strerror}") from None
    out = []
    for name, draw in (("mesh", draw_mesh), ("timeline", draw_timeline),
                       ("memory", draw_memory), ("alternatives", draw_alternatives)):
        path = os.path.join(folder, f"{name}.png")
        draw(plan, path)
        out.append(path)
    return out
