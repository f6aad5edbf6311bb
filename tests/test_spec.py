"""One Spec for plan, estimate, compare and the command line: the same mistake gets the
same message from each, the CLI has an option per field by its name, and memory is
written in one unit (decimal GB)."""

from __future__ import annotations

from dataclasses import fields

import pytest
import torch

import autopar
from autopar.cli import _build_parser, main
from autopar.cli_options import spec_from_args
from autopar.errors import ConfigError
from autopar.examples import zoo
from autopar.spec import Spec, split_space
from autopar.units_text import fmt_bytes

CLUSTER = autopar.Cluster("a100-80g", 1, 4)
CLI = ["--gpu", "a100-80g", "--gpus-per-node", "4", "--global-batch", "8"]

BAD = [  # (Spec fields, CLI options, the one message)
    ({"cp_variant": "spiral"}, ["--cp-variant", "spiral"],
     "cp_variant='spiral': expected one of allgather, ring, ulysses"),
    ({"cp": 2, "ep": 2}, ["--cp", "2", "--ep", "2"],
     "cp=2 with ep=2: context and expert parallelism are not planned together; it would "
     "need the experts split over ep ranks drawn from dp x cp, with every cp rank's tokens "
     "routed to them (Megatron-Core folds EP over DP x CP), while autopar's ep takes its "
     "ranks from dp (or dp x tp with expert_tp=1), never cp; choose one (cp for long "
     "sequences, ep for the experts)"),
    ({"tp": 0}, ["--tp", "0"], "tp=0: expected a positive integer"),
    ({"zero": 5}, ["--zero", "5"], "zero=5: expected a ZeRO stage, 0, 1, 2 or 3"),
    ({"schedule": "1f2b"}, ["--schedule", "1f2b"],
     "schedule='1f2b': expected one of gpipe, 1f1b, interleaved_1f1b, "
     "interleaved_zero_bubble, zbv"),
    ({"recompute": "some"}, ["--recompute", "some"],
     "recompute='some': expected one of none, selective, full"),
    ({"offload": True, "zero": 2}, ["--offload", "--zero", "2"],
     "offload=True needs zero=3 (FSDP2 offloads sharded parameters), not zero=2"),
]


@pytest.fixture(scope="module")
def gpt():
    return zoo.get("tiny-gpt", batch_size=8)


def _message(call) -> str:
    with pytest.raises(ConfigError) as err:
        call()
    return str(err.value)


@pytest.mark.parametrize("given, options, message", BAD, ids=lambda v: repr(v)[:30])
def test_a_bad_field_gives_one_message_from_every_entry_point(gpt, capsys, given, options,
                                                              message):
    model, x = gpt
    assert _message(lambda: Spec(**given)) == message
    assert _message(lambda: autopar.plan(model, x, cluster=CLUSTER, **given)) == message
    assert _message(lambda: autopar.estimate(model, x, Spec(**given),
                                             cluster=CLUSTER)) == message
    assert _message(lambda: autopar.compare(model, x, Spec(**given),
                                            cluster=CLUSTER)) == message
    for command in ("plan", "compare"):
        assert main([command, "tiny-gpt", *CLI, *options]) == 2
        assert capsys.readouterr().err == f"autopar: error: {message}\n"


def test_expert_parallelism_of_a_dense_model_is_refused(gpt, capsys):
    """ep > 1 on a model without expert modules: one message from plan, estimate and
    the command line; an ep that does not divide dp is refused by the Spec's filling."""
    model, x = gpt
    message = ("ep=4: the model has no expert modules (a module whose parameters stack one "
               "weight per expert, run per expert); leave ep out for a dense model")
    assert _message(lambda: autopar.plan(model, x, cluster=CLUSTER, ep=4)) == message
    assert _message(lambda: autopar.estimate(model, x, Spec(ep=4), cluster=CLUSTER)) == message
    for command in ("plan", "compare"):
        assert main([command, "tiny-gpt", *CLI, "--ep", "4"]) == 2
        assert capsys.readouterr().err == f"autopar: error: {message}\n"
    assert _message(lambda: Spec(dp=4, ep=3).for_estimate(4, 8)) == (
        "ep=3 does not divide dp=4: the experts are split over ep of the data-parallel "
        "ranks; choose an ep that divides dp")


def test_an_unknown_planning_keyword_names_the_valid_ones(gpt):
    model, x = gpt
    assert _message(lambda: autopar.plan(model, x, cluster=CLUSTER, tensor_parallel=2)) == (
        "unknown planning option(s) tensor_parallel; known: dp, tp, pp, cp, ep, expert_tp, "
        "cp_variant, microbatch_size, schedule, virtual_stages, recompute, zero, "
        "sequence_parallel, loss_parallel, split_weights, offload, compile, time_limit_s, "
        "top_k, progress, explain (or space=autopar.Spec(...))")
    assert _message(lambda: autopar.plan(model, x, cluster=CLUSTER, space={"tp": 2})) == \
        "space must be an autopar.Spec, got dict"


def test_keywords_and_space_are_the_same_search(gpt):
    """``plan(tp=2)`` and ``plan(space=Spec(tp=2))`` give the same plan; a keyword beside
    ``space`` replaces that field, and cp=1 / ep=1 are allowed."""
    model, x = gpt
    by_name = autopar.plan(model, x, cluster=CLUSTER, tp=2, recompute="full")
    by_spec = autopar.plan(model, x, cluster=CLUSTER,
                           space=Spec(tp=4, recompute="full", cp=1, ep=1), tp=2)
    by_name.solver = by_spec.solver = {}
    assert by_name.to_json() == by_spec.to_json()
    assert by_name.degree("tp") == 2 and set(by_name.recompute.values()) == {"full"}
    assert split_space({"tp": 2, "top_k": 3, "time_limit_s": 1.0}) == \
        (Spec(tp=2), {"top_k": 3, "time_limit_s": 1.0})


def test_estimate_fills_what_the_spec_leaves_out():
    """Degrees left out are 1 except dp, which fills the world; ZeRO 0; the largest
    micro-batch that still gives pp micro-batches; 1F1B with a pipeline; eager blocks;
    recomputation and virtual stages stay the solver's."""
    assert Spec(pp=2).for_estimate(8, 32) == Spec(
        dp=4, tp=1, pp=2, cp=1, ep=1, microbatch_size=4, schedule="1f1b", zero=0,
        offload=False, compile=False)
    assert Spec(tp=2, recompute="full").for_estimate(8, 32) == Spec(
        dp=4, tp=2, pp=1, cp=1, ep=1, microbatch_size=8, recompute="full", zero=0,
        sequence_parallel=False, offload=False, compile=False)
    assert Spec(cp=2).for_estimate(8, 32) == Spec(
        dp=4, tp=1, pp=1, cp=2, ep=1, cp_variant="allgather", microbatch_size=8, zero=0,
        offload=False, compile=False)
    assert repr(Spec(tp=2, recompute="full")) == "Spec(tp=2, recompute='full')"
    with pytest.raises(ConfigError) as err:
        Spec(tp=3).for_estimate(8, 32)
    assert str(err.value) == "tp=3 x pp=1 x cp=1 does not divide the 8 devices of the cluster"
    with pytest.raises(ConfigError) as err:
        Spec(dp=2, tp=2).for_estimate(8, 32)
    assert str(err.value) == "dp=2 x tp=2 x pp=1 x cp=1 uses 4 devices but the cluster has 8"
    with pytest.raises(ConfigError) as err:
        Spec(dp=8).for_estimate(8, 12)
    assert str(err.value) == "the global batch 12 is not divisible by dp=8"


def test_the_cli_has_an_option_per_spec_field_by_its_name():
    parser = _build_parser()
    values = {"dp": 2, "tp": 2, "pp": 2, "cp": 1, "ep": 1, "expert_tp": 2, "cp_variant": "ring",
              "microbatch_size": 2,
              "schedule": "gpipe", "virtual_stages": 1, "recompute": "full", "zero": 3,
              "sequence_parallel": True, "loss_parallel": True, "split_weights": True,
              "offload": True, "compile": True}
    assert set(values) == {f.name for f in fields(Spec)}
    options = [a for k, v in values.items() for a in (
        [f"--{k.replace('_', '-')}"] if v is True else [f"--{k.replace('_', '-')}", str(v)])]
    for command in ("plan", "compare", "train"):
        args = parser.parse_args([command, "tiny-gpt", *options])
        assert spec_from_args(args) == Spec(**values)
        assert spec_from_args(parser.parse_args([command, "tiny-gpt"])) == Spec()


def test_memory_is_written_in_decimal_units(gpt):
    assert [fmt_bytes(n) for n in (79.46e9, 123.4e9, 8.4e6, 2_500, 512, 0)] == \
        ["79.46 GB", "123.40 GB", "8.40 MB", "2.50 kB", "512 B", "0 B"]
    model, x = gpt
    plan = autopar.plan(model, x, cluster=CLUSTER, top_k=2)
    text = plan.summary()
    line = next(s for s in text.splitlines() if s.startswith("memory per device"))
    assert line.startswith(f"memory per device    {fmt_bytes(plan.memory_per_device_bytes)}"
                           f"   (params {fmt_bytes(plan.memory['params'])}, ")
    assert "iB" not in text
    result = autopar.compare(model, x, Spec(tp=2), cluster=CLUSTER)
    row = next(r for r in result.rows() if r.label == "memory per device")
    assert (row.planned, row.handwritten) == (
        fmt_bytes(plan.memory_per_device_bytes),
        fmt_bytes(result.handwritten.memory_per_device_bytes))
    assert "iB" not in result.table()


class _ListExperts(torch.nn.Module):
    """A mixture of experts written as a list of FFN modules, every expert run on
    every token and weighted by the top-2 gate (zero elsewhere)."""

    def __init__(self, dim: int = 16, experts: int = 4) -> None:
        super().__init__()
        self.router = torch.nn.Linear(dim, experts, bias=False)
        self.experts = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(dim, 32), torch.nn.SiLU(),
                                torch.nn.Linear(32, dim)) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        w = self.router(x).softmax(-1)
        top, idx = w.topk(2, -1)
        gate = torch.zeros_like(w).scatter(-1, idx, top)
        return x + sum(gate[..., i:i + 1] * e(x) for i, e in enumerate(self.experts))


def test_expert_parallelism_of_listed_experts_says_why():
    """Experts written as a list of modules are found, and ep on them is refused with
    what to change; without ep the same model plans (blocks are not taken for experts)."""
    from autopar.capture import capture
    from autopar.strategies.experts import expert_lists

    model = torch.nn.Sequential(_ListExperts(), _ListExperts())
    x = torch.randn(8, 4, 16)
    assert expert_lists(capture(model, (x,))) == {"0.experts": 4, "1.experts": 4}
    assert _message(lambda: autopar.plan(model, (x,), cluster=CLUSTER, dp=4, ep=2)) == (
        "ep=2: the experts of '0.experts' are a list of 4 modules, each run on its own in "
        "the forward; expert parallelism splits experts stacked in one module (one weight "
        "of shape (experts, ...) per projection, as transformers 5's MoE layers and "
        "autopar.examples.moe hold them). Stack them, or leave ep out: data, tensor and "
        "pipeline parallelism still split these layers")
    assert autopar.plan(model, (x,), cluster=CLUSTER, dp=4).mesh["dp"] == 4
