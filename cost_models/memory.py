"""Memory model: bytes per device for parameters, gradients and optimizer state by
ZeRO stage, precision and offload, and which tensors each operator saves for its
backward pass.

:func:`param_bytes` gives a device's bytes per parameter element by category
(:class:`ParamBytes`, from :func:`state_bytes`); :func:`fsdp_lays_out` says when FSDP2
lays the parameters out; :func:`saved_for_backward` and :func:`saved_element_bytes`
say what an op saves; :func:`memory_budget` is the budget in bytes.

The peak model M = P_rest + acc·G + O + P_gathered + held · A_kept + max(T_loss,
A_recompute), its liveness, the allocator allowance and the bytes per parameter element
by ZeRO stage with their sources: docs/cost_models.md, section
``autopar.cost_models.memory``.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.errors import ConfigError

PRECISIONS = ("fp32", "bf16", "fp16", "fp8")
"""``"fp8"``: bf16 training with float8 Linear products (:mod:`autopar.cost_models.float8`)."""
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
    """Bytes per parameter element for ``precision`` and ``optimizer`` (the table in
    docs/cost_models.md, section ``autopar.cost_models.memory``)."""
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
    (already divided by ``dp`` where the stage shards; the table in docs/cost_models.md,
    section ``autopar.cost_models.memory``).
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
                offload: bool = False, grads_unsharded: bool = False,
                keeps_gathered: bool = False) -> ParamBytes:
    """Bytes per parameter element on a device (the table in docs/cost_models.md,
    section ``autopar.cost_models.memory``). ``grads_unsharded``: FSDP2 accumulates
    the gradients unsharded in fp32 until it reduces them once per step
    (:attr:`~autopar.strategies.settings.Settings.grad_sync_once`);
    ``keeps_gathered``: every parameter stays gathered after its backward
    (:attr:`~autopar.strategies.settings.Settings.keeps_gathered`), under ZeRO-3 too."""
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
    grad = 4.0 if grads_unsharded else keep * sb.grad / shard
    return ParamBytes(keep * 4.0 / shard, grad, keep * sb.optimizer / shard,
                      gathered, zero != 3 or keeps_gathered)


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
