"""Build the solver :class:`~autopar.solvers.problem.Problem` of a graph on one mesh: the
strategies :mod:`autopar.strategies.enumeration` enumerates (with the summing twins of
:mod:`autopar.strategies.grad_sum`), priced by
:mod:`autopar.cost_models.strategy_price`, the edges and ties between them
(:mod:`autopar.strategies.edges`) and the recomputation groups
(:mod:`autopar.strategies.recompute`, :mod:`autopar.cost_models.recompute_price`).

A search builds many problems that differ only in settings no layout depends on
(:func:`layout_key`); the caller's cache keeps each layout's build, and a later
problem reprices it through the same :meth:`StrategyPricer.price` as a first build.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from autopar.cost_models.host import charges_host
from autopar.cost_models.recompute_price import ModeCosts, edge_extra, mode_costs, rerun_reach
from autopar.cost_models.strategy_price import OpTerms, StrategyPrice, StrategyPricer
from autopar.errors import NoFeasiblePlanError
from autopar.graph import OpNode
from autopar.memory_choices import RECOMPUTE
from autopar.solvers.cost_record import StrategyCost
from autopar.solvers.problem import EdgeChoice, NodeChoice, Problem, RecomputeGroup, Tie
from autopar.strategies.analysis import GraphAnalysis
from autopar.strategies.edges import edge_counts, edge_options, shared_conversion, tied_groups
from autopar.strategies.enumeration import NodeStrategy
from autopar.strategies.grad_sum import add_gradient_sums
from autopar.strategies.recompute import recompute_layers
from autopar.strategies.settings import Settings

_NO_TERMS = OpTerms(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)  # a graph input's: it costs nothing


@dataclass
class Built:
    """A problem plus the strategy details behind each of its choices."""

    problem: Problem
    names: list[str]
    strategies: list[list[NodeStrategy]]
    settings: Settings


@dataclass
class _Layout:
    """A build kept in the cache under its :func:`layout_key`, with each strategy's
    :class:`OpTerms` (the terms a repricing keeps)."""

    built: Built
    ops: list[list[OpTerms]]


def build_problem(an: GraphAnalysis, st: Settings, cache: dict | None = None) -> Built:
    """Build the solver problem for graph analysis ``an`` under settings ``st``.

    ``cache`` (a dict the caller owns for one search) keeps each built problem under
    the settings its layouts depend on (:func:`layout_key`); a later call that differs
    only in ZeRO stage, micro-batch count, offload, optimizer or budget reprices just
    the parameter terms (:func:`_reprice`) and shares the rest. It also keeps the
    graph's facts that no setting changes (``"saved_owner"``, ``"facts"``,
    ``"edge_counts"``, ``"host_facts"``)."""
    p = StrategyPricer(an, st, cache.get("saved_owner") if cache is not None else None,
                       cache.get("facts") if cache is not None else None,
                       cache.get("host_facts") if cache is not None else None)
    if cache is not None:  # the graph's, the same for every layout
        cache["saved_owner"] = p.saved_owner
        cache["facts"] = p.facts
    key = layout_key(st)
    if cache is not None and key in cache:
        return _reprice(p, cache[key])
    layout = _build(p, cache)
    if cache is not None:
        cache[key] = layout
        if p.has_host_facts:
            cache["host_facts"] = p.host_facts
    return layout.built


REPRICED_SETTINGS = frozenset({"num_microbatches", "zero", "offload", "optimizer",
                               "memory_budget", "pipelined"})
"""The :class:`Settings` fields a repricing covers (:func:`_reprice`: the parameters'
terms); every other field is part of :func:`layout_key`, a new one included."""


def layout_key(st: Settings) -> tuple:
    """What a problem's strategies, compute and activation costs, edges, ties and
    recomputation groups depend on: every field of ``st`` but those of
    :data:`REPRICED_SETTINGS`, with the hardware profile by identity and the size of
    the data-parallel axis as 1 or more than 1. (The ``dp`` axis only splits the batch:
    every device keeps ``microbatch_size`` samples whatever its size, so local shapes,
    compute and the collectives of the other axes, whose groups are the innermost
    ranks, do not change; what does — parameter communication over ``dp`` and the
    sharded parameter memory — is repriced.)"""
    sizes = tuple(min(n, 2) if name == "dp" else n
                  for name, n in zip(st.mesh.names, st.mesh.sizes))
    rest = tuple(getattr(st, f.name) for f in fields(st)
                 if f.name not in REPRICED_SETTINGS and f.name not in ("mesh", "hw"))
    return (st.mesh.names, sizes, id(st.hw)) + rest


def strategy_cost(name: str, price: StrategyPrice) -> StrategyCost:
    """The solver's record of a strategy priced ``price``."""
    op, par = price.op, price.params
    return StrategyCost(
        name=name, compute_s=op.compute_s, bwd_compute_s=op.bwd_compute_s,
        comm_s=price.comm_s, all_to_all_s=price.all_to_all_s,
        micro_param_comm_s=par.micro, step_param_comm_s=par.step,
        memory_bytes=sum(price.memory.values()), gather_bytes=par.gather,
        optimizer_s=par.optimizer_s, backward_start_bytes=op.backward_start_bytes,
        param_copy_s=par.copy_f + par.copy_b, param_copy_bwd_s=par.copy_b,
        host_s=op.host_s, host_bwd_s=op.host_bwd_s, param_host_s=par.host,
        param_host_bwd_s=par.host_bwd, host_step_s=par.host_step)


def _priced(p: StrategyPricer, n: OpNode, ns: NodeStrategy,
            op: OpTerms) -> tuple[NodeStrategy, StrategyCost]:
    """Strategy ``ns`` of op ``n`` with its memory, and its cost: the one pricing path
    of a build and a repricing."""
    price = p.price(n, ns, op)
    return ns.with_memory(price.memory), strategy_cost(ns.name, price)


def _reprice(p: StrategyPricer, base: _Layout) -> Built:
    """``base`` (built under the same :func:`layout_key`) priced for ``p.st``: each
    strategy of an op that owns parameters, its :class:`OpTerms` kept; the others'
    prices do not depend on what differs."""
    nodes, details = [], []
    old = base.built
    for nc, ds, ops, name in zip(old.problem.nodes, old.strategies, base.ops, old.names):
        n = p.node(name)
        if n.kind != "op" or not p.facts.owned(n):
            nodes.append(nc)
            details.append(ds)
            continue
        priced = [_priced(p, n, ns, op) for ns, op in zip(ds, ops)]
        nodes.append(replace(nc, strategies=[sc for _, sc in priced]))
        details.append([ns for ns, _ in priced])
    st = p.st
    prob = replace(old.problem, nodes=nodes, num_microbatches=st.num_microbatches,
                   memory_budget=st.memory_budget, overlap=st.overlap)
    return Built(prob, old.names, details, st)


def _build(p: StrategyPricer, cache: dict | None = None) -> _Layout:
    """Enumerate and price every canonical node's strategies, the edges, the ties and
    the recomputation groups."""
    an, st, space = p.an, p.st, p.space
    g = an.graph
    canon = g.canonical
    index: dict[str, int] = {}
    enumerated: list[list[NodeStrategy]] = []
    names: list[str] = []
    for n in g.nodes:
        if n.kind not in ("op", "input") or canon.get(n.name, n.name) != n.name:
            continue
        ns = space.input_strategies(n) if n.kind == "input" else space.strategies(n)
        if not ns:
            raise NoFeasiblePlanError(f"operator {n.target} in '{n.module_path}' has no "
                                      f"strategy on mesh {st.mesh.as_dict()}")
        index[n.name] = len(names)
        enumerated.append(ns)
        names.append(n.name)
    if cache is not None and "edge_counts" in cache:
        counts = cache["edge_counts"]
    else:
        counts = edge_counts(g, index)
        if cache is not None:  # the graph's, the same for every layout
            cache["edge_counts"] = counts
    add_gradient_sums(space, counts, names, enumerated)
    nodes, details, ops = [], [], []
    for name, ds in zip(names, enumerated):
        n = p.node(name)
        if n.kind == "input":
            nodes.append(_node_choice(an, n, [StrategyCost(ns.name) for ns in ds]))
            details.append(ds)
            ops.append([_NO_TERMS] * len(ds))
            continue
        terms = [p.op_terms(n, ns) for ns in ds]
        priced = [_priced(p, n, ns, op) for ns, op in zip(ds, terms)]
        nodes.append(_node_choice(an, n, [sc for _, sc in priced]))
        details.append([ns for ns, _ in priced])
        ops.append(terms)
    edges, forward = _edges(p, counts, details, names)
    ties = [Tie(a, c, ga, gb) for a, c, ga, gb in tied_groups(space, index, details)]
    groups = _recompute_groups(p, index, details, ops, edges, forward)
    prob = Problem(nodes, edges, ties, st.num_microbatches, st.memory_budget, 0.0, st.overlap,
                   groups)
    return _Layout(Built(prob, names, details, st), ops)


def _node_choice(an: GraphAnalysis, n: OpNode, costs: list[StrategyCost]) -> NodeChoice:
    return NodeChoice(n.name, costs, multiplicity=an.multiplicity.get(n.name, 1),
                      gather_multiplicity=2 if n.layer is not None else 1)


def _edges(p: StrategyPricer, counts: dict[tuple[int, int, int], int],
           details: list[list[NodeStrategy]], names: list[str]
           ) -> tuple[list[EdgeChoice], list[dict[tuple[int, int], float]]]:
    """Every edge with the price of each pair of strategies it allows, and per edge the
    pairs whose forward conversion costs something, with those seconds."""
    edges, forward = [], []
    for e in edge_options(p.space, counts, details, names):
        nbytes = p.out_bytes(e.tensor)
        cost, a2a, fwd = {}, {}, {}
        for ii, jj, c in e.pairs:
            if e.shared_axis is not None:
                c = shared_conversion(c, e.shared_axis)
            t = p.convert_both(c.src, c.dst, c.grad, nbytes, e.needs_grad)
            cost.update({(i, j): t for i in ii for j in jj})
            t_fwd = p.convert(c.src, c.dst, nbytes) if c.src != c.dst else 0.0
            if t_fwd:
                fwd.update({(i, j): t_fwd for i in ii for j in jj})
            if e.entry and c.src[p.ep_axis] != c.dst[p.ep_axis]:  # tokens to their experts
                plain = shared_conversion(c, p.ep_axis)
                t -= p.convert_both(plain.src, plain.dst, plain.grad, nbytes, e.needs_grad)
                a2a.update({(i, j): t for i in ii for j in jj})
        edges.append(EdgeChoice(e.producer, e.consumer, dict(sorted(cost.items())), e.count,
                                dict(sorted(a2a.items()))))
        forward.append(fwd)
    return edges, forward


def _recompute_groups(p: StrategyPricer, index: dict[str, int],
                      details: list[list[NodeStrategy]], ops: list[list[OpTerms]],
                      edges: list[EdgeChoice], forward: list[dict[tuple[int, int], float]]
                      ) -> list[RecomputeGroup]:
    """One group per canonical layer of the graph, over the modes ``p.st.recompute_modes``
    allows (mode indices follow :data:`autopar.memory_choices.RECOMPUTE`); a node no
    mode changes is left out. Each group lists the edges into its nodes whose forward
    conversion (``forward``, per edge and pair) its recomputation runs again."""
    allowed = tuple(k for k, m in enumerate(RECOMPUTE) if m in p.st.recompute_modes)
    host = charges_host(p.st.hw)
    groups = []
    for layer in recompute_layers(p.space, index):
        reach = rerun_reach(p, layer.names)
        rows: list[tuple[int, list[ModeCosts]]] = []
        for name in layer.names:
            k = index[name]
            own = layer.inputs.get(name, [])
            costs = [mode_costs(p, name, ns, op, own, host, reach[name])
                     for ns, op in zip(details[k], ops[k])]
            if any(c.any() for c in costs):
                rows.append((k, costs))
        consumers = {index[name]: reach[name] for name in layer.names}
        again = [(k, {ij: edge_extra(consumers[e.v], t) for ij, t in forward[k].items()})
                 for k, e in enumerate(edges) if e.v in consumers and forward[k]]
        again = [(k, table) for k, table in again if any(any(r) for r in table.values())]
        if rows or again:
            groups.append(RecomputeGroup(
                ",".join(layer.paths), [k for k, _ in rows],
                [[c.extra_s for c in cs] for _, cs in rows],
                [[c.act_delta for c in cs] for _, cs in rows],
                [[c.transient for c in cs] for _, cs in rows], RECOMPUTE, allowed,
                host_fwd_s=[[c.host_fwd_s for c in cs] for _, cs in rows] if host else [],
                host_bwd_s=[[c.host_bwd_s for c in cs] for _, cs in rows] if host else [],
                edges=[k for k, _ in again], edge_extra_s=[table for _, table in again]))
    return groups
