"""Every bad input answered: one table row per mistake a user can make, through the
Python API, plan and profile JSON files and the command line, each with the one
message it must get (what is wrong and what to try). A row passes when the call raises
that message as an :class:`autopar.AutoparError` (or warns it, or notes it in the plan)
and nothing else: no bare traceback, no plan made silently from a bad input."""

from __future__ import annotations

import contextlib
import io
import json
import pickle
import re
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import autopar
from autopar.cli import main
from autopar.errors import (AutoparError, CaptureError, ConfigError, LoweringError,
                            NoFeasiblePlanError, PlanFormatError)
from autopar.examples.gpt import GPT, GPTConfig
from autopar.plans import Plan
from autopar.spec import Spec

SHIPPED = Path(autopar.__file__).resolve().parent.parent / "cost_models" / "profiles"
MODELS = '''
import torch
from autopar.examples.gpt import GPT, GPTConfig


def build():
    cfg = GPTConfig(vocab_size=128, max_seq_len=16, dim=32, n_layers=2, n_heads=4)
    return GPT(cfg), (torch.randint(0, 128, (8, 16)),)


def wider():
    cfg = GPTConfig(vocab_size=128, max_seq_len=16, dim=64, n_layers=2, n_heads=4)
    return GPT(cfg), (torch.randint(0, 128, (8, 16)),)


def constant():
    return 42
'''


def tiny_gpt(dim: int = 32, vocab: int = 128) -> GPT:
    """The GPT of ``models.py:build`` (``dim=64``: of ``wider``)."""
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=vocab, max_seq_len=16, dim=dim, n_layers=2, n_heads=4))


@dataclass
class Ctx:
    """What the rows share: a folder of files, a tiny GPT with one batch of tokens and
    a plan for it on 4 devices (its JSON) and on 1 device."""

    folder: Path
    tokens: torch.Tensor
    plan4: str
    plan1: Plan

    def write(self, name: str, content: str | bytes) -> str:
        """``content`` written to ``name`` in the folder; its path."""
        path = self.folder / name
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
        return str(path)

    def plan_edit(self, **fields: Any) -> str:
        """The 4-device plan's JSON with ``fields`` replaced (None: removed)."""
        data = json.loads(self.plan4)
        for k, v in fields.items():
            if v is None:
                data.pop(k)
            else:
                data[k] = v
        return json.dumps(data)

    def plan_file(self, text: str) -> str:
        """A plan file holding ``text``."""
        return self.write("edited-plan.json", text)


CPU4 = autopar.Cluster("cpu", 1, 4)
CLI4 = ["--gpu", "cpu", "--gpus-per-node", "4"]


@pytest.fixture(scope="module")
def ctx(tmp_path_factory: pytest.TempPathFactory) -> Ctx:
    folder = tmp_path_factory.mktemp("bad-inputs")
    (folder / "models.py").write_text(MODELS)
    tokens = torch.randint(0, 128, (8, 16))
    plan4 = autopar.plan(tiny_gpt(), (tokens,), cluster=CPU4, tp=2, precision="fp32")
    plan1 = autopar.plan(tiny_gpt(), (tokens,), cluster=autopar.Cluster("cpu", 1, 1),
                         precision="fp32")
    return Ctx(folder, tokens, plan4.to_json(), plan1)


# --- models that cannot be captured as they are --------------------------------------------


class ReadsNumpy(nn.Module):
    """Reads tensor values in Python."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * float(x.detach().numpy().mean())


class Branches(nn.Module):
    """Branches on a tensor value."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x)
        if y.sum() > 0:
            return y * 2
        return y


class Selects(nn.Module):
    """Boolean indexing: a shape that depends on tensor values."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x)
        return y[y > 0].sum().expand(x.shape[0], 8)


class Scaled(nn.Module):
    """A forward that takes a number beside its tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        return self.proj(x) * scale


# --- the table -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sub:
    """An expected message given by a distinctive, complete part of it."""

    text: str


Message = str | Sub | re.Pattern


@dataclass(frozen=True)
class Bad:
    """One bad input: ``call(ctx)`` must raise ``error`` with ``message`` (a Warning
    class: warn it and return; None: return a Plan whose notes hold it)."""

    label: str
    call: Callable[[Ctx], Any]
    error: type[BaseException] | None
    message: Message


def plan4(c: Ctx, model: nn.Module | None = None, inputs: Any = None, **kw: Any) -> Plan:
    """``autopar.plan`` on 4 CPU processes (the tiny GPT and its tokens by default)."""
    return autopar.plan(model if model is not None else tiny_gpt(),
                        inputs if inputs is not None else (c.tokens,),
                        cluster=kw.pop("cluster", CPU4), **kw)


def estimate4(c: Ctx, spec: Spec, **kw: Any) -> Plan:
    """``autopar.estimate`` of the tiny GPT on 4 CPU processes."""
    return autopar.estimate(tiny_gpt(), (c.tokens,), spec, cluster=kw.pop("cluster", CPU4), **kw)


@contextlib.contextmanager
def one_rank() -> Iterator[None]:
    """A gloo process group of this process alone, for the checks of ``apply_plan``."""
    import torch.distributed as dist

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def apply_alone(model: nn.Module, plan: Plan) -> Any:
    """``apply_plan`` in a job of one rank."""
    from autopar.runtime import apply_plan

    with one_rank():
        return apply_plan(model, plan)


X8 = torch.randn(8, 8)
PLAN_AGAIN = "fix it or re-run `autopar plan` to write a valid plan"
FINGERPRINT = re.compile(
    r"the plan was made for another model: plan\.model = 'GPT' with parameters of "
    r"fingerprint [0-9a-f]{16}, but this GPT's parameters \(names and shapes\) have "
    r"fingerprint [0-9a-f]{16}; re-plan for this model \(autopar\.plan, or `autopar plan` "
    r"with the same model factory\)")

API: list[Bad] = [
    Bad("untraceable: reads .numpy()", lambda c: plan4(c, ReadsNumpy(), (X8,)), CaptureError,
        Sub("cannot capture module '<root>' (ReadsNumpy) at test_bad_inputs.py:")),
    Bad("untraceable: the hint", lambda c: plan4(c, ReadsNumpy(), (X8,)), CaptureError,
        Sub("Hint: the forward reads tensor values in Python (.numpy(), .tolist(), ...); "
            "keep that computation in torch operations.")),
    Bad("data-dependent control flow", lambda c: plan4(c, Branches(), (X8,)), CaptureError,
        Sub("(`if y.sum() > 0:`): GuardOnDataDependentSymNode: Could not guard on "
            "data-dependent expression")),
    Bad("data-dependent control flow: the hint", lambda c: plan4(c, Branches(), (X8,)),
        CaptureError,
        Sub("Hint: the forward branches on tensor values (data-dependent control flow); make "
            "the branch depend only on shapes or configuration (or use torch.cond), or pass "
            "example inputs that take the training path.")),
    Bad("data-dependent shape", lambda c: plan4(c, Selects(), (X8,)), CaptureError,
        Sub("(`return y[y > 0].sum().expand(x.shape[0], 8)`): index.Tensor gives a tensor "
            "whose shape depends on tensor values (GuardOnDataDependentSymNode")),
    Bad("data-dependent shape: the hint", lambda c: plan4(c, Selects(), (X8,)), CaptureError,
        Sub("Hint: autopar plans tensors of fixed shapes; compute with a mask (torch.where, "
            "or multiplying by the condition) instead of boolean indexing, nonzero or "
            "unique.")),
    Bad("a function, not a module", lambda c: plan4(c, lambda x: x, (X8,)), CaptureError,
        "model must be a torch.nn.Module, got function; wrap the function in an nn.Module "
        "whose forward calls it"),
    Bad("a number among the inputs", lambda c: plan4(c, Scaled(), (X8, 2.0)), CaptureError,
        "example_inputs must be a tensor or a tuple of tensors, got (Tensor, float); pass "
        "only the forward's tensor inputs, positionally, e.g. (token_ids,), and fix its "
        "other arguments (numbers, flags, keyword inputs) in a wrapper module whose forward "
        "takes only those tensors"),
    Bad("keyword inputs", lambda c: plan4(c, inputs={"idx": c.tokens}), ConfigError,
        "example_inputs is a dict (idx): keyword inputs are not captured; pass the forward's "
        "inputs positionally, as a tuple in its order, or wrap the model in a module whose "
        "forward takes them positionally"),
    Bad("no inputs", lambda c: plan4(c, inputs=()), ConfigError,
        "example_inputs is empty; pass one global batch of the forward's positional inputs, "
        "e.g. (token_ids,)"),
    Bad("inputs of numbers", lambda c: plan4(c, inputs=[1, 2]), ConfigError,
        "example_inputs must be a tensor or a tuple of tensors whose first dim is the batch, "
        "but its first input is int; pass one global batch of the forward's positional "
        "inputs, e.g. (token_ids,)"),
    Bad("an input missing", lambda c: plan4(c, Scaled(), (X8,)), CaptureError,
        "cannot capture module '<root>' (Scaled): TypeError: Scaled.forward() missing 1 "
        "required positional argument: 'scale'. Hint: example_inputs do not match "
        "forward(x, scale); pass one tensor per positional argument, as a tuple in the "
        "forward's order."),
    Bad("token ids as floats", lambda c: plan4(c, inputs=(c.tokens.float(),)), CaptureError,
        Sub("Hint: check the example inputs' dtypes: token ids must be int64 (torch.long).")),
    Bad("heads not divisible by tp", lambda c: plan4(c, cluster=autopar.Cluster("cpu", 1, 6),
                                                     tp=3), ConfigError,
        "tensor-parallel degree tp=3 does not divide the 4 attention heads of module "
        "'blocks.0.attn'; choose tp among [1, 2, 4]"),
    Bad("vocabulary not divisible by tp",
        lambda c: plan4(c, tiny_gpt(vocab=130), (torch.randint(0, 130, (8, 16)),), tp=4,
                        precision="fp32"), None,
        "tp=4 does not divide the 130 rows of embedding 'tok_emb': its weight stays whole on "
        "every tp rank; pad the vocabulary to a multiple of 4 (as Megatron-LM does) to split "
        "it"),
    Bad("tp not dividing the world", lambda c: plan4(c, tp=3), ConfigError,
        "tp=3 does not divide the 4 devices of the cluster"),
    Bad("batch not divisible by dp", lambda c: plan4(c, global_batch=6, dp=4), ConfigError,
        "no pipeline x data x context x tensor parallel layout of 4 devices divides the "
        "global batch of 6 under the requested degrees (pp=None, dp=4, cp=None, tp=None, "
        "microbatch=None); choose a global batch divisible by the data-parallel degree, or "
        "fewer pipeline stages than the model has blocks"),
    Bad("estimate: batch not divisible by dp",
        lambda c: estimate4(c, Spec(dp=4), global_batch=6), ConfigError,
        "the global batch 6 is not divisible by dp=4"),
    Bad("estimate: degrees not filling the world", lambda c: estimate4(c, Spec(dp=2, tp=1)),
        ConfigError, "dp=2 x tp=1 x pp=1 x cp=1 uses 2 devices but the cluster has 4"),
    Bad("a 1 kB budget", lambda c: plan4(c, memory_budget=1000), NoFeasiblePlanError,
        re.compile(r"no plan fits in 1\.00 kB per device: the smallest needs at least "
                   r"[1-9][0-9.]* kB \(.*, with the most saving recomputation; .*\)\. Raise "
                   r"memory_budget, use more devices, or a smaller global batch\.")),
    Bad("recomputation fixed, budget too small",
        lambda c: estimate4(c, Spec(tp=2, recompute="none"), memory_budget=30_000),
        NoFeasiblePlanError,
        Sub("kB (dp=2 tp=2 mb=4x1 zero=0, with recompute='none' as asked; largest consumers "
            "without recomputation: ")),
    Bad("recomputation fixed: what to try",
        lambda c: estimate4(c, Spec(tp=2, recompute="none"), memory_budget=30_000),
        NoFeasiblePlanError,
        Sub("Raise memory_budget, use more devices, allow more recomputation "
            "(recompute='full', or leave it to the solver), or a smaller global batch.")),
    Bad("NaN budget", lambda c: plan4(c, memory_budget=float("nan")), ConfigError,
        "memory_budget=nan: expected a positive number of bytes per device, e.g. 40e9 (None: "
        "the GPU's memory less the profile's reserve)"),
    Bad("infinite budget", lambda c: plan4(c, memory_budget=float("inf")), ConfigError,
        "memory_budget=inf: expected a positive number of bytes per device, e.g. 40e9 (None: "
        "the GPU's memory less the profile's reserve)"),
    Bad("negative budget", lambda c: plan4(c, memory_budget=-1), ConfigError,
        "memory_budget=-1: expected a positive number of bytes per device, e.g. 40e9 (None: "
        "the GPU's memory less the profile's reserve)"),
    Bad("negative batch", lambda c: plan4(c, global_batch=-8), ConfigError,
        "global_batch=-8: expected a positive integer"),
    Bad("NaN batch", lambda c: plan4(c, global_batch=float("nan")), ConfigError,
        "global_batch=nan: expected a positive integer"),
    Bad("NaN bandwidth", lambda c: autopar.Cluster("cpu", 1, 4, intra_node_bandwidth=float("nan")),
        ConfigError, "Cluster(intra_node_bandwidth=nan): expected a positive, finite number "
        "(GB/s per GPU), or None for the profile's own figure"),
    Bad("negative bandwidth", lambda c: autopar.Cluster("h100-sxm", 2, inter_node_bandwidth=-50),
        ConfigError, "Cluster(inter_node_bandwidth=-50): expected a positive, finite number "
        "(GB/s per GPU), or None for the profile's own figure"),
    Bad("infinite memory", lambda c: autopar.Cluster("h100-sxm", memory_gb=float("inf")),
        ConfigError, "Cluster(memory_gb=inf): expected a positive, finite number (GB of "
        "device memory), or None for the profile's own figure"),
    Bad("no nodes", lambda c: autopar.Cluster("h100-sxm", nodes=0), ConfigError,
        "Cluster(nodes=0): expected a positive integer"),
    Bad("half a GPU per node", lambda c: autopar.Cluster("h100-sxm", gpus_per_node=2.5),
        ConfigError, "Cluster(gpus_per_node=2.5): expected a positive integer"),
    Bad("unknown GPU", lambda c: autopar.Cluster("h300"), ConfigError,
        "unknown GPU 'h300'; known profiles: a100-80g, cpu, h100-sxm, h100-sxm-500w, h200 (or "
        "pass the path of a profile JSON file)"),
    Bad("negative degree", lambda c: Spec(tp=-2), ConfigError,
        "tp=-2: expected a positive integer"),
    Bad("NaN degree", lambda c: plan4(c, pp=float("nan")), ConfigError,
        "pp=nan: expected an integer"),
    Bad("NaN time limit", lambda c: plan4(c, time_limit_s=float("nan")), ConfigError,
        "time_limit_s=nan: expected a number of seconds, 0 or more (None: search until the "
        "best plan is proven)"),
    Bad("a loss that is not a function", lambda c: plan4(c, loss_fn="cross_entropy"),
        ConfigError, "loss_fn='cross_entropy': expected a function loss_fn(output, targets) "
        "returning a scalar tensor (None: cross-entropy over the output's last dim)"),
    Bad("a cluster that is not a Cluster",
        lambda c: autopar.estimate(tiny_gpt(), (c.tokens,), Spec(), cluster={"gpu": "cpu"}),
        ConfigError, "cluster must be an autopar.Cluster, got dict"),
    Bad("parallelize outside a job",
        lambda c: autopar.parallelize(tiny_gpt(), (c.tokens,), cluster=CPU4), ConfigError,
        Sub("parallelize() must run inside a distributed job, but no process group exists")),
    Bad("world size not the plan's",
        lambda c: apply_alone(tiny_gpt(), Plan.from_json(c.plan4)), LoweringError,
        "the plan's mesh {'pp': 2, 'dp': 1, 'tp': 2} has 4 devices but the process group "
        "has 1 rank; run with 4 processes, or make a plan for 1 device"),
    Bad("a plan for another model", lambda c: apply_alone(tiny_gpt(dim=64), c.plan1),
        LoweringError, FINGERPRINT),
]

PLAN_FILES: list[Bad] = [
    Bad("truncated plan", lambda c: Plan.from_json(c.plan4[:len(c.plan4) // 2]),
        PlanFormatError, Sub("the plan is not valid JSON (")),
    Bad("empty plan", lambda c: Plan.from_json(""), PlanFormatError,
        "the plan is not valid JSON (Expecting value: line 1 column 1 (char 0)); pass the "
        "text written by Plan.to_json() or `autopar plan --json`"),
    Bad("pickled plan", lambda c: Plan.from_json(pickle.dumps(json.loads(c.plan4))),
        PlanFormatError, "the plan is not JSON text (a pickle or other binary file?); pass "
        "the text written by Plan.to_json() or `autopar plan --json`"),
    Bad("a list, not a plan", lambda c: Plan.from_json("[]"), PlanFormatError,
        "the plan JSON must be an object with the fields of autopar.Plan"),
    Bad("future version", lambda c: Plan.from_json(c.plan_edit(version=4)), PlanFormatError,
        "plan format version 4 is not supported (this autopar reads versions 1 to 3); the "
        "plan was written by a newer autopar: upgrade autopar, or re-run `autopar plan` with "
        "this one"),
    Bad("no version", lambda c: Plan.from_json(c.plan_edit(version=None)), PlanFormatError,
        "plan format version None is not supported (this autopar reads versions 1 to 3); "
        "re-run `autopar plan` to write a current plan"),
    Bad("a field removed", lambda c: Plan.from_json(c.plan_edit(mesh=None)), PlanFormatError,
        "the plan is missing the field(s) mesh; re-run `autopar plan` to write a complete "
        "plan"),
    Bad("a field added", lambda c: Plan.from_json(c.plan_edit(speedup=2)), PlanFormatError,
        Sub("the plan has unknown field(s) speedup (this autopar's Plan has model, "
            "graph_hash, cluster, mesh,")),
    Bad("a number as text", lambda c: Plan.from_json(c.plan_edit(global_batch="8")),
        PlanFormatError,
        f"the plan's field 'global_batch' must be an integer, got \"8\"; {PLAN_AGAIN}"),
    Bad("a section of the wrong type", lambda c: Plan.from_json(c.plan_edit(pipeline=[1])),
        PlanFormatError, "the plan's field 'pipeline' must be an object with the fields of "
        f"PipelinePlan or null, got [1]; {PLAN_AGAIN}"),
    Bad("a module with an unknown field",
        lambda c: Plan.from_json(c.plan_edit(modules={"head": {
            "path": "head", "module_type": "Linear", "shards": 2}})), PlanFormatError,
        "the plan's modules[\"head\"] has unknown field(s) shards (this autopar's ModulePlan "
        "has path, module_type, style, input_layout, desired_input_layout, output_layout, "
        "params, time_s); remove them, or re-run `autopar plan`"),
    Bad("a negative degree", lambda c: Plan.from_json(c.plan_edit(mesh={"pp": 2, "dp": -1,
                                                                        "tp": 2})),
        PlanFormatError, "the plan's mesh {'pp': 2, 'dp': -1, 'tp': 2} must map axis names to "
        "positive integers"),
    Bad("a NaN", lambda c: Plan.from_json(c.plan4.replace('"mfu": ', '"mfu": NaN, "_": ', 1)),
        PlanFormatError, "the plan is not valid JSON (NaN is not a number a plan or profile "
        "may hold); pass the text written by Plan.to_json() or `autopar plan --json`"),
    Bad("the batch edited", lambda c: Plan.from_json(c.plan_edit(global_batch=16)),
        PlanFormatError, "the plan's global_batch 16 is not microbatch_size 4 x "
        "num_microbatches 2 x dp 1; was it edited? Re-run `autopar plan` with --global-batch "
        "16"),
    Bad("a placement edited", lambda c: Plan.from_json(c.plan_edit(params={
        **json.loads(c.plan4)["params"], "head.weight": ["R", "S(x)"]})), PlanFormatError,
        "placement 'S(x)' is not one of 'R', 'P', 'S(<dim>)' or 'S(<dim>)/<pieces>'"),
    Bad("an unknown precision", lambda c: Plan.from_json(c.plan_edit(precision="fp4")),
        PlanFormatError, "the plan's precision 'fp4' or optimizer 'adamw' is unknown; "
        "expected one of fp32, bf16, fp16, fp8 and one of adam, adamw, sgd"),
    Bad("the pipeline removed", lambda c: Plan.from_json(c.plan_edit(pipeline=None)),
        PlanFormatError, "the mesh has pp=2 but the plan has no pipeline section"),
    Bad("a version-2 plan, without a fingerprint",
        lambda c: Plan.from_json(c.plan_edit(version=2, model_hash=None)), UserWarning,
        "the plan was written in format version 2, without a model fingerprint: autopar "
        "cannot check that it is applied to the model it was made for; re-run `autopar plan` "
        "to write a version 3 plan"),
]


def _cpu_profile(**fields: Any) -> str:
    """The shipped CPU profile's JSON with ``fields`` replaced (None: removed)."""
    data = json.loads((SHIPPED / "cpu.json").read_text())
    data.pop("tables", None)
    for k, v in fields.items():
        if v is None:
            data.pop(k)
        else:
            data[k] = v
    return json.dumps(data)


def _measured(edit: Callable[[dict], None] = lambda d: None) -> str:
    """A profile as `autopar profile` writes it (the shipped H100 measurement, marked
    as measured with this torch), changed by ``edit``."""
    data = json.loads((SHIPPED / "measured" / "h100-sxm.profile.json").read_text())
    data["provenance"]["torch"] = torch.__version__
    edit(data)
    return json.dumps(data)


def profile(c: Ctx, text: str | bytes) -> autopar.Cluster:
    """A Cluster planned with the profile ``text`` (written to a file)."""
    return autopar.Cluster("h100-sxm", profile=c.write("profile.json", text))


def _set(path: str, value: Any) -> Callable[[dict], None]:
    """An edit of a profile document: the value at a dotted ``path`` replaced."""
    def edit(d: dict) -> None:
        *keys, last = path.split(".")
        for k in keys:
            d = d[int(k)] if isinstance(d, list) else d[k]
        d[last] = value
    return edit


PROFILE_FILES: list[Bad] = [
    Bad("no such profile", lambda c: autopar.Cluster("cpu", profile="/no/such/gpu.json"),
        ConfigError, "hardware profile file '/no/such/gpu.json' does not exist"),
    Bad("a profile that is not JSON", lambda c: profile(c, "gemm 1.2 TFLOP/s"),
        PlanFormatError, Sub("profile.json is not valid JSON: Expecting value: line 1 column "
                             "1 (char 0); regenerate it with `autopar profile`, or fix the "
                             "file")),
    Bad("a truncated profile", lambda c: profile(c, _measured()[:5000]), PlanFormatError,
        Sub("profile.json is not valid JSON: ")),
    Bad("a pickled profile", lambda c: profile(c, pickle.dumps({"name": "h100"})),
        PlanFormatError, Sub("profile.json is not JSON text (a pickle or other binary "
                             "file?); profiles are JSON only, as `autopar profile` writes "
                             "them")),
    Bad("a profile of a future format", lambda c: profile(c, _measured(_set(
        "format", "autopar-profile/2"))), PlanFormatError,
        Sub("profile.json has format 'autopar-profile/2', written by a newer autopar (this "
            "one reads 'autopar-profile/1'); upgrade autopar, or re-run `autopar profile` "
            "with this one")),
    Bad("a profile of an unknown format", lambda c: profile(c, _cpu_profile(format="nccl")),
        PlanFormatError, Sub("profile.json has an unknown format 'nccl'; a measured profile "
                             "has format 'autopar-profile/1' (written by `autopar "
                             "profile`), a hand-written one no format field")),
    Bad("a plan given as a profile", lambda c: profile(c, c.plan4), PlanFormatError,
        Sub("profile.json is a plan (written by `autopar plan --json`), not a hardware "
            "profile; pass a shipped profile name or a file written by `autopar profile`")),
    Bad("a profile without a name", lambda c: profile(c, _cpu_profile(name=None)),
        PlanFormatError, Sub("profile.json is missing the field 'name'")),
    Bad("a NaN in a profile",
        lambda c: profile(c, _cpu_profile().replace('"value": 0.', '"value": NaN, "_": 0.', 1)),
        PlanFormatError, Sub("profile.json is not valid JSON: NaN is not a number a plan or "
                             "profile may hold")),
    Bad("negative memory in a profile",
        lambda c: profile(c, _cpu_profile(memory_bytes={"value": -1, "source": "typo"})),
        PlanFormatError, Sub("profile.json: field 'memory_bytes' must be a finite, "
                             "non-negative number (as {\"value\": ..., \"source\": ...}), got "
                             "{'value': -1, 'source': 'typo'}")),
    Bad("a negative measured rate", lambda c: profile(c, _measured(_set(
        "summary.gemm_peak_flop_per_s.bf16.flop_per_s", -1))), PlanFormatError,
        Sub("profile.json: 'summary.gemm_peak_flop_per_s.bf16.flop_per_s' must be a positive "
            "number, got -1; regenerate the file with `autopar profile`")),
    Bad("a measured row edited", lambda c: profile(c, _measured(_set("tables.gemm.0.m", "big"))),
        PlanFormatError, Sub("profile.json: table 'gemm' has a malformed row (ValueError: "
                             "could not convert string to float: 'big'); regenerate it with "
                             "`autopar profile`")),
    Bad("a profile from another torch",
        lambda c: profile(c, _measured(_set("provenance.torch", "1.13.1+cu117"))),
        UserWarning, re.compile(
            r"hardware profile .*profile\.json was measured with torch 1\.13\.1\+cu117, and "
            r"this is torch " + re.escape(torch.__version__) + r": kernel times may differ "
            r"between releases, so the plan's predicted times may be off; re-run `autopar "
            r"profile` under this torch to measure it again")),
]


def _matches(message: Message, text: str) -> bool:
    """Whether ``text`` is ``message``: equal, containing a Sub, or matching a pattern."""
    if isinstance(message, Sub):
        return message.text in text
    if isinstance(message, re.Pattern):
        return message.fullmatch(text) is not None
    return text == message


def _check(row: Bad, c: Ctx) -> None:
    """Run one row: the one message, as the row's kind of answer."""
    if row.error is None:
        plan = row.call(c)
        assert any(_matches(row.message, n) for n in plan.notes), plan.notes
        return
    if issubclass(row.error, Warning):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            row.call(c)
        texts = [str(w.message) for w in caught if issubclass(w.category, row.error)]
        assert sum(_matches(row.message, t) for t in texts) == 1, texts
        return
    with pytest.raises(AutoparError) as err:
        row.call(c)
    assert isinstance(err.value, row.error), repr(err.value)
    text = str(err.value)
    assert _matches(row.message, text), text
    assert "Traceback" not in text and "\n" not in text.strip()


@pytest.mark.parametrize("row", API + PLAN_FILES + PROFILE_FILES, ids=lambda r: r.label)
def test_one_clear_message(ctx: Ctx, row: Bad) -> None:
    _check(row, ctx)


# --- the command line ------------------------------------------------------------------------


@dataclass(frozen=True)
class BadCommand:
    """One bad command line: ``argv(ctx)`` must exit with status 2 and print ``line`` as
    its only error line on stderr."""

    label: str
    argv: Callable[[Ctx], list[str]]
    line: Message


def _models(c: Ctx, factory: str) -> str:
    """The spec ``path/to/models.py:factory`` of the rows' model file."""
    return f"{c.folder / 'models.py'}:{factory}"


def _plan_path(c: Ctx) -> str:
    """The 4-device plan, written as `autopar plan --json` writes it."""
    return c.write("plan.json", c.plan4)


ERROR = "autopar: error: "
USAGE = "autopar plan: error: argument "

CLI: list[BadCommand] = [
    BadCommand("unknown model", lambda c: ["plan", "gpt5", *CLI4], re.compile(
        ERROR + r"unknown model 'gpt5'; known models: tiny-gpt, .*, deepseek-v3 \(or pass "
        r"path/to/file\.py:factory\)")),
    BadCommand("a factory that is not there", lambda c: ["plan", _models(c, "build2"), *CLI4],
               re.compile(ERROR + r".*models\.py has no callable named 'build2'; it defines "
                          r"build, constant, wider")),
    BadCommand("a factory returning no model",
               lambda c: ["plan", _models(c, "constant"), *CLI4],
               re.compile(ERROR + r".*models\.py:constant must return a model, \(model, "
                          r"example_inputs\) or \(model, example_inputs, example_targets\) "
                          r"with tensor inputs and targets, got int")),
    BadCommand("unknown GPU", lambda c: ["plan", "tiny-gpt", "--gpu", "h300"],
               ERROR + "unknown GPU 'h300'; known profiles: a100-80g, cpu, h100-sxm, "
               "h100-sxm-500w, h200 (or pass the path of a profile JSON file)"),
    BadCommand("a budget in unknown units",
               lambda c: ["plan", "tiny-gpt", *CLI4, "--memory-budget", "40XB"],
               USAGE + "--memory-budget: memory size '40XB' is not like '40GB', '80GiB' or a "
               "byte count"),
    BadCommand("a NaN budget", lambda c: ["plan", "tiny-gpt", *CLI4, "--memory-budget", "nan"],
               USAGE + "--memory-budget: memory size 'nan' is not like '40GB', '80GiB' or a "
               "byte count"),
    BadCommand("a NaN bandwidth",
               lambda c: ["plan", "tiny-gpt", *CLI4, "--intra-node-bandwidth", "nan"],
               ERROR + "Cluster(intra_node_bandwidth=nan): expected a positive, finite number "
               "(GB/s per GPU), or None for the profile's own figure"),
    BadCommand("no batch", lambda c: ["plan", "tiny-gpt", *CLI4, "--global-batch", "0"],
               ERROR + "global_batch=0: expected a positive integer"),
    BadCommand("a negative degree", lambda c: ["plan", "tiny-gpt", *CLI4, "--tp", "-2"],
               ERROR + "tp=-2: expected a positive integer"),
    BadCommand("heads not divisible by tp",
               lambda c: ["plan", "tiny-gpt", "--gpu", "cpu", "--gpus-per-node", "8", "--tp",
                          "8"],
               ERROR + "tensor-parallel degree tp=8 does not divide the 4 attention heads of "
               "module 'blocks.0.attn'; choose tp among [1, 2, 4]"),
    BadCommand("compare: tp not dividing the world",
               lambda c: ["compare", "tiny-gpt", *CLI4, "--tp", "3"],
               ERROR + "tp=3 x pp=1 x cp=1 does not divide the 4 devices of the cluster"),
    BadCommand("a plan file in a missing folder",
               lambda c: ["plan", "tiny-gpt", *CLI4, "--json", "/no/such/folder/plan.json"],
               ERROR + "cannot write the plan to '/no/such/folder/plan.json': its folder "
               "'/no/such/folder' does not exist; pass a file path in an existing folder"),
    BadCommand("a pickled profile", lambda c: [
        "plan", "tiny-gpt", "--gpu", c.write("gpu.pkl", pickle.dumps({"name": "x"}))],
        re.compile(ERROR + r"hardware profile .*gpu\.pkl is not JSON text \(a pickle or "
                   r"other binary file\?\); profiles are JSON only, as `autopar profile` "
                   r"writes them")),
    BadCommand("codegen: no plan file",
               lambda c: ["codegen", "/no/plan.json", "--model", _models(c, "build")],
               ERROR + "cannot read the plan '/no/plan.json': No such file or directory"),
    BadCommand("codegen: a pickled plan", lambda c: [
        "codegen", c.write("plan.pkl", pickle.dumps(json.loads(c.plan4))), "--model",
        _models(c, "build")],
        ERROR + "the plan is not JSON text (a pickle or other binary file?); pass the text "
        "written by Plan.to_json() or `autopar plan --json`"),
    BadCommand("codegen: a truncated plan", lambda c: [
        "codegen", c.plan_file(c.plan4[:-40]), "--model", _models(c, "build")],
        re.compile(ERROR + r"the plan is not valid JSON \(.*\); pass the text written by "
                   r"Plan\.to_json\(\) or `autopar plan --json`")),
    BadCommand("codegen: a plan of a future version", lambda c: [
        "codegen", c.plan_file(c.plan_edit(version=7)), "--model", _models(c, "build")],
        ERROR + "plan format version 7 is not supported (this autopar reads versions 1 to "
        "3); the plan was written by a newer autopar: upgrade autopar, or re-run `autopar "
        "plan` with this one"),
    BadCommand("codegen: a plan for another model", lambda c: [
        "codegen", _plan_path(c), "--model", _models(c, "wider"), "-o",
        str(c.folder / "train.py")], re.compile(ERROR + FINGERPRINT.pattern)),
    BadCommand("codegen: a model without its factory",
               lambda c: ["codegen", _plan_path(c), "--model", str(c.folder / "models.py")],
               re.compile(ERROR + r"--model '.*models\.py' is not of the form "
                          r"path/to/file\.py:factory")),
    BadCommand("codegen: a program in a missing folder", lambda c: [
        "codegen", _plan_path(c), "--model", _models(c, "build"), "-o", "/no/such/train.py"],
        ERROR + "cannot write the program to '/no/such/train.py': its folder '/no/such' does "
        "not exist; pass a file path in an existing folder"),
    BadCommand("profile: a NaN time limit",
               lambda c: ["profile", "--device", "cpu", "--time-limit-s", "nan", "--out",
                          str(c.folder / "p.json")],
               ERROR + "--time-limit-s nan: expected a positive number of seconds"),
    BadCommand("profile: a damaged partial file", lambda c: [
        "profile", "--device", "cpu", "--resume", "--out",
        c.write("q.json.partial.jsonl", "{\"provenance\": {\"device_na\n")[:-len(".partial.jsonl")]],
        re.compile(ERROR + r".*q\.json\.partial\.jsonl is not a partial profile: line 1 is "
                   r"not JSON; delete it or run without --resume")),
    BadCommand("demo: no ranks", lambda c: ["demo", "--ranks", "0"],
               ERROR + "--ranks 0: expected a positive integer"),
]
if not torch.cuda.is_available():
    CLI.append(BadCommand(
        "profile: no GPU", lambda c: ["profile", "--device", "cuda"],
        ERROR + "--device cuda: this machine has no CUDA device that torch can use "
        "(torch.cuda.is_available() is False); profile its CPU with --device cpu, or run on "
        "the GPU to be measured"))


@pytest.mark.parametrize("row", CLI, ids=lambda r: f"cli: {r.label}")
def test_one_clear_line(ctx: Ctx, row: BadCommand) -> None:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main(row.argv(ctx))
        except SystemExit as e:  # argparse's own errors
            status = e.code
    lines = err.getvalue().splitlines()
    assert status == 2, (status, err.getvalue())
    assert "Traceback" not in err.getvalue()
    errors = [s for s in lines if ": error: " in s]
    assert len(errors) == 1 and errors[0] == lines[-1], lines
    assert _matches(row.line, lines[-1]), lines[-1]
    assert "plan written" not in out.getvalue() and "wrote " not in out.getvalue()


def test_the_table_is_large() -> None:
    """At least 40 distinct bad inputs, each with its own label."""
    labels = [r.label for r in API + PLAN_FILES + PROFILE_FILES] + \
        [f"cli: {r.label}" for r in CLI]
    assert len(labels) >= 40 and len(set(labels)) == len(labels)


def test_plans_round_trip_and_a_version_2_plan_still_runs_its_checks(ctx: Ctx) -> None:
    """The plan's new field survives JSON; a version-2 plan (no fingerprint) loads, with
    one warning, and is checked as before, without its fingerprint."""
    plan = Plan.from_json(ctx.plan4)
    assert plan.to_json() == ctx.plan4 and len(plan.model_hash) == 16
    with pytest.warns(UserWarning, match="without a model fingerprint"):
        old = Plan.from_json(ctx.plan_edit(version=2, model_hash=None))
    assert old.model_hash == "" and old.version == 3
    from autopar.runtime.lower import check_model_hash

    check_model_hash(tiny_gpt(dim=64), old)  # nothing to check it against
