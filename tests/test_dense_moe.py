"""A dense-dispatch mixture of experts (examples/dense_moe.py: every expert on every token,
its weights stacked, a top-k gate combining them) is found as a *gathered* expert
module, priced under expert parallelism as Megatron-Core's all-gather token dispatcher
(tokens all-gathered over ep, the gate exchanged, the output reduce-scattered; each
rank the GEMMs of its E/ep experts over the group's tokens), and trains as in one
process under ep2, ep4, ep2 x tp2 and pp2 x ep2 (fp32, 4 gloo ranks), in the runtime
and in the emitted program, whose checkpoints (the runtime's too) hold the experts
whole."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor

import autopar
from autopar import Spec
from autopar.cost_models.comm import collective_time
from autopar.demo import reference_step, sgd_losses
from autopar.examples.dense_moe import DenseMoEConfig, DenseMoETransformer
from tests.codegen_models import DENSE_MOE_CONFIG as CONFIG
from tests.dist_utils import RankPool

STEPS, LR = 3, 0.1
EXPERT_MODULES = ["layers.0.ffn.experts", "layers.1.ffn.experts"]
CASES = {"ep2": {"dp": 4, "ep": 2, "zero": 3}, "ep4": {"dp": 4, "ep": 4},
         "ep2 x tp2": {"dp": 2, "ep": 2, "tp": 2}, "pp2 x ep2": {"pp": 2, "dp": 2, "ep": 2}}


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and next-token targets, 8 sequences of 16."""
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, CONFIG.vocab_size, (8, 16), generator=g)
    return x, torch.randint(0, CONFIG.vocab_size, (8, 16), generator=g)


def whole_grads(named: list[tuple[str, torch.nn.Parameter]]) -> dict[str, torch.Tensor]:
    """Each parameter's whole gradient by its name in the model (collective over the
    meshes of the DTensor ones)."""
    return {name.removeprefix("module."): (p.grad.full_tensor() if isinstance(p.grad, DTensor)
                                           else p.grad).detach().clone()
            for name, p in named}


def train(step, named, grads: dict[str, torch.Tensor]) -> list[float]:
    """The losses of :data:`STEPS` SGD steps of ``step``; the first step's gradients of
    the parameters ``named()`` lists go into ``grads``."""
    def first() -> torch.Tensor:
        loss = step()
        if not grads:
            grads.update(whole_grads(named()))
        return loss

    return sgd_losses([p for _, p in named()], first, STEPS, LR)


def single_process() -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses and first gradients in one process."""
    torch.manual_seed(0)
    model = DenseMoETransformer(CONFIG)
    grads: dict[str, torch.Tensor] = {}
    return train(reference_step(model, *batch()), lambda: list(model.named_parameters()),
                 grads), grads


def parallel(space: dict) -> tuple[list[float], dict[str, torch.Tensor], dict]:
    """Losses, first gradients (this rank's stages') and what the plan split, under
    ``space``."""
    x, y = batch()
    torch.manual_seed(0)
    pm = autopar.parallelize(DenseMoETransformer(CONFIG), (x,), example_targets=y,
                             precision="fp32", **space)
    stages = pm.module if isinstance(pm.module, torch.nn.ModuleList) else [pm]
    grads: dict[str, torch.Tensor] = {}
    losses = train(lambda: pm.step(x, y),
                   lambda: [np for stage in stages for np in stage.named_parameters()], grads)
    kinds = {path: xp.kind for path, xp in pm.plan.experts.items()}
    return losses, grads, dict(pm.plan.mesh) | {"experts": kinds}


def test_the_experts_are_a_gathered_expert_module():
    """Each block's DenseExperts reads the tokens without an expert dim (entry -1) and
    the gate with it (dim 1), and its output op sums the experts."""
    from autopar.capture import capture
    from autopar.strategies.analysis import analyze

    with torch.device("meta"):
        model = DenseMoETransformer(CONFIG)
    an = analyze(capture(model, (torch.randint(0, 64, (8, 16), device="meta"),)))
    assert sorted(an.experts) == EXPERT_MODULES
    for path, em in an.experts.items():
        assert (em.kind, sorted(em.entries.values()), em.out_dim, em.experts) == \
            ("gathered", [-1, 1], -1, 4), em
        assert em.params == {f"{path}.w_in": 0, f"{path}.w_out": 0}
        assert an.graph.node(em.output).target == "aten.einsum.default"


def test_expert_parallelism_is_priced_as_the_all_gather_dispatcher(monkeypatch):
    """dp4 x ep2 against dp4 on 4 H100: the token exchange per step is, per block and
    micro-batch, the tokens' all-gather and their gradient's reduce-scatter, the gate's
    all-to-all both ways and the output's reduce-scatter and its gradient's all-gather
    over the 2 ranks of ep, each of a data-parallel pair's share of the tokens; each
    expert GEMM is priced on this rank's 2 of the 4 experts and the ep group's tokens,
    the FLOPs of dp4's; the experts' weights take half the bytes."""
    import autopar.cost_models.strategy_price as pricing

    gemms: dict[str, set] = {}
    priced = pricing.op_time

    def spy(shapes, flops, nbytes, **kw):
        if shapes.target == "aten.einsum.default" and len(shapes.inputs[1]) == 3:
            gemms.setdefault(current, set()).add((shapes.inputs, flops, kw["backward"]))
        return priced(shapes, flops, nbytes, **kw)

    monkeypatch.setattr(pricing, "op_time", spy)
    with torch.device("meta"):
        model = DenseMoETransformer(CONFIG)
    x = torch.randint(0, 64, (8, 16), device="meta")
    cluster = autopar.Cluster("h100-sxm", 1, 4)
    plans = {}
    for current, ep in (("ep2", {"ep": 2}), ("dp4", {})):
        plans[current] = autopar.estimate(model, (x,), Spec(dp=4, microbatch_size=2, **ep),
                                          cluster=cluster, precision="fp32", optimizer="sgd")
    ep2, dp = plans["ep2"], plans["dp4"]
    assert {xp.kind for xp in ep2.experts.values()} == {"gathered"} and not dp.experts
    link = cluster.hardware().intra_node
    tokens = 8 * 16 * CONFIG.dim * 4 / 2      # fp32 (tokens, dim) of the dp pair's ep group
    gate = 8 * 16 * CONFIG.n_experts * 4 / 2  # fp32 (tokens, experts)
    block = 2 * collective_time("all_gather", tokens, 2, link) + \
        2 * collective_time("reduce_scatter", tokens, 2, link) + \
        2 * collective_time("all_to_all", gate / 2, 2, link)
    assert ep2.breakdown["all_to_all_s"] == pytest.approx(CONFIG.n_layers * block, rel=1e-9)
    d, f, e = CONFIG.dim, CONFIG.expert_ffn_dim, CONFIG.n_experts
    # the first GEMM, einsum("th,ehf->etf"): 128 tokens a micro-batch, 64 an ep group's
    first = {(ins, backward): flops for ins, flops, backward in gemms["ep2"]
             if len(ins[0]) == 2}
    assert sorted(first) == [(((64, d), (e // 2, d, f)), False), (((64, d), (e // 2, d, f)), True)]
    alike = {(ins, backward): flops for ins, flops, backward in gemms["dp4"]
             if len(ins[0]) == 2}
    assert sorted(alike) == [(((32, d), (e, d, f)), False), (((32, d), (e, d, f)), True)]
    assert sorted(first.values()) == sorted(alike.values())
    expert_bytes = CONFIG.n_layers * 2 * CONFIG.n_experts * CONFIG.dim * \
        CONFIG.expert_ffn_dim * 4
    assert dp.memory["params"] - ep2.memory["params"] == pytest.approx(expert_bytes / 2)


def test_asking_for_ep_splits_the_gathered_experts():
    """plan(ep=2) splits both blocks' experts by all-gather dispatch; the plan's JSON
    keeps how."""
    x, y = batch()
    plan = autopar.plan(DenseMoETransformer(CONFIG), (x,), example_targets=y,
                        cluster=autopar.Cluster("cpu", 1, 4), precision="fp32",
                        optimizer="sgd", dp=4, ep=2)
    assert plan.degree("ep") == 2 and sorted(plan.experts) == EXPERT_MODULES
    for path, xp in plan.experts.items():
        assert (xp.kind, xp.experts, xp.input_dim, xp.output_dim, xp.batch_dim, xp.params) \
            == ("gathered", 4, 1, -1, 0, {"w_in": 0, "w_out": 0})
        assert plan.params[f"{path}.w_in"][list(plan.mesh).index("ep")] == "S(0)"
    again = autopar.Plan.from_json(plan.to_json())
    assert again.experts == plan.experts


def test_the_search_splits_large_experts_where_it_pays():
    """Large experts (8 x 4096 x 14336, two weights, two blocks: 1.9 G parameters) on 8
    H100: the free search chooses expert parallelism with all-gather dispatch (dp2 x
    ep4 when written: 27.7 ms a step, its parameter traffic 5 ms against 28 ms), faster
    than its best plan without it (dp8, 31.7 ms)."""
    cfg = DenseMoEConfig(vocab_size=4096, max_seq_len=1024, dim=4096, n_layers=2,
                         n_heads=32, n_kv_heads=8, ffn_dim=1024, n_experts=8, top_k=2,
                         expert_ffn_dim=14336)
    with torch.device("meta"):
        model = DenseMoETransformer(cfg)
    x = torch.randint(0, 4096, (8, 1024), device="meta")
    common = dict(cluster=autopar.Cluster("h100-sxm", 1, 8), global_batch=8)
    free = autopar.plan(model, (x,), **common)
    assert free.degree("ep") > 1, free.summary()
    assert {xp.kind for xp in free.experts.values()} == {"gathered"}
    without = autopar.plan(model, (x,), ep=1, **common)
    assert free.step_time_s < 0.95 * without.step_time_s
    assert free.breakdown["param_comm_s"] < without.breakdown["param_comm_s"] / 2


@pytest.fixture(scope="module")
def reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    """The single-process losses and first gradients."""
    return single_process()


@pytest.mark.multirank
@pytest.mark.parametrize("name", list(CASES))
def test_dense_moe_trains_as_in_one_process(rank_pool: RankPool, reference, name: str) -> None:
    """Losses of 3 SGD steps and every parameter's first gradient equal one process's,
    the experts split by all-gather dispatch over the ep asked for."""
    space = CASES[name]
    losses, grads = reference
    results = rank_pool.run(4, parallel, space, timeout_s=300)
    seen: set[str] = set()
    for got, got_grads, mesh in results:
        assert got == pytest.approx(losses, abs=1e-5), (name, mesh)
        assert mesh["ep"] == space["ep"] and mesh.get("tp", 1) == space.get("tp", 1), mesh
        assert mesh["experts"] == dict.fromkeys(EXPERT_MODULES, "gathered"), mesh
        for n, g in got_grads.items():
            torch.testing.assert_close(g, grads[n], atol=1e-5, rtol=1e-4, msg=n)
        seen |= set(got_grads)
    assert seen == set(grads)


@pytest.mark.multirank
def test_emitted_program_trains_and_resumes_without_ep(tmp_path):
    """The program for dp2 x ep2 (ZeRO-3) trains 2 steps as one process does and saves
    its checkpoint, the experts' weights whole; the program for plain dp2 loads it and
    takes the third step (2 gloo processes each)."""
    from tests.test_codegen import save_then_resume

    losses, plans = save_then_resume(tmp_path, "tiny_dense_moe", batch(), LR)
    assert [{xp.kind for xp in p.experts.values()} for p in plans] == [{"gathered"}, set()]
    assert losses == pytest.approx(single_process()[0], abs=1e-5)


@pytest.mark.parametrize("space", [{"pp": 2, "dp": 2, "ep": 2}, {"dp": 2, "ep": 2, "tp": 2}],
                         ids=["pp2 x ep2", "ep2 x tp2"])
def test_emitted_programs_with_pipelines_and_tensor_parallelism_are_clean(tmp_path, space):
    """The programs for pp2 x ep2 and ep2 x tp2 list both expert modules as gathered
    (output expert dim -1) and pass pyflakes. (Each ran under torchrun on 4 gloo
    processes with the single-process losses when written: 50 to 75 s apiece here,
    which the runtime test above covers in-process.)"""
    from autopar.runtime.codegen import emit_program
    from tests.test_codegen import MODELS, pyflakes

    x, y = batch()
    plan = autopar.plan(DenseMoETransformer(CONFIG), (x,), example_targets=y,
                        cluster=autopar.Cluster("cpu", 1, 4), precision="fp32",
                        optimizer="sgd", **space)
    program = tmp_path / "train.py"
    program.write_text(emit_program(plan, f"{MODELS}:tiny_dense_moe"))
    text = program.read_text()
    for path in EXPERT_MODULES:
        assert f"\"{path}\": (0, 1, -1, {{'w_in': 0, 'w_out': 0}}, 1, False)," in text
    assert pyflakes(program) == ""


def test_experts_whose_tokens_look_like_the_gate_are_refused_with_the_reason():
    """With 4 experts on tokens of width 4 the lowering could not tell the gate (T, 4)
    from the tokens (T, 4): ep is refused saying so, and the model still plans without."""
    from autopar.errors import ConfigError

    cfg = DenseMoEConfig(vocab_size=64, max_seq_len=16, dim=4, n_layers=1, n_heads=1,
                         n_kv_heads=1, ffn_dim=8, n_experts=4, top_k=2, expert_ffn_dim=8)
    with torch.device("meta"):
        model = DenseMoETransformer(cfg)
    x = torch.randint(0, 64, (8, 16), device="meta")
    cluster = autopar.Cluster("cpu", 1, 4)
    with pytest.raises(ConfigError) as err:
        autopar.plan(model, (x,), cluster=cluster, ep=2)
    assert str(err.value) == (
        "ep=2: 'layers.0.ffn.experts' runs every expert on every token, a gate combining "
        "them, but its tokens hold 4 elements along dim 1, as many as the gate has experts "
        "there, which is how the lowering tells the gate from the tokens; expert "
        "parallelism cannot split it so. Change that, or leave ep out: data, tensor and "
        "pipeline parallelism still split it")
    assert not autopar.plan(model, (x,), cluster=cluster).experts


def save_then_load(path: str) -> list[float]:
    """One SGD step under ep2 (ZeRO-3), saved with the runtime's checkpoints, loaded
    under ep4 for two more: the three losses."""
    from autopar.runtime.checkpoint import load, save

    x, y = batch()
    losses = []
    for k, space in enumerate(({"dp": 4, "ep": 2, "zero": 3}, {"dp": 4, "ep": 4})):
        torch.manual_seed(k)  # the second model's own weights are overwritten by load
        pm = autopar.parallelize(DenseMoETransformer(CONFIG), (x,), example_targets=y,
                                 precision="fp32", **space)
        opt = torch.optim.SGD(pm.parameters(), lr=LR)
        if k:
            load(path, pm, opt)
        for _ in range(STEPS - 1 if k else 1):
            losses.append(float(pm.step(x, y)))
            opt.step()
            opt.zero_grad()
        if not k:
            save(path, pm, opt, step=1)
    return losses


@pytest.mark.multirank
def test_runtime_checkpoint_holds_the_experts_whole(rank_pool: RankPool, reference, tmp_path):
    """A checkpoint saved under ep2 holds every expert once, as the single process has
    them after the same step, and loads under ep4 to train on as one process does."""
    from autopar.runtime.checkpoint import to_torch_file

    folder = str(tmp_path / "ckpt")
    for got in rank_pool.run(4, save_then_load, folder, timeout_s=300):
        assert got == pytest.approx(reference[0], abs=1e-5)
    to_torch_file(folder, tmp_path / "whole.pt")
    state = torch.load(tmp_path / "whole.pt")
    torch.manual_seed(0)
    model = DenseMoETransformer(CONFIG)
    sgd_losses(model.parameters(), reference_step(model, *batch()), 1, LR)
    for path in EXPERT_MODULES:
        for name in ("w_in", "w_out"):
            torch.testing.assert_close(state[f"{path}.{name}"], getattr(
                model.get_submodule(path), name).detach(), atol=1e-6, rtol=1e-5)


class AddedInPlace(DenseMoETransformer):
    """The dense MoE with the tokens added to the experts' output in place (``out +=
    tokens``), as residual MoE code writes it."""

    def block(self, cfg: DenseMoEConfig, index: int) -> torch.nn.Module:
        """A block whose feed-forward adds in place to the experts' output."""
        from autopar.examples.dense_moe import Block, DenseMoE

        class Residual(DenseMoE):
            def forward(self, x: torch.Tensor) -> torch.Tensor:
                b, s, d = x.shape
                tokens = x.reshape(b * s, d)
                scores = self.router(tokens).softmax(-1)
                weights, chosen = scores.topk(self.top_k, dim=-1)
                gate = torch.zeros_like(scores).scatter(-1, chosen, weights)
                out = self.experts(tokens, gate)
                out += tokens
                return out.view(b, s, d)

        return Block(cfg, Residual(cfg))


def added_in_place() -> list[float]:
    """Losses of :class:`AddedInPlace` under dp4 x ep2 with ZeRO-3."""
    x, y = batch()
    torch.manual_seed(0)
    pm = autopar.parallelize(AddedInPlace(CONFIG), (x,), example_targets=y,
                             precision="fp32", dp=4, ep=2, zero=3)
    assert {xp.kind for xp in pm.plan.experts.values()} == {"gathered"}
    return sgd_losses(pm.parameters(), lambda: pm.step(x, y), STEPS, LR)


@pytest.mark.multirank
def test_the_experts_output_may_be_modified_in_place(rank_pool: RankPool) -> None:
    """The reduce-scattered output is the caller's own tensor, not a view of the
    redistribution's (which autograd forbids modifying in place): a model adding to it
    in place trains as in one process."""
    torch.manual_seed(0)
    model = AddedInPlace(CONFIG)
    ref = sgd_losses(model.parameters(), reference_step(model, *batch()), STEPS, LR)
    for got in rank_pool.run(4, added_in_place, timeout_s=300):
        assert got == pytest.approx(ref, abs=1e-5)
