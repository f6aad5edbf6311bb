"""Time of CPU offload (FSDP2 ``CPUOffloadPolicy`` with ZeRO-3).

With offload the sharded fp32 parameters, their gradients and the optimizer state
live in host memory. :func:`offload_transfer_time` prices the host<->device copies
per micro-batch, :func:`host_step_time` the optimizer step on the host's cores once
per step, at :data:`HOST_MEMORY_BANDWIDTH_PER_GPU`.

The formulas t_transfer and t_step: docs/cost_models.md, section
``autopar.cost_models.offload``.
"""

from __future__ import annotations

from autopar.cost_models.param_work import optimizer_bytes

HOST_MEMORY_BANDWIDTH_PER_GPU = 51.2e9
"""Bytes/s of host DRAM bandwidth one GPU's optimizer step can use: a DGX A100 / H100
host has two sockets of 8 DDR4-3200 (A100) or DDR5-4800 (H100) channels, 2 x 8 x 25.6
GB/s = 409.6 GB/s at DDR4-3200 (AMD EPYC 7742 datasheet: 8 channels DDR4-3200), shared
by 8 GPUs: 51.2 GB/s each (the DDR4 figure, the lower of the two)."""


def offload_transfer_time(shard_elements: float, hw) -> float:
    """Seconds per micro-batch of host<->device copies for ``shard_elements`` fp32
    parameter elements (two parameter copies in, one gradient copy out)."""
    return 3 * 4.0 * shard_elements / hw.host_link.bandwidth


def host_step_time(shard_elements: float, optimizer: str, hw) -> float:
    """Seconds per step of the optimizer step on the host for ``shard_elements``."""
    return optimizer_bytes(optimizer) * shard_elements / HOST_MEMORY_BANDWIDTH_PER_GPU
