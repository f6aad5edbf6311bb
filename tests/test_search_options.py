"""Runners-up (``top_k``), the time limit with its gap, and progress reports."""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar.cli import main
from autopar.errors import ConfigError
from autopar.examples import zoo


@pytest.fixture(scope="module")
def gpt():
    return zoo.get("tiny-gpt", batch_size=8)


CLUSTER = autopar.Cluster("a100-80g", 2, 4)


@pytest.fixture(scope="module")
def full(gpt) -> autopar.Plan:
    """The tiny GPT planned with every candidate solved (k large enough that nothing is
    pruned): the best plan and every runner-up."""
    model, x = gpt
    return autopar.plan(model, x, cluster=CLUSTER, global_batch=16, top_k=10_000)


def test_runners_up_are_the_next_fastest_plans(gpt, full):
    model, x = gpt
    plan = autopar.plan(model, x, cluster=CLUSTER, global_batch=16, top_k=4)
    times = [plan.step_time_s] + [r["step_time_s"] for r in plan.runners_up]
    ref = [full.step_time_s] + [r["step_time_s"] for r in full.runners_up]
    assert len(plan.runners_up) == 3 and times == sorted(times)
    assert times == pytest.approx(ref[:4], rel=1e-12)
    for r in plan.runners_up:
        assert r["step_time_s"] >= plan.step_time_s
        slower = r["step_time_s"] > plan.step_time_s * (1 + 1e-9)
        assert bool(r["why"]) == slower  # a reason exactly when it is slower
    assert autopar.Plan.from_json(plan.to_json()).runners_up == plan.runners_up
    assert "runners-up (why each is slower than the plan)" in plan.summary()
    # with runners-up the search visits the configurations without a pipeline first;
    # the plan is still the one found alone, ties included
    one = autopar.plan(model, x, cluster=CLUSTER, global_batch=16)
    same = lambda p: (p.mesh, p.zero, p.microbatch_size, p.num_microbatches, p.recompute,
                      p.step_time_s)
    assert same(one) == same(plan) == same(full)


def test_time_limit_returns_the_best_found_with_its_gap(gpt, full):
    model, x = gpt
    seen = []
    plan = autopar.plan(model, x, cluster=CLUSTER, global_batch=16, time_limit_s=0.0,
                        progress=lambda done, total, best: seen.append((done, total, best)))
    assert plan.solver["candidates"] == 1 and seen == [(1, seen[0][1], plan.step_time_s)]
    assert 0.0 <= plan.solver["gap"] < 1.0
    assert any("time limit" in n for n in plan.notes)
    # the optimum, found with nothing pruned, is within the gap of the plan found
    assert full.step_time_s >= plan.step_time_s * (1 - plan.solver["gap"]) * (1 - 1e-12)


def test_bad_top_k_is_one_clear_error(gpt):
    model, x = gpt
    with pytest.raises(ConfigError, match=r"top_k=0: expected a positive integer"):
        autopar.plan(model, x, cluster=CLUSTER, global_batch=16, top_k=0)


def test_cli_top_lists_runners_up(capsys):
    assert main(["plan", "tiny-gpt", "--gpu", "a100-80g", "--nodes", "1",
                 "--gpus-per-node", "4", "--global-batch", "8", "--top-k", "3"]) == 0
    out = capsys.readouterr().out
    assert "runners-up (why each is slower than the plan)" in out
    assert out.count("ZeRO-") >= 2


def test_cli_plan_takes_the_api_knobs_by_their_api_names(tmp_path, gpt):
    """`autopar plan` fixes what plan() fixes, under plan()'s names (the old short
    spellings still work)."""
    out = tmp_path / "plan.json"
    args = ["plan", "tiny-gpt", "--gpu", "a100-80g", "--nodes", "2", "--gpus-per-node", "4",
            "--global-batch", "16", "--json", str(out)]
    assert main(args + ["--microbatch-size", "2", "--recompute", "full", "--zero", "3",
                        "--no-sequence-parallel", "--no-offload", "--time-limit-s", "60"]) == 0
    cli = autopar.Plan.from_json(out.read_text())
    model, x = gpt
    api = autopar.plan(model, x, cluster=CLUSTER, global_batch=16, microbatch_size=2,
                       recompute="full", zero=3, sequence_parallel=False, offload=False)
    assert (cli.mesh, cli.microbatch_size, cli.zero, set(cli.recompute.values())) == \
        (api.mesh, 2, 3, {"full"})
    assert cli.step_time_s == pytest.approx(api.step_time_s, rel=1e-9)
    assert main(args + ["--microbatch", "4", "--top", "1", "--time-limit", "60"]) == 0
    assert autopar.Plan.from_json(out.read_text()).microbatch_size == 4


def test_gpu_names_map_to_their_profiles():
    from autopar.api import profile_for_gpu

    assert profile_for_gpu("NVIDIA H200") == "h200"
    assert profile_for_gpu("NVIDIA H100 80GB HBM3") == "h100-sxm"
    assert profile_for_gpu("NVIDIA A100-SXM4-80GB") == "a100-80g"
    with pytest.warns(UserWarning, match=r"no hardware profile for the GPU 'NVIDIA L40S'.*"
                                         r"autopar profile"):
        assert profile_for_gpu("NVIDIA L40S") == "h100-sxm"


class _BlocksTwice(torch.nn.Module):
    """The tiny GPT with its blocks run twice per forward (weights shared across depth):
    torch.export captures it, but no cut at block calls gives each block one stage."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        m = self.inner
        h = m.tok_emb(idx) + m.pos_emb(torch.arange(idx.shape[1], device=idx.device))
        for _ in range(2):
            for block in m.blocks:
                h = block(h)
        return m.head(m.ln_f(h))


def test_a_model_the_runtime_cannot_cut_is_planned_without_pipelining(gpt, full):
    """The pipelined runtime cuts stages from the exported program at block calls;
    where that fails, a free search leaves pipelining out and says why, instead of
    returning a plan the runtime cannot run, and a pp the caller asks for is refused
    with the same reason."""
    model, x = gpt
    assert not any("pipeline parallelism left out" in n for n in full.notes)
    assert any(r["mesh"].get("pp", 1) > 1 for r in full.runners_up)
    twice = _BlocksTwice(model)
    checked = autopar.plan(twice, x, cluster=CLUSTER, global_batch=16, top_k=10_000)
    assert checked.mesh.get("pp", 1) == 1
    assert all(r["mesh"].get("pp", 1) == 1 for r in checked.runners_up)
    note = next(n for n in checked.notes if "pipeline parallelism left out" in n)
    assert "block 'inner.blocks.0' is called more than once" in note
    with pytest.raises(ConfigError, match="pp=2 cannot run: .* called more than once"):
        autopar.plan(twice, x, cluster=CLUSTER, global_batch=16, pp=2)


def test_tensor_parallelism_wider_than_a_node_only_when_nothing_else_fits(gpt, full):
    """On 2 nodes of 4, tp=8 is tried only when no plan with tp <= 4 fits (or when asked
    for); the search's order is the brute-force reference's too (tiers)."""
    from autopar.solvers.search_space import candidates, offload_candidates, tiers

    cands = candidates(8, 16, heads=8, num_units=6)
    wide = [c for c in cands if c.tp == 8]
    local, rest = tiers(cands, 4, None)
    assert wide and {c.tp for c in local} == {1, 2, 4}
    assert rest == wide + offload_candidates(cands)
    assert tiers(cands, 4, False) == [local, wide]
    # tp=8 on 8 devices leaves dp=1: no ZeRO-3 to offload, so no second list
    assert tiers(cands, 4, True) == [offload_candidates(local)]
    assert tiers(wide, 4, None)[0] == wide  # asked for: searched first
    model, x = gpt  # 4 heads: tp=4 is wider than nodes of 2
    pairs = autopar.Cluster("a100-80g", 4, 2)
    free = autopar.plan(model, x, cluster=pairs, global_batch=16, top_k=10_000)
    assert max(m["tp"] for m in [free.mesh] + [r["mesh"] for r in free.runners_up]) == 2
    assert autopar.plan(model, x, cluster=pairs, global_batch=16, tp=4).mesh["tp"] == 4


def test_time_limit_bounds_the_whole_search():
    """A mid-size model whose full search takes several seconds: with a 1 s limit the
    plan comes back within the limit plus what runs before the search (capture, timed
    here on its own) and a slack for building the candidates' problems, and its gap
    covers the proven optimum."""
    import time

    from autopar.capture import capture

    model, x = zoo.get("gpt-7.5b")
    cluster = autopar.Cluster("h100-sxm", 4, 8)
    t0 = time.perf_counter()
    capture(model, x)
    captured_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    limited = autopar.plan(model, x, cluster=cluster, global_batch=32, time_limit_s=1.0)
    wall_s = time.perf_counter() - t0
    assert wall_s < 1.0 + 2 * captured_s + 2.0, (wall_s, captured_s)
    full = autopar.plan(model, x, cluster=cluster, global_batch=32)
    assert "gap" not in full.solver
    if "gap" in limited.solver:
        assert limited.solver["candidates"] < full.solver["candidates"]
        assert full.step_time_s >= limited.step_time_s * (1 - limited.solver["gap"]) * \
            (1 - 1e-12)
    else:
        assert limited.step_time_s == full.step_time_s


def test_the_bound_of_an_unbuilt_problem_is_below_every_plan_of_it(gpt):
    """:func:`flop_bound` (the gap's bound on a candidate whose problem the time limit
    left unbuilt) is below the step time of every plan the full search solves."""
    from autopar.capture import capture
    from autopar.planner_inputs import attention_heads
    from autopar.solvers.outer_search import search
    from autopar.solvers.search_bounds import flop_bound
    from autopar.solvers.search_space import candidates
    from autopar.strategies.analysis import analyze

    model, x = gpt
    g = capture(model, x)
    hw = CLUSTER.hardware()
    cands = candidates(CLUSTER.world_size, 16, num_units=len(g.layers) + 2,
                       heads=attention_heads(g))
    res = search(analyze(g), cands, hw=hw, gpus_per_node=CLUSTER.gpus_per_node,
                 precision="bf16", optimizer="adamw",
                 memory_budget=float(hw.usable_memory_bytes), top_k=10_000)
    plans = [(res.candidate, res.step_time_s)] + \
        [(s.candidate, s.step_time_s) for s in res.runners_up]
    assert len(plans) > 20
    ratios = [flop_bound(g, c, hw, "bf16") / t for c, t in plans]
    assert 0.0 < max(ratios) < 1.0, max(ratios)
