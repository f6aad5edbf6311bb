"""What the parameters an op owns cost under one placement of them: their memory, the
ZeRO/FSDP traffic, FSDP2's copies, CPU offload, the optimizer step and the host's
part of each (seconds per micro-batch or per step, bytes per device).

:class:`ParamPricer` (:meth:`~ParamPricer.param_terms`) prices them into
:class:`ParamTerms`, from :mod:`autopar.cost_models.memory`,
:mod:`autopar.cost_models.comm`, :mod:`autopar.cost_models.param_work`,
:mod:`autopar.cost_models.offload` and :mod:`autopar.cost_models.host`.

Which collectives each ZeRO stage and offload run, and how often:
docs/cost_models.md, section ``autopar.cost_models.param_price``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from autopar.cost_models.comm import bucketed_time, collective_time, group_link
from autopar.cost_models.hardware import LinkSpec
from autopar.cost_models.host import fsdp_host_time, optimizer_host_time
from autopar.cost_models.memory import (ParamBytes, activation_bytes_per_element, fsdp_lays_out,
                                        param_bytes)
from autopar.cost_models.offload import host_step_time, offload_transfer_time
from autopar.cost_models.param_work import device_step_time, fsdp_copy_time
from autopar.graph import OpNode
from autopar.strategies.enumeration import OwnedParam, StrategySpace

Placements = tuple[str, ...]


class DataGroup(NamedTuple):
    """A parameter's data-parallel group: its ranks, their link, the ZeRO shard
    group's size (1 for ZeRO-0) and the bytes per element it keeps."""

    size: int
    link: LinkSpec
    shard: int
    pbytes: ParamBytes


@dataclass(frozen=True)
class ParamTerms:
    """What the parameters an op owns cost under one placement of them: memory by
    category (``gathered`` None where nothing is gathered), the parameter communication
    of :meth:`ParamPricer.param_comm`, the optimizer step, FSDP2's copies and the host
    terms of :meth:`ParamPricer.param_host`."""

    params: float
    grads: float
    optimizer: float
    gathered: float | None
    micro: float
    step: float
    tp: float
    gather: float
    optimizer_s: float
    copy_f: float
    copy_b: float
    host: float
    host_bwd: float
    host_step: float


class ParamPricer:
    """Prices the parameters of the ops of ``space`` under its settings
    (docs/cost_models.md, section ``autopar.cost_models.param_price``), and holds what
    every price on its mesh reads: each axis's link."""

    def __init__(self, space: StrategySpace) -> None:
        st = space.st
        self.space, self.st = space, st
        self.facts, self.node, self.mesh = space.facts, space.node, space.mesh
        self.dp_axis, self.dp, self.free = space.dp_axis, space.dp, space.free
        self.degree = space.degree
        self.links = [group_link(self.mesh.sizes, a, st.gpus_per_node, st.hw)
                      for a in range(self.mesh.ndim)]
        self.act_elt = activation_bytes_per_element(st.precision)
        self.ep_axis = space.ep_axis
        # the ranks holding a replica of a parameter: data parallelism's, times the
        # context-parallel ranks, which run the same parameters on other tokens
        self.cp = self.mesh.degree("cp")
        self.replicas = self.dp * self.cp
        self._groups = {False: self._group(self.dp), True: self._group(self.dp // self._ep())}
        # a routed expert weight is split over ep, and over tp too where the experts fold
        self.routed_split = self._ep() * (self.mesh.degree("tp") if st.fold_experts else 1)
        self._terms: dict[tuple, ParamTerms] = {}

    def _ep(self) -> int:
        return self.mesh.sizes[self.ep_axis] if self.ep_axis is not None else 1

    def _group(self, n: int) -> DataGroup:
        """The data-parallel group of ``n`` data ranks (times ``cp``) a parameter's
        gradients are reduced over: the ranks of the data axes (dp and ep together: ep
        is inside dp, so they are one block of neighbours), or, for experts split over
        ep, dp's; with context parallelism, cp's ranks joined to them (FSDP2 over dp x
        cp, cp being the inner axis)."""
        st, mesh = self.st, self.mesh
        dpa = self.dp_axis if self.dp_axis is not None else self.ep_axis
        n *= self.cp
        if dpa is None or n == 1:
            link = self.links[0]
        else:
            sizes = list(mesh.sizes)
            if n == self.replicas and self.ep_axis is not None:
                sizes[dpa] *= sizes[self.ep_axis]
                sizes[self.ep_axis] = 1
            if self.space.cp_axis is not None:
                sizes[dpa] *= sizes[self.space.cp_axis]
                sizes[self.space.cp_axis] = 1
            link = group_link(tuple(sizes), dpa, st.gpus_per_node, st.hw)
        return DataGroup(n, link, n if st.zero >= 1 else 1,
                         param_bytes(st.precision, st.optimizer,
                                     st.zero if n > 1 or st.offload else 0, n, st.offload,
                                     st.grad_sync_once, st.keeps_gathered))

    def data_group(self, placements: Placements, routed: bool = False) -> DataGroup:
        """The data-parallel group of a parameter placed ``placements`` (:meth:`_group`);
        ``routed``: an expert weight of a routed expert module, split over ep whatever
        its placement (:mod:`autopar.strategies.experts`)."""
        a = self.ep_axis
        return self._groups[a is not None and (routed or placements[a].startswith("S("))]

    def local(self, p: OwnedParam, ins) -> float:
        """Elements of owned parameter ``p`` on one device under input placements
        ``ins`` (a routed expert weight also split over ep, and tp where the experts
        fold over it)."""
        n = p.numel / self.degree(ins[p.pos])
        return n / self.routed_split if p.routed else n

    def group_of(self, p: OwnedParam, ins) -> DataGroup:
        """:meth:`data_group` of owned parameter ``p`` under input placements ``ins``."""
        return self.data_group(ins[p.pos], p.routed)

    def param_terms(self, n: OpNode, ins: tuple[Placements, ...],
                    grads: tuple[Placements, ...]) -> ParamTerms:
        """The costs of the parameters op ``n`` owns under input placements ``ins`` and
        gradient placements ``grads``, worked out once per placement of those
        parameters: the strategies of an op share a few."""
        owned = self.facts.owned(n)
        key = (n.name, tuple((ins[p.pos], grads[p.pos]) for p in owned))
        found = self._terms.get(key)
        if found is None:
            found = self._terms[key] = self._param_terms(n, ins, grads)
        return found

    def _param_terms(self, n: OpNode, ins, grads) -> ParamTerms:
        """:meth:`param_terms`, not memoized."""
        params, grads_b, optimizer, gathered = self._param_memory(n, ins)
        micro, step, tp, gather = self.param_comm(n, ins, grads)
        copy_f, copy_b = self._param_copies(n, ins)
        host, host_bwd, host_step = self.param_host(n, ins)
        return ParamTerms(params, grads_b, optimizer, gathered, micro, step, tp, gather,
                          self._optimizer_step(n, ins), copy_f, copy_b, host, host_bwd,
                          host_step)

    def redistribute_overhead(self, kind: str) -> float:
        """Seconds DTensor adds to a redistribution running one collective of ``kind``
        where the host is the device (CPU profiles; 0 on a GPU, where the host runs
        ahead, or without the figure). An all-to-all counts as an all-gather, which gloo
        runs in its place."""
        hw = self.st.hw
        if hw.host_runs_ahead:
            return 0.0
        dt = "all_gather" if kind == "all_to_all" else kind
        return hw.host_overhead_s.get(f"redistribute_{dt}", 0.0)

    def param_host(self, n: OpNode, ins) -> tuple[float, float, float]:
        """Host seconds of the parameters op ``n`` owns, on a GPU profile
        (:mod:`autopar.cost_models.host`): FSDP2's hooks per micro-batch (forward +
        backward, and the backward's part) where FSDP2 lays them out, and the optimizer
        step's dispatch per step (on DTensors under FSDP2 or tensor parallelism; under
        CPU offload too, beside the host step's arithmetic in ``optimizer_s``)."""
        st = self.st
        count = sum(1 for p in self.facts.owned(n) if p.trainable)
        if not count:
            return 0.0, 0.0, 0.0
        fsdp = fsdp_lays_out(st.precision, self.replicas, st.offload)
        f, b = fsdp_host_time(st.hw, count) if fsdp else (0.0, 0.0)
        step = optimizer_host_time(st.hw, count, fsdp or bool(self.free))
        return f + b, b, step

    def _param_memory(self, n: OpNode, ins) -> tuple[float, float, float, float | None]:
        """(parameter, gradient, optimizer, gathered or None) bytes per device of the
        parameters op ``n`` owns under input placements ``ins``."""
        params = grads = optimizer = 0.0
        gathered: float | None = None
        for p in self.facts.owned(n):
            pb = self.group_of(p, ins).pbytes
            numel = self.local(p, ins)
            if not p.trainable:
                params += numel * p.nbytes / max(p.numel, 1)
                continue
            params += numel * pb.param
            if self.st.num_microbatches > 1:  # gradients outlive the forward
                grads += numel * pb.grad
            optimizer += numel * pb.optimizer
            if pb.gathered_all:
                gathered = (gathered or 0.0) + numel * pb.gathered
        return params, grads, optimizer, gathered

    def _own_params(self, n: OpNode, ins) -> list[tuple[float, int]]:
        """Local element counts of the trainable parameters op ``n`` owns, each with
        its ZeRO shard group's size."""
        return [(self.local(p, ins), self.group_of(p, ins).shard)
                for p in self.facts.owned(n) if p.trainable]

    def _optimizer_step(self, n: OpNode, ins) -> float:
        """Seconds per step of the optimizer step on the parameters op ``n`` owns: on
        the host under CPU offload, else on the device, over the ZeRO shard
        (:mod:`autopar.cost_models.param_work`)."""
        st = self.st
        step = host_step_time if st.offload else device_step_time
        return sum(step(local / shard, st.optimizer, st.hw)
                   for local, shard in self._own_params(n, ins))

    def _param_copies(self, n: OpNode, ins) -> tuple[float, float]:
        """(forward, backward) seconds per micro-batch of FSDP2's copies of the
        parameters op ``n`` owns, where FSDP2 lays the model out (data parallelism, low
        precision or offload: :func:`~autopar.cost_models.memory.fsdp_lays_out`)."""
        st = self.st
        if not fsdp_lays_out(st.precision, self.replicas, st.offload):
            return 0.0, 0.0
        fwd = bwd = 0.0
        for local, shard in self._own_params(n, ins):
            f, b = fsdp_copy_time(local, self.act_elt, shard, st.zero,
                                  st.num_microbatches, st.hw, st.keeps_gathered)
            fwd, bwd = fwd + f, bwd + b
        return fwd, bwd

    def _partial_grad_time(self, grad_bytes: float, axis: int, share: float) -> float:
        """Seconds per micro-batch to all-reduce one parameter's gradient that comes out
        partial over mesh axis ``axis`` (a replicated parameter used on shards). Where
        FSDP2 lays the parameters out it reduces them with the other gradients of its
        unit, of which the parameter holds ``share``;
        without it the runtime redistributes each such gradient on its own once per step
        (``reduce_partial_gradients``): one all-reduce and one DTensor redistribution
        per parameter, spread here over the step's micro-batches."""
        st, n, link = self.st, self.mesh.sizes[axis], self.links[axis]
        if fsdp_lays_out(st.precision, self.replicas, st.offload):
            return bucketed_time("all_reduce", grad_bytes, n, link, share)
        one = collective_time("all_reduce", grad_bytes, n, link) + \
            self.redistribute_overhead("all_reduce")
        return one / st.num_microbatches

    def _gathers(self, root: bool) -> int:
        """All-gathers of a ZeRO-1/2/3 parameter per micro-batch: ZeRO-3 gathers a
        block's in forward and again in backward, once where a pipeline stage keeps
        them gathered after backward (:attr:`~autopar.strategies.settings.Settings.keeps_gathered`:
        only the forward reshards them); ZeRO-1/2 once, or none per micro-batch (once
        per step) where the stage keeps them; the root unit once."""
        st = self.st
        if st.zero < 3:
            return 0 if st.keeps_gathered else 1
        return 2 if not (root or st.keeps_gathered) else 1

    def param_comm(self, n: OpNode, ins, grads) -> tuple[float, float, float, float]:
        """(per-micro-batch dp comm that may hide behind compute, per-step dp comm that
        may, per-micro-batch parameter comm on the critical path, gathered bytes).

        On the critical path: tensor parallelism's partial-gradient reductions, and the
        data-parallel collectives of the root ``fully_shard`` unit (the parameters
        outside the blocks: embeddings, head, final norm). The root's all-gather is the
        first thing a forward waits for and its gradients are complete only when the
        backward ends (the embedding's comes last), so its reduce-scatter (ZeRO 1-3)
        or all-reduce (ZeRO-0, once per step: charged as 1/n per micro-batch) has no
        compute left to hide behind. The runtime keeps the root gathered from forward
        to backward (:mod:`autopar.runtime.data_parallel`), so under ZeRO-3 it is
        gathered once per micro-batch, where a block is gathered twice
        (:meth:`_gathers`). Where FSDP2 reduces the gradients once per step
        (:attr:`~autopar.strategies.settings.Settings.grad_sync_once`) the
        reduce-scatter is per step, beside the backward like DDP's all-reduce (the
        root's on the critical path, 1/n per micro-batch)."""
        micro = step = tp = gather = 0.0
        n_micro = max(1, self.st.num_microbatches)
        for p in self.facts.owned(n):
            if not p.trainable:
                continue
            local = self.local(p, ins)
            share = p.share
            folded = p.routed and self.st.fold_experts  # each rank's own experts, no sum
            for a in self.free:
                if grads[p.pos][a] == "P" and not folded:
                    tp += self._partial_grad_time(local * 4.0, a, share)
            group = self.group_of(p, ins)
            if group.size == 1:
                continue
            dpn, link, pb = group.size, group.link, group.pbytes
            grad_bytes = local * 4.0  # gradients are reduced in fp32 (MixedPrecisionPolicy)
            w = local * pb.gathered if pb.gathered else local * 4.0
            root = p.root
            if self.st.zero == 0:
                t = bucketed_time("all_reduce", grad_bytes, dpn, link, share)
                if root:
                    tp += t / n_micro
                else:
                    step += t
                continue
            ag = bucketed_time("all_gather", w, dpn, link, share)
            rs = bucketed_time("reduce_scatter", grad_bytes, dpn, link, share)
            gathers = self._gathers(root)
            once = self.st.grad_sync_once
            per_micro = gathers * ag + (0.0 if once else rs)
            per_step = (rs if once else 0.0) + (ag if gathers == 0 else 0.0)
            if root:
                tp += per_micro + per_step / n_micro
            else:
                micro += per_micro
                step += per_step
            if self.st.zero == 3:
                gather += w
                if self.st.offload:
                    micro += offload_transfer_time(local / dpn, self.st.hw)
        return micro, step, tp, gather
