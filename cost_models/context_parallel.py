"""Context parallelism's attention, priced per variant: each of ``cp`` ranks holds S/cp
of every sequence's tokens, every op but attention runs on them as on any tokens, and
attention brings the keys it needs in one of three ways (:func:`cp_attention`):

- ``allgather``: keys and values all-gathered before attention (their gradients
  reduce-scattered after it), queries local, head-tail load balanced;
- ``ring``: key/value blocks passed around the ring in ``cp`` steps, each transfer
  overlapped with the attention of the block in hand;
- ``ulysses``: all-to-alls from sequence-split to head-split q, k, v, and back for
  the output; each rank attends over the whole sequence on heads / cp.

Attention is priced as the planner prices an op (``compute.op_time``), collectives by
``comm.collective_time``. Formulas and the H100 measurement of the local parts:
docs/cost_models.md, section ``autopar.cost_models.context_parallel``.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.cost_models.comm import collective_time
from autopar.cost_models.compute import OpShapes, backward_factors, op_time
from autopar.cost_models.hardware import HardwareProfile, LinkSpec
from autopar.cost_models.tables import ELEMENT_BYTES
from autopar.errors import ConfigError

__all__ = ["VARIANTS", "SEARCHED_VARIANTS", "MASKED_SLOWDOWN", "AttentionShape",
           "CPAttentionCost", "attention_call_s", "cp_attention", "local_calls"]

VARIANTS = ("allgather", "ring", "ulysses")
"""The context-parallel attention variants (module docstring)."""

SEARCHED_VARIANTS = ("allgather", "ulysses")
"""The variants the search tries where none is asked for: not the ring, whose runtime
(``autopar.runtime.context_parallel.ring_attention``) writes each block's scores out
for the log-sum-exp merge, a reference form that its price (flash rates, the block's
scores never held) does not describe."""

SDPA = "aten.scaled_dot_product_attention.default"

MASKED_SLOWDOWN = 1.44
"""How much longer a call of fewer queries than keys, masked causally from the keys' end
(the all-gather variant's chunk on its key prefix), takes than its attended pairs at the
profile's attention rate: PyTorch's flash kernel runs ``is_causal`` (a square mask)
only, so a bottom-right mask runs a slower kernel. Measured on one H100
(benchmarks/results/h100_attention_long.json, 2026-11-26): each all-gather case less
its square call, priced, over the masked call priced, at 8K, 32K and 128K tokens and
cp 2, 4, 8: 1.16 to 1.79, median 1.44 (nine cases)."""


@dataclass(frozen=True)
class AttentionShape:
    """One attention layer: ``batch`` sequences of ``seq`` tokens, ``heads`` query and
    ``kv_heads`` key/value heads of ``head_dim``, causal or not, in ``dtype``."""

    batch: int
    seq: int
    heads: int
    kv_heads: int
    head_dim: int
    causal: bool = True
    dtype: str = "bf16"

    @property
    def element_bytes(self) -> int:
        """Bytes per element of q, k, v."""
        return ELEMENT_BYTES.get(self.dtype, 4)


@dataclass(frozen=True)
class CPAttentionCost:
    """Forward+backward seconds of one attention layer on the busiest rank:
    ``compute_s`` of local attention, ``comm_s`` of the variant's communication and
    ``exposed_s`` of it not hidden behind attention; ``kv_bytes`` are the keys and
    values a rank holds during the layer beyond its own tokens' (gathered, the block in
    flight, or repeated heads)."""

    variant: str
    cp: int
    compute_s: float
    comm_s: float
    exposed_s: float
    kv_bytes: float
    backward_s: float = 0.0  # the backward's part of compute_s

    @property
    def total_s(self) -> float:
        """What the layer's attention adds to the step: compute plus exposed
        communication."""
        return self.compute_s + self.exposed_s


def attention_call_s(hw: HardwareProfile, batch: int, heads: int, kv_heads: int,
                     q_len: int, k_len: int, head_dim: int, causal: bool,
                     dtype: str) -> tuple[float, float]:
    """(Forward, backward) seconds of one attention call: ``q_len`` queries against
    ``k_len`` keys; causal masks the queries' upper triangle, aligned to the keys' end
    (a query chunk attending to the key prefix that ends with it). FLOPs:
    4·batch·heads·head_dim per attended (query, key) pair (autopar.flops' convention),
    2.5x that backward; fewer queries than keys, causal: :data:`MASKED_SLOWDOWN` times
    that."""
    pairs = q_len * k_len - (q_len * q_len / 2.0 if causal else 0.0)
    flops = 4.0 * batch * heads * head_dim * pairs
    b = ELEMENT_BYTES.get(dtype, 4)
    nbytes = b * batch * head_dim * (2 * heads * q_len + 2 * kv_heads * k_len)
    shapes = OpShapes(SDPA, ((batch, heads, q_len, head_dim), (batch, kv_heads, k_len, head_dim),
                             (batch, kv_heads, k_len, head_dim)),
                      (batch, heads, q_len, head_dim), causal)
    ff, fb = backward_factors(SDPA)
    slow = MASKED_SLOWDOWN if causal and q_len < k_len else 1.0
    return (slow * op_time(shapes, flops, nbytes, backward=False, dtype=dtype, hw=hw),
            slow * op_time(shapes, flops * ff, nbytes * fb, backward=True, dtype=dtype, hw=hw))


def local_calls(variant: str, cp: int, a: AttentionShape) -> list[tuple[int, int, int, int, bool]]:
    """The attention calls (queries, keys, query heads, key/value heads, causal) of the
    busiest rank's layer. ``allgather``: query chunks r and 2cp-1-r of S/2cp against
    their key prefixes (rank 0: c and S keys; every rank attends S²/2cp pairs);
    ``ring``: the diagonal step (2c queries on their own 2c keys, causal) and cp - 1
    steps of 2c queries on c keys; ``ulysses``: the whole sequence on heads / cp."""
    s, c = a.seq, a.seq // (2 * cp)
    if cp == 1:
        return [(s, s, a.heads, a.kv_heads, a.causal)]
    if variant == "allgather":
        if not a.causal:
            return [(s // cp, s, a.heads, a.kv_heads, False)]
        return [(c, c, a.heads, a.kv_heads, True), (c, s, a.heads, a.kv_heads, True)]
    if variant == "ring":
        if not a.causal:
            return [(s // cp, s // cp, a.heads, a.kv_heads, False)] * cp
        return [(2 * c, 2 * c, a.heads, a.kv_heads, True)] + \
            [(2 * c, c, a.heads, a.kv_heads, False)] * (cp - 1)
    if variant == "ulysses":
        return [(s, s, a.heads // cp, max(1, a.kv_heads // cp), a.causal)]
    raise ConfigError(f"unknown context-parallel variant {variant!r}; expected one of "
                      f"{', '.join(VARIANTS)}")


def _check(variant: str, cp: int, a: AttentionShape) -> None:
    """The shapes the variant needs: 2·cp divides the sequence (cp for a non-causal
    one), and cp divides the query heads under Ulysses."""
    if cp < 1 or a.seq % (2 * cp if a.causal else cp):
        raise ConfigError(f"cp={cp} needs a sequence divisible by {2 * cp if a.causal else cp} "
                          f"(head-tail chunks), not {a.seq}; choose a cp that divides it")
    if variant == "ulysses" and a.heads % cp:
        raise ConfigError(f"Ulysses context parallelism splits the {a.heads} query heads over "
                          f"cp={cp}, which does not divide them; use the all-gather or ring "
                          f"variant, or a cp that divides {a.heads}")


def cp_attention(variant: str, cp: int, a: AttentionShape, hw: HardwareProfile,
                 link: LinkSpec) -> CPAttentionCost:
    """Forward+backward cost of one attention layer under ``variant`` over ``cp`` ranks
    joined by ``link`` (module docstring). ``allgather``: an all-gather of k and v
    forward and a reduce-scatter of their gradients backward, not overlapped (eager
    PyTorch waits on them before attention). ``ring``: cp - 1 exchanges of the k, v
    block forward and of k, v and their gradients backward, each overlapped with the
    attention step it feeds (the step takes the longer). ``ulysses``: all-to-alls of
    q, k, v and of the output forward, and of their gradients backward, not overlapped;
    key/value heads fewer than cp are repeated up to cp."""
    _check(variant, cp, a)
    calls = local_calls(variant, cp, a)
    times = [attention_call_s(hw, a.batch, h, kv, q, k, a.head_dim, causal, a.dtype)
             for q, k, h, kv, causal in calls]
    compute = sum(f + b for f, b in times)
    bwd = sum(b for _, b in times)
    e = a.element_bytes * a.batch * a.head_dim
    local = a.seq // cp
    if cp == 1:
        return CPAttentionCost(variant, 1, compute, 0.0, 0.0, 0.0, bwd)
    if variant == "allgather":
        kv = 2.0 * e * a.kv_heads * a.seq  # the gathered k and v
        comm = collective_time("all_gather", kv, cp, link) + \
            collective_time("reduce_scatter", kv, cp, link)
        return CPAttentionCost(variant, cp, compute, comm, comm, kv * (cp - 1) / cp, bwd)
    if variant == "ring":
        block = 2.0 * e * a.kv_heads * local  # one rank's k and v
        step_f = collective_time("send_recv", block, 2, link)
        step_b = collective_time("send_recv", 2.0 * block, 2, link)  # k, v and their grads
        exposed = sum(max(0.0, step_f - f) + max(0.0, step_b - b) for f, b in times[1:])
        comm = (cp - 1) * (step_f + step_b)
        return CPAttentionCost(variant, cp, compute, comm, exposed, block, bwd)
    kv_heads = max(a.kv_heads, cp)
    comm = 2.0 * sum(collective_time("all_to_all", e * local * h, cp, link)
                     for h in (a.heads, a.heads, kv_heads, kv_heads))
    # k and v head-split: the whole sequence on kv_heads / cp heads, against the own
    extra = max(0.0, 2.0 * e * (a.seq * kv_heads // cp - local * a.kv_heads))
    return CPAttentionCost(variant, cp, compute, comm, comm, extra, bwd)
