"""The public entry points: :func:`plan`, :func:`estimate` and :func:`parallelize`."""

from __future__ import annotations

import contextlib
import gc
import math
import os
import time
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Callable

from autopar.batch_default import asked_source, example_source
from autopar.cluster import Cluster
from autopar.cost_models.float8 import NOT_RUN as FP8_NOT_RUN, FP8, element_dtype, float8_rate_ratio
from autopar.cost_models.memory import OPTIMIZERS, PRECISIONS
from autopar.errors import ConfigError, NoFeasiblePlanError
from autopar.spec import Spec, check_choice, split_space

if TYPE_CHECKING:
    import torch

    from autopar.plans import Plan
    from autopar.runtime import ParallelModel
    from autopar.solvers.outer_search import SearchResult


def _budget(memory_budget: float | None, hw) -> float:
    """The memory budget per device in bytes: ``memory_budget``, or the GPU's memory
    less the profile's reserve when it is None."""
    if memory_budget is None:
        return float(hw.usable_memory_bytes)
    if not _positive_number(memory_budget):
        raise ConfigError(f"memory_budget={memory_budget!r}: expected a positive number of "
                          f"bytes per device, e.g. 40e9 (None: the GPU's memory less the "
                          f"profile's reserve)")
    return float(memory_budget)


def _positive_number(value: Any) -> bool:
    """Whether ``value`` is a finite number above 0 (not a bool, NaN or infinity)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and \
        math.isfinite(value) and value > 0


def _check_search_options(time_limit_s: Any, loss_fn: Any) -> None:
    """``time_limit_s`` is None or a finite number of seconds, 0 or more (0: the first
    plan found); ``loss_fn`` is None or callable."""
    if time_limit_s is not None and not (_positive_number(time_limit_s) or (
            type(time_limit_s) in (int, float) and time_limit_s == 0)):
        raise ConfigError(f"time_limit_s={time_limit_s!r}: expected a number of seconds, 0 or "
                          f"more (None: search until the best plan is proven)")
    if loss_fn is not None and not callable(loss_fn):
        raise ConfigError(f"loss_fn={loss_fn!r}: expected a function loss_fn(output, targets) "
                          f"returning a scalar tensor (None: cross-entropy over the output's "
                          f"last dim)")


def detect_cluster() -> Cluster:
    """The cluster of the running job: world size from torch.distributed (1 if not
    initialized), CUDA → the shipped profile matching the GPU name
    (:func:`profile_for_gpu`), otherwise ``cpu``."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    gpu = profile_for_gpu(torch.cuda.get_device_name()) if torch.cuda.is_available() else "cpu"
    per_node = local if local > 0 and world % local == 0 else world
    return Cluster(gpu=gpu, nodes=world // per_node, gpus_per_node=per_node)


GPU_PROFILES = (("h200", "h200"), ("h100", "h100-sxm"), ("a100", "a100-80g"))
"""(substring of the CUDA device name, shipped profile), first match wins."""


def profile_for_gpu(device_name: str) -> str:
    """The shipped hardware profile for a CUDA device name; for a GPU without one, the
    H100's, with a warning that says how to measure this GPU instead."""
    name = device_name.lower()
    for part, profile in GPU_PROFILES:
        if part in name:
            return profile
    warnings.warn(f"autopar has no hardware profile for the GPU {device_name!r}; planning "
                  f"with the H100's (h100-sxm). Run `autopar profile --out gpu.json` on it "
                  f"and pass Cluster(profile='gpu.json') to plan with its own figures",
                  stacklevel=3)
    return "h100-sxm"


TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _join_torchrun_job(collective_timeout_s: float | None = None) -> None:
    """Initialize the default process group from torchrun's environment when none exists.

    torchrun sets ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``; the
    backend is NCCL when CUDA is available (each rank on the GPU ``LOCAL_RANK``), gloo
    otherwise. Its collectives wait for a peer
    :func:`~autopar.runtime.agree.collective_timeout` (``collective_timeout_s``, else
    ``AUTOPAR_COLLECTIVE_TIMEOUT_S``, else 300 s) before they fail, so a dead or stuck
    rank is reported instead of waited on. An existing process group is kept as it is.

    Raises:
        ConfigError: no process group exists and the process was not started by torchrun,
            or the timeout is not a positive number of seconds.
    """
    import torch
    import torch.distributed as dist

    from autopar.runtime.agree import collective_timeout

    if not dist.is_available():
        raise ConfigError("this build of torch has no torch.distributed; install one that has "
                          "it to run a plan")
    if dist.is_initialized():
        return
    missing = [k for k in TORCHRUN_ENV if not os.environ.get(k)]
    if missing:
        raise ConfigError(f"parallelize() must run inside a distributed job, but no process "
                          f"group exists and {', '.join(missing)} "
                          f"{'is' if len(missing) == 1 else 'are'} not set: start the script "
                          f"with torchrun (e.g. torchrun --nproc-per-node 4 train.py), or call "
                          f"torch.distributed.init_process_group first")
    timeout = collective_timeout(collective_timeout_s)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0:  # a first attempt
        dist.init_process_group(backend, timeout=timeout)
        return
    from autopar.runtime.checkpoint_state import attempt_store

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(backend, store=attempt_store(rank, world, timeout), rank=rank,
                            world_size=world, timeout=timeout)


def _batch_of(example_inputs: Any) -> int:
    """The batch size of ``example_inputs``: dim 0 of its first tensor."""
    import torch

    if isinstance(example_inputs, dict):
        raise ConfigError(f"example_inputs is a dict ({', '.join(map(str, example_inputs))}): "
                          f"keyword inputs are not captured; pass the forward's inputs "
                          f"positionally, as a tuple in its order, or wrap the model in a "
                          f"module whose forward takes them positionally")
    if isinstance(example_inputs, (tuple, list)) and not example_inputs:
        raise ConfigError("example_inputs is empty; pass one global batch of the forward's "
                          "positional inputs, e.g. (token_ids,)")
    first = example_inputs[0] if isinstance(example_inputs, (tuple, list)) else example_inputs
    if not isinstance(first, torch.Tensor) or first.dim() == 0:
        got = "a 0-d tensor" if isinstance(first, torch.Tensor) else type(first).__name__
        raise ConfigError(f"example_inputs must be a tensor or a tuple of tensors whose first "
                          f"dim is the batch, but its first input is {got}; pass one global "
                          f"batch of the forward's positional inputs, e.g. (token_ids,)")
    return int(first.shape[0])


def _global_batch(global_batch: int | None, example_inputs: Any) -> int:
    """``global_batch``, or the batch of ``example_inputs`` when it is None."""
    gb = global_batch if global_batch is not None else _batch_of(example_inputs)
    if not isinstance(gb, int) or gb < 1:
        raise ConfigError(f"global_batch={global_batch!r}: expected a positive integer")
    return gb


def _heads(graph) -> int | None:
    """The greatest common divisor of every attention's head count (None: no attention)."""
    counts = [n.out.shape[-3] for n in graph.nodes
              if n.target.startswith("aten.scaled_dot_product_attention") and n.out is not None
              and len(n.out.shape) >= 3]
    return math.gcd(*counts) if counts else None


def _whole_vocabularies(model, plan: "Plan") -> list[str]:
    """Notes for the embeddings of ``model`` that the plan's ``tp`` does not divide: their
    weights (and a head tied to them) stay whole on every tp rank, as the plan's
    placements say, where a padded vocabulary would be split."""
    from torch import nn

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


def _check_heads(graph, tp: int) -> None:
    """A forced tensor-parallel degree must divide every attention's head count."""
    if tp <= 1:
        return
    for n in graph.nodes:
        if n.target.startswith("aten.scaled_dot_product_attention") and n.out is not None \
                and len(n.out.shape) >= 3:
            heads = n.out.shape[-3]
            if heads % tp:
                raise ConfigError(
                    f"tensor-parallel degree tp={tp} does not divide the {heads} attention heads "
                    f"of module '{n.module_path}'; choose tp among "
                    f"{[d for d in range(1, heads + 1) if heads % d == 0]}")


def _check_imbalance(value: Any) -> None:
    """``expert_imbalance`` must be a number of at least 1."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 1:
        raise ConfigError(f"expert_imbalance={value!r}: expected a number of at least 1 (the "
                          f"busiest expert-parallel rank's tokens over the mean; 1 = even)")


def _experts(an, ep: int | None) -> int:
    """How many experts every expert module of the analysed graph has in common (their
    gcd; 0 without any), checked against an ``ep`` asked for."""
    counts = [em.experts for em in an.experts.values()]
    common = math.gcd(*counts) if counts else 0
    if ep is not None and ep > 1:
        if not counts:
            from autopar.strategies.experts import expert_lists, refused_gathered

            lists = expert_lists(an.graph)
            if lists:
                path, n = next(iter(sorted(lists.items())))
                raise ConfigError(
                    f"ep={ep}: the experts of '{path}' are a list of {n} modules, each run "
                    f"on its own in the forward; expert parallelism splits experts stacked "
                    f"in one module (one weight of shape (experts, ...) per projection, as "
                    f"transformers 5's MoE layers and autopar.examples.moe hold them). "
                    f"Stack them, or leave ep out: data, tensor and pipeline parallelism "
                    f"still split these layers")
            refused = refused_gathered(an.graph, an.rules, an.batch_label, an.output_ops,
                                       an.batch_dim)
            if refused:
                path, why = next(iter(sorted(refused.items())))
                raise ConfigError(
                    f"ep={ep}: '{path}' runs every expert on every token, a gate combining "
                    f"them, but {why}; expert parallelism cannot split it so. Change that, "
                    f"or leave ep out: data, tensor and pipeline parallelism still split it")
            raise ConfigError(f"ep={ep}: the model has no expert modules (a module whose "
                              f"parameters stack one weight per expert, run per expert); "
                              f"leave ep out for a dense model")
        if common % ep:
            raise ConfigError(f"ep={ep} does not divide the {common} experts of the model's "
                              f"mixture-of-experts layers; choose an ep that divides {common}")
    return common


def _cp_variants(an, spec: Spec) -> tuple[str, ...]:
    """The context-parallel variants the search may try on the analysed graph: all,
    or none where the sequence cannot be split (ConfigError naming where, when ``cp``
    > 1 was asked for, or a sequence 2·cp does not divide)."""
    from autopar.cost_models.context_parallel import VARIANTS

    seq = an.sequence
    asked = spec.cp is not None and spec.cp > 1
    if seq is None or not seq.splittable:
        if asked:
            raise ConfigError(f"cp={spec.cp}: {seq.refusal if seq else 'no sequence'}")
        return ()
    if asked and (spec.pp or 1) > 1 and seq.masked:
        raise ConfigError(f"cp={spec.cp} with pp={spec.pp}: the model's attention reads a "
                          f"mask its code builds from positions (a Hugging Face model's, "
                          f"traced), which a pipeline stage would compute from each rank's "
                          f"share of the sequence; leave pp or cp out")
    if asked and seq.length % (2 * spec.cp):
        raise ConfigError(f"cp={spec.cp} cuts each sequence into {2 * spec.cp} head-tail "
                          f"chunks (equal causal work per rank), which do not divide "
                          f"{seq.length} tokens; choose a cp that divides {seq.length // 2}")
    return VARIANTS


def _check_pipeline_depth(pp: int | None, num_blocks: int) -> None:
    """Pipelining needs a pipeline unit per stage: the repeated blocks and what comes
    before and after them."""
    if pp is not None and pp > 1 and pp > num_blocks + 2:
        raise ConfigError(f"pp={pp} needs at least {pp} pipeline units but the model has "
                          f"{num_blocks} repeated blocks (+ what comes before and after "
                          f"them); choose pp <= {num_blocks + 2}")


def _unsplittable_for_pipelining(model, example_inputs, graph, pp: int | None) -> str | None:
    """Why pipeline parallelism is left out of the plan, or None. The runtime cuts
    stages from the model's exported program at its blocks, and this asks the
    runtime's own cut (:func:`autopar.runtime.pipeline_split.pipeline_blocker`), so a
    model it cannot cut is never offered pp > 1. A ``pp`` the caller asked for raises
    ConfigError with the reason instead."""
    from autopar.runtime.pipeline_split import pipeline_blocker

    reason = pipeline_blocker(model, example_inputs, [lay.path for lay in graph.layers])
    if reason is None:
        return None
    if pp is not None:
        raise ConfigError(f"pp={pp} cannot run: {reason}")
    return f"pipeline parallelism left out of the plan: {reason}"


def _input_specs(example_inputs, global_batch: int) -> list[dict]:
    """``Plan.inputs``: each example input's shape with the global batch, and dtype."""
    xs = example_inputs if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    return [{"shape": [global_batch, *(int(d) for d in x.shape[1:])],
             "dtype": str(x.dtype).removeprefix("torch.")} for x in xs]


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


@_collect_less()
def _compiled_if_faster(res: "SearchResult", solve: Callable) -> "SearchResult":
    """The configuration search result ``res`` chose, solved again by ``solve(candidate)``
    with its blocks compiled (:mod:`autopar.cost_models.compiled`), where it has no
    pipeline; kept when faster and its ``tp`` still splits something (a compiled layout
    may win by replicating everything over tp, which the search sets aside:
    :mod:`autopar.solvers.idle_axis`). The runners-up and notes stay ``res``'s."""
    from autopar.solvers.idle_axis import splits_nothing

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


def _run_search(model, example_inputs, *, cluster: Cluster, global_batch: int | None,
                loss_fn, precision: str, optimizer: str, memory_budget, spec: Spec,
                expert_imbalance: float = 1.0, time_limit_s: float | None = None, top_k: int = 1,
                progress: Callable[[int, int, float | None], None] | None = None,
                name: str | None = None, example_targets: torch.Tensor | None = None,
                explain: list[str] | str | None = None):
    """Search the configurations ``spec`` leaves open (its fields, already checked by
    :class:`Spec`) for the fastest plan that fits; (plan, the search's result)."""
    from autopar.assemble import add_pipeline, assemble, runner_up
    from autopar.capture import capture
    from autopar.cost_models.compiled import compiles_where_it_pays
    from autopar.explain import check_explain, explain_layouts
    from autopar.plans import model_fingerprint
    from autopar.solvers.outer_search import SearchResult, search
    from autopar.solvers.search_space import candidates
    from autopar.strategies.analysis import analyze

    check_choice("precision", precision, PRECISIONS)
    check_choice("optimizer", optimizer, OPTIMIZERS)
    _check_imbalance(expert_imbalance)
    _check_search_options(time_limit_s, loss_fn)
    if not isinstance(cluster, Cluster):
        raise ConfigError(f"cluster must be an autopar.Cluster, got {type(cluster).__name__}")
    hw = cluster.hardware()
    if precision == FP8:
        float8_rate_ratio(hw)  # raises where the GPU has no float8 tensor cores
    budget = _budget(memory_budget, hw)
    gb = _global_batch(global_batch, example_inputs)
    world = cluster.world_size
    if spec.tp is not None and world % spec.tp:
        raise ConfigError(f"tp={spec.tp} does not divide the {world} devices of the cluster")
    graph = capture(model, example_inputs, loss_fn=loss_fn, example_targets=example_targets,
                    name=name)
    _check_heads(graph, spec.tp or 1)
    explain = check_explain(graph, explain)
    an = analyze(graph)
    _check_pipeline_depth(spec.pp, len(graph.layers))
    cands = candidates(world, gb, dp=spec.dp, tp=spec.tp, pp=spec.pp,
                       microbatch_size=spec.microbatch_size, zero=spec.zero,
                       schedule=spec.schedule, virtual_stages=spec.virtual_stages,
                       num_units=len(graph.layers) + 2 if graph.layers else 1,
                       heads=_heads(graph), ep=spec.ep, experts=_experts(an, spec.ep),
                       expert_imbalance=float(expert_imbalance), cp=spec.cp,
                       seq_len=graph.seq_len or 0, cp_variants=_cp_variants(an, spec),
                       cp_variant=spec.cp_variant, cp_with_pp=not an.sequence.masked)
    if not isinstance(top_k, int) or top_k < 1:
        raise ConfigError(f"top_k={top_k!r}: expected a positive integer (1 = the best plan "
                          f"only)")
    pp_note = None
    asked = (spec.pp or 1) > 1
    if asked:  # a model that cannot be cut is an error
        _unsplittable_for_pipelining(model, example_inputs, graph, spec.pp)

    if spec.compile and not graph.layers:
        raise ConfigError("compile=True compiles the model's repeated blocks, and autopar "
                          "found none in this model; leave compile out")
    # the time limit bounds the search as a whole, a second one without pipelines included
    deadline = None if time_limit_s is None else time.perf_counter() + time_limit_s

    def run(cands: list, compile_blocks: bool = bool(spec.compile), top: int = top_k
            ) -> SearchResult:
        return search(an, cands, hw=hw, gpus_per_node=cluster.gpus_per_node,
                      precision=precision, optimizer=optimizer, memory_budget=budget,
                      sequence_parallel=spec.sequence_parallel,
                      loss_parallel=spec.loss_parallel,
                      split_weights=bool(spec.split_weights),
                      recompute=(spec.recompute,) if spec.recompute is not None else None,
                      offload=spec.offload, top_k=top, progress=progress,
                      deadline=deadline, compile_blocks=compile_blocks)

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
    # whether the runtime can cut the model into stages is asked only of a search that
    # kept a pipeline (a second export): one it cannot cut is searched again without
    if not asked and any(r.candidate is not None and r.candidate.pp > 1
                         for r in [res, *res.runners_up]):
        pp_note = _unsplittable_for_pipelining(model, example_inputs, graph, spec.pp)
        if pp_note:
            res = run([c for c in cands if c.pp == 1])
    if spec.compile is None and compiles_where_it_pays(hw) and graph.layers:
        res = _compiled_if_faster(res, lambda c: run([c], True, 1))
    # MFU against bf16's peak under fp8, as torchtitan and NeMo report float8 runs
    peak = hw.matmul_flops.get(element_dtype(precision), hw.matmul_flops.get("fp32", 1.0))

    def make(built, solution, candidate, pipeline) -> "Plan":
        p = assemble(an, built, solution, cluster_desc=cluster.describe(), global_batch=gb,
                     peak_flops=peak)
        if pipeline is not None and candidate is not None:
            add_pipeline(p, pipeline, pp=candidate.pp, schedule=candidate.schedule,
                         virtual_stages=candidate.virtual_stages,
                         model_flops=3.0 * graph.forward_flops * gb / graph.batch_size,
                         peak_flops=peak)
        return p

    plan = make(res.built, res.solution, res.candidate, res.pipeline)
    if res.set_aside is not None:
        from autopar.summary import set_aside_note

        a = res.set_aside
        plan.notes.append(set_aside_note(plan, make(a.built, a.solution, a.candidate,
                                                    a.pipeline)))
    plan.batch_source = example_source("global_batch=") if global_batch is None else asked_source(
        "global_batch=")
    plan.runners_up = [runner_up(plan, make(r.built, r.solution, r.candidate, r.pipeline))
                       for r in res.runners_up]
    plan.solver["memory_budget_bytes"] = budget
    plan.explanations = explain_layouts(an, res.built, res.solution, explain, budget)
    plan.inputs = _input_specs(example_inputs, gb)
    plan.model_hash = model_fingerprint(model)
    plan.notes.extend(_whole_vocabularies(model, plan))
    if pp_note:
        plan.notes.append(pp_note)
    plan.notes.extend(res.notes)
    if plan.compile_blocks:
        plan.notes.append(f"each block compiled with torch.compile (priced so: fused "
                          f"memory-bound kernels, no per-op dispatch; about "
                          f"{plan.compile_s:.0f} s to compile, once); compile=False runs "
                          f"them eager")
    if plan.context is not None and spec.cp is None and res.passed_over:
        why = res.passed_over[-1].split(" Raise memory_budget")[0]
        plan.notes.append(f"context parallelism, because without it (and without tensor "
                          f"parallelism across nodes or offload) {why}")
    if "gap" in plan.solver:
        why = f"the search stopped at its time limit of {time_limit_s} s" \
            if time_limit_s is not None else \
            "where the host bounds the step, some layouts were not proven best in the " \
            "solver's time (docs/solvers.md, intra_op_host)"
        plan.notes.append(f"{why}; no plan it did not solve to the end can be more than "
                          f"{plan.solver['gap'] * 100:.1f}% faster")
    return plan, res


def plan(model, example_inputs, *, cluster: Cluster | None = None, global_batch: int | None = None,
         loss_fn: Callable | None = None, precision: str = "bf16", optimizer: str = "adamw",
         memory_budget: float | None = None, example_targets: torch.Tensor | None = None,
         space: Spec | None = None, expert_imbalance: float = 1.0, **knobs: Any) -> "Plan":
    """Find the fastest plan for ``model`` on ``cluster`` that fits in memory.

    ``example_inputs`` is one global batch (real or ``meta`` tensors); ``global_batch``
    overrides its size. ``loss_fn(output, targets)`` defaults to cross-entropy over the
    output's last dim; ``example_targets`` (the targets of that batch) may be left out,
    and a custom loss is then tried with int64 class targets of the output's leading
    shape, then with float targets shaped like the output (see
    :func:`autopar.capture.capture`).

    The search space is a :class:`Spec`, given as ``space=Spec(...)`` or as its fields
    by name (``plan(model, inputs, tp=2, recompute="full")``; a field named beside
    ``space`` replaces the Spec's): ``dp``, ``tp``, ``pp``, ``microbatch_size``,
    ``zero`` (0-3), ``sequence_parallel``, ``schedule`` (one of
    :data:`autopar.plans.SCHEDULES`), ``virtual_stages``, ``recompute`` ("none",
    "selective" or "full" on every block) and ``offload``; each one left None is the
    solver's choice (recomputation per block; offload only when nothing fits without
    it). Three keywords steer the search itself: ``time_limit_s`` (stop early with the
    best plan found; the optimality gap is in ``plan.solver["gap"]``), ``top_k`` (also
    list the next ``top_k`` − 1 fastest configurations in ``plan.runners_up``, each with
    the terms it loses on) and ``progress`` (called as ``progress(done, total,
    best_step_time_s)`` after each configuration); a fourth, ``explain`` (module paths,
    their last parts or globs, e.g. ``["attn.proj"]``), fills ``plan.explanations`` with
    why each such module has its layout: every other layout of it priced by term with
    the plan's other choices kept. Any other keyword raises ConfigError
    naming the valid ones. ``memory_budget`` (bytes per device) defaults to the GPU's
    memory less the profile's stated reserve. Without a cluster, plans for the running
    job (see :func:`detect_cluster`). ``expert_imbalance`` (at least 1) is the routing's
    load imbalance the pricing assumes for Hugging Face-style dropless experts under
    expert parallelism: the busiest ep rank receives that many times the mean tokens
    (docs/strategies.md, section ``autopar.strategies.experts``).
    """
    spec, options = split_space(knobs, space)
    cluster = cluster or detect_cluster()
    p, _ = _run_search(model, example_inputs, cluster=cluster, global_batch=global_batch,
                       loss_fn=loss_fn, precision=precision, optimizer=optimizer,
                       memory_budget=memory_budget, spec=spec,
                       example_targets=example_targets, expert_imbalance=expert_imbalance,
                       **options)
    return p


make_plan = plan  # parallelize() takes a keyword named ``plan``


def estimate(model, example_inputs, spec: Spec, *, cluster: Cluster | None = None,
             global_batch: int | None = None, loss_fn: Callable | None = None,
             precision: str = "bf16", optimizer: str = "adamw",
             memory_budget: float | None = None,
             example_targets: torch.Tensor | None = None,
             expert_imbalance: float = 1.0) -> "Plan":
    """Score a hand-written configuration with the same cost model as :func:`plan`.

    What ``spec`` leaves out is filled as :meth:`Spec.for_estimate` says: degrees are 1,
    except ``dp``, which fills the world. The intra-op layout within the given degrees
    is still chosen by the solver (so ``tp=8`` gives the best 8-way tensor-parallel
    layout), and so is recomputation when ``spec.recompute`` is None. ``loss_fn``,
    ``example_targets`` and ``expert_imbalance`` are those of :func:`plan`.
    """
    if not isinstance(spec, Spec):
        raise ConfigError(f"spec must be an autopar.Spec, got {type(spec).__name__}")
    cluster = cluster or detect_cluster()
    if not isinstance(cluster, Cluster):
        raise ConfigError(f"cluster must be an autopar.Cluster, got {type(cluster).__name__}")
    gb = _global_batch(global_batch, example_inputs)
    scored = spec.for_estimate(cluster.world_size, gb)
    p, _ = _run_search(model, example_inputs, cluster=cluster, global_batch=gb, loss_fn=loss_fn,
                       precision=precision, optimizer=optimizer, memory_budget=memory_budget,
                       spec=scored, example_targets=example_targets,
                       expert_imbalance=expert_imbalance)
    if global_batch is None:
        p.batch_source = example_source("global_batch=")
    p.notes.append(f"scored hand-written configuration {scored}")
    return p


def parallelize(model, example_inputs=None, *, plan: "Plan | None" = None,
                cluster: Cluster | None = None, loss_fn: Callable | None = None,
                example_targets: torch.Tensor | None = None,
                collective_timeout_s: float | None = None, compile: bool | None = None,
                **plan_kwargs) -> "ParallelModel":
    """Plan (unless ``plan`` is given) and apply the plan inside a running job.

    Must run on every rank of a job started by torchrun (the default process group is
    then initialized from torchrun's environment when none exists: NCCL on GPUs, gloo
    on CPUs, its collectives failing after ``collective_timeout_s``, by default
    ``AUTOPAR_COLLECTIVE_TIMEOUT_S`` or 300 s) or by ``init_process_group``. Rank 0
    plans and broadcasts the plan, so every rank applies the same one. An exception on
    any rank, in planning or in applying the plan, is raised on every rank alike (same
    type and message, with a note naming the rank that raised it; see
    :func:`autopar.runtime.agree.agreed`), so no rank waits for a peer that has given
    up. ``loss_fn``, ``example_targets`` and ``plan_kwargs`` are those of :func:`plan`;
    ``compile`` that of :func:`autopar.runtime.apply_plan` (torch.compile per block;
    given, the plan is also searched and priced so).
    """
    import torch.distributed as dist

    from autopar.plans import Plan
    from autopar.runtime import apply_plan
    from autopar.runtime.agree import agreed

    if FP8 in (plan_kwargs.get("precision"), getattr(plan, "precision", None)):
        raise ConfigError(FP8_NOT_RUN)
    _join_torchrun_job(collective_timeout_s)
    text: str | None = None
    with agreed("planning in autopar.parallelize"):
        if plan is None:
            if example_inputs is None:
                raise ConfigError("parallelize() needs example_inputs (one global batch) or "
                                  "a plan")
            if dist.get_rank() == 0:
                asked = {"compile": compile} if compile is not None else {}
                text = make_plan(model, example_inputs, cluster=cluster or detect_cluster(),
                                 loss_fn=loss_fn, example_targets=example_targets,
                                 **asked, **plan_kwargs).to_json()
        elif not isinstance(plan, Plan):
            raise ConfigError(f"plan must be an autopar.Plan, got {type(plan).__name__}")
    if plan is None:
        shared = [text]
        dist.broadcast_object_list(shared, src=0)
        plan = Plan.from_json(shared[0])
    with agreed("applying the plan in autopar.parallelize"):
        if math.prod(plan.mesh.values()) != dist.get_world_size():
            raise ConfigError(f"the plan is for {math.prod(plan.mesh.values())} devices but the "
                              f"job has {dist.get_world_size()}; plan for this world size")
        parallel = apply_plan(model, plan, loss_fn=loss_fn, example_inputs=example_inputs,
                              compile=compile)
    return parallel
