"""The device meshes a plan runs on (:func:`build_meshes`, :class:`PlanMeshes`).

A plan's mesh has the axes ``pp`` (outermost, only with a pipeline), ``dp`` and ``tp``
(innermost), ranks row-major, so the ranks of one tensor-parallel group are
neighbours and each pipeline stage runs on a contiguous block of ranks. Tensor
parallelism runs on the ``tp`` sub-mesh; data parallelism runs FSDP2 ``fully_shard``
on a ``dp`` sub-mesh of the same root mesh (:func:`needs_fsdp` says when FSDP2 runs).

Which ``dp`` mesh each ZeRO stage gets (and ``dp`` 1 under low precision or
offload), and why: docs/runtime.md, section ``autopar.runtime.mesh``.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autopar.cost_models.memory import fsdp_lays_out
from autopar.plans import Plan

__all__ = ["PlanMeshes", "build_meshes", "needs_fsdp", "MESH_AXES"]

MESH_AXES = ("pp", "dp", "tp")


@dataclass(frozen=True)
class PlanMeshes:
    """The meshes of one lowered plan.

    Attributes:
        mesh: the plan's mesh with axes ``("dp", "tp")``, or ``("pp", "dp", "tp")``
            with a pipeline.
        tp: the ``tp`` sub-mesh (tensor and sequence parallelism).
        fsdp: the mesh FSDP2 runs on (see docs/runtime.md); None without
            data parallelism (``dp == 1``), low precision or offload.
        pp: the ``pp`` sub-mesh (pipeline stages), or None without a pipeline.
    """

    mesh: DeviceMesh
    tp: DeviceMesh
    fsdp: DeviceMesh | None
    pp: DeviceMesh | None = None


def needs_fsdp(plan: Plan) -> bool:
    """Whether the plan runs FSDP2: for data parallelism, low precision (FSDP2's
    ``MixedPrecisionPolicy`` on a ``dp`` mesh of size 1, so every path casts alike) or
    offload (the cost models' rule, :func:`autopar.cost_models.memory.fsdp_lays_out`)."""
    return fsdp_lays_out(plan.precision, plan.degree("dp"), plan.offload)


def build_meshes(plan: Plan, device_type: str) -> PlanMeshes:
    """Create the plan's meshes with ``init_device_mesh`` (a collective: every rank
    must call it). The caller has checked that the world size matches the plan."""
    pp, dp, tp = plan.degree("pp"), plan.degree("dp"), plan.degree("tp")
    outer: tuple[str, ...] = ("pp", "dp") if pp > 1 else ("dp",)
    shape = tuple(plan.degree(a) for a in outer)
    if dp > 1 and plan.zero == 0:
        root = init_device_mesh(device_type, shape + (1, tp),
                                mesh_dim_names=outer + ("dp_shard", "tp"))
        fsdp: DeviceMesh | None = root["dp", "dp_shard"]
    else:
        root = init_device_mesh(device_type, shape + (tp,), mesh_dim_names=outer + ("tp",))
        fsdp = root["dp"] if needs_fsdp(plan) else None
    return PlanMeshes(mesh=root[outer + ("tp",)], tp=root["tp"], fsdp=fsdp,
                      pp=root["pp"] if pp > 1 else None)
