"""Tensor and sequence parallelism: each :class:`~autopar.plans.ModulePlan` becomes
PyTorch parallel styles applied with ``parallelize_module`` on the ``tp`` mesh.

* colwise Linear: ``ColwiseParallel(input_layouts=in, output_layouts=out)``;
  weight and bias ``S(0)`` on tp;
* colwise Embedding: ``ColwiseParallel(...)``; weight ``S(1)``;
* rowwise Linear: ``RowwiseParallel(input_layouts=in, output_layouts=out)``; weight
  ``S(1)``, bias ``R``;
* rowwise Embedding: ``RowwiseParallel(...)``; weight ``S(0)`` (vocabulary-parallel);
* sequence_parallel: ``SequenceParallel(sequence_dim=d)`` for desired ``S(d)``, with a
  ``PrepareModuleInput`` before it / ``PrepareModuleOutput`` after it when the input /
  output layout differs from ``S(d)``; parameters ``R``;
* replicate: :class:`ReplicateParallel`; parameters ``R``;
* replicate, for a module without parameters of its own: :class:`PrepareFirstInput`
  when its input and desired layouts differ.

Every style reads its module's input as a local tensor with the plan's
``input_layout``, redistributes it to ``desired_input_layout`` and hands its output on
as a local tensor with ``output_layout``; between modules the model runs on plain
local tensors, as in torchtitan. A ModulePlan for a module without parameters of
its own (style "replicate") only converts its first input, e.g. gathering the
sequence before an attention module that reads the sequence length from its input;
its output is whatever its submodules hand on. A parameter shared by several
modules (tied embeddings) gets one placement from its first owner and is re-tied
after the styles are applied, so it stays one parameter with one gradient.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_module
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle,
                                               PrepareModuleInput, PrepareModuleOutput,
                                               RowwiseParallel, SequenceParallel,
                                               parallelize_module)
from torch.distributed.tensor.placement_types import Placement

from autopar.errors import LoweringError
from autopar.plans import ModulePlan, Plan
from autopar.sharding import parse_placement

__all__ = ["ReplicateParallel", "PrepareFirstInput", "style_placements", "module_styles",
           "check_module_plan", "tied_parameter_groups", "apply_tensor_parallel",
           "reduce_partial_gradients"]

_SHARDED = MappingProxyType({  # (module kind, style) -> tp placement of the split parameters
    ("Linear", "colwise"): {"weight": "S(0)", "bias": "S(0)"},
    ("Linear", "rowwise"): {"weight": "S(1)", "bias": "R"},
    ("Embedding", "colwise"): {"weight": "S(1)"},
    ("Embedding", "rowwise"): {"weight": "S(0)"},
})


def _as_layout(x: Any, mesh: DeviceMesh, src: Placement, dst: Placement) -> Any:
    """Read ``x`` (a local tensor, or already a DTensor) as ``src`` and redistribute it
    to ``dst``; anything that is not a tensor passes through."""
    if not isinstance(x, torch.Tensor):
        return x
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, mesh, (src,), run_check=False)
    return x if x.placements == (dst,) else x.redistribute(placements=(dst,))


class ReplicateParallel(ParallelStyle):
    """Parameters (and buffers) replicated over the tp mesh, computing on DTensors.

    The first input is read as ``input_layout`` and redistributed to
    ``desired_input_layout`` (other tensor inputs are read as replicated); the output
    is redistributed to ``output_layout`` and, with ``use_local_output``, handed on as
    a local tensor. A replicated parameter used on a split activation gets a partial
    gradient, which is reduced to its replicated placement after backward.
    """

    def __init__(self, *, input_layout: Placement = Replicate(),
                 desired_input_layout: Placement = Replicate(),
                 output_layout: Placement = Replicate(), use_local_output: bool = True) -> None:
        super().__init__()
        self.input_layout = input_layout
        self.desired_input_layout = desired_input_layout
        self.output_layout = output_layout
        self.use_local_output = use_local_output

    def _prepare_input(self, module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        first = (_as_layout(inputs[0], mesh, self.input_layout, self.desired_input_layout),) \
            if inputs else ()
        return first + tuple(_as_layout(x, mesh, Replicate(), Replicate()) for x in inputs[1:])

    def _prepare_output(self, module: nn.Module, outputs: Any, mesh: DeviceMesh) -> Any:
        def convert(o: Any) -> Any:
            if not isinstance(o, DTensor):
                return o
            if o.placements != (self.output_layout,):
                o = o.redistribute(placements=(self.output_layout,))
            return o.to_local() if self.use_local_output else o

        if isinstance(outputs, tuple):
            return tuple(convert(o) for o in outputs)
        return convert(outputs)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, None, self._prepare_input,
                                 self._prepare_output)

    def __repr__(self) -> str:
        return (f"ReplicateParallel(input_layout={self.input_layout}, desired_input_layout="
                f"{self.desired_input_layout}, output_layout={self.output_layout})")


class PrepareFirstInput(ParallelStyle):
    """A layout conversion at a module without parameters of its own, e.g. an
    attention module under sequence parallelism, whose code reads the sequence length
    from its input (torchtitan puts a ``PrepareModuleInput`` there). The first
    positional input is read as ``input_layout``, redistributed to
    ``desired_input_layout`` and handed in as a local tensor; other inputs (rotary
    tables, masks) and the output pass through, whatever their number."""

    def __init__(self, *, input_layout: Placement, desired_input_layout: Placement) -> None:
        super().__init__()
        self.input_layout = input_layout
        self.desired_input_layout = desired_input_layout

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def hook(_: nn.Module, inputs: tuple) -> tuple:
            if not inputs or not isinstance(inputs[0], torch.Tensor):
                return inputs
            x = _as_layout(inputs[0], device_mesh, self.input_layout, self.desired_input_layout)
            return (x.to_local(),) + tuple(inputs[1:])

        module.register_forward_pre_hook(hook)
        return module

    def __repr__(self) -> str:
        return (f"PrepareFirstInput(input_layout={self.input_layout}, desired_input_layout="
                f"{self.desired_input_layout})")


def _kind(module: nn.Module) -> str | None:
    if isinstance(module, nn.Linear):
        return "Linear"
    if isinstance(module, nn.Embedding):
        return "Embedding"
    return None


def style_placements(module: nn.Module, style: str) -> dict[str, str]:
    """The tp-axis placement ``style`` gives each of ``module``'s own parameters."""
    table = _SHARDED.get((_kind(module) or "", style), {})
    return {name: table.get(name, "R") for name, _ in module.named_parameters(recurse=False)}


def _owns_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False))


def module_styles(mp: ModulePlan, module: nn.Module) -> list[ParallelStyle]:
    """The torch parallel styles realizing ``mp`` on ``module``, in the order to apply
    them (the plan is assumed checked by :func:`check_module_plan`)."""
    src, want, out = (parse_placement(p) for p in (mp.input_layout, mp.desired_input_layout,
                                                   mp.output_layout))
    if not _owns_parameters(module):
        return [] if src == want else [PrepareFirstInput(input_layout=src,
                                                         desired_input_layout=want)]
    if mp.style == "colwise":
        return [ColwiseParallel(input_layouts=src, output_layouts=out, use_local_output=True)]
    if mp.style == "rowwise":
        return [RowwiseParallel(input_layouts=src, output_layouts=out, use_local_output=True)]
    if mp.style == "sequence_parallel":
        styles: list[ParallelStyle] = []
        if src != want:
            styles.append(PrepareModuleInput(input_layouts=(src,), desired_input_layouts=(want,),
                                             use_local_output=True))
        styles.append(SequenceParallel(sequence_dim=want.dim, use_local_output=out == want))
        if out != want:
            styles.append(PrepareModuleOutput(output_layouts=(want,),
                                              desired_output_layouts=(out,), use_local_output=True))
        return styles
    return [ReplicateParallel(input_layout=src, desired_input_layout=want, output_layout=out)]


def _fail(path: str, module: nn.Module, style: str, what: str, fix: str) -> LoweringError:
    kind = type(module).__name__
    return LoweringError(f"module '{path}' ({kind}, style '{style}') {what}; {fix}")


def check_module_plan(path: str, module: nn.Module, mp: ModulePlan, tp: int,
                      parent: nn.Module | None) -> None:
    """Raise LoweringError when the styles cannot realize ``mp`` on ``module`` at
    tensor-parallel degree ``tp``: layouts a style cannot take or produce, a style the
    module type lacks, or a split dim (or head count) that ``tp`` does not divide."""
    style = mp.style
    for field in ("input_layout", "desired_input_layout", "output_layout"):
        value = getattr(mp, field)
        if value == "P":
            raise _fail(path, module, style, f"has {field} 'P'",
                        "a partial sum cannot pass between modules as a local tensor: plan 'R' "
                        "or 'S(d)' there (reduce inside the module)")
        parse_placement(value)
    kind = _kind(module)
    want = mp.desired_input_layout
    if not _owns_parameters(module):
        if style != "replicate":
            raise _fail(path, module, style, "owns no parameters of its own",
                        "plan the style 'replicate' (a conversion of its first input's layout) "
                        "for it, and styles for its submodules")
        return
    if style in ("colwise", "rowwise"):
        if kind is None:
            raise _fail(path, module, style, "is neither nn.Linear nor nn.Embedding",
                        "colwise/rowwise apply to Linear and Embedding only; use 'replicate' "
                        "or 'sequence_parallel'")
        needs_split = style == "rowwise" and kind == "Linear"
        last_dim = want.startswith("S(") and (want == "S(-1)" or int(want[2:-1]) >= 2)
        if needs_split and not last_dim:
            raise _fail(path, module, style, f"computes on its input split along the last dim, "
                        f"but desired_input_layout is '{want}'", "plan desired_input_layout "
                        "'S(-1)' for a rowwise Linear")
        if not needs_split and want != "R":
            raise _fail(path, module, style, f"computes on a replicated input, but "
                        f"desired_input_layout is '{want}'", f"plan desired_input_layout 'R' "
                        f"for a {style} {kind}")
    elif style == "sequence_parallel":
        if not want.startswith("S("):
            raise _fail(path, module, style, f"computes on a sequence-split input, but "
                        f"desired_input_layout is '{want}'", "plan 'S(1)' (the sequence dim) or "
                        "the style 'replicate'")
        if any(m is not module and any(True for _ in m.parameters(recurse=False))
               for m in module.modules()):
            raise _fail(path, module, style, "has submodules with parameters",
                        "plan sequence_parallel on the leaf modules (the norms) instead")
    if tp > 1:
        _check_divisible(path, module, mp, tp, parent)


def _check_divisible(path: str, module: nn.Module, mp: ModulePlan, tp: int,
                     parent: nn.Module | None) -> None:
    for name, placement in style_placements(module, mp.style).items():
        if placement == "R":
            continue
        dim = int(placement[2:-1])
        size = getattr(module, name).shape[dim]
        if size % tp:
            raise _fail(path, module, mp.style, f"splits {name} dim {dim} of size {size} over "
                        f"tp={tp}, which does not divide it", f"choose a tp that divides {size}, "
                        f"or the style 'replicate' for '{path}'")
    head_dim = getattr(parent, "head_dim", None)
    if isinstance(module, nn.Linear) and mp.style in ("colwise", "rowwise") and \
            isinstance(head_dim, int) and head_dim > 0:
        features = module.out_features if mp.style == "colwise" else module.in_features
        heads = features // head_dim
        if features % head_dim == 0 and heads % tp:
            side = "output" if mp.style == "colwise" else "input"
            owner = path.rpartition(".")[0]
            raise _fail(path, module, mp.style, f"splits its {features} {side} features, "
                        f"{heads} heads of size {head_dim}, over tp={tp}, which does not divide "
                        f"{heads} heads", f"choose a tp that divides {heads}, or give the "
                        f"projections of '{owner}' the style 'replicate'")


def tied_parameter_groups(model: nn.Module) -> list[list[str]]:
    """Names of the parameters shared by several modules, one list per shared tensor
    (first owner first), e.g. ``[["tok_emb.weight", "head.weight"]]``."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def _retie(model: nn.Module, groups: list[list[str]]) -> None:
    """Point every alias of a tied parameter at its first owner's (distributed) one."""
    for names in groups:
        first = model.get_parameter(names[0])
        for name in names[1:]:
            owner_path, _, local = name.rpartition(".")
            owner = model.get_submodule(owner_path)
            current = getattr(owner, local)
            if getattr(current, "placements", None) != getattr(first, "placements", None):
                raise LoweringError(f"tied parameters '{names[0]}' and '{name}' were given "
                                    f"different placements ({getattr(first, 'placements', None)} "
                                    f"and {getattr(current, 'placements', None)}); give their "
                                    "modules styles that place the tensor alike")
            owner.register_parameter(local, first)


def apply_tensor_parallel(model: nn.Module, plan: Plan, tp_mesh: DeviceMesh) -> None:
    """Apply every ModulePlan's styles with ``parallelize_module`` on ``tp_mesh``
    (innermost modules first, so a parent's style never touches a planned child),
    then re-tie shared parameters."""
    groups = tied_parameter_groups(model)
    for path in sorted(plan.modules, key=lambda p: -len(p.split(".")) if p else 0):
        module = model.get_submodule(path)
        for style in module_styles(plan.modules[path], module):
            parallelize_module(module, tp_mesh, style)
    _retie(model, groups)


def reduce_partial_gradients(module: nn.Module) -> None:
    """A replicated tp parameter used on split activations (sequence parallelism)
    gets a partial-sum gradient; redistribute it to the parameter's placement once
    per step (FSDP2 does this itself when data parallelism is on)."""
    for p in module.parameters():
        g = p.grad
        if isinstance(p, DTensor) and isinstance(g, DTensor) and g.placements != p.placements:
            p.grad = g.redistribute(placements=p.placements)
