"""Context parallelism's attention variants on gloo ranks equal attention over the whole
sequence, forward and backward: each rank holds its head-tail share of q, k and v,
runs one of the variants of :mod:`autopar.runtime.context_parallel` (all-gather,
ring, Ulysses), and its output and the
gradients of its share match a single-process ``scaled_dot_product_attention`` (fp64),
with and without causal masking, for grouped-query and multi-head attention."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from autopar.errors import LoweringError
from autopar.runtime.context_parallel import (allgather_attention, gather_sequence, head_tail,
                                              ring_attention, shard_sequence,
                                              ulysses_attention)
from tests.dist_utils import RankPool

VARIANTS = {"allgather": allgather_attention, "ring": ring_attention,
            "ulysses": ulysses_attention}
CASES = [(variant, kv, causal) for variant in VARIANTS for kv in (4, 2)
         for causal in (True, False)]


def largest_errors(cases: list[tuple[str, int, bool]]) -> list[float]:
    """Per case, the largest difference of output and gradients from one process."""
    cp, rank, group = dist.get_world_size(), dist.get_rank(), dist.group.WORLD
    out = []
    for variant, kv, causal in cases:
        g = torch.Generator().manual_seed(0)
        q, w = (torch.randn(2, 4, 32, 8, dtype=torch.float64, generator=g) for _ in range(2))
        k, v = (torch.randn(2, kv, 32, 8, dtype=torch.float64, generator=g) for _ in range(2))
        whole = [t.clone().requires_grad_(True) for t in (q, k, v)]
        ref = F.scaled_dot_product_attention(*whole, is_causal=causal, enable_gqa=kv != 4)
        (ref * w).sum().backward()
        mine = [shard_sequence(t, 2, cp, rank).requires_grad_(True) for t in (q, k, v)]
        got = VARIANTS[variant](*mine, group, is_causal=causal)
        (got * shard_sequence(w, 2, cp, rank)).sum().backward()
        errs = [(got - shard_sequence(ref, 2, cp, rank)).abs().max()]
        errs += [(m.grad - shard_sequence(t.grad, 2, cp, rank)).abs().max()
                 for m, t in zip(mine, whole)]
        errs.append((gather_sequence(got.detach(), 2, group) - ref).abs().max())
        out.append(max(float(e) for e in errs))
    return out


@pytest.mark.multirank
@pytest.mark.parametrize("world", [2, 4])
def test_variants_equal_whole_sequence_attention(rank_pool: RankPool, world: int) -> None:
    for errs in rank_pool.run(world, largest_errors, CASES):
        for case, err in zip(CASES, errs):
            assert err < 1e-12, (world, case, err)


def test_head_tail_balances_causal_work() -> None:
    """Rank r holds chunks r and 2cp-1-r; every rank attends the same number of
    (query, key) pairs under a causal mask; a sequence 2·cp does not divide is refused."""
    assert head_tail(16, 4, 1).tolist() == [2, 3, 12, 13]
    pairs = {sum(int(p) + 1 for p in head_tail(64, 4, r)) for r in range(4)}
    assert len(pairs) == 1
    with pytest.raises(LoweringError, match="does not split into 8 equal chunks"):
        head_tail(20, 4, 0)
