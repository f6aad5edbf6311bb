"""Pipeline units: the model cut into the pieces that pipeline stages are made of, and
the cost of each piece under an intra-op solution.

The units are everything before the first repeated block (``pre``), each repeated
block, and everything after the last (``post``); :func:`unit_of_nodes` finds them and
:func:`unit_costs` gives each its exact share of the intra-op objective under a choice
of strategies and recomputation modes (:class:`Unit`); :func:`least_unit_costs`
bounds them over every choice, and :func:`add_tied_copies` charges the copies of a
tied parameter.

The unit costs (forward and backward seconds, static and activation bytes) and the
recomputation terms are written out in docs/solvers.md, section
``autopar.solvers.units``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from autopar.graph import Graph
from autopar.sharding import replica_degree, shard_count
from autopar.solvers.cost_terms import PieceCost
from autopar.solvers.cost_record import StrategyCost
from autopar.solvers.problem import Problem, edge_rerun
from autopar.solvers.problem_build import Built
from autopar.strategies.analysis import param_users


@dataclass
class Unit(PieceCost):
    """One pipeline unit: its costs (see docs/solvers.md), its module paths and
    its graph nodes."""

    modules: list[str] = field(default_factory=list)
    nodes: list[str] = field(default_factory=list)


def unit_of_nodes(g: Graph) -> tuple[list[Unit], dict[str, int]]:
    """The units of ``g`` (without costs: fresh ones each call) and the unit index of
    every node (worked out once per graph)."""
    found = g.memo.get("unit_of_nodes")
    if found is None:
        units, where = _unit_of_nodes(g)
        found = g.memo["unit_of_nodes"] = (
            tuple((u.name, tuple(u.modules), tuple(u.nodes)) for u in units), where)
    shapes, where = found
    return [Unit(name=name, modules=list(mods), nodes=list(nodes))
            for name, mods, nodes in shapes], where


def _unit_of_nodes(g: Graph) -> tuple[list[Unit], dict[str, int]]:
    """:func:`unit_of_nodes`, worked out."""
    if not g.layers:
        return [Unit(name="model", modules=[""], nodes=[n.name for n in g.nodes])], \
            {n.name: 0 for n in g.nodes}
    pos = {n.name: k for k, n in enumerate(g.nodes)}
    start = pos[g.layers[0].nodes[0]]
    units = [Unit(name="pre")] + [Unit(name=lay.path, modules=[lay.path]) for lay in g.layers] + \
        [Unit(name="post")]
    where: dict[str, int] = {}
    first_user = {}
    for n in g.nodes:
        for i in n.inputs:
            first_user.setdefault(i, n)
    for n in g.nodes:
        if n.kind == "param" and n.name in first_user:  # a parameter goes with its user
            user = first_user[n.name]
            where[n.name] = user.layer + 1 if user.layer is not None else \
                (0 if pos[user.name] < start else len(units) - 1)
        elif n.layer is not None:
            where[n.name] = n.layer + 1
        else:
            where[n.name] = 0 if pos[n.name] < start else len(units) - 1
        units[where[n.name]].nodes.append(n.name)
    for u in (units[0], units[-1]):
        for name in u.nodes:
            n = g.node(name)
            if n.kind == "op" and n.params and n.module_path not in u.modules:
                u.modules.append(n.module_path)
    return units, where


def backward_transients(problem: Problem, choice: list[int],
                        modes: list[int]) -> tuple[float, float]:
    """(bytes at the start of backward: the logits' gradient; bytes the block being
    recomputed holds again, the largest over groups, one block at a time)."""
    redo = sum(n.strategies[i].total.recompute_bytes for n, i in zip(problem.nodes, choice))
    for grp, r in zip(problem.recompute, modes):
        redo = max(redo, sum(grp.transient[k][choice[v]][r] for k, v in enumerate(grp.nodes)))
    start = sum(n.multiplicity * n.strategies[i].total.backward_start_bytes
                for n, i in zip(problem.nodes, choice))
    return start, redo


def recompute_transient(problem: Problem, choice: list[int], modes: list[int]) -> float:
    """The transient bytes of backward without a pipeline (see
    :mod:`autopar.solvers.problem`): the larger of the two :func:`backward_transients`."""
    return max(backward_transients(problem, choice, modes))


def unit_costs(g: Graph, built: Built, choice: list[int], modes: list[int] | None = None,
               tied_sync: Callable[[float], float] | None = None) -> list[Unit]:
    """The units of ``g`` with their costs under ``choice`` (one strategy index per
    node of ``built.problem``) and recomputation ``modes`` (one per problem group;
    default none). ``tied_sync``: given for a pipeline, whose stages each hold their
    own copy of a parameter they share (:func:`add_tied_copies`); it maps a copy's
    gradient bytes to the seconds of summing the copies over the stages' ranks."""
    problem, names = built.problem, built.names
    memory = [[s.memory for s in ss] for ss in built.strategies]
    units, where = unit_of_nodes(g)
    index = {name: k for k, name in enumerate(names)}
    modes = modes or [0] * len(problem.recompute)
    in_group: dict[int, tuple] = {}
    for grp, r in zip(problem.recompute, modes):
        for pos, v in enumerate(grp.nodes):
            in_group[v] = (grp, pos, r)
    for n in g.nodes:
        k = index.get(g.canonical.get(n.name, n.name))
        if k is None:
            continue
        sc = problem.nodes[k].strategies[choice[k]]
        s = sc.total
        u = units[where[n.name]]
        u.forward_s += forward_share(sc)
        u.backward_s += backward_share(sc)
        u.backward_weight_s += s.device_bwd_s / 2  # weight grad: one of backward's 2 GEMMs
        u.step_comm_s += s.step_param_comm_s
        u.optimizer_s += s.optimizer_s
        u.comm_s += s.comm_s
        u.all_to_all_s += s.all_to_all_s
        u.param_comm_s += s.micro_param_comm_s
        u.host_s += s.all_host_s
        u.host_step_s += s.host_step_s
        mem = memory[k][choice[k]]
        u.activation_bytes += mem.get("activations", 0.0)
        u.static_bytes += sum(v for c, v in mem.items() if c != "activations")
        if k in in_group:
            grp, pos, r = in_group[k]
            u.activation_bytes += grp.act_delta[pos][choice[k]][r]
            u.backward_s += grp.extra_s[pos][choice[k]][r]
            u.recompute_s += grp.extra_s[pos][choice[k]][r]
            u.host_s += sum(grp.host(pos, choice[k], r))
    _add_edges(g, problem, names, choice, units, where, modes)
    if tied_sync is not None:
        add_tied_copies(g, built, choice, units, tied_sync)
    return units


def forward_share(s: StrategyCost) -> float:
    """The seconds one instance of strategy ``s`` adds to its unit's forward per
    micro-batch: its compute less the backward's, and half its collectives."""
    t = s.total
    return t.device_s - t.device_bwd_s + t.comm_s / 2


def backward_share(s: StrategyCost) -> float:
    """The seconds one instance of strategy ``s`` adds to its unit's backward per
    micro-batch: the backward's compute, half its collectives and its ZeRO-3 traffic."""
    t = s.total
    return t.device_bwd_s + t.comm_s / 2 + t.micro_param_comm_s


def unit_members(g: Graph) -> list[dict[str, int]]:
    """Per unit of ``g`` (:func:`unit_of_nodes`), how many of its graph nodes each
    canonical node stands for (a repeated block's nodes share their first instance's)."""
    units, where = unit_of_nodes(g)
    out: list[dict[str, int]] = [{} for _ in units]
    for n in g.nodes:
        name = g.canonical.get(n.name, n.name)
        row = out[where[n.name]]
        row[name] = row.get(name, 0) + 1
    return out


def least_unit_costs(built: Built, members: list[dict[str, int]]) -> list[PieceCost]:
    """Per unit (``members``: :func:`unit_members` of the graph ``built`` was built
    from), lower bounds on its forward and backward seconds per micro-batch (ZeRO-3
    traffic included) and its optimizer seconds per step under any choice of
    strategies: every node's least over its strategies, each cost on its own.
    Recomputation, the resharding on edges and the copies of tied parameters only add,
    so :func:`unit_costs` of every choice is at least this, unit by unit."""
    least = {}
    for name, node in zip(built.names, built.problem.nodes):
        ss = node.strategies
        least[name] = (min(map(forward_share, ss)), min(map(backward_share, ss)),
                       min(s.total.optimizer_s for s in ss))
    out = []
    for row in members:
        f = b = o = 0.0
        for name, count in row.items():
            x = least.get(name)
            if x is not None:
                f, b, o = f + count * x[0], b + count * x[1], o + count * x[2]
        out.append(PieceCost(forward_s=f, backward_s=b, optimizer_s=o))
    return out


@dataclass(frozen=True)
class TiedCopy:
    """A trainable parameter that units other than its own read (a tied output head
    reading the embedding's weight): ``owner`` is the problem node of the op that owns
    it (its first user), ``own`` every parameter that op owns with its input position,
    ``readers`` the units that would hold a copy."""

    param: str
    owner: int
    own: tuple[tuple[str, int], ...]
    readers: tuple[int, ...]


def tied_copies(g: Graph, built: Built) -> list[TiedCopy]:
    """Every tied parameter of ``g`` read outside its own unit (worked out once per
    graph and problem node order)."""
    key = ("tied_copies", tuple(built.names))
    found = g.memo.get(key)
    if found is None:
        found = g.memo[key] = _tied_copies(g, built)
    return list(found)


def _tied_copies(g: Graph, built: Built) -> list[TiedCopy]:
    """:func:`tied_copies`, worked out."""
    index = {name: k for k, name in enumerate(built.names)}
    _, where = unit_of_nodes(g)
    owner, consumers = param_users(g)
    out = []
    for p, uses in consumers.items():
        info = g.params.get(g.node(p).target)
        readers = sorted({where[o] for o, _ in uses} - {where[p]})
        if readers and (info is None or info.trainable):
            op = owner[p][0]
            own = tuple((i, pos) for i, (o, pos) in owner.items() if o == op)
            out.append(TiedCopy(p, index[g.canonical.get(op, op)], own, tuple(readers)))
    return out


def own_elements(g: Graph, built: Built, copy: TiedCopy, strategy: int) -> dict[str, float]:
    """Elements on one device of every parameter the tied parameter's owner op owns,
    under the owner's ``strategy`` (the tied parameter's share of them is the share
    of the op's parameter terms a copy repeats)."""
    sizes = built.settings.mesh.sizes
    ins = built.strategies[copy.owner][strategy].ins
    return {i: g.node(i).out.numel / shard_count(ins[pos], sizes) for i, pos in copy.own}


def copy_static_bytes(g: Graph, built: Built, copy: TiedCopy, strategy: int) -> float:
    """Bytes per device of one copy of the tied parameter under its owner's
    ``strategy``: its share of the owner's parameters, gradients, optimizer state and
    ZeRO-3 gathered parameters."""
    own = own_elements(g, built, copy, strategy)
    ns = built.strategies[copy.owner][strategy]
    static = sum(v for c, v in ns.memory.items() if c != "activations")
    return static * own[copy.param] / sum(own.values())


def add_tied_copies(g: Graph, built: Built, choice: list[int], units: list[Unit],
                    sync: Callable[[float], float]) -> None:
    """Charge every unit that reads a trainable parameter held by another unit a copy
    of it (:func:`tied_copies`), as a pipeline stage keeps one (the runtime unties
    shared parameters across stages and sums their gradients after the backward).

    The copy repeats the tied parameter's share of the owning op's parameter terms
    under the chosen strategy (:func:`own_elements`): static bytes
    (:func:`copy_static_bytes`, exact), per-micro-batch ZeRO-3 gathers and FSDP2
    copies, the dp gradient synchronization and the optimizer step (in proportion to
    elements). Its gradient sum over the stages' ranks, ``sync`` of the fp32 gradient
    shard, runs after the last backward and is added to the unit's ``optimizer_s``,
    the part of a step nothing hides. Exact when the owner and the reader are the
    first and the last unit (always on different stages); for units in between, which
    a split may put on one stage, the copy is an upper bound."""
    st = built.settings
    shard = replica_degree(st.mesh) if st.zero >= 1 else 1
    for copy in tied_copies(g, built):
        i = choice[copy.owner]
        s = built.problem.nodes[copy.owner].strategies[i]
        own = own_elements(g, built, copy, i)
        frac = own[copy.param] / sum(own.values())
        static = copy_static_bytes(g, built, copy, i)
        for r in copy.readers:
            u = units[r]
            u.static_bytes += static
            u.forward_s += (s.param_copy_s - s.param_copy_bwd_s) * frac
            u.backward_s += (s.param_copy_bwd_s + s.total.micro_param_comm_s) * frac
            u.param_comm_s += s.total.micro_param_comm_s * frac
            u.step_comm_s += s.total.step_param_comm_s * frac
            u.optimizer_s += s.total.optimizer_s * frac + sync(4.0 * own[copy.param] / shard)


def _add_edges(g: Graph, problem: Problem, names: list[str], choice: list[int],
               units: list[Unit], where: dict[str, int], modes: list[int]) -> None:
    """Charge each instance edge's resharding to its consumer's unit (half per pass),
    and the forward conversion that recomputation under ``modes`` runs again to its
    backward.

    ``problem.edges`` lists one edge per distinct (producer, consumer, input position)
    of canonical nodes, in the order of first occurrence in the graph
    (:func:`autopar.solvers.problem_build.build_problem`); the same walk finds them here."""
    index = {name: k for k, name in enumerate(names)}
    again = edge_rerun(problem, choice, modes)
    order: dict[tuple[int, int, int], int] = {}
    for n in g.nodes:
        if n.kind != "op":
            continue
        v = index[g.canonical.get(n.name, n.name)]
        for pos, i in enumerate(n.inputs):
            if g.node(i).kind == "param":
                continue
            u = index[g.canonical.get(i, i)]
            k = order.setdefault((u, v, pos), len(order))
            e = problem.edges[k]
            c = e.cost.get((choice[u], choice[v]), 0.0)
            units[where[n.name]].forward_s += c / 2
            units[where[n.name]].backward_s += c / 2
            units[where[n.name]].comm_s += c
            units[where[n.name]].backward_s += again.get(k, 0.0)
            units[where[n.name]].recompute_s += again.get(k, 0.0)
            units[where[n.name]].all_to_all_s += e.all_to_all.get((choice[u], choice[v]), 0.0)
