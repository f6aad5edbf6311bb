"""Data parallelism with FSDP2 ``fully_shard``, one call per repeated block and one on
the root, as in torchtitan's ``apply_fsdp`` (:func:`apply_data_parallel`).

ZeRO 0 runs FSDP2's hybrid mode on a ``(dp, dp_shard=1)`` mesh (a full replica per
rank), ZeRO 1 and 2 shard at rest and keep parameters gathered from forward to
backward, ZeRO 3 gathers per block. Precision "bf16"/"fp16" runs one
``MixedPrecisionPolicy`` on every path (:func:`mixed_precision_policy`), and
``plan.offload`` a ``CPUOffloadPolicy`` (:func:`offload_policy`).

The table of ZeRO stages and meshes, how precision casts and how offload places
parameters, gradients and optimizer state: docs/runtime.md, section
``autopar.runtime.data_parallel``.
"""

from __future__ import annotations

from types import MappingProxyType

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy,
                                    fully_shard)

from autopar.errors import LoweringError
from autopar.plans import Plan, fsdp_unit

__all__ = ["PRECISION_DTYPES", "fsdp_unit", "check_tied_units", "mixed_precision_policy",
           "offload_policy", "apply_data_parallel"]

PRECISION_DTYPES = MappingProxyType(
    {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16})


def check_tied_units(plan: Plan, groups: list[list[str]]) -> None:
    """A tied parameter must live in one ``fully_shard`` unit (each unit gathers and
    frees its own parameters)."""
    for names in groups:
        units = {fsdp_unit(plan.blocks, n) for n in names}
        if len(units) > 1:
            where = ", ".join(f"'{n}' in " + (f"'{u}'" if u else "the root")
                              for n, u in ((n, fsdp_unit(plan.blocks, n)) for n in names))
            raise LoweringError(f"tied parameter {where} would be sharded by different "
                                f"fully_shard units; keep the tying modules out of plan.blocks "
                                f"or in the same block")


def mixed_precision_policy(precision: str) -> MixedPrecisionPolicy:
    """FSDP2's policy for a plan's precision: none for "fp32", else low-precision
    parameters and compute with fp32 gradient reduction (fp32 master weights)."""
    dtype = PRECISION_DTYPES[precision]
    if dtype == torch.float32:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def offload_policy(plan: Plan, device_type: str) -> OffloadPolicy:
    """``CPUOffloadPolicy`` when ``plan.offload`` (pinned host memory on CUDA only),
    else FSDP2's default (no offload)."""
    if not plan.offload:
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=device_type == "cuda")


def apply_data_parallel(model: nn.Module, plan: Plan, mesh: DeviceMesh,
                        expert_mesh: DeviceMesh | None = None) -> None:
    """Wrap each of ``plan.experts`` with ``fully_shard`` on ``expert_mesh`` (the ranks
    holding the same experts: :mod:`autopar.runtime.experts`),
    then each of ``plan.blocks`` and the root on ``mesh``, with the plan's precision
    and offload policies (torchtitan's ``apply_fsdp``)."""
    kwargs = dict(mesh=mesh, mp_policy=mixed_precision_policy(plan.precision),
                  offload_policy=offload_policy(plan, mesh.device_type))
    modules = dict(model.named_modules())
    for path in plan.experts:
        if expert_mesh is None or path not in modules:
            continue
        fully_shard(modules[path], reshard_after_forward=plan.zero == 3,
                    **(kwargs | {"mesh": expert_mesh}))
    for path in plan.blocks:
        fully_shard(model.get_submodule(path), reshard_after_forward=plan.zero == 3, **kwargs)
    # the root's parameters (embeddings, head) are needed again first in backward
    fully_shard(model, reshard_after_forward=False, **kwargs)
