"""Expert parallelism of a Plan: each expert module of ``plan.experts`` keeps only its
``ep`` rank's experts, and its tokens cross the ``ep`` axis by an all-to-all on the
way in and on the way out (:func:`apply_expert_parallel`, :func:`split_experts`; a
gathered module's by all-gather in, reduce-scatter out: :func:`gather_tokens`).

The module's own code runs unchanged, on local tensors: its input arrives split by
sample, holding every expert's slots; the all-to-all (:func:`exchange`, a DTensor
redistribution ``Shard(batch)`` -> ``Shard(expert)`` on the ``ep`` mesh) gives it every
sample's slots of this rank's experts, and the reverse one hands each rank its samples
back; autograd runs both backward. :class:`ScaleGrad` makes the experts' gradients
the data-parallel mean. After tensor parallelism, :func:`shard_expert_weights` makes
the weights DTensors of every expert split over ``ep`` (what FSDP2 and checkpoints
see), the forward still seeing its share. Why and how, in full: docs/runtime.md,
section ``autopar.runtime.experts``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

from autopar.errors import LoweringError
from autopar.plans import Plan
from autopar.runtime.mesh import PlanMeshes
from autopar.runtime.routed_experts import route_tokens

__all__ = ["check_experts", "apply_expert_parallel", "expert_table", "split_experts",
           "keep_own_experts", "over_ep", "exchange", "gather_tokens", "ScaleGrad",
           "shard_expert_weights", "shard_plan_experts"]


def check_experts(model: nn.Module, plan: Plan) -> None:
    """Every expert module of the plan exists, owns the parameters it names, and holds
    a number of experts the ``ep`` degree divides."""
    ep = plan.degree("ep")
    for path, xp in plan.experts.items():
        try:
            module = model.get_submodule(path)
        except AttributeError:
            raise LoweringError(f"plan.experts names module '{path}', which the model does "
                                f"not have; re-plan for this model") from None
        own = dict(module.named_parameters(recurse=False))
        for local, dim in xp.params.items():
            p = own.get(local)
            if p is None or dim >= p.dim() or p.shape[dim] != xp.experts:
                raise LoweringError(f"plan.experts['{path}'] splits parameter '{local}' along "
                                    f"dim {dim} into {xp.experts} experts, which "
                                    f"'{path}' ({type(module).__name__}) does not hold; "
                                    f"re-plan for this model")
        if xp.experts % ep:
            raise LoweringError(f"module '{path}' has {xp.experts} experts, which ep={ep} "
                                f"does not divide; re-plan with an ep that divides them")


def over_ep(x: torch.Tensor, mesh: DeviceMesh, src: Placement, dst: Placement,
            grad: Placement | None = None) -> torch.Tensor:
    """Redistribute local tensor ``x`` over ``mesh`` from ``src`` to ``dst`` (a DTensor
    redistribution; differentiable, the gradient handed back as ``grad``, by default
    ``dst``). A tensor-parallel activation (a DTensor) moves its local piece and keeps
    its own layout."""
    if isinstance(x, DTensor):
        moved = over_ep(x.to_local(), mesh, src, dst, grad)
        return DTensor.from_local(moved, x.device_mesh, x.placements, run_check=False)
    d = DTensor.from_local(x, mesh, [src], run_check=False).redistribute(mesh, [dst])
    return d.to_local(grad_placements=None if grad is None else [grad])


def exchange(x: torch.Tensor, mesh: DeviceMesh, src: int, dst: int) -> torch.Tensor:
    """All-to-all ``x`` over ``mesh``: from split along dim ``src`` to split along dim
    ``dst`` (local tensors in and out; differentiable)."""
    return over_ep(x, mesh, Shard(src), Shard(dst))


def gather_tokens(module: nn.Module, params: Mapping[str, int], batch: int, gate: int,
                  mesh: DeviceMesh, scale: type) -> None:
    """All-gather dispatch around a gathered expert module (every expert on every
    token, a gate combining them; its parameters, name -> expert dim, already cut to
    this ep rank's experts): each tensor argument is all-gathered over ``mesh`` along dim ``batch``
    (its gradient, this rank's experts' share, reduce-scattered back), but the gate
    (the argument holding every expert along dim ``gate``), which is exchanged to the
    ep group's tokens of this rank's experts; the output, a partial sum over this
    rank's experts, is reduce-scattered back to the tokens' ranks, and copied out of
    the redistribution's view (one pass over the local output, as the all-to-all
    dispatch's is), so that the caller may modify it in place. ``scale`` is the
    gradient-scaling function (:class:`ScaleGrad`)."""
    ep = mesh.size()
    name, dim = next(iter(params.items()))
    experts = getattr(module, name).shape[dim] * ep

    def dispatch(_: nn.Module, args: tuple) -> tuple:
        out = []
        for a in args:
            if not isinstance(a, torch.Tensor):
                out.append(a)
            elif a.dim() > gate and a.shape[gate] == experts:
                out.append(scale.apply(exchange(a, mesh, batch, gate), float(ep)))
            else:
                out.append(scale.apply(over_ep(a, mesh, Shard(batch), Replicate(), Partial()),
                                       float(ep)))
        return tuple(out)

    def combine(_: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        back = over_ep(scale.apply(out, 1.0 / ep), mesh, Partial(), Shard(batch))
        return back.clone()  # not a view: the caller may add to it in place

    module.register_forward_pre_hook(dispatch)
    module.register_forward_hook(combine)


class ScaleGrad(torch.autograd.Function):
    """The identity forward; backward, the gradient times ``factor``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, factor: float) -> torch.Tensor:  # noqa: D102
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: D102
        return grad * ctx.factor, None


def keep_own_experts(module: nn.Module, params: Mapping[str, int], mesh: DeviceMesh) -> None:
    """Keep this ep rank's experts of each of the module's expert parameters (name ->
    its expert dim)."""
    rank, ep = mesh.get_local_rank(), mesh.size()
    for local, dim in params.items():
        p = getattr(module, local)
        piece = p.detach().chunk(ep, dim)[rank].clone()
        setattr(module, local, nn.Parameter(piece, requires_grad=p.requires_grad))


def split_experts(model: nn.Module, table: Mapping[str, tuple], mesh: DeviceMesh,
                  legs: tuple[DeviceMesh, DeviceMesh] | None = None,
                  tp: DeviceMesh | None = None) -> None:
    """For each module path of ``table`` -> (batch dim, expert dim of its input, of its
    output, {parameter: expert dim}, ep ranks per node of a two-leg exchange, folded):
    keep this rank's experts and move the module's tokens by all-to-all over ``mesh``
    (the ``ep`` axis; the ``ep`` and ``tp`` ranks together where the experts are
    folded over ``tp``, the tp mesh) at its boundary; expert dims of -1 mark a routed
    module (:func:`~autopar.runtime.routed_experts.route_tokens`, in two legs over
    ``legs`` where its ranks per node exceed 1), an output expert dim of -1 alone a
    gathered one (:func:`gather_tokens`). Modules the model (or this pipeline stage)
    does not hold are skipped."""
    paths = dict(model.named_modules())
    ep = float(mesh.size())
    for path, (batch, into, out_dim, params, per_node, folded) in table.items():
        module = paths.get(path)
        if module is None:
            continue
        keep_own_experts(module, params, mesh)
        if into < 0:  # a routed module: each token to its experts' ranks and back
            route_tokens(module, params, mesh, ScaleGrad, legs if per_node > 1 else None,
                         tp if folded else None)
            continue
        if out_dim < 0:  # a gathered module: the group's tokens in, partial sums out
            gather_tokens(module, params, batch, into, mesh, ScaleGrad)
            continue

        def dispatch(_: nn.Module, args: tuple, batch: int = batch, into: int = into) -> tuple:
            x = exchange(args[0], mesh, batch, into)
            return (ScaleGrad.apply(x, ep),) + tuple(args[1:])

        def combine(_: nn.Module, args: tuple, out: torch.Tensor, batch: int = batch,
                    dim: int = out_dim) -> torch.Tensor:
            back = exchange(ScaleGrad.apply(out, 1.0 / ep), mesh, dim, batch)
            return back.clone()  # not a view: the caller may add to it in place

        module.register_forward_pre_hook(dispatch)
        module.register_forward_hook(combine)


def shard_expert_weights(model: nn.Module, table: Mapping[str, tuple],
                         expert_mesh: DeviceMesh, tp_mesh: DeviceMesh | None = None) -> None:
    """Make each expert parameter of ``table`` (cut to this rank's experts by
    :func:`split_experts`, and split by tensor parallelism since, where it is; folded
    experts before tensor parallelism, which leaves them alone, as DTensors) a DTensor
    sharded over ``expert_mesh["ep"]`` along its expert dim, on ``expert_mesh["ep",
    "tp"]`` when it is a tensor-parallel DTensor: the global tensor of every expert,
    which FSDP2 and checkpoints see under the parameter's own name. The module's
    forward keeps seeing this rank's share, as a plain tensor or as a DTensor on
    ``tp_mesh``: a forward pre-hook puts that view in the module's ``__dict__``, which
    attribute lookup reads before its parameters, and a forward hook takes it out."""
    paths = dict(model.named_modules())
    for path, entry in table.items():
        params = entry[3]
        module = paths.get(path)
        if module is None:
            continue
        for local, dim in params.items():
            p = module._parameters[local]
            if isinstance(p, DTensor):
                whole = DTensor.from_local(p.to_local().detach(), expert_mesh["ep", "tp"],
                                           [Shard(dim), *p.placements], run_check=False)
            else:
                whole = DTensor.from_local(p.detach(), expert_mesh["ep"], [Shard(dim)],
                                           run_check=False)
            module._parameters[local] = nn.Parameter(whole, requires_grad=p.requires_grad)
        names = tuple(params)

        def views(m: nn.Module, _: tuple, names: tuple[str, ...] = names) -> None:
            for name in names:
                p = m._parameters[name]
                view = p.to_local() if isinstance(p, DTensor) else p
                if isinstance(p, DTensor) and p.device_mesh.ndim == 2 and tp_mesh is not None:
                    view = DTensor.from_local(view, tp_mesh, p.placements[1:], run_check=False)
                m.__dict__[name] = view

        def drop(m: nn.Module, _: tuple, out: object, names: tuple[str, ...] = names) -> None:
            for name in names:
                m.__dict__.pop(name, None)

        module.register_forward_pre_hook(views)
        module.register_forward_hook(drop)


def shard_plan_experts(model: nn.Module, plan: Plan, meshes: PlanMeshes,
                       before_tp: bool) -> None:
    """:func:`shard_expert_weights` for the expert modules of ``plan.experts``, at the
    step of the lowering that lays them out: before tensor parallelism (``before_tp``)
    for experts folded over tp, which tensor parallelism then leaves alone; after it,
    on the tp mesh, for the others. Nothing at the other step, or without ep."""
    if meshes.experts is not None and plan.fold_experts == before_tp:
        shard_expert_weights(model, expert_table(plan), meshes.experts,
                             None if before_tp else meshes.tp)


def expert_table(plan: Plan) -> dict[str, tuple[int, int, int, dict[str, int], int, bool]]:
    """``plan.experts`` as the plain table :func:`split_experts` reads."""
    return {path: (xp.batch_dim, xp.input_dim, xp.output_dim, dict(xp.params), xp.node_ranks,
                   xp.folded) for path, xp in plan.experts.items()}


def apply_expert_parallel(model: nn.Module, plan: Plan, meshes: PlanMeshes) -> None:
    """Split the experts of ``plan.experts`` over ``meshes.ep`` and move their tokens by
    all-to-all, a routed module's in two legs over ``meshes.ep_legs`` where the plan
    says so (module docstring; :func:`split_experts`); experts folded over tp are made
    DTensors over the expert mesh here (:func:`shard_plan_experts`)."""
    split_experts(model, expert_table(plan), meshes.ep, meshes.ep_legs, meshes.tp)
    shard_plan_experts(model, plan, meshes, before_tp=True)
