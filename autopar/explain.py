"""Why a module has the layout the plan gives it: ``plan(..., explain=["attn.proj"])``,
``autopar plan ... --explain attn.proj``.

:func:`explain_layouts` prices each other layout of the modules asked about with every
other choice of the solution kept (:func:`autopar.solvers.explain.price_alternatives`,
the ILP's own terms) and records them as :class:`autopar.plans.LayoutExplanation`;
:func:`explanation_lines` writes them for the summary. :func:`check_explain` refuses,
before the search, a name that matches no module. What the terms mean and an example:
docs/reading_a_plan.md, section "Why a module has its layout".
"""

from __future__ import annotations

from fnmatch import fnmatchcase

from autopar.assemble import (chosen_strategies, expert_plans, module_ops, module_plan,
                              param_owners, param_placements)
from autopar.errors import ConfigError
from autopar.graph import Graph
from autopar.plans import LayoutExplanation, LayoutOption, ModulePlan, Plan
from autopar.solvers.explain import PricedChoice, price_alternatives
from autopar.solvers.intra_op_ilp import Solution
from autopar.solvers.problem_build import Built
from autopar.strategies.analysis import GraphAnalysis
from autopar.summary_words import fmt_time, join_words, module_pattern, saves_and_pays, table
from autopar.units_text import fmt_bytes

EXPLAIN_TERMS = (("compute_s", "compute"), ("recompute_s", "recomputation"),
                 ("comm_s", "collectives"), ("reshard_s", "resharding"),
                 ("optimizer_s", "optimizer step"),
                 ("exposed_param_comm_s", "exposed param comm"),
                 ("exposed_host_s", "waiting for the host"))
"""The terms of :attr:`LayoutOption.terms` whose differences add up to the difference
of two layouts' step times, with their readable names, in order."""

SHOWN = 6
"""Alternatives kept per explanation (the fastest, distinct layouts)."""

PRICED_SHOWN = 64
"""Of the assignments priced, the chosen one and the fastest others up to this many
are turned into layouts (a module of several ops may have thousands)."""


def explainable_modules(g: Graph) -> list[str]:
    """The module paths a plan lays out (those owning parameters and running ops), in
    the order the forward first runs them."""
    ops, owners = module_ops(g), param_owners(g)
    return [path for path, o in ops.items() if o and path in owners]


def matching(paths: list[str], name: str) -> list[str]:
    """The paths ``name`` names: equal to it, ending with ``"." + name`` or matching it
    as a glob (``blocks.*.attn.proj``)."""
    return [p for p in paths if p == name or p.endswith("." + name) or fnmatchcase(p, name)]


def check_explain(g: Graph, names: object) -> list[str]:
    """``names`` (``plan``'s ``explain``) as a list of strings, each naming at least
    one module of ``g``; raises ConfigError saying what is wrong otherwise."""
    if names is None:
        return []
    if isinstance(names, str):
        names = [names]
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise ConfigError(f"explain={names!r}: expected a module path or a list of them, "
                          f"e.g. explain=['attn.proj']")
    paths = explainable_modules(g)
    for name in names:
        if not matching(paths, name):
            shown = list(dict.fromkeys(module_pattern(p, _blocks(g)) for p in paths))
            raise ConfigError(
                f"explain={name!r} names no module that owns parameters; give a module path, "
                f"its last parts or a glob, one of: {', '.join(shown[:12])}"
                + (f" (and {len(shown) - 12} more)" if len(shown) > 12 else ""))
    return list(names)


def _blocks(g: Graph) -> list[str]:
    """The paths of the repeated blocks (a plan's ``blocks``)."""
    return sorted({lay.path for lay in g.layers})


def explain_layouts(an: GraphAnalysis, built: Built, sol: Solution, names: list[str],
                    budget: float) -> list[LayoutExplanation]:
    """One :class:`LayoutExplanation` per group of modules that ``names`` match and
    that share their strategies (the instances of a repeated block), in model order."""
    if not names:
        return []
    g = an.graph
    ops, owners = module_ops(g), param_owners(g)
    index = {name: k for k, name in enumerate(built.names)}
    blocks = _blocks(g)
    groups: dict[tuple[int, ...], list[str]] = {}
    for path in explainable_modules(g):
        nodes = tuple(sorted({index[g.canonical.get(o.name, o.name)] for o in ops[path]}))
        groups.setdefault(nodes, []).append(path)
    out: list[LayoutExplanation] = []
    for nodes, members in groups.items():
        path = next((p for p in members if any(matching([p], n) for n in names)), None)
        if path is None:
            continue
        owning = {index[g.canonical.get(op, op)] for pn, (op, _) in an.param_owner.items()
                  if g.node(pn).target.rpartition(".")[0] == path}
        priced = price_alternatives(built.problem, list(nodes), sol.choice, sol.modes,
                                    sorted(owning))
        allowed = [c for c in priced if c.blocked in ("", "memory")][:PRICED_SHOWN]
        options = [_option(an, built, sol.choice, list(nodes), c, path, ops[path],
                           owners[path], budget) for c in allowed]
        out.append(LayoutExplanation(module_pattern(path, blocks), ops[path][0].module_type,
                                     len(members), options[0],
                                     _distinct(options[1:], options[0])[:SHOWN], budget))
    return out


def _option(an: GraphAnalysis, built: Built, choice: list[int], nodes: list[int],
            c: PricedChoice, path: str, ops: list, locals_: list[str],
            budget: float) -> LayoutOption:
    """The :class:`LayoutOption` of assignment ``c`` of ``nodes`` for module ``path``."""
    trial = list(choice)
    for v, i in zip(nodes, c.strategies):
        trial[v] = i
    chosen = chosen_strategies(an.graph, built, trial)
    st = built.settings
    params = param_placements(an, chosen, st, expert_plans(an, chosen, st.mesh))
    axis = st.mesh.names.index("tp") if "tp" in st.mesh.names else None
    mp: ModulePlan = module_plan(an, path, ops, locals_, chosen, axis, params, 0.0)
    lt = c.local
    terms = {"compute_s": lt.compute_s, "recompute_s": lt.recompute_s, "comm_s": lt.comm_s,
             "reshard_s": lt.reshard_s, "optimizer_s": lt.optimizer_s,
             "exposed_param_comm_s": c.exposed_param_comm_s,
             "exposed_host_s": c.exposed_host_s, "param_comm_s": lt.param_comm_s,
             "memory_bytes": lt.memory_bytes}
    names = [built.strategies[v][i].name for v, i in zip(nodes, c.strategies)]
    return LayoutOption(mp.style, mp.input_layout, mp.desired_input_layout, mp.output_layout,
                        mp.params, names, terms, c.step_time_s, c.memory_bytes,
                        c.memory_bytes <= budget * (1 + 1e-9))


def _key(o: LayoutOption) -> tuple:
    return (o.style, o.input_layout, o.desired_input_layout, o.output_layout,
            tuple((k, tuple(v)) for k, v in sorted(o.params.items())))


def _distinct(options: list[LayoutOption], chosen: LayoutOption) -> list[LayoutOption]:
    """``options`` fastest first, one per module layout (the fastest assignment giving
    it), the chosen layout's own other assignments left out."""
    best: dict[tuple, LayoutOption] = {}
    for o in sorted(options, key=lambda o: o.step_time_s):
        best.setdefault(_key(o), o)
    best.pop(_key(chosen), None)
    return list(best.values())


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
