"""Memory-bound work on the parameters: the optimizer step and FSDP2's copies.

:func:`device_step_time` prices the optimizer step on the device (once per step,
after the backward; nothing hides it) at :func:`optimizer_bytes` per element; the
offloaded step runs on the host instead (:mod:`autopar.cost_models.offload`).
:func:`fsdp_copy_time` prices FSDP2's copies of one parameter per micro-batch (on the
device, beside the collectives) from :func:`fsdp_copy_bytes`.

The formulas, the bytes each of FSDP2's copies reads and writes with their source in
PyTorch: docs/cost_models.md, section ``autopar.cost_models.param_work``; the H100
measurement of the step: benchmarks/results/README.md, "Cost models".
"""

from __future__ import annotations

OPTIMIZER_STEP_BYTES = {"adam": 28.0, "adamw": 28.0, "sgd": 20.0}
"""Bytes of memory traffic per parameter element of one optimizer step, one pass over
the fp32 state: AdamW's fused kernel reads parameter, gradient and both moments and
writes parameter and moments, 7 x 4 = 28 bytes; SGD with momentum reads parameter,
gradient and buffer and writes parameter and buffer, 5 x 4 = 20 bytes
(docs/cost_models.md, section ``autopar.cost_models.param_work``). An unknown
optimizer is priced as AdamW."""


def optimizer_bytes(optimizer: str) -> float:
    """Bytes moved per parameter element by one step of ``optimizer``."""
    return OPTIMIZER_STEP_BYTES.get(optimizer, OPTIMIZER_STEP_BYTES["adamw"])


def device_step_time(shard_elements: float, optimizer: str, hw) -> float:
    """Seconds of the optimizer step on the device for ``shard_elements`` fp32
    parameter elements (docs/cost_models.md, section ``autopar.cost_models.param_work``)."""
    return optimizer_bytes(optimizer) * shard_elements / hw.achieved_memory_bandwidth


def fsdp_copy_bytes(compute_bytes: int, shard: int, zero: int, num_microbatches: int,
                    keeps_gathered: bool = False) -> tuple[float, float]:
    """(forward, backward) bytes FSDP2 copies per parameter element per micro-batch,
    averaged over the step's micro-batches (docs/cost_models.md, section
    ``autopar.cost_models.param_work``). ``compute_bytes``: 2 in bf16/fp16, 4 in fp32;
    ``shard``: the shard group's size (1 for ZeRO-0); ``keeps_gathered``: the
    parameters stay gathered from one micro-batch to the next
    (:attr:`~autopar.strategies.settings.Settings.keeps_gathered`), so ZeRO-0/1/2
    gathers once per step and ZeRO-3 only in forward."""
    p, d = float(compute_bytes), float(shard)
    gather = (4.0 + p) / d + 2 * p + (2 * p if shard == 1 else 0.0)
    reduce = p + 4.0 + 8.0 / d + (8.0 if shard == 1 else 0.0)
    accumulate = p + 8.0
    n = max(1, num_microbatches)
    if n > 1 and (zero < 3 or keeps_gathered):  # reduce once, after the last micro-batch
        backward = (reduce + (n - 1) * accumulate) / n
    else:
        backward = reduce
    if zero == 3 and not keeps_gathered:
        backward += gather
    if zero < 3 and keeps_gathered:  # gathered on the first micro-batch only
        gather /= n
    return gather, backward


def fsdp_copy_time(local_elements: float, compute_bytes: int, shard: int, zero: int,
                   num_microbatches: int, hw, keeps_gathered: bool = False
                   ) -> tuple[float, float]:
    """(forward, backward) seconds per micro-batch of FSDP2's copies of one parameter
    of ``local_elements`` elements (the tensor-parallel local size): the bytes moved
    at the achieved memory bandwidth, plus, on a CPU (where the host is the device),
    FSDP2's host time per parameter where the profile measured it (``host_overhead_s``:
    hooks and per-parameter bookkeeping; :mod:`autopar.cost_models.profiling.host_wrappers`).
    On a GPU that host time runs beside the device (:mod:`autopar.cost_models.host`)."""
    rate = hw.achieved_memory_bandwidth
    fwd, bwd = fsdp_copy_bytes(compute_bytes, shard, zero, num_microbatches, keeps_gathered)
    host = {} if hw.host_runs_ahead else hw.host_overhead_s
    return (local_elements * fwd / rate + host.get("fsdp_param_fwd", 0.0),
            local_elements * bwd / rate + host.get("fsdp_param_bwd", 0.0))
