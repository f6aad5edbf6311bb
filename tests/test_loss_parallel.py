"""Loss parallelism: the loss computed on logits split along their classes over tp.

Which losses may split their classes (cross-entropy, and a user's NLL of a log-softmax
that feeds it alone), what it costs (three all-reduces of one float per row), that the
planner takes it by itself where the logits are large (Llama 3 8B and torchtitan's 70B
configuration, whose measured peak memory it then predicts), and that training under it
equals one process: tp2 and tp4 with and without sequence parallelism, dp x tp with
ZeRO-3, pp x tp, a custom loss, Hugging Face's ``.logits``, the user's own loop and the
emitted programs."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

import autopar
from autopar.capture import capture
from autopar.cost_models.comm import collective_time
from autopar.cost_models.strategy_price import StrategyPricer
from autopar.demo import reference_step, sgd_losses
from autopar.examples import zoo
from autopar.sharding import Mesh
from autopar.strategies.analysis import analyze
from autopar.strategies.settings import Settings
from tests.dist_utils import RankPool
from tests.foreign_models import NanoGPT, lm_loss
from tests.test_codegen import MODELS
from tests.test_parallel_equivalence import LR, STEPS, data, make

GIB = 2**30


def nll_of_log_softmax(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """A user's cross-entropy written as NLL of a log-softmax."""
    return F.nll_loss(F.log_softmax(logits.flatten(0, -2).float(), dim=-1), targets.flatten())


def reread_log_softmax(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The log-softmax read twice: by the NLL loss and by an entropy-like term."""
    logp = F.log_softmax(logits.flatten(0, -2).float(), dim=-1)
    return (F.nll_loss(logp, targets.flatten(), reduction="none") + 1e-3 * logp.mean(-1)).mean()


def smoothed(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy with label smoothing (torch's class-split kernels have none)."""
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(),
                           label_smoothing=0.1)


def class_split_ops(loss_fn=None) -> dict[str, frozenset[str]]:
    """Op target -> the labels it may split with all-reduced statistics, for the tiny
    GPT under ``loss_fn``."""
    x, y = data()
    an = analyze(capture(make("gpt"), (x,), loss_fn=loss_fn, example_targets=y))
    return {an.graph.node(name).target.split(".")[1]: rule.allreduced
            for name, rule in an.rules.items() if rule.allreduced}


def test_which_losses_split_their_classes() -> None:
    assert class_split_ops() == {"cross_entropy_loss": frozenset({"c"})}
    assert class_split_ops(nll_of_log_softmax) == {"log_softmax": frozenset({"d1"}),
                                                  "nll_loss_nd": frozenset({"c"})}
    assert class_split_ops(reread_log_softmax) == {}
    assert class_split_ops(smoothed) == {}


def test_the_statistics_are_three_all_reduces_of_a_float_per_row() -> None:
    """Cross-entropy on 2 x 2,048 tokens x 50,257 classes split over tp=8 (GPT-2
    small on the A100 profile): 3 all-reduces of 4,096 floats, nothing else added."""
    model, x = zoo.get("gpt2-small", batch_size=2, seq_len=2048)
    an = analyze(capture(model, x))
    cluster = autopar.Cluster("a100-80g", 1, 8)
    pricer = StrategyPricer(an, Settings(Mesh(("dp", "tp"), (1, 8)), 2, 1, 0, "bf16", "adamw",
                                         80e9, cluster.hardware(), 8))
    loss = an.graph.node(an.graph.loss)
    split = [s for s in pricer.space.strategies(loss) if s.labels[1] == "c"]
    whole = [s for s in pricer.space.strategies(loss) if s.labels[1] is None]
    assert len(split) == 1 and len(whole) == 1 and split[0].out == ("R", "R")
    want = 3 * collective_time("all_reduce", 4.0 * 2 * 2048, 8, pricer.links[1])
    assert pricer.statistics_comm(loss, split[0]) == pytest.approx(want, rel=1e-12)
    assert pricer.statistics_comm(loss, whole[0]) == 0.0
    op_split, op_whole = (pricer.op_terms(loss, s[0]) for s in (split, whole))
    assert op_split.activations == pytest.approx(op_whole.activations / 8)
    assert op_split.backward_start_bytes == pytest.approx(op_whole.backward_start_bytes / 8)


def test_the_planner_splits_llama_3_8b_logits_by_itself() -> None:
    model, x = zoo.get("llama3-8b", batch_size=8, seq_len=8192)
    model.layers = model.layers[:4]
    cluster = autopar.Cluster("h100-sxm", 1, 8)
    chosen = autopar.plan(model, x, cluster=cluster, tp=8, global_batch=8)
    assert chosen.loss_parallel and chosen.modules["output"].output_layout == "S(2)"
    whole = autopar.plan(model, x, cluster=cluster, tp=8, global_batch=8, loss_parallel=False)
    assert not whole.loss_parallel and whole.modules["output"].output_layout == "R"
    # the logits (8 x 8,192 x 128,256), their fp32 copy and gradient, 1/8 of them per rank
    assert whole.memory_per_device_bytes - chosen.memory_per_device_bytes > 8 * GIB
    assert chosen.step_time_s <= whole.step_time_s


def test_torchtitans_70b_configuration_fits_as_measured() -> None:
    """torchtitan's Llama 3 70B on 256 H100 (dp32 x tp8 with sequence parallelism, FSDP,
    full recomputation, local batch 16 x 8,192) ran in 71.9 GiB (benchmarks/
    reference_configs.json); without loss parallelism no layout of it fit in 80 GB."""
    model, x = zoo.get("llama3-70b", batch_size=16, seq_len=8192)
    plan = autopar.estimate(model, x, autopar.Spec(dp=32, tp=8, zero=3, sequence_parallel=True,
                                                   recompute="full", microbatch_size=16),
                            cluster=autopar.Cluster("h100-sxm", 32, 8), global_batch=512)
    assert plan.loss_parallel
    assert plan.memory_per_device_bytes / GIB == pytest.approx(71.9, rel=0.10)


def test_a_plan_without_tp_cannot_split_the_loss() -> None:
    x, _ = data()
    plan = autopar.plan(make("gpt"), (x,), cluster=autopar.Cluster("h100-sxm", 1, 2), dp=2)
    plan.loss_parallel = True
    with pytest.raises(autopar.PlanFormatError, match="loss_parallel is true, but the plan "
                       "has no tp axis to split the logits' classes over"):
        autopar.Plan.from_json(plan.to_json())


@contextlib.contextmanager
def counting_class_split_kernels() -> Iterator[dict[str, int]]:
    """Count the calls of torch's class-split log-softmax kernel in this process while
    inside; the kernel table is restored after."""
    import torch.distributed.tensor.parallel.loss as torch_loss
    op = torch.ops.aten._log_softmax.default
    counts = {"log_softmax": 0}
    inner = torch_loss.customized_loss_ops[op]

    def counting(*args):
        counts["log_softmax"] += 1
        return inner(*args)
    torch_loss.customized_loss_ops[op] = counting
    try:
        yield counts
    finally:
        torch_loss.customized_loss_ops[op] = inner


def hf_llama() -> torch.nn.Module:
    from tests.test_hf_models import make as make_hf
    return make_hf("llama")


CASES = [  # (model, loss, forced space) on 4 ranks
    ("gpt", None, {"dp": 1, "tp": 4, "sequence_parallel": True}),
    ("llama", None, {"dp": 2, "tp": 2, "zero": 3}),
    ("gpt", None, {"pp": 2, "dp": 1, "tp": 2}),
    ("llama", nll_of_log_softmax, {"dp": 2, "tp": 2, "sequence_parallel": True}),
    ("hf-llama", None, {"dp": 2, "tp": 2}),
    ("nano", lm_loss, {"dp": 1, "tp": 4}),  # the tied head as F.linear in the root
]


def _model(kind: str) -> torch.nn.Module:
    if kind == "nano":
        torch.manual_seed(0)
        return NanoGPT()
    return hf_llama() if kind == "hf-llama" else make(kind)


def train_cases(cases: list) -> list[tuple[list[float], bool, int]]:
    """Each case's SGD losses through ``pm.step``, whether its plan split the loss, and
    how many class-split log-softmaxes ran on this rank."""
    out = []
    with counting_class_split_kernels() as counts:
        for kind, loss_fn, space in cases:
            before = counts["log_softmax"]
            x, y = data()
            pm = autopar.parallelize(_model(kind), (x,), precision="fp32", loss_fn=loss_fn,
                                     loss_parallel=True, **space)
            losses = sgd_losses(pm.parameters(), lambda: pm.step(x, y), STEPS, LR)
            out.append((losses, pm.plan.loss_parallel, counts["log_softmax"] - before))
    return out


def user_loop() -> list[float]:
    """The user's own loop on ``pm(x)`` (gathered logits) under a loss-parallel plan."""
    x, y = data()
    pm = autopar.parallelize(make("gpt"), (x,), precision="fp32", dp=1, tp=4,
                             loss_parallel=True)
    assert pm.plan.loss_parallel

    def step() -> torch.Tensor:
        loss = F.cross_entropy(pm(x).flatten(0, -2), y.flatten())
        loss.backward()
        return loss.detach()
    return sgd_losses(pm.parameters(), step, STEPS, LR)


def reference(kind: str, loss_fn=None) -> list[float]:
    model = _model(kind)
    x, y = data()
    if loss_fn is None:
        return sgd_losses(model.parameters(), reference_step(model, x, y), STEPS, LR)

    def step() -> torch.Tensor:
        loss = loss_fn(model(x), y)
        loss.backward()
        return loss.detach()
    return sgd_losses(model.parameters(), step, STEPS, LR)


@pytest.mark.multirank
def test_training_on_class_split_logits_equals_one_process(rank_pool: RankPool) -> None:
    got = rank_pool.run(4, train_cases, CASES, timeout_s=600)
    for (kind, loss_fn, space), (losses, split, kernels) in zip(CASES, got[0]):
        assert split, (kind, space)
        assert losses == pytest.approx(reference(kind, loss_fn), abs=1e-5), (kind, space)
    for rank in got:  # every rank holding the loss ran the class-split kernel each step
        assert [k for _, _, k in rank][:2] + [r[2] for r in rank[3:]] == [STEPS] * 5
    pp = sorted(r[2][2] for r in got)  # pp: the last stage's ranks, once per micro-batch
    assert pp[:2] == [0, 0] and pp[2] == pp[3] >= STEPS


@pytest.mark.multirank
def test_the_users_own_loop_gets_whole_logits(rank_pool: RankPool) -> None:
    got = rank_pool.run(4, user_loop, timeout_s=300)[0]
    assert got == pytest.approx(reference("gpt"), abs=1e-5)


def test_emitted_programs_split_the_loss() -> None:
    """The programs of a loss-parallel plan keep the logits split (the last stage's only,
    in a pipeline) and run forward, loss and backward in ``class_parallel_loss``; that
    they train as apply_plan does is checked with the other programs (test_codegen's and
    test_codegen_pipeline's loss-parallel cases)."""
    from autopar.runtime.codegen import emit_program, model_facts
    from tests.handmade_plans import megatron_plan, pipeline_plan

    model = model_facts(f"{MODELS}:tiny_gpt").model
    plain = emit_program(megatron_plan(model, dp=2, tp=2, loss_parallel=True),
                         f"{MODELS}:tiny_gpt")
    assert "distribute_io(model, tp_mesh, gather=False)" in plain
    assert "with plain_as_replicated(), class_parallel_loss():" in plain
    assert "loss = gather_output(loss_fn(output, targets[part])) / NUM_MICROBATCHES" in plain
    piped = emit_program(pipeline_plan(model, pp=2, tp=2, loss_parallel=True),
                         f"{MODELS}:tiny_gpt")
    assert "distribute_io(model, tp_mesh, gather=not last)  # the last stage" in piped
    assert 'apply_tp(stage, mesh["tp"], index == len(graphs) - 1)' in piped
    assert "loss_fn=whole_loss" in piped
    assert "return gather_output(loss_fn(output, targets))" in piped
    whole = emit_program(megatron_plan(model, dp=2, tp=2), f"{MODELS}:tiny_gpt")
    assert "class_parallel_loss()" not in whole and "distribute_io(model, tp_mesh)" in whole
