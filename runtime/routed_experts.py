"""Expert parallelism of a *routed* expert module (:func:`route_tokens`): a dropless
module fed (tokens, expert indices, weights), as Hugging Face's ``MixtralExperts`` and
``Qwen2MoeExperts`` are. Each rank keeps its ``ep`` rank's experts; each token row goes
to the rank of every expert it chose and comes back, with as many rows per rank as
the routing sends (uneven all-to-alls). The module's own forward then runs unchanged
on the rows it received, each a token of its own with one local expert and weight 1,
and the weights multiply on the way back.

The uneven exchange is ``torch.distributed._functional_collectives.
all_to_all_single_autograd`` (private; torch 2.11 to 2.13: the one differentiable
all-to-all with split sizes, on gloo and NCCL), used in :func:`exchange_rows` only.
How and why, in full: docs/runtime.md, section ``autopar.runtime.experts``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

__all__ = ["exchange_rows", "route_tokens", "routed_args"]


def exchange_rows(x: torch.Tensor, out_splits: list[int], in_splits: list[int],
                  group: dist.ProcessGroup) -> torch.Tensor:
    """Rows of ``x``, ``in_splits[r]`` of them to rank r, and ``out_splits[r]`` rows
    from rank r back (differentiable)."""
    return all_to_all_single_autograd(x.contiguous(), out_splits, in_splits, group)


def routed_args(args: tuple) -> tuple[int, int, int]:
    """The positions of the tokens, the expert indices (the integer tensor) and the
    weights among a routed module's first three arguments."""
    index = next(i for i in (1, 2) if not args[i].is_floating_point())
    return 0, index, 3 - index


def route_tokens(module: nn.Module, params: Mapping[str, int], mesh: DeviceMesh,
                 scale: type) -> None:
    """Send each token to its experts' ranks and back around ``module``'s forward, its
    parameters (name -> expert dim) already cut to this ep rank's experts. ``scale`` is
    the gradient-scaling function (:class:`~autopar.runtime.experts.ScaleGrad`)."""
    ep, group = mesh.size(), mesh.get_group()
    local = getattr(module, next(iter(params))).shape[next(iter(params.values()))]
    if hasattr(module, "num_experts"):
        module.num_experts = local
    pending: list[tuple] = []

    def dispatch(_: nn.Module, args: tuple) -> tuple:
        t, i, w = routed_args(args)
        like = args[t] if isinstance(args[t], DTensor) else None  # tensor parallelism
        tokens, index, weights = (a.to_local() if isinstance(a, DTensor) else a
                                  for a in (args[t], args[i], args[w]))
        k = index.shape[-1]
        flat = index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        owner = flat[order] // local
        send = torch.bincount(owner, minlength=ep)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)
        send_l, recv_l = send.tolist(), recv.tolist()
        rows = exchange_rows(tokens[order // k], recv_l, send_l, group)
        ids = torch.empty(sum(recv_l), dtype=flat.dtype, device=flat.device)
        dist.all_to_all_single(ids, (flat[order] - owner * local).contiguous(), recv_l,
                               send_l, group=group)
        pending.append((order, send_l, recv_l, weights, k, like))
        out = list(args)
        out[t] = scale.apply(rows, float(ep))
        out[i] = ids.unsqueeze(-1)
        out[w] = torch.ones(len(ids), 1, dtype=weights.dtype, device=weights.device)
        if like is not None:  # the module runs on DTensors laid out as its tokens were
            out = [DTensor.from_local(x, like.device_mesh, like.placements, run_check=False)
                   if n in (t, i, w) else x for n, x in enumerate(out)]
        return tuple(out)

    def combine(_: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        order, send_l, recv_l, weights, k, like = pending.pop()
        local = out.to_local() if isinstance(out, DTensor) else out
        back = exchange_rows(scale.apply(local, 1.0 / ep), send_l, recv_l, group)
        rows = back[torch.argsort(order)]  # token-major again: (tokens x k, dim)
        rows = rows.view(-1, k, rows.shape[-1]) * weights.unsqueeze(-1).to(rows.dtype)
        mixed = rows.sum(1)
        if like is None:
            return mixed
        return DTensor.from_local(mixed, like.device_mesh, like.placements, run_check=False)

    module.register_forward_pre_hook(dispatch)
    module.register_forward_hook(combine)
