"""Context parallelism in the user's own forward: each rank's inputs and targets cut to
its head-tail share of every sequence (:func:`split_batch`), and, while the forward
runs, ``F.scaled_dot_product_attention`` replaced by the plan's variant and the
model's ``torch.arange`` over its sequence answered with the rank's positions
(:class:`SequenceShards`).

The model sees sequences of S/cp tokens. Every op but attention works token by token
(the planner checked that: :mod:`autopar.strategies.sequence_flow`), so only two
things must learn that the tokens are a share of a longer sequence: attention, which
must reach the other ranks' keys, and the positions a model makes with
``torch.arange(T)`` (rotary tables, learned position embeddings, Hugging Face's
``cache_position``), which must be the rank's own positions. Both are caught at the
torch API by a ``TorchFunctionMode``. Why this way: docs/runtime.md, section
``autopar.runtime.context_mode``.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from autopar.errors import LoweringError
from autopar.plans import Plan
from autopar.runtime.context_parallel import (allgather_attention, head_tail, ring_attention,
                                              shard_sequence, ulysses_attention)

__all__ = ["SequenceShards", "split_batch", "VARIANT_FUNCTIONS"]

VARIANT_FUNCTIONS: dict[str, Callable[..., torch.Tensor]] = {
    "allgather": allgather_attention, "ring": ring_attention, "ulysses": ulysses_attention}
"""The attention function of each context-parallel variant."""

_SDPA = (F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention,
         torch.ops.aten.scaled_dot_product_attention.default)  # the last in exported stages
_ARANGE = (torch.arange, torch.ops.aten.arange.default, torch.ops.aten.arange.start,
           torch.ops.aten.arange.start_step)
_SDPA_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale",
               "enable_gqa")


def _one_sequence(position_ids: torch.Tensor) -> None:
    """Hugging Face's ``find_packed_sequence_indices`` under context parallelism: no
    packed sequences."""
    return None


def split_batch(plan: Plan, xs: tuple[Any, ...], targets: torch.Tensor, rank: int
                ) -> tuple[tuple[Any, ...], torch.Tensor]:
    """This cp rank's share of inputs ``xs`` and ``targets``: each tensor the plan
    records with a sequence dim (``plan.context.inputs``: the model's inputs, then the
    targets) cut to the rank's head-tail positions along it."""
    cx, cp = plan.context, plan.degree("cp")
    assert cx is not None
    dims = list(cx.inputs) + [None] * (len(xs) + 1 - len(cx.inputs))

    def cut(t: Any, dim: int | None) -> Any:
        if dim is None or not isinstance(t, torch.Tensor):
            return t
        if t.dim() <= dim or t.shape[dim] % (2 * cp):
            raise LoweringError(f"context parallelism over cp={cp} cuts dim {dim} of every "
                                f"sequence into {2 * cp} chunks, but a tensor of shape "
                                f"{tuple(t.shape)} came; pass sequences of a length "
                                f"divisible by {2 * cp} (the plan's: {cx.seq_len})")
        return shard_sequence(t, dim, cp, rank)
    return (tuple(cut(x, d) for x, d in zip(xs, dims[:len(xs)])),
            cut(targets, dims[len(xs)] if len(xs) < len(dims) else None))


class SequenceShards(TorchFunctionMode):
    """While active, attention runs as ``variant`` over the cp ``group`` and
    ``torch.arange`` over the local sequence length (from 0, step 1) returns this
    rank's head-tail positions of the ``seq_len``-token sequence (module docstring)."""

    def __init__(self, group: dist.ProcessGroup, variant: str, seq_len: int) -> None:
        super().__init__()
        if variant not in VARIANT_FUNCTIONS:
            raise LoweringError(f"unknown context-parallel variant {variant!r}; expected one "
                                f"of {', '.join(VARIANT_FUNCTIONS)}")
        self.group, self.attend = group, VARIANT_FUNCTIONS[variant]
        self.cp, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.seq_len = seq_len
        self.local = seq_len // self.cp
        self._packed: Callable | None = None

    def __enter__(self) -> "SequenceShards":
        """Enter the mode; Hugging Face's mask code stops reading the rank's positions,
        which jump where its two chunks meet, as sequences packed together (each rank's
        tokens are one sequence's share: attention is causal over the whole of it)."""
        hf = sys.modules.get("transformers.masking_utils")
        if hf is not None and hasattr(hf, "find_packed_sequence_indices"):
            self._packed = hf.find_packed_sequence_indices
            hf.find_packed_sequence_indices = _one_sequence
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        """Leave the mode; Hugging Face's mask code as it was."""
        if self._packed is not None:
            sys.modules["transformers.masking_utils"].find_packed_sequence_indices = self._packed
            self._packed = None
        super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: D105
        kwargs = kwargs or {}
        if func in _SDPA:
            return self._attention(*args, **kwargs)
        if func in _ARANGE:
            found = self._positions(args, kwargs)
            if found is not None:
                return found
        return func(*args, **kwargs)

    def _attention(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The variant's attention for one ``scaled_dot_product_attention`` call."""
        a = dict(zip(_SDPA_NAMES, args)) | kwargs
        if a.get("attn_mask") is not None:
            raise LoweringError("context parallelism runs causal or unmasked attention, but "
                                "the model passed an attention mask to "
                                "scaled_dot_product_attention; drop the mask (is_causal=True) "
                                "or plan without cp")
        if a.get("dropout_p", 0.0):
            raise LoweringError("context parallelism runs attention without dropout; set "
                                "the attention dropout to 0 or plan without cp")
        return self.attend(a["query"], a["key"], a["value"], self.group,
                           is_causal=bool(a.get("is_causal", False)), scale=a.get("scale"))

    def _positions(self, args: tuple, kwargs: dict) -> torch.Tensor | None:
        """This rank's positions for ``torch.arange(local)`` or ``(0, local)``, else
        None (any other range is the model's own business)."""
        nums = [a for a in args if not isinstance(a, torch.dtype)]
        start, end, step = (0, nums[0], 1) if len(nums) == 1 else (
            (nums[0], nums[1], nums[2] if len(nums) > 2 else 1) if nums else (None, None, None))
        if end is None:
            start, end, step = kwargs.get("start", 0), kwargs.get("end"), kwargs.get("step", 1)
        if isinstance(end, torch.Tensor) or isinstance(start, torch.Tensor):
            return None
        if start != 0 or step != 1 or end != self.local:
            return None
        dtype = kwargs.get("dtype") or (torch.get_default_dtype() if any(
            isinstance(v, float) for v in (start, end, step)) else torch.int64)
        pos = head_tail(self.seq_len, self.cp, self.rank)
        return pos.to(device=kwargs.get("device"), dtype=dtype)
