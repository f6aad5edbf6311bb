"""What the outer search knows of a candidate before solving it: a lower bound on its
step time (:func:`candidate_bounds`, to visit and prune candidates in order) and on its
memory (:func:`lower_bound_memory`), and the message when none fits
(:func:`no_fit_message`)."""

from __future__ import annotations

from autopar.cost_models.compute import is_matmul
from autopar.cost_models.hardware import HardwareProfile
from autopar.graph import Graph
from autopar.units_text import fmt_bytes
from autopar.solvers.bounds import combo_bounds, pipeline_stage_bound, step_bound
from autopar.solvers.problem import least_memory
from autopar.solvers.problem_build import Built
from autopar.solvers.pipelined_candidate import in_flight, pipeline_problem
from autopar.solvers.schedule_sim import ZERO_BUBBLE
from autopar.solvers.search_space import Candidate, Outcome, problem_key
from autopar.solvers.units import least_unit_costs, unit_members


def candidate_bounds(g: Graph, cands: list[Candidate], built_by: dict, budget: float) -> list[float]:
    """Each candidate's lower bound on the step time (inf: nothing fits in memory):
    the least :func:`~autopar.solvers.bounds.step_bound` of the recomputation modes
    whose memory bound fits — its micro-batches' work and its once-per-step optimizer
    and exposed gradient traffic, spread perfectly over the pipeline's ranks — and, on a
    pipeline, its ranks' loads in whole units and the fill and drain every split pays
    (:func:`~autopar.solvers.bounds.pipeline_stage_bound`; over the processes' share of
    a core, :func:`~autopar.solvers.pipelined_candidate.shared_cores_time`)."""
    per: dict[tuple, float] = {}
    staged: dict[tuple, float] = {}
    least: dict[tuple, list] = {}
    members = unit_members(g) if any(c.pp > 1 for c in cands) else []
    out = []
    for c in cands:
        pk = problem_key(c)
        built = built_by[pk]
        if not isinstance(built, Built):
            out.append(float("inf"))
            continue
        held = in_flight(c.schedule, c.pp, c.num_microbatches) if c.pp > 1 else 1
        key = (pk, c.pp, held)
        if key not in per:
            acts = [[ns.memory.get("activations", 0.0) for ns in ds] for ds in built.strategies]
            per[key] = step_bound(combo_bounds(built.problem, acts, c.pp, held), budget,
                                  c.num_microbatches, c.pp)
        bound = per[key]
        if c.pp > 1 and bound < float("inf"):
            skey = (pk, c.pp, c.virtual_stages, c.schedule in ZERO_BUBBLE)
            if skey not in staged:
                if pk not in least:
                    least[pk] = least_unit_costs(built, members)
                units = least[pk]
                staged[skey] = pipeline_stage_bound(
                    [u.forward_s for u in units], [u.backward_s for u in units],
                    [u.optimizer_s for u in units], pp=c.pp, m=c.num_microbatches,
                    v=c.virtual_stages, drains=c.schedule not in ZERO_BUBBLE) / \
                    max(1.0, built.settings.hw.oversubscription)
            bound = max(bound, staged[skey])
        out.append(bound)
    return out


def flop_bound(g: Graph, c: Candidate, hw: HardwareProfile, precision: str) -> float:
    """A lower bound on candidate ``c``'s step time that needs no problem built: its
    samples' FLOPs spread evenly over its ranks at the GPU's matrix peak for
    ``precision`` (no op runs faster), counting each op's forward and, for a matrix
    product that passes a gradient, one more product of its size for that gradient
    (the gradient of one of its operands costs as much as the forward)."""
    work = sum(n.flops * (2 if n.requires_grad and is_matmul(n.target) else 1)
               for n in g.nodes)
    samples = c.dp * c.microbatch_size * c.num_microbatches
    ranks = c.dp * c.tp * c.pp * c.cp
    peak = hw.matmul_flops.get(precision, max(hw.matmul_flops.values()))
    return work / g.batch_size * samples / ranks / peak


def lower_bound_memory(g: Graph, built: Built, c: Candidate | None = None) -> float:
    """A lower bound on the memory per device of candidate ``c`` (every node's smallest
    memory with its most saving recomputation mode; on a pipeline, that of one rank
    holding 1/pp of the model and the schedule's in-flight micro-batches)."""
    if c is None or c.pp == 1:
        return least_memory(built.problem)
    held = in_flight(c.schedule, c.pp, c.num_microbatches)
    return least_memory(pipeline_problem(g, built, c.pp, held))


def _consumers(built: Built, c: Candidate) -> dict[str, float]:
    """Bytes per device by category of each node's smallest-memory strategy (a
    pipeline rank's share: static / pp, activations · in-flight / pp)."""
    held = in_flight(c.schedule, c.pp, c.num_microbatches) if c.pp > 1 else 1
    cats: dict[str, float] = {}
    for k, n in enumerate(built.problem.nodes):
        i = min(range(len(n.strategies)), key=lambda j: n.strategies[j].total.memory_bytes)
        for cat, v in built.strategies[k][i].memory.items():
            scale = held if cat == "activations" else 1
            cats[cat] = cats.get(cat, 0.0) + n.multiplicity * v * scale / c.pp
    return cats


def no_fit_message(g: Graph, infeasible: list[tuple[Candidate, Built]], budget: float,
                    outcomes: list[Outcome], recompute: tuple[str, ...] | None = None) -> str:
    """Why no candidate gave a plan: the least memory any needs (with the most saving
    recomputation the search may use: every mode, or the one ``recompute`` fixed), its
    largest consumers, and what to change."""
    if not infeasible:
        reasons = "; ".join(sorted({o.reason for o in outcomes if o.reason}))
        return f"no candidate plan could be built ({reasons})"
    c, best = min(infeasible, key=lambda cb: lower_bound_memory(g, cb[1], cb[0]))
    need = lower_bound_memory(g, best, c)
    if need <= budget:
        return (f"no plan was found for {c.label()}, though its least memory ({fmt_bytes(need)}) "
                f"is within {fmt_bytes(budget)} per device: either no choice of layouts "
                f"lets every operator hand its output on as the next one reads it under the "
                f"options forced on the search, or the layouts that join need more memory "
                f"than that bound. Drop a forced option (e.g. sequence_parallel) or raise "
                f"memory_budget.")
    top = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in
                    sorted(_consumers(best, c).items(), key=lambda kv: -kv[1]) if v > 0)
    fixed = recompute is not None and len(recompute) == 1
    how = f"with recompute={recompute[0]!r} as asked" if fixed else \
        "with the most saving recomputation"
    more = ", allow more recomputation (recompute='full', or leave it to the solver)" if \
        fixed and recompute[0] != "full" else ""  # type: ignore[index]
    return (f"no plan fits in {fmt_bytes(budget)} per device: the smallest needs at least "
            f"{fmt_bytes(need)} ({c.label()}, {how}; largest consumers without "
            f"recomputation: {top}). Raise memory_budget, use more devices{more}, or a "
            f"smaller global batch.")
