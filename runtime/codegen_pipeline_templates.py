"""The pipeline sections of the emitted training program, as ``string.Template`` pieces.

:mod:`autopar.runtime.codegen_pipeline` fills them for a plan with a pipeline; the
program then cuts the model into stages (:data:`SPLIT_STAGES`, the counterpart of
:mod:`autopar.runtime.pipeline_split`), gives stages their own copies of shared
parameters (:data:`TIED`), lays out and materializes only this rank's stages, and
runs the plan's ``torch.distributed.pipelining`` schedule (:data:`SCHEDULE`,
:data:`PIPELINE_STEP`), as :mod:`autopar.runtime.pipeline` does in process.
"""

from __future__ import annotations

from string import Template

__all__ = ["LOCAL_MODULES", "LOCAL_PLAN", "SPLIT_STAGES", "TIED", "MATERIALIZE_STAGE", "SCHEDULE",
           "PIPELINE_STEP", "BUILD"]

LOCAL_MODULES = Template('''\
def local_modules(model: nn.Module, paths: tuple[str, ...]) -> list[nn.Module]:
    """The modules of ``paths`` that ``model`` (one pipeline stage) holds."""
    found = []
    for path in paths:
        try:
            found.append(model.get_submodule(path))
        except AttributeError:
            pass  # on another stage
    return found''')
"""Lets the per-block loops run on a stage holding some of the blocks."""

LOCAL_PLAN = Template('''\
def local_plan(model: nn.Module, plan: dict[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """The entries of a parallelize plan whose modules ``model`` (one stage) holds."""
    return {path: style for path, style in plan.items() if local_modules(model, (path,))}''')
"""Lets a parallelize plan of the root's modules run on a stage holding some of them."""

SPLIT_STAGES = Template('''\
class UnitTracer(fx.Tracer):
    """A torch.fx tracer that keeps every pipeline unit as one opaque module call."""

    def __init__(self, units: set[str]) -> None:
        super().__init__()
        self.units = units

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        """Units are leaves, as are torch.nn's own modules."""
        return module_qualified_name in self.units or \\
            super().is_leaf_module(m, module_qualified_name)


def split_stages(model: nn.Module) -> tuple[list[fx.GraphModule], list[str]]:
    """Cut the model into one GraphModule per entry of STAGE_UNITS; also return the
    names of the model's inputs.

    The model is traced once with torch.fx, each unit ("blocks.3") kept as one call.
    A unit call runs on its unit's stage; an op reading some staged value runs on the
    latest stage among its inputs ("tok_emb(idx) + pos_emb(pos)" on the first stage);
    an op reading only the model's inputs and constants (torch.arange of the sequence
    length, RoPE tables) is recomputed by every stage that uses it. A stage is called
    as stage(*activations, **model_inputs): the activations are the values made on
    earlier stages and read on it or later ones, in graph order, and the model inputs
    of the micro-batch reach every stage as keywords (the schedule passes step()'s
    keywords to all stages). A stage returns the values later stages read, the last
    one the model's output. A stage calls the model's own unit modules under their
    own paths, so the per-module plans above address them unchanged.
    """
    stage_of = {unit: i for i, units in enumerate(STAGE_UNITS) for unit in units}
    graph = UnitTracer(set(stage_of)).trace(model)
    stage: dict[fx.Node, int | None] = {}  # None: input-only, recomputed where used
    for node in graph.nodes:
        after = max((stage[a] for a in node.all_input_nodes if stage[a] is not None),
                    default=None)
        if node.op == "call_module" and node.target in stage_of:
            stage[node] = stage_of[node.target]
        else:
            stage[node] = len(STAGE_UNITS) - 1 if node.op == "output" else after

    def live(boundary: int) -> list[fx.Node]:
        """Staged values made before stage ``boundary`` and read on it or later."""
        return [n for n in graph.nodes if stage[n] is not None and stage[n] < boundary
                and any(stage[u] is not None and stage[u] >= boundary for u in n.users)]

    stages = []
    for index in range(len(STAGE_UNITS)):
        g = fx.Graph()
        env = {n: g.placeholder(n.name) for n in live(index)}
        for n in graph.nodes:
            if n.op == "placeholder":
                env[n] = g.node_copy(n, env.__getitem__)

        def copy(node: fx.Node) -> fx.Node:
            """Copy ``node`` into ``g``, with the input-only values it reads."""
            if node not in env:
                for a in node.all_input_nodes:
                    copy(a)
                env[node] = g.node_copy(node, env.__getitem__)
            return env[node]

        for n in graph.nodes:
            if stage[n] == index and n.op != "output":
                copy(n)
        if index == len(STAGE_UNITS) - 1:
            out = next(n for n in graph.nodes if n.op == "output")
            for a in out.all_input_nodes:
                copy(a)
            g.node_copy(out, env.__getitem__)
        else:
            g.output(tuple(env[n] for n in live(index + 1)))
        stages.append(fx.GraphModule(model, g, class_name=f"PipelineStage{index}"))
    names = [str(n.target) for n in graph.nodes if n.op == "placeholder"]
    return stages, names''')
"""The stage splitter: an fx cut of the traced model (see its docstring)."""

TIED = Template('''\
def untie_across_stages(stages: list[fx.GraphModule]) -> None:
    """Give every stage but the first owner its own copy of each TIED parameter (the
    copies start equal: sync_tied copies the first owner's values after init)."""
    for copies in TIED:
        for index, name in copies[1:]:
            stage = stages[index]
            shared = stage.get_parameter(name)
            own = nn.Parameter(shared.detach().clone(), requires_grad=shared.requires_grad)
            for m in stage.modules():
                for local, p in list(m.named_parameters(recurse=False)):
                    if p is shared:
                        setattr(m, local, own)


def tied_process_groups(inner: int) -> list[dist.ProcessGroup | None]:
    """For each TIED parameter, the group of the pp ranks holding its copies at this
    rank's (dp, tp) coordinate; None where one pp rank holds them all. Every rank
    creates every group, in the same order (new_group is collective)."""
    groups: list[dist.ProcessGroup | None] = []
    for copies in TIED:
        owners = sorted({STAGE_RANKS[index] for index, _ in copies})
        mine = None
        for c in range(inner if len(owners) > 1 else 0):
            ranks = [r * inner + c for r in owners]
            group = dist.new_group(ranks)
            if dist.get_rank() in ranks:
                mine = group
        groups.append(mine)
    return groups


def sync_tied(stages: dict[int, nn.Module], groups: list[dist.ProcessGroup | None],
              grads: bool) -> None:
    """Sum the gradients of each TIED parameter's copies over this rank's stages and
    the owning pp ranks, and give every copy the sum (``grads``); or copy the lowest
    owning pp rank's values to every copy (not ``grads``)."""
    inner = dist.get_world_size() // PP
    with torch.no_grad():
        for copies, group in zip(TIED, groups):
            params = [stages[i].get_parameter(n) for i, n in copies if i in stages]
            if not params:
                continue
            local = [p.grad if grads else p for p in params]
            local = [t.to_local() if isinstance(t, DTensor) else t for t in local]
            total = local[0].clone()
            if grads:
                for t in local[1:]:
                    total += t
                if group is not None:
                    dist.all_reduce(total, group=group)
            elif group is not None:
                first = min(STAGE_RANKS[i] for i, _ in copies)
                src = first * inner + dist.get_rank() % inner
                dist.broadcast(total, src=src, group=group)
            for t in local:
                t.copy_(total)''')
"""Shared parameters across stages: one copy per stage, gradients summed."""

MATERIALIZE_STAGE = Template('''\
def materialize_stage(stage: nn.Module, device: torch.device) -> None:
    """materialize() one pipeline stage, keeping the constants tracing stored on it."""
    constants = {name: t for name, t in stage.named_buffers(recurse=False) if not t.is_meta}
    materialize(stage, device)
    for name, t in constants.items():
        stage.register_buffer(name, t.to(device))''')
"""Materialize only this rank's stages."""

SCHEDULE = Template('''\
def build_schedule(stages: list[PipelineStage]) -> $cls:
    """The $schedule schedule ($detail) over this rank's stage$plural, in
    NUM_MICROBATCHES micro-batches. loss_fn gives a micro-batch's mean loss and the
    schedule divides gradients by the micro-batch count (scale_grads), so they are
    those of the mean over this rank's micro-batches."""
    return $cls(
        $stage_arg, n_microbatches=NUM_MICROBATCHES, loss_fn=loss_fn, scale_grads=True)''')
"""The plan's ``torch.distributed.pipelining`` schedule."""

PIPELINE_STEP = Template('''\
def train_step(schedule: Any, stages: dict[int, nn.Module],$tied_arg mesh: DeviceMesh,
               input_names: list[str], inputs: tuple[torch.Tensor, ...],
               targets: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Run the schedule on this rank's dp slice of the global batch (tp ranks of a dp
    group take the same one); return the global mean loss. Every rank passes the
    inputs, on the device (stages recompute input-only values); the last stage computes
    the losses."""
    start = mesh.get_local_rank("dp") * NUM_MICROBATCHES * MICROBATCH_SIZE
    part = slice(start, start + NUM_MICROBATCHES * MICROBATCH_SIZE)
    losses: list[torch.Tensor] = []
    schedule.step(target=targets[part], losses=losses,
                  **{name: x[part] for name, x in zip(input_names, inputs)})
$after    total = torch.zeros((), device=device)
    if losses:  # the last stage's mean, handed to every pp rank
        total += torch.stack([loss.detach().float() for loss in losses]).mean()
    dist.all_reduce(total, group=mesh.get_group("pp"))
$dp_mean    return total''')
"""One pipelined training step."""

BUILD = Template('''\
    mesh = build_mesh(device_type)
    graphs, input_names = split_stages(build_model())
$untie    torch.manual_seed(args.seed)  # every rank initializes alike
    stages: dict[int, nn.Module] = {}  # this rank's stages by index
    for index, stage in enumerate(graphs):
        if STAGE_RANKS[index] == mesh.get_local_rank("pp"):
$layout            materialize_stage(stage, device)  # only this rank's stages
            stages[index] = stage
$groups    schedule = build_schedule([
        PipelineStage(stage, index, len(STAGE_UNITS), device, group=mesh.get_group("pp"))
        for index, stage in stages.items()])
$sync    model = nn.ModuleDict({str(index): stage for index, stage in stages.items()})
''')
"""The start of ``main`` for a pipelined plan: split, lay out own stages, schedule."""
