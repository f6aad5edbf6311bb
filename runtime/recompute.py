"""Activation recomputation per block, as ``plan.recompute`` says, with
``torch.utils.checkpoint`` (non-reentrant).

:func:`apply_ac` checkpoints each block (:func:`checkpoint_block`), after tensor
parallelism and before FSDP2, in torchtitan's order: ``"full"`` keeps only the block's
inputs, ``"selective"`` saves the outputs of :data:`autopar.plans.SELECTIVE_SAVE_OPS`
(matrix products, attention, reduce-scatters) and recomputes every other op (:func:`selective_policy`), ``"none"`` leaves autograd
as it is. The block's ``forward`` is replaced in place (:class:`CheckpointedForward`),
so parameter names stay as they were.

The modes in detail, and why ``checkpoint`` rather than ``checkpoint_wrapper``:
docs/runtime.md, section ``autopar.runtime.recompute``.
"""

from __future__ import annotations

from typing import Any, Callable

from torch import nn
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts)

from autopar.errors import LoweringError
from autopar.plans import RECOMPUTE, SELECTIVE_SAVE_OPS, Plan

__all__ = ["selective_policy", "selective_context", "CheckpointedForward",
           "checkpoint_block", "recompute_mode", "check_recompute", "apply_ac"]


def selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """The selective checkpoint policy: ``MUST_SAVE`` the outputs of the ops in
    :data:`~autopar.plans.SELECTIVE_SAVE_OPS` (matched by the aten name without
    overload, ``op.overloadpacket.__name__``), ``PREFER_RECOMPUTE`` every other op."""
    name = getattr(getattr(op, "overloadpacket", op), "__name__", str(op))
    return CheckpointPolicy.MUST_SAVE if name in SELECTIVE_SAVE_OPS else \
        CheckpointPolicy.PREFER_RECOMPUTE


def selective_context() -> Any:
    """A fresh pair of selective-checkpoint contexts for one checkpointed call
    (``context_fn`` of ``torch.utils.checkpoint.checkpoint``)."""
    return create_selective_checkpoint_contexts(selective_policy)


class CheckpointedForward:
    """A block's original ``forward`` run under non-reentrant
    ``torch.utils.checkpoint.checkpoint``; installed as the block's ``forward``
    instance attribute by :func:`checkpoint_block`.

    Attributes:
        inner: the block's forward before wrapping (a bound method).
        mode: "full" or "selective".
    """

    def __init__(self, inner: Callable[..., Any], mode: str) -> None:
        self.inner = inner
        self.mode = mode

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the block's forward, saving what ``mode`` keeps for backward."""
        if self.mode == "selective":
            return checkpoint(self.inner, *args, use_reentrant=False,
                              context_fn=selective_context, **kwargs)
        return checkpoint(self.inner, *args, use_reentrant=False, **kwargs)

    def __repr__(self) -> str:
        return f"CheckpointedForward(mode={self.mode!r})"


def recompute_mode(module: nn.Module) -> str:
    """The recomputation :func:`checkpoint_block` applied to ``module`` ("none" if
    it applied none)."""
    fwd = module.__dict__.get("forward")
    return fwd.mode if isinstance(fwd, CheckpointedForward) else "none"


def checkpoint_block(module: nn.Module, mode: str) -> None:
    """Make ``module`` recompute its activations in backward as ``mode`` says
    ("none", "selective" or "full"), in place: its forward is wrapped, its
    parameters, buffers, submodules and hooks are untouched. Applying a block twice
    replaces the earlier mode."""
    if mode not in RECOMPUTE:
        raise LoweringError(f"unknown recomputation {mode!r}; expected one of "
                            f"{', '.join(RECOMPUTE)}")
    current = module.__dict__.get("forward")
    if isinstance(current, CheckpointedForward):
        inner = current.inner
        del module.forward
    else:
        inner = module.forward
    if mode != "none":
        module.forward = CheckpointedForward(inner, mode)  # type: ignore[method-assign]


def check_recompute(plan: Plan) -> None:
    """Every block named in ``plan.recompute`` must be one of ``plan.blocks`` and
    every mode one of :data:`~autopar.plans.RECOMPUTE`; raises LoweringError."""
    for path, mode in plan.recompute.items():
        if path not in plan.blocks:
            raise LoweringError(f"plan.recompute names '{path}', which is not one of "
                                f"plan.blocks; recomputation is chosen per block (e.g. "
                                f"'{plan.blocks[0] if plan.blocks else 'blocks.0'}'), re-plan "
                                f"or list the block in plan.blocks")
        if mode not in RECOMPUTE:
            raise LoweringError(f"block '{path}' has recomputation {mode!r}; expected one of "
                                f"{', '.join(RECOMPUTE)}")


def apply_ac(model: nn.Module, plan: Plan) -> None:
    """Activation checkpointing of each of ``plan.blocks`` that ``model`` contains,
    as ``plan.recompute`` says (torchtitan's ``apply_ac``); run it after tensor
    parallelism and before ``fully_shard``."""
    for path in plan.blocks:
        mode = plan.recompute.get(path, "none")
        if mode == "none":
            continue
        try:
            block = model.get_submodule(path)
        except AttributeError:
            continue  # a pipeline stage holds only some of the blocks
        checkpoint_block(block, mode)
