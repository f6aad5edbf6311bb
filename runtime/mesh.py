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

import warnings
from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autopar.cost_models.memory import fsdp_lays_out
from autopar.plans import Plan

__all__ = ["PlanMeshes", "build_meshes", "needs_fsdp", "MESH_AXES", "expert_meshes",
           "expert_mesh_shape", "expert_fsdp_axes", "expert_legs", "expert_legs_shape"]

MESH_AXES = ("pp", "dp", "ep", "cp", "tp")


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
        ep: the ``ep`` sub-mesh the experts are split over, or None without expert
            parallelism.
        expert_fsdp: the mesh FSDP2 runs the expert modules on: the data-parallel
            ranks holding the same experts (the plan's ``dp`` axis), or None.
        experts: the expert mesh whose sub-meshes ``ep`` and ``expert_fsdp`` are (axes
            of :func:`expert_mesh_shape`), or None.
        cp: the ``cp`` sub-mesh each sequence is split over, or None without context
            parallelism (FSDP2 then runs on ``dp`` and ``cp`` flattened).
        ep_legs: the ``ep`` group cut into its nodes, (the mesh across them, the mesh
            inside this rank's), where a routed module's tokens move in two legs
            (:func:`expert_legs`), else None.
    """

    mesh: DeviceMesh
    tp: DeviceMesh
    fsdp: DeviceMesh | None
    pp: DeviceMesh | None = None
    ep: DeviceMesh | None = None
    expert_fsdp: DeviceMesh | None = None
    experts: DeviceMesh | None = None
    cp: DeviceMesh | None = None
    ep_legs: tuple[DeviceMesh, DeviceMesh] | None = None


def needs_fsdp(plan: Plan) -> bool:
    """Whether the plan runs FSDP2: for data parallelism, low precision (FSDP2's
    ``MixedPrecisionPolicy`` on a ``dp`` mesh of size 1, so every path casts alike) or
    offload (the cost models' rule, :func:`autopar.cost_models.memory.fsdp_lays_out`);
    the ranks of ``cp`` hold replicas too."""
    return fsdp_lays_out(plan.precision, plan.data_parallel * plan.degree("cp"), plan.offload)


def build_meshes(plan: Plan, device_type: str) -> PlanMeshes:
    """Create the plan's meshes with ``init_device_mesh`` (a collective: every rank
    must call it). The caller has checked that the world size matches the plan. With
    context parallelism the ``cp`` axis sits between ``dp`` and ``tp``, and FSDP2 runs
    on ``dp`` and ``cp`` flattened (``dp_cp``), as torchtitan does."""
    pp, dp, tp, cp = plan.degree("pp"), plan.data_parallel, plan.degree("tp"), plan.degree("cp")
    outer: tuple[str, ...] = ("pp", "dp") if pp > 1 else ("dp",)
    shape = (pp, dp) if pp > 1 else (dp,)
    inner: tuple[str, ...] = ("cp", "tp") if cp > 1 else ("tp",)
    inner_shape = (cp, tp) if cp > 1 else (tp,)
    ep = expert_meshes(plan, device_type)
    data = ("dp", "cp") if cp > 1 else ("dp",)
    if dp * cp > 1 and plan.zero == 0:
        root = init_device_mesh(device_type, shape + inner_shape[:-1] + (1, tp),
                                mesh_dim_names=outer + inner[:-1] + ("dp_shard", "tp"))
        if cp > 1:
            root[data]._flatten("dp_cp")
        with warnings.catch_warnings():  # slicing a flattened dim: deprecated, works to 2.13
            warnings.simplefilter("ignore", UserWarning)
            fsdp: DeviceMesh | None = root["dp_cp" if cp > 1 else "dp", "dp_shard"]
    else:
        root = init_device_mesh(device_type, shape + inner_shape, mesh_dim_names=outer + inner)
        flat = root[data]._flatten("dp_cp") if cp > 1 else root["dp"]
        fsdp = flat if needs_fsdp(plan) else None
    return PlanMeshes(mesh=root[outer + inner], tp=root["tp"], fsdp=fsdp,
                      pp=root["pp"] if pp > 1 else None, ep=ep[0], expert_fsdp=ep[1],
                      experts=ep[2], cp=root["cp"] if cp > 1 else None,
                      ep_legs=expert_legs(plan, device_type))


def expert_meshes(plan: Plan, device_type: str) -> tuple[DeviceMesh | None, DeviceMesh | None,
                                                          DeviceMesh | None]:
    """The ``ep`` mesh, the experts' FSDP2 mesh (the ``dp`` ranks holding the same
    experts) and the expert mesh they are cut from, or three Nones without expert
    parallelism. The data-parallel ranks of the main mesh are the ``dp`` and ``ep``
    axes flattened, ``ep`` inner, so both meshes number the ranks alike."""
    if plan.degree("ep") == 1:
        return None, None, None
    names, shape = expert_mesh_shape(plan)
    root = init_device_mesh(device_type, shape, mesh_dim_names=names)
    return root["ep"], root[expert_fsdp_axes(plan)], root


def expert_legs(plan: Plan, device_type: str) -> tuple[DeviceMesh, DeviceMesh] | None:
    """The ``ep`` group cut into its nodes (:func:`expert_legs_shape`): the mesh across
    them and the mesh inside this rank's, or None where no module moves in two legs."""
    found = expert_legs_shape(plan)
    if found is None:
        return None
    root = init_device_mesh(device_type, found[1], mesh_dim_names=found[0])
    return root["ep_node"], root["ep_local"]


def expert_legs_shape(plan: Plan) -> tuple[tuple[str, ...], tuple[int, ...]] | None:
    """The axis names and sizes of the expert mesh with ``ep`` split into ``ep_node`` x
    ``ep_local`` by the plan's :attr:`~autopar.plans.Plan.ep_node_ranks` (so ep rank =
    node x node_ranks + local, as the experts are numbered), or None where no routed
    module moves its tokens in two legs."""
    per_node = plan.ep_node_ranks
    if per_node == 1:
        return None
    names, shape = expert_mesh_shape(plan)
    k = names.index("ep")
    return (names[:k] + ("ep_node", "ep_local") + names[k + 1:],
            shape[:k] + (shape[k] // per_node, per_node) + shape[k + 1:])


def expert_mesh_shape(plan: Plan) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The axis names and sizes of the expert mesh: the plan's, with ``dp_shard`` = 1
    after ``dp`` under ZeRO-0 (FSDP2's hybrid mode: full replicas, as for the rest);
    where the experts fold over tp, ``ep`` is the ``ep`` and ``tp`` ranks together
    (:attr:`~autopar.plans.Plan.expert_ranks`) and there is no ``tp``."""
    names: tuple[str, ...] = ()
    shape: tuple[int, ...] = ()
    for a in MESH_AXES:
        if a == "tp" and plan.fold_experts:
            continue
        if a in plan.mesh:
            size = plan.expert_ranks if a == "ep" else plan.degree(a)
            names, shape = names + (a,), shape + (size,)
        if a == "dp" and plan.zero == 0:
            names, shape = names + ("dp_shard",), shape + (1,)
    return names, shape


def expert_fsdp_axes(plan: Plan) -> tuple[str, ...]:
    """The expert mesh's axes FSDP2 runs the experts on."""
    return ("dp", "dp_shard") if plan.zero == 0 else ("dp",)
