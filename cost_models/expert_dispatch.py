"""How a routed expert module's tokens reach their experts' ranks and come back, and
its seconds: in one all-to-all over the ``ep`` group, or in two legs where the group
spans nodes with several members on each (:func:`routed_dispatch`).

In two legs (node-deduplicated dispatch, as DeepEP's and Megatron-Core's HybridEP
inter-node kernels move tokens, and as hierarchical all-to-alls do), each token crosses
the inter-node network once per node holding any of its experts, to the member of its
own local index there (a *rail* all-to-all over the ep group's nodes), then goes to its
experts' ranks inside that node (an all-to-all over the node's members). The combine
runs the legs backward, the node's weighted expert outputs of a token summed before
they cross back, so the inter-node bytes fall from ``top_k`` copies of a token to the
number of distinct nodes its experts lie on (:func:`distinct_nodes`). The runtime's
form: :func:`autopar.runtime.routed_experts.route_tokens`. Formulas and what is left
out: docs/cost_models.md, section ``autopar.cost_models.expert_dispatch``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from math import comb

from autopar.cost_models.comm import collective_time, group_link
from autopar.cost_models.hardware_spec import LinkSpec
from autopar.sharding import Mesh

EXCHANGES = 4
"""All-to-alls of one routed module per micro-batch, each leg: dispatch and combine,
forward and backward."""


def distinct_nodes(experts: int, top_k: int, nodes: int) -> float:
    """Expected number of nodes a token's ``top_k`` distinct experts lie on, the
    ``experts`` spread evenly over ``nodes`` and chosen uniformly (a routing that its
    load-balancing loss keeps even): ``nodes`` times the chance that a given node holds
    at least one of them, ``1 - C(E - E/N, k) / C(E, k)``."""
    per = experts // nodes
    k = min(top_k, experts)
    return nodes * (1.0 - comb(experts - per, k) / comb(experts, k))


@dataclass(frozen=True)
class TokenExchange:
    """A routed module's exchange: ``node_ranks`` ep members per node in the two-leg
    form (1: one all-to-all over the whole group) and its ``seconds`` per micro-batch
    (:data:`EXCHANGES` exchanges of each leg)."""

    node_ranks: int
    seconds: float


def routed_dispatch(row_bytes: float, top_k: int, experts: int, ep: int,
                    link: LinkSpec, intra: LinkSpec) -> TokenExchange:
    """The faster exchange of a routed module whose tokens weigh ``row_bytes`` in all
    on a rank (the busiest rank's, once), ``top_k`` experts each of ``experts``, over an
    ``ep`` group on ``link`` (:func:`~autopar.cost_models.comm.group_link`'s, with its
    members per node) inside nodes joined by ``intra``: one all-to-all of ``top_k``
    copies of each token, or, where the group spans nodes with 1 < ``node_ranks`` <
    ``ep`` members on each, the rail leg (:func:`distinct_nodes` copies, over the
    nodes) and the node leg (``top_k`` copies, over a node's members) one after the
    other."""
    whole = collective_time("all_to_all", row_bytes * top_k, ep, link)
    flat = TokenExchange(1, EXCHANGES * whole)
    per_node = link.node_ranks
    if not 1 < per_node < ep or ep % per_node or experts % ep:
        return flat
    nodes = ep // per_node
    rail = collective_time("all_to_all", row_bytes * distinct_nodes(experts, top_k, nodes),
                           nodes, replace(link, node_ranks=1))
    inside = collective_time("all_to_all", row_bytes * top_k, per_node, intra)
    legs = TokenExchange(per_node, EXCHANGES * (rail + inside))
    return legs if legs.seconds < flat.seconds else flat


def expert_group(mesh: Mesh, fold: bool, gpus_per_node: int, hw) -> tuple[int, LinkSpec]:
    """The ranks a routed module's experts are split over on ``mesh`` (which has an
    ``ep`` axis) and their link: the ``ep`` axis's, or, ``fold``-ed over tp, the
    ``ep`` and ``tp`` axes' ranks together (tp is the inner axis, so they are one block
    of neighbours), of :func:`~autopar.cost_models.comm.group_link` on ``hw`` with
    ``gpus_per_node``."""
    sizes = list(mesh.sizes)
    a = mesh.names.index("ep")
    if fold:
        t = mesh.names.index("tp")
        sizes[a], sizes[t] = sizes[a] * sizes[t], 1
    return sizes[a], group_link(tuple(sizes), a, gpus_per_node, hw)
