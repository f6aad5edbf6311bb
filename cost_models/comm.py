"""Collective communication time: α-β models per link level.

With n devices in the group, B bytes, link bandwidth β (bytes/s per device and
direction) and per-step latency α (Thakur, Rabenseifner & Gropp, "Optimization of
Collective Communication Operations in MPICH", 2005; ring algorithms as NCCL uses):

    all-reduce      2(n-1)/n · B/β + 2(n-1)·α      (B = the buffer)
    all-gather      (n-1)/n · B/β + (n-1)·α        (B = the gathered, full tensor)
    reduce-scatter  (n-1)/n · B/β + (n-1)·α        (B = the full input tensor)
    all-to-all      (n-1)/n · B/β + (n-1)·α        (B = bytes each device holds)
    send/recv       α + B/β                        (B = the message)

A group whose devices all sit in one node uses the intra-node link, any other the
inter-node link (each GPU has its own NIC on the machines profiled, so the per-device
inter-node bandwidth is the bottleneck of a ring across nodes). A link may carry
separate measured α-β fits per collective kind (:meth:`LinkSpec.for_kind`; the ``cpu``
profile's gloo all-gather and reduce-scatter), used in place of its own figures.
"""

from __future__ import annotations

from autopar.cost_models.hardware import HardwareProfile, LinkSpec
from autopar.errors import ConfigError

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")

def collective_time(kind: str, nbytes: float, group_size: int, link: LinkSpec) -> float:
    """Seconds for one collective (see module docstring)."""
    if kind not in KINDS:
        raise ConfigError(f"unknown collective {kind!r}; expected one of {', '.join(KINDS)}")
    link = link.for_kind(kind)
    n = group_size
    if kind == "send_recv":
        return link.latency + nbytes / link.bandwidth
    if n <= 1 or nbytes <= 0:
        return 0.0
    if kind == "all_reduce":
        return 2 * (n - 1) / n * nbytes / link.bandwidth + 2 * (n - 1) * link.latency
    return (n - 1) / n * nbytes / link.bandwidth + (n - 1) * link.latency


def bucketed_time(kind: str, nbytes: float, group_size: int, link: LinkSpec,
                  share: float) -> float:
    """One parameter's part of a collective it shares with others: its bandwidth term in
    full, and the latency term of one collective times ``share``, the parameter's share
    of the collective's tensors, so the parts of the tensors in one collective add up to
    one collective. Parameter collectives are issued per bucket, not per tensor: FSDP2
    issues one per ``fully_shard`` unit and kind
    (:func:`autopar.strategies.analysis.unit_shares`)."""
    link = link.for_kind(kind)
    bandwidth_only = collective_time(kind, nbytes, group_size, LinkSpec(link.bandwidth, 0.0))
    latency = collective_time(kind, nbytes, group_size, link) - bandwidth_only
    return bandwidth_only + latency * min(1.0, share)


def group_link(mesh_sizes: tuple[int, ...], axis: int, gpus_per_node: int,
               hw: HardwareProfile) -> LinkSpec:
    """The link a group along mesh ``axis`` uses, ranks laid out row-major: the group
    {r0 + k·stride} stays in one node iff (size-1)·stride < gpus_per_node and every
    group is aligned inside a node, i.e. size·stride divides gpus_per_node or the
    group spans at most one node block."""
    stride = 1
    for s in mesh_sizes[axis + 1:]:
        stride *= s
    span = stride * mesh_sizes[axis]
    inside = span <= gpus_per_node and gpus_per_node % span == 0
    return hw.intra_node if inside or mesh_sizes[axis] == 1 else hw.inter_node


def fit_alpha_beta(sizes: list[float], times: list[float], kind: str,
                   group_size: int) -> LinkSpec:
    """Least-squares α and β from measured (bytes, seconds) of one collective kind."""
    import numpy as np

    n = group_size
    if kind == "all_reduce":
        a_coef, b_coef = 2 * (n - 1), 2 * (n - 1) / n
    elif kind == "send_recv":
        a_coef, b_coef = 1.0, 1.0
    else:
        a_coef, b_coef = (n - 1), (n - 1) / n
    x = np.array([[a_coef, b_coef * s] for s in sizes], dtype=float)
    y = np.array(times, dtype=float)
    (alpha, inv_beta), *_ = np.linalg.lstsq(x, y, rcond=None)
    alpha = max(float(alpha), 0.0)
    inv_beta = max(float(inv_beta), 1e-30)
    return LinkSpec(bandwidth=1.0 / inv_beta, latency=alpha)
