"""Routed experts folded over tensor parallelism (Megatron-Core's MoE parallel folding,
expert tensor parallelism 1): the experts split over the ``ep`` and ``tp`` ranks
together, whole on each rank, each tp rank routing its own rows of the tokens
(:attr:`autopar.plans.ExpertPlan.folded`). Asked for with ``expert_tp=1`` or chosen by
the planner where it pays; trained as in one process (Hugging Face's Mixtral, Qwen2-MoE
and DeepSeek-V3, fp32, gloo; 4 ranks, and 8 with a pipeline); checkpointed whole, so
another plan resumes it; the emitted program trains as one process does."""

from __future__ import annotations

import inspect

import pytest
import torch

from autopar.demo import reference_step, sgd_losses
from autopar.errors import ConfigError
from tests.dist_utils import RankPool
from tests.test_expert_legs import batch, mixtral
from tests.test_moe_models import experts_held

pytest.importorskip("transformers")

STEPS, LR = 3, 0.1
FOLD = {"tp": 2, "expert_tp": 1, "sequence_parallel": True}


def _model(kind: str) -> torch.nn.Module:
    """Mixtral with 8 experts, or a test_hf_experts model (4 experts)."""
    from tests.test_hf_experts import make

    return mixtral() if kind == "mixtral" else make(kind)[0]


def _train(cases: list[tuple[str, dict, int]]) -> list[tuple[list[float], list[int], bool]]:
    """Each (model, space, ep ranks per node) trained on this group's ranks: the losses,
    the experts a rank holds, and whether the plan folds them."""
    import autopar

    out = []
    for kind, space, per_node in cases:
        x, y = batch()
        model = _model(kind)
        ranks = space.get("pp", 1) * space["dp"] * space["tp"]
        nodes = 2 if per_node > 1 else 1
        plan = autopar.plan(model, (x,), example_targets=y, precision="fp32",
                            cluster=autopar.Cluster("cpu", nodes, ranks // nodes), **space)
        for xp in plan.experts.values():
            xp.node_ranks = per_node
        pm = autopar.parallelize(model, plan=plan)
        held = experts_held(pm, "gate_up_proj")
        out.append((sgd_losses(pm.parameters(), lambda: pm.step(x, y), STEPS, LR), held,
                    pm.plan.fold_experts))
    return out


CASES = {4: [("mixtral", {"dp": 2, "ep": 4, **FOLD}, 2),  # two legs over 2 nodes of 2
             ("qwen2moe", {"dp": 2, "ep": 4, "tp": 2, "expert_tp": 1, "zero": 3}, 1),
             ("deepseek_v3", {"dp": 2, "ep": 4, "microbatch_size": 1, **FOLD}, 1)],
         8: [("mixtral", {"pp": 2, "dp": 2, "ep": 4, **FOLD}, 1)]}


@pytest.mark.multirank
@pytest.mark.parametrize("ranks", [4, 8], ids=["4 ranks", "pp2 x dp2 x tp2"])
def test_folded_experts_train_as_in_one_process(rank_pool: RankPool, ranks: int) -> None:
    cases = CASES[ranks]
    got = rank_pool.run(ranks, _train, cases, timeout_s=900)[0]
    for (kind, space, per_node), (losses, held, folded) in zip(cases, got):
        x, y = batch()
        model = _model(kind)
        ref = sgd_losses(model.parameters(), reference_step(model, x, y), STEPS, LR)
        assert losses == pytest.approx(ref, abs=1e-5), (kind, space, per_node)
        experts = 8 if kind == "mixtral" else 4
        assert folded and held == [experts // space["ep"]], (kind, space, held)


def _save_then_resume(folder: str) -> list[float]:
    """On each of 4 ranks: 2 AdamW steps of Mixtral with its experts folded over tp
    (dp2 x tp2, ep 4), saved; then a fresh Mixtral under dp4 x ep2 (experts over dp
    alone) loads it and takes a third step: the three losses."""
    import autopar

    x, y = batch()
    losses = []
    for space, steps in (({"dp": 2, "ep": 4, **FOLD}, 2), ({"dp": 4, "ep": 2}, 1)):
        pm = autopar.parallelize(mixtral(), (x,), precision="fp32", **space)
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
        if steps == 1:
            assert autopar.load(folder, pm, opt).step == 2
        for _ in range(steps):
            losses.append(float(pm.step(x, y)))
            opt.step()
            opt.zero_grad()
        if steps == 2:
            assert pm.plan.fold_experts
            autopar.save(folder, pm, opt, step=2)
    return losses


@pytest.mark.multirank
def test_a_folded_checkpoint_resumes_with_experts_over_dp(rank_pool: RankPool,
                                                         tmp_path) -> None:
    """The folded experts are checkpointed whole: saved under ep 4 over dp2 x tp2 (one
    exchange), loaded under ep 2 over dp4, the three AdamW steps' losses are one
    process's."""
    got = rank_pool.run(4, _save_then_resume, str(tmp_path / "ckpt"), timeout_s=600)[0]
    x, y = batch()
    model = mixtral()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step, ref = reference_step(model, x, y), []
    for _ in range(3):
        ref.append(float(step()))
        opt.step()
        opt.zero_grad()
    assert got == pytest.approx(ref, abs=1e-5)


def test_folded_plan_holds_whole_experts_and_exchanges_over_ep_x_tp() -> None:
    """Folded, each rank holds half the expert weights it holds with the experts
    replicated over tp (ep2 of dp, tp2), and the plan and its summary say so; the
    solver's choice between folding and not is the faster of the two estimates."""
    import autopar
    from autopar.plans import Plan

    model, (x, y) = mixtral(), batch()
    kw = dict(example_targets=y, precision="bf16", sequence_parallel=True)
    four = autopar.Cluster("h100-sxm", 1, 4)
    folded = autopar.plan(model, (x,), cluster=four, dp=2, tp=2, ep=4, expert_tp=1, **kw)
    whole = autopar.plan(model, (x,), cluster=four, dp=2, tp=2, ep=2, expert_tp=2, **kw)
    assert folded.fold_experts and folded.expert_ranks == 4 and folded.degree("ep") == 2
    assert not whole.fold_experts and whole.expert_ranks == 2
    name = "model.layers.0.mlp.experts.gate_up_proj"
    assert folded.params[name] == ["R", "S(0)", "S(0)"] and whole.params[name][1] == "S(0)"
    assert Plan.from_json(folded.to_json()).experts == folded.experts
    assert "experts split over ep x tp = 4 ranks, whole experts on each (folded)" in \
        folded.summary()
    eight = autopar.Cluster("h100-sxm", 1, 8)
    fixed = dict(dp=4, tp=2, ep=4, sequence_parallel=True, zero=0, microbatch_size=2,
                 offload=False, compile=False)  # what estimate fills in
    steps = {e: autopar.estimate(model, (x,), autopar.Spec(expert_tp=e, **fixed),
                                 cluster=eight, example_targets=y,
                                 precision="bf16").step_time_s for e in (1, 2)}
    chosen = autopar.plan(model, (x,), cluster=eight, example_targets=y, precision="bf16",
                          **fixed)
    assert chosen.step_time_s == pytest.approx(min(steps.values()), rel=1e-9)
    assert chosen.fold_experts == (steps[1] < steps[2])


def test_expert_tp_is_checked() -> None:
    """An expert_tp other than 1 or tp, a folded ep that tp does not divide, and
    expert_tp=1 on a model without routed experts are refused, each saying why."""
    import autopar
    from tests.test_batch_flow import hf

    with pytest.raises(ConfigError, match=r"expert_tp=3 with tp=2: the experts are split like "
                                          r"the rest of the model \(expert_tp=2\) or held whole"):
        autopar.Spec(tp=2, expert_tp=3)
    with pytest.raises(ConfigError, match=r"ep=2 with expert_tp=1 and tp=2: folded experts "
                                          r"take their ep ranks from dp x tp"):
        autopar.Spec(tp=2, ep=2, expert_tp=1)
    x, y = batch()
    with pytest.raises(ConfigError, match=r"expert_tp=1 folds routed experts .* but the model "
                                          r"has no expert modules; leave expert_tp out"):
        autopar.plan(hf("opt"), (x,), example_targets=y, cluster=autopar.Cluster("cpu", 1, 4),
                     tp=2, expert_tp=1)


def test_emitted_program_runs_folded_experts(tmp_path) -> None:
    """The program for a folded plan passes pyflakes and trains as one process does (4
    gloo processes, 2 SGD steps)."""
    import autopar
    from autopar.runtime.codegen import emit_program
    from tests.test_codegen import printed_losses, pyflakes, torchrun_outputs

    factory = tmp_path / "models.py"
    factory.write_text("import torch\n\n\n" + inspect.getsource(mixtral))
    x, y = batch()
    data = tmp_path / "batch.pt"
    torch.save({"inputs": x, "targets": y}, data)
    plan = autopar.plan(mixtral(), (x,), example_targets=y, precision="fp32", optimizer="sgd",
                        cluster=autopar.Cluster("cpu", 1, 4), dp=2, tp=2, ep=4, expert_tp=1,
                        sequence_parallel=True)
    assert plan.fold_experts
    program = tmp_path / "folded.py"
    program.write_text(emit_program(plan, f"{factory}:mixtral"))
    assert pyflakes(program) == ""
    [out] = torchrun_outputs([(program, ["--steps", "2", "--optimizer", "sgd", "--lr", str(LR),
                                         "--data", str(data)])], tmp_path / "runs")
    model = mixtral()
    ref = sgd_losses(model.parameters(), reference_step(model, x, y), 2, LR)
    assert printed_losses(out) == pytest.approx(ref, abs=1e-5)


def test_a_pipelined_program_is_cut_for_the_plans_inputs(tmp_path) -> None:
    """A pipelined folded plan made for sequences of 16 tokens, of a factory whose own
    example holds 1,024: the program exports its stages for the plan's 16 (it cut
    them for the factory's 1,024 and failed in the rotary embedding on 8 gloo ranks)."""
    import autopar
    from autopar.runtime.codegen import emit_program
    from tests.test_codegen import pyflakes

    factory = tmp_path / "models.py"
    factory.write_text("import torch\n\n\n" + inspect.getsource(mixtral))
    x, y = batch()
    plan = autopar.plan(mixtral(), (x,), example_targets=y, precision="fp32",
                        cluster=autopar.Cluster("cpu", 1, 8), pp=2, dp=2, ep=4, **FOLD)
    assert plan.fold_experts and plan.inputs[0]["shape"] == [8, 16]
    program = tmp_path / "pipelined.py"
    program.write_text(emit_program(plan, f"{factory}:mixtral"))
    text = program.read_text()
    assert "\nINPUT_SHAPE = (16,)  #" in text
    assert 'shard_experts(stage, build_expert_mesh(device_type), None)' in text
    assert pyflakes(program) == ""
