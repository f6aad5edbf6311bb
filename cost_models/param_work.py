"""Memory-bound work on the parameters: the optimizer step and FSDP2's copies.

**Optimizer step** (once per step, after the backward; nothing hides it). On the
device, AdamW's fused kernel makes one pass over the fp32 parameter, gradient and both
moments: it reads 4 streams and writes 3, 7 x 4 = 28 bytes per element (SGD with
momentum: parameter, gradient, buffer read, parameter and buffer written: 5 x 4 = 20
bytes). Each device steps its own shard: divided by ``dp`` when ZeRO (1, 2 or 3)
shards the optimizer state, by the tensor-parallel degree already in the local size:

    t_step = bytes_per_element · N_shard / (memory_bandwidth · memory_efficiency)

Measured on one H100 (benchmarks/results/h100_runtime_steps.json): the fused AdamW
kernels of a 1.32B GPT take 14 ms, 28 x 1.32e9 bytes at 2.6 TB/s. The offloaded
step runs on the host instead (:mod:`autopar.cost_models.offload`).

**FSDP2's copies** (per micro-batch, on the device, beside the collectives). Where
FSDP2 lays the model out (data parallelism, or a low-precision ``MixedPrecisionPolicy``
even on one device) it moves every parameter through three copies per all-gather and
three per gradient reduction, whatever the collective itself costs (PyTorch's
``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py``, seen as kernels in the
H100 profile of one step):

* all-gather: the copy-in (``chunk_cat``) reads the fp32 shard (4/d bytes per element)
  and writes it cast to the compute dtype (p/d, p = 2 in bf16/fp16, 4 in fp32); the
  copy-out (``split_with_sizes_copy``) reads and writes the gathered parameters (2p).
  On a shard group of one the all-gather is itself a device copy (2p more).
* reduction: the copy-in reads the unsharded gradient (p) and writes it in the fp32
  reduce dtype (4); the reduced shard is copied into the sharded gradient (8/d). On a
  shard group of one the reduce-scatter is a device copy (8 more).
* gradient accumulation without synchronization (several micro-batches, ZeRO < 3):
  every micro-batch but the last adds its unsharded gradient into an fp32 buffer
  (reads p and 4, writes 4) instead of reducing.

FSDP2's hooks and per-parameter bookkeeping also cost host time per parameter and
micro-batch; a CPU profile that measured it (``host_overhead_s``) adds it to the copies,
since there host time is device time; on a GPU it is host time beside the device's
(:mod:`autopar.cost_models.host`).

ZeRO-3 all-gathers twice per micro-batch (forward and backward), the others once.
"""

from __future__ import annotations

OPTIMIZER_STEP_BYTES = {"adam": 28.0, "adamw": 28.0, "sgd": 20.0}
"""Bytes of memory traffic per parameter element of one optimizer step (module
docstring); an unknown optimizer is priced as AdamW."""


def optimizer_bytes(optimizer: str) -> float:
    """Bytes moved per parameter element by one step of ``optimizer``."""
    return OPTIMIZER_STEP_BYTES.get(optimizer, OPTIMIZER_STEP_BYTES["adamw"])


def device_step_time(shard_elements: float, optimizer: str, hw) -> float:
    """Seconds of the optimizer step on the device for ``shard_elements`` fp32
    parameter elements (module docstring)."""
    return optimizer_bytes(optimizer) * shard_elements / hw.achieved_memory_bandwidth


def fsdp_copy_bytes(compute_bytes: int, shard: int, zero: int,
                    num_microbatches: int) -> tuple[float, float]:
    """(forward, backward) bytes FSDP2 copies per parameter element per micro-batch,
    averaged over the step's micro-batches (module docstring). ``compute_bytes``: 2 in
    bf16/fp16, 4 in fp32; ``shard``: the shard group's size (1 for ZeRO-0)."""
    p, d = float(compute_bytes), float(shard)
    gather = (4.0 + p) / d + 2 * p + (2 * p if shard == 1 else 0.0)
    reduce = p + 4.0 + 8.0 / d + (8.0 if shard == 1 else 0.0)
    accumulate = p + 8.0
    n = max(1, num_microbatches)
    if zero < 3 and n > 1:  # reduce once, after the last micro-batch
        backward = (reduce + (n - 1) * accumulate) / n
    else:
        backward = reduce
    if zero == 3:
        backward += gather
    return gather, backward


def fsdp_copy_time(local_elements: float, compute_bytes: int, shard: int, zero: int,
                   num_microbatches: int, hw) -> tuple[float, float]:
    """(forward, backward) seconds per micro-batch of FSDP2's copies of one parameter
    of ``local_elements`` elements (the tensor-parallel local size): the bytes moved
    at the achieved memory bandwidth, plus, on a CPU (where the host is the device),
    FSDP2's host time per parameter where the profile measured it (``host_overhead_s``:
    hooks and per-parameter bookkeeping; :mod:`autopar.cost_models.profiling.host_wrappers`).
    On a GPU that host time runs beside the device (:mod:`autopar.cost_models.host`)."""
    rate = hw.achieved_memory_bandwidth
    fwd, bwd = fsdp_copy_bytes(compute_bytes, shard, zero, num_microbatches)
    host = {} if hw.host_runs_ahead else hw.host_overhead_s
    return (local_elements * fwd / rate + host.get("fsdp_param_fwd", 0.0),
            local_elements * bwd / rate + host.get("fsdp_param_bwd", 0.0))
