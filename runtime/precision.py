"""A single-process reference for low-precision runs.

A parallel run under ``plan.precision`` "bf16"/"fp16" computes with FSDP2's
``MixedPrecisionPolicy(param_dtype=<dtype>, reduce_dtype=float32)`` on every path (see
:mod:`autopar.runtime.data_parallel`). To compare like with like,
:func:`precision_reference` runs the *same* model under the *same* policy on one
process, over the mesh of this rank alone that :func:`single_rank_mesh` builds:
exactly what each rank of the parallel run does, without splitting the batch.

What the reference casts, and its usage: docs/runtime.md, section
``autopar.runtime.precision``.
"""

from __future__ import annotations

import dataclasses

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autopar.plans import Plan
from autopar.runtime.data_parallel import apply_data_parallel

__all__ = ["single_rank_mesh", "precision_reference"]


def single_rank_mesh(device_type: str) -> DeviceMesh:
    """A 1-device mesh of this rank alone. With several ranks it creates one
    process group per rank (``new_group`` is collective, so every rank must call
    this, in the same order as its other group creations)."""
    world = dist.get_world_size()
    if world == 1:
        return init_device_mesh(device_type, (1,), mesh_dim_names=("dp",))
    groups = [dist.new_group([r]) for r in range(world)]
    return DeviceMesh.from_group(groups[dist.get_rank()], device_type, mesh_dim_names=("dp",))


def precision_reference(model: nn.Module, plan: Plan, mesh: DeviceMesh) -> nn.Module:
    """Lay ``model`` out for one process under ``plan.precision``: ``fully_shard``
    per block of ``plan.blocks`` and on the root over the 1-device ``mesh``, with the
    plan's ``MixedPrecisionPolicy`` and no offload; return ``model``."""
    if mesh.size() != 1:
        raise ValueError(f"the reference runs on one device, but the mesh has {mesh.size()}")
    apply_data_parallel(model, dataclasses.replace(plan, zero=0, offload=False), mesh)
    return model
