"""Host time counted as dispatched: the aten ops each captured op dispatches, the
seconds per dispatched op solved from the measured figures, and the modules that can
run on local tensors."""

from __future__ import annotations

import pytest
import torch

from autopar.capture import capture
from autopar.cost_models.dispatch import KINDS, Dispatches, _Counting, graph_dispatches
from autopar.cost_models.hardware import load_profile
from autopar.cost_models.host import (CHAIN, PROFILED_DISPATCHES, dispatch_rates,
                                   dispatched_host_time)
from autopar.cost_models.local_regions import region_candidates
from autopar.cost_models.profiling.host_dispatch import _CHAIN, _ops
from autopar.examples.gpt import GPT, GPTConfig
from autopar.examples.llama import Llama, LlamaConfig


def _kinds(**counts: int) -> tuple[int, ...]:
    return tuple(counts.get(k, 0) for k in KINDS)


def _llama_graph():
    cfg = LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                      ffn_dim=128)
    return capture(Llama(cfg), torch.randint(0, 256, (2, 16)))


def test_profiled_chains_dispatch_as_recorded() -> None:
    """The chains the host figures were measured on dispatch, with the installed torch,
    the aten ops the solved rates assume (the attention chain on a CPU runs its
    CPU flash kernel, one op as on a GPU); the backward's count holds the loss that
    starts it, as its measurement does."""
    assert CHAIN == _CHAIN
    for kind, make in _ops(torch.device("cpu")).items():
        op, x = make()
        with _Counting() as fwd:
            if kind == "embedding":
                out = [op(x) for _ in range(_CHAIN)]
            else:
                out = x
                for _ in range(_CHAIN):
                    out = op(out)
        with _Counting() as bwd:  # the measured backward: both passes less the forward
            (torch.stack(out) if kind == "embedding" else out).float().sum().backward()
        got = Dispatches(_kinds(**fwd.kinds), _kinds(**bwd.kinds))
        assert got == PROFILED_DISPATCHES[kind], kind


def test_captured_ops_count_what_eager_dispatches() -> None:
    """A Linear on a 3-D input dispatches t, view, mm and _unsafe_view forward and two
    mm backward; rms_norm and attention run fused on a GPU; a tuple's getitem
    dispatches nothing; the loss dispatches its log-softmax and NLL."""
    g = _llama_graph()
    d = graph_dispatches(g)
    by_target = {}
    for n in g.nodes:
        if n.kind == "op" and n.requires_grad:
            by_target.setdefault(n.target, d[n.name])
    linear = by_target["aten.linear.default"]
    assert linear.fwd == _kinds(matmul=1, view=3)
    assert linear.bwd[KINDS.index("matmul")] == 2
    assert by_target["aten.rms_norm.default"] == Dispatches(_kinds(norm=1), _kinds(norm=1))
    sdpa = by_target["aten.scaled_dot_product_attention.default"]
    assert sdpa == Dispatches(_kinds(attention=1), _kinds(attention=1))
    loss = by_target["aten.cross_entropy_loss.default"]
    assert loss.forward_ops >= 2 and sum(loss.bwd) >= 2
    ops = [n for n in g.nodes if n.kind == "op"]
    assert sum(d[n.name].forward_ops for n in ops) > len(ops)  # more dispatched than captured


@pytest.mark.parametrize("name", ["h100-sxm", "h200"])
def test_rates_give_back_the_measured_figures(name: str) -> None:
    """The seconds per dispatched op, applied to the measured chains, give back each
    measured forward figure to 1% and each backward one to 25% (non-negative rates
    cannot fit all six backward figures exactly), and none is negative."""
    hw = load_profile(name)
    rates = dispatch_rates(hw)
    assert min(rates[0] + rates[1]) >= 0.0
    for kind, d in PROFILED_DISPATCHES.items():
        fwd, bwd = dispatched_host_time(rates, d)
        assert fwd / CHAIN == pytest.approx(hw.host_overhead_s[f"op_{kind}_fwd"], rel=0.01)
        assert bwd / CHAIN == pytest.approx(hw.host_overhead_s[f"op_{kind}_bwd"], rel=0.25)


def test_no_figures_no_rates() -> None:
    """The CPU profile (the host is the device) has no seconds per dispatched op."""
    assert dispatch_rates(load_profile("cpu")) == ((0.0,) * 6, (0.0,) * 6)


def test_attention_and_ffn_are_the_local_regions() -> None:
    """Llama's attention (four Linears) and feed-forward network (three) can run on
    local tensors; the blocks (norm weights) and the root (embedding, head) cannot;
    a GPT whose head is tied to its embedding keeps those out too."""
    regions = region_candidates(_llama_graph())
    found = {(r.path, r.linears) for r in regions.values()}
    assert found == {("layers.0.attn", 4), ("layers.0.ffn", 3), ("layers.1.attn", 4),
                     ("layers.1.ffn", 3)}
    g = _llama_graph()
    inside = [n for n in g.nodes if n.name in regions]
    assert all(n.module_path.startswith(("layers.0.", "layers.1.")) for n in inside)
    gpt = capture(GPT(GPTConfig(vocab_size=256, max_seq_len=64, dim=64, n_layers=1,
                                n_heads=4)), torch.randint(0, 256, (2, 16)))
    paths = {r.path for r in region_candidates(gpt).values()}
    assert paths == {"blocks.0.attn", "blocks.0.mlp"}
    assert region_candidates(gpt, frozenset({"blocks.0.mlp"})).keys().isdisjoint(
        n.name for n in gpt.nodes if n.module_path.startswith("blocks.0.mlp"))
