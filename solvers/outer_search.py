"""The outer search: every factorization of the world into pp x dp x tp, every
micro-batch size, ZeRO stage and pipeline schedule; one intra-op ILP per candidate
(and, with pipelining, one stage DP per schedule); the fastest feasible wins
(:func:`search`), one whose tp splits nothing only if no other exists
(:mod:`.idle_axis`). Recomputation is chosen inside each ILP (one mode per distinct
layer), not here.

:func:`candidates` lists the space and :func:`tiers` the order it is tried in: CPU
offload and tensor parallelism wider than a node only when no other candidate fits,
unless asked for. Candidates are visited in a fixed order (by lower bound) and ties
keep the first found, so the same inputs always give the same plan. The ZeRO stages
tried and the reasons for the tiers: docs/solvers.md, section
``autopar.solvers.outer_search``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from autopar.errors import ConfigError, NoFeasiblePlanError
from autopar.graph import Graph
from autopar.sharding import Mesh
from autopar.units_text import fmt_bytes
from autopar.solvers.bounds import combo_bounds, pipeline_stage_bound, step_bound
from autopar.solvers.idle_axis import splits_nothing
from autopar.solvers.intra_op_ilp import Solution, SolverTimeout, solve_ilp
from autopar.memory_choices import RECOMPUTE
from autopar.solvers.pipelined_candidate import (PipelineOutcome, RefineLater, in_flight,
                                                 pipeline_problem, refine_modes, solve_pipeline)
from autopar.solvers.problem import evaluate, least_memory
from autopar.solvers.problem_build import Built, build_problem
from autopar.solvers.schedule_sim import ZERO_BUBBLE, needs_a_microbatch_per_stage, validate
from autopar.solvers.units import least_unit_costs, unit_members
from autopar.strategies.analysis import GraphAnalysis
from autopar.strategies.settings import Settings


@dataclass(frozen=True)
class Candidate:
    """One point of the outer search space (``pp`` = 1: no pipeline)."""

    dp: int
    tp: int
    microbatch_size: int
    num_microbatches: int
    zero: int
    pp: int = 1
    schedule: str = ""
    virtual_stages: int = 1
    offload: bool = False
    ep: int = 1  # experts split over ep of the dp ranks (ep divides dp)
    split_experts: bool = False  # every expert module split over ep (ep asked for)
    expert_imbalance: float = 1.0  # busiest ep rank's routed tokens over the mean
    cp: int = 1  # context parallelism: every sequence split over cp ranks
    cp_variant: str = ""  # how its attention brings the keys (context_parallel.VARIANTS)

    def label(self) -> str:
        """Short readable description."""
        pipe = f"pp={self.pp} {self.schedule}" + (
            f" v={self.virtual_stages}" if self.virtual_stages > 1 else "") + " " \
            if self.pp > 1 else ""
        ep = f" ep={self.ep}" if self.ep > 1 else ""
        cp = f" cp={self.cp} {self.cp_variant}" if self.cp > 1 else ""
        return (f"{pipe}dp={self.dp}{ep}{cp} tp={self.tp} mb={self.microbatch_size}x"
                f"{self.num_microbatches} zero={self.zero}" + (" offload" if self.offload else ""))


@dataclass
class Outcome:
    """What one candidate gave: a step time, or why it was dropped."""

    candidate: Candidate
    step_time_s: float | None
    memory_bytes: float | None
    reason: str = ""


@dataclass
class SearchResult:
    """The best candidate's problem and solution (and its pipeline, if any), and every
    candidate's outcome."""

    built: Built
    solution: Solution
    outcomes: list[Outcome] = field(default_factory=list)
    time_s: float = 0.0
    candidate: Candidate | None = None
    pipeline: PipelineOutcome | None = None
    runners_up: list["Scored"] = field(default_factory=list)
    passed_over: list[str] = field(default_factory=list)  # why each earlier tier had none
    step_time_s: float = 0.0  # the best plan's
    gap_bound_s: float | None = None  # least bound of what a time limit left unproven
    notes: list[str] = field(default_factory=list)  # what the search left out, in words
    set_aside: "Scored | None" = None  # a faster layout whose tp splits nothing (idle_axis)


def divisors(n: int) -> list[int]:
    """Positive divisors of n, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


AUTO_SCHEDULES = (("1f1b", 1), *((s, v) for s in ("interleaved_1f1b", "interleaved_zero_bubble")
                                  for v in (2, 3, 4)), ("zbv", 2))
"""Schedules the search tries by itself, with their virtual stages per rank: the
interleaved ones with 2 to 4 chunks per rank (Megatron-LM's published runs use 2 and 3,
benchmarks/reference_configs.json; each more chunk shrinks the bubble and adds a stage
boundary to cross per micro-batch, and the stage split needs pp x v blocks), ZBV with its 2.
GPipe is left out: it takes the time of 1F1B with more activation memory (Narayanan et
al., SC'21 §2.2), so it never wins; ask for it with ``schedule="gpipe"``."""


def candidates(world: int, global_batch: int, *, dp: int | None = None, tp: int | None = None,
               pp: int | None = None, microbatch_size: int | None = None,
               zero: int | None = None, schedule: str | None = None,
               virtual_stages: int | None = None, num_units: int = 0,
               heads: int | None = None, ep: int | None = None,
               experts: int = 0, expert_imbalance: float = 1.0, cp: int | None = None,
               seq_len: int = 0, cp_variants: tuple[str, ...] = (),
               cp_variant: str | None = None, cp_with_pp: bool = True) -> list[Candidate]:
    """Every candidate allowed by the fixed degrees (None = free). ``num_units`` (the
    model's pipeline units) bounds the pipeline: each stage needs one unit. A free
    ``tp`` must divide ``heads`` (the attention heads; None = any), since attention
    cannot split otherwise; a free micro-batch size must leave a pipeline at least
    ``pp`` micro-batches (fewer leave ranks idle for most of the step). A free ``ep``
    is each divisor of both ``dp`` and ``experts`` (the experts of every expert module;
    0 = the model has none, so ep is 1); every candidate carries ``expert_imbalance``,
    the load imbalance its pricing assumes for routed experts. A free ``cp`` is each
    degree whose head-tail chunks divide ``seq_len`` (2·cp of them), each with every
    variant of ``cp_variants`` that can split the heads left by tp (or ``cp_variant``
    alone); no ``cp_variants`` (a model context parallelism cannot split): cp is 1;
    ``cp_with_pp`` False: not both cp and pp above 1."""
    out = []
    for p in divisors(world):
        if (pp is not None and p != pp) or (pp is None and p > 1 and p * 2 > num_units):
            continue
        for t, c, variant in _model_degrees(world // p, tp, cp, heads, seq_len, cp_variants,
                                            cp_variant):
            d = world // p // t // c
            if (tp is not None and t != tp) or (dp is not None and d != dp):
                continue
            if p > 1 and c > 1 and not cp_with_pp:
                continue
            if global_batch % d:
                continue
            local = global_batch // d
            mbs = [microbatch_size] if microbatch_size is not None else divisors(local)
            for mb in mbs:
                if local % mb or (microbatch_size is None and local // mb < p):
                    continue
                m = local // mb
                r = d * c  # the ranks holding each parameter: ZeRO shards over them
                zs = [zero] if zero is not None else ([0, 2, 3] if r > 1 and p == 1 else
                                                      [0, 2] if r > 1 else [0])
                for z in zs:
                    for sched, v in _schedules(p, m, schedule, virtual_stages, num_units):
                        for e in _expert_degrees(d, ep, experts):
                            out.append(Candidate(d, t, mb, m, z, p, sched, v, ep=e,
                                                 split_experts=ep is not None and e > 1,
                                                 expert_imbalance=expert_imbalance,
                                                 cp=c, cp_variant=variant))
    if not out:
        raise ConfigError(
            f"no pipeline x data x{' context x' if cp_variants else ''} tensor parallel "
            f"layout of {world} devices divides the global batch of {global_batch} under the "
            f"requested degrees (pp={pp}, dp={dp}, {f'cp={cp}, ' if cp_variants else ''}"
            f"tp={tp}, microbatch={microbatch_size}); choose a global batch divisible by "
            f"the data-parallel degree, or fewer pipeline stages than the model has blocks")
    return out


def _model_degrees(n: int, tp: int | None, cp: int | None, heads: int | None, seq_len: int,
                   variants: tuple[str, ...], variant: str | None
                   ) -> list[tuple[int, int, str]]:
    """The (tp, cp, cp variant) triples to try on ``n`` devices of a stage
    (:func:`candidates`): tp dividing ``heads`` when free; cp 1, or, when the model
    allows it (``variants``), each degree whose 2·cp head-tail chunks divide
    ``seq_len``, with each variant that splits the heads tp leaves (Ulysses: cp
    divides them)."""
    out = []
    for t in divisors(n):
        if (tp is not None and t != tp) or (tp is None and heads is not None and heads % t):
            continue
        for c in divisors(n // t):
            if (cp is not None and c != cp) or (cp is None and c > 1 and not variants):
                continue
            if c == 1:
                out.append((t, 1, ""))
                continue
            if not seq_len or seq_len % (2 * c):
                continue
            for v in ((variant,) if variant else variants):
                if v == "ulysses" and (heads is None or (heads // t) % c):
                    continue
                out.append((t, c, v))
    return out


def _expert_degrees(dp: int, ep: int | None, experts: int) -> list[int]:
    """The expert-parallel degrees to try with ``dp`` data-parallel ranks: the one
    asked for if it divides ``dp``, else every common divisor of ``dp`` and
    ``experts``."""
    if ep is not None:
        return [ep] if dp % ep == 0 else []
    return [e for e in divisors(dp) if experts and experts % e == 0] or [1]


def _schedules(pp: int, m: int, schedule: str | None, virtual_stages: int | None,
               num_units: int) -> list[tuple[str, int]]:
    """The (schedule, virtual stages) pairs to try for ``pp`` stages and ``m``
    micro-batches: none without a pipeline, the requested one (a schedule asked for
    without its virtual stages: each count AUTO_SCHEDULES tries it with, else 1), or
    AUTO_SCHEDULES; those
    torch runs (:func:`~autopar.solvers.schedule_sim.validate`) and autopar's runtime
    lowers (:func:`~autopar.solvers.schedule_sim.needs_a_microbatch_per_stage`)."""
    if pp == 1:
        return [("", 1)]
    def runs(pairs: list[tuple[str, int]]) -> list[tuple[str, int]]:
        return [(sc, v) for sc, v in pairs if pp * v <= num_units and
                validate(sc, pp, m, v) is None and
                not (needs_a_microbatch_per_stage(sc) and m < pp * v)]

    if schedule is None:
        return runs(list(AUTO_SCHEDULES))
    if virtual_stages is not None:
        return runs([(schedule, virtual_stages)])
    # an interleaved schedule asked for without its chunks: the counts AUTO tries it with
    return runs([(sc, v) for sc, v in AUTO_SCHEDULES if sc == schedule]) or \
        runs([(schedule, 2 if schedule == "zbv" else 1)])


def offload_candidates(cands: list[Candidate]) -> list[Candidate]:
    """The ZeRO-3 candidates without a pipeline, with CPU offload (for when nothing else
    fits)."""
    out = []
    for c in cands:
        if c.pp == 1 and c.zero == 3 and not c.offload:
            out.append(replace(c, offload=True))
    return out


def tiers(cands: list[Candidate], gpus_per_node: int,
          offload: bool | None) -> list[list[Candidate]]:
    """``cands`` in the order the search tries them, each list only when none of the
    earlier ones has a plan that fits: tensor and expert parallelism within a node
    without context parallelism first (all of ``cands`` when none is), then the rest:
    context parallelism, tensor parallelism wider than a node and (``offload`` None)
    CPU offload together, each a way to fit at a price in time. ``offload=True``: only
    the offload variants (:func:`offload_candidates`), in the same order."""
    local = [c for c in cands if c.tp * c.ep <= gpus_per_node]
    wide = [c for c in cands if c.tp * c.ep > gpus_per_node]
    if not local:  # every candidate is wider than a node: the caller asked for that tp
        local, wide = wide, []
    first = [c for c in local if c.cp == 1] or local  # cp asked for: every one has it
    split = [c for c in local if c.cp > 1 and first is not local]
    if offload:
        out = [offload_candidates(first + split), offload_candidates(wide)]
    elif offload is None:
        out = [first, split + wide + offload_candidates(cands)]
    else:
        out = [first, split + wide]
    return [t for t in out if t]


def search(an: GraphAnalysis, cands: list[Candidate], *, hw, gpus_per_node: int,
           precision: str, optimizer: str, memory_budget: float,
           sequence_parallel: bool | None = None, recompute: tuple[str, ...] | None = None,
           loss_parallel: bool | None = None, split_weights: bool = False,
           offload: bool | None = None, time_limit_s: float | None = None, top_k: int = 1,
           progress: Callable[[int, int, float | None], None] | None = None,
           deadline: float | None = None) -> SearchResult:
    """Solve every candidate and return the fastest feasible plan's pieces, trying the
    lists of :func:`tiers` in turn until one has a plan that fits (``offload=True``:
    only CPU offload; False: never). ``recompute`` limits the recomputation modes
    (None: all); ``split_weights`` keeps the layouts that split every block matrix over
    tp (:class:`~autopar.strategies.settings.Settings`).

    ``top_k`` > 1 also keeps the next fastest plans (:attr:`SearchResult.runners_up`):
    pruning then compares bounds with the k-th best time found, so the runners-up are
    exact too (but for a pipelined candidate whose modes must be searched: that search
    runs only against the plan, :data:`RUNNER_UP_PRUNED`); the candidates without a
    pipeline are visited first, so that their plans prune the stage splits, and ties go
    to the smaller bound, so the plan does not depend on ``top_k``.

    ``time_limit_s`` bounds the whole search, from this call (or ``deadline``, a
    :func:`time.perf_counter` instant, when given): it is checked between candidates,
    and each intra-op ILP solved once a plan is in hand gets the time left as CBC's own
    limit. The search then returns the best plan found with its optimality gap
    (``solution.stats["gap"]``: 1 − the least lower bound of every candidate not solved
    to the end, over its step time; :attr:`SearchResult.gap_bound_s` that bound). It
    runs past the limit only to build the candidates' problems and to find a first plan.
    ``progress(done, total, best)`` is called after each candidate.

    Raises NoFeasiblePlanError when none fits, naming the least memory a plan needs.
    """
    if deadline is None and time_limit_s is not None:
        deadline = time.perf_counter() + time_limit_s
    kw = dict(hw=hw, gpus_per_node=gpus_per_node, precision=precision, optimizer=optimizer,
              memory_budget=memory_budget, sequence_parallel=sequence_parallel,
              loss_parallel=loss_parallel, split_weights=split_weights, recompute=recompute,
              deadline=deadline, top_k=top_k, progress=progress)
    failed: NoFeasiblePlanError | None = None
    passed: list[str] = []
    order = tiers(cands, gpus_per_node, offload) or [[]]
    for k, tier in enumerate(order):
        try:
            res = _search(an, tier, **kw)
            res.passed_over = passed
            return _or_split_sequences(an, res, order[k + 1] if k + 1 < len(order) else [], kw)
        except NoFeasiblePlanError as e:  # name the smaller of the minima
            passed.append(str(e))
            if failed is None or getattr(e, "least_bytes", 0.0) < \
                    getattr(failed, "least_bytes", 0.0):
                failed = e
    raise failed


CP_TIER_PROBLEMS = 800
"""Intra-op problems the search builds for context-parallel candidates that it tries only
because the best plan without them recomputes whole blocks or offloads, when the caller
set no time limit (the fewest-way splits first; every candidate of those problems is
then scored). A search effort, not a cost, counted in work rather than seconds so that a
plan does not depend on the machine's speed: Llama 3 70B on 256 H100 has about 13,000
such candidates (a thousand distinct problems), whose problems alone took 4 minutes to
build on a 2-core machine; this many keep its plan within its 15 s goal. Asking for cp
(``cp=``, ``--cp``) searches them all."""


def _or_split_sequences(an: GraphAnalysis, res: SearchResult, following: list[Candidate],
                        kw: dict) -> SearchResult:
    """``res``, or the best plan of ``following`` when it is faster and ``res`` (found
    without context parallelism) pays much time for memory — full recomputation of a
    block, or offload — where splitting the sequences may save it for less. Without a
    deadline this builds at most :data:`CP_TIER_PROBLEMS` problems, and a note says what
    it left out."""
    c = res.candidate
    if c is None or c.cp > 1 or not any(f.cp > 1 for f in following):
        return res
    modes = res.solution.modes or [0] * len(res.built.problem.recompute)
    recomputes = any(grp.modes[r] == "full" for grp, r in zip(res.built.problem.recompute, modes))
    if not (recomputes or c.offload):
        return res
    split = [f for f in following if f.cp > 1]
    unbuilt: list[Candidate] = []
    t0 = time.perf_counter()
    budget = kw["deadline"] is None  # its own CP_TIER_PROBLEMS, not the caller's limit
    mine = Scored(res.step_time_s, res.built, res.solution, c, res.pipeline,
                  idle=splits_nothing(res.built, res.solution.choice))
    seed = [mine] + res.runners_up + ([res.set_aside] if res.set_aside else [])
    other = _search(an, split, **kw, have_plan=True, unbuilt=unbuilt,
                    max_built=CP_TIER_PROBLEMS if budget else None,
                    seed=seed)
    _note_cut(res, unbuilt, len(split), budget)
    if other.candidate is c:  # still the plan; the runners-up of both tiers ranked
        res.runners_up, res.set_aside = other.runners_up, other.set_aside
        _set_gap(res, other.gap_bound_s)
        won = res
    else:
        _set_gap(other, res.gap_bound_s)
        other.notes = res.notes + other.notes
        other.passed_over = res.passed_over + [
            f"the fastest plan that fits takes {res.step_time_s:.4g} s ({c.label()}, "
            f"saving memory by {'full recomputation' if recomputes else 'offload'})"]
        won = other
    won.outcomes = res.outcomes + other.outcomes
    won.solution.stats["candidates"] = len(won.outcomes)
    won.solution.stats["search_s"] = res.time_s + time.perf_counter() - t0
    return won


def _note_cut(res: SearchResult, unbuilt: list[Candidate], of: int, budget: bool) -> None:
    """Add to ``res`` a note, when some of the ``of`` context-parallel candidates were
    left ``unbuilt``, saying what ended their search: :data:`CP_TIER_PROBLEMS`
    (``budget``) or the caller's time limit (their problems unbuilt, they have no bound
    for the gap)."""
    if not unbuilt:
        return
    if budget:
        res.notes.append(f"context parallelism was weighed in the first "
                         f"{CP_TIER_PROBLEMS} problems the search builds for it without a "
                         f"time limit, not to the end ({len(unbuilt):,} of {of:,} "
                         f"configurations not built); pass cp (--cp) to search it whole")
    else:
        res.notes.append(f"the time limit ended the search of context parallelism before "
                         f"it built the problems of {len(unbuilt):,} of {of:,} "
                         f"configurations: they are not scored, and the gap leaves them "
                         f"out; a longer limit searches them")


def _set_gap(res: SearchResult, bound_s: float | None) -> None:
    """Lower ``res``'s gap bound to ``bound_s`` (None: nothing more left unproven) and
    state its gap (``solution.stats["gap"]``) when it has one."""
    if bound_s is None:
        return
    res.gap_bound_s = bound_s if res.gap_bound_s is None else min(res.gap_bound_s, bound_s)
    res.solution.stats["gap"] = max(0.0, 1.0 - res.gap_bound_s / res.step_time_s)


class _OutOfTime(Exception):
    """A search that may return nothing (a plan is already in hand) reached its
    deadline before it solved a candidate; ``bound_s``: the least lower bound of those
    it left."""

    def __init__(self, bound_s: float) -> None:
        super().__init__(f"out of time; no plan left is faster than {bound_s} s")
        self.bound_s = bound_s


@dataclass
class Scored:
    """A solved candidate: its step time and the pieces to assemble its plan."""

    step_time_s: float
    built: Built
    solution: Solution
    candidate: Candidate
    pipeline: PipelineOutcome | None = None
    bound_s: float = 0.0  # the candidate's lower bound on its step time
    rank: int = 0  # its place in the search's order of bounds (ties go to the first)
    idle: bool = False  # its layout splits nothing over tp (solvers.idle_axis)


def _search(an: GraphAnalysis, cands: list[Candidate], *, hw, gpus_per_node: int,
            precision: str, optimizer: str, memory_budget: float,
            sequence_parallel: bool | None, recompute: tuple[str, ...] | None,
            deadline: float | None, top_k: int, loss_parallel: bool | None = None,
            split_weights: bool = False,
            progress: Callable[[int, int, float | None], None] | None,
            have_plan: bool = False, unbuilt: list[Candidate] | None = None,
            max_built: int | None = None, seed: list[Scored] | None = None) -> SearchResult:
    """:func:`search` over ``cands`` as given. ``have_plan``: the caller holds a plan
    already, so the deadline may stop this search before it finds one (raising
    :class:`_OutOfTime`), or before it builds every candidate's problem (those go to
    ``unbuilt``, as do those past ``max_built`` problems). ``seed``: plans an earlier
    search kept, fastest first, which prune this one from its start and stay in its
    ranking (ahead of its own on ties); its result may be ``seed[0]`` itself."""
    t0 = time.perf_counter()
    kept: list[Scored] = []  # the top_k fastest so far, fastest first
    idle: list[Scored] = []  # the same of those whose layout splits nothing over tp
    for i, s in enumerate(seed or []):
        s.rank = i - len(seed)
        kept, idle = _place(kept, idle, s, top_k)
    outcomes: list[Outcome] = []
    infeasible: list[tuple[Candidate, Built]] = []
    built_by = _build_all(an, cands, hw=hw, gpus_per_node=gpus_per_node, precision=precision,
                          optimizer=optimizer, memory_budget=memory_budget,
                          sequence_parallel=sequence_parallel, recompute=recompute,
                          loss_parallel=loss_parallel, split_weights=split_weights,
                          deadline=_halfway(deadline) if have_plan else None,
                          max_built=max_built)
    if unbuilt is not None:
        unbuilt.extend(c for c in cands if isinstance(built_by[mesh_key(c)], _NotBuilt))
    bound = _bounds(an.graph, cands, built_by, memory_budget)
    order = sorted(range(len(cands)), key=lambda k: (bound[k], k))
    rank = {k: i for i, k in enumerate(order)}  # ties between equal plans go by it
    if top_k > 1:  # cheap ILPs first: their plans tighten the k-th best time before
        order.sort(key=lambda k: cands[k].pp > 1)  # the pipelines' stage splits run
    solved: dict[tuple, object] = {}
    unproven: list[float] = []  # the bounds of candidates a time limit left unsolved

    def out_of_time() -> bool:
        """Whether the deadline has passed and a plan is in hand (here or the caller's)."""
        return deadline is not None and bool(kept or idle or have_plan) and \
            time.perf_counter() > deadline

    def score(k: int, refine: bool, beat: float | None = None) -> Scored | None:
        """:func:`_score` of candidate ``k`` against the k-th best time found (``beat``:
        against that time instead, which a search of the modes need beat to matter for
        the plan); one whose ILP the time limit cut short leaves its bound in
        ``unproven``."""
        c = cands[k]
        left = None if deadline is None or not kept else deadline - time.perf_counter()
        limit = _limit(kept, top_k) if beat is None else beat
        try:
            scored = _score(an, c, built_by[mesh_key(c)], bound[k], limit, solved, outcomes,
                            infeasible, refine=refine, time_limit_s=left,
                            pruned=None if beat is None or top_k == 1 else RUNNER_UP_PRUNED)
        except SolverTimeout:
            outcomes.append(Outcome(c, None, None, "not solved: the search's time limit"))
            unproven.append(bound[k])
            return None
        if scored is not None:
            scored.bound_s, scored.rank = bound[k], rank[k]
            scored.idle = splits_nothing(scored.built, scored.solution.choice)
            if scored.solution.status == "Stopped":  # its own bound is on F: no pipeline
                own = scored.solution.stats.get("lower_bound_s", 0.0) if c.pp == 1 else 0.0
                unproven.append(max(bound[k], own))
        return scored

    # a pipelined candidate whose ILP answer fits no stage split searches its modes (many
    # ILPs): that waits until every candidate has been visited once, when the best plan
    # found prunes most of it; it is then visited again, by its bound, with refine
    later: list[int] = []
    for done, k in enumerate(order):
        if out_of_time():
            unproven.extend(bound[j] for j in order[done:])
            unproven.extend(bound[j] for j in later)
            later = []
            break
        try:
            scored = score(k, refine=False)
        except RefineLater:
            later.append(k)
            continue
        kept, idle = _place(kept, idle, scored, top_k)
        if progress is not None:
            plan = (kept or idle)[:1]  # what would be returned now
            progress(done + 1, len(order), plan[0].step_time_s if plan else None)
    for i, j in enumerate(later):  # the deferred searches, in their bounds' order
        if out_of_time():
            unproven.extend(bound[x] for x in later[i:])
            break
        if kept and kept[0].step_time_s <= bound[j] < _limit(kept, top_k):
            outcomes.append(Outcome(cands[j], None, None, RUNNER_UP_UNREFINED))
            continue
        kept, idle = _place(kept, idle, score(j, refine=True,
                                             beat=kept[0].step_time_s if kept else None),
                            top_k)
    if not kept:  # nothing else: the layouts that split nothing
        kept, idle = idle[:top_k], []
    if not kept and have_plan and unproven:
        raise _OutOfTime(min(unproven))
    if not kept:
        err = NoFeasiblePlanError(_no_fit_message(an.graph, infeasible, memory_budget, outcomes,
                                                  recompute))
        err.least_bytes = min((lower_bound_memory(an.graph, b, c) for c, b in infeasible),
                              default=float("inf"))
        raise err
    best = kept[0]
    if best.pipeline is not None and not any(best is s for s in seed or []):
        # the winner's recomputation, chosen with its stage split (a seed's already was)
        c = best.candidate
        if out_of_time():  # left as the ILP chose it: a refined one may be faster
            unproven.append(best.bound_s)
        else:
            po = refine_modes(an.graph, best.built, best.pipeline, pp=c.pp,
                              schedule=c.schedule, virtual_stages=c.virtual_stages) or \
                best.pipeline
            best = Scored(po.step_time_s, best.built, po.solution, c, po, best.bound_s,
                          best.rank, best.idle)
    others = kept[1:]  # the runners-up: those slower than the plan, idle or not
    for s in idle:
        if s.step_time_s >= best.step_time_s:
            others = _keep(others, s, top_k - 1)
    res = SearchResult(best.built, best.solution, outcomes, time.perf_counter() - t0,
                       best.candidate, best.pipeline, others, step_time_s=best.step_time_s)
    if idle and idle[0].step_time_s < best.step_time_s:
        res.set_aside = idle[0]
    res.solution.stats["candidates"] = len(outcomes)
    res.solution.stats["search_s"] = res.time_s
    _set_gap(res, min(unproven) if unproven else None)
    return res


RUNNER_UP_UNREFINED = ("not scored: no stage split fits its ILP's answer, and the search "
                       "for one (many ILPs) runs only where a configuration can beat the "
                       "plan, not for a runner-up place")
"""Why a pipelined candidate that could only be a runner-up was left unscored: the
runners-up cost little more than the plan this way (``top_k`` 5 on GPT-3 175B at 1,024
A100: 12.1 s of search against 3.2 s when such candidates were refined too)."""


RUNNER_UP_PRUNED = ("pruned: no recomputation and stage split of it beats the plan; "
                    "that search (many ILPs) runs only as far as the plan, not for a "
                    "runner-up place")
"""Why a pipelined candidate whose modes were searched against the plan alone (with
``top_k`` > 1: against the k-th best time it would cost as much again) is no runner-up."""


def _limit(kept: list[Scored], top_k: int) -> float:
    """The step time a plan must beat to enter ``kept`` (inf while it has room)."""
    return kept[-1].step_time_s if len(kept) >= top_k else float("inf")


def _place(kept: list[Scored], idle: list[Scored], scored: Scored | None,
           top_k: int) -> tuple[list[Scored], list[Scored]]:
    """``(kept, idle)`` with ``scored`` kept (:func:`_keep`) in ``kept``, or, when its
    layout splits nothing over tp (:mod:`autopar.solvers.idle_axis`: set aside while a
    layout that uses its ranks exists), in ``idle``, which keeps every one: those
    faster than the plan are no runners-up, and how many that is is known at the end."""
    if scored is not None and scored.idle:
        return kept, _keep(idle, scored, len(idle) + 1)
    return _keep(kept, scored, top_k), idle


def _keep(kept: list[Scored], scored: Scored | None, top_k: int) -> list[Scored]:
    """``kept`` (the top_k fastest, fastest first) with ``scored`` placed after every
    plan as fast (ties go to the candidate of the smaller bound, whatever the order the
    search visited them in)."""
    if scored is None:
        return kept

    def before(s: Scored) -> bool:
        if scored.step_time_s < s.step_time_s * (1 - 1e-9):
            return True
        return scored.step_time_s <= s.step_time_s * (1 + 1e-9) and scored.rank < s.rank
    at = next((i for i, s in enumerate(kept) if before(s)), len(kept))
    return (kept[:at] + [scored] + kept[at:])[:top_k]


def candidate_settings(c: Candidate, *, hw, gpus_per_node: int, precision: str,
                       optimizer: str, memory_budget: float,
                       sequence_parallel: bool | None = None,
                       recompute: tuple[str, ...] | None = None,
                       loss_parallel: bool | None = None,
                       split_weights: bool = False) -> Settings:
    """The intra-op problem settings of candidate ``c`` (its dp × tp stage mesh, or
    dp/ep × ep × tp with expert parallelism)."""
    names, sizes = ["dp", "tp"], [c.dp, c.tp]
    if c.ep > 1:
        names, sizes = ["dp", "ep", "tp"], [c.dp // c.ep, c.ep, c.tp]
    if c.cp > 1:
        names.insert(-1, "cp")
        sizes.insert(-1, c.cp)
    return Settings(Mesh(tuple(names), tuple(sizes)), c.microbatch_size, c.num_microbatches,
                    c.zero, precision, optimizer, memory_budget, hw, gpus_per_node,
                    sequence_parallel=sequence_parallel, loss_parallel=loss_parallel,
                    split_weights=split_weights, offload=c.offload,
                    split_experts=c.split_experts, expert_imbalance=c.expert_imbalance,
                    recompute_modes=recompute or RECOMPUTE,
                    cp_variant=c.cp_variant or "allgather", pipelined=c.pp > 1)


def _build_all(an: GraphAnalysis, cands: list[Candidate], *, hw, gpus_per_node: int,
               precision: str, optimizer: str, memory_budget: float,
               sequence_parallel: bool | None, recompute: tuple[str, ...] | None,
               loss_parallel: bool | None = None, split_weights: bool = False,
               deadline: float | None = None,
               max_built: int | None = None) -> dict[tuple, Built | NoFeasiblePlanError]:
    """One intra-op problem per distinct :func:`mesh_key` (or the error saying an op has
    no strategy on that mesh, or that a smaller micro-batch already needs more memory
    than the budget, or :class:`_NotBuilt` past ``deadline`` or ``max_built`` problems).

    Keys are built by increasing micro-batch size within each group of
    :func:`_batch_group`: a group's candidates differ only in how the rank's samples are
    cut into several micro-batches, so static memory is the same and the activations in
    flight (micro-batch size x micro-batches held) do not shrink with a larger one. Once
    every candidate of a micro-batch size has a memory lower bound over the budget, the
    larger ones are not built."""
    built_by: dict[tuple, Built | NoFeasiblePlanError] = {}
    layouts: dict = {}  # build_problem's cache: layouts shared across ZeRO stages
    users: dict[tuple, list[Candidate]] = {}
    for c in cands:
        users.setdefault(mesh_key(c), []).append(c)
    hopeless: dict[tuple, int] = {}  # batch group -> the micro-batch size that did not fit
    built_count = 0
    def first(c: Candidate) -> tuple:
        """With a budget, the fewest-way splits first (cp, then pp, then tp)."""
        return (c.cp, c.pp, c.tp) if deadline is not None or max_built is not None else ()
    order = sorted(users, key=lambda k: (first(users[k][0]), _batch_group(users[k][0]),
                                         users[k][0].microbatch_size))
    # whether a larger micro-batch of the same group follows (only then is a bound worth it)
    larger = {k: nxt is not None and _batch_group(users[nxt][0]) == _batch_group(users[k][0])
              for k, nxt in zip(order, order[1:] + [None])}
    for key in order:
        c = users[key][0]
        group = _batch_group(c)
        if deadline is not None and time.perf_counter() > deadline or \
                max_built is not None and built_count >= max_built:
            built_by[key] = _NotBuilt("not scored: the search's time or budget ran out "
                                      "before its problem was built")
            continue
        if group in hopeless:
            built_by[key] = NoFeasiblePlanError(
                f"does not fit in memory: micro-batches of {hopeless[group]} already need "
                f"more than the budget")
            continue
        st = candidate_settings(c, hw=hw, gpus_per_node=gpus_per_node, precision=precision,
                                optimizer=optimizer, memory_budget=memory_budget,
                                sequence_parallel=sequence_parallel, recompute=recompute,
                                loss_parallel=loss_parallel, split_weights=split_weights)
        built_count += 1
        try:
            built = built_by[key] = build_problem(an, st, layouts)
        except NoFeasiblePlanError as e:
            built_by[key] = e
            continue
        if not larger.get(key):
            continue
        by_schedule = {u.schedule: u for u in users[key]}  # one pp per key: dp and tp fix it
        if all(lower_bound_memory(an.graph, built, u) > memory_budget * (1 + 1e-9)
               for u in by_schedule.values()):
            hopeless[group] = c.microbatch_size
    return {k: built_by[k] for k in users}


def _halfway(deadline: float | None) -> float | None:
    """The instant halfway from now to ``deadline``: building problems may take half the
    time left, so that scoring them has the rest."""
    if deadline is None:
        return None
    now = time.perf_counter()
    return now + max(0.0, deadline - now) / 2


class _NotBuilt(NoFeasiblePlanError):
    """A candidate whose problem the search's deadline left unbuilt (it may well fit)."""


def _batch_group(c: Candidate) -> tuple:
    """What candidates share but for the cut of each rank's samples into micro-batches
    (one micro-batch apart: it keeps no gradients between micro-batches)."""
    return (c.dp, c.tp, c.pp, c.zero, c.offload, c.ep, c.split_experts,
            c.num_microbatches == 1, c.cp, c.cp_variant)


def _score(an: GraphAnalysis, c: Candidate, built: Built | NoFeasiblePlanError, bound: float,
           limit: float, solved: dict, outcomes: list[Outcome],
           infeasible: list[tuple[Candidate, Built]], refine: bool = True,
           time_limit_s: float | None = None, pruned: str | None = None) -> Scored | None:
    """Solve candidate ``c`` unless it cannot fit or cannot beat ``limit`` (the time a
    plan must beat to be kept); record its outcome either way. Without ``refine``, a
    pipelined candidate that would search its modes raises RefineLater instead (and
    records nothing). ``time_limit_s`` bounds its intra-op ILP without a pipeline
    (:func:`~autopar.solvers.intra_op_ilp.solve_ilp`: SolverTimeout when it found
    nothing, records nothing). ``pruned``: the outcome of a pipelined candidate that
    cannot beat ``limit`` (default: it is no better than the best plans found)."""
    def drop(reason: str, fits: bool = True) -> None:
        outcomes.append(Outcome(c, None, None, reason))
        if not fits:
            infeasible.append((c, built))

    if isinstance(built, NoFeasiblePlanError):
        outcomes.append(Outcome(c, None, None, str(built)))
        return None
    if bound == float("inf"):
        return drop("does not fit in memory", fits=False)
    if bound >= limit:
        return drop("pruned: its lower bound on the step time is no better than the best "
                    "plans found")
    if c.pp > 1:
        try:
            po = solve_pipeline(an.graph, built, pp=c.pp, schedule=c.schedule,
                                virtual_stages=c.virtual_stages, solved=solved, bound=limit,
                                refine=refine)
        except NoFeasiblePlanError as e:
            return drop(str(e), fits=False)
        if po is None:
            return drop(pruned or "pruned: even without a bubble it is no better than the "
                        "best plans found")
        outcomes.append(Outcome(c, po.step_time_s, po.memory_bytes))
        return Scored(po.step_time_s, built, po.solution, c, po)
    try:
        sol = solve_ilp(built.problem, time_limit_s=time_limit_s, bound=limit)
    except NoFeasiblePlanError:
        return drop("does not fit in memory", fits=False)
    if sol is None:
        return drop("pruned: no recomputation that fits can beat the best plans found")
    ev = evaluate(built.problem, sol.choice, sol.modes)
    outcomes.append(Outcome(c, ev.step_time_s, ev.memory_bytes))
    return Scored(ev.step_time_s, built, sol, c)


def mesh_key(c: Candidate) -> tuple:
    """What a candidate's intra-op problem depends on (pipelined or not)."""
    return (c.dp, c.tp, c.microbatch_size, c.num_microbatches, c.zero, c.offload, c.ep,
            c.split_experts, c.expert_imbalance, c.cp, c.cp_variant)


def _bounds(g: Graph, cands: list[Candidate], built_by: dict, budget: float) -> list[float]:
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
        built = built_by[mesh_key(c)]
        if not isinstance(built, Built):
            out.append(float("inf"))
            continue
        held = in_flight(c.schedule, c.pp, c.num_microbatches) if c.pp > 1 else 1
        key = (mesh_key(c), c.pp, held)
        if key not in per:
            acts = [[ns.memory.get("activations", 0.0) for ns in ds] for ds in built.strategies]
            per[key] = step_bound(combo_bounds(built.problem, acts, c.pp, held), budget,
                                  c.num_microbatches, c.pp)
        bound = per[key]
        if c.pp > 1 and bound < float("inf"):
            skey = (mesh_key(c), c.pp, c.virtual_stages, c.schedule in ZERO_BUBBLE)
            if skey not in staged:
                if mesh_key(c) not in least:
                    least[mesh_key(c)] = least_unit_costs(built, members)
                units = least[mesh_key(c)]
                staged[skey] = pipeline_stage_bound(
                    [u.forward_s for u in units], [u.backward_s for u in units],
                    [u.optimizer_s for u in units], pp=c.pp, m=c.num_microbatches,
                    v=c.virtual_stages, drains=c.schedule not in ZERO_BUBBLE) / \
                    max(1.0, built.settings.hw.oversubscription)
            bound = max(bound, staged[skey])
        out.append(bound)
    return out


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
        i = min(range(len(n.strategies)), key=lambda j: n.strategies[j].memory_bytes)
        for cat, v in built.strategies[k][i].memory.items():
            scale = held if cat == "activations" else 1
            cats[cat] = cats.get(cat, 0.0) + n.multiplicity * v * scale / c.pp
    return cats


def _no_fit_message(g: Graph, infeasible: list[tuple[Candidate, Built]], budget: float,
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
