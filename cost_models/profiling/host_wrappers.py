"""Host seconds the parallel wrappers add: DTensor modules, FSDP2 units, redistributions.

A tensor-parallel Linear, a sequence-parallel norm and any op run on a DTensor dispatch
through DTensor on the host, every call and its backward; FSDP2 adds hooks and
per-parameter bookkeeping to a ``fully_shard`` unit. Each figure is the wrapped
module's time less the plain module's on a mesh of one process (no collective runs),
forward and backward (:func:`host_overhead`: :data:`HOST_KEYS`,
:data:`DTENSOR_OP_KEYS`); a redistribution that runs a collective is timed on the mesh
of every process against the plain collective (:func:`redistribute_overhead`). The
figures go into a profile's ``host_overhead_s``, priced by
:mod:`autopar.cost_models.host`; what each counts: docs/profiling.md.
"""

from __future__ import annotations

import contextlib
import statistics
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from autopar.cost_models.profiling.timing import (backward_times, median_difference, median_of,
                                                  median_time, paired_times)

HOST_KEYS = ("linear_fwd", "linear_bwd", "norm_fwd", "norm_bwd", "fsdp_param_fwd",
             "fsdp_param_bwd")
"""The measured figures every shipped profile has (:func:`host_overhead`)."""

DTENSOR_OP_KEYS = ("dtensor_op_fwd", "dtensor_op_bwd")
"""What DTensor adds to any other op (:func:`dtensor_overhead`): measured by
:func:`host_overhead` since every op of a tensor-parallel plan runs on DTensors; the
profiles shipped before that lack it, and a plan then charges nothing for it."""

_CALLS, _REPS = 100, 5


def _fwd_and_step(module: nn.Module, x: torch.Tensor,
                  context: Callable[[], Any] = contextlib.nullcontext) -> tuple[Callable[[], None],
                                                                              Callable[[], None]]:
    """(forward, forward + backward) of one call of ``module`` on ``x``, each inside
    ``context()``."""
    def fwd() -> None:
        with context():
            module(x)

    def both() -> None:
        with context():
            out = module(x)
            (out.to_local() if hasattr(out, "to_local") else out).sum().backward()
    return fwd, both


def _added(wrapped: nn.Module, plain: nn.Module, x: torch.Tensor, sync: Callable[[], None],
           context: Callable[[], Any] = contextlib.nullcontext) -> tuple[float, float]:
    """(forward, backward) seconds that ``wrapped`` (run inside ``context()``) takes
    beyond ``plain`` on ``x``, from paired repetitions (:func:`paired_times`)."""
    pf, pb, wf, wb = paired_times([*_fwd_and_step(plain, x), *_fwd_and_step(wrapped, x, context)],
                                  sync, 2 * _REPS + 1, _CALLS, warmup=10)
    return median_difference(pf, wf), median_difference(backward_times(pf, pb),
                                                        backward_times(wf, wb))


def dtensor_overhead(mesh: Any, sync: Callable[[], None]) -> dict[str, float]:
    """Host seconds per call that DTensor adds to a tensor-parallel Linear (the mean of
    a column-wise and a row-wise one), to a sequence-parallel LayerNorm and to any
    other op (per pointwise op of a chain run on a DTensor inside the runtime's
    :func:`~autopar.runtime.dtensor_layout.plain_as_replicated`, as a tensor-parallel
    step runs), forward and backward, on ``mesh`` (one process: :func:`host_overhead`)."""
    from autopar.runtime.dtensor_layout import plain_as_replicated
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    dev = torch.device(mesh.device_type)
    x = torch.randn(4, 2, 8, device=dev, requires_grad=True)
    plain = nn.Linear(8, 8).to(dev)
    lin = [_added(parallelize_module(nn.Linear(8, 8).to(dev), mesh, style), plain, x, sync)
           for style in (ColwiseParallel(), RowwiseParallel())]
    norm = _added(parallelize_module(nn.LayerNorm(8).to(dev), mesh, SequenceParallel()),
                  nn.LayerNorm(8).to(dev), x, sync)
    op = _added(_OnDTensor(_Pointwise(), mesh), _Pointwise(), x, sync, plain_as_replicated)
    return {"linear_fwd": statistics.fmean(f for f, _ in lin),
            "linear_bwd": statistics.fmean(b for _, b in lin),
            "norm_fwd": norm[0], "norm_bwd": norm[1],
            "dtensor_op_fwd": op[0] / _Pointwise.OPS, "dtensor_op_bwd": op[1] / _Pointwise.OPS}


class _Pointwise(nn.Module):
    """A chain of ``OPS`` pointwise ops, each with a backward."""

    OPS = 4

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return torch.tanh(x * 2.0 + x).sigmoid()


class _OnDTensor(nn.Module):
    """``inner`` run on its input made a replicated DTensor, as every op of a model
    laid out for tensor parallelism runs (:mod:`autopar.runtime.dtensor_layout`)."""

    def __init__(self, inner: nn.Module, mesh: Any) -> None:
        super().__init__()
        self.inner, self.mesh = inner, mesh

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        from torch.distributed.tensor import DTensor, Replicate

        d = DTensor.from_local(x, self.mesh, [Replicate()], run_check=False)
        return self.inner(d).to_local()


REDISTRIBUTE_KEYS = ("redistribute_all_reduce", "redistribute_all_gather",
                     "redistribute_reduce_scatter")
"""The figures of :func:`redistribute_overhead`, one per collective kind."""


def redistribute_overhead(mesh: Any, sync: Callable[[], None]) -> dict[str, float]:
    """Seconds DTensor adds to one redistribution that runs a collective, on ``mesh``
    (one dimension, more than one process), per kind (:data:`REDISTRIBUTE_KEYS`): partial
    sums to replicated (all-reduce), sequence shards to replicated (all-gather: DTensor
    gathers along dimension 0 and moves the pieces into place) and partial sums to
    sequence shards (reduce-scatter), each on a 64 KiB activation of shape (8, 8, 256)
    in fp32, less the plain collective on the same bytes; not negative."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    n = mesh.size()
    group = mesh.get_group()
    x = torch.randn(8, 8, 256)
    part = DTensor.from_local(x, mesh, [Partial()], run_check=False)
    seq = DTensor.from_local(x[:, : 8 // n].contiguous(), mesh, [Shard(1)], run_check=False)
    cases = {
        "redistribute_all_reduce": (
            lambda: part.redistribute(mesh, [Replicate()]).to_local(),
            lambda: dist.all_reduce(x.clone(), group=group)),
        "redistribute_all_gather": (
            lambda: seq.redistribute(mesh, [Replicate()]).to_local(),
            lambda: dist.all_gather_into_tensor(torch.empty(8 * n, 8 // n, 256),
                                                seq.to_local(), group=group)),
        "redistribute_reduce_scatter": (
            lambda: part.redistribute(mesh, [Shard(1)]).to_local(),
            lambda: dist.reduce_scatter_tensor(torch.empty(x.numel() // n), x.reshape(-1),
                                               group=group)),
    }
    return {k: max(0.0, median_time(dt, sync, 2 * _REPS + 1, _CALLS // 5, warmup=5)
                   - median_time(plain, sync, 2 * _REPS + 1, _CALLS // 5, warmup=5))
            for k, (dt, plain) in cases.items()}


def fsdp_overhead(mesh: Any, sync: Callable[[], None],
                  param_dtype: torch.dtype | None = None) -> dict[str, float]:
    """Host seconds per parameter that FSDP2 adds to one forward and one backward of a
    ``fully_shard`` unit (its hooks, the unshard and reshard bookkeeping and the
    per-parameter copies), on ``mesh`` (one process: :func:`host_overhead`): a unit of
    eight tiny Linears (16 parameters, as many as a transformer block has) against the
    plain module, divided by its parameter count. Keys ``fsdp_param_fwd`` and
    ``fsdp_param_bwd``. With ``param_dtype`` the unit computes in that dtype
    (``MixedPrecisionPolicy``, as a bf16 plan runs), its casts included."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dev = torch.device(mesh.device_type)
    x = torch.randn(4, 8, device=dev, requires_grad=True)

    def unit() -> nn.Module:
        return nn.Sequential(*(nn.Linear(8, 8) for _ in range(8))).to(dev)
    wrapped = unit()
    params = sum(1 for _ in wrapped.parameters())
    fully_shard(wrapped, mesh=mesh,
                mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype) if param_dtype
                else MixedPrecisionPolicy())
    fwd, bwd = _added(wrapped, unit(), x, sync)
    return {"fsdp_param_fwd": fwd / params, "fsdp_param_bwd": bwd / params}


def host_overhead(device_type: str, sync: Callable[[], None], dispatch: bool = False,
                  say: Callable[[str], None] | None = None) -> dict[str, float]:
    """Every figure of :data:`HOST_KEYS` and :data:`DTENSOR_OP_KEYS` (:func:`dtensor_overhead`,
    :func:`fsdp_overhead`), non-negative, on a mesh of this process alone; with
    ``dispatch`` also those of
    :data:`~autopar.cost_models.profiling.host_dispatch.DISPATCH_KEYS` (what a GPU profile
    needs: there the host runs beside the device, and the op tables do not see it).
    On CUDA the FSDP2 figure is taken in bf16, as GPU plans run. ``say(phase)`` is
    called as each phase starts (progress for a reader). Needs an initialized process
    group: every rank calls it, as the one-process groups are created collectively."""
    from torch.distributed.device_mesh import DeviceMesh

    group, _ = dist.new_subgroups(group_size=1)
    mesh = DeviceMesh.from_group(group, device_type)
    low = torch.bfloat16 if device_type == "cuda" else None
    say = say or (lambda phase: None)
    say("DTensor modules and redistributions")
    got = dtensor_overhead(mesh, sync)
    say("FSDP2 per parameter")
    got.update(fsdp_overhead(mesh, sync, low))
    if dispatch:
        from autopar.cost_models.profiling.host_dispatch import dispatch_overhead
        got.update(dispatch_overhead(mesh, sync, say))
    return {k: max(0.0, v) for k, v in got.items()}


def measure_host(device: torch.device, rounds: int = 1,
                 say: Callable[[str], None] | None = None) -> dict[str, float]:
    """:func:`host_overhead` with dispatch figures for ``autopar profile``, in a process
    group of this process alone (created here, over a file store, when none exists):
    each figure the median of ``rounds`` measurements (on one H100 machine three rounds
    of a Linear's backward gave 89, 95 and 123 µs; of selective checkpointing's per-op
    backward 55, 126 and 167 µs: benchmarks/results/h100_host_figures_repeat.json).
    ``say(phase)`` is called as each phase of each round starts."""
    import tempfile

    own = not dist.is_initialized()
    if own:
        with tempfile.NamedTemporaryFile(delete=False) as f:
            store = dist.FileStore(f.name, 1)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store,
                                rank=0, world_size=1)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    try:
        n, got = max(1, rounds), []
        for k in range(n):
            suffix = f" (round {k + 1} of {n})" if n > 1 else ""
            tell = (lambda phase, suffix=suffix: say(phase + suffix)) if say else None
            got.append(host_overhead(device.type, sync, dispatch=True, say=tell))
        return median_of(got)
    finally:
        if own:
            dist.destroy_process_group()
