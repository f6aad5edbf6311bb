"""What activation recomputation runs again and keeps, priced as the runtime does it.

Recomputation re-runs the layouts changes inside a recomputed block (the lowering's
module hooks run in the checkpointed forward) until torch's early stop, so an edge's
forward conversion is charged once more per backward, and the block's last op that
saves a tensor (and its output's conversion) is not. Selective recomputation keeps a
row-split product's partial sum at its full local size, as the runtime's checkpoint
policy caches it (measured on 2 gloo ranks); full recomputation never keeps more than
none. GPT-3 175B under Megatron's ``--tp 8 --pp 8`` with selective recomputation
splits ``attn.proj`` by rows, as Megatron does.
"""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar.capture import capture
from autopar.cost_models.comm import collective_time
from autopar.cost_models.hardware import load_profile
from autopar.cost_models.strategy_price import StrategyPricer
from autopar.examples.gpt import GPT, GPTConfig
from autopar.sharding import Mesh
from autopar.solvers.intra_op_ilp import IntraOpILP
from autopar.solvers.cost_record import StrategyCost
from autopar.solvers.problem import EdgeChoice, NodeChoice, Problem
from autopar.solvers.problem_build import Built, build_problem
from autopar.strategies.analysis import analyze
from autopar.strategies.settings import Settings

B, T, DIM = 2, 256, 512


def built(tp: int, sp: bool) -> Built:
    """The problem of a 2-block GPT on a (dp 1, tp) mesh of A100s, bf16."""
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=1024, max_seq_len=T, dim=DIM, n_layers=2, n_heads=8))
    g = capture(model, (torch.randint(0, 1024, (B, T), device="meta"),))
    st = Settings(Mesh(("dp", "tp"), (1, tp)), B, 1, 0, "bf16", "adamw", float("inf"),
                  load_profile("a100-80g"), 8, sequence_parallel=sp)
    return build_problem(analyze(g), st)


def test_gathered_input_is_charged_again_and_the_last_product_is_not() -> None:
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=1024, max_seq_len=T, dim=DIM, n_layers=2, n_heads=8))
    g = capture(model, (torch.randint(0, 1024, (B, T), device="meta"),))
    an = analyze(g)
    st = Settings(Mesh(("dp", "tp"), (1, 2)), B, 1, 0, "bf16", "adamw", float("inf"),
                  load_profile("a100-80g"), 8, sequence_parallel=True)
    b = build_problem(an, st)
    p, grp = b.problem, b.problem.recompute[0]
    link = StrategyPricer(an, st).links[1]
    whole = B * T * DIM * 2  # bytes of one (B, T, C) bf16 activation
    gather = collective_time("all_gather", whole, 2, link)
    scatter = collective_time("reduce_scatter", whole, 2, link)
    path = {name: g.node(name).module_path for name in b.names}
    proj = b.names.index(next(n for n in b.names if path[n] == "blocks.0.attn.proj"))
    fc2 = b.names.index(next(n for n in b.names if path[n] == "blocks.0.mlp.fc2"))
    # a column-wise proj all-gathers its head-split input: once more per backward
    # under selective and full (in the hand-made Megatron plan, a hook in the block)
    rows = [(e, table) for e, table in zip(grp.edges, grp.edge_extra_s)
            if p.edges[e].v == proj]
    gathered = [(p.edges[e], ij) for e, table in rows for ij in table
                if b.strategies[proj][ij[1]].ins[0] == ("R", "R")
                and b.strategies[p.edges[e].u][ij[0]].out == ("R", "S(2)")]
    assert gathered
    for e, table in rows:
        for ij, row in table.items():
            if (p.edges[e], ij) in gathered:
                assert row == pytest.approx([0.0, gather, gather], rel=1e-12)
    # a row-wise proj reduce-scatters its partial output: under full recomputation that
    # forward runs again; selective keeps the reduce-scatter's output (its 1/tp share)
    k = grp.nodes.index(proj)
    rowwise = [i for i, ns in enumerate(b.strategies[proj])
               if ns.raw_out == ("R", "P") and ns.out == ("R", "S(1)")]
    assert rowwise
    for i in rowwise:
        assert grp.extra_s[k][i][1] == 0.0
        assert grp.extra_s[k][i][2] > scatter
        kept_none = -grp.act_delta[k][i][2]  # what none keeps beyond full's block inputs
        assert grp.act_delta[k][i][1] == pytest.approx(whole / 2 + whole - kept_none,
                                                       rel=1e-12)
    # fc2 saves its inputs last: recomputation stops before it runs, so neither its
    # product nor its output's reduce-scatter runs again
    if fc2 in grp.nodes:
        assert all(row[1] == row[2] == 0.0 for row in grp.extra_s[grp.nodes.index(fc2)])


def _worst(b: Built, r: int) -> float:
    """The largest Σ act_delta of the layer under mode r over every assignment the
    edges and ties allow (an ILP that minimizes −Σ act_delta)."""
    p, grp = b.problem, b.problem.recompute[0]
    row = {v: k for k, v in enumerate(grp.nodes)}
    scale = 1e9
    nodes = [NodeChoice(n.name, [StrategyCost(s.name, compute_s=1.0 - (
        grp.act_delta[row[v]][i][r] if v in row else 0.0) / scale)
        for i, s in enumerate(n.strategies)]) for v, n in enumerate(p.nodes)]
    edges = [EdgeChoice(e.u, e.v, {ij: 0.0 for ij in e.cost}) for e in p.edges]
    sol = IntraOpILP(Problem(nodes, edges, p.ties)).solve()
    return sum(grp.act_delta[k][sol.choice[v]][r] for k, v in enumerate(grp.nodes))


@pytest.mark.parametrize("tp,sp", [(2, True), (4, False)])
def test_full_recomputation_never_keeps_more(tp: int, sp: bool) -> None:
    """Over every assignment of a GPT layer, full recomputation keeps no more than none;
    selective may, by the row-split products' partial sums it keeps whole and the
    reduce-scatters' outputs."""
    b = built(tp, sp)
    assert _worst(b, 2) < 0
    grp = b.problem.recompute[0]
    whole = B * T * DIM * 2
    for k, v in enumerate(grp.nodes):
        for i, ns in enumerate(b.strategies[v]):
            if "P" in ns.raw_out and grp.act_delta[k][i][1] > 0:
                # at most one (B, T, 4C) product's partial sum and its reduce-scatter's share
                assert grp.act_delta[k][i][1] <= whole * 4 * (1 + 1 / tp)


def _megatron_gpt_step(backward: bool) -> None:
    """On this rank: a 2-block GPT planned as Megatron does (tp 2 with sequence
    parallelism, selective recomputation) runs forward, and backward when asked."""
    from autopar.runtime import apply_plan
    from tests.handmade_plans import megatron_plan

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=128, max_seq_len=16, dim=64, n_layers=2, n_heads=4))
    plan = megatron_plan(model, tp=2, sequence_parallel=True, global_batch=2,
                         recompute="selective")
    out = apply_plan(model, plan)(torch.randint(0, 128, (2, 16)))
    if backward:
        out.float().pow(2).mean().backward()


def _spied_step(mode: type, make_spy, backward: bool) -> None:
    """:func:`_megatron_gpt_step` with checkpoint dispatch mode ``mode``'s
    ``__torch_dispatch__`` replaced by ``make_spy(original)`` meanwhile."""
    dispatch = mode.__torch_dispatch__
    mode.__torch_dispatch__ = make_spy(dispatch)
    try:
        _megatron_gpt_step(backward=backward)
    finally:
        mode.__torch_dispatch__ = dispatch


def _cached_partials() -> list[tuple[str, int, int]]:
    """On this rank: (placements, local bytes, global bytes) of the outputs the selective
    policy caches for the row-split products of a Megatron-planned GPT block (tp 2)."""
    import torch.utils.checkpoint as ck
    from torch.distributed.tensor import DTensor

    seen: list[tuple[str, int, int]] = []

    def make_spy(dispatch):
        def spy(self, func, types, args=(), kwargs=None):
            out = dispatch(self, func, types, args, kwargs)
            policy = self.policy_fn(ck.SelectiveCheckpointContext(is_recompute=False), func,
                                    *args, **(kwargs or {}))
            if policy == ck.CheckpointPolicy.MUST_SAVE and isinstance(out, DTensor) \
                    and out.placements[0].is_partial():
                seen.append((str(out.placements), out._local_tensor.nbytes,
                             out.numel() * out.element_size()))
            return out
        return spy

    _spied_step(ck._CachingTorchDispatchMode, make_spy, backward=False)
    return seen


@pytest.mark.multirank
def test_selective_keeps_row_split_partials_whole(rank_pool) -> None:
    """What ``recompute_price._kept`` charges a row-split product under selective: its
    partial output at the full size of the whole tensor, before the reduction."""
    seen = rank_pool.run(2, _cached_partials, timeout_s=300)[0]
    assert len(seen) == 4  # attn.proj and mlp.fc2 of 2 blocks
    assert all(local == whole for _, local, whole in seen)


@pytest.mark.slow
def test_gpt3_175b_megatron_selective_splits_proj_by_rows() -> None:
    from autopar.examples import zoo

    model, x = zoo.get("gpt3-175b", batch_size=1)
    plan = autopar.plan(model, x, cluster=autopar.Cluster("a100-80g", 8, 8), global_batch=64,
                        tp=8, pp=8, dp=1, microbatch_size=1, schedule="interleaved_1f1b",
                        virtual_stages=3, recompute="selective", sequence_parallel=True)
    proj = plan.modules["blocks.*.attn.proj"] if "blocks.*.attn.proj" in plan.modules else \
        next(m for p, m in plan.modules.items() if p.endswith("attn.proj"))
    assert (proj.style, proj.input_layout, proj.output_layout) == ("rowwise", "S(2)", "S(1)")


def test_selective_keeps_einsum_products_as_the_runtime_does() -> None:
    """An einsum is captured whole but dispatches to ``bmm``, whose output the runtime's
    selective policy saves: in backward it runs no product again (as many ``bmm`` as
    without checkpointing; full recomputation runs the forward's again), and the
    pricer charges an einsum expert's product nothing under selective."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.checkpoint import checkpoint

    from autopar.examples.moe import MoEConfig, MoETransformer
    from autopar.runtime.recompute import selective_context

    class Products(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += func.overloadpacket.__name__ in ("bmm", "mm")
            return func(*args, **(kwargs or {}))

    def experts(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.einsum("becd,edf->becf", x, w).sin()

    def backward_products(mode: str) -> int:
        x = torch.randn(2, 3, 4, 8, requires_grad=True)
        w = torch.randn(3, 8, 5, requires_grad=True)
        if mode == "none":
            y = experts(x, w)
        else:
            kw = {"context_fn": selective_context} if mode == "selective" else {}
            y = checkpoint(experts, x, w, use_reentrant=False, **kw)
        with Products() as seen:
            y.sum().backward()
        return seen.count

    plain = backward_products("none")
    assert backward_products("selective") == plain < backward_products("full")

    cfg = MoEConfig(vocab_size=128, max_seq_len=16, dim=32, n_layers=2, n_heads=4,
                    n_kv_heads=4, ffn_dim=64, n_experts=4, top_k=2, expert_ffn_dim=32)
    with torch.device("meta"):
        model = MoETransformer(cfg)
    g = capture(model, (torch.randint(0, 128, (2, 16), device="meta"),))
    st = Settings(Mesh(("dp", "tp"), (1, 1)), 2, 1, 0, "bf16", "adamw", float("inf"),
                  load_profile("a100-80g"), 8)
    b = build_problem(analyze(g), st)
    grp = b.problem.recompute[0]
    einsums = [k for k, v in enumerate(grp.nodes) if g.node(b.names[v]).target ==
               "aten.einsum.default"]
    assert einsums
    for k in einsums:
        for row in grp.extra_s[k]:
            assert row[1] == 0.0 < row[2]


def _rerun_collectives() -> list[str]:
    """On this rank: the collectives the backward of a Megatron-planned GPT (tp 2 with
    sequence parallelism, selective recomputation) runs again while recomputing."""
    import torch.utils.checkpoint as ck

    rerun: list[str] = []

    def make_spy(dispatch):
        def spy(self, func, types, args=(), kwargs=None):
            key = ck._sac_storage_key(func, args)
            entry = self.storage.get(key, {}).get(self.func_counter[key])
            name = getattr(getattr(func, "overloadpacket", func), "__name__", str(func))
            if entry is ck._RECOMPUTE and func.namespace == "_c10d_functional":
                rerun.append(name)
            return dispatch(self, func, types, args, kwargs)
        return spy

    _spied_step(ck._CachedTorchDispatchMode, make_spy, backward=True)
    return rerun


@pytest.mark.multirank
def test_selective_keeps_the_reduce_scatters_outputs(rank_pool) -> None:
    """The runtime's selective policy keeps what the pricer says it keeps: the
    recomputation of a sequence-parallel block all-gathers the column-split products'
    inputs again, and runs none of the row-split products' reduce-scatters again."""
    rerun = rank_pool.run(2, _rerun_collectives, timeout_s=300)[0]
    assert "all_gather_into_tensor" in rerun
    assert "reduce_scatter_tensor" not in rerun
