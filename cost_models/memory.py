"""Memory model: bytes per device for parameters, gradients and optimizer state by
ZeRO stage, precision and offload, and which tensors each operator saves for its
backward pass.

Peak model (what the planner bounds; bytes per device, per pipeline rank):

    M = P_rest + acc·G + O + P_gathered + held · A_kept + max(T_loss, A_recompute)

* ``P_rest``, ``G``, ``O``: parameters (fp32 masters), fp32 gradients and optimizer
  state of the device's share, each divided by ``dp`` when the ZeRO stage shards it
  (table below); zero on the device with CPU offload.
* ``P_gathered``: low-precision (or, in fp32, separate all-gathered) parameter copies
  live during forward and backward: every parameter for ZeRO-1/2 (FSDP2 keeps them
  gathered from forward to backward) and for ZeRO-0 under bf16/fp16 (the cast copy);
  the root's parameters plus two blocks for ZeRO-3 (the block computing and the one
  prefetched: FSDP2 prefetches one ``fully_shard`` unit ahead).
* ``A_kept``: the bytes autograd saves for backward for one micro-batch (per op:
  :func:`saved_for_backward`), after recomputation (only the block inputs under full
  recomputation, plus the outputs of ``SELECTIVE_SAVE_OPS`` under selective);
  ``held`` micro-batches are in flight (1 without a pipeline; the schedule's count on a
  pipeline rank).
* ``T_loss``: at the start of backward the loss's gradient w.r.t. its input and, when
  the loss casts the logits to fp32, w.r.t. the logits (both logits-sized); freed
  once the head's backward ran;
* ``A_recompute``: the one block being recomputed holds its whole activations again
  during its backward (by then ``T_loss`` is freed, hence the max).

Liveness: this is the peak at the start of backward (or while the first recomputed
block runs its backward). Gradients count there only when they outlive the step's
forward: ``acc`` = 1 with several micro-batches (gradient accumulation, pipelines),
0 with one, where ``zero_grad()`` (``set_to_none``) freed them and they grow only as
the activations are freed. Not modeled: a step whose gradients outweigh its
activations peaks at the end of backward or in the optimizer step (P + O + G + the
optimizer's temporaries) instead.

Allocator allowance: the bytes above are what the caching allocator hands out. Its
rounding (512 B blocks below 1 MiB, 2 MiB segments above: PyTorch's
``CUDACachingAllocator``), fragmentation, the CUDA context and NCCL's own buffers are not
in M; they are the profile's ``memory_reserve_bytes`` (6 GiB on the GPU profiles, stated
there), which the default budget leaves free.

Per parameter element (Rajbhandari et al., "ZeRO", SC'20, §3.1, counted as PyTorch's
FSDP2 lowers each stage: ``fully_shard`` keeps fp32 sharded parameters and, with
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, all-gathers bf16
copies that are freed after use; sharded gradients are fp32; AdamW's ``exp_avg`` and
``exp_avg_sq`` follow the fp32 parameter):

=====  =================  ==================  ===========  =======================
zero   param (rest)       gathered copy       grad         Adam/AdamW (SGD)
=====  =================  ==================  ===========  =======================
0      4                  2 (bf16/fp16) / 0   4            8 (4)
1, 2   4 / dp             2 or 4 (all)        4 / dp       8 / dp (4 / dp)
3      4 / dp             2 or 4 (2 blocks)   4 / dp       8 / dp (4 / dp)
=====  =================  ==================  ===========  =======================

ZeRO-1 lowers as ZeRO-2 (FSDP2 ``reshard_after_forward=False`` shards gradients too),
so the two cost the same. Offload (FSDP2 ``CPUOffloadPolicy``, ZeRO-3 only) keeps the
param, grad and optimizer columns in host memory.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.errors import ConfigError

PRECISIONS = ("fp32", "bf16", "fp16")
OPTIMIZERS = ("adam", "adamw", "sgd")


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter element kept for training."""

    param: float
    grad: float
    optimizer: float

    @property
    def total(self) -> float:
        """Sum of the three."""
        return self.param + self.grad + self.optimizer


def state_bytes(precision: str, optimizer: str) -> StateBytes:
    """Bytes per parameter element for ``precision`` and ``optimizer`` (see table)."""
    if precision not in PRECISIONS:
        raise ConfigError(f"precision {precision!r} is not one of {', '.join(PRECISIONS)}")
    if optimizer not in OPTIMIZERS:
        raise ConfigError(f"optimizer {optimizer!r} is not one of {', '.join(OPTIMIZERS)}")
    param = 4.0 if precision == "fp32" else 6.0
    opt = 8.0 if optimizer in ("adam", "adamw") else 4.0
    return StateBytes(param, 4.0, opt)


@dataclass(frozen=True)
class ParamBytes:
    """Bytes per parameter element on one device, by category, for one ZeRO stage
    (already divided by ``dp`` where the stage shards; see the module table).
    ``gathered`` applies to every parameter for ZeRO-0/1/2 and to the gathered blocks
    only for ZeRO-3 (``gathered_all`` says which)."""

    param: float
    grad: float
    optimizer: float
    gathered: float
    gathered_all: bool


def fsdp_lays_out(precision: str, dp: int, offload: bool) -> bool:
    """Whether FSDP2 lays the parameters out: for data parallelism, for the
    low-precision cast (``MixedPrecisionPolicy``, on a dp mesh of size 1) and for CPU
    offload (``CPUOffloadPolicy``). The runtime and both cost models follow this rule."""
    return dp > 1 or precision != "fp32" or offload


def param_bytes(precision: str, optimizer: str, zero: int, dp: int,
                offload: bool = False) -> ParamBytes:
    """Bytes per parameter element on a device (module table)."""
    sb = state_bytes(precision, optimizer)
    if zero not in (0, 1, 2, 3):
        raise ConfigError(f"zero={zero!r} is not a ZeRO stage (0, 1, 2 or 3)")
    if offload and zero != 3:
        raise ConfigError("offload needs zero=3 (FSDP2 offloads sharded parameters)")
    low = activation_bytes_per_element(precision)
    shard = dp if zero >= 1 else 1
    # FSDP2 computes on a separate unsharded copy, even on a shard group of one
    # (ZeRO-0's replicate mesh): measured by the probe (tests/test_memory_accuracy.py),
    # params = 2x the fp32 parameters
    gathered = float(low) if fsdp_lays_out(precision, dp, offload) else 0.0
    keep = 0.0 if offload else 1.0
    return ParamBytes(keep * 4.0 / shard, keep * sb.grad / shard, keep * sb.optimizer / shard,
                      gathered, zero != 3)


def activation_bytes_per_element(precision: str) -> int:
    """Bytes of one activation element: 4 in fp32, 2 under bf16/fp16 mixed precision."""
    return 4 if precision == "fp32" else 2


# What autograd saves (tensor-input indices; -1 = the output). Parameters are skipped by
# the caller (they are counted as parameters). Sources: the derivative formulas in
# PyTorch's tools/autograd/derivatives.yaml: linear/mm save both operands (input and
# weight), addmm its two matrices; layer_norm its input (plus mean and rstd, B·S fp32
# each, left out: 1/h of the input); gelu and silu their input; sigmoid, tanh, relu,
# exp, softmax their output; scaled_dot_product_attention q, k, v and its output (plus
# logsumexp, B·H·S fp32, left out: 1/head_dim of the output); embedding its indices
# (int64); cross_entropy the log-softmax of its input (sized as the input); dropout its
# mask.
_SAVED: dict[str, tuple[int, ...]] = {
    "linear": (0, 1), "mm": (0, 1), "bmm": (0, 1), "matmul": (0, 1), "addmm": (1, 2),
    "baddbmm": (1, 2), "einsum": (0, 1),
    "layer_norm": (0,), "rms_norm": (0,), "group_norm": (0,),
    "gelu": (0,), "silu": (0,), "sigmoid": (-1,), "tanh": (-1,), "relu": (-1,),
    "exp": (-1,), "rsqrt": (-1,), "sqrt": (-1,), "pow": (0,), "log": (0,),
    "sin": (0,), "cos": (0,), "mul": (0, 1), "div": (0, 1),
    "softmax": (-1,), "_softmax": (-1,), "log_softmax": (-1,), "_log_softmax": (-1,),
    "scaled_dot_product_attention": (0, 1, 2, -1),
    "embedding": (1,), "cross_entropy_loss": (0,), "nll_loss": (0,),
    "dropout": (-1,), "native_dropout": (-1,),
}
# Saved tensors whose element size is not the activation dtype's: dropout keeps its
# boolean mask (1 byte; derivatives.yaml: native_dropout_backward(grad, mask, scale)).
_SAVED_ELEMENT_BYTES: dict[str, float] = {"dropout": 1.0, "native_dropout": 1.0}


def saved_element_bytes(target: str) -> float | None:
    """Bytes per element of the op's saved output when it is not an activation (None)."""
    return _SAVED_ELEMENT_BYTES.get(_op(target))


def _op(target: str) -> str:
    parts = target.split(".")
    return parts[1] if len(parts) >= 3 and parts[0] == "aten" else parts[-1]


def saved_for_backward(target: str, n_inputs: int) -> tuple[int, ...]:
    """Indices of the op's tensor inputs (and -1 for its output) saved for backward."""
    return tuple(i for i in _SAVED.get(_op(target), ()) if i < n_inputs)


def memory_budget(hw, budget: float | None) -> float:
    """The user's budget in bytes, or the profile's usable memory."""
    return float(budget) if budget is not None else float(hw.usable_memory_bytes)
