"""Lowering: check a Plan against the live model and the running job, then apply it
with PyTorch's distributed stack, in torchtitan's order: the meshes
(:mod:`~autopar.runtime.mesh`), tensor / sequence parallelism
(:mod:`~autopar.runtime.tensor_parallel`), activation recomputation
(:mod:`~autopar.runtime.recompute`), data parallelism and precision with FSDP2
(:mod:`~autopar.runtime.data_parallel`), then materialization of a ``meta`` model
(:mod:`~autopar.runtime.materialize`). :func:`lower` applies a plan;
:func:`lower_pipeline` first cuts the model into stages
(:mod:`~autopar.runtime.pipeline`) and applies the steps after the meshes to this
rank's stages only.

Every check runs before anything is changed, and all of them depend only on the
plan and the model, so every rank raises the same LoweringError. Each step in
detail: docs/runtime.md, section ``autopar.runtime.lower``.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage

from autopar.errors import LoweringError
from autopar.plans import Plan, model_fingerprint
from autopar.runtime.applied import log_applied
from autopar.runtime.compiled import compile_blocks
from autopar.cost_models.float8 import FP8, NOT_RUN
from autopar.runtime.data_parallel import PRECISION_DTYPES, apply_data_parallel, check_tied_units
from autopar.runtime.experts import apply_expert_parallel, check_experts, shard_plan_experts
from autopar.runtime.materialize import (check_materializable, is_meta_model, materialize,
                                         materialize_stage)
from autopar.runtime.mesh import MESH_AXES, PlanMeshes, build_meshes
from autopar.runtime.pipeline import (LossFn, PipelineRuntime, build_pipeline_schedule,
                                      check_pipeline, parallelize_stage, split_for_plan,
                                      tied_process_groups, unflattened_loss)
from autopar.runtime.recompute import apply_ac, check_recompute
from autopar.runtime.tensor_parallel import (apply_tensor_parallel, check_module_plan,
                                             check_param_placement, tied_parameter_groups,
                                             tp_placement)

__all__ = ["check_process_group", "check_plan", "check_model_hash", "default_device", "lower",
           "lower_pipeline"]


def check_process_group(plan: Plan) -> None:
    """The default process group must exist and have as many ranks as the plan's mesh."""
    if not (dist.is_available() and dist.is_initialized()):
        raise LoweringError("apply_plan() needs an initialized default process group; run under "
                            "torchrun, or call torch.distributed.init_process_group() first")
    world = dist.get_world_size()
    if plan.world_size != world:
        ranks = f"{world} rank{'s' if world > 1 else ''}"
        raise LoweringError(f"the plan's mesh {plan.mesh} has {plan.world_size} devices but the "
                            f"process group has {ranks}; run with {plan.world_size} "
                            f"processes, or make a plan for {world} "
                            f"device{'s' if world > 1 else ''}")


def default_device() -> torch.device:
    """This rank's device: its current CUDA device under NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _module(model: nn.Module, path: str, plan: Plan, where: str) -> nn.Module:
    try:
        return model.get_submodule(path)
    except AttributeError:
        raise LoweringError(f"{where} names module '{path}', which the model does not have; "
                            f"was the plan made for another model (plan.model = "
                            f"'{plan.model}')? Re-plan for this model") from None


def check_model_hash(model: nn.Module, plan: Plan) -> None:
    """The plan must have been made for ``model``: its ``model_hash`` (the names and
    shapes of the parameters it was planned for, :func:`~autopar.plans.model_fingerprint`)
    must be the model's. A plan without one (format version 2 or earlier, or written by
    hand) is not checked."""
    if not plan.model_hash:
        return
    here = model_fingerprint(model)
    if here != plan.model_hash:
        raise LoweringError(
            f"the plan was made for another model: plan.model = '{plan.model}' with "
            f"parameters of fingerprint {plan.model_hash}, but this "
            f"{type(model).__name__}'s parameters (names and shapes) have fingerprint "
            f"{here}; re-plan for this model (autopar.plan, or `autopar plan` with the same "
            f"model factory)")


def _check_shape(plan: Plan) -> None:
    axes = list(plan.mesh)
    if any(a not in MESH_AXES for a in axes) or axes != [a for a in MESH_AXES if a in axes]:
        raise LoweringError(f"the plan's mesh axes {axes} are not supported; this runtime lowers "
                            f"meshes with the axes 'pp' (outermost), 'dp' and 'tp' (innermost), "
                            f"in that order")
    dp = plan.data_parallel
    if plan.global_batch != plan.microbatch_size * plan.num_microbatches * dp:
        raise LoweringError(f"the plan's global_batch {plan.global_batch} is not microbatch_size "
                            f"{plan.microbatch_size} x num_microbatches {plan.num_microbatches} x "
                            f"dp {dp}; fix the plan's batch sizes")
    if plan.precision == FP8:
        raise LoweringError(NOT_RUN)
    if plan.precision not in PRECISION_DTYPES:
        raise LoweringError(f"precision {plan.precision!r} is not supported; use one of "
                            f"{', '.join(PRECISION_DTYPES)}")


def _allowed_dp(plan: Plan) -> set[str]:
    if plan.data_parallel == 1 or plan.zero in (1, 2):
        return {"R", "S(0)"}
    return {"S(0)"} if plan.zero == 3 else {"R"}


def _check_params(model: nn.Module, plan: Plan, groups: list[list[str]]) -> None:
    """Every parameter has placements: on tp replicated or a split of one of its dims,
    on dp what ``plan.zero`` produces; tied parameters get one placement."""
    axes = list(plan.stage_mesh)
    allowed_dp = _allowed_dp(plan)
    names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    unknown = sorted(set(plan.params) - names)
    if unknown:
        raise LoweringError(f"plan.params names parameter '{unknown[0]}', which the model does "
                            f"not have; was the plan made for another model (plan.model = "
                            f"'{plan.model}')? Re-plan for this model")
    for fqn, param in model.named_parameters(remove_duplicate=False):
        path, _, local = fqn.rpartition(".")
        mp = plan.modules.get(path)
        planned = plan.params.get(fqn)
        if planned is None:
            raise LoweringError(f"the plan gives no placements for parameter '{fqn}'; plan.params "
                                f"must list every parameter (re-plan for this model)")
        if mp is not None and local in mp.params and mp.params[local] != planned:
            raise LoweringError(f"the plan disagrees with itself on '{fqn}': plan.params has "
                                f"{planned} but modules['{path}'].params has {mp.params[local]}; "
                                f"make the two agree (re-plan)")
        check_param_placement(fqn, param, tp_placement(plan, planned))
        got = dict(zip(axes, planned))
        xp = plan.experts.get(path)
        for axis in ("dp", "ep"):
            expert = axis == "ep" and xp is not None and local in xp.params
            want = {f"S({xp.params[local]})"} if expert else allowed_dp  # type: ignore[union-attr]
            if got.get(axis, "R") in want or plan.degree(axis) == 1:
                continue
            why = f"zero={plan.zero} over dp={plan.data_parallel}"
            if expert:
                why = f"plan.experts splits its experts (dim {next(iter(want))[2:-1]}) over ep"
            raise LoweringError(
                f"parameter '{fqn}' is planned as {planned} on {tuple(axes)}, but {why} "
                f"places it as {' or '.join(repr(p) for p in sorted(want))} on {axis}; make "
                f"plan.params agree with plan.{'experts' if expert else 'zero'}")
    for group in groups:
        tps = {tp_placement(plan, plan.params[n]) for n in group}
        if len(tps) > 1:
            raise LoweringError(
                f"parameters {' and '.join(repr(n) for n in group)} are one tied tensor, but "
                f"the plan places them differently on tp ({', '.join(sorted(tps))}); give "
                f"them one placement (re-plan)")


def check_plan(model: nn.Module, plan: Plan) -> list[list[str]]:
    """Check that ``plan`` can be lowered onto ``model``; return the tied parameter
    groups. Raises LoweringError naming what is wrong and what to try."""
    check_model_hash(model, plan)
    _check_shape(plan)
    for path in plan.blocks:
        _module(model, path, plan, "plan.blocks")
    for path, mp in plan.modules.items():
        check_module_plan(path, _module(model, path, plan, "plan.modules"), mp)
    check_recompute(plan)
    check_experts(model, plan)
    groups = tied_parameter_groups(model)
    _check_params(model, plan, groups)
    if plan.data_parallel > 1:
        check_tied_units(plan, groups)
    return groups


def lower(model: nn.Module, plan: Plan, device: torch.device,
          compile: bool = False) -> PlanMeshes:
    """Lay ``model`` out in place as ``plan`` says (see the module docstring); return
    the meshes. ``model`` must be the same (same weights, or meta) on every rank.
    ``compile``: torch.compile each of the plan's blocks
    (:func:`~autopar.runtime.compiled.compile_blocks`) before FSDP2 wraps them."""
    check_process_group(plan)
    check_plan(model, plan)
    meta = is_meta_model(model)
    if meta:
        check_materializable(model)
    else:
        model.to(device)
    meshes = build_meshes(plan, device.type)
    if meshes.ep is not None:
        apply_expert_parallel(model, plan, meshes)
    if plan.degree("tp") > 1:
        apply_tensor_parallel(model, plan, meshes.tp, local=not compile)
    shard_plan_experts(model, plan, meshes, before_tp=False)
    apply_ac(model, plan)
    if compile:
        compile_blocks(model, plan)
    if meshes.fsdp is not None:
        apply_data_parallel(model, plan, meshes.fsdp, meshes.expert_fsdp)
    if meta:
        materialize(model, device)
    log_applied(model, plan, device.type, meshes.fsdp is not None)
    return meshes


def lower_pipeline(model: nn.Module, plan: Plan, device: torch.device, loss_fn: LossFn,
                   example_inputs: Any) -> PipelineRuntime:
    """Cut ``model`` into the stages of ``plan.pipeline``, lay out this rank's stages
    (tensor parallelism, FSDP2, materialization of a meta model's own stage only)
    and build the schedule; see :mod:`autopar.runtime.pipeline`. ``loss_fn(output,
    targets)`` returns one micro-batch's mean loss; ``example_inputs`` (a batch of the
    model's inputs, batch first) give the shapes the stages are exported for."""
    check_process_group(plan)
    check_plan(model, plan)
    check_pipeline(model, plan)
    assert plan.pipeline is not None
    meta = is_meta_model(model)
    if meta:
        check_materializable(model)
    cut, tied = split_for_plan(model, plan, example_inputs, device)
    graphs = cut.stages
    meshes = build_meshes(plan, device.type)
    assert meshes.pp is not None
    pp_rank = meshes.pp.get_local_rank()
    local = [g for g, st in zip(graphs, plan.pipeline.stages) if st.rank == pp_rank]
    for g in local:
        if not meta:
            g.module.to(device)
        parallelize_stage(g.module, plan, meshes, last=g.index == len(graphs) - 1)
        if meta:
            materialize_stage(g.module, device, model)
    groups = tied_process_groups(plan, tied)
    stages = [PipelineStage(g.module, g.index, len(graphs), device, group=meshes.pp.get_group())
              for g in local]
    runtime = PipelineRuntime(
        plan=plan, meshes=meshes, modules=[g.module for g in local], stages=stages,
        schedule=build_pipeline_schedule(plan, stages,
                                         functools.partial(unflattened_loss, cut, loss_fn)),
        input_names=cut.input_names, tied=list(zip(tied, groups)),
        device=device, input_shapes=cut.input_shapes)
    runtime.sync_tied(grads=False)  # copies start equal (a meta model's are initialized apart)
    log_applied(nn.ModuleList([g.module for g in local]), plan, device.type,
                meshes.fsdp is not None, stages=[g.index for g in local])
    return runtime
