"""Expert parallelism of a *routed* expert module (:func:`route_tokens`): a dropless
module fed (tokens, expert indices, weights), as Hugging Face's ``MixtralExperts`` and
``Qwen2MoeExperts`` are. Each rank keeps its ``ep`` rank's experts; each token row goes
to the rank of every expert it chose and comes back, with as many rows per rank as
the routing sends (uneven all-to-alls). The module's own forward then runs unchanged
on the rows it received, each a token of its own with one local expert and weight 1,
and the weights multiply on the way back. Where the plan cuts the ep group into nodes,
the rows move in two legs: each token once to every node holding any of its experts,
then to their ranks inside it (:func:`route_tokens`).

The uneven exchange is ``torch.distributed._functional_collectives.
all_to_all_single_autograd`` (private; torch 2.11 to 2.13: the one differentiable
all-to-all with split sizes, on gloo and NCCL), used in :func:`exchange_rows` only.
How and why, in full: docs/runtime.md, section ``autopar.runtime.experts``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

__all__ = ["exchange_rows", "route_tokens", "routed_args", "Sends", "plan_sends",
           "exchange_ids", "to_experts", "from_experts"]


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


class Sends(NamedTuple):
    """Rows sent over a group: ``order`` sorts the pairs by destination, ``rows`` is
    each sorted pair's source row, ``send[r]`` / ``recv[r]`` the rows to / from rank r."""

    order: torch.Tensor
    rows: torch.Tensor
    send: list[int]
    recv: list[int]


def plan_sends(dest: torch.Tensor, rows: torch.Tensor, size: int,
               group: dist.ProcessGroup) -> Sends:
    """Pairs going to rank ``dest`` of a ``size``-rank group, each from source row
    ``rows``, sorted by destination; the split sizes are exchanged first."""
    order = torch.argsort(dest, stable=True)
    send = torch.bincount(dest, minlength=size)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return Sends(order, rows[order], send.tolist(), recv.tolist())


def exchange_ids(x: torch.Tensor, s: Sends, group: dist.ProcessGroup) -> torch.Tensor:
    """Integer rows ``x`` (one per sorted pair of ``s``) sent as ``s`` says (no
    gradient)."""
    out = x.new_empty((sum(s.recv),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), s.recv, s.send, group=group)
    return out


def to_experts(rows: torch.Tensor, expert: torch.Tensor, source: torch.Tensor, local: int,
               size: int, group: dist.ProcessGroup) -> tuple[torch.Tensor, torch.Tensor, Sends]:
    """Rows ``rows[source[p]]`` to the rank of the group holding expert ``expert[p]``
    (``local`` experts a rank, in rank order): the received rows, their experts' local
    indices and the sends that :func:`from_experts` reverses."""
    s = plan_sends(expert // local, source, size, group)
    got = exchange_rows(rows[s.rows], s.recv, s.send, group)
    return got, exchange_ids(expert[s.order] % local, s, group), s


def from_experts(out: torch.Tensor, s: Sends, weight: torch.Tensor | None, count: int,
                 group: dist.ProcessGroup) -> torch.Tensor:
    """The reverse of :func:`to_experts`: the experts' outputs ``out`` back, each
    times its pair's ``weight`` (None: 1) and summed into its source row of ``count``
    rows."""
    back = exchange_rows(out, s.send, s.recv, group)
    if weight is not None:
        back = back * weight[s.order].unsqueeze(-1).to(back.dtype)
    return back.new_zeros((count,) + tuple(back.shape[1:])).index_add(0, s.rows, back)


def route_tokens(module: nn.Module, params: Mapping[str, int], mesh: DeviceMesh,
                 scale: type, legs: tuple[DeviceMesh, DeviceMesh] | None = None,
                 tp: DeviceMesh | None = None) -> None:
    """Send each token to its experts' ranks and back around ``module``'s forward, its
    parameters (name -> expert dim) already cut to this ep rank's experts. ``scale`` is
    the gradient-scaling function (:class:`~autopar.runtime.experts.ScaleGrad`).
    ``legs`` (the ep group cut into its nodes: the mesh across them, the mesh inside
    this one) sends a token once to each node holding any of its experts, then to
    their ranks inside it, and back (docs/runtime.md, section
    ``autopar.runtime.experts``); without it, one exchange over ``mesh``. ``tp``: the
    experts are folded over this tensor-parallel mesh (``mesh`` holds its ranks too):
    each rank sends its own rows of the tokens (split over tp first where they are
    not) and the module runs on local tensors."""
    ep, group = mesh.size(), mesh.get_group()
    replicas = ep // tp.size() if tp is not None else ep  # the samples' ranks among them
    local = getattr(module, next(iter(params))).shape[next(iter(params.values()))]
    if hasattr(module, "num_experts"):
        module.num_experts = local
    pending: list[tuple] = []

    def dispatch(_: nn.Module, args: tuple) -> tuple:
        t, i, w = routed_args(args)
        if tp is not None:
            args = _own_rows(args, (t, i, w), tp)
        like = args[t] if isinstance(args[t], DTensor) else None  # tensor parallelism
        tokens, index, weights = (a.to_local() if isinstance(a, DTensor) else a
                                  for a in (args[t], args[i], args[w]))
        if legs is None:
            source = torch.arange(index.numel(), device=index.device) // index.shape[-1]
            rows, ids, s = to_experts(tokens, index.reshape(-1), source, local, ep, group)
            back = [(s, weights.reshape(-1), len(tokens), group)]
        else:
            rows, ids, back = _by_node(tokens, index, weights, local, legs)
        pending.append((back, like))
        out = list(args)
        out[t] = scale.apply(rows, float(replicas))
        out[i] = ids.unsqueeze(-1)
        out[w] = torch.ones(len(ids), 1, dtype=weights.dtype, device=weights.device)
        if like is not None and tp is None:  # it runs on DTensors laid out as its tokens
            out = [DTensor.from_local(x, like.device_mesh, like.placements, run_check=False)
                   if n in (t, i, w) else x for n, x in enumerate(out)]
        return tuple(out)

    def combine(_: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        back, like = pending.pop()
        mixed = scale.apply(out.to_local() if isinstance(out, DTensor) else out,
                            1.0 / replicas)
        for s, weight, count, g in back:  # the inner leg first
            mixed = from_experts(mixed, s, weight, count, g)
        if like is None:
            return mixed
        return DTensor.from_local(mixed, like.device_mesh, like.placements, run_check=False,
                                  shape=like.shape, stride=like.stride())

    module.register_forward_pre_hook(dispatch)
    module.register_forward_hook(combine)


def _own_rows(args: tuple, which: tuple[int, ...], tp: DeviceMesh) -> tuple:
    """``args`` with the tensors at positions ``which`` (a routed module's tokens,
    indices and weights, one row a token) split along their rows over ``tp`` (a
    redistribution; free where they are replicated), so that each tp rank routes its
    own tokens to folded experts."""
    out = list(args)
    for k in which:
        a = args[k]
        if not isinstance(a, DTensor) or a.device_mesh != tp:
            raise RuntimeError(f"experts folded over tp need their tokens, indices and "
                               f"weights as DTensors on the tp mesh; argument {k} is a "
                               f"{type(a).__name__}: lay the module's inputs out with "
                               f"autopar's tensor parallelism, or re-plan with expert_tp>1")
        if a.placements != (Shard(0),):
            out[k] = a.redistribute(tp, [Shard(0)])
    return tuple(out)


def _by_node(tokens: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, local: int,
             legs: tuple[DeviceMesh, DeviceMesh]) -> tuple[torch.Tensor, torch.Tensor, list]:
    """The two-leg dispatch of :func:`route_tokens`: each token, with its experts and
    weights, once to the member of its own place in every node holding any of its
    experts (over ``legs[0]``), then each (token, expert) of this node to the expert's
    rank (over ``legs[1]``). Returns the rows, their experts' local indices and what
    the combine runs back, inner leg first."""
    rail, node = legs
    across, inside = rail.get_group(), node.get_group()
    nodes, span = rail.size(), node.size() * local
    held = (index // span).unsqueeze(-1) == torch.arange(nodes, device=index.device)
    pairs = held.any(1).nonzero()  # (token, node) for every node a token goes to
    outer = plan_sends(pairs[:, 1], pairs[:, 0], nodes, across)
    got = exchange_rows(tokens[outer.rows], outer.recv, outer.send, across)
    got_w = exchange_rows(weights[outer.rows], outer.recv, outer.send, across)
    got_i = exchange_ids(index[outer.rows], outer, across)
    row, slot = (got_i // span == rail.get_local_rank()).nonzero().unbind(1)
    rows, ids, inner = to_experts(got, got_i[row, slot] % span, row, local, node.size(), inside)
    return rows, ids, [(inner, got_w[row, slot], len(got), inside),
                       (outer, None, len(tokens), across)]
