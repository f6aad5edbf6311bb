"""The planner: the ILP equals exhaustive search on real graphs, the solver alone finds
Megatron's layout, plans round-trip through JSON, and bad input gets clear errors."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autopar
from autopar.capture import capture
from autopar.cost_models.hardware import load_profile
from autopar.errors import CaptureError, ConfigError, NoFeasiblePlanError, PlanFormatError
from autopar.sharding import Mesh
from autopar.solvers.exhaustive import solve_exhaustive
from autopar.solvers.intra_op_solve import solve_ilp
from autopar.solvers.problem import evaluate
from autopar.solvers.problem_build import build_problem
from autopar.strategies.analysis import analyze
from autopar.strategies.settings import Settings


class Seq(nn.Module):
    def __init__(self, *mods):
        super().__init__()
        self.mods = nn.ModuleList(mods)

    def forward(self, x):
        for m in self.mods:
            x = m(x)
        return x


class Residual(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.a, self.b = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.b(F.relu(self.a(x)))


SMALL = [
    lambda: nn.Linear(16, 8),
    lambda: nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8)),
    lambda: nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 8)),
    lambda: Seq(nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 8)),
    lambda: nn.Sequential(Residual(16), nn.Linear(16, 8)),
]


@pytest.mark.parametrize("idx", range(len(SMALL)))
@pytest.mark.parametrize("mesh,zero", [((1, 4), 0), ((2, 2), 0), ((2, 2), 3)])
def test_ilp_equals_exhaustive_on_real_graphs(idx, mesh, zero):
    torch.manual_seed(0)
    g = capture(SMALL[idx](), (torch.randn(8, 16),))
    an = analyze(g)
    hw = load_profile("h100-sxm")
    st = Settings(Mesh(("dp", "tp"), mesh), 4, 1, zero, "bf16", "adamw", 1e12, hw, 8)
    built = build_problem(an, st)
    free = solve_exhaustive(built.problem)
    assert evaluate(built.problem, solve_ilp(built.problem).choice).step_time_s == \
        pytest.approx(free.objective_s, rel=1e-6)
    # a budget just below the unconstrained optimum's memory forces another answer
    built.problem.memory_budget = 0.999 * evaluate(built.problem, free.choice).memory_bytes
    try:
        ref = solve_exhaustive(built.problem)
    except NoFeasiblePlanError:
        with pytest.raises(NoFeasiblePlanError):
            solve_ilp(built.problem)
        return
    sol = solve_ilp(built.problem)
    assert evaluate(built.problem, sol.choice).step_time_s == pytest.approx(ref.objective_s,
                                                                            rel=1e-6)


def test_solver_alone_finds_megatron_layout(tmp_path):
    """On the device's costs alone (the H100 profile without its host figures: with them
    this step is nearly host-bound, and layouts of equal host time tie within 1%)."""
    import json
    from importlib import resources

    from autopar.examples.gpt import GPT, GPTConfig
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=51200, max_seq_len=2048, dim=4096, n_layers=2, n_heads=32))
        x = torch.randint(0, 100, (2, 2048))
    shipped = resources.files("autopar.cost_models") / "profiles"
    profile = json.loads((shipped / "h100-sxm.json").read_text())
    del profile["host_overhead_s"]
    profile["tables"]["file"] = str(shipped / profile["tables"]["file"])
    (tmp_path / "device-only.json").write_text(json.dumps(profile))
    cluster = autopar.Cluster("h100-sxm", 1, 8, profile=str(tmp_path / "device-only.json"))
    plan = autopar.plan(model, (x,), cluster=cluster, dp=1, tp=8, microbatch_size=4,
                        global_batch=4)
    assert plan.breakdown["host_s"] == 0.0
    styles = {p: m.style for p, m in plan.modules.items()}
    for name in ("attn.q", "attn.k", "attn.v", "mlp.fc1"):
        assert styles[f"blocks.0.{name}"] == "colwise", (name, styles)
    for name in ("attn.proj", "mlp.fc2"):
        assert styles[f"blocks.0.{name}"] == "rowwise", (name, styles)
    assert plan.params["blocks.1.attn.q.weight"] == ["R", "S(0)"]
    assert plan.params["blocks.1.mlp.fc2.weight"] == ["R", "S(1)"]


def tiny_gpt():
    from autopar.examples.gpt import GPT, GPTConfig
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=128, max_seq_len=16, dim=32, n_layers=2, n_heads=4))


def test_plan_json_round_trip_and_summary():
    x = torch.randint(0, 128, (8, 16))
    plan = autopar.plan(tiny_gpt(), (x,), cluster=autopar.Cluster("cpu", 1, 4), precision="fp32")
    again = autopar.Plan.from_json(plan.to_json())
    assert again == plan
    assert plan.memory_per_device_bytes > 0 and plan.step_time_s > 0
    assert "predicted step time" in plan.summary()
    assert plan.world_size == 4 and len(plan.graph_hash) == 16


def test_same_inputs_same_plan():
    x = torch.randint(0, 128, (8, 16))
    a = autopar.plan(tiny_gpt(), (x,), cluster=autopar.Cluster("cpu", 1, 4))
    b = autopar.plan(tiny_gpt(), (x,), cluster=autopar.Cluster("cpu", 1, 4))
    a.solver = b.solver = {}
    assert a.to_json() == b.to_json()


def test_malformed_plan_file():
    with pytest.raises(PlanFormatError, match="not valid JSON"):
        autopar.Plan.from_json("{not json")
    with pytest.raises(PlanFormatError, match="format version 99 is not supported"):
        autopar.Plan.from_json('{"version": 99}')
    with pytest.raises(PlanFormatError, match="missing the field"):
        autopar.Plan.from_json('{"version": 1}')


def test_unknown_gpu():
    with pytest.raises(ConfigError, match=r"unknown GPU 'h300'; known profiles: a100-80g, cpu, "
                                          r"h100-sxm, h100-sxm-500w, h200 \(or pass the path of a "
                                          r"profile JSON "
                                          r"file\)"):
        autopar.Cluster(gpu="h300")


def test_tp_must_divide_heads():
    x = torch.randint(0, 128, (8, 16))
    with pytest.raises(ConfigError, match=r"tp=3 does not divide the 4 attention heads of "
                                          r"module 'blocks.0.attn'"):
        autopar.plan(tiny_gpt(), (x,), cluster=autopar.Cluster("cpu", 1, 6), tp=3)


def test_budget_no_plan_fits_names_minimum():
    x = torch.randint(0, 128, (8, 16))
    with pytest.raises(NoFeasiblePlanError, match=r"no plan fits in 1.00 kB per device: the "
                                                  r"smallest needs at least"):
        autopar.plan(tiny_gpt(), (x,), cluster=autopar.Cluster("cpu", 1, 4), memory_budget=1000)


def test_uncapturable_model_names_module():
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(4, 4)
            self.gate = Gate()

        def forward(self, x):
            return self.gate(self.inner(x))

    class Gate(nn.Module):
        def forward(self, x):
            if x.sum() > 0:
                return x * 2
            return x

    with pytest.raises(CaptureError, match=r"cannot capture module 'gate' \(Gate\).*Hint: the "
                                           r"forward branches on tensor values"):
        capture(Branchy(), (torch.randn(2, 4),))
