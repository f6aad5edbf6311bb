"""The text of the emitted training program, as ``string.Template`` pieces.

:mod:`autopar.runtime.codegen` fills these with a plan's values; every piece of
program text lives here, so the shape of the emitted program is read in one place,
except the check whether the model can start on meta and the materialization of a meta
model, which are the runtime's own code (:mod:`autopar.runtime.materialize`) copied in,
so that the two cannot drift apart.
Each section is a top-level definition of the program; :data:`PROGRAM` puts them in
order. ``$name`` marks a value, ``$$`` a literal dollar sign.
"""

from __future__ import annotations

import inspect
from string import Template

from autopar.runtime import checkpoint_state as _ck
from autopar.runtime import context_mode as _cm
from autopar.runtime import context_parallel as _cp
from autopar.runtime import dtensor_layout as _layout
from autopar.runtime import local_tensors as _local
from autopar.runtime import experts as _experts
from autopar.runtime import materialize as _materialize
from autopar.runtime import piecewise as _piecewise
from autopar.runtime import routed_experts as _routed
from autopar.runtime import tensor_parallel as _tp

__all__ = ["PROGRAM", "HEADER", "BUILD_MODEL", "BUILD_MESH", "DTENSOR_LAYOUT", "PIECEWISE",
           "APPLY_TP", "SELECTIVE_POLICY", "APPLY_AC", "APPLY_FSDP", "FSDP_BLOCKS", "FSDP_EXPERTS",
           "EXPERT_MESH", "EXPERT_PARALLEL", "CONTEXT_PARALLEL", "CONSTANTS",
           "MATERIALIZE", "PARTIAL_GRADS", "DATA", "LOSS", "USER_LOSS", "TRAIN_STEP",
           "FORWARD_BACKWARD", "FORWARD_BACKWARD_TP", "FORWARD_BACKWARD_CP", "FORWARD_BACKWARD_CP_TP",
           "LOSS_MODES", "LOSS_PARALLEL",
           "CHECKPOINT", "STATE_MODULES",
           "BUILD", "MAIN"]

PROGRAM = Template('''\
$header

$imports

$constants


$sections
''')
"""The whole program: docstring, imports, constants, then the sections."""

HEADER = Template('''\
"""Train $model under a parallelization plan: $mesh_text, $zero_text, $precision.

Predicted by the plan ($cluster): $step_time per step, $memory per device,
$throughput samples/s, MFU $mfu. Needs torch alone. Run with

    torchrun --nproc-per-node $world $program --steps 10 [--data BATCH.pt] [--save DIR]

(one process per device; $cuda_note).

Without --data each step trains on a fresh synthetic batch, whose loss shows that
training runs, not that the model learns. The model is the one the factory builds on
the CPU under --seed, as one process builds it; only where whole copies do not fit in
memory, or with --build meta, it starts on meta, each rank initializing its own shards
with the modules' reset_parameters() (the program says so).
"""''')
"""The module docstring."""

BUILD_MODEL = Template('''\
@functools.cache
def import_file(name: str) -> Any:
    """The Python file ``name`` (a relative path is read from this program's folder),
    imported once."""
    path = Path(name)
    if not path.is_absolute():
        path = Path(__file__).resolve().parent / path
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # so dataclasses and pickling inside it work
    spec.loader.exec_module(module)
    return module


def call_factory() -> nn.Module:
    """The model that $model_file:$factory returns, on the default device."""
    model = getattr(import_file(MODEL_FILE), MODEL_FACTORY)()
    return model[0] if isinstance(model, (tuple, list)) else model


''' + "\n\n".join(inspect.getsource(f) for f in (
    _materialize.without_reset_parameters, _materialize.custom_initialization,
    _materialize.meta_start_note, _materialize.tensor_bytes, _materialize.available_host_bytes,
    _materialize.choose_build)) + '''


def build_model(seed: int, build: str, device: torch.device,
                host_bytes: int | None) -> tuple[nn.Module, bool]:
    """The user's model and whether it is on the meta device (``build``: --build; see
    choose_build). Built on the CPU it is the model the factory makes under ``seed``,
    as one process builds it; on meta each rank later initializes only its own shards
    with the modules' reset_parameters()."""
    meta_model, meta_error = None, ""
    if build != "cpu":
        try:
            with torch.device("meta"):
                meta_model = call_factory()
        except Exception as e:  # noqa: BLE001 - the factory's own code, e.g. data on a device
            meta_error = f"{type(e).__name__}: {e}"
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
    try:
        on_meta, message = choose_build(
            build, meta_model, meta_error, int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
            host_bytes if host_bytes is not None else available_host_bytes(), free)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    if message and dist.get_rank() == 0:
        print(message, flush=True)
    if on_meta:
        return meta_model, True
    torch.manual_seed(seed)
    return call_factory(), False''')
"""Import the user's factory by file path and build the model: on the CPU from the
factory whenever it fits, else on ``meta`` (:func:`autopar.runtime.materialize.choose_build`
and the checks it calls, copied in; ``--build`` chooses)."""

CONTEXT_PARALLEL = Template('''\
class LoweringError(RuntimeError):
    """What context parallelism cannot run."""


''' + "\n\n".join(inspect.getsource(f) for f in (
    _cp.head_tail, _cp.shard_sequence, _cp._pieces, _cp._natural, _cp._repeat_heads,
    _cp.gather_sequence, _cp._lower_right, _cp.allgather_attention, _cp._heads_to_sequence,
    _cp._sequence_to_heads, _cp.ulysses_attention, _cp._RingPass, _cp._shift, _cp._block,
    _cp.ring_attention, _cm._one_sequence)) + '''


VARIANT_FUNCTIONS = {
    "allgather": allgather_attention, "ring": ring_attention, "ulysses": ulysses_attention}
"""The attention function of each context-parallel variant."""

_SDPA = (F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention,
         torch.ops.aten.scaled_dot_product_attention.default)
_SDPA_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale",
               "enable_gqa")
_ARANGE = (torch.arange, torch.ops.aten.arange.default, torch.ops.aten.arange.start,
           torch.ops.aten.arange.start_step)


''' + inspect.getsource(_cm.SequenceShards) + '''


def data_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP2 runs on: dp and cp flattened (cp's ranks hold the same parameters
    and average their gradients)$doc."""
$body


def split_sequences(inputs: tuple[torch.Tensor, ...], targets: torch.Tensor,
                    mesh: DeviceMesh) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """This cp rank's head-tail share of every sequence (SEQUENCE_DIMS: the sequence
    dim of each input, then of the targets; None: no sequence)."""
    rank = mesh.get_local_rank("cp")
    dims = SEQUENCE_DIMS[:len(inputs)]
    inputs = tuple(x if d is None else shard_sequence(x, d, CP, rank)
                   for x, d in zip(inputs, dims))
    d = SEQUENCE_DIMS[len(inputs)] if len(SEQUENCE_DIMS) > len(inputs) else None
    return inputs, targets if d is None else shard_sequence(targets, d, CP, rank)''')
"""Context parallelism: the runtime's attention variants and function mode
(:mod:`autopar.runtime.context_parallel`, :mod:`autopar.runtime.context_mode`), copied
into the program, and the cut of each rank's sequences."""

BUILD_MESH = Template('''\
def build_mesh(device_type: str) -> DeviceMesh:
    """The device mesh, ranks row-major, tp innermost (a tp group is neighbouring ranks)."""
    # $comment
    return init_device_mesh(device_type, $shape,${sep}mesh_dim_names=$names)''')
"""``init_device_mesh`` with the plan's axes."""

DTENSOR_LAYOUT = Template("\n\n".join(inspect.getsource(f) for f in (
    _layout.any_index, _layout.lookup, _layout.ReplicateUnsharded, _layout.plain_as_replicated,
    _layout.place_parameters, _layout._Relayout, _layout._redistribute, _layout._first_tensor,
    _layout._input_hook, _layout._output_hook,
    _layout.relayout_modules, _layout._to_dtensor, _layout.gather_output, _layout.distribute_io,
    _layout._attention_strategies, _layout.register_cpu_attention_sharding,
    _local._same_outputs, _local.LocalRegion, _local._local_input, _local._LocalShard,
    _local._local_shard, _local._local_weights,
    _local._partial_output, _local._add_bias, _local.localize_regions)))
"""DTensors from input to output, local tensors inside the regions that allow them: the
runtime's own functions (:mod:`autopar.runtime.dtensor_layout`,
:mod:`autopar.runtime.local_tensors`), copied into the program."""

PIECEWISE = Template("\n\n".join(inspect.getsource(f) for f in (
    _piecewise.piecewise_shard, _piecewise.piecewise_pieces, _piecewise._sharded_on,
    _piecewise._split_sizes, _piecewise._split, _piecewise._cat_strategy,
    _piecewise.register_piecewise_sharding)))
"""Fused projections split per head (``S(d)/k`` placements): the runtime's own functions
(:mod:`autopar.runtime.piecewise`), copied into the program."""

APPLY_TP = Template('''\
def apply_tp(model: nn.Module, tp_mesh: DeviceMesh$last_arg) -> None:
    """Tensor$sp_text parallelism over tp=$tp. Every parameter becomes a DTensor (split as
    listed, "*" standing for any block index; the rest replicated); activations stay
    DTensors through the model's own code, so its shapes are global; the listed modules'
    first input and output are redistributed where the plan changes layout; the listed
    regions run on local tensors between their colwise and rowwise Linears where their
    first forward shows that exact. Comments give each module's style and predicted
    forward + backward time per step."""
    register_cpu_attention_sharding()$piecewise
    place_parameters(model, tp_mesh, $params)
    relayout_modules(model, inputs=$inputs, outputs=$outputs)
    localize_regions(model, tp_mesh, regions=$regions, linears=$linears)
    distribute_io(model, tp_mesh$gather''')
"""Tensor parallelism: the plan's tables applied by the runtime's functions."""

SELECTIVE_POLICY = Template('''\
def selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Selective recomputation: keep the outputs of matrix products, attention and
    reduce-scatters, recompute the rest (norms, pointwise ops, softmax) in backward."""
    name = getattr(getattr(op, "overloadpacket", op), "__name__", str(op))
    if name in SAVE_OPS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE''')
"""The selective checkpoint policy (a save list of aten op names)."""

APPLY_AC = Template('''\
def apply_ac(model: nn.Module) -> None:
    """Activation recomputation per block: the block's forward runs under
    torch.utils.checkpoint ($ac_cost)."""
$body''')
"""Checkpoint each recomputed block's forward in place (its parameter names stay)."""

APPLY_FSDP = Template('''\
def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh$expert_arg) -> None:
    """$zero_title: fully_shard per $units, then on the root.
    $zero_doc$fsdp_cost."""
$policies$expert_loop$block_loop    # the root's parameters (embeddings, head) are needed again first in backward
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=False$kwargs)''')
"""FSDP2 per block and on the root with the plan's ZeRO, precision and offload."""

FSDP_EXPERTS = Template('''\
    # the experts: over the dp ranks that hold the same ones (their ep rank's share)
    modules = dict(model.named_modules())
    for path in $paths:
        if path in modules:
            fully_shard(modules[path], mesh=expert_mesh,
                        reshard_after_forward=$reshard$kwargs)
''')
"""The per-expert-module ``fully_shard`` loop, before the blocks that hold them."""

EXPERT_MESH = Template('''\
@functools.cache
def build_expert_mesh(device_type: str) -> DeviceMesh:
    """The mesh of expert parallelism: the same ranks with the data-parallel axis cut in
    dp (ranks holding the same experts) x ep (ranks splitting them), ep inner."""
    # $comment
    return init_device_mesh(device_type, $shape,
                            mesh_dim_names=$names)''')
"""The expert mesh, built once (every stage of a pipeline rank asks for it)."""

EXPERT_LEGS = Template('''\
@functools.cache
def build_ep_legs(device_type: str) -> tuple[DeviceMesh, DeviceMesh]:
    """The ep group cut into its nodes of $per_node ranks (ep rank = node x $per_node +
    local): the mesh across the nodes and the mesh inside this rank's, over which a
    routed module's tokens move in two legs."""
    # $comment
    root = init_device_mesh(device_type, $shape, mesh_dim_names=$names)
    return root["ep_node"], root["ep_local"]''')
"""The two legs' meshes, built once, where a routed module's exchange has two legs."""

EXPERT_PARALLEL = Template("\n\n".join(inspect.getsource(f) for f in (
    _routed.exchange_rows, _routed.routed_args, _routed.Sends, _routed.plan_sends,
    _routed.exchange_ids, _routed.to_experts, _routed.from_experts, _routed.route_tokens,
    _routed._by_node, _routed._own_rows,
    _experts.ScaleGrad, _experts.over_ep, _experts.exchange, _experts.gather_tokens,
    _experts.keep_own_experts, _experts.split_experts, _experts.shard_expert_weights)) + '''


EXPERTS = $table
"""Expert modules: path -> (batch dim, expert dim of its input, of its output,
{parameter: expert dim}, ep ranks per node of a two-leg exchange, folded over tp);
-1 for both dims marks a routed module, for the output's alone a gathered one (every
expert on every token, a gate combining them)."""


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh,
             legs: tuple[DeviceMesh, DeviceMesh] | None = None,
             tp_mesh: DeviceMesh | None = None) -> None:
    """Expert parallelism over ep=$ep: each listed module keeps 1/$ep of its experts
    and its tokens cross ep on the way in and out (all-to-all; for a gathered module
    all-gather in, reduce-scatter out; in two legs over ``legs``, across the nodes and
    inside one, where a routed module's ranks per node exceed 1; each tp rank's own
    tokens where the experts fold over ``tp_mesh``); predicted token exchange $a2a per
    step."""
    split_experts(model, EXPERTS, ep_mesh, legs, tp_mesh)


def shard_experts(model: nn.Module, expert_mesh: DeviceMesh,
                  tp_mesh: DeviceMesh | None) -> None:
    """The experts' weights as DTensors split over ep (after tensor parallelism; folded
    experts before it, which leaves them alone): what FSDP2 and checkpoints see; the
    modules' forwards see this rank's share."""
    shard_expert_weights(model, EXPERTS, expert_mesh, tp_mesh)''')
"""Expert parallelism: the runtime's own functions (:mod:`autopar.runtime.experts`),
copied into the program, with the plan's table."""

FSDP_BLOCKS = Template('''\
    for block in $blocks:
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=$reshard$kwargs)
''')
"""The per-block ``fully_shard`` loop."""

CONSTANTS = Template('''\
MODEL_FILE = "$model_file"  # a relative path is read from this program's folder
MODEL_FACTORY = "$factory"
GLOBAL_BATCH = $global_batch  # samples per optimizer step, the same batch on every rank
MICROBATCH_SIZE = $microbatch_size  # samples per forward on one dp rank
NUM_MICROBATCHES = $num_microbatches  # micro-batches (gradient accumulation) per step
INPUT_SHAPE = $input_shape  # one sample of synthetic data
INPUT_IS_TOKENS = $input_is_tokens
NUM_CLASSES = $num_classes  # synthetic token ids and targets are drawn below this
PREDICTED_STEP_S = $step_s$extra''')
"""The plan's values the program reads at run time."""

MATERIALIZE = Template("\n\n".join(inspect.getsource(f) for f in (
    _materialize.tied_aliases, _materialize.full_size_init, _materialize.materialize)))
"""``to_empty`` + ``reset_parameters`` of a laid-out meta model (at full size on a CPU):
the runtime's own functions (:mod:`autopar.runtime.materialize`), copied into the
program."""

PARTIAL_GRADS = Template(inspect.getsource(_tp.reduce_partial_gradients))
"""Only without FSDP under tensor parallelism: the runtime's own function
(:func:`autopar.runtime.tensor_parallel.reduce_partial_gradients`), copied."""

DATA = Template('''\
def load_batch(path: str) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """The global batch saved at ``path``, the dict {"inputs", "targets"} of torch.save:
    every step trains on it, on every rank."""
    data = torch.load(path)
    inputs = data["inputs"]
    return (tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)), data["targets"]


def synthetic_batch(seed: int, step: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """A fresh global batch of synthetic $synthetic_what and random targets for ``step``,
    from a generator seeded by ``seed`` and ``step``: the same on every rank, and after a
    resume. Random targets cannot be learned: the loss shows that training runs, not that
    the model learns (pass --data for that)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    shape = (GLOBAL_BATCH,) + INPUT_SHAPE
    if INPUT_IS_TOKENS:
        x = torch.randint(0, NUM_CLASSES, shape, generator=g)
        return (x,), torch.randint(0, NUM_CLASSES, shape, generator=g)
    x = torch.randn(shape, generator=g)
    return (x,), torch.randint(0, NUM_CLASSES, shape[:-1], generator=g)''')
"""The training data: a saved global batch, or a fresh synthetic one of the planned shape
each step."""

LOSS = Template('''\
def loss_fn(output: Any, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over the last dim of the logits, in fp32."""
    logits = output if isinstance(output, torch.Tensor) else output[0]
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())''')
"""The loss, as autopar's ParallelModel.step computes it."""

USER_LOSS = Template('''\
def loss_fn(output: Any, targets: torch.Tensor) -> torch.Tensor:
    """The user's loss, $loss_name from $loss_file."""
    return getattr(import_file(LOSS_FILE), LOSS_FUNCTION)(output, targets)''')
"""The user's own loss function, imported by file path as the model is."""

USER_SUM_LOSS = Template('''\
def loss_fn(output: Any, targets: torch.Tensor) -> torch.Tensor:
    """The user's loss, $loss_name from $loss_file. It sums over the batch, and the step
    takes the mean over micro-batches and dp ranks (of the loss, and FSDP2 of the
    gradients): each is scaled by their count, LOSS_SCALE, to keep the sum."""
    return LOSS_SCALE * getattr(import_file(LOSS_FILE), LOSS_FUNCTION)(output, targets)''')
"""The user's own loss function when it sums over the batch
(:func:`autopar.runtime.loss_scale`)."""

TRAIN_STEP = Template('''\
def train_step(model: nn.Module, mesh: DeviceMesh, inputs: tuple[torch.Tensor, ...],
               targets: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Forward and backward of the global batch (on the device); returns the global
    mean loss. This
    rank takes its dp slice (tp ranks of a dp group take the same one) in
    NUM_MICROBATCHES micro-batches and accumulates their gradients."""
    start = mesh.get_local_rank("dp") * NUM_MICROBATCHES * MICROBATCH_SIZE
$before    total = torch.zeros((), device=device)
    for i in range(NUM_MICROBATCHES):
$sync        part = slice(start + i * MICROBATCH_SIZE, start + (i + 1) * MICROBATCH_SIZE)
$forward_backward        total += loss.detach().float()
$after    return total''')
"""One training step without a pipeline."""

FORWARD_BACKWARD = '''\
        output = model(*(x[part] for x in inputs))
        loss = loss_fn(output, targets[part]) / NUM_MICROBATCHES
        loss.backward()
'''
"""A micro-batch's forward and backward."""

FORWARD_BACKWARD_TP = Template('''\
        # tensors the forward makes meet DTensors as replicated
        with plain_as_replicated()$lp:
            output = model(*(x[part] for x in inputs))
            loss = $loss / NUM_MICROBATCHES
            loss.backward()
''')
"""A micro-batch's forward and backward under tensor parallelism (``$lp``, ``$loss``:
:data:`LOSS_MODES`)."""

FORWARD_BACKWARD_CP = '''\
        # this rank's share of every sequence: attention over the cp group, its positions
        with SequenceShards(mesh.get_group("cp"), CP_VARIANT, SEQ_LEN):
            output = model(*(x[part] for x in inputs))
        loss = loss_fn(output, targets[part]) / NUM_MICROBATCHES
        loss.backward()
'''
"""A micro-batch's forward and backward under context parallelism."""

FORWARD_BACKWARD_CP_TP = Template('''\
        # tensors the forward makes meet DTensors as replicated
        with plain_as_replicated()$lp:
            # this rank's share of every sequence: attention over the cp group, its positions
            with SequenceShards(mesh.get_group("cp"), CP_VARIANT, SEQ_LEN):
                output = model(*(x[part] for x in inputs))
            loss = $loss / NUM_MICROBATCHES
            loss.backward()
''')
"""A micro-batch's forward and backward under context and tensor parallelism
(``$lp``, ``$loss``: :data:`LOSS_MODES`)."""

LOSS_MODES = {
    False: {"lp": "", "loss": "loss_fn(output, targets[part])"},
    True: {"lp": ", class_parallel_loss()",
           "loss": "gather_output(loss_fn(output, targets[part]))"},
}
"""The substitutions of the tensor-parallel forward and backward without and with loss
parallelism (the loss on logits split along their classes: ``plan.loss_parallel``)."""

LOSS_PARALLEL = Template("\n\n".join(inspect.getsource(f) for f in (
    _layout._splits_classes, _layout._when_classes_split, _layout.class_parallel_loss)))
"""Loss parallelism: the runtime's own functions (:mod:`autopar.runtime.dtensor_layout`),
copied into the program."""

CHECKPOINT = Template("\n\n\n".join(inspect.getsource(f) for f in (
    _ck.state_names, _ck.checkpoint_record, _ck.optimizer_record, _ck.canonical_tensors,
    _ck.init_optimizer_state, _ck._chunkable, _ck.flat_state, _ck._copy_into,
    _ck.read_commit, _ck.commit, _ck.begin_partial, _ck.save_state, _ck._check_shapes,
    _ck.damaged_file, _ck.unreadable, _ck.load_state, _ck.committed_steps,
    _ck.prune_checkpoints, _ck.attempt_store)).replace("$", "$$") + '''


$state_modules


def save_checkpoint(path: str, model: nn.Module, names: tuple[dict[str, str], frozenset[str]],
                    optimizer: torch.optim.Optimizer, step: int) -> None:
    """Model, optimizer, step and random generators with torch.distributed.checkpoint
    under the plain model's names (every rank writes its own shards): this program
    under any plan, or autopar.load, resumes from it."""
    modules, later = state_modules(model)
    record = checkpoint_record(step, {}, $mesh, "$model", names[0], optimizer)
    save_state(path, canonical_tensors(modules, *names, later), optimizer, record)


def load_checkpoint(path: str, model: nn.Module, names: tuple[dict[str, str], frozenset[str]],
                    optimizer: torch.optim.Optimizer) -> int:
    """Restore what save_checkpoint (or autopar.save) wrote under any plan, resharded
    onto this one; return the step it was saved after."""
    modules, _ = state_modules(model)
    return int(load_state(path, canonical_tensors(modules, *names), optimizer)["step"])''')
"""Saving and resuming with torch.distributed.checkpoint."""

BUILD = Template('''\
    mesh = build_mesh(device_type)
    model, on_meta = build_model(args.seed, args.build, device, host_bytes(args))
    names = state_names(model)  # the plain model's tensor names, for checkpoints
    if not on_meta:
        model.to(device)  # laid out from its own weights
$layout    if on_meta:
        torch.manual_seed(args.seed)  # every rank initializes alike
        materialize(model, device)
''')
"""The start of ``main`` without a pipeline: lay the whole model out, then materialize
it if it started on meta."""

MAIN = Template('''\
def parse_args() -> argparse.Namespace:
    """The command line."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10,
                    help="steps to train (with --checkpoint-dir: the last step to reach, so "
                         "a restarted job stops where the first would have)")
    ap.add_argument("--lr", type=float, default=$lr)
    ap.add_argument("--optimizer", choices=["adamw", "sgd"], default="$optimizer")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data", help="a torch.save'd dict {inputs, targets}: one global batch "
                    "to train on every step (default: a fresh synthetic batch each step)")
    ap.add_argument("--build", choices=["auto", "meta", "cpu"], default="$build_default",
                    help="where the model is built: cpu (the weights the factory makes under "
                         "--seed, a whole copy on each rank while it is laid out), meta (each "
                         "rank initializes only its shards, with the modules' "
                         "reset_parameters()) or auto (cpu whenever the copies fit in host "
                         "and device memory, else meta; default: %(default)s)")
    ap.add_argument("--host-memory", type=float, metavar="GB",
                    help="host memory --build auto may fill with the ranks' whole copies of "
                         "the model (default: what the machine has available)")
    ap.add_argument("--save", metavar="DIR", help="checkpoint after the last step")
    ap.add_argument("--load", metavar="DIR", help="resume from a checkpoint")
    ap.add_argument("--checkpoint-dir", metavar="DIR",
                    help="resume from the last complete DIR/step-<n> (a job torchrun "
                         "--max-restarts started again goes on) and save there")
    ap.add_argument("--checkpoint-every", type=int, default=0, metavar="K",
                    help="save DIR/step-<n> every K steps, keeping the last 2 (default: 0, "
                         "never)")
    return ap.parse_args()


def host_bytes(args: argparse.Namespace) -> int | None:
    """--host-memory in bytes (1 GB = 10^9 bytes), None when not given."""
    return None if args.host_memory is None else int(args.host_memory * 1e9)


def main() -> None:
    """Lay the model out as planned, then train."""
    args = parse_args()
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    backend = "nccl" if device_type == "cuda" else "gloo"
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:  # a restart: its own keys
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store = attempt_store(rank, world, datetime.timedelta(minutes=5))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world)
    else:
        dist.init_process_group(backend)
    device = torch.device("cpu")
    if device_type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
$build    if args.optimizer == "adamw":
        # one fused kernel per step on a GPU (torchtitan's default), as the plan prices it
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr,
                                      fused=device_type == "cuda")
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    first, last_step = 0, args.steps
    done = committed_steps(args.checkpoint_dir) if args.checkpoint_dir else []
    if done:  # a restarted job, or a later run: go on from the last complete save
        first = load_checkpoint(f"{args.checkpoint_dir}/step-{done[-1]:08d}", model, names,
                                optimizer)
    elif args.load:
        first = load_checkpoint(args.load, model, names, optimizer)
    if not args.checkpoint_dir:
        last_step = first + args.steps
    if dist.get_rank() == 0 and first:
        print(f"resumed after step {first}", flush=True)
    saved = load_batch(args.data) if args.data else None
    if dist.get_rank() == 0:
        print(f"data: the batch in {args.data}, every step" if saved else
              "data: a fresh synthetic batch each step ($synthetic_what and random targets, "
              "seeded by --seed and the step, alike on every rank): the loss shows that "
              "training runs, not that it learns; pass --data BATCH.pt", flush=True)
    for step in range(first + 1, last_step + 1):
        inputs, targets = saved or synthetic_batch(args.seed, step)
        # copied before the timed step: a pageable copy inside it would stall the host
        # until the device has run everything queued before it
        inputs, targets = tuple(x.to(device) for x in inputs), targets.to(device)
        start = time.perf_counter()
        loss = train_step($step_args)
        optimizer.step()
        optimizer.zero_grad()
        loss = loss.item()  # read after the optimizer step: the host never waits mid-step
        if device_type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        if dist.get_rank() == 0:
            print(f"step {step} loss {loss:.8f} time {elapsed * 1e3:.2f} ms "
                  f"(predicted {PREDICTED_STEP_S * 1e3:.2f} ms)", flush=True)
        if args.checkpoint_dir and args.checkpoint_every and step % args.checkpoint_every == 0:
            save_checkpoint(f"{args.checkpoint_dir}/step-{step:08d}", model, names, optimizer,
                            step)
            prune_checkpoints(args.checkpoint_dir, 2)
    if args.save:
        save_checkpoint(args.save, model, names, optimizer, last_step)
    dist.barrier()  # no rank tears its groups down while another is still in a collective
    dist.destroy_process_group()


if __name__ == "__main__":
    main()''')
"""The command line and the main function."""


STATE_MODULES = Template('''\
def state_modules(model: nn.Module) -> tuple[list[nn.Module], set[tuple[int, str]]]:
    """The modules holding this rank's tensors (the whole model), and the later
    copies of tied weights among them (none: one model holds each weight once)."""
    return [model], set()''')
"""Where a checkpoint finds this rank's tensors, without a pipeline."""
