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
reduction); fp16 gets no loss scaling here, so prefer bf16. Every path runs this one
policy: without data parallelism (``dp`` 1: tensor parallelism only, or a pipeline
stage) the lowering still calls ``fully_shard`` on a ``dp`` mesh of size 1 (see
:mod:`autopar.runtime.mesh`), which shards nothing and only casts. FSDP2 casts each
unit's parameters to ``param_dtype`` when it gathers them and the unit's floating
inputs (``cast_forward_inputs``), so all of a block's ops run in low precision — unlike
``torch.autocast``, which keeps norms and reductions in fp32. Compare a low-precision
run with :func:`autopar.runtime.precision.precision_reference`, the same policy on one
process.

Offload (``plan.offload``, with ``zero`` 3): ``fully_shard(offload_policy=
CPUOffloadPolicy(pin_memory=<on CUDA>))``. On GPUs the sharded parameters, their
gradients and hence the optimizer state (created beside its parameter) stay in host
memory; each unit copies its shard to the GPU before the all-gather and its reduced
gradient shard back after the reduce-scatter, and ``optimizer.step()`` runs on the
CPU. On a CPU mesh the host *is* the device: the policy changes no placement and only
skips pinning (pinned memory needs an accelerator).
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


def apply_data_parallel(model: nn.Module, plan: Plan, mesh: DeviceMesh) -> None:
    """Wrap each of ``plan.blocks`` and then the root with ``fully_shard`` on ``mesh``,
    with the plan's precision and offload policies (torchtitan's ``apply_fsdp``)."""
    kwargs = dict(mesh=mesh, mp_policy=mixed_precision_policy(plan.precision),
                  offload_policy=offload_policy(plan, mesh.device_type))
    for path in plan.blocks:
        fully_shard(model.get_submodule(path), reshard_after_forward=plan.zero == 3, **kwargs)
    # the root's parameters (embeddings, head) are needed again first in backward
    fully_shard(model, reshard_after_forward=False, **kwargs)
