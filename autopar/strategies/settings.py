"""What a solver problem is built for besides the graph: the mesh, the micro-batching,
the ZeRO stage, precision, optimizer, memory budget and hardware profile.

Enumeration (:mod:`autopar.strategies.enumeration`) reads the mesh, the micro-batch
size and the sequence-parallel and recomputation choices; pricing
(:mod:`autopar.cost_models.strategy_price`) reads the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.sharding import Mesh


@dataclass(frozen=True)
class Settings:
    """What a problem is built for, besides the graph."""

    mesh: Mesh
    microbatch_size: int
    num_microbatches: int
    zero: int
    precision: str
    optimizer: str
    memory_budget: float
    hw: object
    gpus_per_node: int
    sequence_parallel: bool | None = None
    loss_parallel: bool | None = None  # the loss on class-split logits (None: the solver's)
    split_weights: bool = False  # every block matrix split over tp (enumeration)
    offload: bool = False
    recompute_modes: tuple[str, ...] = ("none", "selective", "full")
    split_experts: bool = False  # every expert module split over ep (else the solver's)
    expert_imbalance: float = 1.0  # busiest ep rank's routed tokens over the mean
    fold_experts: bool = False  # routed experts split over ep x tp, whole on each rank
    cp_variant: str = "allgather"  # how attention brings keys over cp (context_parallel)
    compiled: bool = False  # the blocks run under torch.compile (cost_models.compiled)
    pipelined: bool = False  # a pipeline stage's problem (torch.distributed.pipelining runs it)

    @property
    def grad_sync_once(self) -> bool:
        """Whether FSDP2 reduces the data-parallel gradients once per step, after the
        last micro-batch's backward, accumulating them unsharded in fp32 until then:
        under ZeRO-1/2 with micro-batches (the runtime's
        ``set_requires_gradient_sync(False)`` before the last), and on every pipeline
        stage (``torch.distributed.pipelining``'s ``backward_maybe_with_nosync`` turns
        FSDP2's gradient sync and its resharding after backward off for every
        micro-batch; ``perform_reduce_grad`` reduces once at the end, torch 2.13)."""
        return self.num_microbatches > 1 and (self.pipelined or self.zero in (1, 2))

    @property
    def keeps_gathered(self) -> bool:
        """Whether FSDP2 keeps each unit's parameters gathered after its backward until
        the step ends, with micro-batches: on a pipeline stage (``torch.distributed.
        pipelining`` turns resharding after backward off until the last) and under
        ZeRO-0/1/2 (the runtime's ``set_reshard_after_backward(False)`` before the last
        micro-batch: they are gathered from forward to backward anyway, so the peak
        does not grow). Under ZeRO-0/1/2 they are then gathered once per step; under
        ZeRO-3 the next forward reshards them, so its backward gathers them once more."""
        return self.num_microbatches > 1 and (self.pipelined or self.zero < 3)

    @property
    def overlap(self) -> float:
        """The share of compute that gradient synchronization and ZeRO traffic may
        hide behind: the hardware profile's ``comm_overlap``.

        What overlaps in eager PyTorch, and how the pricing treats it:

        * Tensor-parallel and sequence-parallel collectives (DTensor redistributions,
          the partial-gradient all-reduces: ``comm_s``) sit on the critical path: the
          next op consumes their result, and eager DTensor waits on each collective
          before the op that reads it. Only async-TP (torch's micro-pipelined
          all-gather-matmul, opt-in via ``torch._inductor`` under ``torch.compile``:
          PyTorch "Introducing Async Tensor Parallelism", 2024) hides them, and the
          runtime does not use it, so none of it is hidden.
        * FSDP2's all-gathers and reduce-scatters (``micro_param_comm_s``) run on
          their own CUDA streams: the all-gather of the next ``fully_shard`` unit is
          issued when the host reaches its pre-forward hook (implicit prefetch, the
          host running ahead) or explicitly one unit ahead in backward, and each
          unit's reduce-scatter overlaps the backward of the units before it
          (torch.distributed.fsdp.fully_shard documentation; Zhao et al., "PyTorch
          FSDP", VLDB 2023, §3.3). DDP's bucketed all-reduce (``step_param_comm_s``)
          likewise overlaps the backward (Li et al., "PyTorch Distributed", VLDB 2020,
          §3.2.3). The solver hides them behind ``overlap`` x compute summed over
          the step (:mod:`autopar.solvers.problem`), except the root unit's, whose
          all-gather opens each forward and whose reduce-scatter closes each
          backward with no compute beside them: they are priced on the critical path
          (:meth:`autopar.cost_models.param_price.ParamPricer.param_comm`). Still
          optimistic: a block unit whose traffic outlasts its neighbours' compute is
          hidden by slack elsewhere in the sum, and the first block's all-gather
          (behind only the embedding) and the last reduce-scatter are counted as
          hidden.
        * On a GPU profile ``comm_overlap`` is 1 (NCCL's kernels beside the compute
          stream); the slowdown concurrent NCCL kernels cause to the GEMMs they
          share SMs and HBM with is not priced.
        """
        return self.hw.comm_overlap  # type: ignore[attr-defined]
