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

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor.placement_types import Placement

from autopar.errors import LoweringError, PlanFormatError
from autopar.plans import ModulePlan, Plan
from autopar.runtime.dtensor_layout import (distribute_io, place_parameters,
                                            register_cpu_attention_sharding, relayout_modules)
from autopar.runtime.piecewise import (piecewise_pieces, piecewise_shard,
                                       register_piecewise_sharding)
from autopar.sharding import check_placement, shard_dim, shard_pieces, shard_placement

__all__ = ["TPLayout", "tp_layout", "check_module_plan", "tied_parameter_groups",
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
    """

    params: dict[str, str] = field(default_factory=dict)
    inputs: dict[str, str] = field(default_factory=dict)
    outputs: dict[str, str] = field(default_factory=dict)
    modules: dict[str, ModulePlan] = field(default_factory=dict)


def tp_placement(plan: Plan, placements: list[str]) -> str:
    """The ``tp`` component of a parameter's per-axis placements in ``plan``."""
    axes = list(plan.stage_mesh)
    return dict(zip(axes, placements)).get("tp", "R")


def _relaid(mp: ModulePlan) -> bool:
    """Whether the module's output may need a layout change: a split or partial
    result, or a computation on a split input."""
    return mp.style != "replicate" or mp.output_layout != "R" or mp.desired_input_layout != "R"


def tp_layout(plan: Plan, model: nn.Module) -> TPLayout:
    """The tables :func:`apply_tensor_parallel` applies to ``model`` (the whole model,
    or a pipeline stage holding part of it: entries for what it lacks are left out)."""
    names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    paths = {p for p, _ in model.named_modules(remove_duplicate=False)}
    out = TPLayout()
    for fqn, placements in plan.params.items():
        p = tp_placement(plan, placements)
        if fqn in names and p != "R":
            out.params[fqn] = p
    for path, mp in plan.modules.items():
        if path not in paths or not path:
            continue
        out.modules[path] = mp
        if mp.input_layout != mp.desired_input_layout:
            out.inputs[path] = mp.desired_input_layout
        if _relaid(mp):
            out.outputs[path] = mp.output_layout
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


def apply_tensor_parallel(model: nn.Module, plan: Plan, tp_mesh: DeviceMesh) -> TPLayout:
    """Lay ``model`` out over ``tp_mesh`` as ``plan`` says (see the module docstring)
    and return the tables applied. ``model`` may be a pipeline stage: its inputs enter
    and its outputs leave as replicated tensors, as the whole model's do."""
    layout = tp_layout(plan, model)
    register_cpu_attention_sharding()
    if piecewise(layout):
        register_piecewise_sharding()
    place_parameters(model, tp_mesh, _placements(layout.params))
    relayout_modules(model, _placements(layout.inputs), _placements(layout.outputs))
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
    per step (FSDP2 does this itself when data parallelism is on)."""
    for p in module.parameters():
        g = p.grad
        if isinstance(p, DTensor) and isinstance(g, DTensor) and g.placements != p.placements:
            p.grad = g.redistribute(placements=p.placements)
