"""Planning from start to end: :func:`make_plan` runs capture → analysis → candidates →
search → assembly → notes, and returns the :class:`~autopar.plans.Plan`.

:func:`autopar.plan` and :func:`autopar.estimate` are its public faces (they read the
keywords into a :class:`~autopar.spec.Spec` and find the cluster); the checks of what
it is given are in :mod:`autopar.planner_inputs`. Whether the model can be cut into
pipeline stages is asked of the cut the runtime makes
(:func:`autopar.pipeline_split.pipeline_blocker`, in the capture layer), once, and
only when pipelining was asked for or a pipelined configuration won the search; a
model it cannot cut is then searched again without pipelines.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from torch import nn

from autopar.assemble import add_pipeline, assemble, runner_up
from autopar.batch_default import asked_source, example_source
from autopar.capture import capture
from autopar.cluster import Cluster
from autopar.cost_models.compiled import compiles_where_it_pays
from autopar.cost_models.float8 import FP8, element_dtype, float8_rate_ratio
from autopar.cost_models.hardware import HardwareProfile
from autopar.cost_models.memory import OPTIMIZERS, PRECISIONS
from autopar.errors import ConfigError, NoFeasiblePlanError
from autopar.explain import check_explain, explain_layouts
from autopar.pipeline_split import pipeline_blocker
from autopar.planner_inputs import (attention_heads, check_heads, check_imbalance,
                                    check_pipeline_depth, check_search_options, cp_variants,
                                    expert_count, expert_folding,
                                    global_batch as batch_size,
                                    memory_budget_bytes)
from autopar.plans import Plan, model_fingerprint
from autopar.solvers.idle_axis import splits_nothing
from autopar.solvers.outer_search import SearchResult, search
from autopar.solvers.search_space import Candidate, candidates
from autopar.spec import Spec, check_choice
from autopar.strategies.analysis import GraphAnalysis, analyze
from autopar.summary import set_aside_note

if TYPE_CHECKING:
    import torch

__all__ = ["RING_NOTE", "make_plan"]


@contextlib.contextmanager
def _collect_less() -> Iterator[None]:
    """Python's cyclic garbage collector run every 100,000 allocations instead of 700
    while a plan is made, then as before. Planning allocates millions of small objects
    (strategies, costs, solver terms) that die young without cycles; the default
    collections took 0.6 s of a 6 s plan of Llama 3 8B on 64 H100 (598 of them)."""
    threshold = gc.get_threshold()
    gc.set_threshold(100_000, *threshold[1:])
    try:
        yield
    finally:
        gc.set_threshold(*threshold)


@dataclass(frozen=True)
class _Asked:
    """What a search is asked for, checked: the cluster's profile ``hw``, the memory
    ``budget`` per device in bytes, the global batch ``gb`` and its words
    ``batch_source``."""

    cluster: Cluster
    hw: HardwareProfile
    budget: float
    gb: int
    batch_source: str


def _check_asked(model_inputs: Any, *, cluster: Any, global_batch: int | None,
                 loss_fn: Any, precision: str, optimizer: str, memory_budget: Any,
                 spec: Spec, expert_imbalance: Any, time_limit_s: Any, top_k: Any) -> _Asked:
    """Every option of :func:`make_plan` checked before anything is captured."""
    check_choice("precision", precision, PRECISIONS)
    check_choice("optimizer", optimizer, OPTIMIZERS)
    check_imbalance(expert_imbalance)
    check_search_options(time_limit_s, loss_fn)
    if not isinstance(top_k, int) or top_k < 1:
        raise ConfigError(f"top_k={top_k!r}: expected a positive integer (1 = the best plan "
                          f"only)")
    if not isinstance(cluster, Cluster):
        raise ConfigError(f"cluster must be an autopar.Cluster, got {type(cluster).__name__}")
    hw = cluster.hardware()
    if precision == FP8:
        float8_rate_ratio(hw)  # raises where the GPU has no float8 tensor cores
    budget = memory_budget_bytes(memory_budget, hw)
    gb = batch_size(global_batch, model_inputs)
    if spec.tp is not None and cluster.world_size % spec.tp:
        raise ConfigError(f"tp={spec.tp} does not divide the {cluster.world_size} devices of "
                          f"the cluster")
    source = example_source("global_batch=") if global_batch is None else \
        asked_source("global_batch=")
    return _Asked(cluster, hw, budget, gb, source)


def _candidates(an: GraphAnalysis, spec: Spec, asked: _Asked,
                expert_imbalance: float) -> list[Candidate]:
    """The configurations ``spec`` leaves open on the analysed graph."""
    graph = an.graph
    return candidates(asked.cluster.world_size, asked.gb, dp=spec.dp, tp=spec.tp, pp=spec.pp,
                      microbatch_size=spec.microbatch_size, zero=spec.zero,
                      schedule=spec.schedule, virtual_stages=spec.virtual_stages,
                      num_units=len(graph.layers) + 2 if graph.layers else 1,
                      heads=attention_heads(graph), ep=spec.ep,
                      experts=expert_count(an, spec.ep),
                      expert_imbalance=float(expert_imbalance), cp=spec.cp,
                      seq_len=graph.seq_len or 0, cp_variants=cp_variants(an, spec),
                      cp_variant=spec.cp_variant, cp_with_pp=not an.sequence.masked,
                      fold=expert_folding(an, spec.expert_tp))


def _pipeline_refusal(model: nn.Module, example_inputs: Any, an: GraphAnalysis,
                      pp: int | None) -> str | None:
    """Why pipeline parallelism is left out of the plan, or None, by the runtime's own
    cut (:func:`~autopar.pipeline_split.pipeline_blocker`), so a model it cannot cut is
    never offered pp > 1. A ``pp`` the caller asked for raises ConfigError with the
    reason instead."""
    reason = pipeline_blocker(model, example_inputs, [lay.path for lay in an.graph.layers])
    if reason is None:
        return None
    if pp is not None:
        raise ConfigError(f"pp={pp} cannot run: {reason}")
    return f"pipeline parallelism left out of the plan: {reason}"


@_collect_less()
def _compiled_if_faster(res: SearchResult, solve: Callable[[Candidate], SearchResult]
                        ) -> SearchResult:
    """The configuration search result ``res`` chose, solved again by ``solve(candidate)``
    with its blocks compiled (:mod:`autopar.cost_models.compiled`), where it has no
    pipeline; kept when faster and its ``tp`` still splits something (a compiled layout
    may win by replicating everything over tp, which the search sets aside:
    :mod:`autopar.solvers.idle_axis`). The runners-up and notes stay ``res``'s."""
    c = res.candidate
    if c is None or c.pp > 1:
        return res
    try:
        other = solve(c)
    except NoFeasiblePlanError:
        return res
    if other.candidate != c or other.set_aside is not None or \
            splits_nothing(other.built, other.solution.choice) or \
            other.step_time_s >= res.step_time_s:
        return res
    other.runners_up, other.set_aside, other.outcomes = res.runners_up, res.set_aside, \
        res.outcomes
    other.notes, other.passed_over = res.notes, res.passed_over
    searched = res.solution.stats  # the search's counts stand; the solution's own are new
    stats = other.solution.stats
    stats["candidates"] = searched.get("candidates", 0)
    stats["search_s"] = searched.get("search_s", 0.0) + stats.get("search_s", 0.0)
    if "gap" in searched:
        stats["gap"] = searched["gap"]
    other.gap_bound_s = res.gap_bound_s
    return other


def _search(model: nn.Module, example_inputs: Any, an: GraphAnalysis,
            cands: list[Candidate], spec: Spec, asked: _Asked, *, precision: str, optimizer: str,
            time_limit_s: float | None, top_k: int,
            progress: Callable[[int, int, float | None], None] | None
            ) -> tuple[SearchResult, str | None]:
    """The search over ``cands``: (its result, why pipelining was left out or None).
    The time limit bounds the search as a whole, a second one without pipelines
    included."""
    deadline = None if time_limit_s is None else time.perf_counter() + time_limit_s

    def run(cs: list[Candidate], compile_blocks: bool = bool(spec.compile),
            top: int = top_k) -> SearchResult:
        return search(an, cs, hw=asked.hw, gpus_per_node=asked.cluster.gpus_per_node,
                      precision=precision, optimizer=optimizer, memory_budget=asked.budget,
                      sequence_parallel=spec.sequence_parallel,
                      loss_parallel=spec.loss_parallel,
                      split_weights=bool(spec.split_weights),
                      recompute=(spec.recompute,) if spec.recompute is not None else None,
                      offload=spec.offload, top_k=top, progress=progress,
                      deadline=deadline, compile_blocks=compile_blocks)

    pipelines_asked = (spec.pp or 1) > 1
    if pipelines_asked:  # a model that cannot be cut is an error
        _pipeline_refusal(model, example_inputs, an, spec.pp)
    try:
        res = run(cands)
    except NoFeasiblePlanError as e:
        if spec.cp == 1 and an.sequence is not None and an.sequence.splittable:
            more = NoFeasiblePlanError(f"{e} Context parallelism (leave cp out, or cp > 1) "
                                       f"would split each sequence's activations over cp "
                                       f"ranks.")
            more.least_bytes = getattr(e, "least_bytes", None)
            raise more from None
        raise
    refusal = None
    # whether the runtime can cut the model into stages is asked only of a search that
    # kept a pipeline (a second export): one it cannot cut is searched again without
    if not pipelines_asked and any(r.candidate is not None and r.candidate.pp > 1
                                   for r in [res, *res.runners_up]):
        refusal = _pipeline_refusal(model, example_inputs, an, spec.pp)
        if refusal:
            res = run([c for c in cands if c.pp == 1])
    if spec.compile is None and compiles_where_it_pays(asked.hw) and an.graph.layers:
        res = _compiled_if_faster(res, lambda c: run([c], True, 1))
    return res, refusal


def _whole_vocabularies(model: nn.Module, plan: Plan) -> list[str]:
    """Notes for the embeddings of ``model`` that the plan's ``tp`` does not divide: their
    weights (and a head tied to them) stay whole on every tp rank, as the plan's
    placements say, where a padded vocabulary would be split."""
    tp = plan.degree("tp")
    if tp <= 1 or "tp" not in plan.stage_mesh:
        return []
    axis = list(plan.stage_mesh).index("tp")
    return [f"tp={tp} does not divide the {m.num_embeddings} rows of embedding '{path}': "
            f"its weight stays whole on every tp rank; pad the vocabulary to a multiple of "
            f"{tp} (as Megatron-LM does) to split it"
            for path, m in model.named_modules()
            if isinstance(m, nn.Embedding) and m.num_embeddings % tp
            and plan.params.get(f"{path}.weight", ["R"] * (axis + 1))[axis] == "R"]


def _input_specs(example_inputs: Any, global_batch: int) -> list[dict]:
    """``Plan.inputs``: each example input's shape with the global batch, and dtype."""
    xs = example_inputs if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    return [{"shape": [global_batch, *(int(d) for d in x.shape[1:])],
             "dtype": str(x.dtype).removeprefix("torch.")} for x in xs]


def _assembled(an: GraphAnalysis, res: SearchResult, asked: _Asked, precision: str) -> Plan:
    """The plan of the search's result, its set-aside configuration named in a note and
    its runners-up attached. MFU is against bf16's peak under fp8, as torchtitan and
    NeMo report float8 runs."""
    hw = asked.hw
    peak = hw.matmul_flops.get(element_dtype(precision), hw.matmul_flops.get("fp32", 1.0))
    graph = an.graph

    def make(r: Any) -> Plan:
        p = assemble(an, r.built, r.solution, cluster_desc=asked.cluster.describe(),
                     global_batch=asked.gb, peak_flops=peak)
        if r.pipeline is not None and r.candidate is not None:
            c = r.candidate
            add_pipeline(p, r.pipeline, pp=c.pp, schedule=c.schedule,
                         virtual_stages=c.virtual_stages,
                         model_flops=3.0 * graph.forward_flops * asked.gb / graph.batch_size,
                         peak_flops=peak)
        return p

    plan = make(res)
    if res.set_aside is not None:
        plan.notes.append(set_aside_note(plan, make(res.set_aside)))
    plan.runners_up = [runner_up(plan, make(r)) for r in res.runners_up]
    return plan


RING_NOTE = ("cp_variant='ring': autopar's runtime runs the ring in a reference form (each "
             "block's scores written out for the log-sum-exp merge), slower and larger than "
             "its price, which is a flash kernel's; the all-gather and Ulysses variants run "
             "as priced")
"""The note of a plan whose context parallelism is the ring (asked for: the search does
not choose it, :data:`autopar.cost_models.context_parallel.SEARCHED_VARIANTS`)."""


def _notes(plan: Plan, res: SearchResult, spec: Spec, refusal: str | None,
           time_limit_s: float | None) -> list[str]:
    """The notes a search adds to its plan: why pipelining was left out, the search's
    own, compilation, the ring's reference form, context parallelism chosen for memory,
    and an unproven gap."""
    notes = [refusal] if refusal else []
    notes.extend(res.notes)
    if plan.compile_blocks:
        notes.append(f"each block compiled with torch.compile (priced so: fused "
                     f"memory-bound kernels, no per-op dispatch; about "
                     f"{plan.compile_s:.0f} s to compile, once); compile=False runs "
                     f"them eager")
    if plan.context is not None and plan.context.variant == "ring":
        notes.append(RING_NOTE)
    if plan.context is not None and spec.cp is None and res.passed_over:
        why = res.passed_over[-1].split(" Raise memory_budget")[0]
        notes.append(f"context parallelism, because without it (and without tensor "
                     f"parallelism across nodes or offload) {why}")
    if "gap" in plan.solver:
        why = f"the search stopped at its time limit of {time_limit_s} s" \
            if time_limit_s is not None else \
            "where the host bounds the step, some layouts were not proven best in the " \
            "solver's time (docs/solvers.md, intra_op_host)"
        notes.append(f"{why}; no plan it did not solve to the end can be more than "
                     f"{plan.solver['gap'] * 100:.1f}% faster")
    return notes


def make_plan(model: nn.Module, example_inputs: Any, *, cluster: Cluster, spec: Spec,
              global_batch: int | None = None, loss_fn: Callable | None = None,
              precision: str = "bf16", optimizer: str = "adamw",
              memory_budget: float | None = None,
              example_targets: torch.Tensor | None = None, expert_imbalance: float = 1.0,
              time_limit_s: float | None = None, top_k: int = 1,
              progress: Callable[[int, int, float | None], None] | None = None,
              name: str | None = None, explain: list[str] | str | None = None) -> Plan:
    """The fastest plan that fits among the configurations ``spec`` leaves open (its
    fields already checked by :class:`~autopar.spec.Spec`); the other options are
    :func:`autopar.plan`'s.

    Raises:
        ConfigError: an option is invalid for this model or cluster (the message says
            which and what to try).
        NoFeasiblePlanError: no configuration fits in memory.
    """
    asked = _check_asked(example_inputs, cluster=cluster, global_batch=global_batch,
                         loss_fn=loss_fn, precision=precision, optimizer=optimizer,
                         memory_budget=memory_budget, spec=spec,
                         expert_imbalance=expert_imbalance, time_limit_s=time_limit_s,
                         top_k=top_k)
    graph = capture(model, example_inputs, loss_fn=loss_fn, example_targets=example_targets,
                    name=name)
    check_heads(graph, spec.tp or 1)
    explain = check_explain(graph, explain)
    an = analyze(graph)
    check_pipeline_depth(spec.pp, len(graph.layers))
    cands = _candidates(an, spec, asked, expert_imbalance)
    if spec.compile and not graph.layers:
        raise ConfigError("compile=True compiles the model's repeated blocks, and autopar "
                          "found none in this model; leave compile out")
    res, refusal = _search(model, example_inputs, an, cands, spec, asked, precision=precision,
                           optimizer=optimizer, time_limit_s=time_limit_s, top_k=top_k,
                           progress=progress)
    plan = _assembled(an, res, asked, precision)
    plan.batch_source = asked.batch_source
    plan.solver["memory_budget_bytes"] = asked.budget
    plan.explanations = explain_layouts(an, res.built, res.solution, explain, asked.budget)
    plan.inputs = _input_specs(example_inputs, asked.gb)
    plan.model_hash = model_fingerprint(model)
    plan.notes.extend(_whole_vocabularies(model, plan))
    plan.notes.extend(_notes(plan, res, spec, refusal, time_limit_s))
    return plan
