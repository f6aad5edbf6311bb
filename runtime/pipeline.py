"""Pipeline parallelism with ``torch.distributed.pipelining``, combined with tensor
parallelism and FSDP2 inside each stage, on the 3-D mesh ``("pp", "dp", "tp")``.

In torchtitan's order: :func:`check_pipeline` checks the plan's pipeline first;
:func:`~autopar.pipeline_split.split_stages` cuts the model into stages;
:func:`untie_across_stages` gives each stage its own copy of a parameter several
stages use; :func:`parallelize_stage` lays out each of this rank's stages; and
:func:`build_pipeline_schedule` wraps them in the plan's schedule.
:class:`PipelineRuntime` runs a step and keeps the tied copies equal, as Megatron-LM's
shared embedding does.

The steps in detail and the rule for tied parameters: docs/runtime.md, section
``autopar.runtime.pipeline``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                          ScheduleInterleaved1F1B,
                                          ScheduleInterleavedZeroBubble,
                                          ScheduleZBVZeroBubble)
from torch.distributed.tensor import DTensor

from autopar.errors import LoweringError
from autopar.plans import Plan
from autopar.runtime.data_parallel import apply_data_parallel
from autopar.runtime.experts import apply_expert_parallel, shard_plan_experts
from autopar.runtime.dtensor_layout import loss_context, tp_context
from autopar.runtime.context_mode import SequenceShards, split_batch
from autopar.runtime.mesh import PlanMeshes
from autopar.runtime.recompute import apply_ac
from autopar.pipeline_split import StageCut, StageGraph, split_stages
from autopar.runtime.tensor_parallel import apply_tensor_parallel, reduce_partial_gradients
from autopar.solvers.schedule_sim import ZERO_BUBBLE, needs_a_microbatch_per_stage, stage_ranks

__all__ = ["SCHEDULE_CLASSES", "TiedCopies", "PipelineRuntime", "check_pipeline",
           "untie_across_stages", "stage_plan", "build_pipeline_schedule",
           "tied_process_groups", "parallelize_stage", "stage_blocks", "microbatch_inputs",
           "split_for_plan", "unflattened_loss"]

SCHEDULE_CLASSES = MappingProxyType({
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "interleaved_zero_bubble": ScheduleInterleavedZeroBubble,
    "zbv": ScheduleZBVZeroBubble,
})
SINGLE_STAGE_SCHEDULES = ("gpipe", "1f1b")

LossFn = Callable[[Any, torch.Tensor], torch.Tensor]


def _check_microbatches(plan: Plan) -> None:
    """The micro-batch count each schedule of torch.distributed.pipelining accepts."""
    pipe, n, pp = plan.pipeline, plan.num_microbatches, plan.degree("pp")
    assert pipe is not None
    stages = len(pipe.stages)
    if needs_a_microbatch_per_stage(pipe.schedule) and n < stages:
        raise LoweringError(f"the '{pipe.schedule}' schedule needs at least as many "
                            f"micro-batches as stages ({stages}), but the plan has "
                            f"num_microbatches={n}; use {stages} or more micro-batches")
    if pipe.schedule.startswith("interleaved") and n % max(1, n // pp):
        raise LoweringError(f"the '{pipe.schedule}' schedule runs micro-batches in rounds of "
                            f"pp={pp}, so num_microbatches={n} must be a multiple of "
                            f"{max(1, n // pp)}; use a multiple of {pp} micro-batches")


def check_pipeline(model: nn.Module, plan: Plan) -> None:
    """Check ``plan.pipeline`` against the model and the schedule (stage count,
    placement of stages on ranks, units, micro-batches); raises LoweringError."""
    pipe, pp = plan.pipeline, plan.degree("pp")
    if pipe is None:
        raise LoweringError(f"the mesh has pp={pp} but the plan has no pipeline section; "
                            "re-plan with a pipeline")
    if list(plan.mesh)[0] != "pp":
        raise LoweringError(f"the plan's mesh {plan.mesh} must have 'pp' as its outermost axis")
    v = pipe.virtual_stages
    if pipe.schedule in SINGLE_STAGE_SCHEDULES and v != 1:
        raise LoweringError(f"the '{pipe.schedule}' schedule runs one stage per rank, but the "
                            f"plan has virtual_stages={v}; use 'interleaved_1f1b' for "
                            "several stages per rank")
    if pipe.schedule == "zbv" and v != 2:
        raise LoweringError(f"the 'zbv' schedule runs exactly 2 stages per rank, but the plan "
                            f"has virtual_stages={v}; use virtual_stages=2")
    want = stage_ranks(pipe.schedule, pp, v)
    got = [st.rank for st in pipe.stages]
    if got != want:
        raise LoweringError(f"the '{pipe.schedule}' schedule places stages on pp ranks {want}, "
                            f"but the plan places them on {got}; fix the stages' ranks")
    for st in pipe.stages:
        for unit in st.units:
            try:
                model.get_submodule(unit)
            except AttributeError:
                raise LoweringError(
                    f"pipeline stage {st.index} names unit '{unit}', which the model does not "
                    f"have; was the plan made for another model (plan.model = "
                    f"'{plan.model}')? Re-plan for this model") from None
    _check_microbatches(plan)


@dataclass
class TiedCopies:
    """One parameter that several stages use: each stage holds its own copy.

    Attributes:
        names: (stage index, parameter name in the stage module) of every copy, the
            first owner first.
        ranks: the pp ranks that hold a copy, ascending.
    """

    names: list[tuple[int, str]]
    ranks: list[int]


def untie_across_stages(stages: list[StageGraph], ranks: list[int]) -> list[TiedCopies]:
    """Give every stage but the first owner its own copy of each parameter that
    several stages use; return the groups of copies (the same list on every rank).
    (:func:`~autopar.pipeline_split.split_stages` has checked that no module
    with parameters is held by several stages; only parameters are shared.)"""
    owners: dict[int, list[tuple[int, str]]] = {}
    for st in stages:
        for name, p in st.module.named_parameters(remove_duplicate=False):
            names = owners.setdefault(id(p), [])
            if not names or names[-1][0] != st.index:
                names.append((st.index, name))
    groups = [TiedCopies(names, sorted({ranks[i] for i, _ in names}))
              for names in owners.values() if len(names) > 1]
    for st in stages:  # every stage but the first owner gets one copy of each
        later = {id(st.module.get_parameter(n)) for g in groups for i, n in g.names[1:]
                 if i == st.index}
        copies: dict[int, nn.Parameter] = {}
        for m in st.module.modules():
            for local, p in list(m.named_parameters(recurse=False)):
                if id(p) in later:
                    if id(p) not in copies:
                        copies[id(p)] = nn.Parameter(p.detach().clone(),
                                                     requires_grad=p.requires_grad)
                    setattr(m, local, copies[id(p)])
    return groups


def stage_plan(plan: Plan, module: nn.Module) -> Plan:
    """The plan restricted to the modules and blocks one stage module contains."""
    def has(path: str) -> bool:
        try:
            module.get_submodule(path)
        except AttributeError:
            return False
        return True
    return dataclasses.replace(
        plan, modules={p: mp for p, mp in plan.modules.items() if has(p)},
        blocks=[b for b in plan.blocks if has(b)],
        experts={p: xp for p, xp in plan.experts.items() if has(p)})


def build_pipeline_schedule(plan: Plan, stages: list[PipelineStage],
                            loss_fn: LossFn) -> Any:
    """The plan's schedule over this rank's stages, with ``plan.num_microbatches``
    micro-batches. ``loss_fn`` returns one micro-batch's mean loss; the schedule
    divides the gradients by the micro-batch count (``scale_grads``), so they are
    those of the mean over the rank's micro-batches."""
    assert plan.pipeline is not None
    cls = SCHEDULE_CLASSES[plan.pipeline.schedule]
    stage_arg: Any = stages[0] if plan.pipeline.schedule in SINGLE_STAGE_SCHEDULES else stages
    return cls(stage_arg, n_microbatches=plan.num_microbatches, loss_fn=loss_fn,
               scale_grads=True)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A (distributed) tensor's local storage, for in-place collectives."""
    return t.to_local() if isinstance(t, DTensor) else t


@dataclass
class PipelineRuntime:
    """This rank's share of a pipelined plan: its stage modules, the schedule and
    the groups of tied copies.

    Attributes:
        plan: the plan.
        meshes: the meshes (``meshes.pp`` is the pipeline's).
        modules: this rank's stage modules, in stage order.
        stages: their ``PipelineStage`` s.
        schedule: the ``torch.distributed.pipelining`` schedule.
        input_names: names of the model's inputs, in order.
        tied: the groups of tied copies, with this rank's process group of each (or
            None where this rank holds no copy or the copies are all local).
        device: this rank's device.
        input_shapes: the micro-batch shape of each input the stages were cut for.
    """

    plan: Plan
    meshes: PlanMeshes
    modules: list[fx.GraphModule]
    stages: list[PipelineStage]
    schedule: Any
    input_names: list[str]
    tied: list[tuple[TiedCopies, dist.ProcessGroup | None]]
    device: torch.device
    input_shapes: list[tuple[int, ...]] = dataclasses.field(default_factory=list)

    @property
    def is_last(self) -> bool:
        """Whether this rank runs the last stage (which computes the losses)."""
        return any(s.is_last for s in self.stages)

    def _copies(self, group: TiedCopies) -> list[torch.Tensor]:
        own = {st.stage_index: m for st, m in zip(self.stages, self.modules)}
        return [own[i].get_parameter(n) for i, n in group.names if i in own]

    def sync_tied(self, grads: bool) -> None:
        """Sum the gradients of each tied parameter's copies (``grads``) or copy the
        first owner's values to every copy (not ``grads``), over stages and pp ranks."""
        with torch.no_grad():
            for group, pg in self.tied:
                params = self._copies(group)
                if not params:
                    continue
                if grads:
                    total = _local(params[0].grad).clone()
                    for p in params[1:]:
                        total += _local(p.grad)
                    if pg is not None:
                        dist.all_reduce(total, group=pg)
                    for p in params:
                        _local(p.grad).copy_(total)
                else:
                    value = _local(params[0]).clone()
                    if pg is not None:
                        dist.broadcast(value, src=self._global_rank(group.ranks[0]), group=pg)
                    for p in params:
                        _local(p).copy_(value)

    def _global_rank(self, pp_rank: int) -> int:
        inner = self.plan.world_size // self.plan.degree("pp")
        return pp_rank * inner + dist.get_rank() % inner

    def _check_shapes(self, xs: tuple[torch.Tensor, ...]) -> None:
        """The inputs must have the shapes the stages were exported for (per sample)."""
        got = [tuple(x.shape[1:]) for x in xs]
        want = [shape[1:] for shape in self.input_shapes]
        if self.input_shapes and got != want:
            raise LoweringError(
                f"the pipeline's stages were cut for inputs of per-sample shapes {want}, but "
                f"step() got {got}; pass example_inputs of the shapes you train on")

    def step(self, xs: tuple[torch.Tensor, ...], targets: torch.Tensor, *,
             local: bool = False) -> torch.Tensor:
        """Run the schedule on this rank's data-parallel slice of the global batch (or,
        ``local``, on ``xs`` and ``targets`` as they are: this rank's shard); return the
        global mean loss (on every rank)."""
        plan = self.plan
        n, mb, dp = plan.num_microbatches, plan.microbatch_size, plan.data_parallel
        start = 0 if local else self.meshes.mesh.get_local_rank("dp") * n * mb
        part = slice(start, start + n * mb)
        xs, targets = tuple(x[part] for x in xs), targets[part]
        sequences: contextlib.AbstractContextManager = contextlib.nullcontext()
        if self.meshes.cp is not None and plan.context is not None:  # this rank's tokens
            xs, targets = split_batch(plan, xs, targets, self.meshes.cp.get_local_rank())
            sequences = SequenceShards(self.meshes.cp.get_group(), plan.context.variant,
                                       plan.context.seq_len)
        self._check_shapes(xs)
        kwargs = {name: x.to(self.device) for name, x in zip(self.input_names, xs)}
        losses: list[torch.Tensor] = []
        # tensors a stage makes meet DTensors; a loss-parallel last stage's loss splits
        with tp_context(plan.degree("tp")), sequences, loss_context(plan.loss_parallel):
            self.schedule.step(target=targets.to(self.device), losses=losses, **kwargs)
        for m in self.modules:
            if not isinstance(m, FSDPModule):
                reduce_partial_gradients(m)
        self.sync_tied(grads=True)
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        if self.is_last:
            total += torch.stack([loss.detach().float() for loss in losses]).mean()
        assert self.meshes.pp is not None
        dist.all_reduce(total, group=self.meshes.pp.get_group())
        for axis, size in (("dp", dp), ("cp", plan.degree("cp"))):
            if size > 1:  # the mean over the ranks' samples (and shares of sequences)
                dist.all_reduce(total, group=self.meshes.mesh.get_group(axis))
                total /= size
        return total


def tied_process_groups(plan: Plan, tied: list[TiedCopies]) -> list[dist.ProcessGroup | None]:
    """For each group of tied copies held on several pp ranks, the process group of
    this rank's copies: the owning pp ranks at this rank's (dp, tp) coordinate. Every
    rank creates every group, in the same order (``new_group`` is collective)."""
    inner = plan.world_size // plan.degree("pp")
    me = dist.get_rank()
    out: list[dist.ProcessGroup | None] = []
    for group in tied:
        mine = None
        if len(group.ranks) > 1:
            for c in range(inner):
                ranks = [r * inner + c for r in group.ranks]
                pg = dist.new_group(ranks)
                if me in ranks:
                    mine = pg
        out.append(mine)
    return out


def _own_outputs(_: nn.Module, args: tuple, output: Any) -> Any:
    """A stage's outputs as tensors of their own: the zero-bubble schedules detach them
    in place after the input-gradient pass, which a view (the local tensor of a
    DTensor a tensor-parallel stage hands on) does not allow."""
    if isinstance(output, tuple):
        return tuple(t.clone() if isinstance(t, torch.Tensor) and t._base is not None else t
                     for t in output)
    return output.clone() if isinstance(output, torch.Tensor) and output._base is not None \
        else output


def parallelize_stage(module: nn.Module, plan: Plan, meshes: PlanMeshes,
                      last: bool = False) -> None:
    """Tensor parallelism, activation recomputation and FSDP2 on one stage module
    (by the model's own paths; the stage calls the model's own block modules, whose
    forwards are checkpointed in place). Only the ``last`` stage's output may leave
    split (the logits of a loss-parallel plan): the others are sent on whole.

    Under the zero-bubble schedules, which run a micro-batch's weight gradients
    after its input gradients, ZeRO-3 keeps each block's parameters gathered from
    forward to backward (as ZeRO-2 does): with FSDP2 resharding after forward, the
    split backward gave wrong weight gradients (torch 2.13)."""
    sub = dataclasses.replace(stage_plan(plan, module),
                              loss_parallel=plan.loss_parallel and last)
    assert plan.pipeline is not None
    if plan.pipeline.schedule in ZERO_BUBBLE:
        sub = dataclasses.replace(sub, zero=min(sub.zero, 2))
    if meshes.ep is not None:
        apply_expert_parallel(module, sub, meshes)
    if plan.degree("tp") > 1:
        apply_tensor_parallel(module, sub, meshes.tp)
        if plan.pipeline.schedule in ZERO_BUBBLE:
            module.register_forward_hook(_own_outputs)
    shard_plan_experts(module, sub, meshes, before_tp=False)
    apply_ac(module, sub)
    if meshes.fsdp is not None:
        apply_data_parallel(module, sub, meshes.fsdp, meshes.expert_fsdp)


def stage_blocks(plan: Plan) -> list[list[str]]:
    """The blocks (``plan.blocks``) of each of the plan's stages, in pipeline order; the
    other units (embeddings, head, root code) go with the first and last blocks."""
    assert plan.pipeline is not None
    blocks = set(plan.blocks)
    if not blocks:
        raise LoweringError("the plan pipelines a model but lists no blocks (plan.blocks); "
                            "stages are cut at blocks, so re-plan for this model")
    return [[u for u in st.units if u in blocks] for st in plan.pipeline.stages]


def microbatch_inputs(plan: Plan, example_inputs: Any) -> tuple[torch.Tensor, ...]:
    """Zeros shaped like one micro-batch of ``example_inputs`` (a tensor or a tuple of
    tensors, batch first), or of the inputs the plan records (``plan.inputs``) when
    none are given: the shapes the stages are exported for and run."""
    if example_inputs is None:
        try:
            return local_sequences(plan, tuple(
                torch.zeros((plan.microbatch_size, *spec["shape"][1:]),
                            dtype=getattr(torch, spec["dtype"])) for spec in plan.inputs))
        except (KeyError, TypeError, AttributeError) as e:
            raise LoweringError(f"the plan's inputs {plan.inputs!r} are malformed ({e}); pass "
                                "example_inputs, or re-plan") from None
    xs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else \
        (example_inputs,)
    if not xs or not all(isinstance(x, torch.Tensor) and x.dim() > 0 for x in xs):
        raise LoweringError("cutting a model into pipeline stages needs example inputs: a "
                            "tensor or a tuple of tensors, batch first")
    return local_sequences(plan, tuple(x.new_zeros((plan.microbatch_size, *x.shape[1:]))
                                       for x in xs))


def local_sequences(plan: Plan, xs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """``xs`` with every sequence cut to one cp rank's share (the first tokens: only
    the shapes count), the shapes a stage runs on under context parallelism."""
    cx, cp = plan.context, plan.degree("cp")
    if cx is None or cp == 1:
        return xs
    return tuple(x if d is None else x.narrow(d, 0, x.shape[d] // cp)
                 for x, d in zip(xs, list(cx.inputs) + [None] * len(xs)))


def split_for_plan(model: nn.Module, plan: Plan, example_inputs: Any,
                   device: torch.device | None = None) -> tuple[StageCut, list[TiedCopies]]:
    """Cut ``model`` at the blocks of the plan's stages (exported for one micro-batch
    of ``example_inputs``) and untie parameters shared by stages."""
    assert plan.pipeline is not None
    inputs = microbatch_inputs(plan, example_inputs)
    if not inputs:
        raise LoweringError("cutting a model into pipeline stages needs the shapes of its "
                            "inputs, and the plan records none (plan.inputs): pass "
                            "example_inputs (one batch, batch first) to apply_plan")
    cut = split_stages(model, stage_blocks(plan), inputs, device)
    tied = untie_across_stages(cut.stages, [st.rank for st in plan.pipeline.stages])
    return cut, tied


def unflattened_loss(cut: StageCut, loss_fn: LossFn, output: Any,
                     targets: torch.Tensor) -> torch.Tensor:
    """``loss_fn`` of the forward's output, rebuilt from the last stage's flat outputs."""
    return loss_fn(cut.unflatten(output), targets)
