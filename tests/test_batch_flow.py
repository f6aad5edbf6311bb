"""Models written by others plan for data parallelism (issue 18, item 8): PyTorch's
``nn.TransformerEncoder`` (batch-first or sequence-first), Hugging Face OPT, Falcon,
Mixtral and Qwen2-MoE, a Llama whose GQA uses ``repeat_interleave`` (which also gets
per-kv-head tensor-parallel strategies), a model with an operator autopar has no
rule for, T5's attention bias broadcast along the batch (issue 40, item 4) and LLaVA's
image tokens, listed per sample, counted over the batch and scattered (issue 40, item
5). Their
2-rank data-parallel training equals a single process; a true batch statistic, or a
replicated tensor lined up with the batch, still refuses with a clear message."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autopar
from autopar.capture import capture
from autopar.demo import reference_step, sgd_losses
from autopar.errors import UnsupportedOpError
from autopar.sharding import Mesh
from autopar.solvers.problem_build import build_problem
from autopar.strategies.analysis import analyze
from autopar.strategies.batch_flow import BATCH, reshape_batch
from autopar.strategies.settings import Settings
from tests.dist_utils import RankPool
from tests.foreign_models import TinyLlama

VOCAB, BATCH_SIZE, SEQ, STEPS, LR = 128, 8, 16, 3, 0.1
CPU4 = autopar.Cluster(gpu="cpu", gpus_per_node=4)


@torch.library.custom_op("autopar_tests::gate", mutates_args=())
def gate(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(w)``: an operator no sharding rule describes."""
    return x * torch.sigmoid(w)


@gate.register_fake
def _gate_fake(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _gate_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _gate_backward(ctx, grad: torch.Tensor):
    x, w = ctx.saved_tensors
    s = torch.sigmoid(w)
    return grad * s, (grad * x * s * (1 - s)).reshape(-1, w.shape[-1]).sum(0)


gate.register_autograd(_gate_backward, setup_context=_gate_setup)


class EncoderLM(nn.Module):
    """A language model on ``nn.TransformerEncoder``, its layers batch-first or not."""

    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 32)
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=batch_first)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, VOCAB)
        self.batch_first = batch_first

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        h = h if self.batch_first else h.transpose(0, 1)
        h = self.encoder(h)
        return self.head(h if self.batch_first else h.transpose(0, 1))


class GatedLM(nn.Module):
    """A model with an operator autopar has no rule for (:func:`gate`)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 32)
        self.up = nn.Linear(32, 64)
        self.gate = nn.Parameter(torch.randn(64))
        self.head = nn.Linear(64, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(gate(F.gelu(self.up(self.emb(tokens))), self.gate))


class BiasedAttention(nn.Module):
    """T5's pattern: one relative-position bias (1, H, T, T) looked up from a parameter,
    broadcast in every block against a mask made from the inputs' shape (B, 1, T, T)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 32)
        self.rel = nn.Embedding(2 * SEQ, 4)
        self.qkv = nn.ModuleList(nn.Linear(32, 96) for _ in range(2))
        self.head = nn.Linear(32, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        b, t = tokens.shape
        pos = torch.arange(t, device=tokens.device)
        bias = self.rel(pos[None, :] - pos[:, None] + SEQ).permute(2, 0, 1).unsqueeze(0)
        keep = torch.ones(b, 1, t, t, dtype=torch.bool, device=tokens.device)
        h = self.emb(tokens)
        for qkv in self.qkv:
            q, k, v = qkv(h).view(b, t, 3, 4, 8).permute(2, 0, 3, 1, 4)
            mask = torch.where(keep, bias, float("-inf"))
            att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            h = h + att.transpose(1, 2).reshape(b, t, 32)
        return self.head(h)


class RowsAsSamples(nn.Module):
    """Adds a table's columns, one per sample of the global batch, to a tensor made
    from the batch's shape: each rank would need the rows of its own samples."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 32)
        self.head = nn.Linear(35, VOCAB)

    def forward(self, tokens: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        side = table.t() + torch.zeros(tokens.shape[0], 3, device=tokens.device)
        return self.head(torch.cat([self.emb(tokens).mean(1), side], 1))


class ImageTokens(nn.Module):
    """LLaVA's pattern: per-sample image features listed and concatenated into the image
    tokens of the whole batch (``torch.cat(list(x))``), a check that counts the image
    positions over the batch, the tokens scattered into those positions; a layer whose
    output goes unused (LLaVA reads the second-to-last vision layer) and a module the
    forward never calls."""

    def __init__(self, n_image: int = 4) -> None:
        super().__init__()
        self.n_image = n_image
        self.emb = nn.Embedding(VOCAB, 32)
        self.vision = nn.ModuleList(nn.Linear(32, 32) for _ in range(2))
        self.head = nn.Linear(32, VOCAB)
        self.spare = nn.Linear(32, 32)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        b, t = tokens.shape
        h = self.emb(tokens)
        states = [h[:, :self.n_image]]
        for layer in self.vision:
            states.append(torch.tanh(layer(states[-1])))
        image = torch.cat(list(states[-2]), dim=0)  # (b * n_image, 32): the last layer unread
        where = (torch.arange(t, device=tokens.device) < self.n_image).expand(b, t)
        torch._check_tensor_all(where.sum() * 32 == image.numel())
        return self.head(h.masked_scatter(where[..., None], image))


def hf(kind: str) -> nn.Module:
    """A tiny Hugging Face causal LM of family ``kind`` (dropout off)."""
    t = pytest.importorskip("transformers")
    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=32)
    if kind == "opt":
        return t.OPTForCausalLM(t.OPTConfig(ffn_dim=64, dropout=0.0, **common))
    if kind == "falcon":
        return t.FalconForCausalLM(t.FalconConfig(**{k: v for k, v in common.items()
                                                     if k != "max_position_embeddings"}))
    moe = dict(intermediate_size=64, num_key_value_heads=2, num_experts_per_tok=2, **common)
    if kind == "mixtral":
        return t.MixtralForCausalLM(t.MixtralConfig(num_local_experts=4, **moe))
    return t.Qwen2MoeForCausalLM(t.Qwen2MoeConfig(
        num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=32, **moe))


MODELS = {"encoder": lambda: EncoderLM(True), "encoder-seq-first": lambda: EncoderLM(False),
          "tiny-llama": TinyLlama, "gated": GatedLM, "biased": BiasedAttention,
          "image-tokens": ImageTokens,
          **{k: (lambda k=k: hf(k)) for k in ("opt", "falcon", "mixtral", "qwen2moe")}}


def make(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[kind]()


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return (torch.randint(0, VOCAB, (BATCH_SIZE, SEQ), generator=g),
            torch.randint(0, VOCAB, (BATCH_SIZE, SEQ), generator=g))


def test_reshape_follows_a_batch_merged_inside_a_dim() -> None:
    # seq-first attention: (T, B, H, D) -> (T·B, H·D) -> (T, B, C)
    assert reshape_batch((16, 8, 4, 8), (128, 32), 1, 1, 8) == (0, 1)
    assert reshape_batch((128, 32), (16, 8, 32), 0, 1, 8) == (1, 1)
    # batch-first: (B, T, C) -> (B·T, C) -> (B, T, H, D)
    assert reshape_batch((8, 16, 32), (128, 32), 0, 1, 8) == (0, 16)
    assert reshape_batch((128, 32), (8, 16, 4, 8), 0, 16, 8) == (0, 1)
    # a reshape that splits the batch over two dims loses it
    assert reshape_batch((8, 16), (4, 32), 0, 1, 8) is None


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_plans_for_pure_data_parallelism(kind: str) -> None:
    x, _ = data()
    plan = autopar.plan(make(kind), (x,), cluster=CPU4, precision="fp32", dp=4, tp=1, pp=1)
    assert plan.mesh == {"dp": 4, "tp": 1} and plan.step_time_s > 0


def test_sequence_first_attention_keeps_the_batch_through_its_reshapes() -> None:
    x, _ = data()
    g = capture(make("encoder-seq-first"), (x,))
    an = analyze(g)
    merged = [n for n in g.nodes if n.target == "aten.reshape.default"
              and n.out.shape == (SEQ * BATCH_SIZE, 32)]
    assert merged and all(an.batch_dim[n.name] == 0 and BATCH in an.rules[n.name].out
                          for n in merged)
    merged_names = {n.name for n in merged}
    out_proj = [n for n in g.nodes if n.kind == "op" and n.inputs[:1] and
                n.inputs[0] in merged_names]
    assert out_proj and all(an.batch_dim[n.name] == 0 for n in out_proj)  # on (T·B, C)
    unmerged = [n for n in g.nodes if n.target == "aten.view.default"
                and n.out.shape == (SEQ, BATCH_SIZE, 32)]
    assert unmerged and all(an.batch_dim[n.name] == 1 for n in unmerged)


def test_position_embeddings_of_shape_made_ids_follow_the_batch() -> None:
    """OPT looks positions up from ids made of ``ones(B, T)``: the lookup reads only a
    parameter and constants, and its consumer settles it split like the tokens."""
    x, _ = data()
    g = capture(make("opt"), (x,))
    an = analyze(g)
    pos = [n for n in g.nodes if n.target == "aten.embedding.default"
           and n.module_path.endswith("embed_positions")]
    assert pos and all(an.batch_dim[n.name] == 0 for n in pos)


def test_a_bias_broadcast_along_the_batch_stays_replicated() -> None:
    """The bias (batch dim 1) is replicated; the masks it makes with the shape-made
    ``keep`` (batch dim B) follow the batch in both blocks, not only in the first,
    whose mask settled the bias replicated before the second read it. Context
    parallelism is refused for the mask, which is not causal."""
    x, _ = data()
    an = analyze(capture(make("biased"), (x,)))
    g = an.graph
    bias = [n for n in g.nodes if n.target == "aten.unsqueeze.default"
            and n.out.shape == (1, 4, SEQ, SEQ)]
    masks = [g.node(n.inputs[3]) for n in g.nodes
             if n.target == "aten.scaled_dot_product_attention.default"]
    assert len(bias) == 1 and an.batch_dim[bias[0].name] is None
    assert len(masks) == 2 and all(an.batch_dim[m.name] == 0 for m in masks)
    assert an.sequence.refusal == (  # the sequence flow names the mask, not the bias
        "the sequence cannot be split at operator aten.scaled_dot_product_attention.default "
        "in module '<root>': it reads an attention mask that is not causal; the "
        "context-parallel variants run causal or unmasked attention only. Context "
        "parallelism needs attention through F.scaled_dot_product_attention and every "
        "other op to work token by token")


def test_a_replicated_tensor_sized_like_the_batch_still_refuses() -> None:
    x, _ = data()
    with pytest.raises(UnsupportedOpError) as e:
        autopar.plan(RowsAsSamples(), (x, torch.randn(3, BATCH_SIZE)), cluster=CPU4,
                     precision="fp32", dp=4, tp=1, pp=1)
    assert str(e.value) == (
        "operator aten.add.Tensor in module '<root>' cannot run data-parallel: it combines "
        "the batch with input 0, which is not split along the batch (inputs placed ['R']). "
        "Compute it per sample, or move it out of the model's forward (e.g. into the loss "
        "function).")


def _built(kind: str, dp: int, tp: int):
    x, _ = data()
    an = analyze(capture(make(kind), (x,)))
    st = Settings(Mesh(("dp", "tp"), (dp, tp)), BATCH_SIZE // dp, 1, 0, "fp32", "adamw", 1e12,
                  CPU4.hardware(), 4)
    built = build_problem(an, st)
    return an, {name: s for name, s in zip(built.names, built.strategies)}, built


def test_repeat_interleave_gqa_is_split_per_kv_head() -> None:
    an, strategies, _ = _built("tiny-llama", 2, 2)
    g = an.graph
    wk = next(n for n in g.nodes if n.kind == "op" and n.target == "aten.linear.default"
              and "layers.0.attention.wk.weight" in n.params)
    # column-parallel: the weight split by output features (whole kv heads)
    assert any(s.ins[1] == ("R", "S(0)") and s.out == ("S(0)", "S(2)")
               for s in strategies[wk.name])
    rep = [n for n in g.nodes if n.target == "aten.repeat_interleave.self_int"
           and n.name in strategies]
    assert rep and all(any(s.ins[0] == ("S(0)", "S(1)") and s.out == ("S(0)", "S(1)")
                           for s in strategies[n.name]) for n in rep)
    x, _ = data()
    plan = autopar.plan(make("tiny-llama"), (x,), cluster=CPU4, precision="fp32", dp=2, tp=2,
                        pp=1)
    assert plan.mesh == {"dp": 2, "tp": 2}


def test_an_op_without_a_rule_is_replicated_and_priced() -> None:
    an, strategies, built = _built("gated", 2, 2)
    node = next(n for n in an.graph.nodes if n.target == "autopar_tests.gate.default")
    assert an.rules[node.name].kind == "fallback" and an.batch_dim[node.name] == 0
    costs = built.problem.nodes[built.names.index(node.name)].strategies
    assert all(s.out[1] == "R" and all(p[1] == "R" for p in s.ins) for s in
               strategies[node.name])
    assert all(c.compute_s > 0 for c in costs)
    x, _ = data()
    plan = autopar.plan(make("gated"), (x,), cluster=CPU4, precision="fp32", dp=2, tp=2, pp=1)
    assert plan.mesh == {"dp": 2, "tp": 2}


def test_a_batch_statistic_still_refuses_data_parallelism() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4))
    with pytest.raises(UnsupportedOpError, match="batch_norm.*cannot run data-parallel"):
        autopar.plan(model, (torch.randn(8, 8),), cluster=CPU4, precision="fp32", dp=4,
                     tp=1, pp=1)
    model = nn.Sequential(nn.Linear(8, 16), nn.GroupNorm(4, 16), nn.Linear(16, 4))
    autopar.plan(model, (torch.randn(8, 8),), cluster=CPU4, precision="fp32", dp=4, tp=1,
                 pp=1)


def test_image_tokens_listed_per_sample_plan_data_parallel() -> None:
    """``torch.cat(list(x))`` is read as the flatten it is (``unbind`` alone selects
    single samples), the ops that only feed the check are left out of the graph (the
    unread layer's stay: eager PyTorch runs it), and the parameters of the module never
    called are still placed (replicated, or split over the data axes under ZeRO-3)."""
    x, _ = data()
    g = capture(make("image-tokens"), (x,))
    targets = [n.target for n in g.nodes if n.kind == "op"]
    assert "aten.flatten.using_ints" in targets and "aten.unbind.int" not in targets
    assert "aten.sum.default" not in targets and "aten._is_all_true.default" not in targets
    assert targets.count("aten.tanh.default") == 2
    assert analyze(g).batch_dim[next(n.name for n in g.nodes
                                     if n.target == "aten.masked_scatter.default")] == 0
    for zero, want in ((0, ["R", "R"]), (3, ["S(0)", "R"])):
        plan = autopar.plan(make("image-tokens"), (x,), cluster=CPU4, precision="fp32",
                            dp=2, tp=2, pp=1, zero=zero)
        assert plan.params["spare.weight"] == want, zero


RUN_KINDS = ("encoder-seq-first", "opt", "gated", "biased", "image-tokens")


def reference(kind: str) -> list[float]:
    model = make(kind)
    x, y = data()
    return sgd_losses(model.parameters(), reference_step(model, x, y), STEPS, LR)


def rank_main() -> dict[str, list[float]]:
    out = {}
    for kind in RUN_KINDS:
        model = make(kind)
        x, y = data()
        pm = autopar.parallelize(model, (x,), precision="fp32", dp=2, tp=1, pp=1)
        out[kind] = sgd_losses(pm.parameters(), lambda: pm.step(x, y), STEPS, LR)
    return out


@pytest.mark.multirank
def test_data_parallel_training_matches_single_process(rank_pool: RankPool) -> None:
    pytest.importorskip("transformers")
    got = rank_pool.run(2, rank_main, timeout_s=400)[0]
    for kind in RUN_KINDS:
        assert got[kind] == pytest.approx(reference(kind), abs=1e-5), kind
