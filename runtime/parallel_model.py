"""ParallelModel: a model laid out by a Plan, with a training ``step``."""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from autopar.capture import default_loss, first_tensor
from autopar.errors import LoweringError
from autopar.plans import Plan
from autopar.runtime.lower import apply_tensor_parallel, build_mesh, materialize


class ParallelModel(nn.Module):
    """The user's model under a plan. ``parameters()`` feeds an ordinary optimizer;
    ``step(inputs, targets)`` runs one forward + backward of a global batch."""

    def __init__(self, module: nn.Module, plan: Plan, mesh, loss_fn: Callable | None) -> None:
        super().__init__()
        self.module = module
        self.plan = plan
        self.mesh = mesh
        self.loss_fn = loss_fn

    def forward(self, *inputs: torch.Tensor):
        """Run the parallelized module on this rank's local inputs."""
        return self.module(*inputs)

    def _dp(self) -> tuple[int, int]:
        dp = self.plan.degree("dp")
        return (self.mesh.get_local_rank("dp") if dp > 1 else 0), dp

    def _loss(self, out, targets: torch.Tensor) -> torch.Tensor:
        if self.loss_fn is not None:
            return self.loss_fn(out, targets)
        return default_loss(first_tensor(out), targets)

    def step(self, inputs, targets: torch.Tensor) -> torch.Tensor:
        """Forward and backward on this rank's share of the global batch (the same
        global batch on every rank); returns the global mean loss on every rank."""
        xs = inputs if isinstance(inputs, (tuple, list)) else (inputs,)
        rank, dp = self._dp()
        batch = xs[0].shape[0]
        if batch != self.plan.global_batch:
            raise LoweringError(f"step() got a batch of {batch} samples but the plan is for a "
                                f"global batch of {self.plan.global_batch}")
        local = batch // dp
        n = self.plan.num_microbatches
        mb = local // n
        total = torch.zeros((), dtype=torch.float32)
        for i in range(n):
            lo = rank * local + i * mb
            sl = slice(lo, lo + mb)
            out = self.module(*(x[sl] for x in xs))
            loss = self._loss(out, targets[sl]) / n
            loss.backward()
            total += loss.detach().float().cpu()
        self._settle_partial_gradients()
        if self.plan.zero == 0 and dp > 1:
            self._average_gradients()
        if dp > 1:
            total = total.to(_device(self.module))
            dist.all_reduce(total, group=self.mesh.get_group("dp"))
            total = total.cpu() / dp
        return total

    def _settle_partial_gradients(self) -> None:
        """A replicated parameter used on split activations gets a partial-sum gradient;
        reduce it to the parameter's own placement (the tp all-reduce of its gradient)."""
        for p in self.module.parameters():
            g = p.grad
            if isinstance(g, DTensor) and isinstance(p, DTensor) and any(
                    pl.is_partial() for pl in g.placements):
                p.grad = g.redistribute(p.device_mesh, p.placements)

    def _average_gradients(self) -> None:
        """Replicated data parallel: average every gradient over the dp group."""
        group = self.mesh.get_group("dp")
        dp = self.plan.degree("dp")
        for p in self.module.parameters():
            if p.grad is None:
                continue
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            dist.all_reduce(g, group=group)
            g.div_(dp)


def _device(module: nn.Module) -> torch.device:
    for p in module.parameters():
        return p.device
    return torch.device("cpu")


def apply_plan(model: nn.Module, plan: Plan, *, loss_fn: Callable | None = None,
               device: torch.device | str | None = None) -> ParallelModel:
    """Lay ``model`` out as ``plan`` says on the running process group."""
    if not (dist.is_available() and dist.is_initialized()):
        raise LoweringError("apply_plan() needs an initialized process group (torchrun or "
                            "torch.distributed.init_process_group)")
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) \
            if dist.get_backend() == "nccl" else torch.device("cpu")
    device = torch.device(device)
    mesh = build_mesh(plan, device.type)
    if plan.degree("tp") > 1:
        apply_tensor_parallel(model, plan, mesh["tp"])
    if plan.zero == 3 and plan.degree("dp") > 1:
        from torch.distributed.fsdp import fully_shard

        for path in plan.blocks:
            fully_shard(model.get_submodule(path), mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    materialize(model, device)
    if not any(p.is_meta for p in model.parameters()):
        model.to(device)
    return ParallelModel(model, plan, mesh, loss_fn)
