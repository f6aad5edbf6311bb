"""Train GPT under a parallelization plan: mesh dp=2 x tp=2, ZeRO-3, fp32.

Predicted by the plan (h100-sxm, 1 node(s) x 4): 12.5 ms per step, 8.39 MB per device,
640.0 samples/s, MFU 41.0%. Needs torch alone. Run with

    torchrun --nproc-per-node 4 train.py --steps 10 [--data BATCH.pt] [--save DIR]

(one process per device; NCCL on GPUs, gloo on CPUs).

Without --data each step trains on a fresh synthetic batch, whose loss shows that
training runs, not that the model learns. The model is the one the factory builds on
the CPU under --seed, as one process builds it; only where whole copies do not fit in
memory, or with --build meta, it starts on meta, each rank initializing its own shards
with the modules' reset_parameters() (the program says so).
"""

import argparse
import contextlib
import datetime
import functools
import importlib.util
import json
import os
import re
import shutil
import sys
import time
import warnings
from collections.abc import Collection, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_tensor,
)
from torch.distributed.tensor.experimental import register_sharding
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

MODEL_FILE = "../codegen_models.py"  # a relative path is read from this program's folder
MODEL_FACTORY = "tiny_gpt"
GLOBAL_BATCH = 8  # samples per optimizer step, the same batch on every rank
MICROBATCH_SIZE = 4  # samples per forward on one dp rank
NUM_MICROBATCHES = 1  # micro-batches (gradient accumulation) per step
INPUT_SHAPE = (16,)  # one sample of synthetic data
INPUT_IS_TOKENS = True
NUM_CLASSES = 128  # synthetic token ids and targets are drawn below this
PREDICTED_STEP_S = 0.0125
SAVE_OPS = {  # outputs selective recomputation keeps (aten op names)
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu", "addmm",
    "baddbmm", "bmm", "einsum", "linear", "matmul", "mm", "reduce_scatter_tensor",
    "scaled_dot_product_attention", "tensordot",
}


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
    """The model that codegen_models.py:tiny_gpt returns, on the default device."""
    model = getattr(import_file(MODEL_FILE), MODEL_FACTORY)()
    return model[0] if isinstance(model, (tuple, list)) else model


def without_reset_parameters(model: nn.Module) -> str | None:
    """The first module, in module order, that directly owns parameters or buffers but
    has no ``reset_parameters()`` to initialize them after a meta start, written
    ``'path' (Class)``; None when the model can start on meta."""
    for path, m in model.named_modules():
        owns = any(True for _ in m.parameters(recurse=False)) or \
            any(True for _ in m.buffers(recurse=False))
        if owns and not callable(getattr(m, "reset_parameters", None)):
            return f"'{path or 'the root module'}' ({type(m).__name__})"
    return None


def custom_initialization(model: nn.Module) -> str | None:
    """The first module, in module order, with an initialization method of its own that
    :func:`materialize` does not run (``_init_weights`` or ``init_weights``, as
    nanoGPT, torchtitan and Hugging Face models name theirs), written ``'path' (Class)
    defines _init_weights()``; None when there is none. A model built on meta starts
    from its modules' ``reset_parameters()`` instead."""
    for path, m in model.named_modules():
        for name in ("_init_weights", "init_weights"):
            if callable(getattr(m, name, None)):
                return f"'{path or 'the root module'}' ({type(m).__name__}) defines {name}()"
    return None


def meta_start_note(model: nn.Module) -> str:
    """What initializes a model that starts on meta, for the user to read: each
    rank's shards get its modules' ``reset_parameters()``, not the weights the model's
    own code makes (in ``__init__``, a factory's seed, or an initialization method of
    its own, :func:`custom_initialization`, named when there is one)."""
    own = custom_initialization(model)
    text = ("the model starts on meta: each rank initializes its own shards with each "
            "module's reset_parameters(), not with the weights the model's code makes")
    return text + (f" (module {own}, which does not run)" if own is not None else "")


def tensor_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers, each tensor counted once (tied
    weights once), at their dtypes: what one whole copy of the model holds."""
    seen: dict[int, torch.Tensor] = {}
    for t in [*model.parameters(), *model.buffers()]:
        seen.setdefault(id(t), t)
    return sum(t.numel() * t.element_size() for t in seen.values())


def available_host_bytes() -> int:
    """The host memory this machine can still give (Linux ``MemAvailable`` of
    ``/proc/meminfo``; elsewhere the free physical pages)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def choose_build(build: str, meta_model: nn.Module | None, meta_error: str, local_ranks: int,
                 host_bytes: int, device_bytes: int | None) -> tuple[bool, str]:
    """Where a program builds the model: (on meta, what to tell the user, '' for
    nothing). ``build`` is "cpu" (from the factory, on the CPU), "meta" or "auto";
    ``meta_model`` the factory's model built on meta, None when that failed with
    ``meta_error``. "auto" builds on the CPU, the weights the factory makes, whenever
    ``local_ranks`` whole copies fit in ``host_bytes`` and one fits in
    ``device_bytes`` (the device's free memory, None for a CPU run): each rank holds
    one while it builds and lays it out. Otherwise it starts on meta and says which
    initialization runs instead. Raises ValueError where neither can work."""
    if build == "cpu":
        return False, ""
    if meta_model is None:
        if build == "meta":
            raise ValueError(f"--build meta: the factory cannot run on the meta device "
                             f"({meta_error}); use --build cpu")
        return False, (f"the factory cannot run on the meta device ({meta_error}): building "
                       "the model on the CPU")
    missing = without_reset_parameters(meta_model)
    if build == "meta":
        if missing is not None:
            raise ValueError(f"--build meta: module {missing} owns tensors but has no "
                             "reset_parameters() to initialize them on meta; use --build cpu")
        return True, meta_start_note(meta_model)
    size = tensor_bytes(meta_model)
    if local_ranks * size <= host_bytes and (device_bytes is None or size <= device_bytes):
        return False, ""
    where = (f"{local_ranks} whole cop{'y' if local_ranks == 1 else 'ies'} of {size / 1e9:.3g} "
             f"GB need more than the host's {host_bytes / 1e9:.3g} GB"
             if local_ranks * size > host_bytes else
             f"one whole copy of {size / 1e9:.3g} GB needs more than the device's free "
             f"{(device_bytes or 0) / 1e9:.3g} GB")
    if missing is not None:
        raise ValueError(f"the model cannot be built whole ({where}) and module {missing} "
                         "has no reset_parameters() to start on meta; add one, or run on "
                         "machines with more memory")
    return True, f"{meta_start_note(meta_model)}, since {where} (--build cpu builds it anyway)"



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
    return call_factory(), False


def build_mesh(device_type: str) -> DeviceMesh:
    """The device mesh, ranks row-major, tp innermost (a tp group is neighbouring ranks)."""
    # dp=2 x tp=2
    # predicted communication per step: collectives 3 ms; 1 ms exposed
    return init_device_mesh(device_type, (2, 2), mesh_dim_names=("dp", "tp"))


def any_index(name: str) -> str:
    """``name`` with every numeric path component written ``*`` (``"h.3.attn.c_attn"``
    -> ``"h.*.attn.c_attn"``): the key of an entry that holds for every block."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)", "*", name)


def lookup(table: Mapping[str, Any], name: str) -> Any:
    """``table[name]``, else the entry for every block (:func:`any_index`), else None."""
    found = table.get(name)
    return found if found is not None else table.get(any_index(name))


class ReplicateUnsharded:
    """DTensor's sharding propagation, falling back for an operator DTensor has no
    sharding strategy for (a custom op, a rare aten op), or whose strategy fails: while
    plain tensors are read as replicated (:func:`plain_as_replicated`), its DTensor
    inputs are gathered whole, it runs as in one process, and its tensor outputs go on
    as replicated DTensors. The planner prices such an op replicated.

    :meth:`install` puts it in place of the dispatcher's slow path, which DTensor's C++
    dispatch calls only when its cache of sharding decisions misses (a failure is never
    cached): the operators DTensor shards, and those on plain tensors, never reach it.
    It reads the implicit-replication flag, thread state that autograd carries into
    the backward, so it serves only inside :func:`plain_as_replicated` (or torch's own
    ``implicit_replication``) and on that thread (a private method in torch 2.11 to
    2.13)."""

    def __init__(self, propagate: Any) -> None:
        self.propagate = propagate

    def __call__(self, func: Any, args: tuple, kwargs: dict, info: Any,
                 try_cache: bool) -> Any:  # noqa: D102
        try:
            return self.propagate(func, args, kwargs, info, try_cache)
        except (NotImplementedError, RuntimeError) as e:
            # no strategy, or one whose shape function refuses what the CPU kernel runs
            # (aten._grouped_mm's asks for bf16 while the CPU kernel takes fp32)
            if not DTensor._op_dispatcher._allow_implicit_replication or (
                    "sharding strategy" not in str(e)
                    and "Sharding propagation failed" not in str(e)):
                raise
        meshes = [x.device_mesh for x in tree_flatten((args, kwargs))[0]
                  if isinstance(x, DTensor)]
        whole = tree_map(lambda x: x.full_tensor() if isinstance(x, DTensor) else x,
                         (args, kwargs))
        out = func(*whole[0], **whole[1])
        mesh = meshes[0]
        return tree_map(lambda t: DTensor.from_local(t, mesh, [Replicate()] * mesh.ndim,
                                                     run_check=False)
                        if isinstance(t, torch.Tensor) else t, out)

    @staticmethod
    def install() -> None:
        """Wrap DTensor's dispatcher's slow path in the fallback, once per process."""
        dispatcher = DTensor._op_dispatcher
        slow = dispatcher._propagate_op_sharding_dispatch_slow_path
        if not isinstance(slow, ReplicateUnsharded):
            dispatcher._propagate_op_sharding_dispatch_slow_path = ReplicateUnsharded(slow)


@contextlib.contextmanager
def plain_as_replicated() -> Iterator[None]:
    """Read plain tensors that meet DTensors as replicated (``torch.arange(T)``, a
    mask, a buffer), forward and backward, and run operators DTensor cannot shard
    replicated (:class:`ReplicateUnsharded`). Unlike torch's ``implicit_replication``,
    which it extends, it nests: leaving it restores the setting it found. (The flag is
    DTensor's dispatcher's, a private attribute in torch 2.11 to 2.13.)"""
    ReplicateUnsharded.install()
    dispatcher = DTensor._op_dispatcher
    before = dispatcher._allow_implicit_replication
    dispatcher._allow_implicit_replication = True
    try:
        yield
    finally:
        dispatcher._allow_implicit_replication = before


def place_parameters(model: nn.Module, mesh: DeviceMesh,
                     sharded: Mapping[str, Placement]) -> None:
    """Make every parameter of ``model`` a DTensor on ``mesh``: the ones named in
    ``sharded`` (names relative to ``model``, ``*`` for any block index, see
    :func:`lookup`) with their placement, the others replicated. A tensor shared by
    several modules (tied weights) is distributed once and stays one parameter under
    all its names."""
    done: dict[int, nn.Parameter] = {}
    for name, param in list(model.named_parameters(remove_duplicate=False)):
        path, _, local = name.rpartition(".")
        new = done.get(id(param))
        if new is None:
            if isinstance(param, DTensor):
                continue
            placement = lookup(sharded, name) or Replicate()
            dt = distribute_tensor(param.data, mesh, [placement],
                                   src_data_rank=None if param.is_meta else 0)
            new = nn.Parameter(dt, requires_grad=param.requires_grad)
            done[id(param)] = new
        model.get_submodule(path).register_parameter(local, new)


class _Relayout(torch.autograd.Function):
    """``x.redistribute`` whose backward hands a partial sum's gradient back
    replicated (its true adjoint), where DTensor's own backward would convert it to the
    source's partial type and cannot for a vocabulary-parallel embedding's masked one."""

    @staticmethod
    def forward(ctx: Any, x: DTensor, placement: Placement) -> DTensor:  # noqa: D102
        ctx.source = x.placements
        return x.redistribute(placements=(placement,))

    @staticmethod
    def backward(ctx: Any, grad: DTensor) -> tuple[DTensor, None]:  # noqa: D102
        want = tuple(Replicate() if p.is_partial() else p for p in ctx.source)
        return (grad if grad.placements == want else grad.redistribute(placements=want)), None


def _redistribute(x: Any, placement: Placement) -> Any:
    if isinstance(x, DTensor) and x.placements != (placement,):
        if any(p.is_partial() for p in x.placements):
            return _Relayout.apply(x, placement)
        return x.redistribute(placements=(placement,))
    return x


def _first_tensor(value: Any, fn: Any) -> Any:
    """``value`` with ``fn`` applied to its first tensor (itself, or in a tuple/list)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (tuple, list)):
        for i, v in enumerate(value):
            if isinstance(v, torch.Tensor):
                return type(value)([*value[:i], fn(v), *value[i + 1:]])
    return value


def _input_hook(placement: Placement, _: nn.Module, args: tuple) -> tuple:
    return _first_tensor(args, functools.partial(_redistribute, placement=placement))


def _output_hook(placement: Placement, _: nn.Module, args: tuple, output: Any) -> Any:
    return _first_tensor(output, functools.partial(_redistribute, placement=placement))


def relayout_modules(model: nn.Module, inputs: Mapping[str, Placement],
                     outputs: Mapping[str, Placement]) -> None:
    """Redistribute the first input of each module in ``inputs`` to its placement
    before the module runs, and the output of each module in ``outputs`` after it
    (module paths relative to ``model``, ``*`` for any block index; a path the model
    lacks, e.g. on a pipeline stage holding part of it, is skipped)."""
    for path, module in model.named_modules():
        placement = lookup(inputs, path)
        if placement is not None:
            module.register_forward_pre_hook(functools.partial(_input_hook, placement))
        placement = lookup(outputs, path)
        if placement is not None:
            module.register_forward_hook(functools.partial(_output_hook, placement))


def _to_dtensor(mesh: DeviceMesh, x: Any) -> Any:
    if isinstance(x, torch.Tensor) and not isinstance(x, DTensor):
        return DTensor.from_local(x, mesh, [Replicate()], run_check=False)
    return x


def gather_output(x: Any) -> Any:
    """``x`` (a tensor, or tensors in a tuple, list or dict) with every DTensor made a
    whole local tensor (replicated, then its local copy)."""
    if isinstance(x, DTensor):
        return x.redistribute(placements=[Replicate()] * x.device_mesh.ndim).to_local()
    if isinstance(x, (tuple, list)):
        return type(x)(gather_output(v) for v in x)
    if isinstance(x, dict):  # a dict, or a Hugging Face ModelOutput (a dict subclass)
        for key in list(x.keys()):
            x[key] = gather_output(x[key])
    return x


def distribute_io(model: nn.Module, mesh: DeviceMesh, gather: bool = True) -> None:
    """The model's tensor inputs (positional and keyword) enter as replicated DTensors
    on ``mesh``; its output leaves as replicated local tensors (:func:`gather_output`),
    or, not ``gather``, as the DTensors it is: a loss-parallel plan's logits split
    along their classes, which the loss reads so (:func:`class_parallel_loss`)."""
    def pre(_: nn.Module, args: tuple, kwargs: dict) -> tuple:
        return (tuple(_to_dtensor(mesh, a) for a in args),
                {k: _to_dtensor(mesh, v) for k, v in kwargs.items()})

    def post(_: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        return gather_output(output) if gather else output

    # The output leaves as DTensor.to_local()'s view, and FSDP2 (torch 2.13) warns that
    # an in-place op on a view its root returns would silently drop its pre-backward
    # hook. A view made by to_local (a custom autograd Function) cannot be changed in
    # place at all: autograd raises, so the hook is never lost silently. Silenced for
    # this model's class alone.
    warnings.filterwarnings("ignore", category=UserWarning, message=(
        rf"FSDP2-wrapped module \(FSDP{re.escape(type(model).__name__)}\) returned a view"))
    model.register_forward_pre_hook(pre, with_kwargs=True)
    model.register_forward_hook(post, with_kwargs=True)


def _attention_strategies(n_tensors: int, masked: bool, n_scalars: int) -> list:
    """Output and input placements of CPU flash attention: everything replicated, or
    split along the batch (dim 0) or the heads (dim 1) alike."""
    out = []
    for p in (Replicate(), Shard(0), Shard(1)):
        ins = [p] * n_tensors + [None] * n_scalars + [p if masked else None, None]
        out.append(([p] * (3 if n_tensors == 6 else 2), ins))
    return out


def register_cpu_attention_sharding() -> None:
    """Give CPU flash attention (forward and backward) DTensor sharding strategies,
    which torch registers for the CUDA kernels only; idempotent."""
    aten = torch.ops.aten

    @register_sharding(aten._scaled_dot_product_flash_attention_for_cpu.default)
    def forward(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None,
                scale=None):  # noqa: ANN001, ANN202 — the op's own signature
        return _attention_strategies(3, attn_mask is not None, 2)

    @register_sharding(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
    def backward(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *,
                 attn_mask=None, scale=None):  # noqa: ANN001, ANN202
        return _attention_strategies(6, attn_mask is not None, 2)


def _same_outputs(want: Any, got: Any) -> bool:
    """Whether two forward results agree: the same structure, DTensors of the same
    placements (compared by local tensor) and plain tensors alike, to float rounding."""
    a, spec_a = tree_flatten(want)
    b, spec_b = tree_flatten(got)
    if spec_a != spec_b:
        return False
    for x, y in zip(a, b):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if not isinstance(x, torch.Tensor):
            continue
        if isinstance(x, DTensor) != isinstance(y, DTensor):
            return False
        if isinstance(x, DTensor):
            if x.placements != y.placements or x.shape != y.shape:
                return False
            x, y = x.to_local(), y.to_local()
        if x.shape != y.shape or x.dtype != y.dtype:
            return False
        if x.is_floating_point() and x.numel():
            scale = x.abs().max().item() or 1.0
            if not torch.allclose(x, y, rtol=1e-4, atol=1e-5 * scale):
                return False
        elif not torch.equal(x, y):
            return False
    return True


class LocalRegion:
    """A region's ``forward`` (set as an instance attribute of its module): on its
    first call it runs the module's own forward both on DTensors and on local tensors
    and keeps local tensors when every rank of ``group`` found the same outputs; later
    calls run the way chosen. ``local`` is None until then, and ``active`` is True while
    a forward runs on local tensors (read by the Linears' hooks); ``linears`` are the
    region's Linears, whose local weights are dropped after each forward."""

    def __init__(self, forward: Any, group: Any, linears: list[nn.Module]) -> None:
        self.forward = forward
        self.group = group
        self.linears = linears
        self.local: bool | None = None
        self.active = False

    def _run(self, local: bool, args: tuple, kwargs: dict) -> Any:
        if local:
            args, kwargs = tree_map(_local_input, (args, kwargs))
        self.active = local
        try:
            return self.forward(*args, **kwargs)
        finally:
            self.active = False
            for m in self.linears:  # also after a failure, before the forward hooks
                m.__dict__.pop("weight", None)
                m.__dict__.pop("bias", None)

    def _agrees(self, args: tuple, kwargs: dict) -> bool:
        """Run both ways without gradients on a copy of the random state; True when
        every rank's outputs agree."""
        tensors = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
        cuda = [t.device for t in tensors if t.device.type == "cuda"][:1]
        with torch.no_grad(), torch.random.fork_rng(devices=cuda):
            want = self._run(False, args, kwargs)
            try:
                same = _same_outputs(want, self._run(True, args, kwargs))
            except Exception:  # noqa: BLE001 — any failure on local tensors: keep DTensors
                same = False
        device = tensors[0].device if tensors else torch.device("cpu")
        flag = torch.tensor([0.0 if same else 1.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return flag.item() == 0.0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:  # noqa: D102
        if self.local is None:
            self.local = self._agrees(args, kwargs)
        return self._run(self.local, args, kwargs)


def _local_input(x: Any) -> Any:
    """A replicated DTensor as its local tensor, whose gradient is this rank's partial
    sum (the region splits the work over the ranks); anything else as it is."""
    if isinstance(x, DTensor) and all(p.is_replicate() for p in x.placements):
        return x.to_local(grad_placements=[Partial()] * x.device_mesh.ndim)
    return x


class _LocalShard(torch.autograd.Function):
    """``p.to_local()`` of a parameter whose shard is contiguous, its gradient wrapped
    in the parameter's own spec by DTensor's constructor: ``to_local``'s backward
    builds a spec and runs ``from_local``, an autograd function of its own, for the
    same DTensor (private fields in torch 2.11 to 2.13)."""

    @staticmethod
    def forward(ctx: Any, p: DTensor) -> torch.Tensor:  # noqa: D102
        ctx.spec = p._spec
        return p._local_tensor.view_as(p._local_tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> DTensor:  # noqa: D102
        return DTensor(grad.contiguous(), ctx.spec, requires_grad=False)


def _local_shard(p: Any) -> torch.Tensor:
    """The local shard of parameter ``p``, its gradient flowing back to ``p``
    (``to_local`` where the private fields are not there or the shard is strided)."""
    local = getattr(p, "_local_tensor", None)
    if local is not None and hasattr(p, "_spec") and local.is_contiguous():
        return _LocalShard.apply(p)
    return p.to_local()


def _local_weights(region: LocalRegion, rowwise: bool, module: nn.Module, args: tuple) -> None:
    """Before a Linear of an active region: its local weight (and colwise bias) shards
    in its ``__dict__``, which attribute lookup reads before its parameters."""
    if not region.active:
        return
    module.__dict__["weight"] = _local_shard(module._parameters["weight"])
    bias = module._parameters.get("bias")
    if bias is not None:
        module.__dict__["bias"] = None if rowwise else _local_shard(bias)


def _partial_output(region: LocalRegion, mesh: DeviceMesh, module: nn.Module, args: tuple,
                    output: Any) -> Any:
    """After a rowwise Linear of an active region: its local partial sum as a
    ``Partial`` DTensor (laid out next by the plan's own hook)."""
    if region.active and type(output) is torch.Tensor:
        return DTensor.from_local(output, mesh, [Partial()], run_check=False)
    return output


def _add_bias(region: LocalRegion, module: nn.Module, args: tuple, output: Any) -> Any:
    """After a rowwise Linear of an active region is laid out: its replicated bias."""
    bias = module._parameters.get("bias")
    if region.active and bias is not None:
        return output + bias
    return output


def localize_regions(model: nn.Module, mesh: DeviceMesh, regions: Mapping[str, Any],
                     linears: Mapping[str, str]) -> None:
    """Run each module of ``regions`` on local tensors where that is exact (see the
    module docstring); ``linears``: the style ("colwise" or "rowwise") of each Linear
    inside them. Paths are relative to ``model``, ``*`` for any block index
    (:func:`lookup`). Call it after :func:`relayout_modules`: a region's first input is
    laid out by its hook, and a rowwise Linear's partial output by its own."""
    current: list[tuple[str, LocalRegion]] = []
    for path, module in model.named_modules():
        current = [(p, r) for p, r in current if path.startswith(p + ".")]
        if lookup(regions, path) is not None:
            region = LocalRegion(module.forward, mesh.get_group(), [])
            module.forward = region
            current.append((path, region))
            continue
        style = lookup(linears, path) if current else None
        if style is None:
            continue
        region = current[-1][1]
        region.linears.append(module)
        rowwise = style == "rowwise"
        module.register_forward_pre_hook(functools.partial(_local_weights, region, rowwise))
        if rowwise:
            module.register_forward_hook(functools.partial(_partial_output, region, mesh),
                                         prepend=True)
            module.register_forward_hook(functools.partial(_add_bias, region))



def apply_tp(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Tensor parallelism over tp=2. Every parameter becomes a DTensor (split as
    listed, "*" standing for any block index; the rest replicated); activations stay
    DTensors through the model's own code, so its shapes are global; the listed modules'
    first input and output are redistributed where the plan changes layout; the listed
    regions run on local tensors between their colwise and rowwise Linears where their
    first forward shows that exact. Comments give each module's style and predicted
    forward + backward time per step."""
    register_cpu_attention_sharding()
    place_parameters(model, tp_mesh, {
        "tok_emb.weight": Shard(0),  # rowwise Embedding, 100 us
        "blocks.*.attn.q.weight": Shard(0),  # colwise Linear, 400 us
        "blocks.*.attn.q.bias": Shard(0),  # colwise Linear, 400 us
        "blocks.*.attn.k.weight": Shard(0),  # colwise Linear, 500 us
        "blocks.*.attn.k.bias": Shard(0),  # colwise Linear, 500 us
        "blocks.*.attn.v.weight": Shard(0),  # colwise Linear, 100 us
        "blocks.*.attn.v.bias": Shard(0),  # colwise Linear, 100 us
        "blocks.*.attn.proj.weight": Shard(1),  # rowwise Linear, 200 us
        "blocks.*.mlp.fc1.weight": Shard(0),  # colwise Linear, 400 us
        "blocks.*.mlp.fc1.bias": Shard(0),  # colwise Linear, 400 us
        "blocks.*.mlp.fc2.weight": Shard(1),  # rowwise Linear, 500 us
        "head.weight": Shard(0),  # colwise Linear, 500 us
    })
    relayout_modules(model, inputs={}, outputs={
        "tok_emb": Replicate(),  # rowwise Embedding, 100 us
        "blocks.*.attn.q": Shard(-1),  # colwise Linear, 400 us
        "blocks.*.attn.k": Shard(-1),  # colwise Linear, 500 us
        "blocks.*.attn.v": Shard(-1),  # colwise Linear, 100 us
        "blocks.*.attn.proj": Replicate(),  # rowwise Linear, 200 us
        "blocks.*.mlp.fc1": Shard(-1),  # colwise Linear, 400 us
        "blocks.*.mlp.fc2": Replicate(),  # rowwise Linear, 500 us
        "head": Replicate(),  # colwise Linear, 500 us
    })
    localize_regions(model, tp_mesh, regions={}, linears={})
    distribute_io(model, tp_mesh)


def selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Selective recomputation: keep the outputs of matrix products, attention and
    reduce-scatters, recompute the rest (norms, pointwise ops, softmax) in backward."""
    name = getattr(getattr(op, "overloadpacket", op), "__name__", str(op))
    if name in SAVE_OPS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def apply_ac(model: nn.Module) -> None:
    """Activation recomputation per block: the block's forward runs under
    torch.utils.checkpoint (predicted per device: activations 3.15 MB,
    recomputation buffers 524.29 kB)."""
    selective = functools.partial(create_selective_checkpoint_contexts, selective_policy)
    for block in model.blocks:  # selective
        block.forward = functools.partial(
            checkpoint, block.forward, use_reentrant=False, context_fn=selective)


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh) -> None:
    """ZeRO-3 over dp=2: fully_shard per block, then on the root.
    Fully sharded: a block gathers its parameters for forward and
    again for backward (predicted per device: params 1.05 MB, grads 1.05 MB, optimizer 2.10 MB)."""
    for block in model.blocks:
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=True)
    # the root's parameters (embeddings, head) are needed again first in backward
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=False)


def tied_aliases(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module, str]]:
    """(module, name, first module, its name) for every parameter slot that holds a
    parameter an earlier slot (in module order) holds too."""
    first: dict[int, tuple[nn.Module, str]] = {}
    out = []
    for m in model.modules():
        for name, p in m._parameters.items():
            if p is None:
                continue
            if id(p) in first:
                out.append((m, name) + first[id(p)])
            else:
                first[id(p)] = (m, name)
    return out


@contextlib.contextmanager
def full_size_init(model: nn.Module, device: torch.device,
                   keep: bool = False) -> Iterator[None]:
    """Inside, every DTensor parameter and buffer of ``model`` is a plain tensor of its
    full shape on ``device``; on leaving, each rank copies its own slice of it into the
    DTensor (``distribute_tensor(..., src_data_rank=None)``: no communication) and the
    DTensors are back. Only where DTensor has no random-number tracker, a CPU mesh
    (torch 2.13 warns "DTensor random operators may not have complete support on cpu"):
    a random op on a DTensor there draws each rank's shard from the rank's own
    generator, so every shard of a parameter would get the same values (rows repeated
    across tp and dp ranks, units that stay copies of each other as they train). Drawn
    full size, the weights are the ones one process draws under the same seed. Costs a
    full copy of the model on each rank while it lasts, as a CPU run can afford. With
    ``keep`` the full tensors start from the DTensors' values (gathered), for an
    initialization that touches only some of them."""
    full: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(DTensor) -> (it, full)
    slots = []
    for m in model.modules():
        for table in (m._parameters, m._buffers):
            for name, t in table.items():
                if isinstance(t, DTensor):
                    if id(t) not in full:
                        plain = t.full_tensor().detach().to(device).clone() if keep \
                            else torch.empty(t.shape, dtype=t.dtype, device=device)
                        full[id(t)] = (t, nn.Parameter(plain, t.requires_grad)
                                       if isinstance(t, nn.Parameter) else plain)
                    slots.append((table, name, t))
                    table[name] = full[id(t)][1]
    try:
        yield
    finally:
        for table, name, t in slots:
            table[name] = t
    with torch.no_grad():
        for t, plain in full.values():
            own = distribute_tensor(plain.detach(), t.device_mesh, t.placements,
                                    src_data_rank=None)
            t.to_local().copy_(own.to_local())


def materialize(model: nn.Module, device: torch.device) -> None:
    """Allocate the local shards of a laid-out meta model on ``device`` and initialize
    them with each module's ``reset_parameters()``, children before parents, so that a
    model's own has the last word over its submodules' defaults. A tied parameter is
    initialized by its first owner in module order and stays tied (``to_empty`` alone
    would give each module its own copy where no wrapper keeps them as one). On a CPU
    device the initialization runs at full size (:func:`full_size_init`)."""
    ties = tied_aliases(model)
    model.to_empty(device=device)
    for module, name, first, first_name in ties:
        module._parameters[name] = first._parameters[first_name]
    aliases = {(id(module), name) for module, name, _, _ in ties}
    with torch.no_grad(), (full_size_init(model, device) if device.type == "cpu"
                           else contextlib.nullcontext()):
        for m in reversed(list(model.modules())):  # every module after its descendants
            reset = getattr(m, "reset_parameters", None)
            own = [name for name, p in m._parameters.items() if p is not None]
            if callable(reset) and not (own and all((id(m), n) in aliases for n in own)):
                reset()  # skipped: a module holding only parameters tied to an earlier one



def load_batch(path: str) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """The global batch saved at ``path``, the dict {"inputs", "targets"} of torch.save:
    every step trains on it, on every rank."""
    data = torch.load(path)
    inputs = data["inputs"]
    return (tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)), data["targets"]


def synthetic_batch(seed: int, step: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """A fresh global batch of synthetic token ids and random targets for ``step``,
    from a generator seeded by ``seed`` and ``step``: the same on every rank, and after a
    resume. Random targets cannot be learned: the loss shows that training runs, not that
    the model learns (pass --data for that)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    shape = (GLOBAL_BATCH,) + INPUT_SHAPE
    if INPUT_IS_TOKENS:
        x = torch.randint(0, NUM_CLASSES, shape, generator=g)
        return (x,), torch.randint(0, NUM_CLASSES, shape, generator=g)
    x = torch.randn(shape, generator=g)
    return (x,), torch.randint(0, NUM_CLASSES, shape[:-1], generator=g)


def loss_fn(output: Any, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over the last dim of the logits, in fp32."""
    logits = output if isinstance(output, torch.Tensor) else output[0]
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())


def train_step(model: nn.Module, mesh: DeviceMesh, inputs: tuple[torch.Tensor, ...],
               targets: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Forward and backward of the global batch (on the device); returns the global
    mean loss. This
    rank takes its dp slice (tp ranks of a dp group take the same one) in
    NUM_MICROBATCHES micro-batches and accumulates their gradients."""
    start = mesh.get_local_rank("dp") * NUM_MICROBATCHES * MICROBATCH_SIZE
    total = torch.zeros((), device=device)
    for i in range(NUM_MICROBATCHES):
        part = slice(start + i * MICROBATCH_SIZE, start + (i + 1) * MICROBATCH_SIZE)
        # tensors the forward makes meet DTensors as replicated
        with plain_as_replicated():
            output = model(*(x[part] for x in inputs))
            loss = loss_fn(output, targets[part]) / NUM_MICROBATCHES
            loss.backward()
        total += loss.detach().float()
    dist.all_reduce(total, group=mesh.get_group("dp"))
    total /= 2  # the mean over dp
    return total


def state_names(model: nn.Module) -> tuple[dict[str, str], frozenset[str]]:
    """What :func:`canonical_tensors` needs from the whole model (a ``meta`` one will
    do), before it is laid out or cut: each later name of a tensor held under several
    names -> its first, and the first names of its state dict's tensors."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    named = list(model.named_parameters(remove_duplicate=False)) + \
        list(model.named_buffers(remove_duplicate=False))
    for name, t in named:
        owner = first.setdefault(id(t), name)
        if owner != name:
            aliases[name] = owner
    return aliases, frozenset(aliases.get(k, k) for k in model.state_dict())



def checkpoint_record(step: int, extra: Mapping[str, Any], mesh: Mapping[str, int],
                      model: str, aliases: Mapping[str, str],
                      optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """The record ``autopar.json`` holds (JSON): the step and the caller's ``extra``,
    where it was saved (world size, mesh, model), the tied names, the optimizer's
    class and hyperparameters."""
    return {"format": "autopar-checkpoint", "version": 1, "step": step, "extra": dict(extra),
            "world_size": dist.get_world_size() if dist.is_initialized() else 1,
            "mesh": dict(mesh), "model": model, "aliases": dict(aliases),
            "optimizer": type(optimizer).__name__ if optimizer is not None else None,
            "param_groups": optimizer_record(optimizer),
            "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat()}



def optimizer_record(optimizer: torch.optim.Optimizer | None) -> list[dict[str, Any]]:
    """The hyperparameters of each parameter group (learning rate, betas, ...) as
    JSON values; tensors become numbers, what JSON cannot hold is left out."""
    groups = []
    for group in optimizer.param_groups if optimizer is not None else []:
        hyper: dict[str, Any] = {}
        for key, value in group.items():
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                value = value.item()
            if isinstance(value, tuple):
                value = list(value)
            if key != "params" and (value is None or isinstance(value, (bool, int, float, str))
                                    or (isinstance(value, list) and all(
                                        isinstance(v, (int, float)) for v in value))):
                hyper[key] = value
        groups.append(hyper)
    return groups



def canonical_tensors(modules: Sequence[nn.Module], aliases: Mapping[str, str],
                      keys: Collection[str], skip: Collection[tuple[int, str]] = (),
                      ) -> dict[str, list[torch.Tensor]]:
    """The model's name -> this rank's tensors of it (parameters and persistent
    buffers of ``modules``; several where a rank holds copies of a tied weight).

    ``aliases`` maps each later name of a tied tensor to its first; ``keys`` are the
    names of the model's state dict (what is not among them, such as a graph's
    constants, is left out); ``skip`` are (module index, name) pairs to leave out (a
    pipeline stage's later copy of a tied weight, when saving)."""
    wrappers = ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "_orig_mod.")
    out: dict[str, list[torch.Tensor]] = {}
    for index, module in enumerate(modules):
        named = list(module.named_parameters(remove_duplicate=False)) + \
            list(module.named_buffers(remove_duplicate=False))
        for name, t in named:
            if (index, name) in skip:
                continue
            for w in wrappers:
                name = name.replace(w, "")
            name = aliases.get(name, name)
            held = out.setdefault(name, []) if name in keys else []
            if name in keys and not any(x is t for x in held):
                held.append(t)
    return out



def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter of ``optimizer`` its state (torch makes it at the first
    step), so that a load has tensors to fill: one step on zero gradients at learning
    rate 0, which changes no parameter; the gradients are then cleared."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if all(p in optimizer.state for p in params):
        return
    lrs = [g["lr"] for g in optimizer.param_groups]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    for g in optimizer.param_groups:
        g["lr"] = torch.zeros_like(g["lr"]) if isinstance(g["lr"], torch.Tensor) else 0.0
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs):
        g["lr"] = lr
    optimizer.zero_grad(set_to_none=True)



def _chunkable(t: torch.Tensor) -> torch.Tensor:
    """``t``, or, for a DTensor split piecewise (``_StridedShard``: a fused projection's
    pieces each split over the ranks, whose local rows DCP would take for one
    contiguous chunk and find overlapping), a copy replicated along those mesh axes."""
    if isinstance(t, DTensor) and any(type(p).__name__ == "_StridedShard"
                                      for p in t.placements):
        return t.redistribute(placements=[Replicate() if type(p).__name__ == "_StridedShard"
                                          else p for p in t.placements])
    return t



def flat_state(tensors: Mapping[str, Sequence[torch.Tensor]],
               optimizer: torch.optim.Optimizer | None, rank: int,
               originals: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """DCP's flat state dict: ``model.<name>`` for each tensor, ``optim.<name>.<key>``
    for each tensor of its optimizer state, ``rng.<rank>.cpu`` (and ``.cuda``) for this
    rank's random generators. A tensor DCP cannot chunk is replaced by a copy
    (:func:`_chunkable`), and ``originals`` (if given) maps its key to the tensor."""
    state: dict[str, torch.Tensor] = {}
    found: dict[str, torch.Tensor] = {}
    for name, held in tensors.items():
        found[f"model.{name}"] = held[0].detach()
        own = optimizer.state.get(held[0], {}) if optimizer is not None else {}
        for key, value in own.items():
            if isinstance(value, torch.Tensor):
                found[f"optim.{name}.{key}"] = value
    for key, t in found.items():
        state[key] = _chunkable(t)
        if originals is not None and state[key] is not t:
            originals[key] = t
    state[f"rng.{rank}.cpu"] = torch.get_rng_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state[f"rng.{rank}.cuda"] = torch.cuda.get_rng_state()
    return state



def _copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[...] = src`` for two tensors on this rank (DTensors redistributed to
    ``dst``'s placements)."""
    with torch.no_grad():
        if isinstance(src, DTensor) and isinstance(dst, DTensor):
            if any(type(p).__name__ == "_StridedShard" for p in dst.placements):
                src = distribute_tensor(src.full_tensor(), dst.device_mesh, dst.placements,
                                        src_data_rank=None)  # each rank cuts its pieces
            elif (src.device_mesh, src.placements) != (dst.device_mesh, dst.placements):
                src = src.redistribute(dst.device_mesh, dst.placements)
            dst.to_local().copy_(src.to_local())
        else:
            dst.copy_(src)



def read_commit(path: str | os.PathLike) -> dict[str, Any]:
    """The record ``autopar.json`` of a committed checkpoint folder; ValueError saying
    what is wrong for a folder that is missing, half written or not autopar's."""
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"no checkpoint at {folder}: not a folder")
    record = folder / "autopar.json"
    if not record.is_file():
        raise ValueError(f"{folder} is not a complete autopar checkpoint (no autopar.json: it "
                         "was half written when its job stopped, or not written by autopar); "
                         "load an earlier one")
    try:
        meta = json.loads(record.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{record} is not valid JSON ({e}); the checkpoint is damaged") from None
    if not isinstance(meta, dict) or meta.get("format") != "autopar-checkpoint":
        raise ValueError(f"{record} is not an autopar checkpoint record")
    if meta.get("version") != 1:
        raise ValueError(f"{folder} has checkpoint format version {meta.get('version')}; this "
                         "autopar reads version 1: upgrade autopar")
    return meta



def commit(tmp: Path, final: Path, meta: Mapping[str, Any]) -> None:
    """Write the record into the finished folder ``tmp`` and rename it to ``final``
    (an older ``final`` is removed only after)."""
    with open(tmp / "autopar.json", "w") as f:
        json.dump(meta, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    old = final.with_name(final.name + ".old")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)



def begin_partial(final: Path) -> Path:
    """The folder ``final.partial`` a save writes into, emptied of an earlier killed
    save's files (rank 0 removes them; every rank waits for it)."""
    tmp = final.with_name(final.name + ".partial")
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    return tmp



def save_state(path: str | os.PathLike, tensors: Mapping[str, Sequence[torch.Tensor]],
               optimizer: torch.optim.Optimizer | None, meta: Mapping[str, Any]) -> None:
    """Save on every rank into folder ``path``, committed with the record ``meta``
    (JSON: step, hyperparameters, what the caller keeps): the shards go to
    ``path.partial``, which becomes ``path`` once every rank has written."""
    final = Path(path)
    tmp = begin_partial(final)
    rank = dist.get_rank()
    dcp.save(flat_state(tensors, optimizer, rank), checkpoint_id=str(tmp))
    if rank == 0:  # dcp.save returns once every rank's shards and the metadata are written
        commit(tmp, final, meta)
    dist.barrier()



def _check_shapes(state: Mapping[str, torch.Tensor], saved: Mapping[str, Any],
                  folder: Path) -> None:
    """Every tensor asked for is in the checkpoint with the same global shape."""
    for key, t in state.items():
        if key.startswith("model.") and key not in saved:
            raise ValueError(f"the checkpoint {folder} has no '{key[6:]}'; was it saved from "
                             "another model?")
        size = getattr(saved.get(key), "size", None)
        if size is not None and tuple(size) != tuple(t.shape):
            raise ValueError(f"'{key.partition('.')[2]}' has shape {tuple(t.shape)} here but "
                             f"{tuple(size)} in the checkpoint {folder}; was it saved from "
                             "another model?")



def damaged_file(folder: Path, storage: Mapping[Any, Any]) -> str | None:
    """What is wrong with the first shard file of checkpoint ``folder`` that DCP's index
    (``storage``: its ``storage_data``, each item's file, offset and length) lists but
    that is missing or shorter than the bytes the index places in it; None when every
    file is there in full."""
    need: dict[str, int] = {}
    for item in storage.values():
        end = item.offset + item.length
        need[item.relative_path] = max(need.get(item.relative_path, 0), end)
    for name in sorted(need):
        file = folder / name
        if not file.is_file():
            return f"its file {name} is missing (its index lists it)"
        size = file.stat().st_size
        if size < need[name]:
            return (f"its file {name} has {size} bytes, fewer than the {need[name]} its index "
                    "lists: it was cut short (a full disk, or a copy that stopped)")
    return None



def unreadable(folder: Path, error: BaseException,
               storage: Mapping[Any, Any] | None) -> ValueError:
    """The ValueError for checkpoint ``folder`` whose files DCP could not read: it names
    the file at fault: DCP's index ``.metadata`` (``storage`` None: the index itself
    failed), a shard file that is missing or cut short (:func:`damaged_file`), or the
    file ``error`` names; else it quotes the first failing rank's exception."""
    what = damaged_file(folder, storage) if storage is not None else None
    if what is None:
        cause = error
        failures = getattr(error, "failures", None)  # CheckpointException: rank -> (error, trace)
        if isinstance(failures, dict) and failures:
            cause = failures[min(failures)][0]
        line = (str(cause).strip().splitlines() or [""])[0]
        named = getattr(cause, "filename", None)
        file = "its index file .metadata" if storage is None else \
            f"its file {Path(named).name}" if named else "its shard files"
        what = f"reading {file} raised {type(cause).__name__}: {line}"
    return ValueError(f"cannot load the checkpoint {folder}: {what}; load an earlier "
                      "checkpoint, or copy this one again")



def load_state(path: str | os.PathLike, tensors: Mapping[str, Sequence[torch.Tensor]],
               optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """Fill ``tensors`` (every copy) and the optimizer's state from the committed
    checkpoint ``path``, resharded onto this rank's layout; restore this rank's
    random generators where the checkpoint has them, and the optimizer's
    hyperparameters. Returns the checkpoint's record, with ``optimizer_restored`` and
    ``rng_restored`` added."""
    folder = Path(path)
    meta = read_commit(folder)
    try:
        index = dcp.FileSystemReader(str(folder)).read_metadata()
    except Exception as e:  # noqa: BLE001 - unpickling a damaged index raises any type
        raise unreadable(folder, e, None) from e
    saved = index.state_dict_metadata
    has_optim = any(k.startswith("optim.") for k in saved)
    if optimizer is not None and has_optim:
        init_optimizer_state(optimizer)
    rank = dist.get_rank()
    originals: dict[str, torch.Tensor] = {}
    state = flat_state(tensors, optimizer if has_optim else None, rank, originals)
    rng = {k: state.pop(k) for k in list(state) if k.startswith("rng.")}
    state.update({k: v.clone() for k, v in rng.items() if k in saved})
    _check_shapes(state, saved, folder)
    state = {k: v for k, v in state.items() if k in saved}
    try:
        dcp.load(state, checkpoint_id=str(folder))
    except (Exception, dcp.CheckpointException) as e:  # the latter derives from BaseException
        raise unreadable(folder, e, index.storage_data) from e
    for key, t in originals.items():  # loaded into a chunkable copy: back into place
        if key in state:
            _copy_into(t, state[key])
    for name, held in tensors.items():  # a rank's later copies of a tied weight
        for t in held[1:]:
            _copy_into(t.detach(), held[0].detach())
            if optimizer is not None and has_optim:
                for key, value in optimizer.state.get(held[0], {}).items():
                    if isinstance(value, torch.Tensor):
                        _copy_into(optimizer.state[t][key], value)
    if f"rng.{rank}.cpu" in state:
        torch.set_rng_state(state[f"rng.{rank}.cpu"])
    if f"rng.{rank}.cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state[f"rng.{rank}.cuda"])
    groups = meta.get("param_groups") or []
    if optimizer is not None and has_optim and len(groups) == len(optimizer.param_groups):
        for group, hyper in zip(optimizer.param_groups, groups):
            for key, value in hyper.items():
                old = group.get(key)
                if isinstance(old, torch.Tensor):
                    old.fill_(value)
                else:
                    group[key] = tuple(value) if isinstance(old, tuple) else value
    return dict(meta, optimizer_restored=optimizer is not None and has_optim,
                rng_restored=f"rng.{rank}.cpu" in state)



def committed_steps(root: str | os.PathLike) -> list[int]:
    """The steps of the committed ``step-<n>`` checkpoint folders under ``root``, in
    ascending order (half-written folders are not among them)."""
    folder = Path(root)
    if not folder.is_dir():
        return []
    steps = []
    for child in folder.iterdir():
        tail = child.name.removeprefix("step-")
        if child.name.startswith("step-") and tail.isdigit() and \
                (child / "autopar.json").is_file():
            steps.append(int(tail))
    return sorted(steps)



def prune_checkpoints(root: str | os.PathLike, keep: int) -> None:
    """Remove all but the last ``keep`` committed ``step-<n>`` folders under ``root``
    (rank 0 removes; every rank waits for it)."""
    if dist.get_rank() == 0:
        for step in committed_steps(root)[:-keep]:
            shutil.rmtree(Path(root) / f"step-{step:08d}", ignore_errors=True)
    dist.barrier()



def attempt_store(rank: int, world: int, timeout: datetime.timedelta) -> dist.Store:
    """torchrun's store, with this attempt's keys apart from earlier attempts'.

    Under ``torchrun --max-restarts``, every attempt's workers meet in the agent's
    store, which outlives them; with torch's own ``env://`` set-up a restarted gloo
    group reads the peer addresses the killed attempt left there and fails to connect
    (torch 2.13, seen here). A prefix per attempt (``TORCHELASTIC_RESTART_COUNT``)
    keeps each attempt's keys its own."""
    hosted = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"  # else the agent's
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=hosted and rank == 0, timeout=timeout)
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    return dist.PrefixStore(f"autopar/attempt_{attempt}", store)



def state_modules(model: nn.Module) -> tuple[list[nn.Module], set[tuple[int, str]]]:
    """The modules holding this rank's tensors (the whole model), and the later
    copies of tied weights among them (none: one model holds each weight once)."""
    return [model], set()


def save_checkpoint(path: str, model: nn.Module, names: tuple[dict[str, str], frozenset[str]],
                    optimizer: torch.optim.Optimizer, step: int) -> None:
    """Model, optimizer, step and random generators with torch.distributed.checkpoint
    under the plain model's names (every rank writes its own shards): this program
    under any plan, or autopar.load, resumes from it."""
    modules, later = state_modules(model)
    record = checkpoint_record(step, {}, {"dp": 2, "tp": 2}, "GPT", names[0], optimizer)
    save_state(path, canonical_tensors(modules, *names, later), optimizer, record)


def load_checkpoint(path: str, model: nn.Module, names: tuple[dict[str, str], frozenset[str]],
                    optimizer: torch.optim.Optimizer) -> int:
    """Restore what save_checkpoint (or autopar.save) wrote under any plan, resharded
    onto this one; return the step it was saved after."""
    modules, _ = state_modules(model)
    return int(load_state(path, canonical_tensors(modules, *names), optimizer)["step"])


def parse_args() -> argparse.Namespace:
    """The command line."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10,
                    help="steps to train (with --checkpoint-dir: the last step to reach, so "
                         "a restarted job stops where the first would have)")
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--optimizer", choices=["adamw", "sgd"], default="sgd")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data", help="a torch.save'd dict {inputs, targets}: one global batch "
                    "to train on every step (default: a fresh synthetic batch each step)")
    ap.add_argument("--build", choices=["auto", "meta", "cpu"], default="auto",
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
    mesh = build_mesh(device_type)
    model, on_meta = build_model(args.seed, args.build, device, host_bytes(args))
    names = state_names(model)  # the plain model's tensor names, for checkpoints
    if not on_meta:
        model.to(device)  # laid out from its own weights
    apply_tp(model, mesh["tp"])
    apply_ac(model)
    apply_fsdp(model, mesh["dp"])
    if on_meta:
        torch.manual_seed(args.seed)  # every rank initializes alike
        materialize(model, device)
    if args.optimizer == "adamw":
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
              "data: a fresh synthetic batch each step (token ids and random targets, "
              "seeded by --seed and the step, alike on every rank): the loss shows that "
              "training runs, not that it learns; pass --data BATCH.pt", flush=True)
    for step in range(first + 1, last_step + 1):
        inputs, targets = saved or synthetic_batch(args.seed, step)
        # copied before the timed step: a pageable copy inside it would stall the host
        # until the device has run everything queued before it
        inputs, targets = tuple(x.to(device) for x in inputs), targets.to(device)
        start = time.perf_counter()
        loss = train_step(model, mesh, inputs, targets, device)
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
    main()
