"""A routed expert module's tokens in two legs where the ``ep`` group spans nodes: each
token once to every node holding any of its experts, then to their ranks inside it
(:mod:`autopar.cost_models.expert_dispatch`, :func:`autopar.runtime.routed_experts.
route_tokens`). Priced from the expected number of distinct nodes (checked against
every choice of experts), chosen by the planner where the nodes are joined slowly, and
trained as in one process (Hugging Face's Mixtral, 8 experts, fp32, gloo; 4 ranks, and
8 with a pipeline)."""

from __future__ import annotations

import dataclasses
import inspect
import itertools
from math import comb

import pytest
import torch

from autopar.cost_models.comm import collective_time, group_link
from autopar.cost_models.expert_dispatch import EXCHANGES, distinct_nodes, routed_dispatch
from autopar.cost_models.hardware_parse import load_profile
from autopar.demo import reference_step, sgd_losses
from autopar.errors import PlanFormatError
from tests.dist_utils import RankPool

pytest.importorskip("transformers")

STEPS, LR = 3, 0.1


@pytest.mark.parametrize("experts,top_k,nodes", [(8, 2, 2), (8, 3, 4), (12, 4, 3), (6, 6, 2)])
def test_distinct_nodes_is_the_mean_over_every_choice(experts: int, top_k: int,
                                                      nodes: int) -> None:
    per = experts // nodes
    hits = [len({e // per for e in c}) for c in itertools.combinations(range(experts), top_k)]
    assert distinct_nodes(experts, top_k, nodes) == pytest.approx(sum(hits) / comb(experts, top_k))


def test_two_legs_cross_the_nodes_once_per_node() -> None:
    """16 H100s in two nodes, ep=16, 128 experts, top-8: the rail leg moves each token
    to about 2 nodes instead of 8 copies, one half of them across; one expert per
    token gains nothing and keeps the one exchange."""
    hw = load_profile("h100-sxm")
    link = group_link((16,), 0, 8, hw)
    rows = 4096 * 2048 * 2.0
    legs = routed_dispatch(rows, 8, 128, 16, link, hw.intra_node)
    d = distinct_nodes(128, 8, 2)
    assert d == pytest.approx(1.99, abs=0.01)
    rail = collective_time("all_to_all", rows * d, 2, dataclasses.replace(link, node_ranks=1))
    inside = collective_time("all_to_all", rows * 8, 8, hw.intra_node)
    assert legs.node_ranks == 8
    assert legs.seconds == pytest.approx(EXCHANGES * (rail + inside))
    flat = EXCHANGES * collective_time("all_to_all", rows * 8, 16, link)
    assert legs.seconds < 0.5 * flat
    assert routed_dispatch(rows, 1, 128, 16, link, hw.intra_node).node_ranks == 1
    one_node = group_link((8,), 0, 8, hw)
    assert routed_dispatch(rows, 8, 128, 8, one_node, hw.intra_node).node_ranks == 1


def mixtral(experts: int = 8, top_k: int = 2, hidden: int = 32) -> torch.nn.Module:
    """A Mixtral of 2 layers, ``experts`` experts, ``top_k`` a token (dropout off), the
    same weights each call."""
    import transformers as t

    torch.manual_seed(0)
    return t.MixtralForCausalLM(t.MixtralConfig(
        vocab_size=64, hidden_size=hidden, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=1024, intermediate_size=2 * hidden, num_key_value_heads=2,
        num_experts_per_tok=top_k, num_local_experts=experts))


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return (torch.randint(0, 64, (8, 16), generator=g), torch.randint(0, 64, (8, 16), generator=g))


def test_planner_moves_tokens_in_two_legs_between_nodes() -> None:
    """Planned for two nodes of two H100s with ep=4, the routed modules move their
    tokens in two legs, which the plan records and its JSON keeps; a plan edited to
    cut the group into nodes that do not divide it is refused."""
    import autopar
    from autopar.plans import Plan

    with torch.device("meta"):
        model = mixtral(64, 8, 1024)
    x = torch.randint(0, 64, (8, 1024))
    kw = dict(precision="bf16", dp=4, ep=4)
    plan = autopar.plan(model, (x,), cluster=autopar.Cluster("h100-sxm", 2, 2), **kw)
    assert {xp.node_ranks for xp in plan.experts.values()} == {2}
    assert Plan.from_json(plan.to_json()).experts == plan.experts
    assert "each token sent once per node of its experts, then inside it to their ranks " \
           "(2 a node)" in plan.summary()
    one = autopar.plan(model, (x,), cluster=autopar.Cluster("h100-sxm", 1, 4), **kw)
    assert {xp.node_ranks for xp in one.experts.values()} == {1}
    path = next(iter(plan.experts))
    plan.experts[path].node_ranks = 3
    with pytest.raises(PlanFormatError, match=r"expert module '.*' has node_ranks 3; a routed "
                                              r"module's two-leg exchange needs 1 < node_ranks "
                                              r"< ep=4 dividing ep"):
        Plan.from_json(plan.to_json())


def _train(spaces: list[dict]) -> list[list[float]]:
    """Each space trained on this group's ranks with its routed modules' tokens in two
    legs of two ranks per node (the plan edited so): the losses."""
    from autopar.runtime import routed_experts

    legs = []
    by_node = routed_experts._by_node

    def counted(*args):
        legs.append(1)
        return by_node(*args)

    routed_experts._by_node = counted
    try:
        return [_losses(space, legs) for space in spaces]
    finally:
        routed_experts._by_node = by_node


def _losses(space: dict, legs: list) -> list[float]:
    """The losses of ``space`` trained in two legs (``legs`` counts their calls)."""
    import autopar

    x, y = batch()
    model = mixtral()
    ranks = space.get("pp", 1) * space["dp"]
    plan = autopar.plan(model, (x,), example_targets=y, precision="fp32",
                        cluster=autopar.Cluster("cpu", 2, ranks // 2), **space)
    for xp in plan.experts.values():
        xp.node_ranks = 2
    pm = autopar.parallelize(model, plan=plan)
    losses = sgd_losses(pm.parameters(), lambda: pm.step(x, y), STEPS, LR)
    assert legs, "the two-leg exchange did not run"
    legs.clear()
    return losses


SPACES = [{"dp": 4, "ep": 4}, {"dp": 4, "ep": 4, "zero": 3}]


@pytest.mark.multirank
@pytest.mark.parametrize("ranks, spaces", [(4, SPACES), (8, [{"pp": 2, "dp": 4, "ep": 4}])],
                         ids=["dp4 x ep4", "pp2 x dp4 x ep4"])
def test_two_leg_exchange_trains_as_in_one_process(rank_pool: RankPool, ranks: int,
                                                   spaces: list[dict]) -> None:
    got = rank_pool.run(ranks, _train, spaces, timeout_s=900)[0]
    x, y = batch()
    model = mixtral()
    ref = sgd_losses(model.parameters(), reference_step(model, x, y), STEPS, LR)
    for space, losses in zip(spaces, got):
        assert losses == pytest.approx(ref, abs=1e-5), space


def test_emitted_program_runs_the_two_legs(tmp_path) -> None:
    """The program for a plan whose routed modules move in two legs builds the legs'
    meshes, passes pyflakes, and trains as the program of the one-exchange plan does
    (4 gloo processes, 2 SGD steps on one batch)."""
    import autopar
    from autopar.runtime.codegen import emit_program
    from tests.test_codegen import printed_losses, pyflakes, torchrun_outputs

    factory = tmp_path / "models.py"
    factory.write_text("import torch\n\n\n" + inspect.getsource(mixtral))
    x, y = batch()
    data = tmp_path / "batch.pt"
    torch.save({"inputs": x, "targets": y}, data)
    plan = autopar.plan(mixtral(), (x,), example_targets=y, cluster=autopar.Cluster("cpu", 2, 2),
                        precision="fp32", optimizer="sgd", dp=4, ep=4)
    runs = []
    for per_node in (1, 2):
        for xp in plan.experts.values():
            xp.node_ranks = per_node
        program = tmp_path / f"legs{per_node}.py"
        program.write_text(emit_program(plan, f"{factory}:mixtral"))
        assert pyflakes(program) == ""
        assert ("def build_ep_legs(" in program.read_text()) == (per_node > 1)
        runs.append((program, ["--steps", "2", "--optimizer", "sgd", "--lr", str(LR),
                               "--data", str(data)]))
    flat, legs = (printed_losses(out) for out in torchrun_outputs(runs, tmp_path / "runs"))
    assert len(flat) == 2 and legs == pytest.approx(flat, abs=1e-5)
