"""Attention masks that run as ``is_causal``: price and shard them so.

A Hugging Face model run eagerly with SDPA attention and no padding builds no mask
where the mask would be exactly causal, and its attention runs with ``is_causal=True``
(half the work); traced, the captured graph holds an explicit boolean mask instead.
:func:`mark_causal_masks` records such an op as causal where :func:`is_causal_mask`
finds its mask equal to that triangle and :func:`skips_causal_masks` finds a model
whose code skips such masks.

Why, and which masks stay as captured: docs/capture.md, section ``autopar.masks``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx, nn

from autopar.graph import Graph

SDPA = "aten.scaled_dot_product_attention.default"
MASK_ARG, CAUSAL_ARG = 3, 5
"""Positions of ``attn_mask`` and ``is_causal`` in ``scaled_dot_product_attention``'s
arguments."""
SDPA_DEFAULTS = (None, None, None, None, 0.0, False)
"""Its defaults up to ``is_causal`` (attn_mask None, dropout_p 0.0, is_causal False),
for arguments a call left out."""
MAX_ELEMENTS = 1 << 27
"""Largest tensor evaluated (128 Mi elements: a batch of 2 at sequence 8K is 128 Mi
booleans); a larger mask is left as captured."""


class _NotConstant(Exception):
    """The value depends on something not known at planning time, or is too large."""


def skips_causal_masks(model: nn.Module) -> bool:
    """Whether ``model`` holds a Hugging Face model attending with SDPA, whose mask code
    returns no mask (and ``is_causal=True``) where the mask would be exactly causal."""
    for m in model.modules():
        config = getattr(m, "config", None)
        if getattr(config, "_attn_implementation", None) == "sdpa" and any(
                c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers.")
                for c in type(m).__mro__):
            return True
    return False


def mark_causal_masks(g: Graph, model: nn.Module) -> list[str]:
    """Record as causal each SDPA op of ``g`` whose mask the model's eager code skips
    (docs/capture.md): ``is_causal`` set in its arguments, its FLOPs halved as
    :func:`autopar.flops` counts causal attention. Returns the ops' names."""
    if g.fx is None or not skips_causal_masks(model):
        return []
    fx_nodes = {n.name: n for n in g.fx.graph.nodes}
    values: dict[str, Any] = {}
    causal: dict[str, bool] = {}  # by mask: every layer reads the same one
    marked = []
    for n in g.nodes:
        if n.target != SDPA or len(n.args) <= MASK_ARG or \
                (len(n.args) > CAUSAL_ARG and n.args[CAUSAL_ARG] is True):
            continue
        ref = n.args[MASK_ARG]
        if not (isinstance(ref, str) and ref.startswith("%")) or ref[1:] not in fx_nodes:
            continue
        if ref not in causal:
            try:
                causal[ref] = is_causal_mask(_evaluate(fx_nodes[ref[1:]], values))
            except _NotConstant:
                causal[ref] = False
        if causal[ref]:
            args = [*n.args, *SDPA_DEFAULTS[len(n.args):]]
            n.args = [*args[:CAUSAL_ARG], True, *args[CAUSAL_ARG + 1:]]
            n.flops /= 2.0
            marked.append(n.name)
    return marked


def is_causal_mask(mask: Any) -> bool:
    """Whether ``mask`` (boolean: True attends; or additive float: 0 attends, a large
    negative value blocks) is the square lower triangle ``is_causal=True`` applies,
    the same for every batch and head."""
    if not isinstance(mask, torch.Tensor) or mask.dim() < 2 or mask.shape[-1] != mask.shape[-2]:
        return False
    n = mask.shape[-1]
    tril = torch.ones(n, n, dtype=torch.bool).tril()
    if mask.dtype == torch.bool:
        return bool((mask == tril).all())
    if not mask.is_floating_point():
        return False
    return bool(((mask == 0) == tril).all()) and bool((mask[..., ~tril] <= -1e4).all())


def _evaluate(node: fx.Node, values: dict[str, Any]) -> Any:
    """The value of ``node`` computed on the CPU from constants alone (memoized in
    ``values``); raises _NotConstant where it reads an input, a parameter or a buffer,
    or a tensor would exceed MAX_ELEMENTS."""
    if node.name in values:
        return values[node.name]
    if node.op != "call_function":
        raise _NotConstant(node.name)
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor) and val.numel() > MAX_ELEMENTS:
        raise _NotConstant(node.name)
    args = fx.node.map_arg(node.args, lambda a: _evaluate(a, values))
    kwargs = fx.node.map_arg(node.kwargs, lambda a: _evaluate(a, values))
    if "device" in kwargs:
        kwargs = {**kwargs, "device": torch.device("cpu")}
    try:
        out = node.target(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 — anything it cannot run is not a known constant
        raise _NotConstant(node.name) from e
    if isinstance(out, torch.Tensor) and out.device.type != "cpu":
        raise _NotConstant(node.name)
    values[node.name] = out
    return out
