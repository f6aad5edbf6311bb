"""The public entry points: :func:`plan`, :func:`estimate` and :func:`parallelize`, and the
running job's cluster (:func:`detect_cluster`). Planning itself is
:func:`autopar.planner.make_plan`."""

from __future__ import annotations

import math
import os
import warnings
from typing import TYPE_CHECKING, Any, Callable

from autopar.batch_default import example_source
from autopar.cluster import Cluster
from autopar.cost_models.float8 import NOT_RUN as FP8_NOT_RUN, FP8
from autopar.errors import ConfigError
from autopar.planner_inputs import global_batch as batch_size
from autopar.spec import Spec, split_space

if TYPE_CHECKING:
    import torch

    from autopar.plans import Plan
    from autopar.runtime import ParallelModel


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
    from autopar import planner

    return planner.make_plan(model, example_inputs, cluster=cluster, spec=spec,
                             global_batch=global_batch, loss_fn=loss_fn, precision=precision,
                             optimizer=optimizer, memory_budget=memory_budget,
                             example_targets=example_targets,
                             expert_imbalance=expert_imbalance, **options)


def _planned(model, example_inputs, **keywords: Any) -> "Plan":
    """:func:`plan`, under a name that :func:`parallelize` (whose keyword ``plan`` hides
    it) can call."""
    return plan(model, example_inputs, **keywords)


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
    from autopar import planner

    gb = batch_size(global_batch, example_inputs)
    scored = spec.for_estimate(cluster.world_size, gb)
    p = planner.make_plan(model, example_inputs, cluster=cluster, spec=scored, global_batch=gb,
                          loss_fn=loss_fn, precision=precision, optimizer=optimizer,
                          memory_budget=memory_budget, example_targets=example_targets,
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
                text = _planned(model, example_inputs, cluster=cluster or detect_cluster(),
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
