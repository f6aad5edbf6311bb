"""Why a module has the layout the plan gives it: ``plan(..., explain=["attn.proj"])``,
``autopar plan ... --explain attn.proj``.

:func:`explain_layouts` prices each other layout of the modules asked about with every
other choice of the solution kept (:func:`autopar.solvers.explain.price_alternatives`,
the ILP's own terms) and records them as :class:`autopar.plans.LayoutExplanation`;
:func:`autopar.explain_words.explanation_lines` writes them for the summary.
:func:`check_explain` refuses, before the search, a name that matches no module. What
the terms mean and an example: docs/reading_a_plan.md, section "Why a module has its
layout".
"""

from __future__ import annotations

from fnmatch import fnmatchcase

from autopar.assemble import (chosen_strategies, expert_plans, module_ops, module_plan,
                              param_owners, param_placements)
from autopar.errors import ConfigError
from autopar.graph import Graph
from autopar.plans import LayoutExplanation, LayoutOption, ModulePlan
from autopar.solvers.explain import PricedChoice, price_alternatives
from autopar.solvers.intra_op_ilp import Solution
from autopar.solvers.problem_build import Built
from autopar.strategies.analysis import GraphAnalysis
from autopar.summary_words import module_pattern

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
