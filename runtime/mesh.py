"""The device meshes a plan runs on.

A plan's mesh has the axes ``dp`` (outer) and ``tp`` (inner), ranks row-major, so the
ranks of one tensor-parallel group are neighbours. Tensor parallelism runs on the
``tp`` sub-mesh; data parallelism runs FSDP2 ``fully_shard`` on a ``dp`` sub-mesh of
the same root mesh (FSDP2 requires the data- and tensor-parallel meshes to share a
root, as in torchtitan):

* ``zero`` 1, 2 or 3: the 1-D ``dp`` mesh — parameters sharded over ``dp``;
* ``zero`` 0: a 2-D ``(dp, dp_shard)`` mesh with ``dp_shard`` of size 1 — FSDP2's
  hybrid mode then keeps a full replica of every parameter on each ``dp`` rank and
  all-reduces (averages) gradients over ``dp``, which is plain data parallelism with
  the public API, and works with DTensor tensor-parallel parameters on both gloo and
  NCCL (DDP does not accept DTensor parameters without a private transform).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autopar.plans import Plan

__all__ = ["PlanMeshes", "build_meshes", "MESH_AXES"]

MESH_AXES = ("dp", "tp")


@dataclass(frozen=True)
class PlanMeshes:
    """The meshes of one lowered plan.

    Attributes:
        mesh: the plan's 2-D mesh with axes ``("dp", "tp")``.
        tp: the ``tp`` sub-mesh (tensor and sequence parallelism).
        fsdp: the mesh FSDP2 runs on (see the module docstring); None without
            data parallelism (``dp == 1``).
    """

    mesh: DeviceMesh
    tp: DeviceMesh
    fsdp: DeviceMesh | None


def build_meshes(plan: Plan, device_type: str) -> PlanMeshes:
    """Create the plan's meshes with ``init_device_mesh`` (a collective: every rank
    must call it). The caller has checked that the world size matches the plan."""
    dp, tp = plan.degree("dp"), plan.degree("tp")
    if dp > 1 and plan.zero == 0:
        root = init_device_mesh(device_type, (dp, 1, tp), mesh_dim_names=("dp", "dp_shard", "tp"))
        return PlanMeshes(mesh=root["dp", "tp"], tp=root["tp"], fsdp=root["dp", "dp_shard"])
    root = init_device_mesh(device_type, (dp, tp), mesh_dim_names=MESH_AXES)
    return PlanMeshes(mesh=root, tp=root["tp"], fsdp=root["dp"] if dp > 1 else None)
