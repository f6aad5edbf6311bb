"""The intra-op placement problem, as plain numbers, and its objective.

A :class:`Problem` is what every intra-op solver (the ILP, the exhaustive reference,
or a researcher's heuristic) reads: one decision per canonical op node — which of
its strategies to use — with the costs of each choice and of each pair of choices
on connected nodes. It carries no torch objects. :func:`evaluate` scores an
assignment exactly as the ILP does, :func:`host_exposure` gives the exposed host time
and :func:`least_memory` a lower bound on the memory.

The formulas are written out in docs/solvers.md, section ``autopar.solvers.problem``:
the objective T(s) in seconds per step with its exposed parameter traffic E(s) (*)
and exposed host time H(s) (**), the memory per device M(s), and what each
recomputation mode of a :class:`RecomputeGroup` adds to both.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from autopar.solvers.cost_record import StrategyCost
from autopar.solvers.cost_terms import StepTerms


@dataclass
class NodeChoice:
    """One decision: a canonical node and its candidate strategies."""

    name: str
    strategies: list[StrategyCost]
    multiplicity: int = 1
    gather_multiplicity: int = 0


@dataclass
class EdgeChoice:
    """A producer -> consumer edge; ``cost[(i, j)]`` is the resharding time (seconds
    per micro-batch, forward + backward) when the producer uses strategy i and the
    consumer strategy j. Pairs missing from ``cost`` are not allowed together."""

    u: int
    v: int
    cost: dict[tuple[int, int], float]
    multiplicity: int = 1
    all_to_all: dict[tuple[int, int], float] = field(default_factory=dict)
    """The part of ``cost`` that moves tokens to their experts (pairs without one
    left out)."""
    recompute: dict[tuple[int, int], float] = field(default_factory=dict)
    """Seconds per micro-batch (and instance) of the pair's forward conversion that a
    recomputation mode folded in (:func:`~autopar.solvers.intra_op_ilp.fold_modes`)
    re-runs in backward: beside ``cost``, counted as a group's ``extra_s`` is."""


@dataclass
class Tie:
    """Nodes ``a`` and ``b`` must pick strategies of the same group: for every k,
    strategy of a in groups_a[k] <=> strategy of b in groups_b[k] (e.g. two ops reading
    one tied parameter must agree on its placement)."""

    a: int
    b: int
    groups_a: list[list[int]]
    groups_b: list[list[int]]


@dataclass
class RecomputeGroup:
    """One recomputation decision shared by the canonical nodes ``nodes`` of a layer.

    ``extra_s[k][i][r]`` / ``act_delta[k][i][r]`` / ``transient[k][i][r]``: for the k-th
    node of ``nodes`` using its strategy i under mode ``modes[r]`` (see
    docs/solvers.md); ``host_fwd_s`` / ``host_bwd_s`` likewise, the host seconds (**).
    ``allowed`` lists the mode indices the solver may pick. ``edges`` are the indices
    (into :attr:`Problem.edges`) of the edges whose forward conversion the layer's
    recomputation runs again, and ``edge_extra_s[j][(i, k)][r]`` those seconds for the
    j-th of them with the pair (i, k) under mode ``modes[r]`` (per micro-batch and
    instance), counted as ``extra_s`` is."""

    name: str
    nodes: list[int]
    extra_s: list[list[list[float]]]
    act_delta: list[list[list[float]]]
    transient: list[list[list[float]]]
    modes: tuple[str, ...] = ("none", "selective", "full")
    allowed: tuple[int, ...] = (0, 1, 2)
    activation_scale: float = 1.0
    host_fwd_s: list[list[list[float]]] = field(default_factory=list)
    host_bwd_s: list[list[list[float]]] = field(default_factory=list)
    edges: list[int] = field(default_factory=list)
    edge_extra_s: list[dict[tuple[int, int], list[float]]] = field(default_factory=list)

    def host(self, k: int, i: int, r: int) -> tuple[float, float]:
        """(forward, backward) host seconds per micro-batch and instance the mode adds
        to node k with strategy i (``host_fwd_s`` / ``host_bwd_s``; none when empty)."""
        if not self.host_fwd_s:
            return 0.0, 0.0
        return self.host_fwd_s[k][i][r], self.host_bwd_s[k][i][r]

    def memory(self, k: int, i: int, r: int, multiplicity: int) -> float:
        """Bytes node ``nodes[k]`` with strategy i adds to C under mode r (all instances)."""
        return self.activation_scale * multiplicity * self.act_delta[k][i][r]


@dataclass
class Problem:
    """An intra-op placement problem (see docs/solvers.md for the objective)."""

    nodes: list[NodeChoice]
    edges: list[EdgeChoice]
    ties: list[Tie] = field(default_factory=list)
    num_microbatches: int = 1
    memory_budget: float = float("inf")
    fixed_memory: float = 0.0
    overlap: float = 1.0
    recompute: list[RecomputeGroup] = field(default_factory=list)
    host_phases: bool = True

    @property
    def num_choices(self) -> int:
        """Number of (node, strategy) pairs."""
        return sum(len(n.strategies) for n in self.nodes)


@dataclass
class Evaluation:
    """The objective and its parts for one assignment (seconds, bytes).

    ``compute_s`` includes ``recompute_s`` (n · Σ m_v · extra_s, the recomputed
    forwards, and n · Σ m_e · the edges' conversions run again); ``comm_s`` includes ``reshard_s``; ``optimizer_s`` is Σ m_v optimizer_v;
    ``exposed_host_s`` is H(s) of (**), ``host_s`` the step's host seconds.
    step_time_s = compute_s + comm_s + exposed_param_comm_s + optimizer_s
    + exposed_host_s."""

    step_time_s: float
    compute_s: float
    comm_s: float
    reshard_s: float
    exposed_param_comm_s: float
    param_comm_s: float
    memory_bytes: float
    feasible: bool
    recompute_s: float = 0.0
    optimizer_s: float = 0.0
    exposed_host_s: float = 0.0
    host_s: float = 0.0
    all_to_all_s: float = 0.0

    @property
    def terms(self) -> StepTerms:
        """The step time by term: no bubble; the exposed communication is the
        activation collectives and resharding and the parameter traffic not hidden."""
        return StepTerms(compute_s=self.compute_s - self.recompute_s,
                         recompute_s=self.recompute_s,
                         exposed_comm_s=self.comm_s + self.exposed_param_comm_s, bubble_s=0.0,
                         optimizer_s=self.optimizer_s, exposed_host_s=self.exposed_host_s,
                         comm_s=self.comm_s, exposed_param_comm_s=self.exposed_param_comm_s,
                         reshard_s=self.reshard_s, param_comm_s=self.param_comm_s,
                         host_s=self.host_s, all_to_all_s=self.all_to_all_s or None)


def edge_rerun(p: Problem, choice: list[int], modes: list[int]) -> dict[int, float]:
    """Edge index -> the seconds per micro-batch and instance that recomputation under
    ``modes`` re-runs of its forward conversion with ``choice``: the groups'
    ``edge_extra_s`` and what :func:`~autopar.solvers.intra_op_ilp.fold_modes` folded
    into the edges (edges with none left out)."""
    out: dict[int, float] = {}
    for grp, r in zip(p.recompute, modes):
        for k, table in zip(grp.edges, grp.edge_extra_s):
            e = p.edges[k]
            row = table.get((choice[e.u], choice[e.v]))
            if row and row[r]:
                out[k] = out.get(k, 0.0) + row[r]
    for k, e in enumerate(p.edges):
        t = e.recompute.get((choice[e.u], choice[e.v]), 0.0) if e.recompute else 0.0
        if t:
            out[k] = out.get(k, 0.0) + t
    return out


def edge_recompute_s(p: Problem, choice: list[int], modes: list[int],
                     only: set[int] | None = None) -> float:
    """Σ_e m_e · :func:`edge_rerun` (seconds per micro-batch); ``only``: over the edges
    that touch these nodes."""
    return sum(p.edges[k].multiplicity * t for k, t in edge_rerun(p, choice, modes).items()
               if only is None or p.edges[k].u in only or p.edges[k].v in only)


def host_exposure(n: int, d_fwd: float, d_bwd: float, h_fwd: float, h_bwd: float,
                  h_step: float, total: float, phases: bool = True) -> float:
    """H(s) of (**) in docs/solvers.md: the seconds the host adds to a step of
    ``total`` device seconds, from the per-micro-batch forward and backward device and
    host seconds and the optimizer's host seconds (``phases`` False: the whole-step
    term alone)."""
    whole = max(0.0, n * (h_fwd + h_bwd) + h_step - total)
    if not phases:
        return whole
    delta = h_fwd + h_bwd - d_fwd - d_bwd
    first = h_fwd - d_fwd
    return max(whole, first, n * delta, (n - 1) * delta + first)


def evaluate(p: Problem, choice: list[int], modes: list[int] | None = None) -> Evaluation:
    """Score an assignment of one strategy index per node (and one recomputation mode
    index per group of ``p.recompute``; default: mode 0, "none"), exactly as the ILP does."""
    n = p.num_microbatches
    comp = bwd = comm = micro_pc = step_pc = mem = host = start = redo = extra = a2a = 0.0
    h_fwd = h_bwd = h_step = 0.0
    modes = list(modes) if modes is not None else [0] * len(p.recompute)
    feasible = True
    for grp, r in zip(p.recompute, modes):
        feasible &= r in grp.allowed
        for k, v in enumerate(grp.nodes):
            i, m = choice[v], p.nodes[v].multiplicity
            extra += m * grp.extra_s[k][i][r]
            comp += m * grp.extra_s[k][i][r]
            bwd += m * grp.extra_s[k][i][r]
            mem += grp.memory(k, i, r, m)
            redo += grp.transient[k][i][r]
            hf, hb = grp.host(k, i, r)
            h_fwd, h_bwd = h_fwd + m * hf, h_bwd + m * hb
    for node, i in zip(p.nodes, choice):
        s = node.strategies[i].total
        m = node.multiplicity
        comp += m * s.device_s
        bwd += m * s.device_bwd_s
        comm += m * s.comm_s
        micro_pc += m * s.micro_param_comm_s
        step_pc += m * s.step_param_comm_s
        host += m * s.optimizer_s
        h_fwd += m * (s.all_host_s - s.all_host_bwd_s)
        h_bwd += m * s.all_host_bwd_s
        h_step += m * s.host_step_s
        start += m * s.backward_start_bytes
        a2a += m * s.all_to_all_s
        redo += s.recompute_bytes
        mem += m * s.memory_bytes + node.gather_multiplicity * s.gather_bytes
    again = edge_recompute_s(p, choice, modes)
    extra, comp, bwd = extra + again, comp + again, bwd + again
    reshard = 0.0
    for e in p.edges:
        c = e.cost.get((choice[e.u], choice[e.v]))
        if c is None:
            feasible = False
            continue
        reshard += e.multiplicity * c
        a2a += e.multiplicity * e.all_to_all.get((choice[e.u], choice[e.v]), 0.0)
    for t in p.ties:
        ga = next(k for k, g in enumerate(t.groups_a) if choice[t.a] in g)
        gb = next(k for k, g in enumerate(t.groups_b) if choice[t.b] in g)
        feasible &= ga == gb
    mem += p.fixed_memory + max(start, redo)
    feasible &= mem <= p.memory_budget * (1 + 1e-9)
    e_step = max(0.0, step_pc - p.overlap * bwd)
    e_micro = max(0.0, micro_pc - p.overlap * comp)
    exposed = e_step + n * e_micro
    total = n * (comp + comm + reshard) + exposed + host
    hidden = 0.0
    if h_fwd or h_bwd or h_step:
        half = (comm + reshard) / 2
        hidden = host_exposure(n, comp - bwd + half, bwd + half, h_fwd, h_bwd, h_step, total,
                               p.host_phases)
    return Evaluation(total + hidden, n * comp, n * (comm + reshard), n * reshard, exposed,
                      step_pc + n * micro_pc, mem, feasible, n * extra, host, hidden,
                      n * (h_fwd + h_bwd) + h_step, n * a2a)


def least_memory(p: Problem) -> float:
    """A lower bound on M over every assignment and recomputation mode: each node's
    smallest C share on its own (with the most saving mode of its group for it) plus
    its backward-start bytes, or plus its recompute bytes, whichever sum is larger."""
    saving: dict[int, tuple[RecomputeGroup, int]] = {}
    for grp in p.recompute:
        for k, v in enumerate(grp.nodes):
            saving[v] = (grp, k)
    with_start = with_redo = p.fixed_memory
    for v, n in enumerate(p.nodes):
        a = b = float("inf")
        for i, s in enumerate(c.total for c in n.strategies):
            m = n.multiplicity * s.memory_bytes + n.gather_multiplicity * s.gather_bytes
            redo = s.recompute_bytes
            if v in saving:
                grp, k = saving[v]
                m += min(grp.memory(k, i, r, n.multiplicity) for r in grp.allowed)
                redo += min(grp.transient[k][i][r] for r in grp.allowed)
            a = min(a, m + n.multiplicity * s.backward_start_bytes)
            b = min(b, m + redo)
        with_start += a
        with_redo += b
    return max(with_start, with_redo)
