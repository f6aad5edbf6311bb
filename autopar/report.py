"""A plan as one self-contained HTML page: ``autopar plan ... --report plan.html``.

:func:`render_report` returns the page (inline CSS, SVG and a few lines of script; no
network): the prediction, the device mesh and its groups, the per-rank timeline of one
step, memory per rank against the budget, the runners-up term by term and the per-module
layouts. Its figures come from :mod:`autopar.report_figures`, drawn by
:mod:`autopar.report_svg`; :func:`write_outputs` writes the page and, with ``--plots``,
the same figures as PNG (:mod:`autopar.report_png`). See docs/report.md.
"""

from __future__ import annotations

import os
from html import escape

from autopar.errors import ConfigError
from autopar.explain_words import (PIPELINE_NOTE, PRICED_AS, explanation_table, explanation_title,
                                   verdict)
from autopar.plans import Plan
from autopar.report_figures import (MEMORY_KINDS, alternatives, layout_rows, legend_text,
                                    memory_figure, mesh_figure, timeline_figure)
from autopar.report_svg import PALETTE, alternatives_svg, memory_svg, mesh_svg, timeline_svg
from autopar.solvers.cost_terms import STEP_TERMS
from autopar.summary import (ZERO_TEXT, batch_text, fmt_time, idle_tp_text, recompute_text,
                             term_label)
from autopar.units_text import fmt_bytes

STYLE = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:#222;
 margin:0 auto;max-width:1180px;padding:18px 24px 40px;background:#fff}
h1{font-size:22px;margin:4px 0 2px}h2{font-size:17px;margin:30px 0 6px;border-bottom:1px solid #ddd;
 padding-bottom:3px}.sub{color:#666;margin:0 0 14px}
.cards{display:flex;gap:12px;flex-wrap:wrap;margin:10px 0}
.card{border:1px solid #ddd;border-radius:6px;padding:8px 14px;min-width:150px}
.card .v{font-size:21px;font-weight:600}.card .k{color:#666;font-size:12px}
table{border-collapse:collapse;margin:8px 0;font-size:13px}
th,td{border-bottom:1px solid #e6e6e6;padding:3px 10px 3px 0;text-align:left;vertical-align:top}
th{color:#555;font-weight:600}
td.n{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
code,.mono{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:12.5px}
svg.figure{width:100%;height:auto;display:block;margin:6px 0}
svg text{font-size:12px;fill:#333}svg .tick{font-size:11px;fill:#555}
svg .boxlabel{font-size:10px;fill:#fff;pointer-events:none}svg .legend{font-size:12px}
svg .devlabel{font-size:12px;fill:#fff;font-weight:600;pointer-events:none}
svg .devcoord{font-size:10.5px;fill:#fff;pointer-events:none}
svg .budget{fill:#c0392b;font-size:12px}
rect.op.dim{opacity:.25}rect.op.hl{stroke:#111;stroke-width:1.2}
g.dev.hl rect{stroke:#111;stroke-width:2.5}
.caption{color:#555;font-size:13px;margin:2px 0 8px}.axisbtn{margin:0 4px 4px 0;padding:2px 10px;
 border:1px solid #bbb;background:#f7f7f7;border-radius:4px;cursor:pointer}
.axisbtn.on{background:#333;color:#fff;border-color:#333}
"""
"""The page's stylesheet."""

SCRIPT = """
(function(){
  const palette = %s;
  let axis = %s;
  const devs = document.querySelectorAll('g.dev');
  function paint(){
    devs.forEach(g => g.querySelector('rect').setAttribute('fill',
      palette[Number(g.getAttribute('data-g-' + axis)) %% palette.length]));
    document.querySelectorAll('.axisbtn').forEach(
      b => b.classList.toggle('on', b.dataset.axis === axis));
  }
  document.querySelectorAll('.axisbtn').forEach(b => b.addEventListener('click', () => {
    axis = b.dataset.axis; paint(); }));
  devs.forEach(g => {
    g.addEventListener('mouseenter', () => {
      const key = 'data-g-' + axis;
      devs.forEach(o => o.classList.toggle('hl', o.getAttribute(key) === g.getAttribute(key)));
    });
    g.addEventListener('mouseleave', () => devs.forEach(o => o.classList.remove('hl')));
  });
  document.querySelectorAll('svg.figure').forEach(svg => {
    const ops = svg.querySelectorAll('rect.op[data-mb]');
    ops.forEach(r => {
      r.addEventListener('mouseenter', () => ops.forEach(o => {
        const same = o.dataset.mb === r.dataset.mb;
        o.classList.toggle('hl', same); o.classList.toggle('dim', !same); }));
      r.addEventListener('mouseleave', () => ops.forEach(o => o.classList.remove('hl', 'dim')));
    });
  });
  if (devs.length) paint();
})();
"""
"""The page's script (``%`` template: the mesh palette, the first axis coloured): the
axis buttons recolour the devices, a hovered device outlines its group and a hovered
timeline box lights up its micro-batch's operations."""


def _table(header: list[str], rows: list[list[str]],
           numeric: frozenset[int] | set[int] = frozenset()) -> str:
    """An HTML table of already formatted cells (escaped here); columns in ``numeric``
    are right-aligned."""
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(
        f'<td{" class=n" if k in numeric else ""}>{escape(c)}</td>' for k, c in enumerate(r))
        + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _card(value: str, key: str) -> str:
    return (f'<div class="card"><div class="v">{escape(value)}</div>'
            f'<div class="k">{escape(key)}</div></div>')


def _overview(plan: Plan) -> str:
    """The heading, the prediction's cards, the step's terms and the configuration."""
    c = plan.cluster
    budget = plan.solver.get("memory_budget_bytes")
    of_budget = (f"per device, of {fmt_bytes(float(budget))}"
                 if isinstance(budget, (int, float)) and budget > 0 else "per device")
    b = plan.breakdown
    terms = " + ".join(f"{term_label(k)} {fmt_time(b.get(k, 0.0))}" for k in STEP_TERMS
                       if b.get(k) or k in ("compute_s", "exposed_comm_s"))
    rest = ", ".join(f"{term_label(k)} {fmt_time(v)}" for k, v in b.items()
                     if k not in STEP_TERMS and abs(v) >= 5e-8)  # shown as 0.0 us below
    mesh = " x ".join(f"{k}={v}" for k, v in plan.mesh.items())
    pipe = plan.pipeline
    config = [
        ["mesh", mesh],
        ["batch", f"global {plan.global_batch} = dp {plan.data_parallel} x micro-batch "
                  f"{plan.microbatch_size} x {plan.num_microbatches} "
                  + ("pipeline micro-batches" if pipe else "accumulation step(s)")
                  + f"; {batch_text(plan)}"],
        ["data parallel", f"ZeRO-{plan.zero} ({ZERO_TEXT.get(plan.zero, '')})"
                          + (", CPU offload" if plan.offload else "")],
        ["tensor parallel", (f"tp={plan.degree('tp')}" if plan.degree("tp") > 1 else "none")
                            + (", sequence parallel" if plan.sequence_parallel else "")
                            + idle_tp_text(plan)],
        ["pipeline", f"pp={plan.degree('pp')}, {pipe.schedule}"
                     + (f", {pipe.virtual_stages} chunks per rank"
                        if pipe.virtual_stages > 1 else "")
                     + f", predicted bubble {pipe.bubble_fraction * 100:.1f}%, p2p "
                       f"{fmt_time(pipe.p2p_s)} per transfer" if pipe else "none"],
        ["recomputation", recompute_text(plan)],
        ["precision", f"{plan.precision}, optimizer {plan.optimizer}"],
    ]
    if plan.context is not None:
        config.insert(4, ["context parallel", f"cp={plan.degree('cp')}, {plan.context.variant}, "
                          f"{plan.context.seq_len:,} tokens per sequence"])
    if plan.experts:
        folded = f" (ep={plan.degree('ep')} x tp, whole experts)" if plan.fold_experts else ""
        config.insert(4, ["expert parallel", f"ep={plan.expert_ranks}{folded} over "
                          f"{len(plan.experts)} expert module(s)"])
    return (f"<h1>autopar plan for {escape(plan.model)}</h1>"
            f'<p class="sub">{c.get("nodes")} node(s) x {c.get("gpus_per_node")} '
            f'{escape(str(c.get("gpu")))} = {plan.world_size} devices · graph '
            f'<span class="mono">{escape(plan.graph_hash)}</span></p><div class="cards">'
            + _card(fmt_time(plan.step_time_s), "predicted step time")
            + _card(f"{plan.throughput:.2f} samples/s", "throughput")
            + _card(f"{plan.mfu * 100:.1f}%", "MFU")
            + _card(fmt_bytes(plan.memory_per_device_bytes), "memory " + of_budget)
            + f'</div><p>step = {escape(terms)}</p>'
            + (f'<p class="caption">({escape(rest)})</p>' if rest else "")
            + _table(["", ""], config))


def _mesh_section(plan: Plan) -> str:
    fig = mesh_figure(plan)
    rows = [[a.name, str(a.size), str(a.stride), str(a.groups),
             ("within a node" if a.within_node else "across nodes") if a.size > 1 else "–",
             (" ".join(a.shown) + (f" … ({a.groups - len(a.shown)} more)"
                                   if a.groups > len(a.shown) else "")) if a.size > 1
             else "– (size 1: no communication over it)"]
            for a in fig.axes]
    buttons = "".join(f'<button class="axisbtn" data-axis="{escape(a.name)}">{escape(a.name)}'
                      f"</button>" for a in fig.axes if a.size > 1)
    return ("<h2>Device mesh</h2><p class=caption>Ranks are numbered row-major over the axes, "
            "outermost first; a group is the ranks that differ only on that axis and "
            "communicate over it.</p>"
            + _table(["axis", "size", "rank stride", "groups", "placement", "ranks per group"],
                     rows, {1, 2, 3})
            + (f"<p class=caption>Devices of one colour form one group of the axis "
               f"chosen here (hover a device to outline its group): {buttons}</p>"
               if buttons else "")
            + mesh_svg(fig, plan.mesh))


def _timeline_section(plan: Plan) -> str:
    fig = timeline_figure(plan)
    out = ("<h2>One step, per rank</h2>" if plan.pipeline else "<h2>One step</h2>")
    out += timeline_svg(fig) + "".join(f'<p class="caption">{escape(n)}.</p>' for n in fig.notes)
    if plan.pipeline:
        out += ('<p class="caption">Each box is one operation of the schedule, as the solver '
                "simulated it from the stages below (hover for its stage, micro-batch and "
                "times; all of a micro-batch's operations light up); a stage's communication "
                "is drawn at the end of its operations, in proportion to their time."
                + (" A rank's second model chunk is drawn lighter." if
                   plan.pipeline.virtual_stages > 1 else "") + "</p>")
        rows = [[str(s.index), str(s.rank), ", ".join(s.units) if len(s.units) <= 6 else
                 f"{s.units[0]} … {s.units[-1]} ({len(s.units)} units)",
                 fmt_time(s.forward_s), fmt_time(s.backward_s), fmt_bytes(s.memory_bytes)]
                for s in plan.pipeline.stages]
        out += _table(["stage", "rank", "units", "forward", "backward", "rank memory"], rows,
                      {3, 4, 5})
    return out


def _memory_section(plan: Plan) -> str:
    fig = memory_figure(plan)
    rows = [[legend_text(MEMORY_KINDS, k), fmt_bytes(v)] for k, v in plan.memory.items()]
    what = ("Peak bytes per pp rank (the plan's memory below is its fullest rank's)"
            if plan.pipeline else "Peak bytes per device (every rank alike)")
    return (f"<h2>Memory</h2><p class=caption>{what}, against the budget the search was "
            "held to.</p>" + memory_svg(fig) + _table(["category", "bytes"], rows, {1}))


def _alternatives_section(plan: Plan) -> str:
    alts = alternatives(plan)
    if len(alts) == 1:
        return ("<h2>Alternatives</h2><p class=caption>None recorded: plan with "
                "<code>--top-k 5</code> to see the next fastest configurations and the "
                "terms each loses on.</p>")
    rows = [[a.label, a.config, fmt_time(a.step_time_s), fmt_bytes(a.memory_bytes),
             f"{a.mfu * 100:.1f}%", a.why] for a in alts]
    return ("<h2>Alternatives</h2><p class=caption>The plan and the next fastest "
            "configurations the search kept, their step time by term.</p>"
            + alternatives_svg(alts)
            + _table(["#", "configuration", "step time", "memory", "MFU", "loses on"], rows,
                     {2, 3, 4}))


def _explanations_section(plan: Plan) -> str:
    """Why the modules asked about (``--explain``) have their layouts: a table each."""
    out = ""
    for exp in plan.explanations:
        header, rows = explanation_table(exp)
        why = "".join(f'<p class="caption">{escape(v)}.</p>' for v in verdict(exp))
        out += (f"<h3>{escape(explanation_title(exp))}</h3><p class=caption>"
                f"{escape(PRICED_AS.capitalize())}"
                + (f"; {escape(PIPELINE_NOTE)}" if plan.pipeline else "") + ".</p>"
                + _table(header, rows, set(range(1, len(header)))) + why)
    return "<h2>Why these layouts</h2>" + out if out else ""


def _layout_section(plan: Plan) -> str:
    axes = "/".join(plan.stage_mesh)
    rows = [[r.module, r.module_type, str(r.count), r.style, r.input_layout, r.output_layout,
             r.params, r.recompute] + ([r.stages] if plan.pipeline else [])
            for r in layout_rows(plan)]
    header = ["module", "type", "count", "tp style", "input (received → used)", "output",
              f"parameters ({axes})", "recompute"] + (["stages"] if plan.pipeline else [])
    return ("<h2>Per-module layouts</h2><p class=caption>Placements per mesh axis ("
            f"{escape(axes)}): R replicated, S(d) split along tensor dim d, P partial sums "
            "awaiting a reduction; <code>blocks.*</code> stands for every block.</p>"
            + _table(header, rows, {2}))


def _footer(plan: Plan) -> str:
    s = plan.solver
    solver = ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                       for k, v in s.items())
    notes = "".join(f"<li>{escape(n)}</li>" for n in plan.notes)
    return ("<h2>How it was found</h2>" + (f'<p class="mono">{escape(solver)}</p>' if s else "")
            + (f"<ul>{notes}</ul>" if notes else ""))


def render_report(plan: Plan) -> str:
    """The plan as one self-contained HTML page."""
    first = next((a for a, n in plan.mesh.items() if n > 1), next(iter(plan.mesh)))
    script = SCRIPT % (repr(list(PALETTE)).replace("'", '"'), '"' + first + '"')
    return ("<!DOCTYPE html><html lang=en><head><meta charset=utf-8>"
            f"<title>autopar plan: {escape(plan.model)}</title><style>{STYLE}</style></head>"
            "<body>" + _overview(plan) + _mesh_section(plan) + _timeline_section(plan)
            + _memory_section(plan) + _alternatives_section(plan) + _layout_section(plan)
            + _explanations_section(plan)
            + _footer(plan) + f"<script>{script}</script></body></html>\n")


def check_outputs(report: str | None, plots: str | None) -> None:
    """ConfigError, before any planning, when the report's folder does not exist or
    ``plots`` is given and matplotlib is not installed or ``plots`` is a file."""
    if report is not None:
        folder = os.path.dirname(os.path.abspath(report))
        if os.path.isdir(report) or not os.path.isdir(folder):
            raise ConfigError(f"cannot write the report to {report!r}: "
                              + ("it is a folder" if os.path.isdir(report)
                                 else f"its folder {folder!r} does not exist"))
    if plots is not None:
        from autopar.report_png import require_matplotlib

        require_matplotlib()
        if os.path.exists(plots) and not os.path.isdir(plots):
            raise ConfigError(f"--plots {plots!r} is a file; pass a folder for the PNG figures")


def write_outputs(plan: Plan, report: str | None, plots: str | None) -> list[str]:
    """Write the HTML report and the PNG figures asked for; the paths written."""
    written = []
    if report is not None:
        try:
            with open(report, "w", encoding="utf-8") as f:
                f.write(render_report(plan))
        except OSError as e:
            raise ConfigError(f"cannot write the report to {report!r}: {e.strerror}") from None
        written.append(report)
    if plots is not None:
        from autopar.report_png import write_plots

        written += write_plots(plan, plots)
    return written
