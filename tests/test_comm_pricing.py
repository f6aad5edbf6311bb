"""What the planner charges for the collectives a lowered plan runs: the all-reduce of a
column-wise Linear's input gradient (once per tensor), and FSDP2's one collective per
unit."""

from __future__ import annotations

import pytest
import torch

from autopar.capture import capture
from autopar.cost_models.comm import collective_time
from autopar.cost_models.hardware import load_profile
from autopar.examples.gpt import GPT, GPTConfig
from autopar.sharding import Mesh
from autopar.solvers.problem_build import build_problem
from autopar.strategies.analysis import analyze, unit_shares
from autopar.strategies.settings import Settings
from tests.dist_utils import RankPool


def _gpt_graph(n_layers: int = 2):
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=512, max_seq_len=64, dim=256, n_layers=n_layers,
                              n_heads=4))
    return capture(model, (torch.randint(0, 512, (8, 64), device="meta"),))


def _built(mesh: tuple[int, int], zero: int = 0, n_layers: int = 2):
    st = Settings(Mesh(("dp", "tp"), mesh), 8 // mesh[0], 1, zero, "fp32", "adamw", 1e12,
                  load_profile("h100-sxm"), 8)
    return build_problem(analyze(_gpt_graph(n_layers)), st)


def _edge(built, u: str, v: str):
    iu, iv = built.names.index(u), built.names.index(v)
    return next(e for e in built.problem.edges if (e.u, e.v) == (iu, iv))


def test_a_column_wise_linears_replicated_input_gets_its_gradient_all_reduced_once() -> None:
    """No forward collective feeds a column-wise Linear its replicated input, but the
    input's gradient comes back partial over tp (the backward half of Megatron's f/g
    pair). Autograd adds the partial gradients of the q, k and v projections first (a
    sum of partial sums is one) and the norm's backward reduces the total: one
    all-reduce per tensor, not one per consuming Linear (autopar.strategies.grad_sum).
    The norm's summing twin pays it, its edges to the Linears cost nothing, and its
    plain strategy takes no partial gradient."""
    built = _built((1, 2))
    e = _edge(built, "layer_norm", "linear")  # ln1 -> the attention's q projection
    link = load_profile("h100-sxm").intra_node
    once = collective_time("all_reduce", 8 * 64 * 256 * 4.0, 2, link)
    seen = set()
    for (i, j), cost in e.cost.items():
        su = built.strategies[e.u][i]
        need, grad = built.strategies[e.v][j].ins[0], built.strategies[e.v][j].grads[0]
        if su.out == need == ("R", "R"):
            assert cost == 0.0, (su.name, need, grad)
            assert grad[1] != "P" or su.grad_sum == (1,), (su.name, grad)
            seen.add(grad[1])
    assert seen == {"P", "R"}  # both the sharded and the replicated weight were priced
    costs = built.problem.nodes[e.u].strategies
    by_name = {s.name: k for k, s in enumerate(built.strategies[e.u])}
    twins = [(k, s) for k, s in enumerate(built.strategies[e.u]) if s.grad_sum]
    assert twins
    for k, s in twins:
        plain = by_name[s.name.rpartition("  [grad")[0]]
        assert costs[k].comm_s - costs[plain].comm_s == pytest.approx(once, rel=1e-12)


def test_a_gradient_partial_over_data_parallelism_is_not_an_activation_collective() -> None:
    """The position embedding's output is the same on every dp rank and meets
    batch-sharded activations: its gradient is partial over dp, and FSDP2 reduces it
    with the parameter gradients, so the edge itself costs nothing."""
    built = _built((2, 1))
    e = _edge(built, "embedding_1", "add")
    assert e.cost and all(c == 0.0 for c in e.cost.values())


def _charged(built, field: str) -> float:
    """The least ``field`` of each node's strategies, summed over the graph."""
    return sum(n.multiplicity * min(getattr(s, field) for s in n.strategies)
               for n in built.problem.nodes)


def _unit_sizes(g) -> tuple[int, int]:
    """Elements of one block's parameters and of the root unit's (the rest)."""
    block = sum(p.meta.numel for k, p in g.params.items() if k.startswith("blocks.0."))
    root = sum(p.meta.numel for k, p in g.params.items() if not k.startswith("blocks."))
    return block, root


def test_fsdp_collectives_cost_one_latency_per_unit() -> None:
    """FSDP2 issues one gradient all-reduce per ``fully_shard`` unit (each block, and
    the root for the rest): the parameters' charges add up to exactly one collective of
    each unit's bytes; the blocks' may hide behind the backward (per step), the root's,
    complete only when the backward ends, is on the critical path (1/n of it per
    micro-batch, n = 1 here)."""
    n_layers = 2
    g = _gpt_graph(n_layers)
    shares = unit_shares(g)
    for unit in ("blocks.0.", "blocks.1."):
        assert sum(v for k, v in shares.items() if k.startswith(unit)) == pytest.approx(1.0)
    assert sum(v for k, v in shares.items() if not k.startswith("blocks.")) == pytest.approx(1.0)
    built = _built((2, 1), n_layers=n_layers)
    hidden, critical = _charged(built, "step_param_comm_s"), _charged(built, "comm_s")
    link = load_profile("h100-sxm").intra_node
    block, root = _unit_sizes(g)
    assert hidden == pytest.approx(
        n_layers * collective_time("all_reduce", 4.0 * block, 2, link), rel=1e-9)
    assert critical == pytest.approx(collective_time("all_reduce", 4.0 * root, 2, link),
                                     rel=1e-9)


def _backward_collectives() -> dict[str, int]:
    """Collectives in the backward of three column-wise Linears reading one norm's
    replicated output, on this group's tp mesh."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    ws = [distribute_tensor(torch.randn(8, 8), mesh, [Shard(0)]).requires_grad_() for _ in "qkv"]
    x = DTensor.from_local(torch.randn(2, 4, 8), mesh, [Replicate()]).requires_grad_()
    h = torch.nn.functional.layer_norm(x, (8,))
    outs = [torch.nn.functional.linear(h, w) for w in ws]
    with CommDebugMode() as comm:
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
    return {str(k).rpartition(".")[2]: v for k, v in comm.get_comm_counts().items()}


@pytest.mark.multirank
def test_dtensor_reduces_the_summed_partial_gradient_once(rank_pool: RankPool) -> None:
    """What the pricing above assumes: the three partial input gradients are added
    before the norm's backward reduces them, in one all-reduce."""
    assert rank_pool.run(2, _backward_collectives, timeout_s=120)[0] == {"all_reduce": 1}


def test_zero3_gathers_blocks_twice_and_the_root_once_on_the_critical_path() -> None:
    """ZeRO-3 lays blocks out with ``reshard_after_forward`` (gathered in forward and
    again in backward) and the root without (gathered once per micro-batch); the blocks'
    traffic may hide behind compute, the root's opens the forward and closes the
    backward, on the critical path."""
    n_layers = 2
    g = _gpt_graph(n_layers)
    built = _built((2, 1), zero=3, n_layers=n_layers)
    hidden, critical = _charged(built, "micro_param_comm_s"), _charged(built, "comm_s")
    link = load_profile("h100-sxm").intra_node
    block, root = _unit_sizes(g)

    def unit(numel: float, gathers: int) -> float:  # fp32: 4 bytes gathered and reduced
        return gathers * collective_time("all_gather", 4.0 * numel, 2, link) + \
            collective_time("reduce_scatter", 4.0 * numel, 2, link)
    assert hidden == pytest.approx(n_layers * unit(block, 2), rel=1e-9)
    assert critical == pytest.approx(unit(root, 1), rel=1e-9)


def test_an_all_to_all_across_nodes_charges_only_the_other_nodes_share() -> None:
    """16 expert ranks on 2 nodes of 8: each rank sends 8/16 of its buffer to the other
    node over its NIC (the rest goes over NVLink at the same time), so the all-to-all
    costs what 8/15 of a 16-rank all-to-all's ring traffic costs on the inter-node link;
    a ring collective across the same nodes still moves its whole traffic there."""
    from autopar.cost_models.comm import group_link

    hw = load_profile("h100-sxm")
    nbytes = 512e6
    across = group_link((16,), 0, 8, hw)
    assert across.node_ranks == 8
    plain = hw.inter_node
    a2a = collective_time("all_to_all", nbytes, 16, across)
    assert a2a == pytest.approx(collective_time("all_to_all", nbytes * 8 / 15, 16, plain))
    assert collective_time("all_gather", nbytes, 16, across) == \
        collective_time("all_gather", nbytes, 16, plain)
    one_per_node = group_link((16, 8), 0, 8, hw)  # stride 8: one member per node
    assert one_per_node.node_ranks == 1
    assert collective_time("all_to_all", nbytes, 16, one_per_node) == \
        collective_time("all_to_all", nbytes, 16, plain)
    two_per_node = group_link((16, 4), 0, 8, hw)  # stride 4: two members per node
    assert two_per_node.node_ranks == 2
    assert group_link((2, 8), 1, 8, hw) is hw.intra_node
