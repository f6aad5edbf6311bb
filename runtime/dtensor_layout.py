"""Tensor and sequence parallelism on DTensors from the model's input to its output.

Every parameter becomes a ``DTensor`` on the ``tp`` mesh with its planned placement
(:func:`place_parameters`), the model's inputs enter and its output leaves replicated
(:func:`distribute_io`), and the planner's layout changes happen at module boundaries
(:func:`relayout_modules`); in between, DTensor's sharding propagation runs each
operator on its shards, and plain tensors made inside the forward are read as
replicated (:func:`plain_as_replicated`, :func:`tp_context`). How each part works:
docs/runtime.md, section ``autopar.runtime.dtensor_layout``.

This module imports torch alone: the generated training program carries its source.
"""

from __future__ import annotations

import contextlib
import functools
import re
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed.tensor.parallel.loss as torch_loss
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.experimental import register_sharding
from torch.distributed.tensor.placement_types import Placement
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["place_parameters", "relayout_modules", "distribute_io", "plain_as_replicated",
           "tp_context", "ReplicatedBeforeAutograd", "class_parallel_loss", "loss_context",
           "gather_output",
           "ReplicateUnsharded",
           "register_cpu_attention_sharding", "any_index", "lookup"]


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


def tp_context(tp: int) -> contextlib.AbstractContextManager:
    """:func:`plain_as_replicated` where tensor parallelism makes DTensors meet plain
    tensors (``tp > 1``), else nothing, so that a plan without tensor parallelism never
    reads a plain tensor as replicated."""
    return plain_as_replicated() if tp > 1 else contextlib.nullcontext()


class ReplicatedBeforeAutograd(TorchFunctionMode):
    """Make a plain tensor that an operator mixes with DTensors a replicated DTensor
    before autograd records the operator, so that its backward meets DTensors only.

    :func:`plain_as_replicated` reads plain tensors as replicated below autograd,
    which serves a backward run inside it (:meth:`ParallelModel.step`); a user's own
    ``loss.backward()`` runs outside, where the plain tensors the forward saved (a
    rotary table, a mask) would meet DTensor gradients. (DTensor's implicit
    replication is thread state that autograd restores per node, so it cannot be
    turned on from a backward hook.) 0-dim tensors stay plain, as DTensor reads them
    as scalars."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        flat = tree_flatten((args, kwargs))[0]
        mesh = next((x.device_mesh for x in flat if isinstance(x, DTensor)), None)
        if mesh is not None and any(type(x) is torch.Tensor and x.dim() > 0 for x in flat):
            def lift(x: Any) -> Any:
                if type(x) is torch.Tensor and x.dim() > 0:
                    return DTensor.from_local(x, mesh, [Replicate()] * mesh.ndim,
                                              run_check=False)
                return x
            args, kwargs = tree_map(lift, (args, kwargs))
        return func(*args, **kwargs)


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


def _splits_classes(op_call: Any, args: tuple) -> bool:
    """Whether a log-softmax or NLL loss op (forward or backward) reads logits split
    along their classes: the dim a log-softmax normalizes, dim 1 (0 for 1-d logits)
    of an NLL loss."""
    name = op_call.overloadpacket.__name__
    pos = 0 if name in ("_log_softmax", "nll_loss_forward", "nll_loss2d_forward") else 1
    x = args[pos]
    if not isinstance(x, DTensor):
        return False
    if name.startswith("_log_softmax"):
        dim = args[pos + 1] % x.dim()
    else:
        dim = 0 if x.dim() == 1 else 1
    return any(p.is_shard(dim) for p in x.placements)


def _when_classes_split(handler: Any, op_call: Any, args: tuple, kwargs: dict) -> Any:
    """Run ``handler`` (torch's loss-parallel kernel of ``op_call``) on logits split
    along their classes, and ``op_call`` as DTensor runs it otherwise."""
    if _splits_classes(op_call, args):
        return handler(op_call, args, kwargs)
    handlers = DTensor._op_dispatcher._custom_op_handlers
    mine = handlers.pop(op_call)
    try:
        return op_call(*args, **kwargs)
    finally:
        handlers[op_call] = mine


@contextlib.contextmanager
def class_parallel_loss() -> Iterator[None]:
    """Compute log-softmax and NLL losses (cross-entropy is both) on logits split
    along their classes without gathering them, forward and backward: torch's
    ``loss_parallel`` kernels (all-reduces of each row's maximum, sum of exponentials
    and target logit), used only where the classes are split, so that any other
    log-softmax of the model runs as DTensor runs it. (The kernels are DTensor's
    custom op handlers, a private table in torch 2.11 to 2.13, which torch's own
    ``loss_parallel`` fills alike.) A class-split log-softmax must feed an NLL loss
    alone, as the planner ensures: its backward is fused into the loss's."""
    handlers = DTensor._op_dispatcher._custom_op_handlers
    before = {op: handlers.get(op) for op in torch_loss.customized_loss_ops}
    for op, handler in torch_loss.customized_loss_ops.items():
        handlers[op] = functools.partial(_when_classes_split, handler)
    try:
        yield
    finally:
        for op, handler in before.items():
            if handler is None:
                handlers.pop(op, None)
            else:
                handlers[op] = handler


def loss_context(loss_parallel: bool) -> contextlib.AbstractContextManager:
    """:func:`class_parallel_loss` where the plan computes the loss on class-split
    logits (``plan.loss_parallel``), else nothing."""
    return class_parallel_loss() if loss_parallel else contextlib.nullcontext()


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
