"""The pipeline sections of the emitted training program, as ``string.Template`` pieces.

:mod:`autopar.runtime.codegen_pipeline` fills them for a plan with a pipeline; the
program then cuts the model into stages (:data:`SPLIT_STAGES`, the runtime's own
cut copied in), gives stages their own copies of shared
parameters (:data:`TIED`), lays out and materializes only this rank's stages, and
runs the plan's ``torch.distributed.pipelining`` schedule (:data:`SCHEDULE`,
:data:`PIPELINE_STEP`), as :mod:`autopar.runtime.pipeline` does in process.
"""

from __future__ import annotations

import inspect
from string import Template

from autopar import capture as _capture
from autopar.runtime import materialize as _materialize
from autopar.runtime import pipeline as _pipeline
from autopar import pipeline_export as _export
from autopar import pipeline_split as _split

__all__ = ["LOCAL_MODULES", "SPLIT_STAGES", "TIED", "MATERIALIZE_STAGE", "SCHEDULE", "WHOLE_LOSS",
           "PIPELINE_STEP", "STEP_CALL", "STEP_CALL_TP", "STEP_CALL_CP", "CP_STAGE_SHAPES",
           "OWN_OUTPUTS", "BUILD", "STATE_MODULES"]

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

SPLIT_STAGES = Template("\n\n\n".join(inspect.getsource(f) for f in (
    _capture.cache_configs, _capture.kv_cache_off,
    _export.StageSplitError, _export.outlined_paths, _export.export_program,
    _export._called_once, _export._owner, _export._leaf_paths, _export._Outliner,
    _export.outlined_graph, _export.retarget_devices, _split._pinned, _split.assign_stages,
    _split._live, _split.stage_graph, _split._contiguous, _split.cut_program,
    _split._model_device)) + '''


def split_stages(model: nn.Module,
                 device: torch.device) -> tuple[list[fx.GraphModule], list[str]]:
    """Cut the model into one GraphModule per entry of STAGE_BLOCKS (cut_program), from
    its program exported by torch.export for one micro-batch of synthetic inputs on the
    model's device (meta or the CPU; only their shapes matter); also return the names of
    the model's inputs, which every stage takes as keywords. A stage calls the model's
    own blocks under their own paths, so the per-block layout above addresses them
    unchanged."""
    dtype = torch.long if INPUT_IS_TOKENS else torch.float32
    where = _model_device(model)
    example = (torch.zeros((MICROBATCH_SIZE,) + INPUT_SHAPE, dtype=dtype, device=where),)
    blocks = [block for stage in STAGE_BLOCKS for block in stage]
    program = export_program(model, example, outlined_paths(model, blocks))
    return cut_program(model, program, STAGE_BLOCKS, device)''')
"""The stage splitter: the runtime's own cut (:mod:`autopar.pipeline_export`,
:mod:`autopar.pipeline_split`), copied into the program, and the call that
exports the program's model for it."""

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
def materialize_stage(stage: nn.Module, device: torch.device, root: nn.Module) -> None:
    """materialize() one pipeline stage, keeping the constants tracing stored on it,
    then the initialization of the modules of root that enclose it."""
    constants = {name: t for name, t in stage.named_buffers(recurse=False) if not t.is_meta}
    materialize(stage, device)
    for name, t in constants.items():
        stage.register_buffer(name, t.to(device))
    reset_enclosing(root, stage, device)


''' + inspect.getsource(_materialize.reset_enclosing).replace("$", "$$"))
"""Materialize only this rank's stages."""

SCHEDULE = Template('''\
def build_schedule(stages: list[PipelineStage]) -> $cls:
    """The $schedule schedule ($detail) over this rank's stage$plural, in
    NUM_MICROBATCHES micro-batches. loss_fn gives a micro-batch's mean loss and the
    schedule divides gradients by the micro-batch count (scale_grads), so they are
    those of the mean over this rank's micro-batches."""
    return $cls(
        $stage_arg, n_microbatches=NUM_MICROBATCHES, loss_fn=$loss_fn, scale_grads=True)''')
"""The plan's ``torch.distributed.pipelining`` schedule."""

WHOLE_LOSS = Template('''\
def whole_loss(output: Any, targets: torch.Tensor) -> torch.Tensor:
    """loss_fn's value as a local tensor: on logits split along the vocabulary it is a
    DTensor (loss parallelism)."""
    return gather_output(loss_fn(output, targets))''')
"""The schedule's loss under loss parallelism."""

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
    batch = {name: x[part] for name, x in zip(input_names, inputs)}
$step_call$after    total = torch.zeros((), device=device)
    if losses:  # the last stage's mean, handed to every pp rank
        total += torch.stack([loss.detach().float() for loss in losses]).mean()
    dist.all_reduce(total, group=mesh.get_group("pp"))
$dp_mean    return total''')
"""One pipelined training step."""

STEP_CALL = "    schedule.step(target=targets[part], losses=losses, **batch)\n"
"""The schedule's step."""

STEP_CALL_CP = Template('''\
    xs, target = split_sequences(tuple(batch.values()), targets[part], mesh)
    batch = dict(zip(batch, xs))  # this rank's share of every sequence
$wrap    with SequenceShards(mesh.get_group("cp"), CP_VARIANT, SEQ_LEN):
$indent        schedule.step(target=target, losses=losses, **batch)
''')
"""The schedule's step under context parallelism (``$wrap``: the tensor-parallel mode
around it)."""

CP_STAGE_SHAPES = '''\
    example = tuple(x if d is None else x.narrow(d, 0, x.shape[d] // CP)  # a cp rank's share
                    for x, d in zip(example, SEQUENCE_DIMS))
'''
"""The stages of a context-parallel plan are exported for one rank's share of each
sequence."""

STEP_CALL_TP = Template(
    "    # tensors a stage makes meet DTensors as replicated\n"
    "    with plain_as_replicated()$lp:\n"
    "        schedule.step(target=targets[part], losses=losses, **batch)\n")
"""The schedule's step under tensor parallelism (``$lp``: loss parallelism's mode)."""

OWN_OUTPUTS = Template(inspect.getsource(_pipeline._own_outputs))
"""Stage outputs the zero-bubble schedules may detach in place (tensor parallelism)."""

BUILD = Template('''\
    mesh = build_mesh(device_type)
    model, on_meta = build_model(args.seed, args.build, device, host_bytes(args))
    names = state_names(model)  # the plain model's tensor names, for checkpoints
    graphs, input_names = split_stages(model, device)
$untie    torch.manual_seed(args.seed)  # every rank initializes alike
    stages: dict[int, nn.Module] = {}  # this rank's stages by index
    for index, stage in enumerate(graphs):
        if STAGE_RANKS[index] == mesh.get_local_rank("pp"):
            if not on_meta:
                stage.to(device)  # laid out from its own weights
$layout            if on_meta:
                materialize_stage(stage, device, model)  # only this rank's stages
            stages[index] = stage
$groups    schedule = build_schedule([
        PipelineStage(stage, index, len(STAGE_BLOCKS), device, group=mesh.get_group("pp"))
        for index, stage in stages.items()])
$sync    model = nn.ModuleDict({str(index): stage for index, stage in stages.items()})
''')
"""The start of ``main`` for a pipelined plan: split, lay out own stages (materialized if
the model started on meta), schedule."""


STATE_MODULES = Template('''\
def state_modules(model: nn.ModuleDict) -> tuple[list[nn.Module], set[tuple[int, str]]]:
    """This rank's stages in pipeline order, and (position among them, name) of each
    later copy of a TIED weight they hold: a checkpoint saves the first owner's."""
    order = sorted(model, key=int)
    at = {int(key): i for i, key in enumerate(order)}
    later = {(at[index], name) for copies in $tied for index, name in copies[1:]
             if index in at}
    return [model[key] for key in order], later''')
"""Where a checkpoint finds this rank's tensors: its stages."""
