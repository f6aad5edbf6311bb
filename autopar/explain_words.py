"""The words and tables of a plan's explanations (``plan.explanations``, made by
:mod:`autopar.explain`): per module its layouts by term, the runner-up and why, for the
summary (:func:`explanation_lines`) and the report page."""

from __future__ import annotations

from typing import TYPE_CHECKING

from autopar.summary_words import fmt_time, join_words, saves_and_pays, table
from autopar.units_text import fmt_bytes

if TYPE_CHECKING:
    from autopar.plans import LayoutExplanation, LayoutOption, Plan

__all__ = ["EXPLAIN_TERMS", "PIPELINE_NOTE", "PRICED_AS", "differences", "explanation_lines",
           "explanation_table", "explanation_title", "layout_text", "verdict"]

EXPLAIN_TERMS = (("compute_s", "compute"), ("recompute_s", "recomputation"),
                 ("comm_s", "collectives"), ("reshard_s", "resharding"),
                 ("optimizer_s", "optimizer step"),
                 ("exposed_param_comm_s", "exposed param comm"),
                 ("exposed_host_s", "waiting for the host"))
"""The terms of :attr:`LayoutOption.terms` whose differences add up to the difference
of two layouts' step times, with their readable names, in order."""


def layout_text(o: LayoutOption) -> str:
    """``colwise S(2)->R, out S(1)``: the style, the input received -> computed on and
    the output handed on (the tp axis)."""
    return f"{o.style} {o.input_layout}->{o.desired_input_layout}, out {o.output_layout}"


def differences(chosen: LayoutOption, other: LayoutOption) -> str:
    """'more resharding (+0.45 s) and more collectives (+67.0 ms), despite less
    recomputation (-33.5 ms)', said of ``other`` against ``chosen``: the terms of
    :data:`EXPLAIN_TERMS` that move the step by at least SHARE of the gap
    (:func:`autopar.summary_words.saves_and_pays`)."""
    slower = other.step_time_s >= chosen.step_time_s
    winner, loser = (chosen, other) if slower else (other, chosen)
    diffs = [(label, winner.terms.get(k, 0.0) - loser.terms.get(k, 0.0))
             for k, label in EXPLAIN_TERMS]
    why, despite = saves_and_pays(diffs, loser.step_time_s - winner.step_time_s, slower)
    if not why:
        return "the same terms"
    return join_words(why) + (", despite " + join_words(despite) if despite else "")


def verdict(exp: LayoutExplanation) -> list[str]:
    """The runner-up in words, and before it a faster layout that does not fit, if there
    is one."""
    chosen = exp.chosen
    fits = [o for o in exp.alternatives if o.fits]
    lines = []
    faster = [o for o in exp.alternatives if not o.fits and o.step_time_s < chosen.step_time_s]
    if faster:
        o = faster[0]
        lines.append(
            f"{layout_text(o)} would be {fmt_time(chosen.step_time_s - o.step_time_s)} "
            f"faster ({differences(chosen, o)}) but does not fit: "
            f"{fmt_bytes(o.memory_bytes)} per device against the "
            f"{fmt_bytes(exp.memory_budget_bytes)} budget (this module "
            f"{_signed_bytes(o.terms['memory_bytes'] - chosen.terms['memory_bytes'])})")
    if fits:
        o = fits[0]
        gap = o.step_time_s - chosen.step_time_s
        lines.append(f"runner-up {layout_text(o)} is {fmt_time(abs(gap))} "
                     f"{'slower' if gap >= 0 else 'faster'} per step: {differences(chosen, o)}")
    elif not faster:
        lines.append("no other layout is possible with the plan's other choices kept (its "
                     "neighbours' layouts, or a parameter tied to another module's, allow none)")
    return lines


def _signed_bytes(b: float) -> str:
    return ("+" if b >= 0 else "-") + fmt_bytes(abs(b))


def explanation_table(exp: LayoutExplanation) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of ``exp``'s layouts by term, the chosen one first (marked ``*``):
    the step with its difference, the terms any layout has, its own and the peak memory."""
    c = exp.chosen
    shown = [c] + exp.alternatives
    terms = [(k, label) for k, label in EXPLAIN_TERMS if any(o.terms.get(k, 0.0) for o in shown)]
    rows = []
    for k, o in enumerate(shown):
        gap = o.step_time_s - c.step_time_s
        step = fmt_time(o.step_time_s) + ("" if k == 0 else
                                           f" ({'+' if gap >= 0 else '-'}{fmt_time(abs(gap))})")
        rows.append([("* " if k == 0 else "  ") + layout_text(o), step]
                    + [fmt_time(o.terms.get(t, 0.0)) for t, _ in terms]
                    + [fmt_bytes(o.terms.get("memory_bytes", 0.0)),
                       fmt_bytes(o.memory_bytes) + ("" if o.fits else " (over)")])
    return ["layout", "step"] + [lab for _, lab in terms] + ["own memory", "peak memory"], rows


def explanation_title(exp: LayoutExplanation) -> str:
    """'why blocks.*.attn.proj (Linear, 96 modules) is colwise S(2)->R, out S(1)'."""
    return (f"why {exp.module} ({exp.module_type}, {exp.count} module"
            f"{'s' if exp.count > 1 else ''}) is {layout_text(exp.chosen)}")


PRICED_AS = ("its layouts priced with the plan's other choices kept (per step; memory per "
             "device)")
"""What an explanation's table shows, in words."""

PIPELINE_NOTE = ("priced on the stage mesh as one pass over the model, without the pipeline "
                 "schedule")
"""How an explanation of a pipelined plan is priced."""


def explanation_lines(plan: Plan) -> list[str]:
    """The summary's section for ``plan.explanations``: per module a table of its
    layouts by term (seconds per step, bytes per device) and the runner-up in words."""
    lines = []
    for exp in plan.explanations:
        header, rows = explanation_table(exp)
        lines.append(f"{explanation_title(exp)}: {PRICED_AS}")
        lines += ["  " + r for r in table(rows, header)]
        lines += ["  " + v for v in verdict(exp)]
        if plan.pipeline is not None:
            lines.append(f"  ({PIPELINE_NOTE})")
        lines.append("")
    return lines
