"""Head-aligned shards of fused projections on DTensor.

A fused projection (one ``qkv = Linear(h, 3h)`` split into q, k and v, or one
``gate_up = Linear(h, 2f)`` split in two) is sharded as Megatron-LM shards it: rank
``r`` holds chunk ``r`` of every piece, written ``"S(d)/k"`` in a plan
(:func:`piecewise_shard`, :func:`piecewise_pieces`), DTensor's ``_StridedShard``.
:func:`register_piecewise_sharding` keeps the pieces local through the split and the
concatenation, which DTensor would otherwise gather.

Private API (torch 2.11 to 2.13) is isolated here; which parts, and why the public
``register_sharding`` does not serve: docs/runtime.md, section
``autopar.runtime.piecewise``.

This module imports torch alone: the generated training program carries its source.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

__all__ = ["piecewise_shard", "piecewise_pieces", "register_piecewise_sharding"]


def piecewise_shard(dim: int, pieces: int) -> Placement:
    """The DTensor placement of tensor dim ``dim`` cut into ``pieces`` equal pieces,
    each split evenly over the mesh axis (``Shard(dim)`` for one piece)."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return Shard(dim) if pieces == 1 else _StridedShard(dim, split_factor=pieces)


def piecewise_pieces(p: Placement) -> int | None:
    """How many equal pieces placement ``p`` splits piecewise (1 for a plain
    ``Shard``), or None when ``p`` is not a shard."""
    from torch.distributed.tensor.placement_types import _StridedShard

    if isinstance(p, _StridedShard):
        return int(p.split_factor)
    return 1 if isinstance(p, Shard) else None


def _sharded_on(placements: tuple[Placement, ...], dim: int) -> list[int]:
    """The mesh dims whose placement shards tensor dim ``dim``."""
    return [i for i, p in enumerate(placements)
            if piecewise_pieces(p) is not None and p.dim == dim]  # type: ignore[attr-defined]


def _split_sizes(n: int, split: Any) -> list[int]:
    if isinstance(split, int):
        return [split] * (n // split) + ([n % split] if n % split else [])
    return [int(s) for s in split]


def _split(op_call: Any, args: tuple, kwargs: dict) -> tuple:
    """DTensor's split (``aten.split.Tensor``, ``aten.split_with_sizes``), and more: a
    dim sharded piecewise over one mesh dim and split into whole pieces hands each
    piece on sharded, with no collective. Otherwise, as DTensor does, a dim sharded
    on the split is gathered first; the split then runs on the local tensor."""
    x, split = args[0], args[1] if len(args) > 1 else kwargs["split_size"]
    dim = (args[2] if len(args) > 2 else kwargs.get("dim", 0)) % x.ndim
    sizes = _split_sizes(x.shape[dim], split)
    placements = list(x.placements)
    axes = _sharded_on(x.placements, dim)
    k = piecewise_pieces(placements[axes[0]]) if len(axes) == 1 else None
    block = x.shape[dim] // k if k and x.shape[dim] % k == 0 else 0
    if len(sizes) > 1 and block and not any(s % block for s in sizes):
        n = x.device_mesh.size(axes[0])
        local = x.to_local().split([s // n for s in sizes], dim)
        outs = []
        for s in sizes:
            placements[axes[0]] = piecewise_shard(dim, s // block)
            outs.append(tuple(placements))
    else:
        for a in axes:
            placements[a] = Replicate()
        if axes:
            x = x.redistribute(x.device_mesh, placements)
        local = x.to_local().split(sizes, dim)
        outs = [tuple(placements)] * len(sizes)
    shape = list(x.shape)
    result = []
    for piece, s, pl in zip(local, sizes, outs):
        shape[dim] = s
        result.append(DTensor.from_local(piece, x.device_mesh, pl, run_check=False,
                                         shape=torch.Size(shape), stride=x.stride()))
    return tuple(result)


def _cat_strategy(original: Any, op_schema: Any) -> Any:
    """DTensor's concatenation strategy, plus: tensors sharded alike on the
    concatenated dim over one mesh dim, in pieces of one size, concatenate into a
    piecewise shard of all their pieces (no collective)."""
    from torch.distributed.tensor._op_schema import DTensorSpec, OpSpec
    from torch.distributed.tensor._ops.utils import generate_redistribute_costs

    result = original(op_schema)
    children = op_schema.args_schema[0].children
    first = children[0]
    dim = op_schema.args_schema[1] if len(op_schema.args_schema) > 1 else 0
    dim = dim % first.ndim
    specs = [c.strategies[0].output_spec for c in children]
    axes = _sharded_on(specs[0].placements, dim)
    if len(children) < 2 or len(axes) != 1:
        return result
    axis = axes[0]
    others = [tuple(p for i, p in enumerate(s.placements) if i != axis) for s in specs]
    pieces = [piecewise_pieces(s.placements[axis]) for s in specs]
    if any(o != others[0] for o in others) or None in pieces or \
            any(s.placements[axis].dim != dim for s in specs):  # type: ignore[attr-defined]
        return result
    blocks = {c.shape[dim] // k for c, k in zip(children, pieces) if c.shape[dim] % k == 0}
    if len(blocks) != 1 or any(c.shape[dim] % k for c, k in zip(children, pieces)):
        return result
    pl = list(specs[0].placements)
    pl[axis] = piecewise_shard(dim, sum(pieces))  # type: ignore[arg-type]
    result.strategies.append(OpSpec(
        output_specs=DTensorSpec(first.mesh, tuple(pl)), input_specs=tuple(specs),
        redistribute_cost=[generate_redistribute_costs(c, s) for c, s in zip(children, specs)]))
    return result


def register_piecewise_sharding() -> None:
    """Give DTensor the piecewise split (:func:`_split`, as an op handler: the local
    split's sizes differ from the global ones) and concatenation
    (:func:`_cat_strategy`, beside DTensor's own strategies); idempotent."""
    import functools

    aten = torch.ops.aten
    handlers = DTensor._op_dispatcher._custom_op_handlers
    for op in (aten.split.Tensor, aten.split_with_sizes.default):
        handlers[op] = _split
    prop = DTensor._op_dispatcher.sharding_propagator
    current = prop.op_strategy_funcs[aten.cat.default]
    if not getattr(current, "piecewise", False):
        wrapped = functools.partial(_cat_strategy, current)
        wrapped.piecewise = True  # type: ignore[attr-defined]
        prop.register_op_strategy(aten.cat.default, wrapped,
                                  prop.op_to_schema_info.get(aten.cat.default))
        cache = getattr(prop, "propagate_op_sharding", None)
        if hasattr(cache, "cache_clear"):
            cache.cache_clear()
