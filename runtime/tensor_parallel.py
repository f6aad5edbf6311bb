"""Tensor and sequence parallelism of a Plan, read from the plan's placements alone.

:func:`tp_layout` turns a plan into three tables — each sharded parameter's ``tp``
placement, and the modules whose first input or output the plan re-lays out — and
:func:`apply_tensor_parallel` applies them with :mod:`autopar.runtime.dtensor_layout`
(parameters as DTensors whatever module owns them, activations DTensors through the
user's code, layout changes at module boundaries). The emitted program
(:mod:`autopar.runtime.codegen`) prints the same tables and carries the same
functions, so both lay a model out alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor.placement_types import Placement

from autopar.errors import LoweringError, PlanFormatError
from autopar.plans import ModulePlan, Plan
from autopar.runtime.dtensor_layout import (distribute_io, place_parameters,
                                            register_cpu_attention_sharding, relayout_modules)
from autopar.runtime.local_tensors import localize_regions
from autopar.runtime.piecewise import (piecewise_pieces, piecewise_shard,
                                       register_piecewise_sharding)
from autopar.sharding import check_placement, shard_dim, shard_pieces, shard_placement

__all__ = ["TPLayout", "tp_layout", "local_regions", "check_module_plan", "tied_parameter_groups",
           "apply_tensor_parallel", "reduce_partial_gradients",
           "reduce_partial_gradients_when_accumulated", "tp_placement", "piecewise",
           "parse_placement", "format_placement", "to_torch"]


def parse_placement(text: str) -> Placement:
    """Parse ``"R"``, ``"P"``, ``"S(d)"`` or ``"S(d)/k"`` into a
    ``torch.distributed.tensor`` placement (``Replicate()``, ``Partial()``,
    ``Shard(d)``, or the strided shard of
    :func:`autopar.runtime.piecewise.piecewise_shard`)."""
    t = check_placement(text)
    if t == "R":
        return Replicate()
    if t == "P":
        return Partial()
    return piecewise_shard(shard_dim(t), shard_pieces(t))  # type: ignore[arg-type]


def format_placement(p: Placement) -> str:
    """The short string of a torch placement (inverse of :func:`parse_placement`)."""
    pieces = piecewise_pieces(p)
    if pieces is not None:
        return shard_placement(p.dim, pieces)  # type: ignore[attr-defined]
    if isinstance(p, Replicate):
        return "R"
    if isinstance(p, Partial):
        return "P"
    raise PlanFormatError(f"unsupported placement {p!r}")


def to_torch(placements: list[str] | tuple[str, ...]) -> tuple[Placement, ...]:
    """Convert a plan's placement strings to a tuple of torch placements."""
    return tuple(parse_placement(p) for p in placements)


@dataclass
class TPLayout:
    """What tensor parallelism does to one model (or one pipeline stage).

    Attributes:
        params: parameter name -> its ``tp`` placement, for the sharded ones (every
            other parameter is replicated over ``tp``).
        inputs: module path -> the layout its first input is redistributed to.
        outputs: module path -> the layout its output is redistributed to.
        modules: module path -> its ModulePlan (for comments: style, predicted time).
        regions: module path -> the layout its first input enters with, for the modules
            that run on local tensors between their colwise and rowwise Linears
            (:mod:`autopar.runtime.local_tensors`).
        local_linears: Linear path -> its style ("colwise" or "rowwise"), for the
            Linears inside those regions.
    """

    params: dict[str, str] = field(default_factory=dict)
    inputs: dict[str, str] = field(default_factory=dict)
    outputs: dict[str, str] = field(default_factory=dict)
    modules: dict[str, ModulePlan] = field(default_factory=dict)
    regions: dict[str, str] = field(default_factory=dict)
    local_linears: dict[str, str] = field(default_factory=dict)


def tp_placement(plan: Plan, placements: list[str]) -> str:
    """The ``tp`` component of a parameter's per-axis placements in ``plan``."""
    axes = list(plan.stage_mesh)
    return dict(zip(axes, placements)).get("tp", "R")


def _relaid(mp: ModulePlan) -> bool:
    """Whether the module's output may need a layout change: a split or partial
    result, or a computation on a split input."""
    return mp.style != "replicate" or mp.output_layout != "R" or mp.desired_input_layout != "R"


def _region_linears(plan: Plan, path: str, module: nn.Module,
                    tied: set[str]) -> dict[str, ModulePlan] | None:
    """The Linears of ``module`` (at ``path``) by path when it can be a local-tensor
    region: every parameter under it (none tied elsewhere) is a colwise or rowwise
    Linear's, with at least one of each, colwise ones reading a replicated input and
    handing on a split one, rowwise ones reading a split input and handing on a
    reduced one; no expert module under it. Else None."""
    prefix = path + "."
    if any(e == path or e.startswith(prefix) for e in plan.experts):
        return None
    names = [prefix + n for n, _ in module.named_parameters(remove_duplicate=False)]
    if not names or tied & set(names):
        return None
    owners = {n.rpartition(".")[0] for n in names}
    mps = {o: plan.modules.get(o) for o in owners}
    if any(mp is None or mp.module_type != "Linear" for mp in mps.values()):
        return None
    styles = {mp.style for mp in mps.values()}  # type: ignore[union-attr]
    if styles != {"colwise", "rowwise"}:
        return None
    for mp in mps.values():
        assert mp is not None
        split_in = mp.desired_input_layout.startswith("S(")
        if mp.style == "colwise" and (split_in or not mp.output_layout.startswith("S(")):
            return None
        if mp.style == "rowwise" and (not split_in or mp.output_layout == "P"):
            return None
    return mps  # type: ignore[return-value]


def local_regions(plan: Plan, model: nn.Module, out: TPLayout) -> None:
    """Add to ``out`` the outermost modules that can run on local tensors between
    their colwise and rowwise Linears (:func:`_region_linears`): each region's first
    input is laid out replicated on entry, once for all its colwise Linears. None under
    context parallelism, whose attention runs in its own mode, nor in a block under
    selective recomputation, whose dispatch mode would replay the outputs of a region's
    first, checking forward (run both ways) in its recomputation."""
    if plan.context is not None:
        return
    tied = {n for group in tied_parameter_groups(model) for n in group}
    selective = [b + "." for b in plan.blocks if plan.recompute.get(b) == "selective"]
    for path, module in model.named_modules():
        if not path or any(path.startswith(r + ".") for r in out.regions) or \
                any(path.startswith(b) for b in selective):
            continue
        mps = _region_linears(plan, path, module, tied)
        if mps is None:
            continue
        out.regions[path] = "R"
        out.inputs[path] = "R"
        out.local_linears.update((p, mp.style) for p, mp in mps.items())


def tp_layout(plan: Plan, model: nn.Module, local: bool = True) -> TPLayout:
    """The tables :func:`apply_tensor_parallel` applies to ``model`` (the whole model,
    or a pipeline stage holding part of it: entries for what it lacks are left out);
    ``local``: with the regions that run on local tensors (:func:`local_regions`)."""
    names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    paths = {p for p, _ in model.named_modules(remove_duplicate=False)}
    out = TPLayout()
    whole = {f"{path}.{local}" for path, xp in plan.experts.items() if xp.folded
             for local in xp.params}  # each rank's own experts: laid out by the ep step
    for fqn, placements in plan.params.items():
        p = tp_placement(plan, placements)
        if fqn in names and p != "R" and fqn not in whole:
            out.params[fqn] = p
    for path, mp in plan.modules.items():
        if path not in paths or not path:
            continue
        out.modules[path] = mp
        if mp.input_layout != mp.desired_input_layout:
            out.inputs[path] = mp.desired_input_layout
        if _relaid(mp):
            out.outputs[path] = mp.output_layout
    if local:
        local_regions(plan, model, out)
    return out


def check_module_plan(path: str, module: nn.Module, mp: ModulePlan) -> None:
    """Raise LoweringError when ``mp`` names a layout that is not a placement, or a
    parameter ``module`` does not own."""
    for name in ("input_layout", "desired_input_layout", "output_layout"):
        try:
            parse_placement(getattr(mp, name))
        except Exception as e:  # noqa: BLE001 — the plan's text, reported with its module
            raise LoweringError(f"module '{path}' ({type(module).__name__}) has {name} "
                                f"{getattr(mp, name)!r}, which is not a placement ({e}); "
                                f"re-plan for this model") from None
    own = {n for n, _ in module.named_parameters(recurse=False)}
    for local in mp.params:
        if local not in own:
            raise LoweringError(f"modules['{path}'].params names '{local}', which module "
                                f"'{path}' ({type(module).__name__}) does not own; was the "
                                f"plan made for another model? Re-plan for this model")


def check_param_placement(fqn: str, param: nn.Parameter, placement: str) -> None:
    """A parameter's ``tp`` placement must be replicated or a split of one of its dims
    (``S(d)``, or ``S(d)/k`` piecewise: dim d cut into k equal pieces)."""
    if placement == "R":
        return
    dim = shard_dim(placement) if placement.startswith("S(") else None
    if dim is None:
        raise LoweringError(f"parameter '{fqn}' is planned as '{placement}' on tp; a "
                            f"parameter is either replicated ('R') or split ('S(d)'): re-plan")
    if not -param.dim() <= dim < param.dim():
        raise LoweringError(f"parameter '{fqn}' of shape {tuple(param.shape)} is planned as "
                            f"'{placement}' on tp, but it has no dim {dim}; was the plan made "
                            f"for another model? Re-plan for this model")
    if param.shape[dim] % shard_pieces(placement):
        raise LoweringError(f"parameter '{fqn}' of shape {tuple(param.shape)} is planned as "
                            f"'{placement}' on tp, but its dim {dim} does not cut into "
                            f"{shard_pieces(placement)} equal pieces; re-plan for this model")


def tied_parameter_groups(model: nn.Module) -> list[list[str]]:
    """Names of the parameters shared by several modules, one list per shared tensor
    (first owner first), e.g. ``[["tok_emb.weight", "head.weight"]]``."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def piecewise(layout: TPLayout) -> bool:
    """Whether ``layout`` splits anything piecewise (``S(d)/k``: a fused projection
    split per head), which DTensor runs with :mod:`autopar.runtime.piecewise`."""
    return any(shard_pieces(p) > 1 for table in (layout.params, layout.inputs, layout.outputs)
               for p in table.values())


def _placements(table: dict[str, str]) -> dict[str, Placement]:
    return {k: parse_placement(v) for k, v in table.items()}


def apply_tensor_parallel(model: nn.Module, plan: Plan, tp_mesh: DeviceMesh,
                          local: bool = True) -> TPLayout:
    """Lay ``model`` out over ``tp_mesh`` as ``plan`` says (see the module docstring)
    and return the tables applied. ``model`` may be a pipeline stage: its inputs enter
    and its outputs leave as replicated tensors, as the whole model's do. ``local``:
    run the regions of :func:`local_regions` on local tensors (off where the blocks are
    compiled, which removes the same host time)."""
    layout = tp_layout(plan, model, local)
    register_cpu_attention_sharding()
    if piecewise(layout):
        register_piecewise_sharding()
    place_parameters(model, tp_mesh, _placements(layout.params))
    relayout_modules(model, _placements(layout.inputs), _placements(layout.outputs))
    localize_regions(model, tp_mesh, layout.regions, layout.local_linears)
    distribute_io(model, tp_mesh, gather=not plan.loss_parallel)
    return layout


def reduce_partial_gradients_when_accumulated(module: nn.Module) -> None:
    """Do :func:`reduce_partial_gradients`' work for each parameter as soon as a
    backward has accumulated its gradient (a post-accumulate-grad hook), so that a
    plain ``loss.backward()`` leaves finished gradients. A parameter whose gradient
    is already in its placement is left alone."""
    def finish(p: nn.Parameter) -> None:
        g = p.grad
        if isinstance(g, DTensor) and g.placements != p.placements:
            p.grad = g.redistribute(placements=p.placements)
    for p in module.parameters():
        if isinstance(p, DTensor) and p.requires_grad:
            p.register_post_accumulate_grad_hook(finish)


def reduce_partial_gradients(module: nn.Module) -> None:
    """A replicated tp parameter used on split activations (sequence parallelism)
    gets a partial-sum gradient; redistribute it to the parameter's placement once
    per step (FSDP2 does this itself when data parallelism is on). The partial sums
    of replicated parameters on one mesh are summed by one all-reduce of them all, as
    DDP buckets its gradients, instead of one per parameter (each collective costs
    the host about a millisecond on the CPU: benchmarks/results/host_time_cpu.md)."""
    buckets: dict[tuple[DeviceMesh, torch.dtype], list[nn.Parameter]] = {}
    for p in module.parameters():
        g = p.grad
        if not (isinstance(p, DTensor) and isinstance(g, DTensor)) or g.placements == p.placements:
            continue
        summed = [getattr(q, "reduce_op", None) == "sum" for q in g.placements]
        if p.device_mesh.ndim == 1 and p.placements[0].is_replicate() and all(summed) \
                and p.is_contiguous():
            buckets.setdefault((g.device_mesh, g.dtype), []).append(p)
        else:
            p.grad = g.redistribute(placements=p.placements)
    for (mesh, _), params in buckets.items():  # gradients need no autograd: DTensor's
        # own fields and constructor, not to_local/from_local (private in torch 2.11-2.13)
        flat = torch.cat([p.grad._local_tensor.reshape(-1) for p in params])  # type: ignore
        dist.all_reduce(flat, group=mesh.get_group())
        for p, piece in zip(params, flat.split([p.numel() for p in params])):
            # the parameter's own spec: a gradient's shape, stride, dtype and placement
            p.grad = DTensor(piece.view(p.shape), p._spec, requires_grad=False)  # type: ignore
