"""Attention over sequences split across the ranks of a context-parallel group, on
local tensors, differentiable, on gloo and NCCL: the layout (:func:`head_tail`,
:func:`shard_sequence`, :func:`gather_sequence`) and the three variants that
``autopar.cost_models.context_parallel`` prices, :func:`allgather_attention`,
:func:`ring_attention` and :func:`ulysses_attention`, each equal to
``F.scaled_dot_product_attention`` over the whole sequence.

Head-tail layout: the sequence is cut into 2·cp chunks and rank r holds chunks r and
2cp-1-r, in that order, so that causal attention costs every rank the same. The
collectives are ``torch.distributed._functional_collectives``' autograd forms (private;
torch 2.11 to 2.13) and point-to-point sends. Why and how: docs/runtime.md, section
``autopar.runtime.context_parallel``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc
import torch.nn.functional as F

from autopar.errors import LoweringError

__all__ = ["head_tail", "shard_sequence", "gather_sequence", "allgather_attention",
           "ulysses_attention", "ring_attention"]


def head_tail(seq: int, cp: int, rank: int) -> torch.Tensor:
    """The positions rank ``rank`` of ``cp`` holds of a sequence of ``seq`` tokens:
    chunk ``rank`` then chunk ``2cp-1-rank`` of ``2cp`` (``seq`` divisible by 2·cp)."""
    if seq % (2 * cp):
        raise LoweringError(f"a sequence of {seq} tokens does not split into {2 * cp} equal "
                            f"chunks for context parallelism over {cp} ranks; plan a cp "
                            f"that divides half the sequence")
    c = seq // (2 * cp)
    return torch.cat([torch.arange(rank * c, (rank + 1) * c),
                      torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)])


def shard_sequence(x: torch.Tensor, dim: int, cp: int, rank: int) -> torch.Tensor:
    """This rank's tokens of ``x`` along ``dim`` in the head-tail layout."""
    return x.index_select(dim, head_tail(x.shape[dim], cp, rank).to(x.device))


def _pieces(seq: int, cp: int) -> torch.Tensor:
    """The positions of the ranks' head-tail pieces laid end to end, rank 0 first."""
    return torch.cat([head_tail(seq, cp, r) for r in range(cp)])


def _natural(seq: int, cp: int) -> torch.Tensor:
    """Where each position sits in the ranks' head-tail pieces laid end to end."""
    return torch.argsort(_pieces(seq, cp))


def _repeat_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Key/value heads (dim 1) repeated to ``heads``, each group's queries beside their
    head, as grouped-query attention pairs them."""
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], 1)


def gather_sequence(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """The whole sequence along ``dim`` from every rank's head-tail piece, in order
    (differentiable: the backward hands each rank its piece's gradient)."""
    cp = dist.get_world_size(group)
    gather = getattr(fc, "all_gather_single_autograd", None) or fc.all_gather_tensor_autograd
    whole = gather(x.contiguous(), dim, group)
    return whole.index_select(dim, _natural(x.shape[dim] * cp, cp).to(x.device))


def allgather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        group: dist.ProcessGroup, is_causal: bool = True,
                        scale: float | None = None) -> torch.Tensor:
    """Attention of this rank's queries (batch, heads, local, dim; head-tail) over the
    whole sequence: keys and values all-gathered (their gradients reduce-scattered
    backward). Causal: each query chunk attends to the key prefix ending with it
    (a bottom-right causal mask). Key/value heads fewer than the query heads are
    grouped-query attention."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    kw, vw = gather_sequence(k, 2, group), gather_sequence(v, 2, group)
    gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
    if not is_causal:
        return F.scaled_dot_product_attention(q, kw, vw, scale=scale, **gqa)
    c = q.shape[2] // 2
    outs = []
    for part, chunk in enumerate((rank, 2 * cp - 1 - rank)):
        end = (chunk + 1) * c
        qc = q[:, :, part * c:(part + 1) * c]
        kc, vc = kw[:, :, :end], vw[:, :, :end]
        # a bottom-right mask (a boolean one: torch's CausalBias subclass fails to be
        # made under some modes) and grouped heads: expand the keys' heads
        kc, vc = _repeat_heads(kc, q.shape[1]), _repeat_heads(vc, q.shape[1])
        outs.append(F.scaled_dot_product_attention(qc, kc, vc, scale=scale,
                                                   attn_mask=_lower_right(c, end, q.device)))
    return torch.cat(outs, dim=2)


def _lower_right(rows: int, cols: int, device: torch.device) -> torch.Tensor:
    """The causal mask of ``rows`` queries that are the last of ``cols`` keys' positions:
    query i attends to keys 0 .. cols - rows + i."""
    return torch.ones(rows, cols, dtype=torch.bool, device=device).tril(cols - rows)


def _heads_to_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """(batch, heads, local, dim) split by sequence -> (batch, heads/cp, seq, dim) split
    by heads, the sequence in order: one all-to-all."""
    cp = dist.get_world_size(group)
    b, h, s, d = x.shape
    send = x.reshape(b, cp, h // cp, s, d).transpose(0, 1).contiguous()
    got = fc.all_to_all_single_autograd(send, None, None, group)  # (cp: source, b, h/cp, s, d)
    whole = got.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * s, d)
    return whole.index_select(2, _natural(cp * s, cp).to(x.device))


def _sequence_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The inverse of :func:`_heads_to_sequence`."""
    cp = dist.get_world_size(group)
    b, hl, seq, d = x.shape
    pieces = x.index_select(2, _pieces(seq, cp).to(x.device)).reshape(b, hl, cp, seq // cp, d)
    send = pieces.permute(2, 0, 1, 3, 4).contiguous()  # (cp: destination, b, h/cp, s, d)
    got = fc.all_to_all_single_autograd(send, None, None, group)
    return got.transpose(0, 1).reshape(b, cp * hl, seq // cp, d)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      group: dist.ProcessGroup, is_causal: bool = True,
                      scale: float | None = None) -> torch.Tensor:
    """Attention of this rank's tokens (batch, heads, local, dim; head-tail) by
    Ulysses: q, k, v all-to-all'd to heads/cp heads over the whole sequence, attention
    there, the output all-to-all'd back. The group's size must divide the query
    heads; key/value heads it does not divide are repeated up to the query heads."""
    cp = dist.get_world_size(group)
    if q.shape[1] % cp:
        raise LoweringError(f"Ulysses attention splits {q.shape[1]} heads over {cp} ranks, "
                            f"which does not divide them; use the all-gather variant or a "
                            f"cp that divides the heads")
    if k.shape[1] % cp:
        k, v = _repeat_heads(k, q.shape[1]), _repeat_heads(v, q.shape[1])
    qh, kh, vh = (_heads_to_sequence(t, group) for t in (q, k, v))
    gqa = {"enable_gqa": True} if kh.shape[1] != qh.shape[1] else {}
    out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=is_causal, scale=scale, **gqa)
    return _sequence_to_heads(out, group)


class _RingPass(torch.autograd.Function):
    """Forward: send ``x`` to the next rank of the ring and receive the previous rank's;
    backward: the gradient goes the other way round."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # noqa: D102
        ctx.group = group
        return _shift(x.contiguous(), group, 1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: D102
        return _shift(grad.contiguous(), ctx.group, -1), None


def _shift(x: torch.Tensor, group: dist.ProcessGroup, step: int) -> torch.Tensor:
    """``x`` sent ``step`` ranks on around the ring; what comes from ``step`` ranks back."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    out = torch.empty_like(x)
    ops = [dist.P2POp(dist.isend, x, dist.get_global_rank(group, (rank + step) % cp), group),
           dist.P2POp(dist.irecv, out, dist.get_global_rank(group, (rank - step) % cp), group)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    return out


def _block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
           scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` on one key block, written out (scores, softmax, values) so its
    log-sum-exp is at hand: (output, log-sum-exp per query). Masked pairs score a large
    negative number, not -inf, so a fully masked query row weighs nothing in the merge
    and has no NaN gradient."""
    scores = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if mask is not None:
        scores = scores.masked_fill(~mask, -1e30)
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    return torch.exp(scores - lse) @ v, lse


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   group: dist.ProcessGroup, is_causal: bool = True,
                   scale: float | None = None) -> torch.Tensor:
    """Attention of this rank's tokens (batch, heads, local, dim; head-tail) by ring
    exchange: in ``cp`` steps each rank attends to the key/value block in hand and
    passes it on, and the blocks' results are merged by their log-sum-exp. Written
    with plain operators (a reference form: a flash kernel that returns the
    log-sum-exp is the fast one); key/value heads fewer than the query heads are
    repeated to them."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    k, v = _repeat_heads(k, q.shape[1]), _repeat_heads(v, q.shape[1])
    seq = q.shape[2] * cp
    mine = head_tail(seq, cp, rank).to(q.device)
    kv = torch.stack((k, v))
    out = lse = None
    for step in range(cp):
        src = (rank - step) % cp
        mask = None
        if is_causal:
            theirs = head_tail(seq, cp, src).to(q.device)
            mask = mine[:, None] >= theirs[None, :]
        o, s = _block(q, kv[0], kv[1], mask, scale)
        if out is None:
            out, lse = o, s
        else:
            total = torch.logaddexp(lse, s)
            out = torch.exp(lse - total) * out + torch.exp(s - total) * o
            lse = total
        if step < cp - 1:
            kv = _RingPass.apply(kv, group)
    return out
