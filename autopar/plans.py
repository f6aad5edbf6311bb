"""The Plan: the only thing that crosses from planning to running.

A Plan is plain data with a versioned JSON round-trip. It says how to lay the model
out on a named device mesh — per parameter and per activation placements, and, for
the lowering, one :class:`ModulePlan` per module that owns parameters — and carries
what the cost model predicted for it and how the solver found it.

Placements are written per mesh axis, in mesh order, as strings: ``"R"``
(Replicate), ``"S(d)"`` (Shard along tensor dim d) and ``"P"`` (Partial sum); see
:mod:`autopar.sharding` for their grammar and
:func:`autopar.runtime.tensor_parallel.parse_placement` for the conversion to
``torch.distributed.tensor`` classes. The memory choices a plan names (recomputation
modes, FSDP units) are :mod:`autopar.memory_choices`'s, re-exported here.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any

from autopar.cost_models.memory import OPTIMIZERS, PRECISIONS
from autopar.errors import PlanFormatError
from autopar.memory_choices import RECOMPUTE, SELECTIVE_SAVE_OPS, fsdp_unit
from autopar.schema import build, strict_loads

__all__ = ["PLAN_FORMAT_VERSION", "READABLE_VERSIONS", "TP_STYLES", "SCHEDULES", "RECOMPUTE",
           "SELECTIVE_SAVE_OPS", "fsdp_unit", "model_fingerprint", "ModulePlan", "ExpertPlan",
           "ContextPlan", "StagePlan", "PipelinePlan", "LayoutOption", "LayoutExplanation", "Plan"]

PLAN_FORMAT_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
"""Versions :meth:`Plan.from_json` reads: 1 (no pipeline section: read with
pipeline=None) and 2 (no ``model_hash``: read with a warning that the plan cannot be
checked against the model it is applied to) as version 3."""

TP_STYLES = ("replicate", "colwise", "rowwise", "sequence_parallel")
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "interleaved_zero_bubble", "zbv")


@dataclass
class ModulePlan:
    """How the lowering treats one module that owns parameters.

    Attributes:
        path: module path in the user's model, e.g. ``"blocks.0.attn.q"``.
        module_type: class name, e.g. ``"Linear"``, ``"Embedding"``, ``"LayerNorm"``.
        style: tensor-parallel style on the ``tp`` axis: "replicate" (no tensor
            parallelism), "colwise" (Linear weight split along its output features,
            Embedding along its embedding dim), "rowwise" (Linear weight split along
            its input features, Embedding along its vocabulary) or
            "sequence_parallel" (replicated parameters, activations split along the
            sequence dim).
        input_layout: ``tp``-axis placement of the activation the module receives.
        desired_input_layout: ``tp``-axis placement the module computes on (the
            lowering redistributes from ``input_layout`` to it).
        output_layout: ``tp``-axis placement the module hands on (the lowering
            reduces a partial result to it).
        params: local parameter name -> placements on every mesh axis.
        time_s: predicted forward + backward time of the module's ops per step.
    """

    path: str
    module_type: str
    style: str = "replicate"
    input_layout: str = "R"
    desired_input_layout: str = "R"
    output_layout: str = "R"
    params: dict[str, list[str]] = field(default_factory=dict)
    time_s: float = 0.0


@dataclass
class ExpertPlan:
    """A mixture-of-experts module whose experts are split over the ``ep`` mesh axis
    (:mod:`autopar.strategies.experts`): the lowering shards its parameters along
    their expert dim over ``ep`` and moves the tokens by an all-to-all over ``ep`` on
    the way in (from split by sample to split by expert) and on the way out.

    Attributes:
        path: module path, e.g. ``"layers.1.ffn.experts"``.
        experts: how many experts the module holds whole.
        input_dim / output_dim: the expert dim of its input and of its output.
        batch_dim: the batch dim of both.
        params: local parameter name -> its expert dim.
        kind: "stacked" (its input and output hold slots per expert: an all-to-all
            regroups them), "gathered" (every expert runs on every token and a gate
            combines them: the ep group's tokens are all-gathered in, the gate
            exchanged to this rank's experts, and the output, a partial sum over them,
            reduce-scattered back; ``input_dim`` is the gate's expert dim,
            ``output_dim`` -1) or "routed" (a dropless module fed tokens, their
            experts' indices and weights, as Hugging Face's ``MixtralExperts``: each
            token row is sent to its experts' ranks and back; the dims above are then
            -1).
        node_ranks: for a routed module whose ``ep`` group spans nodes, the group's
            members on each node when its tokens move in two legs (each token once
            to every node holding any of its experts, then to their ranks inside the
            node: :mod:`autopar.cost_models.expert_dispatch`); 1: one all-to-all over
            the whole group.
        folded: a routed module whose experts are split over the ``ep`` and ``tp``
            ranks together, each rank holding whole experts (Megatron-Core's MoE
            parallel folding, expert tensor parallelism 1): its tokens, split over tp,
            go to their experts' ranks among those ``ep`` x ``tp``
            (:attr:`Plan.expert_ranks`); False: split over ``ep`` alone.
    """

    path: str
    experts: int
    input_dim: int
    output_dim: int
    batch_dim: int = 0
    params: dict[str, int] = field(default_factory=dict)
    kind: str = "stacked"
    node_ranks: int = 1
    folded: bool = False


@dataclass
class StagePlan:
    """One pipeline stage: a contiguous run of the model's units on one pp rank.

    Attributes:
        index: the stage's position in the pipeline, 0 .. pp·virtual_stages − 1.
        rank: the ``pp`` coordinate of the devices that run it (``index % pp`` for
            the looped interleaved schedules; "V"-shaped for ``zbv``: stage i and
            stage 2·pp − 1 − i share rank i).
        units: the module paths the stage runs, in order. The units of a model are
            what comes before its repeated blocks (``"tok_emb"``, ``"pos_emb"``), each
            block (``"blocks.3"``) and what comes after (``"ln_f"``, ``"head"``); the
            loss runs on the last stage.
        forward_s / backward_s: predicted seconds per micro-batch.
        memory_bytes: predicted peak bytes per device of the rank for this stage
            (parameters, gradients, optimizer state and in-flight activations).
        backward_weight_s: the weight-gradient part of ``backward_s``, which the
            zero-bubble schedules run apart (their W operation).
        recompute_s / comm_s: the parts of ``forward_s + backward_s`` spent on
            recomputed forwards, and on collectives, resharding and ZeRO-3 parameter
            traffic, per micro-batch.
        static_bytes / activation_bytes: the stage's parameters, gradients and
            optimizer state, and the activations it keeps per micro-batch in flight.
            With the times above, the schedule simulation
            (:func:`autopar.solvers.schedule_sim.simulate`) reruns from the plan alone.
    """

    index: int
    rank: int
    units: list[str]
    forward_s: float = 0.0
    backward_s: float = 0.0
    memory_bytes: float = 0.0
    backward_weight_s: float = 0.0
    recompute_s: float = 0.0
    comm_s: float = 0.0
    static_bytes: float = 0.0
    activation_bytes: float = 0.0


@dataclass
class ContextPlan:
    """Context parallelism over the mesh axis ``cp``: every sequence split over its
    ranks in head-tail chunks (rank r holds chunks r and 2cp-1-r of 2cp, so causal
    attention costs each the same), attention replaced by ``variant``.

    Attributes:
        variant: "allgather", "ring" or "ulysses"
            (:mod:`autopar.runtime.context_parallel`).
        seq_len: tokens per sequence the plan was made for.
        inputs: the sequence dim of each graph input (the model's inputs, then the
            targets), None for one without a sequence: the runtime splits these.
        causal: whether the model's attention is causal.
        attention_s: predicted seconds per step of attention with the variant's exposed
            communication, on one rank.
    """

    variant: str
    seq_len: int
    inputs: list[int | None] = field(default_factory=list)
    causal: bool = True
    attention_s: float = 0.0


@dataclass
class PipelinePlan:
    """Pipeline parallelism over the mesh axis ``pp``.

    Attributes:
        schedule: one of :data:`SCHEDULES` ("gpipe", "1f1b", "interleaved_1f1b",
            "interleaved_zero_bubble", "zbv"), as in ``torch.distributed.pipelining``.
        virtual_stages: model chunks per pp rank (1 for gpipe and 1f1b, 2 for zbv).
        stages: the pp · virtual_stages stages in pipeline order.
        bubble_fraction: predicted idle fraction of a rank's step.
        p2p_s: predicted seconds of one activation transfer between stages.
    """

    schedule: str
    virtual_stages: int
    stages: list[StagePlan]
    bubble_fraction: float = 0.0
    p2p_s: float = 0.0


@dataclass
class LayoutOption:
    """One layout of a module, priced with every other choice of the plan kept
    (:func:`autopar.explain.explain_layouts`).

    Attributes:
        style, input_layout, desired_input_layout, output_layout, params: as in
            :class:`ModulePlan`.
        strategies: the names of the strategies of the module's ops that give it.
        terms: seconds per step by term (``compute_s``, ``recompute_s``, ``comm_s``
            (the module's own collectives), ``reshard_s`` (on its edges to the kept
            neighbours), ``optimizer_s``, and the whole step's ``exposed_param_comm_s``
            and ``exposed_host_s``: these add up to ``step_time_s`` less what the other
            modules cost), ``param_comm_s`` (its parameter traffic, mostly hidden) and
            ``memory_bytes`` (its share of the memory per device).
        step_time_s: the step with this layout (the intra-op objective; on a pipeline,
            of one pass over the stage mesh without the schedule).
        memory_bytes: the peak memory per device with this layout.
        fits: whether that peak is within the memory budget.
    """

    style: str
    input_layout: str
    desired_input_layout: str
    output_layout: str
    params: dict[str, list[str]] = field(default_factory=dict)
    strategies: list[str] = field(default_factory=list)
    terms: dict[str, float] = field(default_factory=dict)
    step_time_s: float = 0.0
    memory_bytes: float = 0.0
    fits: bool = True


@dataclass
class LayoutExplanation:
    """Why a module got its layout: the layout chosen and the others it could have had,
    each priced with every other choice of the plan kept (``plan(..., explain=[...])``).

    Attributes:
        module: the module, ``blocks.*`` standing for every block (as in the summary).
        module_type: its class name.
        count: how many modules share this decision (the instances of a repeated block).
        chosen: the plan's layout.
        alternatives: the other layouts, fastest first (those a fixed neighbour
            cannot convert to left out).
        memory_budget_bytes: the budget per device the plan was held to.
    """

    module: str
    module_type: str
    count: int
    chosen: LayoutOption
    alternatives: list[LayoutOption] = field(default_factory=list)
    memory_budget_bytes: float = 0.0


@dataclass
class Plan:
    """A complete parallelization plan with its predicted costs.

    Attributes:
        model: the model's name (class name or zoo name).
        graph_hash: fingerprint of the captured graph the plan was made for (its ops,
            shapes and parameters, for the example inputs it was captured with).
        model_hash: fingerprint of the model's parameters, their names and shapes
            (:func:`model_fingerprint`): the lowering refuses a plan whose model_hash
            differs from the model it is applied to; empty in plans written before
            format version 3 (and in plans written by hand), which are not checked.
        cluster: the cluster description (gpu, nodes, gpus_per_node, bandwidths).
        mesh: ordered mesh axes and their sizes, e.g. ``{"dp": 4, "tp": 2}``, or
            ``{"pp": 4, "dp": 2, "tp": 8}`` with pipelining (``pp`` outermost).
        global_batch: samples per optimizer step over all ranks.
        batch_source: where ``global_batch`` came from, in words the summary prints
            (:mod:`autopar.batch_default`): "the example inputs' batch; global_batch=
            sets it", "as asked, global_batch=", or the CLI's default rule; empty in
            plans written before it was recorded.
        microbatch_size: samples per forward/backward pass on one data-parallel rank.
        num_microbatches: micro-batches per optimizer step on one data-parallel rank
            (gradient-accumulation steps, or the pipeline's micro-batches).
        zero: ZeRO stage over ``dp`` (0 = replicated parameters, 3 = fully sharded).
        sequence_parallel: True when norms and pointwise ops run on sequence shards.
        precision: "fp32", "bf16", "fp16" or "fp8" (bf16 with float8 Linear products:
            priced, not run).
        optimizer: "adam", "adamw" or "sgd".
        params: parameter FQN -> placements per mesh axis other than ``pp`` (the
            placement inside its stage; the stage is found from ``pipeline``).
        activations: graph node name -> placements of its output per mesh axis
            other than ``pp``.
        modules: module path -> :class:`ModulePlan`.
        blocks: module paths of the repeated layers, in order (the units that the
            lowering wraps with ``fully_shard`` and activation checkpointing).
        step_time_s: predicted seconds per optimizer step.
        breakdown: predicted seconds by term: ``compute_s``, ``recompute_s``,
            ``exposed_comm_s``, ``bubble_s`` and ``optimizer_s`` add up to
            ``step_time_s`` (:data:`autopar.summary.STEP_TERMS`); the other keys
            (``comm_s``, ``reshard_s``, ``param_comm_s``, ``p2p_s``, ...) detail them.
        memory: predicted peak bytes per device by category (params, grads,
            optimizer, activations, total).
        throughput: predicted samples per second.
        mfu: predicted model FLOPs utilization (model FLOPs / (time x peak x devices)).
        solver: solver statistics (name, status, variables, constraints, time_s, ...).
        notes: human-readable remarks from the planner.
        pipeline: the pipeline stages and schedule, or None without pipelining.
        recompute: block path (as in ``blocks``) -> activation recomputation of that
            block: "none", "selective" (keep matrix-product outputs, recompute the
            pointwise ops, norms and attention internals) or "full" (keep only the
            block's input); a block not listed is "none".
        offload: parameters, gradients and optimizer state kept in host memory
            between uses (FSDP2 ``CPUOffloadPolicy``; with ``zero`` 3).
        runners_up: with ``plan(..., top_k=N)``, the next N − 1 fastest configurations
            the search found, fastest first: each a dict with ``mesh``,
            ``microbatch_size``, ``num_microbatches``, ``zero``, ``offload``,
            ``sequence_parallel``, ``schedule``, ``virtual_stages``, ``recompute`` (the
            modes its blocks use), ``step_time_s``, ``memory_bytes``, ``mfu``,
            ``breakdown``, ``why`` (the step-time terms it loses on) and
            ``tp_splits_nothing`` (:meth:`splits_nothing`; absent in older plans).
        inputs: the shape (one global batch, batch first) and dtype of each of the
            model's inputs the plan was made for, e.g. ``{"shape": [8, 1024], "dtype":
            "int64"}``: a pipeline's stages are exported for these shapes.
        experts: module path -> :class:`ExpertPlan`, for the expert modules split over
            the ``ep`` axis (empty without expert parallelism).
        context: context parallelism over the ``cp`` axis (:class:`ContextPlan`), or
            None without it.
        loss_reduction: how the loss reduces over the batch, ``"mean"`` or ``"sum"``
            (:func:`autopar.strategies.rules.loss_reduction`); the runtime scales a
            summed loss so that averaging over ranks and micro-batches keeps the sum.
        loss_parallel: the loss is computed on logits split along their classes over
            ``tp`` (:mod:`autopar.strategies.loss_parallel`): the model's output
            leaves split so, and the runtime computes the loss, forward and
            backward, under :func:`autopar.runtime.dtensor_layout.class_parallel_loss`.
        explanations: with ``plan(..., explain=[...])``, one :class:`LayoutExplanation`
            per module asked about: why it has its layout and what the others cost.
    """

    model: str
    graph_hash: str
    cluster: dict[str, Any]
    mesh: dict[str, int]
    global_batch: int
    microbatch_size: int
    num_microbatches: int = 1
    zero: int = 0
    sequence_parallel: bool = False
    precision: str = "fp32"
    optimizer: str = "adamw"
    params: dict[str, list[str]] = field(default_factory=dict)
    activations: dict[str, list[str]] = field(default_factory=dict)
    modules: dict[str, ModulePlan] = field(default_factory=dict)
    blocks: list[str] = field(default_factory=list)
    step_time_s: float = 0.0
    breakdown: dict[str, float] = field(default_factory=dict)
    memory: dict[str, float] = field(default_factory=dict)
    throughput: float = 0.0
    mfu: float = 0.0
    solver: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    pipeline: PipelinePlan | None = None
    recompute: dict[str, str] = field(default_factory=dict)
    offload: bool = False
    runners_up: list[dict[str, Any]] = field(default_factory=list)
    inputs: list[dict[str, Any]] = field(default_factory=list)
    loss_reduction: str = "mean"
    experts: dict[str, ExpertPlan] = field(default_factory=dict)
    context: ContextPlan | None = None
    model_hash: str = ""
    loss_parallel: bool = False
    batch_source: str = ""
    explanations: list[LayoutExplanation] = field(default_factory=list)
    compile_blocks: bool = False
    compile_s: float = 0.0
    version: int = PLAN_FORMAT_VERSION

    @property
    def memory_per_device_bytes(self) -> float:
        """Predicted peak memory per device, in bytes."""
        return float(self.memory.get("total", 0.0))

    @property
    def world_size(self) -> int:
        """Number of devices the plan runs on."""
        n = 1
        for s in self.mesh.values():
            n *= s
        return n

    @property
    def stage_mesh(self) -> dict[str, int]:
        """The mesh of one pipeline stage: every axis but ``pp``."""
        return {k: v for k, v in self.mesh.items() if k != "pp"}

    def degree(self, axis: str) -> int:
        """Size of mesh axis ``axis`` (1 when the mesh has no such axis)."""
        return int(self.mesh.get(axis, 1))

    def splits_nothing(self, axis: str = "tp") -> bool:
        """True when mesh axis ``axis`` has more than one rank and every parameter and
        activation is replicated (``R``) along it: its ranks repeat each other's work
        on the same samples (:mod:`autopar.solvers.idle_axis`)."""
        if self.degree(axis) <= 1 or axis not in self.stage_mesh:
            return False
        a = list(self.stage_mesh).index(axis)
        return all(len(pl) <= a or pl[a] == "R"
                   for pl in (*self.params.values(), *self.activations.values()))

    @property
    def ep_node_ranks(self) -> int:
        """The ``ep`` group's members on each node where routed modules move their tokens
        in two legs (every :attr:`ExpertPlan.node_ranks` above 1 is this one), else 1."""
        return max((xp.node_ranks for xp in self.experts.values()), default=1)

    @property
    def fold_experts(self) -> bool:
        """Whether the routed experts are split over ``ep`` x ``tp``
        (:attr:`ExpertPlan.folded`: all of them or none)."""
        return any(xp.folded for xp in self.experts.values())

    @property
    def expert_ranks(self) -> int:
        """The ranks each expert module's experts are split over: ``ep``, times ``tp``
        where they fold over it."""
        return self.degree("ep") * (self.degree("tp") if self.fold_experts else 1)

    @property
    def data_parallel(self) -> int:
        """How many ways the batch is split: ``dp`` × ``ep`` (ep is a part of the
        data-parallel ranks that splits the experts instead)."""
        return self.degree("dp") * self.degree("ep")

    def to_json(self, indent: int | None = 2) -> str:
        """Serialize to JSON text (round-trips through :meth:`from_json`)."""
        data = asdict(self)
        return json.dumps(data, indent=indent, sort_keys=False)

    @classmethod
    def from_json(cls, text: str | bytes) -> "Plan":
        """Parse a plan written by :meth:`to_json`: JSON only (never a pickle), every
        field checked against its type (:mod:`autopar.schema`) and the whole for
        consistency. Raises PlanFormatError naming what is wrong; a plan of format
        version 1 or 2 loads with a warning that it carries no model fingerprint."""
        try:
            data = strict_loads(text)
        except (ValueError, TypeError) as e:
            what = "not JSON text (a pickle or other binary file?)" if isinstance(
                e, UnicodeDecodeError) else f"not valid JSON ({e})"
            raise PlanFormatError(
                f"the plan is {what}; pass the text written by Plan.to_json() or "
                "`autopar plan --json`") from None
        if not isinstance(data, dict):
            raise PlanFormatError("the plan JSON must be an object with the fields of autopar.Plan")
        version = data.get("version")
        if version not in READABLE_VERSIONS or isinstance(version, bool):
            newer = isinstance(version, int) and version > PLAN_FORMAT_VERSION
            raise PlanFormatError(
                f"plan format version {version!r} is not supported (this autopar reads versions "
                f"{READABLE_VERSIONS[0]} to {PLAN_FORMAT_VERSION}); "
                + ("the plan was written by a newer autopar: upgrade autopar, or re-run "
                   "`autopar plan` with this one" if newer
                   else "re-run `autopar plan` to write a current plan"))
        plan = build(cls, {**data, "version": PLAN_FORMAT_VERSION})
        _check_plan(plan)
        if version < 3:
            warnings.warn(f"the plan was written in format version {version}, without a "
                          f"model fingerprint: autopar cannot check that it is applied to "
                          f"the model it was made for; re-run `autopar plan` to write a "
                          f"version {PLAN_FORMAT_VERSION} plan", stacklevel=2)
        return plan

    def summary(self) -> str:
        """A readable multi-line description of the plan (see :mod:`autopar.summary`)."""
        from autopar.summary import plan_summary

        return plan_summary(self)


def model_fingerprint(model: Any) -> str:
    """A stable hash (16 hex digits) of a module's parameters: each name (as
    ``named_parameters()`` gives it, a tied parameter once) and shape, in order. Dtypes
    and devices are left out, so the same model in bf16 or on ``meta`` has the same
    fingerprint; a parameter added, renamed or resized changes it."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        try:
            shape = ",".join(str(int(d)) for d in p.shape)
        except (RuntimeError, ValueError, TypeError):  # an uninitialized (lazy) parameter
            shape = "?"
        h.update(f"{name}:{shape};".encode())
    return h.hexdigest()[:16]


def _check_plan(plan: Plan) -> None:
    """Validate the consistency of a parsed plan (its types are checked by
    :func:`autopar.schema.build`)."""
    from autopar.sharding import check_placement

    if not plan.mesh or not all(v >= 1 for v in plan.mesh.values()):
        raise PlanFormatError(f"the plan's mesh {plan.mesh} must map axis names to positive "
                              f"integers")
    if plan.precision not in PRECISIONS or plan.optimizer not in OPTIMIZERS:
        raise PlanFormatError(f"the plan's precision {plan.precision!r} or optimizer "
                              f"{plan.optimizer!r} is unknown; expected one of "
                              f"{', '.join(PRECISIONS)} and one of {', '.join(OPTIMIZERS)}")
    if min(plan.global_batch, plan.microbatch_size, plan.num_microbatches) < 1:
        raise PlanFormatError(f"the plan's global_batch {plan.global_batch}, microbatch_size "
                              f"{plan.microbatch_size} and num_microbatches "
                              f"{plan.num_microbatches} must be positive")
    if plan.global_batch != plan.microbatch_size * plan.num_microbatches * plan.data_parallel:
        raise PlanFormatError(
            f"the plan's global_batch {plan.global_batch} is not microbatch_size "
            f"{plan.microbatch_size} x num_microbatches {plan.num_microbatches} x dp "
            f"{plan.data_parallel}; was it edited? Re-run `autopar plan` with --global-batch "
            f"{plan.global_batch}")
    naxes = len(plan.stage_mesh)
    for what, table in (("parameter", plan.params), ("activation", plan.activations)):
        for name, pls in table.items():
            if len(pls) != naxes:
                raise PlanFormatError(
                    f"{what} {name!r} has placements {pls!r}; expected one per mesh axis "
                    f"({', '.join(plan.stage_mesh)})")
            for p in pls:
                check_placement(p)
    for path, mp in plan.modules.items():
        if mp.style not in TP_STYLES:
            raise PlanFormatError(f"module {path!r} has unknown style {mp.style!r}; "
                                  f"expected one of {', '.join(TP_STYLES)}")
    for block, mode in plan.recompute.items():
        if mode not in RECOMPUTE:
            raise PlanFormatError(f"block {block!r} has recomputation {mode!r}; expected one of "
                                  f"{', '.join(RECOMPUTE)}")
    if plan.loss_parallel and plan.degree("tp") == 1:
        raise PlanFormatError("loss_parallel is true, but the plan has no tp axis to split "
                              "the logits' classes over; set it false or re-plan")
    if plan.loss_reduction not in ("mean", "sum"):
        raise PlanFormatError(f"loss_reduction {plan.loss_reduction!r} is not 'mean' or 'sum'")
    if plan.offload and plan.zero != 3:
        raise PlanFormatError("offload needs zero=3 (FSDP2 offloads sharded parameters)")
    if plan.zero not in (0, 1, 2, 3):
        raise PlanFormatError(f"zero stage {plan.zero!r} is not one of 0, 1, 2, 3")
    _check_pipeline(plan)
    _check_experts(plan)
    if (plan.degree("cp") > 1) != (plan.context is not None):
        raise PlanFormatError(f"the mesh has cp={plan.degree('cp')} but the plan "
                              f"{'has no' if plan.context is None else 'has a'} context section")


def _check_experts(plan: Plan) -> None:
    """A routed module's two-leg exchange must cut the ``ep`` group into nodes of
    ``node_ranks`` members, and one ``node_ranks`` serves every module (one mesh);
    folded experts are routed ones, all of them, on a mesh with ``ep`` and ``tp``."""
    ep = plan.expert_ranks
    legs = {xp.node_ranks for xp in plan.experts.values() if xp.node_ranks != 1}
    folded = {xp.folded for xp in plan.experts.values()}
    if True in folded and (len(folded) > 1 or plan.degree("tp") == 1 or plan.degree("ep") == 1
                           or any(xp.kind != "routed" for xp in plan.experts.values())):
        raise PlanFormatError("some expert modules are folded over tp and some are not, or a "
                              "folded one is not routed, or the mesh lacks ep or tp; folded "
                              "experts are every routed module's, split over ep x tp; was it "
                              "edited? Re-run `autopar plan`")
    for path, xp in plan.experts.items():
        if xp.node_ranks != 1 and (xp.kind != "routed" or not 1 < xp.node_ranks < ep
                                   or ep % xp.node_ranks):
            raise PlanFormatError(
                f"expert module {path!r} has node_ranks {xp.node_ranks}; a routed module's "
                f"two-leg exchange needs 1 < node_ranks < ep={ep} dividing ep (1: one "
                f"all-to-all); was it edited? Re-run `autopar plan`")
    if len(legs) > 1:
        raise PlanFormatError(f"the expert modules have node_ranks {sorted(legs)}; the ep group "
                              f"has one number of members per node. Re-run `autopar plan`")


def _check_pipeline(plan: Plan) -> None:
    """The pipeline section must agree with the mesh's ``pp`` axis."""
    pp, pipe = plan.degree("pp"), plan.pipeline
    if pipe is None:
        if pp > 1:
            raise PlanFormatError(f"the mesh has pp={pp} but the plan has no pipeline section")
        return
    if pipe.schedule not in SCHEDULES:
        raise PlanFormatError(f"unknown pipeline schedule {pipe.schedule!r}; expected one of "
                              f"{', '.join(SCHEDULES)}")
    if pipe.virtual_stages < 1 or len(pipe.stages) != pp * pipe.virtual_stages:
        raise PlanFormatError(f"the pipeline has {len(pipe.stages)} stages; pp={pp} x "
                              f"virtual_stages={pipe.virtual_stages} needs "
                              f"{pp * pipe.virtual_stages}")
    for k, st in enumerate(pipe.stages):
        if st.index != k or not 0 <= st.rank < pp or not st.units:
            raise PlanFormatError(f"pipeline stage {k} is malformed (index {st.index}, rank "
                                  f"{st.rank}, units {st.units!r}); stages are listed in order, "
                                  f"each on a rank 0..{pp - 1} with at least one unit")
