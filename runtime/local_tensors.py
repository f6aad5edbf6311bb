"""Local tensors inside a tensor-parallel region: DTensor only at its edges.

A *region* is a module whose parameters all belong to colwise and rowwise Linears (an
attention, a feed-forward network under the Megatron-LM layout). As torchtitan does with
``use_local_output=True``, it runs on local tensors: its replicated inputs become local
tensors with a partial-sum gradient, its Linears compute with their local weight shards,
and a rowwise Linear's partial output is wrapped back as a ``Partial`` DTensor, laid
out as planned, and gets its bias. Its first forward runs both ways and it stays local
only where every rank found the same outputs (:class:`LocalRegion`).
:func:`localize_regions` applies the tables of
:func:`autopar.runtime.tensor_parallel.local_regions`. How and why: docs/runtime.md,
section ``autopar.runtime.local_tensors``. This module imports torch and
:mod:`autopar.runtime.dtensor_layout` alone: the generated program carries both.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial
from torch.utils._pytree import tree_flatten, tree_map

from autopar.runtime.dtensor_layout import lookup

__all__ = ["LocalRegion", "localize_regions"]


def _same_outputs(want: Any, got: Any) -> bool:
    """Whether two forward results agree: the same structure, DTensors of the same
    placements (compared by local tensor) and plain tensors alike, to float rounding."""
    a, spec_a = tree_flatten(want)
    b, spec_b = tree_flatten(got)
    if spec_a != spec_b:
        return False
    for x, y in zip(a, b):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if not isinstance(x, torch.Tensor):
            continue
        if isinstance(x, DTensor) != isinstance(y, DTensor):
            return False
        if isinstance(x, DTensor):
            if x.placements != y.placements or x.shape != y.shape:
                return False
            x, y = x.to_local(), y.to_local()
        if x.shape != y.shape or x.dtype != y.dtype:
            return False
        if x.is_floating_point() and x.numel():
            scale = x.abs().max().item() or 1.0
            if not torch.allclose(x, y, rtol=1e-4, atol=1e-5 * scale):
                return False
        elif not torch.equal(x, y):
            return False
    return True


class LocalRegion:
    """A region's ``forward`` (set as an instance attribute of its module): on its
    first call it runs the module's own forward both on DTensors and on local tensors
    and keeps local tensors when every rank of ``group`` found the same outputs; later
    calls run the way chosen. ``local`` is None until then, and ``active`` is True while
    a forward runs on local tensors (read by the Linears' hooks); ``linears`` are the
    region's Linears, whose local weights are dropped after each forward."""

    def __init__(self, forward: Any, group: Any, linears: list[nn.Module]) -> None:
        self.forward = forward
        self.group = group
        self.linears = linears
        self.local: bool | None = None
        self.active = False

    def _run(self, local: bool, args: tuple, kwargs: dict) -> Any:
        if local:
            args, kwargs = tree_map(_local_input, (args, kwargs))
        self.active = local
        try:
            return self.forward(*args, **kwargs)
        finally:
            self.active = False
            for m in self.linears:  # also after a failure, before the forward hooks
                m.__dict__.pop("weight", None)
                m.__dict__.pop("bias", None)

    def _agrees(self, args: tuple, kwargs: dict) -> bool:
        """Run both ways without gradients on a copy of the random state; True when
        every rank's outputs agree."""
        tensors = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
        cuda = [t.device for t in tensors if t.device.type == "cuda"][:1]
        with torch.no_grad(), torch.random.fork_rng(devices=cuda):
            want = self._run(False, args, kwargs)
            try:
                same = _same_outputs(want, self._run(True, args, kwargs))
            except Exception:  # noqa: BLE001 — any failure on local tensors: keep DTensors
                same = False
        device = tensors[0].device if tensors else torch.device("cpu")
        flag = torch.tensor([0.0 if same else 1.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return flag.item() == 0.0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:  # noqa: D102
        if self.local is None:
            self.local = self._agrees(args, kwargs)
        return self._run(self.local, args, kwargs)


def _local_input(x: Any) -> Any:
    """A replicated DTensor as its local tensor, whose gradient is this rank's partial
    sum (the region splits the work over the ranks); anything else as it is."""
    if isinstance(x, DTensor) and all(p.is_replicate() for p in x.placements):
        return x.to_local(grad_placements=[Partial()] * x.device_mesh.ndim)
    return x


class _LocalShard(torch.autograd.Function):
    """``p.to_local()`` of a parameter whose shard is contiguous, its gradient wrapped
    in the parameter's own spec by DTensor's constructor: ``to_local``'s backward
    builds a spec and runs ``from_local``, an autograd function of its own, for the
    same DTensor (private fields in torch 2.11 to 2.13)."""

    @staticmethod
    def forward(ctx: Any, p: DTensor) -> torch.Tensor:  # noqa: D102
        ctx.spec = p._spec
        return p._local_tensor.view_as(p._local_tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> DTensor:  # noqa: D102
        return DTensor(grad.contiguous(), ctx.spec, requires_grad=False)


def _local_shard(p: Any) -> torch.Tensor:
    """The local shard of parameter ``p``, its gradient flowing back to ``p``
    (``to_local`` where the private fields are not there or the shard is strided)."""
    local = getattr(p, "_local_tensor", None)
    if local is not None and hasattr(p, "_spec") and local.is_contiguous():
        return _LocalShard.apply(p)
    return p.to_local()


def _local_weights(region: LocalRegion, rowwise: bool, module: nn.Module, args: tuple) -> None:
    """Before a Linear of an active region: its local weight (and colwise bias) shards
    in its ``__dict__``, which attribute lookup reads before its parameters."""
    if not region.active:
        return
    module.__dict__["weight"] = _local_shard(module._parameters["weight"])
    bias = module._parameters.get("bias")
    if bias is not None:
        module.__dict__["bias"] = None if rowwise else _local_shard(bias)


def _partial_output(region: LocalRegion, mesh: DeviceMesh, module: nn.Module, args: tuple,
                    output: Any) -> Any:
    """After a rowwise Linear of an active region: its local partial sum as a
    ``Partial`` DTensor (laid out next by the plan's own hook)."""
    if region.active and type(output) is torch.Tensor:
        return DTensor.from_local(output, mesh, [Partial()], run_check=False)
    return output


def _add_bias(region: LocalRegion, module: nn.Module, args: tuple, output: Any) -> Any:
    """After a rowwise Linear of an active region is laid out: its replicated bias."""
    bias = module._parameters.get("bias")
    if region.active and bias is not None:
        return output + bias
    return output


def localize_regions(model: nn.Module, mesh: DeviceMesh, regions: Mapping[str, Any],
                     linears: Mapping[str, str]) -> None:
    """Run each module of ``regions`` on local tensors where that is exact (see the
    module docstring); ``linears``: the style ("colwise" or "rowwise") of each Linear
    inside them. Paths are relative to ``model``, ``*`` for any block index
    (:func:`lookup`). Call it after :func:`relayout_modules`: a region's first input is
    laid out by its hook, and a rowwise Linear's partial output by its own."""
    current: list[tuple[str, LocalRegion]] = []
    for path, module in model.named_modules():
        current = [(p, r) for p, r in current if path.startswith(p + ".")]
        if lookup(regions, path) is not None:
            region = LocalRegion(module.forward, mesh.get_group(), [])
            module.forward = region
            current.append((path, region))
            continue
        style = lookup(linears, path) if current else None
        if style is None:
            continue
        region = current[-1][1]
        region.linears.append(module)
        rowwise = style == "rowwise"
        module.register_forward_pre_hook(functools.partial(_local_weights, region, rowwise))
        if rowwise:
            module.register_forward_hook(functools.partial(_partial_output, region, mesh),
                                         prepend=True)
            module.register_forward_hook(functools.partial(_add_bias, region))
