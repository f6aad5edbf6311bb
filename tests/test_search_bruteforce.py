"""The full search equals brute-force enumeration of the whole space on small instances.

For each instance, :func:`autopar.solvers.outer_search.search` (lower bounds, pruning, the
ILP, the stage split, the winner's refinement) and
:func:`autopar.solvers.exhaustive.brute_force_search` (every candidate, every
consistent assignment, every recomputation mode, every stage split scored by the
schedule's simulator) run on the same candidates; the best step times must agree to
1e-9 relative, and the search's candidate must be the brute force's or tie with it.

The candidate-level tests below check, on one pipelined candidate each, the traps
between the planner's means of search and the objective it reports: a split chosen by
a closed form that only uniform stages obey, a split blind to the dp gradient sync each
rank exposes, an ILP memory model stricter than the exact per-rank check, and an ILP
that does not see the stage-to-stage transfer its boundary placement sets.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

import autopar
from autopar.capture import capture
from autopar.errors import NoFeasiblePlanError
from autopar.planner_inputs import attention_heads, expert_count
from autopar.examples.gpt import GPT, GPTConfig
from autopar.examples.mlp import MLP
from autopar.examples.moe import MoEConfig, MoETransformer
from autopar.solvers.exhaustive import BruteForceResult, brute_force_search, score_pipeline
from autopar.solvers.outer_search import SearchResult, search
from autopar.solvers.search_space import Candidate, candidates
from autopar.solvers.problem import evaluate
from autopar.strategies.analysis import GraphAnalysis, analyze

REL = 1e-9

@dataclass(frozen=True)
class Instance:
    """One small planning problem: a model, a cluster, a global batch, a search space and
    the memory budget as a fraction of the memory of the fastest plan without pipelining
    (None: the device's memory)."""

    name: str
    model: str
    nodes: int
    per_node: int
    global_batch: int = 8
    inter_node_gbps: float | None = None
    budget_frac: float | None = None
    space: dict = field(default_factory=dict, hash=False)


def _model(kind: str) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    """``mlp``: 3 hidden layers of 4096; ``mlp6``: 6 of them; ``mlp-wide``: 3 of 16384;
    ``gpt``: 8 blocks of
    width 256 over 128 tokens; ``gpt-wide``: 4 blocks of width 512 over 64 tokens. All
    on the meta device, with one batch of 8."""
    with torch.device("meta"):
        if kind.startswith("mlp"):
            depth = 6 if kind == "mlp6" else 3
            width = 16384 if kind == "mlp-wide" else 4096
            return MLP(in_dim=width, hidden=width, depth=depth, n_classes=16), \
                (torch.randn(8, width),)
        if kind == "moe":  # 4 blocks, the first dense; 8 experts of FFN 4096, top-2
            cfg = MoEConfig(vocab_size=1024, max_seq_len=512, dim=1024, n_layers=4,
                            n_heads=8, n_kv_heads=8, ffn_dim=4096, n_experts=8, top_k=2,
                            expert_ffn_dim=4096, n_dense_layers=1)
            return MoETransformer(cfg), (torch.randint(0, 1024, (8, 512)),)
        dim, layers, seq = (256, 8, 128) if kind == "gpt" else (512, 4, 64)
        model = GPT(GPTConfig(vocab_size=1024, max_seq_len=seq, dim=dim, n_layers=layers,
                              n_heads=8))
        return model, (torch.randint(0, 1024, (8, seq)),)


MLP_SLOW = "mlp6-2x2-slow"
MLP_SLOW_DP = "mlp6-2x2-slow-tp1"
GPT_07 = "gpt-1x4-0.7"
GPT_WIDE_SLOW = "gpt-wide-2x1-slow"

INSTANCES = {i.name: i for i in [
    Instance("mlp-1x4", "mlp", 1, 4),
    Instance("mlp-1x4-tight", "mlp", 1, 4, budget_frac=0.6),
    Instance("mlp-2x4", "mlp", 2, 4, inter_node_gbps=5.0),
    # device-bound (the others are host-bound on the H100 profile): tensor parallel wins
    Instance("mlp-wide-1x4", "mlp-wide", 1, 4, global_batch=16),
    Instance("moe-1x4-tight", "moe", 1, 4, budget_frac=0.5, space={"tp": 1}),
    Instance("gpt-1x2-offload", "gpt", 1, 2, budget_frac=0.2, space={"tp": 1}),
    Instance("gpt-1x2-0.4", "gpt", 1, 2, budget_frac=0.4, space={"tp": 1}),
    Instance("gpt-1x4-half", "gpt", 1, 4, budget_frac=0.5, space={"tp": 1, "zero": 0}),
    Instance("gpt-1x4-third", "gpt", 1, 4, budget_frac=0.35, space={"tp": 1, "zero": 0}),
    Instance("gpt-2x4-tight", "gpt", 2, 4, budget_frac=0.6, space={"tp": 1}),
    Instance(GPT_07, "gpt", 1, 4, budget_frac=0.7, space={"tp": 1, "zero": 0}),
    Instance(GPT_WIDE_SLOW, "gpt-wide", 2, 1, inter_node_gbps=0.5, space={"tp": 1}),
    Instance(MLP_SLOW, "mlp6", 2, 2, inter_node_gbps=0.2),
    Instance(MLP_SLOW_DP, "mlp6", 2, 2, inter_node_gbps=0.2, space={"tp": 1}),
]}



@dataclass
class Setup:
    """An instance ready to solve: its analysis, every candidate and the search keywords."""

    an: GraphAnalysis
    cands: list[Candidate]
    kw: dict


@dataclass
class Solved:
    """An instance solved both ways."""

    setup: Setup
    search: SearchResult
    brute: BruteForceResult


def _search_time(res: SearchResult) -> float:
    """The step time the search reports for its plan."""
    if res.pipeline is not None:
        return res.pipeline.step_time_s
    return evaluate(res.built.problem, res.solution.choice, res.solution.modes).step_time_s


def _setup(inst: Instance) -> Setup:
    """Capture, analyze and list candidates as :func:`autopar.plan` does; a budget
    fraction is taken of the memory of the search's best plan with ``pp=1``."""
    model, x = _model(inst.model)
    cluster = autopar.Cluster("h100-sxm", inst.nodes, inst.per_node,
                              inter_node_bandwidth=inst.inter_node_gbps)
    g = capture(model, x)
    an = analyze(g)
    hw = cluster.hardware()
    kw = dict(hw=hw, gpus_per_node=cluster.gpus_per_node, precision="bf16",
              optimizer="adamw", memory_budget=float(hw.usable_memory_bytes))

    def cands(**fixed) -> list[Candidate]:
        return candidates(cluster.world_size, inst.global_batch, num_units=len(g.layers) + 2,
                          heads=attention_heads(g), experts=expert_count(an, None),
                          **{**inst.space, **fixed})

    if inst.budget_frac is not None:
        free = search(an, cands(pp=1), **kw)
        need = evaluate(free.built.problem, free.solution.choice, free.solution.modes)
        kw["memory_budget"] = inst.budget_frac * need.memory_bytes
    return Setup(an, cands(), kw)


@pytest.fixture(scope="module")
def cache() -> dict[str, Solved]:
    """Each instance solved once for every test of this module."""
    return {}


def _solved(cache: dict[str, Solved], name: str) -> Solved:
    if name not in cache:
        s = _setup(INSTANCES[name])
        cache[name] = Solved(s, search(s.an, s.cands, **s.kw),
                             brute_force_search(s.an, s.cands, **s.kw))
    return cache[name]


@pytest.mark.parametrize("name", list(INSTANCES))
def test_search_equals_brute_force(name: str, cache) -> None:
    s = _solved(cache, name)
    got, ref = _search_time(s.search), s.brute.step_time_s
    assert got == pytest.approx(ref, rel=REL), (
        f"search {s.search.candidate.label()}: {got:.9g} s; brute force "
        f"{s.brute.candidate.label()}: {ref:.9g} s")
    c = s.search.candidate
    if c != s.brute.candidate:  # a tie: brute force times the search's candidate the same
        assert s.brute.times[c] == pytest.approx(ref, rel=REL)


@pytest.mark.parametrize("name", list(INSTANCES))
def test_reference_scores_the_search_plan_as_the_search_does(name: str, cache) -> None:
    """The search's own plan, re-scored by the reference, takes the time and memory the
    search reports (both sides price one objective), and brute force is never slower."""
    s = _solved(cache, name)
    res, c = s.search, s.search.candidate
    if res.pipeline is not None:
        sc = score_pipeline(s.setup.an.graph, res.built, res.solution.choice,
                            res.solution.modes, res.pipeline.split.bounds, pp=c.pp,
                            schedule=c.schedule, virtual_stages=c.virtual_stages)
        assert sc.feasible
        assert sc.step_time_s == pytest.approx(res.pipeline.step_time_s, rel=REL)
        assert sc.memory_bytes == pytest.approx(res.pipeline.memory_bytes, rel=REL)
    assert s.brute.step_time_s <= _search_time(res) * (1 + REL)


def test_instances_cover_the_space(cache) -> None:
    """Among the instances the winners pipeline, recompute, use ZeRO, tensor
    parallelism and CPU offload, so each part of the space is checked where it wins."""
    seen = dict.fromkeys(("pp", "recompute", "zero", "tp", "offload"), False)
    for name in INSTANCES:
        b = _solved(cache, name).brute
        seen["pp"] |= b.candidate.pp > 1
        seen["recompute"] |= any(m != 0 for m in b.modes)
        seen["zero"] |= b.candidate.zero > 0
        seen["tp"] |= b.candidate.tp > 1
        seen["offload"] |= b.candidate.offload
    assert all(seen.values()), seen


CANDIDATES = {  # case -> (instance, candidate)
    "gpt-pp4-1f1b": (GPT_07, Candidate(1, 1, 2, 4, 0, 4, "1f1b", 1)),
    "mlp-pp2-zero2": (MLP_SLOW_DP, Candidate(2, 1, 2, 2, 2, 2, "1f1b", 1)),
    # heavy embedding and head: another split than the least closed-form T simulates faster
    "split-by-formula": (GPT_WIDE_SLOW, Candidate(1, 1, 4, 2, 0, 2, "1f1b", 1)),
    # piling the layers on one rank exposes its dp all-reduce (26% slower)
    "split-blind-to-dp-sync": (MLP_SLOW_DP, Candidate(2, 1, 2, 2, 0, 2, "1f1b", 1)),
    # the first rank's in-flight count forces recomputation an uneven split does not need
    "ilp-memory-model": (GPT_07, Candidate(2, 1, 1, 4, 0, 2, "zbv", 2)),  # m >= 4 stages
    # deeper interleaving: 3 and 4 chunks per rank, 6 and 8 stages of the 8 blocks
    "interleaved-v3-zero-bubble": (GPT_07, Candidate(2, 1, 1, 4, 0, 2,
                                                     "interleaved_zero_bubble", 3)),
    "interleaved-v4": (GPT_07, Candidate(2, 1, 1, 4, 0, 2, "interleaved_1f1b", 4)),
    # a replicated block output doubles the transfer over the slow pp link
    "ilp-blind-to-p2p": (MLP_SLOW, Candidate(1, 2, 4, 2, 0, 2, "1f1b", 1)),
}


@pytest.mark.parametrize("case", list(CANDIDATES))
def test_pipelined_candidate_equals_brute_force(case: str, cache) -> None:
    """One pipelined candidate alone: the search (ILP, stage split, the winner's
    refinement) against every assignment, mode and split of it."""
    name, c = CANDIDATES[case]
    s = _solved(cache, name).setup
    assert c in s.cands
    got = search(s.an, [c], **s.kw)
    ref = brute_force_search(s.an, [c], **s.kw)
    assert got.pipeline.step_time_s == pytest.approx(ref.step_time_s, rel=REL), (
        f"search: {got.pipeline.step_time_s:.9g} s, split {got.pipeline.split.bounds}, "
        f"modes {got.solution.modes}; brute force: {ref.step_time_s:.9g} s, split "
        f"{ref.bounds}, modes {ref.modes}")


def test_nothing_fits_either_way() -> None:
    """A budget below every plan's need (CPU offload included): both raise."""
    s = _setup(Instance("mlp-1x2-none", "mlp", 1, 2, budget_frac=0.15))
    with pytest.raises(NoFeasiblePlanError):
        search(s.an, s.cands, **s.kw)
    with pytest.raises(NoFeasiblePlanError):
        brute_force_search(s.an, s.cands, **s.kw)
