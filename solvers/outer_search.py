"""The outer search: every factorization of the world into pp x dp x tp, every
micro-batch size, ZeRO stage and pipeline schedule; one intra-op ILP per candidate
(and, with pipelining, one stage DP per schedule); the fastest feasible wins
(:func:`search`), one whose tp splits nothing only if no other exists
(:mod:`.idle_axis`). Recomputation is chosen inside each ILP (one mode per distinct
layer), not here.

:func:`~autopar.solvers.search_space.candidates` lists the space and
:func:`~autopar.solvers.search_space.tiers` the order it is tried in: CPU
offload and tensor parallelism wider than a node only when no other candidate fits,
unless asked for. Candidates are visited in a fixed order (by lower bound) and ties
keep the first found, so the same inputs always give the same plan. The ZeRO stages
tried and the reasons for the tiers: docs/solvers.md, section
``autopar.solvers.outer_search``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from autopar.errors import NoFeasiblePlanError
from autopar.solvers.idle_axis import splits_nothing
from autopar.solvers.intra_op_ilp import Solution, SolverTimeout
from autopar.solvers.intra_op_solve import solve_ilp
from autopar.solvers.pipelined_candidate import (PipelineOutcome, RefineLater, refine_modes,
                                                 solve_pipeline)
from autopar.solvers.problem import evaluate
from autopar.solvers.problem_build import Built, build_problem
from autopar.solvers.ranking import Ranking, Scored, SearchBudget
from autopar.solvers.search_bounds import (candidate_bounds, flop_bound, lower_bound_memory,
                                           no_fit_message)
from autopar.solvers.search_space import Candidate, Outcome, candidate_settings, problem_key, tiers
from autopar.strategies.analysis import GraphAnalysis


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


def search(an: GraphAnalysis, cands: list[Candidate], *, hw, gpus_per_node: int,
           precision: str, optimizer: str, memory_budget: float,
           sequence_parallel: bool | None = None, recompute: tuple[str, ...] | None = None,
           loss_parallel: bool | None = None, split_weights: bool = False,
           offload: bool | None = None, time_limit_s: float | None = None, top_k: int = 1,
           progress: Callable[[int, int, float | None], None] | None = None,
           deadline: float | None = None, compile_blocks: bool = False) -> SearchResult:
    """Solve every candidate and return the fastest feasible plan's pieces, trying the
    lists of :func:`tiers` in turn until one has a plan that fits (``offload=True``:
    only CPU offload; False: never). ``recompute`` limits the recomputation modes
    (None: all); ``split_weights`` keeps the layouts that split every block matrix over
    tp (:class:`~autopar.strategies.settings.Settings`); ``compile_blocks`` prices the
    blocks of every candidate without a pipeline as compiled
    (:mod:`autopar.cost_models.compiled`).

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
    builds problems (the fewest-way splits first) for half the time left, and runs past
    the limit only to build one that may fit and to find a first plan; a candidate
    whose problem it did not build enters the gap by
    :func:`~autopar.solvers.search_bounds.flop_bound`.
    ``progress(done, total, best)`` is called after each candidate.

    Raises NoFeasiblePlanError when none fits, naming the least memory a plan needs.
    """
    kw = dict(hw=hw, gpus_per_node=gpus_per_node, precision=precision, optimizer=optimizer,
              memory_budget=memory_budget, sequence_parallel=sequence_parallel,
              loss_parallel=loss_parallel, split_weights=split_weights, recompute=recompute,
              budget=SearchBudget.starting_now(time_limit_s, deadline), top_k=top_k,
              progress=progress, compile_blocks=compile_blocks)
    failed: NoFeasiblePlanError | None = None
    passed: list[str] = []
    order = tiers(cands, gpus_per_node, offload) or [[]]
    for k, tier in enumerate(order):
        res = _search(an, tier, **kw)
        if isinstance(res, NoFeasiblePlanError):  # name the smaller of the minima
            passed.append(str(res))
            if failed is None or getattr(res, "least_bytes", 0.0) < \
                    getattr(failed, "least_bytes", 0.0):
                failed = res
            continue
        res.passed_over = passed
        return _or_split_sequences(an, res, order[k + 1] if k + 1 < len(order) else [], kw)
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
    untimed = not kw["budget"].timed  # its own CP_TIER_PROBLEMS, not the caller's limit
    mine = Scored(res.step_time_s, res.built, res.solution, c, res.pipeline,
                  idle=splits_nothing(res.built, res.solution.choice))
    seed = [mine] + res.runners_up + ([res.set_aside] if res.set_aside else [])
    budget = SearchBudget(kw["budget"].deadline, CP_TIER_PROBLEMS if untimed else None)
    other = _search(an, split, **{**kw, "budget": budget}, unbuilt=unbuilt, seed=seed)
    assert isinstance(other, SearchResult)  # seeded with the plan in hand
    _note_cut(res, unbuilt, len(split), untimed)
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
    won.solution.stats["candidates"] = scored_count(won.outcomes)
    won.solution.stats["search_s"] = res.time_s + time.perf_counter() - t0
    return won


def _note_cut(res: SearchResult, unbuilt: list[Candidate], of: int, budget: bool) -> None:
    """Add to ``res`` a note, when some of the ``of`` context-parallel candidates were
    left ``unbuilt``, saying what ended their search: :data:`CP_TIER_PROBLEMS`
    (``budget``: the gap leaves them out) or the caller's time limit (the gap bounds
    them by :func:`~autopar.solvers.search_bounds.flop_bound`)."""
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
                         f"configurations: they are not scored, and the gap bounds them "
                         f"by their FLOPs at the GPU's peak; a longer limit searches them")


def _set_gap(res: SearchResult, bound_s: float | None) -> None:
    """Lower ``res``'s gap bound to ``bound_s`` (None: nothing more left unproven) and
    state its gap (``solution.stats["gap"]``) when it has one."""
    if bound_s is None:
        return
    res.gap_bound_s = bound_s if res.gap_bound_s is None else min(res.gap_bound_s, bound_s)
    res.solution.stats["gap"] = max(0.0, 1.0 - res.gap_bound_s / res.step_time_s)


def _search(an: GraphAnalysis, cands: list[Candidate], *, hw, gpus_per_node: int,
            precision: str, optimizer: str, memory_budget: float,
            sequence_parallel: bool | None, recompute: tuple[str, ...] | None,
            budget: SearchBudget, top_k: int, loss_parallel: bool | None = None,
            split_weights: bool = False, compile_blocks: bool = False,
            progress: Callable[[int, int, float | None], None] | None,
            unbuilt: list[Candidate] | None = None,
            seed: list[Scored] | None = None) -> SearchResult | NoFeasiblePlanError:
    """:func:`search` over ``cands`` as given, within ``budget``: its result, or the
    error saying why none fits (returned, not raised: the caller tries the next tier).
    ``seed``: plans an earlier search kept, fastest first, which prune this one from
    its start and stay in its ranking (ahead of its own on ties); its result may be
    ``seed[0]`` itself. With a seed the budget may end this search before it builds
    every candidate's problem (those go to ``unbuilt``, as do those past its
    ``max_built`` problems); without one, it runs past the deadline to build a problem
    that may fit and find a plan."""
    t0 = time.perf_counter()
    ranking = Ranking(top_k, seed or [])
    have_plan = bool(seed)
    outcomes: list[Outcome] = []
    infeasible: list[tuple[Candidate, Built]] = []
    built_by = _build_all(an, cands, hw=hw, gpus_per_node=gpus_per_node, precision=precision,
                          optimizer=optimizer, memory_budget=memory_budget,
                          sequence_parallel=sequence_parallel, recompute=recompute,
                          loss_parallel=loss_parallel, split_weights=split_weights,
                          compile_blocks=compile_blocks, budget=budget.halfway(),
                          need_one=not have_plan)
    if unbuilt is not None:
        unbuilt.extend(c for c in cands if isinstance(built_by[problem_key(c)], _NotBuilt))
    bound = candidate_bounds(an.graph, cands, built_by, memory_budget)
    timed_out = [c for c in cands  # their problems left unbuilt by the time limit
                 if isinstance(built_by[problem_key(c)], _OutOfTimeBuilding)]
    unproven: list[float] = [flop_bound(an.graph, c, hw, precision) for c in timed_out]
    order = sorted(range(len(cands)), key=lambda k: (bound[k], k))
    rank = {k: i for i, k in enumerate(order)}  # ties between equal plans go by it
    if top_k > 1:  # cheap ILPs first: their plans tighten the k-th best time before
        order.sort(key=lambda k: cands[k].pp > 1)  # the pipelines' stage splits run
    solved: dict[tuple, object] = {}  # unproven: the bounds of candidates left unsolved

    def out_of_time() -> bool:
        """Whether the deadline has passed and a plan is in hand (here or the caller's)."""
        return budget.passed() and (ranking.leader is not None or have_plan)

    def score(k: int, refine: bool, beat: float | None = None) -> Scored | _Deferred | None:
        """:func:`_score` of candidate ``k`` against the k-th best time found (``beat``:
        against that time instead, which a search of the modes need beat to matter for
        the plan); one whose ILP the time limit cut short leaves its bound in
        ``unproven``."""
        c = cands[k]
        left = budget.seconds_left() if ranking.kept else None
        limit = ranking.limit if beat is None else beat
        try:
            scored = _score(an, c, built_by[problem_key(c)], bound[k], limit, solved, outcomes,
                            infeasible, refine=refine, time_limit_s=left,
                            pruned=None if beat is None or top_k == 1 else RUNNER_UP_PRUNED)
        except SolverTimeout:
            outcomes.append(Outcome(c, None, None, "not solved: the search's time limit"))
            unproven.append(bound[k])
            return None
        if isinstance(scored, Scored):
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
        scored = score(k, refine=False)
        if scored is DEFERRED:
            later.append(k)
            continue
        ranking.place(scored)
        if progress is not None:
            leader = ranking.leader  # what would be returned now
            progress(done + 1, len(order), leader.step_time_s if leader else None)
    for i, j in enumerate(later):  # the deferred searches, in their bounds' order
        if out_of_time():
            unproven.extend(bound[x] for x in later[i:])
            break
        kept = ranking.kept
        if kept and kept[0].step_time_s <= bound[j] < ranking.limit:
            outcomes.append(Outcome(cands[j], None, None, RUNNER_UP_UNREFINED))
            continue
        again = score(j, refine=True, beat=kept[0].step_time_s if kept else None)
        assert not isinstance(again, _Deferred)  # refined: solved or dropped
        ranking.place(again)
    best = ranking.settle()  # a seed guarantees one
    if best is None and timed_out:  # no first plan yet: the rest is built, whatever the time
        res = _search(an, timed_out, hw=hw, gpus_per_node=gpus_per_node, precision=precision,
                      optimizer=optimizer, memory_budget=memory_budget,
                      sequence_parallel=sequence_parallel, recompute=recompute,
                      budget=SearchBudget(), top_k=top_k, loss_parallel=loss_parallel,
                      split_weights=split_weights, compile_blocks=compile_blocks,
                      progress=progress)
        if isinstance(res, SearchResult):
            res.outcomes = [o for o in outcomes if o.candidate not in timed_out] + res.outcomes
            res.solution.stats["candidates"] = scored_count(res.outcomes)
        return res
    if best is None:
        err = NoFeasiblePlanError(no_fit_message(an.graph, infeasible, memory_budget, outcomes,
                                                  recompute))
        err.least_bytes = min((lower_bound_memory(an.graph, b, c) for c, b in infeasible),
                              default=float("inf"))
        return err
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
    res = SearchResult(best.built, best.solution, outcomes, time.perf_counter() - t0,
                       best.candidate, best.pipeline, ranking.runners_up(best),
                       step_time_s=best.step_time_s)
    res.set_aside = ranking.set_aside(best)
    res.solution.stats["candidates"] = scored_count(outcomes)
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


def _build_all(an: GraphAnalysis, cands: list[Candidate], *, hw, gpus_per_node: int,
               precision: str, optimizer: str, memory_budget: float,
               sequence_parallel: bool | None, recompute: tuple[str, ...] | None,
               loss_parallel: bool | None = None, split_weights: bool = False,
               compile_blocks: bool = False, budget: SearchBudget = SearchBudget(),
               need_one: bool = False
               ) -> dict[tuple, Built | NoFeasiblePlanError]:
    """One intra-op problem per distinct :func:`problem_key` (or the error saying an op has
    no strategy on that mesh, or that a smaller micro-batch already needs more memory
    than the budget, or :class:`_NotBuilt` past ``budget.max_built`` problems, or
    :class:`_OutOfTimeBuilding` past ``budget.deadline`` — with ``need_one``, only once a
    problem whose memory bound fits is built, so that a first plan can be found).

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
        users.setdefault(problem_key(c), []).append(c)
    hopeless: dict[tuple, int] = {}  # batch group -> the micro-batch size that did not fit
    built_count = 0
    fitting = not need_one or not budget.timed  # a problem that may hold a plan is built

    def first(c: Candidate) -> tuple:
        """With a budget, the fewest-way splits first (cp, then pp, then tp)."""
        return (c.cp, c.pp, c.tp) if budget.timed or budget.max_built is not None else ()
    order = sorted(users, key=lambda k: (first(users[k][0]), _batch_group(users[k][0]),
                                         users[k][0].microbatch_size))
    # whether a larger micro-batch of the same group follows (only then is a bound worth it)
    larger = {k: nxt is not None and _batch_group(users[nxt][0]) == _batch_group(users[k][0])
              for k, nxt in zip(order, order[1:] + [None])}
    for key in order:
        c = users[key][0]
        group = _batch_group(c)
        if fitting and budget.passed():
            built_by[key] = _OutOfTimeBuilding(UNBUILT_IN_TIME)
            continue
        if budget.max_built is not None and built_count >= budget.max_built:
            built_by[key] = _NotBuilt("not scored: the search's budget of problems ran out "
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
                                loss_parallel=loss_parallel, split_weights=split_weights,
                                compile_blocks=compile_blocks)
        built_count += 1
        try:
            built = built_by[key] = build_problem(an, st, layouts)
        except NoFeasiblePlanError as e:
            built_by[key] = e
            continue
        if fitting and not larger.get(key):
            continue
        by_schedule = {u.schedule: u for u in users[key]}  # one pp per key: dp and tp fix it
        if all(lower_bound_memory(an.graph, built, u) > memory_budget * (1 + 1e-9)
               for u in by_schedule.values()):
            if larger.get(key):
                hopeless[group] = c.microbatch_size
        else:
            fitting = True
    return {k: built_by[k] for k in users}


UNBUILT_IN_TIME = "not scored: the search's time limit ran out before its problem was built"
"""The outcome of a candidate whose problem the time limit left unbuilt."""


def scored_count(outcomes: list[Outcome]) -> int:
    """How many of ``outcomes`` the search looked at (``solution.stats["candidates"]``):
    all but those whose problem the time limit left unbuilt."""
    return sum(o.reason != UNBUILT_IN_TIME for o in outcomes)


class _NotBuilt(NoFeasiblePlanError):
    """A candidate whose problem the search left unbuilt (it may well fit)."""


class _OutOfTimeBuilding(_NotBuilt):
    """A candidate whose problem the search's time limit left unbuilt: its bound is
    :func:`~autopar.solvers.search_bounds.flop_bound`."""


def _batch_group(c: Candidate) -> tuple:
    """What candidates share but for the cut of each rank's samples into micro-batches
    (one micro-batch apart: it keeps no gradients between micro-batches)."""
    return (c.dp, c.tp, c.pp, c.zero, c.offload, c.ep, c.split_experts,
            c.num_microbatches == 1, c.cp, c.cp_variant, c.fold_experts)


class _Deferred:
    """What :func:`_score` returns for a pipelined candidate whose recomputation modes
    must be searched with its stage split (many ILPs): the search visits it again once
    every candidate has been, when the best plan found prunes most of that search."""


DEFERRED = _Deferred()
"""The one :class:`_Deferred` (compared by identity)."""


def _score(an: GraphAnalysis, c: Candidate, built: Built | NoFeasiblePlanError, bound: float,
           limit: float, solved: dict, outcomes: list[Outcome],
           infeasible: list[tuple[Candidate, Built]], refine: bool = True,
           time_limit_s: float | None = None, pruned: str | None = None
           ) -> Scored | _Deferred | None:
    """Solve candidate ``c`` unless it cannot fit or cannot beat ``limit`` (the time a
    plan must beat to be kept); record its outcome either way. Without ``refine``, a
    pipelined candidate that would search its modes is :data:`DEFERRED` instead (and
    records nothing). ``time_limit_s`` bounds its intra-op ILP without a pipeline
    (:func:`~autopar.solvers.intra_op_solve.solve_ilp`: SolverTimeout when it found
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
        except RefineLater:
            return DEFERRED
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
