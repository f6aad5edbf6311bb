"""Inline SVG of a plan's figures (:mod:`autopar.report_figures`) for the HTML report.

:func:`mesh_svg`, :func:`timeline_svg`, :func:`memory_svg` and :func:`alternatives_svg`
each return one ``<svg>`` element that scales to the page's width; every box carries a
``<title>`` tooltip with its exact figures. Times are written by
:func:`autopar.summary.fmt_time`, bytes by :func:`autopar.units_text.fmt_bytes`.
"""

from __future__ import annotations

import math
from html import escape

from autopar.report_figures import (KINDS, MEMORY_KINDS, TERM_COLOURS, Alternative,
                                    MemoryFigure, MeshFigure, TimelineFigure, axis_groups,
                                    colour, legend_text, shade)
from autopar.summary import fmt_time, term_label
from autopar.units_text import fmt_bytes

WIDTH = 1100
"""Width of every figure in SVG units (the page scales it)."""

PALETTE = ("#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#eeca3b", "#b279a2",
           "#ff9da6", "#9d755d", "#bab0ac")
"""Colours of mesh groups, cycled."""

MAX_NODES_DRAWN = 16
"""Nodes the device grid draws; larger meshes are described by their groups alone."""


def nice_ticks(span: float, count: int = 8) -> list[float]:
    """Round tick positions from 0 to ``span`` (1, 2 or 5 times a power of ten apart)."""
    if span <= 0:
        return [0.0]
    raw = span / count
    base = 10 ** math.floor(math.log10(raw))
    step = next(m * base for m in (1, 2, 5, 10) if m * base >= raw)
    return [k * step for k in range(int(span / step + 1e-9) + 1)]


def _svg(height: float, body: list[str], label: str) -> str:
    """One ``<svg>`` of the report's width."""
    return (f'<svg class="figure" viewBox="0 0 {WIDTH} {height:.0f}" role="img" '
            f'aria-label="{escape(label)}">'
            + "".join(body) + "</svg>")


def _text(x: float, y: float, text: str, cls: str = "", anchor: str = "start") -> str:
    return (f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}"'
            + (f' class="{cls}"' if cls else "") + f">{escape(text)}</text>")


def _legend(items: list[tuple[str, str]], y: float, hatch: bool = False) -> list[str]:
    """A one-line legend of (text, colour) items; a colour "hatch" draws the bubble."""
    out, x = [], 10.0
    for text, fill in items:
        paint = "url(#hatch)" if fill == "hatch" else fill
        out.append(f'<rect x="{x:.1f}" y="{y - 10:.1f}" width="12" height="12" '
                   f'fill="{paint}" stroke="#888" stroke-width="0.5"/>')
        out.append(_text(x + 16, y, text, "legend"))
        x += 16 + 6.6 * len(text) + 18
    return out


HATCH = ('<defs><pattern id="hatch" width="6" height="6" patternUnits="userSpaceOnUse" '
         'patternTransform="rotate(45)"><rect width="6" height="6" fill="#f3f3f3"/>'
         '<line x1="0" y1="0" x2="0" y2="6" stroke="#c8c8c8" stroke-width="2"/></pattern></defs>')
"""The bubble's hatching."""


def timeline_svg(fig: TimelineFigure) -> str:
    """Each row's boxes on one time axis; in a pipeline, the idle time under them is
    hatched (the bubble) and each row ends with its busy share of the schedule."""
    left, right, row_h, gap, top = 78.0, 92.0, 26.0, 6.0, 8.0
    scale = (WIDTH - left - right) / fig.span_s if fig.span_s > 0 else 0.0
    body = [HATCH]
    y = top
    for r, (label, boxes) in enumerate(zip(fig.rows, fig.boxes)):
        body.append(_text(left - 8, y + row_h / 2 + 4, label, "row", "end"))
        if fig.busy_share:
            body.append(f'<rect x="{left:.1f}" y="{y:.1f}" '
                        f'width="{fig.schedule_end_s * scale:.2f}" '
                        f'height="{row_h:.1f}" fill="url(#hatch)"><title>bubble: rank idle '
                        f'{(1 - fig.busy_share[r]) * 100:.1f}% of the schedule</title></rect>')
            body.append(_text(WIDTH - right + 8, y + row_h / 2 + 4,
                              f"busy {fig.busy_share[r] * 100:.1f}%", "row"))
        for b in boxes:
            x, w = left + b.start_s * scale, max((b.end_s - b.start_s) * scale, 0.3)
            mb = f' data-mb="{b.microbatch}"' if b.microbatch >= 0 else ""
            body.append(f'<rect class="op"{mb} x="{x:.2f}" y="{y:.1f}" width="{w:.2f}" '
                        f'height="{row_h:.1f}" fill="{shade(colour(KINDS, b.kind), b.chunk)}">'
                        f"<title>{escape(b.title)}</title></rect>")
            if b.label and w >= 7 * len(b.label) + 3:
                body.append(_text(x + w / 2, y + row_h / 2 + 4, b.label, "boxlabel", "middle"))
        y += row_h + gap
    if fig.busy_share and fig.schedule_end_s < fig.span_s:
        x = left + fig.schedule_end_s * scale
        body.append(f'<line x1="{x:.1f}" y1="{top - 4:.1f}" x2="{x:.1f}" y2="{y:.1f}" '
                    f'stroke="#333" stroke-dasharray="3 3"/>')
    body.append(f'<line x1="{left}" y1="{y:.1f}" x2="{WIDTH - right}" y2="{y:.1f}" stroke="#555"/>')
    for t in nice_ticks(fig.span_s):
        x = left + t * scale
        body.append(f'<line x1="{x:.1f}" y1="{y:.1f}" x2="{x:.1f}" y2="{y + 4:.1f}" '
                    'stroke="#555"/>')
        body.append(_text(x, y + 16, fmt_time(t) if t else "0", "tick", "middle"))
    kinds = []
    for boxes in fig.boxes:
        kinds += [b.kind for b in boxes if b.kind not in kinds]
    items = [(legend_text(KINDS, k), colour(KINDS, k)) for k, _, _ in KINDS if k in kinds]
    if fig.busy_share:
        items.append((legend_text(KINDS, "bubble"), "hatch"))
    body += _legend(items, y + 40)
    return _svg(y + 50, body, "timeline of one step")


def memory_svg(fig: MemoryFigure) -> str:
    """One horizontal stacked bar per row, against the budget's dashed line."""
    left, right, row_h, gap, top = 78.0, 250.0, 24.0, 8.0, 22.0
    scale = (WIDTH - left - right) / fig.scale_bytes
    body = [HATCH]
    y = top
    for bar in fig.bars:
        body.append(_text(left - 8, y + row_h / 2 + 4, bar.label, "row", "end"))
        x = left
        for key, n in bar.parts or [("total", bar.total_bytes)]:
            w = n * scale
            body.append(f'<rect x="{x:.2f}" y="{y:.1f}" width="{max(w, 0.5):.2f}" height="{row_h}" '
                        f'fill="{colour(MEMORY_KINDS, key)}"><title>{escape(bar.label)}: '
                        f'{escape(legend_text(MEMORY_KINDS, key))} {fmt_bytes(n)}</title></rect>')
            x += w
        share = f" ({bar.total_bytes / fig.budget_bytes * 100:.1f}% of the budget)" \
            if fig.budget_bytes else ""
        body.append(_text(x + 6, y + row_h / 2 + 4, fmt_bytes(bar.total_bytes) + share, "row"))
        y += row_h + gap
    if fig.budget_bytes and fig.budget_bytes <= fig.scale_bytes:
        x = left + fig.budget_bytes * scale
        body.append(f'<line x1="{x:.1f}" y1="{top - 14:.1f}" x2="{x:.1f}" y2="{y:.1f}" '
                    f'stroke="#c0392b" stroke-width="1.5" stroke-dasharray="5 3"/>')
        body.append(_text(x, top - 10, f"budget {fmt_bytes(fig.budget_bytes)}", "budget", "end"))
    elif fig.budget_bytes:
        body.append(_text(WIDTH - right, top - 10, f"budget {fmt_bytes(fig.budget_bytes)} "
                          f"(beyond the axis) →", "budget", "end"))
    body.append(f'<line x1="{left}" y1="{y:.1f}" x2="{WIDTH - right}" y2="{y:.1f}" stroke="#555"/>')
    keys: list[str] = []
    for bar in fig.bars:
        keys += [k for k, _ in bar.parts if k not in keys]
    items = [(legend_text(MEMORY_KINDS, k), colour(MEMORY_KINDS, k)) for k in keys]
    body += _legend(items or [("peak (no breakdown recorded)", "#999999")], y + 24)
    return _svg(y + 34, body, "memory per rank")


def alternatives_svg(alts: list[Alternative]) -> str:
    """The plan and each runner-up as stacked bars of their step-time terms."""
    left, right, row_h, gap, top = 78.0, 150.0, 22.0, 8.0, 8.0
    most = max(a.step_time_s for a in alts) or 1.0
    scale = (WIDTH - left - right) / most
    body = [HATCH]
    y = top
    base = alts[0].step_time_s
    for a in alts:
        body.append(_text(left - 8, y + row_h / 2 + 4, a.label, "row", "end"))
        x = left
        for key, s in a.terms:
            if s <= 0:
                continue
            body.append(f'<rect x="{x:.2f}" y="{y:.1f}" width="{s * scale:.2f}" height="{row_h}" '
                        f'fill="{colour(TERM_COLOURS, key)}"><title>{escape(a.label)}: '
                        f'{escape(term_label(key))} {fmt_time(s)}</title></rect>')
            x += s * scale
        more = f" (+{(a.step_time_s / base - 1) * 100:.1f}%)" if a.label != "plan" and base else ""
        body.append(_text(left + a.step_time_s * scale + 6, y + row_h / 2 + 4,
                          fmt_time(a.step_time_s) + more, "row"))
        y += row_h + gap
    used = [k for k, _ in TERM_COLOURS if any(dict(a.terms).get(k, 0.0) > 0 for a in alts)]
    body += _legend([(term_label(k), colour(TERM_COLOURS, k)) for k in used], y + 18)
    return _svg(y + 28, body, "step time of the plan and its runners-up")


def coordinates(mesh: dict[str, int], rank: int) -> dict[str, int]:
    """``rank``'s coordinate on every axis (row-major, the last axis fastest)."""
    out: dict[str, int] = {}
    for a in reversed(list(mesh)):
        out[a] = rank % mesh[a]
        rank //= mesh[a]
    return dict(reversed(list(out.items())))


def mesh_svg(fig: MeshFigure, mesh: dict[str, int]) -> str:
    """The devices node by node, each labelled with its rank and coloured by its group on
    the first axis of size > 1 (the page's buttons recolour by another axis); each
    device's tooltip gives its coordinate on every axis."""
    nodes = min(fig.nodes, MAX_NODES_DRAWN)
    per = fig.gpus_per_node
    cell, pad, label_w = min(120.0, (WIDTH - 110) / max(per, 1)), 4.0, 90.0
    high = min(44.0, cell * 0.62)
    shown = [a for a in mesh if mesh[a] > 1]
    group_of = {a: {r: k for k, g in enumerate(axis_groups(mesh, a)) for r in g} for a in mesh}
    first = next((a.name for a in fig.axes if a.size > 1), fig.axes[0].name)
    body = []
    for n in range(nodes):
        y = 6 + n * (high + 10)
        body.append(_text(label_w - 10, y + high / 2 + 4, f"node {n}", "row", "end"))
        for d in range(per):
            r = n * per + d
            if r >= fig.world:
                break
            coords = coordinates(mesh, r)
            attrs = " ".join(f'data-g-{a}="{group_of[a][r]}"' for a in mesh)
            fill = PALETTE[group_of[first][r] % len(PALETTE)]
            x = label_w + d * cell
            where = " ".join(f"{a}{coords[a]}" for a in shown)
            small = cell >= 7 * len(where) and high >= 34
            body.append(f'<g class="dev" data-rank="{r}" {attrs}><rect x="{x + pad / 2:.1f}" '
                        f'y="{y:.1f}" width="{cell - pad:.1f}" height="{high:.1f}" rx="4" '
                        f'fill="{fill}"/><title>rank {r}: '
                        f'{", ".join(f"{a} {c}" for a, c in coords.items())}; node {n}, '
                        f'device {d}</title>'
                        + _text(x + cell / 2, y + (high / 2 - 2 if small else high / 2 + 4),
                                str(r), "devlabel", "middle")
                        + (_text(x + cell / 2, y + high / 2 + 12, where, "devcoord", "middle")
                           if small else "") + "</g>")
    height = 6 + nodes * (high + 10) + 4
    if fig.nodes > nodes:
        body.append(_text(label_w, height + 10, f"… nodes {nodes}–{fig.nodes - 1} not drawn",
                          "row"))
        height += 18
    return _svg(height, body, "device mesh")
