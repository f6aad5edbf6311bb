"""Cut a model into pipeline stage modules at its block boundaries.

The cut is made on the model's exported program (:mod:`autopar.pipeline_export`),
so the model is left as written and anything export captures can be pipelined, with
no second trace. :func:`split_stages` cuts it (:class:`StageCut`);
:func:`assign_stages` decides which stage runs each node, :func:`stage_graph` builds a
stage's graph, and :func:`pipeline_blocker` tells the planner why a model cannot be cut.

:func:`assign_stages`, :func:`stage_graph` and :func:`cut_program` use torch alone, so
an emitted program copies them (``inspect.getsource``) and cuts by the same code.
The rules for placing nodes, and how a stage module is called and what it holds:
docs/capture.md, section ``autopar.pipeline_split``.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from autopar.errors import LoweringError
from autopar.layers import cut_lists, repeated_lists
from autopar.pipeline_export import (StageSplitError, export_program, outlined_graph,
                                             outlined_paths, retarget_devices)

__all__ = ["StageGraph", "StageCut", "assign_stages", "stage_graph", "cut_program",
           "split_stages", "pipeline_blocker", "stage_signature"]


@dataclass
class StageGraph:
    """One stage cut from the model.

    Attributes:
        index: the stage's position in the pipeline.
        module: the stage's GraphModule (its submodules are the model's own).
        inputs: names of the activations it receives from the previous stage.
        outputs: names of the activations it hands to the next stage (empty for the
            last stage, which returns the model's output).
    """

    index: int
    module: fx.GraphModule
    inputs: list[str]
    outputs: list[str]


@dataclass
class StageCut:
    """The model cut into stages.

    Attributes:
        stages: one StageGraph per stage, in pipeline order.
        input_names: the model's inputs, in order: every stage takes them as keywords.
        out_spec: the pytree spec of the forward's output; ``out_spec.unflatten(flat)``
            rebuilds it from the last stage's flat outputs.
        input_shapes: the shape of each input the stages were exported for (one
            micro-batch); they run these shapes only.
    """

    stages: list[StageGraph]
    input_names: list[str]
    out_spec: Any
    input_shapes: list[tuple[int, ...]]

    def unflatten(self, output: Any) -> Any:
        """The forward's output from what the last stage returns."""
        return self.out_spec.unflatten(list(output) if isinstance(output, tuple) else [output])


def _pinned(node: fx.Node) -> bool:
    """Whether a node that reads no staged value still has one stage: a module call,
    a read of a parameter, or a random op (recomputing it would draw again)."""
    if node.op == "call_module":
        return True
    if any(a.op == "get_attr" and a.meta.get("param") for a in node.all_input_nodes):
        return True
    return torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())


def assign_stages(graph: fx.Graph, stage_blocks: list[list[str]]) -> dict[fx.Node, int | None]:
    """The stage of each node of an outlined graph (None: recomputed by every stage
    that reads it), given each stage's blocks: a block call runs on its stage, the
    code before the first block on the first stage, after the last block on the last,
    between blocks on the stage of the block before it or the latest stage among its
    inputs; a node reading only inputs, buffers and constants is recomputed where
    read, unless it is a module call, reads a parameter or is random."""
    stage_of = {b: i for i, blocks in enumerate(stage_blocks) for b in blocks}
    last = len(stage_blocks) - 1
    calls = [n for n in graph.nodes if n.op == "call_module" and n.target in stage_of]
    if not calls:
        raise StageSplitError("no stage holds a block; pipeline stages are cut at blocks")
    for a, b in zip(calls, calls[1:]):
        if stage_of[a.target] > stage_of[b.target]:
            raise StageSplitError(
                f"the forward calls block '{b.target}' (stage {stage_of[b.target]}) after "
                f"'{a.target}' (stage {stage_of[a.target]}); give the stages the blocks in the "
                "order the forward calls them")
    stage: dict[fx.Node, int | None] = {}
    pos = 0
    for node in graph.nodes:
        after = max((s for s in (stage[a] for a in node.all_input_nodes) if s is not None),
                    default=None)
        if node.op in ("placeholder", "get_attr"):
            stage[node] = None
        elif node.op == "output":
            stage[node] = last
        elif node.op == "call_module" and node.target in stage_of:
            own = stage_of[node.target]
            if after is not None and after > own:
                raise StageSplitError(f"block '{node.target}' on stage {own} reads a value made "
                                      f"on stage {after}; give the stages the blocks in the "
                                      "order the forward calls them")
            stage[node] = own
            pos = last if node is calls[-1] else own
        elif node.target is operator.getitem and isinstance(node.args[0], fx.Node):
            stage[node] = stage[node.args[0]]  # a part of a tuple stays with the tuple
        elif after is None and not _pinned(node):
            stage[node] = None
        else:
            stage[node] = max(pos, after if after is not None else 0)
    return stage


def _live(graph: fx.Graph, stage: dict[fx.Node, int | None], boundary: int) -> list[fx.Node]:
    """Staged values made before stage ``boundary`` and read at or after it."""
    return [n for n in graph.nodes if stage[n] is not None and stage[n] < boundary
            and any(stage[u] is not None and stage[u] >= boundary for u in n.users)]


def stage_graph(graph: fx.Graph, stage: dict[fx.Node, int | None], index: int,
                last: int) -> fx.Graph:
    """The graph of stage ``index``: the received activations, then the model's inputs
    (keywords), then its nodes and the input-only values they read, in order; it
    returns what later stages read, or (the last) the model's flat outputs."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in _live(graph, stage, index) if index > 0 else []:
        env[n] = g.placeholder(n.name)
        env[n].meta = dict(n.meta)
    for n in graph.nodes:
        if n.op == "placeholder":
            env[n] = g.node_copy(n)

    def copy(node: fx.Node) -> fx.Node:
        if node not in env:
            for a in node.all_input_nodes:
                copy(a)
            env[node] = g.node_copy(node, env.__getitem__)
        return env[node]

    for n in graph.nodes:
        if stage[n] == index and n.op != "output":
            copy(n)
    if index == last:
        out = next(n for n in graph.nodes if n.op == "output")
        flat = fx.node.map_arg(out.args[0], copy)
        g.output(flat[0] if len(flat) == 1 else flat)
        return g
    sent = _live(graph, stage, index + 1)
    for n in sent:
        val = n.meta.get("val")
        if val is not None and not isinstance(val, torch.Tensor):
            raise StageSplitError(
                f"'{n.name}' ({type(val).__name__}) is made before stage {index + 1} and read on "
                "it or later; pipeline stages hand on tensors only, so compute it inside a block")
    g.output(tuple(_contiguous(g, env[n]) for n in sent))
    return g


def _contiguous(g: fx.Graph, node: fx.Node) -> fx.Node:
    """``node``, or a contiguous copy of it where its value is a strided view (T5's
    position bias, a permuted embedding): the next stage receives into a buffer of the
    sent strides, and gloo sends and receives contiguous tensors only."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.is_contiguous():
        return node
    copy = g.call_function(torch.ops.aten.contiguous.default, (node,),
                           name=f"{node.name}_contiguous")
    copy.meta = dict(node.meta, val=val.contiguous())
    return copy


def cut_program(model: nn.Module, ep: torch.export.ExportedProgram,
                stage_blocks: list[list[str]],
                device: torch.device) -> tuple[list[fx.GraphModule], list[str]]:
    """One GraphModule per stage of the program ``ep`` of ``model`` (exported by
    ``export_program`` keeping the ``outlined_paths`` of the blocks), with the graph's
    constant devices moved to ``device``; also return the model's input names."""
    blocks = [b for stage in stage_blocks for b in stage]
    graph, attrs = outlined_graph(model, ep, outlined_paths(model, blocks), blocks)
    exported_on = next((v.meta["val"].device for v in ep.graph.nodes
                        if isinstance(v.meta.get("val"), torch.Tensor)), device)
    retarget_devices(graph, exported_on, device)
    stage = assign_stages(graph, stage_blocks)
    modules = []
    for index in range(len(stage_blocks)):
        g = stage_graph(graph, stage, index, len(stage_blocks) - 1)
        root = {n.target: attrs[n.target] if n.op == "get_attr" else model.get_submodule(n.target)
                for n in g.nodes if n.op in ("get_attr", "call_module")}
        modules.append(fx.GraphModule(root, g, class_name=f"PipelineStage{index}"))
    names = [n.name for n in graph.nodes if n.op == "placeholder"]
    return modules, names


def _model_device(model: nn.Module) -> torch.device:
    """Where the model's tensors are (``meta`` for a model built there)."""
    t = next(iter(model.parameters()), None)
    if t is None:
        t = next(iter(model.buffers()), None)
    return t.device if t is not None else torch.device("cpu")


def split_stages(model: nn.Module, stage_blocks: list[list[str]],
                 example_inputs: torch.Tensor | tuple[torch.Tensor, ...],
                 device: torch.device | None = None) -> StageCut:
    """Cut ``model`` into one stage per entry of ``stage_blocks`` (the block paths of
    each stage, in pipeline order) from its program exported on ``example_inputs``
    (one micro-batch: the stages run these shapes); the stages' constants are made on
    ``device`` (default: the model's). Raises LoweringError saying what cannot be cut."""
    name = type(model).__name__
    where = _model_device(model)
    xs = example_inputs if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    inputs = tuple(torch.zeros(x.shape, dtype=x.dtype, device=where) for x in xs)  # shapes only
    blocks = [b for stage in stage_blocks for b in stage]
    try:
        ep = export_program(model, inputs, outlined_paths(model, blocks))
    except Exception as e:  # noqa: BLE001 — export raises many types
        first = (str(e).strip().splitlines() or [""])[0][:300]
        raise LoweringError(
            f"pipeline parallelism could not export {name}.forward with torch.export "
            f"({type(e).__name__}: {first}); make the forward exportable (no data-dependent "
            "control flow outside torch.cond), or plan without pipeline parallelism "
            "(pp=1)") from None
    try:
        modules, names = cut_program(model, ep, stage_blocks, device or where)
    except StageSplitError as e:
        raise LoweringError(f"pipeline parallelism cannot cut {name} into stages: {e}; or plan "
                            "without pipeline parallelism (pp=1)") from None
    _check_modules_held_once(modules)
    stages = []
    for i, m in enumerate(modules):
        received = [str(n.target) for n in m.graph.nodes if n.op == "placeholder"
                    and n.target not in names]
        out = next(n for n in m.graph.nodes if n.op == "output").args[0]
        sent = [] if i == len(modules) - 1 else [a.name for a in out]
        stages.append(StageGraph(i, m, received, sent))
    return StageCut(stages, names, ep.call_spec.out_spec, [tuple(x.shape) for x in inputs])


def _check_modules_held_once(modules: list[fx.GraphModule]) -> None:
    """A module with parameters may run on one stage only (its layout, FSDP wrapping
    and checkpointing would be applied twice); only parameters may be shared."""
    first: dict[int, int] = {}
    for index, stage in enumerate(modules):
        for path, m in stage.named_modules():
            if path and any(True for _ in m.parameters(recurse=False)):
                seen = first.setdefault(id(m), index)
                if seen != index:
                    raise LoweringError(
                        f"module '{path}' runs on pipeline stages {seen} and {index}; a module "
                        "with parameters must run on one stage (a module shared by several "
                        "blocks cannot be pipelined: tie its parameters instead, or use pp=1)")


def _has(model: nn.Module, path: str) -> bool:
    try:
        model.get_submodule(path)
    except AttributeError:
        return False
    return True


def pipeline_blocker(model: nn.Module, example_inputs: torch.Tensor | tuple[torch.Tensor, ...],
                     blocks: list[str]) -> str | None:
    """Why :func:`split_stages` cannot cut ``model`` at ``blocks``, or None: the
    planner's test of whether to offer pipelining, made by the runtime's own cut.

    Every block is given its own stage, the finest cut: a coarser one hands on a
    subset of the same values. Long lists of identical blocks are cut to their first
    two for the export (as :mod:`autopar.capture` does), so a deep model is checked
    at the cost of a shallow one."""
    with cut_lists(repeated_lists(model)):
        kept = [b for b in blocks if _has(model, b)]
        try:
            split_stages(model, [[b] for b in kept], example_inputs)
        except LoweringError as e:
            return str(e)
    return None


def stage_signature(stage: StageGraph) -> str:
    """A readable one-line description of what a stage receives, runs and sends."""
    calls = [str(n.target) for n in stage.module.graph.nodes if n.op == "call_module"]
    return (f"stage {stage.index}: ({', '.join(stage.inputs) or 'model inputs'}) -> "
            f"[{', '.join(calls)}] -> ({', '.join(stage.outputs) or 'model output'})")
