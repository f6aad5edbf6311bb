"""Collective communication time: α-β models, or NCCL's algorithms, per link level.

:func:`collective_time` prices one collective of a kind in :data:`KINDS` on a
:class:`~autopar.cost_models.hardware.LinkSpec`, :func:`bucketed_time` one parameter's
part of a collective it shares with others; :func:`group_link` picks the link of a
mesh axis' groups (intra- or inter-node) and :func:`ring_shape` gives a ring's steps
and bytes on the wire.

The formulas, the α-β ring model (Thakur, Rabenseifner & Gropp 2005) and NCCL's own
tuning model with their sources, and which link a group uses: docs/cost_models.md,
section ``autopar.cost_models.comm``.
"""

from __future__ import annotations

from dataclasses import replace

from autopar.cost_models.hardware import HardwareProfile, LinkSpec
from autopar.errors import ConfigError

INF = float("inf")
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")


def ring_shape(kind: str, nbytes: float, group_size: int,
               node_ranks: int = 1) -> tuple[int, float]:
    """(steps, bytes each device moves on the wire) of a ring collective of ``kind`` on
    a buffer of ``nbytes`` over ``group_size`` devices (docs/cost_models.md, section
    ``autopar.cost_models.comm``). An all-to-all over a group with ``node_ranks``
    members on each node moves on the inter-node link only what goes to the other
    nodes' members, ``(n - node_ranks)/n`` of its buffer."""
    n = group_size
    if kind == "send_recv":
        return 1, nbytes
    if kind == "all_reduce":
        return 2 * (n - 1), 2 * (n - 1) / n * nbytes
    if kind == "all_to_all" and 1 < node_ranks < n:
        return n - 1, (n - node_ranks) / n * nbytes
    return n - 1, (n - 1) / n * nbytes


def collective_time(kind: str, nbytes: float, group_size: int, link: LinkSpec) -> float:
    """Seconds for one collective (docs/cost_models.md, section
    ``autopar.cost_models.comm``)."""
    if kind not in KINDS:
        raise ConfigError(f"unknown collective {kind!r}; expected one of {', '.join(KINDS)}")
    ranks = link.node_ranks
    link = link.for_kind(kind)
    n = group_size
    if kind != "send_recv" and (n <= 1 or nbytes <= 0):
        return 0.0
    steps, traffic = ring_shape(kind, nbytes, n, ranks)
    best = INF
    for a in link.algorithms:  # CollectiveAlgorithm's formula, in the planner's hottest call
        if not a.kinds or kind in a.kinds:
            moved = traffic if a.bus else nbytes
            t = a.base_latency + steps * a.step_latency + moved / a.bandwidth
            if t < best:
                best = t
    if best < INF:
        return best
    return steps * link.latency + traffic / link.bandwidth


def bucketed_time(kind: str, nbytes: float, group_size: int, link: LinkSpec,
                  share: float) -> float:
    """One parameter's part of a collective it shares with others: ``share`` (the
    parameter's share of the collective's bytes) times the time of the whole
    collective, of ``nbytes / share`` bytes, so the parts of the tensors in one
    collective add up to one collective (under the α-β model: its bandwidth term in full
    and ``share`` of one latency term). Parameter collectives are issued per bucket, not
    per tensor: FSDP2 issues one per ``fully_shard`` unit and kind
    (:func:`autopar.strategies.analysis.unit_shares`), which is also the size that picks
    NCCL's algorithm."""
    share = min(1.0, share)
    if share <= 0.0:  # a vanishing share of an unbounded bucket: the bandwidth term alone
        share = 1e-12
    return share * collective_time(kind, nbytes / share, group_size, link)


def group_link(mesh_sizes: tuple[int, ...], axis: int, gpus_per_node: int,
               hw: HardwareProfile) -> LinkSpec:
    """The link a group along mesh ``axis`` uses, ranks laid out row-major: the group
    {r0 + k·stride} stays in one node iff (size-1)·stride < gpus_per_node and every
    group is aligned inside a node, i.e. size·stride divides gpus_per_node or the
    group spans at most one node block. A group across nodes gets the inter-node link
    with its ``node_ranks``: members per node, ``gpus_per_node / stride`` where the
    stride divides a node (else 1)."""
    stride = 1
    for s in mesh_sizes[axis + 1:]:
        stride *= s
    size = mesh_sizes[axis]
    span = stride * size
    inside = span <= gpus_per_node and gpus_per_node % span == 0
    if inside or size == 1:
        return hw.intra_node
    ranks = gpus_per_node // stride if stride < gpus_per_node and gpus_per_node % stride == 0 \
        else 1
    ranks = min(ranks, size)
    return hw.inter_node if ranks <= 1 else replace(hw.inter_node, node_ranks=ranks)
