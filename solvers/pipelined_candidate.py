"""Score one pipelined candidate: intra-op ILP for the stage mesh, then the inter-op
split of the units into stages under the schedule.

:func:`solve_pipeline` solves the two levels in turn, as in Alpa (Zheng et al.,
OSDI'22 §5) but with one intra-op plan per distinct layer shared by every stage: the
ILP on the dp × tp stage mesh, under the memory of one pipeline rank
(:func:`pipeline_problem`), then the stage split of the units' costs. For the winning
candidate, :func:`refine_modes` settles by enumeration what the flat ILP cannot see:
the recomputation modes, the memory model and the placement of the block output
that crosses stages.

The rank memory model M_pp, its relaxed in-flight count k_min, the backward
transients ``extra_r`` (:func:`rank_transients`) and the reported step time T are
written out in docs/solvers.md, section ``autopar.solvers.pipelined_candidate``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, replace

from autopar.cost_models.comm import collective_time, group_link
from autopar.cost_models.hardware import LinkSpec
from autopar.cost_models.memory import activation_bytes_per_element
from autopar.errors import NoFeasiblePlanError
from autopar.graph import Graph
from autopar.sharding import Mesh, data_parallel_degree, replica_degree, shard_count
from autopar.units_text import fmt_bytes
from autopar.solvers.cost_terms import PieceCost, StepTerms
from autopar.solvers.intra_op_ilp import Solution, fold_modes
from autopar.solvers.intra_op_solve import ENUMERATE_MODES, solve_ilp
from autopar.solvers.problem import NodeChoice, Problem, least_memory
from autopar.solvers.problem_build import Built
from autopar.solvers.schedule_sim import simulate, stage_ranks
from autopar.solvers.stage_split import StageSplit, split_stages
from autopar.solvers.stage_split_problem import stage_in_flight
from autopar.solvers.units import (Unit, backward_transients, copy_static_bytes, tied_copies,
                                    unit_costs)


@dataclass
class PipelineOutcome:
    """A solved pipelined candidate. ``exposed_step_comm_s`` is the step's part after
    the slowest rank's last backward: its unhidden gradient synchronization, then its
    optimizer step (:func:`autopar.solvers.stage_split.after_backward`).
    ``exposed_host_s``: what the busiest rank's host time adds to the schedule's
    (:attr:`~autopar.solvers.stage_split.StageSplit.host_s`)."""

    solution: Solution
    units: list[Unit]
    split: StageSplit
    step_time_s: float
    memory_bytes: float
    p2p_s: float
    exposed_step_comm_s: float
    transient_bytes: float = 0.0
    rank_extra_bytes: list[float] | None = None
    exposed_host_s: float = 0.0


def rank_host_time(units: list[Unit], bounds: list[tuple[int, int]], ranks: list[int],
                   pp: int, num_microbatches: int) -> float:
    """The busiest pipeline rank's host seconds per step (GPU profiles: each rank's host
    issues its own stages' ops, n micro-batches of them, and its optimizer step). The
    step takes at least this long; the schedule's device time is the other bound. The
    search reads it from the split (``StageSplit.host_s``); this sum over the units is
    the brute-force reference's (:mod:`autopar.solvers.exhaustive`)."""
    host = [0.0] * pp
    for (a, b), r in zip(bounds, ranks):
        host[r] += sum(u.host_per_step(num_microbatches) for u in units[a:b])
    return max(host)


def in_flight(schedule: str, pp: int, num_microbatches: int) -> int:
    """Micro-batches of activations the first rank holds at its peak (in units of one
    stage's share): all m for GPipe, min(m, pp) for the 1F1B family."""
    return num_microbatches if schedule == "gpipe" else min(num_microbatches, pp)


def least_in_flight(schedule: str, pp: int, num_microbatches: int, virtual_stages: int) -> int:
    """k_min: the fewest micro-batches of activations any stage holds at its peak (the
    relaxed memory model of docs/solvers.md)."""
    return min(stage_in_flight(schedule, pp, num_microbatches, virtual_stages))


def pipeline_problem(g: Graph, built: Built, pp: int, held: int) -> Problem:
    """A copy of ``built.problem`` whose memory is that of one pipeline rank (see
    docs/solvers.md), the copies of tied parameters the stages hold included (on the
    owner op: Σ_r M_r counts each copy once). Its host seconds bound the step by their
    total alone (``host_phases`` False): the problem spans every stage, and each rank's
    host issues only its own, so pp steps take at least the total."""
    copies: dict[tuple[int, int], float] = {}
    for copy in tied_copies(g, built):
        mult = built.problem.nodes[copy.owner].multiplicity
        for i in range(len(built.strategies[copy.owner])):
            extra = len(copy.readers) * copy_static_bytes(g, built, copy, i) / mult
            copies[copy.owner, i] = copies.get((copy.owner, i), 0.0) + extra
    nodes = []
    for k, (node, details) in enumerate(zip(built.problem.nodes, built.strategies)):
        costs = []
        for i, (sc, ns) in enumerate(zip(node.strategies, details)):
            act = ns.memory.get("activations", 0.0)
            static = sc.total.memory_bytes - act + copies.get((k, i), 0.0)
            costs.append(replace(sc, memory_bytes=(static + act * held) / pp))
        nodes.append(NodeChoice(node.name, costs, node.multiplicity, node.gather_multiplicity))
    groups = [replace(grp, activation_scale=held / pp) for grp in built.problem.recompute]
    return replace(built.problem, nodes=nodes, recompute=groups, host_phases=False)




def _per_device(g: Graph, built: Built, numel: int, elt: float) -> float:
    """Bytes of a whole tensor of ``numel`` elements (at the captured batch) at the
    micro-batch size on one dp rank (a cp-th of it under context parallelism: the
    tensors between blocks are split along the sequence)."""
    st = built.settings
    dp = data_parallel_degree(st.mesh)
    cp = replica_degree(st.mesh) // dp
    return numel * st.microbatch_size * dp / g.batch_size * elt / cp


def boundary_node(g: Graph, built: Built) -> tuple[int, float] | None:
    """The problem node whose output is handed from one block to the next (the first
    block's last op, standing for every block), and that output's bytes for one
    micro-batch before its placement splits it; None without repeated blocks."""
    if not g.layers:
        return None
    layer_nodes = set(g.layers[0].nodes)
    last = next(n for n in reversed(g.nodes) if n.name in layer_nodes and n.kind == "op")
    if last.out is None:
        return None
    elt = float(activation_bytes_per_element(built.settings.precision))
    return (built.names.index(g.canonical.get(last.name, last.name)),
            _per_device(g, built, last.out.numel, elt))


def boundary_bytes(g: Graph, built: Built, choice: list[int]) -> float:
    """Bytes per device of the activation handed from one block to the next for one
    micro-batch: the first block's output at the micro-batch size, divided by the
    split its chosen placement gives it."""
    found = boundary_node(g, built)
    if found is None:
        return 0.0
    k, whole = found
    return whole / shard_count(built.strategies[k][choice[k]].out, built.settings.mesh.sizes)


def boundary_classes(g: Graph, built: Built) -> tuple[int, list[list[int]]]:
    """The boundary node (:func:`boundary_node`; −1: none) and its strategies grouped by
    the bytes they hand to the next stage, fewest bytes first."""
    found = boundary_node(g, built)
    if found is None:
        return -1, []
    k = found[0]
    by_shards: dict[int, list[int]] = {}
    for i, ns in enumerate(built.strategies[k]):
        by_shards.setdefault(shard_count(ns.out, built.settings.mesh.sizes), []).append(i)
    return k, [by_shards[n] for n in sorted(by_shards, reverse=True)]


def restrict_node(problem: Problem, k: int, allowed: list[int]) -> Problem:
    """``problem`` with node k limited to the strategies ``allowed``: every edge at k
    keeps only the pairs that use one of them (a strategy with no allowed partner on an
    edge is forbidden, see :class:`~autopar.solvers.problem.EdgeChoice`)."""
    keep = set(allowed)
    edges = [e if k not in (e.u, e.v) else replace(e, cost={
        ij: c for ij, c in e.cost.items()
        if (e.u != k or ij[0] in keep) and (e.v != k or ij[1] in keep)}) for e in problem.edges]
    return replace(problem, edges=edges)


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
    elt = 4.0 if st.precision == "fp32" or src.out.dtype == "float32" else 2.0
    return _per_device(g, built, src.out.numel, elt) / shard_count(ins[0], st.mesh.sizes)


def _solve(problem: Problem, bound: float) -> Solution | NoFeasiblePlanError | None:
    """The ILP's solution, the error saying it does not fit (checked first with the
    cheap bound: every node's smallest memory), or None when no solution's objective
    can be below ``bound``."""
    least = least_memory(problem)
    if least > problem.memory_budget:
        return NoFeasiblePlanError(f"one pipeline rank needs at least {fmt_bytes(least)} "
                                   f"of the {fmt_bytes(problem.memory_budget)} budget")
    try:
        return solve_ilp(problem, bound=bound)
    except NoFeasiblePlanError as e:
        return e


class RefineLater(Exception):
    """:func:`solve_pipeline` with ``refine=False``: no stage split fits the ILP's
    answer, and finding one means searching the modes (:func:`refine_modes`, many
    ILPs)."""


def solve_pipeline(g: Graph, built: Built, *, pp: int, schedule: str, virtual_stages: int,
                   solved: dict[tuple, tuple[Solution, list[Unit]] | NoFeasiblePlanError] | None = None,
                   bound: float = float("inf"), refine: bool = True) -> PipelineOutcome | None:
    """Solve one pipelined candidate (see docs/solvers.md); raises
    NoFeasiblePlanError when no split fits. ``solved`` caches intra-op solutions
    by (problem, pp, in-flight micro-batches), which schedules share. When no assignment
    fits the first rank's in-flight count, the relaxed count decides. Returns None when
    even a bubble-free pipeline of this solution would take ``bound`` or more. Without
    ``refine``, raises :class:`RefineLater` where the modes would be searched, so the
    caller can do it once a better incumbent may prune it."""
    m = built.settings.num_microbatches
    solved = {} if solved is None else solved
    held = in_flight(schedule, pp, m)
    entry = _intra_op(g, built, pp, held, solved, bound)
    if isinstance(entry, NoFeasiblePlanError):
        relaxed = least_in_flight(schedule, pp, m, virtual_stages)
        if relaxed < held:
            entry = _intra_op(g, built, pp, relaxed, solved, bound)
    if entry is None:
        return None
    if isinstance(entry, NoFeasiblePlanError):
        raise entry
    sol, units = entry
    try:
        return _outcome(g, built, sol, units, pp=pp, schedule=schedule,
                        virtual_stages=virtual_stages, bound=bound)
    except NoFeasiblePlanError:  # the ILP's rank model fits, no split does: search the modes
        if not refine:
            raise RefineLater("no stage split fits the ILP's answer") from None
        return refine_modes(g, built, None, pp=pp, schedule=schedule,
                            virtual_stages=virtual_stages, bound=bound)


def _intra_op(g: Graph, built: Built, pp: int, held: int, solved: dict,
              bound: float) -> tuple[Solution, list[Unit]] | NoFeasiblePlanError | None:
    """The ILP's solution and its units for ``held`` micro-batches in flight, cached in
    ``solved`` (the error when nothing fits, None when it cannot beat ``bound``)."""
    key = (id(built), pp, held)
    if key not in solved:
        # the pipeline's step time is at least the ILP's objective spread over pp ranks
        found = _solve(pipeline_problem(g, built, pp, held), bound * pp)
        if found is None or isinstance(found, NoFeasiblePlanError):
            solved[key] = found
        else:
            solved[key] = (found, _units(g, built, found, pp))
    return solved[key]


def _units(g: Graph, built: Built, sol: Solution, pp: int) -> list[Unit]:
    """The pipeline units' costs under an intra-op solution, pipelined over ``pp``
    ranks (each stage with its copy of a tied parameter)."""
    return unit_costs(g, built, sol.choice, sol.modes, tied_sync(built, pp))


def pp_link(built: Built, pp: int) -> LinkSpec:
    """The link between adjacent pipeline ranks of ``built``'s stage mesh (the outermost
    axis of the pp × dp × tp mesh)."""
    st = built.settings
    full = Mesh(("pp",) + st.mesh.names, (pp,) + st.mesh.sizes)
    return group_link(full.sizes, 0, st.gpus_per_node, st.hw)


def boundary_p2p(g: Graph, built: Built, choice: list[int], pp: int) -> float:
    """Seconds of one stage-to-stage transfer of the block output under ``choice``
    (:func:`boundary_bytes` over the pp link)."""
    return collective_time("send_recv", boundary_bytes(g, built, choice), 2, pp_link(built, pp))


def rank_transients(g: Graph, built: Built, choice: list[int], modes: list[int], *, pp: int,
                    schedule: str, virtual_stages: int) -> list[float]:
    """``extra_r`` of docs/solvers.md per rank: the block being recomputed, and on
    the last stage's rank the loss gradient and the logits as well."""
    start, redo = backward_transients(built.problem, choice, modes)
    last = stage_ranks(schedule, pp, virtual_stages)[-1]
    loss = loss_input_bytes(g, built, choice)
    return [redo + (start + loss if r == last else 0.0) for r in range(pp)]


def tied_sync(built: Built, pp: int) -> Callable[[float], float]:
    """Seconds to sum a tied parameter's gradient copies of ``nbytes`` over the pipeline
    ranks holding them: one all-reduce of two ranks over the pp link (the owner's stage
    and the reader's; under zbv they share a rank and this overcharges it)."""
    link = pp_link(built, pp)
    return lambda nbytes: collective_time("all_reduce", nbytes, 2, link)


def refine_modes(g: Graph, built: Built, po: PipelineOutcome | None, *, pp: int, schedule: str,
                 virtual_stages: int, bound: float = float("inf")) -> PipelineOutcome | None:
    """The winning candidate's recomputation modes, memory model and block-boundary
    placement chosen jointly with its stage split.

    The intra-op ILP picks the modes under its memory model of one pipeline rank and
    minimises the flat step time; only the stage split knows each rank's exact memory,
    the schedule's time and the stage-to-stage transfer. So for the winner (only: it
    costs one ILP per combination) every combination of

    * a memory model: the relaxed in-flight count ``k_min``, then the first rank's;
    * a class of the boundary node's strategies that hand over the same bytes
      (:func:`boundary_classes`; the node limited to it with :func:`restrict_node`);
    * recomputation modes, one per group (when there are at most
      :data:`~autopar.solvers.intra_op_solve.ENUMERATE_MODES` combinations; else the ILP picks)

    is solved, split into stages and simulated, and the fastest pipeline that fits is
    kept. Within one class the transfer time is fixed, so the ILP's flat objective
    weighs everything else as the pipeline does; the relaxed model drops no assignment
    that some split fits, and the first rank's is solved only when no split fits the
    relaxed answer. A combination whose ILP lower bound cannot beat the best pipeline
    is skipped.

    With no incumbent (``po`` None: the ILP's solution fitted its model of a rank but
    no split of it fitted the exact per-rank check) the same combinations are searched
    for the fastest pipeline that fits and beats ``bound``: None when one fits but none
    beats it; NoFeasiblePlanError when none fits."""
    m = built.settings.num_microbatches
    helds = sorted({least_in_flight(schedule, pp, m, virtual_stages), in_flight(schedule, pp, m)})
    k, classes = boundary_classes(g, built)
    combos: list = list(itertools.product(*(grp.allowed for grp in built.problem.recompute)))
    if len(combos) > ENUMERATE_MODES:
        combos = [None]
    if po is not None and len(helds) * max(1, len(classes)) * len(combos) < 2:
        return po
    bases = [pipeline_problem(g, built, pp, held) for held in helds]
    seen = set() if po is None else {(tuple(po.solution.choice), tuple(po.solution.modes or []))}
    timelines = {} if po is None else {(schedule, pp, m, virtual_stages): po.split.timeline}
    best, fits = po, po is not None
    for allowed, modes in itertools.product(classes if len(classes) > 1 else [None], combos):
        for base in bases:  # the relaxed model first; the first rank's if no split fits
            one = base if allowed is None else restrict_node(base, k, allowed)
            limit = bound if best is None else best.step_time_s
            try:
                sol = solve_ilp(one if modes is None else fold_modes(one, list(modes)),
                                bound=limit * pp)
            except NoFeasiblePlanError:
                break  # the stricter model has no assignment either
            if sol is None:
                break  # nor can it beat the best
            if modes is not None:
                sol.modes = list(modes)
            if (tuple(sol.choice), tuple(sol.modes)) in seen:
                break
            seen.add((tuple(sol.choice), tuple(sol.modes)))
            try:
                out = _outcome(g, built, sol, _units(g, built, sol, pp), pp=pp, schedule=schedule,
                               virtual_stages=virtual_stages, bound=limit, timelines=timelines,
                               initial=None if best is None else best.split.bounds)
            except NoFeasiblePlanError:
                continue
            fits = True
            if out is not None and out.step_time_s < limit * (1 - 1e-9):
                best = out
            break
    if not fits:
        raise NoFeasiblePlanError(f"no recomputation and split of pp={pp} ({schedule}) fits the "
                                  f"budget")
    return best


def _outcome(g: Graph, built: Built, sol: Solution, units: list[Unit], *, pp: int,
             schedule: str, virtual_stages: int, bound: float,
             timelines: dict | None = None,
             initial: list[tuple[int, int]] | None = None) -> PipelineOutcome | None:
    """Split the units of one intra-op solution into stages and price the pipeline
    (None when even a bubble-free pipeline would take ``bound`` or more, or no split's
    lower bound is below it; a split that still cannot beat ``bound`` is returned as the
    best the split search saw). ``timelines``
    keeps compiled schedules by (schedule, pp, m, v) for later calls; ``initial``: a
    split to improve instead of the least-T seed, when it fits."""
    st = built.settings
    m = st.num_microbatches
    if m * sum(u.forward_s + u.backward_s for u in units) / pp >= bound:
        return None
    shared = st.hw.oversubscription
    p2p = boundary_p2p(g, built, sol.choice, pp)
    extra = rank_transients(g, built, sol.choice, sol.modes, pp=pp, schedule=schedule,
                            virtual_stages=virtual_stages)
    timelines = {} if timelines is None else timelines
    key = (schedule, pp, m, virtual_stages)
    split = split_stages(units, pp, m, schedule=schedule, virtual_stages=virtual_stages,
                         p2p_s=p2p, memory_budget=st.memory_budget - max(extra),
                         overlap=st.overlap, bound=bound * shared, explain=False,
                         timeline=timelines.get(key), initial=initial)
    if split is None:
        return None
    timelines[key] = split.timeline
    ranks = [r + e for r, e in zip(split.estimate.peak_memory_bytes, extra)]
    step = shared_cores_time(split.estimate.step_time_s + split.exposed_s,
                             split.estimate.busy_s, split.exposed_s, shared)
    return PipelineOutcome(sol, units, split, max(step, split.host_s), max(ranks), p2p,
                           split.exposed_s, max(extra), extra, max(0.0, split.host_s - step))


def shared_cores_time(objective_s: float, busy_s: list[float], exposed_s: float,
                      shared: float) -> float:
    """The step time of a stage split when its ranks take turns on fewer cores:
    ``objective_s`` = T (the schedule's makespan plus the exposed synchronization
    ``exposed_s``), ``busy_s`` each rank's busy time.

    ``shared`` = s, processes per core (:attr:`HardwareProfile.oversubscription`); the
    unit costs were priced at the rates of all N processes busy at once, s times
    slower than one process per core. A rank waiting in a bubble gives its core to
    another, so the step is the larger of the critical path at one process per core,
    T/s, and the cores' total work, Σ_r busy_r / cores = mean_r busy_r (plus the
    exposed gradient synchronization, also done on the cores). s = 1: T itself."""
    if shared <= 1.0:
        return objective_s
    return max(objective_s / shared, sum(busy_s) / len(busy_s) + exposed_s)


def pipeline_terms(po: PipelineOutcome, *, pp: int, schedule: str, virtual_stages: int,
                   num_microbatches: int) -> StepTerms:
    """The step time of pipeline ``po`` by term (:class:`StepTerms`): the busiest rank's
    busy time split by its units' costs; the transfers' share of the makespan T, T − T₀
    with T₀ the schedule simulated with free transfers; the bubble, T₀ less the busy
    time; the slowest rank's optimizer step and the gradient synchronization no rank
    hides (:func:`~autopar.solvers.stage_split.after_backward`), and the host's share."""
    est = po.split.estimate
    ranks = stage_ranks(schedule, pp, virtual_stages)
    busiest = max(range(pp), key=lambda r: est.busy_s[r])
    mine = [u for (a, b), r in zip(po.split.bounds, ranks) if r == busiest
            for u in po.units[a:b]]
    m = num_microbatches
    compute = m * sum(u.compute_s for u in mine)
    recompute = m * sum(u.recompute_s for u in mine)
    comm = m * sum(u.comm_s for u in mine)
    a2a = m * sum(u.all_to_all_s for u in mine)
    param = m * sum(u.param_comm_s for u in mine)
    chunks = [PieceCost.total(po.units[a:b]) for a, b in po.split.bounds]
    free_p2p = simulate(schedule, chunks, pp, m, virtual_stages=virtual_stages,
                        p2p_s=0.0).step_time_s
    p2p = max(0.0, est.step_time_s - free_p2p)  # not −1e-19 where transfers cost nothing
    per_rank = [0.0] * pp
    for chunk, r in zip(chunks, ranks):
        per_rank[r] += chunk.optimizer_s
    # the step's after-backward part holds the slowest rank's optimizer step
    optimizer = min(po.exposed_step_comm_s, max(per_rank))
    exposed_param = param + po.exposed_step_comm_s - optimizer
    # Ranks sharing fewer cores (shared_cores_time): every term is the same share of the
    # shorter step, so the terms still sum to it.
    device = est.step_time_s + po.split.exposed_s
    scale = (po.step_time_s - po.exposed_host_s) / device if device else 1.0
    return StepTerms(compute_s=compute * scale, recompute_s=recompute * scale,
                     exposed_comm_s=(comm + exposed_param + p2p) * scale,
                     bubble_s=(free_p2p - (compute + recompute + comm + param)) * scale,
                     optimizer_s=optimizer * scale, exposed_host_s=po.exposed_host_s,
                     comm_s=comm * scale, exposed_param_comm_s=exposed_param * scale,
                     exposed_p2p_s=p2p * scale, p2p_s=po.p2p_s,
                     all_to_all_s=a2a * scale or None)
