"""ParallelModel: the user's model laid out by a Plan, with a training ``step``."""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from autopar.capture import cache_configs, default_loss, first_tensor
from autopar.errors import ConfigError
from autopar.plans import Plan
from autopar.runtime.checkpoint_state import state_names
from autopar.runtime.context_mode import SequenceShards, split_batch
from autopar.runtime.failure_watch import FailureWatch
from autopar.runtime.lower import check_process_group, default_device, lower, lower_pipeline
from autopar.runtime.pipeline import PipelineRuntime
from autopar.runtime.dtensor_layout import (ReplicatedBeforeAutograd, gather_output,
                                            loss_context, tp_context)
from autopar.runtime.tensor_parallel import (reduce_partial_gradients,
                                             reduce_partial_gradients_when_accumulated)

__all__ = ["ParallelModel", "DataShard", "apply_plan"]

LossFn = Callable[[Any, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class DataShard:
    """This rank's share of every global batch, for a loop where each rank loads its
    own data (``torch.utils.data.DistributedSampler(dataset, **shard.sampler_kwargs())``).

    Attributes:
        index: which shard this rank trains on: its data-parallel coordinate (the
            tensor-, context- and pipeline-parallel ranks of one data-parallel group
            train on the same shard).
        count: how many shards a global batch is split into (``plan.data_parallel``).
        batch_size: the samples of one shard (the global batch over ``count``).
    """

    index: int
    count: int
    batch_size: int

    def sampler_kwargs(self) -> dict[str, int]:
        """``num_replicas`` and ``rank`` for ``DistributedSampler``."""
        return {"num_replicas": self.count, "rank": self.index}


class ParallelModel(nn.Module):
    """A model laid out by a :class:`~autopar.plans.Plan` (built by :func:`apply_plan`).

    ``parameters()`` are the distributed parameters (DTensors under tensor or data
    parallelism) and feed an ordinary optimizer::

        pm = apply_plan(model, plan)
        opt = torch.optim.SGD(pm.parameters(), lr=0.1)
        for x, y in batches:                # the same global batch on every rank
            loss = pm.step(x, y)            # global mean loss, equal on every rank
            opt.step(); opt.zero_grad()

    or, without a pipeline or context parallelism, the loop of plain PyTorch on each
    rank's own shard of the data (:meth:`data_shard`)::

        for x, y in my_shard:               # plan.global_batch // plan.data_parallel
            loss = my_loss(pm(x), y)        # the mean over this rank's samples
            loss.backward()                 # gradients averaged over dp, as planned
            opt.step(); opt.zero_grad()

    With a pipeline (``plan.pipeline``), ``module`` is an ``nn.ModuleList`` of this
    rank's stage modules, so ``parameters()`` are this rank's stages' parameters, and
    ``step`` runs the plan's pipeline schedule; ``forward`` is not available (a rank
    holds only part of the model).

    Low precision (``plan.precision`` "bf16"/"fp16") is FSDP2's
    ``MixedPrecisionPolicy`` on every path, with or without data parallelism (see
    :mod:`autopar.runtime.data_parallel`); there is no autocast.

    Attributes:
        module: the parallelized model, or this rank's stage modules.
        plan: the plan it was laid out by.
        mesh: the device mesh with axes ``("dp", "tp")``, or ``("pp", "dp", "tp")``.
        loss_fn: ``loss_fn(output, targets)``; None means cross-entropy over the last
            dim of the output's logits.
        device: this rank's device.
        pipeline: the pipeline stages and schedule, or None without pipelining.
        names: the plain model's names of its tensors (:func:`state_names`): each
            later name of a tied weight -> its first, and its state dict's names;
            checkpoints use them (:mod:`autopar.runtime.checkpoint`).
    """

    def __init__(self, module: nn.Module, plan: Plan, mesh: DeviceMesh, *,
                 loss_fn: LossFn | None = None, device: torch.device | None = None,
                 pipeline: PipelineRuntime | None = None,
                 names: tuple[dict[str, str], frozenset[str]] | None = None) -> None:
        super().__init__()
        self.module = module
        self.plan = plan
        self.mesh = mesh
        self.loss_fn = loss_fn
        self.device = device or torch.device("cpu")
        self.pipeline = pipeline
        self.names = names if names is not None else state_names(module)
        self._hooked = False  # partial-gradient hooks, registered on the first pm(x)
        groups = [mesh.get_group(a) for a in mesh.mesh_dim_names or ()]
        self.watch = FailureWatch.for_job(groups + [dist.group.WORLD])
        if self.watch is not None:
            weakref.finalize(self, self.watch.close)

    def guarded(self, what: str) -> contextlib.AbstractContextManager:
        """A block whose failure on any rank is raised on every rank within seconds,
        naming that rank (:mod:`autopar.runtime.failure_watch`); ``what`` says what the
        block does ("running my backward"). :meth:`step`, ``pm(x)`` and checkpoint saves
        are guarded already; wrap a loop's own ``loss.backward()`` in it, so that a rank
        waiting in its collectives for a failed one raises that rank's error."""
        return self.watch.guard(what) if self.watch is not None else contextlib.nullcontext()

    def state_modules(self) -> tuple[list[nn.Module], set[tuple[int, str]]]:
        """The modules holding this rank's tensors (the model, or this rank's stages
        in stage order), and the (module index, name) of each later copy of a tied
        weight a stage holds (a checkpoint saves the first owner's only)."""
        if self.pipeline is None:
            return [self.module], set()
        index = {st.stage_index: i for i, st in enumerate(self.pipeline.stages)}
        later = {(index[s], name) for group, _ in self.pipeline.tied
                 for s, name in group.names[1:] if s in index}
        return list(self.pipeline.modules), later

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run the parallelized module on this rank's own inputs (its shard of the
        global batch, :meth:`data_shard`); ``loss.backward()`` on the output then
        leaves the gradients the plan's step would (averaged over data-parallel
        ranks by FSDP2, partial tensor-parallel sums reduced). A failure on any rank is
        raised on every rank (:meth:`guarded`)."""
        if self.pipeline is not None:  # the plan's, alike on every rank: not shared
            raise ConfigError("a pipelined model runs only through step(inputs, targets); "
                              "each rank holds only its own stages (pass this rank's shard "
                              "with step(x, y, local=True))")
        if self.plan.context is not None:
            raise ConfigError("under context parallelism each rank holds a share of every "
                              "sequence, which step() cuts and reassembles: train with "
                              "step(x, y), or step(x, y, local=True) for this rank's shard")
        with self.guarded("running the forward (ParallelModel.forward)"):
            return self._forward_parallel(*inputs, **kwargs)

    def _forward_parallel(self, *inputs: Any, **kwargs: Any) -> Any:
        if self.plan.degree("tp") == 1:
            return self._forward(*inputs, **kwargs)
        if not self._hooked and not isinstance(self.module, FSDPModule):
            # the user's backward has no step() to reduce partial gradients after it
            reduce_partial_gradients_when_accumulated(self.module)
            self._hooked = True
        lp = self.plan.loss_parallel  # a loss inside the model splits; the logits gathered
        with ReplicatedBeforeAutograd(), loss_context(lp):  # loss.backward() meets DTensors
            output = self._forward(*inputs, **kwargs)
        return gather_output(output) if lp else output

    def _forward(self, *inputs: Any, **kwargs: Any) -> Any:
        with tp_context(self.plan.degree("tp")), self.sequence_shards():
            return self.module(*inputs, **kwargs)

    def data_shard(self) -> DataShard:
        """Which shard of every global batch this rank trains on, when each rank
        loads its own data (``step(x, y, local=True)`` or ``pm(x)``)."""
        dp = self.plan.data_parallel
        index = self.mesh.get_local_rank("dp") if dp > 1 else 0
        return DataShard(index=index, count=dp, batch_size=self.plan.global_batch // dp)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients over several backwards without reducing them over the
        data-parallel ranks (FSDP2's ``set_requires_gradient_sync(False)``); the first
        backward after the block reduces the sum. Divide each micro-batch's loss by
        their count, as one would without it."""
        if self.pipeline is not None:
            raise ConfigError("a pipelined model accumulates its micro-batches inside step()")
        root = self.module if isinstance(self.module, FSDPModule) else None
        if root is not None:
            root.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            if root is not None:
                root.set_requires_gradient_sync(True)

    def sequence_shards(self) -> contextlib.AbstractContextManager:
        """Under context parallelism, the mode that runs attention over the ``cp``
        ranks and gives the model this rank's positions
        (:class:`~autopar.runtime.context_mode.SequenceShards`); else nothing."""
        cx = self.plan.context
        if cx is None:
            return contextlib.nullcontext()
        return SequenceShards(self.mesh.get_group("cp"), cx.variant, cx.seq_len)

    def _loss(self, output: Any, targets: torch.Tensor) -> torch.Tensor:
        return _loss(self.loss_fn, output, targets, loss_scale(self.plan))

    def _check_batch(self, xs: Sequence[Any], targets: torch.Tensor, local: bool) -> None:
        gb = self.plan.global_batch
        want = gb // self.plan.data_parallel if local else gb
        for what, t in [(f"input {i}", x) for i, x in enumerate(xs)] + [("targets", targets)]:
            if isinstance(t, torch.Tensor) and (t.dim() == 0 or t.shape[0] != want):
                got = "a scalar" if t.dim() == 0 else f"{t.shape[0]} samples"
                if local:
                    raise ConfigError(
                        f"step(local=True) got {got} in {what}, but this rank's shard of the "
                        f"global batch of {gb} has {want} (dp={self.plan.data_parallel}); "
                        f"pass the shard pm.data_shard() names")
                raise ConfigError(f"step() got {got} in {what}, but the plan is for a global "
                                  f"batch of {gb}; pass the whole global batch, the same on "
                                  f"every rank (or this rank's shard with local=True)")
        tp = self.plan.degree("tp")
        splits_sequence = self.plan.sequence_parallel or any(
            "S(1)" in (m.input_layout, m.desired_input_layout, m.output_layout)
            for m in self.plan.modules.values())
        x = xs[0] if xs else None
        if tp > 1 and splits_sequence and isinstance(x, torch.Tensor) and x.dim() > 1 \
                and x.shape[1] % tp:
            raise ConfigError(f"the plan splits the sequence over tp={tp}, but the inputs have "
                              f"sequence length {x.shape[1]}; pass a sequence length divisible "
                              f"by {tp}")

    def step(self, inputs: Any, targets: torch.Tensor, *, local: bool = False) -> torch.Tensor:
        """Forward and backward of one global batch; returns the global batch's loss
        (the mean over its samples, or their sum for a loss that sums: :func:`loss_scale`).

        Every rank passes the same global batch (a tensor or a tuple of tensors, batch
        first). Each rank takes its data-parallel slice (tp ranks of one dp group take
        the same one), splits it into ``plan.num_microbatches`` micro-batches, and
        accumulates the gradients of ``loss / num_microbatches``; gradients are averaged
        over ``dp``, so they equal those of the mean loss over the global batch. The
        caller then runs ``optimizer.step()`` and ``optimizer.zero_grad()``. The rank's
        slice goes to the device once, at the start (:func:`to_device`).

        With ``local``, each rank passes only its own shard (:meth:`data_shard`: the
        usual ``DistributedSampler`` loop), which the step uses as it is.

        A failure on any rank, in the forward, the backward or their hooks, is raised
        on every rank within seconds, naming that rank (:meth:`guarded`).
        """
        xs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
        with self.guarded("running a training step (ParallelModel.step)"):
            self._check_batch(xs, targets, local)  # one rank's batch may be wrong alone
            return self._step(xs, targets, local)

    def _step(self, xs: tuple[Any, ...], targets: torch.Tensor, local: bool) -> torch.Tensor:
        if self.pipeline is not None:
            return self.pipeline.step(xs, targets, local=local)
        plan = self.plan
        n, mb, dp = plan.num_microbatches, plan.microbatch_size, plan.data_parallel
        tp = self.plan.degree("tp")
        rank = 0 if local else self.mesh.get_local_rank("dp")
        mine = slice(rank * n * mb, (rank + 1) * n * mb)
        xs = tuple(to_device(x[mine], self.device) if isinstance(x, torch.Tensor) else x
                   for x in xs)
        targets = to_device(targets[mine], self.device)
        cp = plan.degree("cp")
        if cp > 1:  # this rank's share of every sequence
            xs, targets = split_batch(plan, xs, targets, self.mesh.get_local_rank("cp"))
        fsdp = isinstance(self.module, FSDPModule)
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        for i in range(n):
            if fsdp and self.plan.zero < 3:  # reduce gradients once, after the last micro-batch
                self.module.set_requires_gradient_sync(i == n - 1)  # and keep the gathered
                self.module.set_reshard_after_backward(i == n - 1)  # parameters till then
            part = slice(i * mb, (i + 1) * mb)
            local = [x[part] if isinstance(x, torch.Tensor) else x for x in xs]
            # plain tensors the forward makes meet DTensors; a loss-parallel loss splits.
            # One tp_context for forward, loss and backward
            with tp_context(tp), loss_context(plan.loss_parallel):
                with self.sequence_shards():
                    output = self.module(*local)
                loss = self._loss(output, targets[part]) / n
                del output  # the logits live on only where the loss saved them
                loss.backward()
            total += loss.detach().float()
        if not fsdp:
            reduce_partial_gradients(self.module)
        for axis, size in (("dp", dp), ("cp", cp)):
            if size > 1:  # the mean over the ranks' samples (and shares of sequences)
                dist.all_reduce(total, group=self.mesh.get_group(axis))
                total /= size
        return total



def apply_plan(model: nn.Module, plan: Plan, *, loss_fn: LossFn | None = None,
               device: torch.device | str | None = None,
               example_inputs: Any = None, compile: bool | None = None) -> ParallelModel:
    """Lay ``model`` out in place as ``plan`` says and wrap it in a :class:`ParallelModel`.

    Needs an initialized default process group whose world size equals the plan's
    mesh size; call it on every rank. A real model keeps its weights (every rank must
    pass the same weights, e.g. built after the same ``torch.manual_seed``); a model on
    the ``meta`` device is materialized with only this rank's shards and freshly
    initialized by its modules' ``reset_parameters()`` (see
    :mod:`autopar.runtime.materialize`). ``device`` defaults to the current CUDA
    device under NCCL and to the CPU otherwise. ``loss_fn(output, targets)`` defaults
    to cross-entropy over the last dim.

    A plan with a pipeline (``plan.pipeline`` with several stages, mesh
    ``{"pp": .., "dp": .., "tp": ..}``) is lowered by
    :func:`~autopar.runtime.lower.lower_pipeline`: each rank keeps, lays out and (for
    a meta model) materializes only its own stages. Its stages are cut from the
    model's program exported on ``example_inputs`` (one batch of the inputs ``step``
    will get, batch first; only their shapes and dtypes matter), by default on the
    inputs the plan records (``plan.inputs``).

    ``compile=True`` compiles each of the plan's blocks with ``torch.compile`` after
    tensor parallelism and recomputation and before FSDP2 (as torchtitan does; see
    :mod:`autopar.runtime.compiled`); plans without a pipeline only. None (the
    default): as the plan chose (``plan.compile_blocks``) where the model runs on a
    GPU; on a CPU the blocks run eager.
    """
    if not isinstance(plan, Plan):
        raise ConfigError(f"plan must be an autopar.Plan, got {type(plan).__name__}")
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    check_process_group(plan)
    no_kv_cache(model)
    dev = torch.device(device) if device is not None else default_device()
    names = state_names(model)  # the plain model's, for checkpoints
    if compile is None:
        compile = plan.compile_blocks and dev.type == "cuda"
    if plan.pipeline is not None and len(plan.pipeline.stages) > 1:
        if compile:
            raise ConfigError("compile=True applies to plans without a pipeline: a "
                              "pipeline's stages are cut from an exported program, not "
                              "the model's blocks; leave compile off for this plan")
        runtime = lower_pipeline(model, plan, dev,
                                 functools.partial(_loss, loss_fn, scale=loss_scale(plan)),
                                 example_inputs)
        return ParallelModel(nn.ModuleList(runtime.modules), plan, runtime.meshes.mesh,
                             loss_fn=loss_fn, device=dev, pipeline=runtime, names=names)
    meshes = lower(model, plan, dev, compile=compile)
    return ParallelModel(model, plan, meshes.mesh, loss_fn=loss_fn, device=dev, names=names)


def no_kv_cache(model: nn.Module) -> None:
    """Turn a Hugging Face model's key/value cache off (``config.use_cache``, the
    root's and any submodule's), as its own trainer does: training needs none, and a
    cache that each layer appends to changes between a checkpointed block's forward
    and its recomputation."""
    for config in cache_configs(model):
        config.use_cache = False


def to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``x`` on ``device``. A CPU tensor bound for a GPU goes through pinned memory
    without blocking: a pageable copy makes the host wait until the device has run
    everything queued before it, and the host then issues the rest of the step while
    the device idles."""
    if x.device == device:
        return x
    if x.device.type == "cpu" and device.type == "cuda":
        return x.pin_memory().to(device, non_blocking=True)
    return x.to(device)


def loss_scale(plan: Plan) -> float:
    """What each rank's loss of one micro-batch is multiplied by before its backward.
    The step takes the mean over micro-batches and data-parallel ranks (of the loss,
    and FSDP2 of the gradients), which is the whole batch's loss for a mean; a loss
    that sums over the batch (``plan.loss_reduction == "sum"``) is the sum of the
    ranks' and micro-batches' losses, so each is scaled by their count (context
    parallelism's ranks each sum a share of the tokens, and count too)."""
    if plan.loss_reduction != "sum":
        return 1.0
    return float(plan.num_microbatches * plan.data_parallel * plan.degree("cp"))


def _loss(loss_fn: LossFn | None, output: Any, targets: torch.Tensor,
          scale: float = 1.0) -> torch.Tensor:
    """``loss_fn(output, targets)``, or cross-entropy over the output's logits, times
    ``scale`` (:func:`loss_scale`), a local tensor (a loss-parallel plan's loss is a
    DTensor until here)."""
    loss = loss_fn(output, targets) if loss_fn is not None else \
        default_loss(first_tensor(output), targets)
    loss = gather_output(loss)
    return loss * scale if scale != 1.0 else loss
