"""Score one pipelined candidate: intra-op ILP for the stage mesh, then the inter-op
split of the units into stages under the schedule.

The two levels are solved in turn, as in Alpa (Zheng et al., OSDI'22 §5) but with
one intra-op plan per distinct layer shared by every stage (the stages' submeshes
all have the shape dp × tp):

1. the intra-op ILP (:mod:`autopar.solvers.ilp`) picks every op's strategy on the
   dp × tp stage mesh. Its memory constraint is rewritten for a device that holds
   1/pp of the model and ``in_flight`` micro-batches of activations of that share:

       M_pp(s) = Σ_v m_v (static_v(s_v) / pp + activations_v(s_v) · in_flight / pp)

   where ``in_flight`` is what the first rank holds at the schedule's peak (min(m, p)
   for 1F1B-like schedules, m for GPipe); the recomputation groups' activation terms
   scale the same way (``activation_scale`` = in_flight / pp) and the one block being
   recomputed is added once;
2. the units' costs under that solution (:func:`autopar.solvers.units.unit_costs`)
   go to the stage split (:func:`autopar.solvers.interop.split_stages`), which places
   the units on pp · v stages, checks each rank's memory exactly for the schedule, and
   keeps the split with the least reported step time T below (simulated schedule plus
   exposed synchronization).

Backward transients per rank: every rank adds the block being recomputed (one at a
time); the rank of the last stage also holds, for the whole of that stage's backward,
the gradient of the loss w.r.t. the stage output (``torch.distributed.pipelining``
computes the loss outside the stage and passes that gradient into the stage's
backward) and keeps the stage output (the logits) of the micro-batch in its forward
cache, so there the two transients add up (measured: tests/test_memory_accuracy.py):

    extra_r = A_recompute + [r is the last stage's rank] · (T_loss + logits)

The stage DP checks its ranks against the budget less the largest ``extra_r``.

The step time adds the data-parallel gradient synchronization each rank cannot hide:
it runs after the rank's last backward and overlaps only with it (Megatron-LM's
overlapped gradient reduction), so the split weighs it with the schedule:

    T = T_schedule + max_r max(0, step_comm_r − overlap · backward_r)
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

from autopar.cost_models.comm import collective_time, group_link
from autopar.errors import NoFeasiblePlanError
from autopar.graph import Graph
from autopar.sharding import Mesh
from autopar.solvers.ilp import ENUMERATE_MODES, Solution, fold_modes, solve_ilp
from autopar.solvers.interop import StageSplit, UnitCost, split_stages
from autopar.solvers.problem import NodeChoice, Problem, least_memory
from autopar.solvers.schedules import stage_ranks
from autopar.solvers.units import Unit, backward_transients, unit_costs
from autopar.strategies.build import Built


@dataclass
class PipelineOutcome:
    """A solved pipelined candidate."""

    solution: Solution
    units: list[Unit]
    split: StageSplit
    step_time_s: float
    memory_bytes: float
    p2p_s: float
    exposed_step_comm_s: float
    transient_bytes: float = 0.0
    rank_extra_bytes: list[float] | None = None


def in_flight(schedule: str, pp: int, num_microbatches: int) -> int:
    """Micro-batches of activations the first rank holds at its peak (in units of one
    stage's share): all m for GPipe, min(m, pp) for the 1F1B family."""
    return num_microbatches if schedule == "gpipe" else min(num_microbatches, pp)


def pipeline_problem(built: Built, pp: int, held: int) -> Problem:
    """A copy of ``built.problem`` whose memory is that of one pipeline rank (see the
    module docstring)."""
    nodes = []
    for node, details in zip(built.problem.nodes, built.strategies):
        costs = []
        for sc, ns in zip(node.strategies, details):
            act = ns.memory.get("activations", 0.0)
            static = sc.memory_bytes - act
            costs.append(replace(sc, memory_bytes=(static + act * held) / pp))
        nodes.append(NodeChoice(node.name, costs, node.multiplicity, node.gather_multiplicity))
    groups = [replace(grp, activation_scale=held / pp) for grp in built.problem.recompute]
    return replace(built.problem, nodes=nodes, recompute=groups)


def boundary_bytes(g: Graph, built: Built, choice: list[int]) -> float:
    """Bytes per device of the activation handed from one block to the next for one
    micro-batch: the first block's output at the micro-batch size, divided by the
    split its chosen placement gives it."""
    if not g.layers:
        return 0.0
    layer_nodes = set(g.layers[0].nodes)
    last = next(n for n in reversed(g.nodes) if n.name in layer_nodes and n.kind == "op")
    out = last.out
    if out is None:
        return 0.0
    st = built.settings
    dp = st.mesh.sizes[st.mesh.names.index("dp")] if "dp" in st.mesh.names else 1
    factor = st.microbatch_size * dp / g.batch_size
    elt = 2.0 if st.precision in ("bf16", "fp16") else 4.0
    k = built.names.index(g.canonical.get(last.name, last.name))
    split = 1
    for p, size in zip(built.strategies[k][choice[k]].out, st.mesh.sizes):
        split *= size if p.startswith("S(") else 1
    return out.numel * factor * elt / split


def loss_input_bytes(g: Graph, built: Built, choice: list[int]) -> float:
    """Bytes per device of the loss's input for one micro-batch under its chosen
    placement (the logits the last stage hands to the loss)."""
    if g.loss is None or g.loss not in built.names:
        return 0.0
    k = built.names.index(g.loss)
    ins = built.strategies[k][choice[k]].ins
    node = g.node(g.loss)
    if not ins or not node.inputs or g.node(node.inputs[0]).out is None:
        return 0.0
    src = g.node(node.inputs[0])
    st = built.settings
    dp = st.mesh.sizes[st.mesh.names.index("dp")] if "dp" in st.mesh.names else 1
    elt = 4.0 if st.precision == "fp32" or src.out.dtype == "float32" else 2.0
    split = 1
    for p, size in zip(ins[0], st.mesh.sizes):
        split *= size if p.startswith("S(") else 1
    return src.out.numel * st.microbatch_size * dp / g.batch_size * elt / split


def _solve(problem: Problem, bound: float) -> Solution | NoFeasiblePlanError | None:
    """The ILP's solution, the error saying it does not fit (checked first with the
    cheap bound: every node's smallest memory), or None when no solution's objective
    can be below ``bound``."""
    least = least_memory(problem)
    if least > problem.memory_budget:
        return NoFeasiblePlanError(f"one pipeline rank needs at least {least / 1e9:.2f} GB "
                                   f"of the {problem.memory_budget / 1e9:.2f} GB budget")
    try:
        return solve_ilp(problem, bound=bound)
    except NoFeasiblePlanError as e:
        return e


def solve_pipeline(g: Graph, built: Built, *, pp: int, schedule: str, virtual_stages: int,
                   overlap: float = 1.0,
                   solved: dict[tuple, tuple[Solution, list[Unit]] | NoFeasiblePlanError] | None = None,
                   bound: float = float("inf")) -> PipelineOutcome | None:
    """Solve one pipelined candidate (see the module docstring); raises
    NoFeasiblePlanError when no split fits. ``solved`` caches intra-op solutions
    by (problem, pp, in-flight micro-batches), which schedules share. Returns None
    when even a bubble-free pipeline of this solution would take ``bound`` or more."""
    st = built.settings
    m = st.num_microbatches
    held = in_flight(schedule, pp, m)
    solved = {} if solved is None else solved
    key = (id(built), pp, held)
    if key not in solved:
        # the pipeline's step time is at least the ILP's objective spread over pp ranks
        found = _solve(pipeline_problem(built, pp, held), bound * pp)
        if found is None or isinstance(found, NoFeasiblePlanError):
            solved[key] = found
        else:
            memory = [[s.memory for s in ss] for ss in built.strategies]
            solved[key] = (found, unit_costs(g, built.problem, built.names, memory,
                                             found.choice, found.modes))
    entry = solved[key]
    if entry is None:
        return None
    if isinstance(entry, NoFeasiblePlanError):
        raise entry
    sol, units = entry
    return _outcome(g, built, sol, units, pp=pp, schedule=schedule,
                    virtual_stages=virtual_stages, overlap=overlap, bound=bound)


def refine_modes(g: Graph, built: Built, po: PipelineOutcome, *, pp: int, schedule: str,
                 virtual_stages: int, overlap: float = 1.0) -> PipelineOutcome:
    """The winning candidate's recomputation modes chosen jointly with its stage split.

    The intra-op ILP picks the modes under its memory model of one pipeline rank;
    only the stage split knows each rank's exact memory and the schedule's time. So
    for the winner (only: it costs one ILP per combination of modes) every other
    feasible combination is solved with its modes fixed and split into stages, and
    the fastest whole pipeline is kept."""
    st = built.settings
    problem = pipeline_problem(built, pp, in_flight(schedule, pp, st.num_microbatches))
    combos = list(itertools.product(*(grp.allowed for grp in problem.recompute)))
    if len(combos) < 2 or len(combos) > ENUMERATE_MODES:
        return po
    memory = [[s.memory for s in ss] for ss in built.strategies]
    best = po
    for modes in combos:
        if list(modes) == list(po.solution.modes or []):
            continue
        try:
            sol = solve_ilp(fold_modes(problem, list(modes)))
        except NoFeasiblePlanError:
            continue
        sol.modes = list(modes)
        units = unit_costs(g, built.problem, built.names, memory, sol.choice, sol.modes)
        try:
            out = _outcome(g, built, sol, units, pp=pp, schedule=schedule,
                           virtual_stages=virtual_stages, overlap=overlap,
                           bound=best.step_time_s)
        except NoFeasiblePlanError:
            continue
        if out is not None and out.step_time_s < best.step_time_s * (1 - 1e-9):
            best = out
    return best


def _outcome(g: Graph, built: Built, sol: Solution, units: list[Unit], *, pp: int,
             schedule: str, virtual_stages: int, overlap: float,
             bound: float) -> PipelineOutcome | None:
    """Split the units of one intra-op solution into stages and price the pipeline
    (None when even a bubble-free pipeline would take ``bound`` or more; a split that
    cannot beat ``bound`` is returned as the best the split search saw)."""
    st = built.settings
    m = st.num_microbatches
    if m * sum(u.forward_s + u.backward_s for u in units) / pp >= bound:
        return None
    full = Mesh(("pp",) + st.mesh.names, (pp,) + st.mesh.sizes)
    link = group_link(full.sizes, 0, st.gpus_per_node, st.hw)
    p2p = collective_time("send_recv", boundary_bytes(g, built, sol.choice), 2, link)
    costs = [UnitCost(u.name, u.forward_s, u.backward_s, u.backward_weight_s,
                      u.activation_bytes, u.static_bytes, u.step_comm_s) for u in units]
    start, redo = backward_transients(built.problem, sol.choice, sol.modes)
    last = stage_ranks(schedule, pp, virtual_stages)[-1]
    extra = [redo + (start + loss_input_bytes(g, built, sol.choice) if r == last else 0.0)
             for r in range(pp)]
    split = split_stages(costs, pp, m, schedule=schedule, virtual_stages=virtual_stages,
                         p2p_s=p2p, memory_budget=st.memory_budget - max(extra),
                         overlap=overlap, bound=bound, explain=False)
    ranks = [r + e for r, e in zip(split.estimate.peak_memory_bytes, extra)]
    return PipelineOutcome(sol, units, split, split.objective_s, max(ranks), p2p,
                           split.exposed_s, max(extra), extra)
