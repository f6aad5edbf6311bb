"""Memory model: bytes per parameter for weights, gradients and optimizer state, and
which tensors each operator saves for its backward pass.

Per parameter element (Rajbhandari et al., "ZeRO", SC'20, §3.1: mixed-precision Adam
keeps 2 + 2 + 12 = 16 bytes):

==========  =======  ======  ==========  ==========================================
precision   param    grad    Adam/AdamW  SGD (momentum)
==========  =======  ======  ==========  ==========================================
fp32        4        4       8 (m, v)    4 (momentum buffer)
bf16/fp16   4 + 2    4       8           4
==========  =======  ======  ==========  ==========================================

Mixed precision is counted as PyTorch-native mixed precision runs it (FSDP2's
MixedPrecisionPolicy or autocast): fp32 master parameters (4) plus the low-precision
compute copy (2), fp32 gradients after reduction (4), fp32 moments (8) — 18 bytes for
Adam, 2 more than ZeRO's table because the fp32 master is the parameter itself and a
bf16 copy is cached for compute.
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


def activation_bytes_per_element(precision: str) -> int:
    """Bytes of one activation element: 4 in fp32, 2 under bf16/fp16 mixed precision."""
    return 4 if precision == "fp32" else 2


# What autograd saves (tensor-input indices; -1 = the output). Parameters are skipped by
# the caller (they are counted as parameters). Sources: the derivative formulas in
# PyTorch's tools/autograd/derivatives.yaml.
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


def saved_for_backward(target: str, n_inputs: int) -> tuple[int, ...]:
    """Indices of the op's tensor inputs (and -1 for its output) saved for backward."""
    parts = target.split(".")
    op = parts[1] if len(parts) >= 3 and parts[0] == "aten" else parts[-1]
    return tuple(i for i in _SAVED.get(op, ()) if i < n_inputs)


def memory_budget(hw, budget: float | None) -> float:
    """The user's budget in bytes, or the profile's usable memory."""
    return float(budget) if budget is not None else float(hw.usable_memory_bytes)
