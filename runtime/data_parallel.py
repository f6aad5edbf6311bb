"""Data parallelism with FSDP2 ``fully_shard``, one call per repeated block and one on
the root, as in torchtitan's ``apply_fsdp``.

=====  ==========================================  =====================================
zero   mesh (see :mod:`autopar.runtime.mesh`)       behaviour
=====  ==========================================  =====================================
0      ``(dp, dp_shard=1)``: FSDP2 hybrid mode      full replica per rank, gradients
                                                    all-reduced (averaged) over dp
1, 2   ``dp``, ``reshard_after_forward=False``      parameters, gradients and optimizer
                                                    state sharded at rest; parameters
                                                    stay gathered from forward to backward
3      ``dp``, blocks ``reshard_after_forward``     fully sharded, gathered per block
=====  ==========================================  =====================================

With tensor parallelism the parameters are already DTensors on the ``tp`` mesh, and
FSDP2 shards them along dim 0 over ``dp`` as well (2-D parallelism). Gradients are
averaged over ``dp``, so they equal the gradients of the mean loss over the global
batch.

Precision: "bf16"/"fp16" use ``MixedPrecisionPolicy(param_dtype=<dtype>,
reduce_dtype=float32)`` (fp32 master weights, low-precision compute, fp32 gradient
reduction); fp16 gets no loss scaling here, so prefer bf16.
"""

from __future__ import annotations

from types import MappingProxyType

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from autopar.errors import LoweringError
from autopar.plans import Plan

__all__ = ["PRECISION_DTYPES", "fsdp_unit", "check_tied_units", "apply_data_parallel"]

PRECISION_DTYPES = MappingProxyType(
    {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16})


def fsdp_unit(blocks: list[str], fqn: str) -> str:
    """The ``fully_shard`` unit that owns parameter ``fqn``: the block containing it,
    or ``""`` (the root)."""
    for block in blocks:
        if fqn.startswith(block + "."):
            return block
    return ""


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


def apply_data_parallel(model: nn.Module, plan: Plan, mesh: DeviceMesh) -> None:
    """Wrap each of ``plan.blocks`` and then the root with ``fully_shard`` on ``mesh``."""
    dtype = PRECISION_DTYPES[plan.precision]
    policy = MixedPrecisionPolicy() if dtype == torch.float32 else \
        MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for path in plan.blocks:
        fully_shard(model.get_submodule(path), mesh=mesh, mp_policy=policy,
                    reshard_after_forward=plan.zero == 3)
    # the root's parameters (embeddings, head) are needed again first in backward
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
