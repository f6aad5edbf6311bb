"""Cut a model into pipeline stage modules along a plan's stage units.

The user's model is left as written (no special forward). :func:`split_stages`
traces it once with ``torch.fx`` keeping every unit of ``plan.pipeline`` (e.g.
``"tok_emb"``, ``"blocks.3"``, ``"head"``) as one opaque call, then builds one
``GraphModule`` per stage that calls the *original* unit modules under their
original paths, so ``parallelize_module`` and ``fully_shard`` address them by the
plan's module paths (``stage.get_submodule("blocks.3.attn.q")`` is the model's own
module).

Which stage runs each traced node:

* a unit call runs on its unit's stage;
* an op that reads the output of some unit runs on the latest stage among its inputs
  (``tok_emb(idx) + pos_emb(pos)`` on the first stage, ``ln_f`` output handed on);
* an op that reads only the model's inputs and constants (``torch.arange`` of the
  sequence length, Llama's RoPE tables) is recomputed by every stage that uses it.

Every stage module is called as ``stage(*activations, **model_inputs)``: the
activations are the values the previous stage hands on (as a tuple, in graph
order), and the model inputs of the current micro-batch reach every stage as
keyword arguments (``torch.distributed.pipelining`` passes a schedule's
``step(**kwargs)`` to all stages), so input-only ops need no transfer. The first
stage takes no activations; the last stage returns the model's output.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import fx, nn

from autopar.errors import LoweringError

__all__ = ["StageGraph", "trace_units", "split_stages", "stage_signature"]


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


class _UnitTracer(fx.Tracer):
    """An fx tracer that keeps the pipeline units as opaque module calls."""

    def __init__(self, units: set[str]) -> None:
        super().__init__()
        self.units = units

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        """Units are leaves, as are torch.nn's own modules."""
        return module_qualified_name in self.units or \
            super().is_leaf_module(m, module_qualified_name)


def trace_units(model: nn.Module, units: list[str]) -> fx.Graph:
    """Symbolically trace ``model`` with each of ``units`` as one call; raises
    LoweringError when the model cannot be traced or a unit is never called."""
    try:
        graph = _UnitTracer(set(units)).trace(model)
    except Exception as e:  # fx raises many types (TraceError, TypeError, ...)
        raise LoweringError(
            f"pipeline parallelism could not trace {type(model).__name__}.forward with "
            f"torch.fx ({type(e).__name__}: {e}); keep data-dependent control flow inside "
            "the blocks, or plan without pipeline parallelism (pp=1)") from None
    called = {n.target for n in graph.nodes if n.op == "call_module"}
    missing = [u for u in units if u not in called]
    if missing:
        raise LoweringError(
            f"pipeline unit '{missing[0]}' is never called as a module by "
            f"{type(model).__name__}.forward; stage units must be modules the forward calls "
            "(the modules before the blocks, each block, the modules after them)")
    return graph


def _assign(graph: fx.Graph, stage_of_unit: dict[str, int]) -> dict[fx.Node, int | None]:
    """The stage of each node, or None for input-only nodes (recomputed where used)."""
    stage: dict[fx.Node, int | None] = {}
    for node in graph.nodes:
        inputs = [stage[a] for a in node.all_input_nodes]
        after = max((s for s in inputs if s is not None), default=None)
        if node.op == "call_module" and node.target in stage_of_unit:
            own = stage_of_unit[node.target]
            if after is not None and after > own:
                raise LoweringError(
                    f"pipeline unit '{node.target}' is on stage {own} but reads a value made "
                    f"on stage {after}; list the units in the order the forward runs them")
            stage[node] = own
        elif node.op == "output":
            stage[node] = max(stage_of_unit.values())
        else:
            stage[node] = after
    return stage


def _live(graph: fx.Graph, stage: dict[fx.Node, int | None], boundary: int) -> list[fx.Node]:
    """Staged values made before stage ``boundary`` and read at or after it."""
    return [n for n in graph.nodes if stage[n] is not None and stage[n] < boundary
            and any(stage[u] is not None and stage[u] >= boundary for u in n.users)]


def _stage_graph(graph: fx.Graph, stage: dict[fx.Node, int | None], index: int,
                 last: int) -> tuple[fx.Graph, list[str], list[str]]:
    """Build the graph of stage ``index``: activation placeholders, then the model
    inputs as keyword placeholders, then its nodes in order."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    received = _live(graph, stage, index) if index > 0 else []
    for n in received:
        env[n] = g.placeholder(n.name)
    for n in graph.nodes:
        if n.op == "placeholder":
            env[n] = g.node_copy(n, lambda a: env[a])

    def copy(node: fx.Node) -> fx.Node:
        if node not in env:
            for a in node.all_input_nodes:
                copy(a)
            env[node] = g.node_copy(node, lambda a: env[a])
        return env[node]

    for n in graph.nodes:
        if stage[n] == index and n.op != "output":
            copy(n)
    if index == last:
        out = next(n for n in graph.nodes if n.op == "output")
        for a in out.all_input_nodes:
            copy(a)
        g.node_copy(out, lambda a: env[a])
        sent: list[fx.Node] = []
    else:
        sent = _live(graph, stage, index + 1)
        g.output(tuple(env[n] for n in sent))
    return g, [n.name for n in received], [n.name for n in sent]


def split_stages(model: nn.Module, stage_units: list[list[str]]) -> list[StageGraph]:
    """Cut ``model`` into one GraphModule per entry of ``stage_units`` (the units of
    each stage, in pipeline order); see the module docstring."""
    stage_of_unit: dict[str, int] = {}
    for i, units in enumerate(stage_units):
        for u in units:
            if u in stage_of_unit:
                raise LoweringError(f"pipeline unit '{u}' is listed on stages "
                                    f"{stage_of_unit[u]} and {i}; give each unit one stage")
            stage_of_unit[u] = i
    graph = trace_units(model, list(stage_of_unit))
    stage = _assign(graph, stage_of_unit)
    last = len(stage_units) - 1
    stages = []
    for i in range(len(stage_units)):
        g, received, sent = _stage_graph(graph, stage, i, last)
        gm = fx.GraphModule(model, g, class_name=f"PipelineStage{i}")
        stages.append(StageGraph(i, gm, received, sent))
    return stages


def stage_signature(stage: StageGraph) -> str:
    """A readable one-line description of what a stage receives, runs and sends."""
    calls = [str(n.target) for n in stage.module.graph.nodes if n.op == "call_module"]
    return (f"stage {stage.index}: ({', '.join(stage.inputs) or 'model inputs'}) -> "
            f"[{', '.join(calls)}] -> ({', '.join(stage.outputs) or 'model output'})")

