"""Lowering: apply a Plan to a live model with PyTorch's distributed stack.

* the mesh: ``init_device_mesh`` with axes ("dp", "tp");
* tensor and sequence parallelism: every module that owns parameters becomes a
  DTensor module on the ``tp`` sub-mesh with ``distribute_module``: its parameters are
  distributed with the plan's ``tp`` placements, its input is read as the plan's
  ``input_layout`` and redistributed to ``desired_input_layout``, and its output is
  redistributed to ``output_layout`` and handed on as a local tensor — exactly what
  ``ColwiseParallel`` / ``RowwiseParallel`` / ``SequenceParallel`` do, for any layout the
  solver chose. Between modules the model runs on plain local tensors;
* ZeRO-3: FSDP2 ``fully_shard`` on each repeated block and the root, over ``dp``;
* ZeRO-0: replicated parameters, gradients averaged over ``dp`` after backward;
* a ``meta`` model is materialized with ``to_empty`` (only local shards are allocated)
  and re-initialized with each module's ``reset_parameters``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, distribute_module, distribute_tensor

from autopar.errors import LoweringError
from autopar.plans import ModulePlan, Plan
from autopar.sharding import parse_placement


def build_mesh(plan: Plan, device_type: str) -> DeviceMesh:
    """The plan's device mesh; the world size must match it."""
    world = dist.get_world_size()
    if plan.world_size != world:
        raise LoweringError(f"the plan is for {plan.world_size} devices ({plan.mesh}) but the job "
                            f"has {world} processes; plan for {world} devices")
    return init_device_mesh(device_type, tuple(plan.mesh.values()),
                            mesh_dim_names=tuple(plan.mesh))


def _tp_index(plan: Plan) -> int:
    return list(plan.mesh).index("tp")


def _module(model: nn.Module, path: str) -> nn.Module:
    try:
        return model.get_submodule(path) if path else model
    except AttributeError:
        raise LoweringError(f"the plan names module '{path}', which the model does not have; "
                            "was the plan made for another model?") from None


def _convert(x, mesh: DeviceMesh, src: str, dst: str):
    """Read local tensor ``x`` as placement ``src`` on ``mesh`` and redistribute to ``dst``."""
    if not isinstance(x, torch.Tensor):
        return x
    d = x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, [parse_placement(src)],
                                                            run_check=False)
    return d.redistribute(mesh, [parse_placement(dst)]) if src != dst or not isinstance(
        x, DTensor) else d


def apply_tensor_parallel(model: nn.Module, plan: Plan, tp_mesh: DeviceMesh) -> None:
    """Turn every planned module into a DTensor module on the tp sub-mesh."""
    axis = _tp_index(plan)
    done: dict[int, nn.Parameter] = {}
    for path, mp in plan.modules.items():
        module = _module(model, path)
        _distribute_params(module, mp, axis, tp_mesh, done, path)
        distribute_module(module, tp_mesh, partition_fn=None,
                          input_fn=_input_fn(mp), output_fn=_output_fn(mp))


def _distribute_params(module: nn.Module, mp: ModulePlan, axis: int, mesh: DeviceMesh,
                       done: dict[int, nn.Parameter], path: str) -> None:
    for name, param in list(module.named_parameters(recurse=False)):
        pl = mp.params.get(name)
        if pl is None:
            raise LoweringError(f"the plan gives no placement for '{path}.{name}'")
        placement = parse_placement(pl[axis])
        if id(param) in done:
            new = done[id(param)]
            if new.placements[0] != placement:  # type: ignore[union-attr]
                raise LoweringError(f"tied parameter '{path}.{name}' has two placements in the "
                                    f"plan ({new.placements[0]} and {placement}); re-plan")
        else:
            shape = param.shape
            if placement.is_shard() and shape[placement.dim] % mesh.size():
                raise LoweringError(f"'{path}.{name}' dim {placement.dim} of size "
                                    f"{shape[placement.dim]} does not split over tp={mesh.size()}")
            new = nn.Parameter(distribute_tensor(param.data, mesh, [placement]),
                               requires_grad=param.requires_grad)
            done[id(param)] = new
        module.register_parameter(name, new)


def _input_fn(mp: ModulePlan):
    def fn(module, inputs, mesh):
        if not inputs:
            return inputs
        first = _convert(inputs[0], mesh, mp.input_layout, mp.desired_input_layout)
        return (first,) + tuple(inputs[1:])
    return fn


def _output_fn(mp: ModulePlan):
    def fn(module, output, mesh):
        if isinstance(output, DTensor):
            output = output.redistribute(mesh, [parse_placement(mp.output_layout)])
            return output.to_local()
        return output
    return fn


def materialize(model: nn.Module, device: torch.device) -> None:
    """Allocate a meta model's local shards on ``device`` and initialize them."""
    if not any(p.is_meta for p in model.parameters()):
        return
    model.to_empty(device=device)
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()
