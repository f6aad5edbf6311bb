"""Time and memory of an enumerated strategy on a hardware profile (seconds per
micro-batch, bytes per device): the one pricer of a first build and of a repricing.

:class:`StrategyPricer` prices a strategy of an op: :meth:`~StrategyPricer.op_terms`
its own compute, host time and saved activations (:class:`OpTerms`, which a repricing
keeps), :meth:`~StrategyPricer.price` the rest into a :class:`StrategyPrice`:
conversions (:mod:`autopar.cost_models.comm`), its parameters
(:mod:`autopar.cost_models.param_price`) and memory by category. Recomputation is
priced by :mod:`autopar.cost_models.recompute_price`.

What each term counts: docs/cost_models.md, section
``autopar.cost_models.strategy_price``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autopar.cost_models.comm import INF, collective_time
from autopar.cost_models.compiled import compiled_op_times
from autopar.cost_models.context_parallel import AttentionShape, CPAttentionCost, cp_attention
from autopar.cost_models.compute import (OpShapes, backward_factors, is_matmul, is_norm,
                                         local_shape, op_time)
from autopar.cost_models.dispatch import Dispatches
from autopar.cost_models.expert_dispatch import TokenExchange, expert_group, routed_dispatch
from autopar.cost_models.float8 import FP8, element_dtype, runs_float8
from autopar.cost_models.host import HostFacts, charges_host, op_host_time
from autopar.cost_models.memory import saved_element_bytes, saved_for_backward
from autopar.cost_models.param_price import ParamPricer, ParamTerms
from autopar.graph import OpNode, TensorMeta
from autopar.memory_choices import SELECTIVE_SAVE_COLLECTIVES
from autopar.strategies.analysis import GraphAnalysis
from autopar.strategies.edges import collectives, with_axis
from autopar.strategies.enumeration import GraphFacts, NodeStrategy, StrategySpace
from autopar.strategies.grad_sum import summed_placement
from autopar.strategies.settings import Settings

Placements = tuple[str, ...]


@dataclass(frozen=True)
class OpTerms:
    """What an op itself costs under one strategy: its device and host seconds
    (forward + backward, and the backward's part) and the bytes it saves for backward
    and holds at the start of backward. The ZeRO stage, micro-batch count, offload and
    optimizer change none of it: a repricing keeps them."""

    compute_s: float
    bwd_compute_s: float
    host_s: float
    host_bwd_s: float
    activations: float
    backward_start_bytes: float
    dtensor_waived: tuple[float, float] = (0.0, 0.0)
    """(forward, backward) host seconds DTensor would add to the op were its module
    not run on local tensors, as under selective recomputation
    (:meth:`StrategyPricer.dtensor_host`)."""


@dataclass
class StrategyPrice:
    """Time and memory of one strategy: the op's terms, its parameters' terms, the
    collectives on the critical path (its output's conversion, its parameters'
    partial-gradient reductions and a summed gradient's) and memory by category."""

    op: OpTerms
    params: ParamTerms
    comm_s: float
    memory: dict[str, float]
    all_to_all_s: float = 0.0  # the part of comm_s that moves tokens to their experts


class StrategyPricer(ParamPricer):
    """Prices the strategies of analysis ``an`` under settings ``st`` (module
    docstring). ``saved_owner`` and ``facts`` are the graph's, shared by a search."""

    def __init__(self, an: GraphAnalysis, st: Settings,
                 saved_owner: dict[tuple[str, int], str] | None = None,
                 facts: GraphFacts | None = None,
                 host_facts: HostFacts | None = None) -> None:
        super().__init__(StrategySpace(an, st, facts))
        self.an, self.g = an, an.graph
        self.meta = self.space.meta
        self.saved_owner = saved_owner if saved_owner is not None else self._saved_owner()
        self._steps: dict[tuple[Placements, Placements, float],
                          tuple[tuple[str, int, float, float], ...] | None] = {}
        self._ops: dict[tuple[str, tuple[str | None, ...]], tuple[float, ...]] = {}
        self._out_bytes: dict[str, float] = {}
        self._tensor_bytes: dict[str, float] = {}
        self._attention: dict[tuple, CPAttentionCost] = {}
        self._host_facts = host_facts

    @property
    def host_facts(self) -> HostFacts:
        """The graph's dispatched aten ops, local-tensor regions and the profile's
        seconds per dispatched op (:class:`~autopar.cost_models.host.HostFacts`), found
        on first use."""
        if self._host_facts is None:
            self._host_facts = HostFacts.of(self.g, frozenset(self.an.experts), self.st.hw)
        return self._host_facts

    @property
    def has_host_facts(self) -> bool:
        """Whether :attr:`host_facts` was found (a GPU profile's pricing needed it)."""
        return self._host_facts is not None

    def price(self, n: OpNode, ns: NodeStrategy, op: OpTerms) -> StrategyPrice:
        """Strategy ``ns`` of op ``n`` priced, its own terms ``op`` given
        (:meth:`op_terms`, or kept from a build under the same layout)."""
        terms = self.param_terms(n, ns.ins, ns.grads)
        mem = {"params": terms.params, "grads": terms.grads, "optimizer": terms.optimizer,
               "activations": op.activations}
        if terms.gathered is not None:
            mem["gathered"] = terms.gathered
        out_comm = self.output_comm(n, ns.raw_out, ns.out)
        routed = self.routed_exchange(n, ns)
        a2a = routed
        ep = self.ep_axis
        if ep is not None and ns.out[ep] != ns.raw_out[ep]:  # an expert module's tokens
            a2a += out_comm - self.output_comm(n, ns.raw_out,  # sent back over ep
                                               with_axis(ns.out, ns.raw_out, ep))
        comm = out_comm + terms.tp + self._grad_sum(n, ns) + routed + \
            self.statistics_comm(n, ns)
        cp = self.cp_attention(n, ns.ins)
        if cp is not None:
            comm += cp.exposed_s
        return StrategyPrice(op, terms, comm, mem, a2a)

    def cp_attention(self, n: OpNode, ins: tuple[Placements, ...]) -> CPAttentionCost | None:
        """The context-parallel cost of attention op ``n`` under input placements
        ``ins`` (:func:`~autopar.cost_models.context_parallel.cp_attention`, the
        settings' variant over the ``cp`` axis's link), or None for any other op or
        without context parallelism. Memoized."""
        a = self.space.cp_axis
        if a is None or n.name not in self.an.sequence.attention:
            return None
        key = (n.name, ins[:3])
        found = self._attention.get(key)
        if found is None:
            sizes, cp = self.mesh.sizes, self.mesh.sizes[a]
            q, k = (local_shape(self.meta(i).shape, p, sizes)
                    for i, p in zip(n.inputs[:2], ins[:2]))
            batch = 1
            for d in q[:-3]:
                batch *= d
            shape = AttentionShape(batch, q[-2] * cp, q[-3], k[-3], q[-1],
                                   self.an.sequence.attention[n.name],
                                   element_dtype(self.st.precision))
            found = self._attention[key] = cp_attention(self.st.cp_variant, cp, shape,
                                                        self.st.hw, self.links[a])
        return found

    def statistics_comm(self, n: OpNode, ns: NodeStrategy) -> float:
        """Seconds per micro-batch of the all-reduces an op that splits an
        ``allreduced`` label (loss parallelism, :mod:`autopar.strategies.loss_parallel`)
        makes its result whole with: ``statistics`` all-reduces of one fp32 value per
        row of its first input over each axis that splits the label, in the forward
        (the backward needs none)."""
        rule = self.an.rules[n.name]
        if not rule.allreduced or not n.inputs:
            return 0.0
        total = 0.0
        for a, lab in enumerate(ns.labels):
            if lab is None or lab not in rule.allreduced:
                continue
            m = self.meta(n.inputs[0])
            shape = local_shape(m.shape, ns.ins[0], self.mesh.sizes)
            d = rule.ins[0].index(lab)
            rows = 1
            for k, size in enumerate(shape):
                rows *= size if k != d else 1
            total += rule.statistics * collective_time("all_reduce", 4.0 * rows,
                                                       self.mesh.sizes[a], self.links[a])
        return total

    def routed_exchange(self, n: OpNode, ns: NodeStrategy) -> float:
        """Seconds per micro-batch of a routed expert module's exchanges, charged on its
        output op ``n`` (:meth:`token_exchange`; 0 for any other op)."""
        found = self.token_exchange(n, ns)
        return 0.0 if found is None else found.seconds

    def token_exchange(self, n: OpNode, ns: NodeStrategy) -> TokenExchange | None:
        """How a routed expert module whose output op is ``n`` moves its tokens under
        strategy ``ns``, and its seconds per micro-batch, or None for any other op or
        without ``ep``: each device's tokens, once per expert they go to, to the experts'
        ranks and back, forward and backward, in one all-to-all or two legs
        (:func:`~autopar.cost_models.expert_dispatch.routed_dispatch`); the busiest rank
        sends the settings' ``expert_imbalance`` times the mean (1: the even spread
        routers' load-balancing losses aim at)."""
        em = self.an.expert_of_output(n.name)
        if em is None or em.kind != "routed" or self.ep_axis is None:
            return None
        st = self.st
        ep, link = expert_group(self.mesh, st.fold_experts, st.gpus_per_node, st.hw)
        rows = self.out_bytes(n.name) / self.degree(ns.out) * self.st.expert_imbalance
        return routed_dispatch(rows, em.top_k, em.experts, ep, link, self.st.hw.intra_node)

    def op_terms(self, n: OpNode, ns: NodeStrategy) -> OpTerms:
        """The op's own terms under strategy ``ns`` (:class:`OpTerms`): a routed expert
        module's op under expert parallelism runs on the busiest rank's tokens, the
        settings' ``expert_imbalance`` times the mean."""
        device, bwd, host, host_b, waived = self._times(n, ns)
        if self.ep_axis is not None and n.name in self.an.routed_ops:
            device, bwd = device * self.st.expert_imbalance, bwd * self.st.expert_imbalance
        saved = self._activations(n, ns.ins, ns.out)
        cp = self.cp_attention(n, ns.ins)
        if cp is not None and cp.variant != "ring":  # gathered or head-split keys saved
            saved += cp.kv_bytes
        return OpTerms(device, bwd, host, host_b, saved, self._loss_gradient(n, ns.ins),
                       waived)

    # ---- bytes ------------------------------------------------------------------
    def nbytes(self, m: TensorMeta | None) -> float:
        """Bytes of an activation: float tensors in the compute dtype, others as they are."""
        if m is None:
            return 0.0
        return m.numel * (self.act_elt if m.is_float else m.nbytes / max(m.numel, 1))

    def out_bytes(self, name: str) -> float:
        """:meth:`nbytes` of node ``name``'s output at the micro-batch size, memoized."""
        found = self._out_bytes.get(name)
        if found is None:
            found = self._out_bytes[name] = self.nbytes(self.meta(name))
        return found

    def tensor_bytes(self, name: str) -> float:
        """Bytes of node ``name``'s output at the micro-batch size; an explicit cast to
        float32 (e.g. the logits before the loss) stays 4 bytes under mixed precision.
        Memoized."""
        found = self._tensor_bytes.get(name)
        if found is None:
            n, m = self.node(name), self.meta(name)
            if m is not None and m.dtype == "float32" and n.target.startswith(
                    ("aten.to.", "aten._to_copy.")):
                found = m.numel * 4.0
            else:
                found = self.nbytes(m)
            self._tensor_bytes[name] = found
        return found

    # ---- conversions ------------------------------------------------------------
    def conversion_steps(self, src: Placements, dst: Placements, nbytes: float
                         ) -> tuple[tuple[str, int, float, float], ...] | None:
        """The collectives that redistribute a tensor of ``nbytes`` (whole) from src to
        dst (:func:`~autopar.strategies.edges.collectives`), each as (kind, mesh axis,
        buffer bytes, seconds): its time plus, where the host is the device (a CPU
        profile), what DTensor's redistribution adds to a collective of its kind
        (:meth:`redistribute_overhead`); None where no collective can. Memoized."""
        key = (src, dst, nbytes)
        if key not in self._steps:
            steps = collectives(src, dst, nbytes, self.mesh.sizes)
            self._steps[key] = None if steps is None else tuple(
                (kind, a, size, collective_time(kind, size, self.mesh.sizes[a], self.links[a])
                 + self.redistribute_overhead(kind)) for kind, a, size in steps)
        return self._steps[key]

    def convert(self, src: Placements, dst: Placements, nbytes: float) -> float:
        """Seconds to redistribute a tensor of ``nbytes`` (whole) from src to dst: its
        :meth:`conversion_steps` together; INF where no collective can."""
        steps = self.conversion_steps(src, dst, nbytes)
        return INF if steps is None else sum(t for *_, t in steps)

    def kept_collectives(self, src: Placements, dst: Placements,
                         nbytes: float) -> tuple[float, float]:
        """(seconds, bytes per device) of the :meth:`conversion_steps` from src to dst
        whose outputs selective recomputation keeps
        (:data:`autopar.memory_choices.SELECTIVE_SAVE_COLLECTIVES`): their forward
        seconds, which the backward does not run again, and the bytes of their outputs
        it holds instead (a reduce-scatter's: its share of the buffer)."""
        kept = [(t, size / self.mesh.sizes[a])
                for kind, a, size, t in self.conversion_steps(src, dst, nbytes) or ()
                if kind in SELECTIVE_SAVE_COLLECTIVES]
        return sum(t for t, _ in kept), sum(b for _, b in kept)

    def convert_both(self, src: Placements, dst: Placements, grad_src: Placements,
                     nbytes: float, needs_grad: bool) -> float:
        """Forward conversion plus, when gradients flow, the gradient's way back."""
        t = self.convert(src, dst, nbytes)
        if needs_grad:
            back = tuple("R" if p == "P" else p for p in src)
            t += self.convert(grad_src, back, nbytes)
        return t

    def output_comm(self, n: OpNode, raw: Placements, out: Placements) -> float:
        """Seconds per micro-batch to convert op ``n``'s output from the placement its
        rule produces (``raw``) to the one it hands on (``out``), forward and, when
        gradients flow, backward."""
        if out == raw:
            return 0.0
        return self.convert_both(raw, out, out, self.out_bytes(n.name), n.requires_grad)

    def _grad_sum(self, n: OpNode, ns: NodeStrategy) -> float:
        """Seconds per micro-batch to reduce the gradient a summing twin takes partial
        (:mod:`autopar.strategies.grad_sum`) to its output's placement, once."""
        if not ns.grad_sum or not n.requires_grad:
            return 0.0
        return self.convert(summed_placement(ns.out, ns.grad_sum), ns.out,
                            self.out_bytes(n.name))

    # ---- the op's own terms -----------------------------------------------------
    def _times(self, n: OpNode, ns: NodeStrategy) -> tuple[Any, ...]:
        """(forward + backward device, backward device, forward + backward host,
        backward host) seconds of op ``n`` under its label assignment, and the host
        seconds its local tensors spare (:attr:`OpTerms.dtensor_waived`): the same for
        every placement its output is handed on in, so memoized by the assignment."""
        key = (n.name, ns.labels)
        found = self._ops.get(key)
        if found is None:
            found = self._ops[key] = self._op_times(n, ns.labels, ns.raw_out, ns.ins)
        return found

    def _op_times(self, n: OpNode, combo, raw: Placements,
                  ins: tuple[Placements, ...]) -> tuple[Any, ...]:
        """:meth:`_times`, not memoized."""
        shard = self.space.sequence_split(n)
        for lab, size in zip(combo, self.mesh.sizes):
            if lab is not None:
                shard *= size
        f = self.space.scaled(n)
        elt_scale = self.act_elt / 4.0
        flops = n.flops * f / shard
        nbytes = n.bytes * f * elt_scale / shard
        sizes = self.mesh.sizes
        out_meta = self.meta(n.name)
        shapes = OpShapes(n.target, tuple(
            local_shape(m.shape if m is not None else None, p, sizes)
            for m, p in zip((self.meta(i) for i in n.inputs), ins)),
            local_shape(out_meta.shape if out_meta is not None else None, raw, sizes),
            causal=len(n.args) > 5 and n.args[5] is True)
        dtype, hw = self._dtype(n), self.st.hw
        fwd = op_time(shapes, flops, nbytes, backward=False, dtype=dtype, hw=hw)
        bwd = 0.0
        if n.requires_grad and (flops or nbytes):
            ff, bf = backward_factors(n.target)
            if ff or bf:
                bwd = op_time(shapes, flops * ff, nbytes * bf, backward=True,
                              dtype=dtype, hw=hw)
        cp = self.cp_attention(n, ins)
        if cp is not None:  # the queries on every key they attend, as the variant runs it
            fwd, bwd = cp.compute_s - cp.backward_s, cp.backward_s if n.requires_grad else 0.0
        if self.st.compiled and n.layer is not None:  # torch.compile of the blocks
            fwd, bwd, host_f, host_b = compiled_op_times(hw, is_matmul(n.target), fwd, bwd,
                                                         n.requires_grad)
            waived = (0.0, 0.0)
        else:
            (dt_f, dt_b), waived = self.dtensor_host(n, ins)
            host_f, host_b = self._op_host(n)
            host_f, host_b = host_f + dt_f, host_b + dt_b
        if not hw.host_runs_ahead:  # on a CPU the host is the device
            fwd, bwd, host_f, host_b = fwd + host_f, bwd + host_b, 0.0, 0.0
        return fwd + bwd, bwd, host_f + host_b, host_b, waived

    def _dtype(self, n: OpNode) -> str:
        """The dtype op ``n`` computes in: ``"fp8"`` for a float8 Linear product
        (:func:`~autopar.cost_models.float8.runs_float8`), else the precision's
        element dtype."""
        prec = self.st.precision
        if prec == FP8:
            weights = [self.meta(i) for i, k in zip(n.inputs, self.facts.input_kinds(n))
                       if k == "param"]
            shape = tuple(weights[0].shape) if weights and weights[0] is not None else None
            if runs_float8(prec, n.target, n.module_type, shape):
                return FP8
        return element_dtype(prec)

    def _op_host(self, n: OpNode) -> tuple[float, float]:
        """(forward, backward) host seconds of dispatching op ``n`` on a GPU profile
        (:func:`~autopar.cost_models.host.op_host_time`: its dispatched aten ops,
        never less than the measured op of its kind)."""
        d = self.dispatches(n.name)
        if d is None:
            return 0.0, 0.0
        return op_host_time(self.st.hw, self.host_facts.rates, n, d)

    def dispatches(self, name: str) -> Dispatches | None:
        """The aten ops op ``name`` dispatches, on a profile that charges host time
        (else None, nor where the op was not counted)."""
        if not charges_host(self.st.hw):
            return None
        return self.host_facts.dispatches.get(name)

    def dtensor_host(self, n: OpNode, ins) -> tuple[tuple[float, float], tuple[float, float]]:
        """(forward, backward) host seconds DTensor adds to op ``n`` under input
        placements ``ins``, and what it would add were the op's module not run on
        local tensors (figures of :attr:`HardwareProfile.host_overhead_s`; 0 where the
        profile has none). Outside a local-tensor region
        (:mod:`~autopar.cost_models.local_regions`), with a model-parallel axis: a
        matrix product (or embedding) whose parameter is split over it runs as a
        tensor-parallel Linear (``linear``), a norm whose input is split so as a
        sequence-parallel one (``norm``), and every other op but those computed from
        shapes on DTensors (``dtensor_op``). Inside a region, under no context
        parallelism, the ops run on local tensors: a Linear with a split weight pays
        one ``dtensor_op`` for its edge (its weight's local view, a rowwise Linear's
        output wrapped back), the other ops nothing; a Linear with a replicated
        weight keeps the region on DTensors, so it pays its share of the region's
        ops at ``dtensor_op``. On a CPU the seconds add to the op's time (the host is
        the device); on a GPU they are host time beside the device's."""
        zero = (0.0, 0.0)
        over = self.st.hw.host_overhead_s
        if not over or not self.free:
            return zero, zero
        grad = n.requires_grad

        def fig(kind: str, times: float = 1.0) -> tuple[float, float]:
            return (times * over.get(f"{kind}_fwd", 0.0),
                    times * over.get(f"{kind}_bwd", 0.0) if grad else 0.0)
        kind = self._dtensor_kind(n, ins)
        whole = fig(kind) if kind is not None else zero
        region = self.host_facts.regions.get(n.name) if self.space.cp_axis is None else None
        if region is None:
            return whole, zero
        if kind == "linear":
            return fig("dtensor_op"), (whole[0] - fig("dtensor_op")[0],
                                       whole[1] - fig("dtensor_op")[1])
        if kind == "dtensor_op" and self._reads_param(n):
            return fig("dtensor_op", region.ops / region.linears), zero
        return zero, whole

    def _reads_param(self, n: OpNode) -> bool:
        """Whether op ``n`` is a matrix product of a parameter (a Linear)."""
        return is_matmul(n.target) and "param" in self.facts.input_kinds(n)

    def _dtensor_kind(self, n: OpNode, ins) -> str | None:
        """The DTensor figure of op ``n`` outside a region (:meth:`dtensor_host`)."""
        kinds = self.facts.input_kinds(n)

        def split(pl: Placements) -> bool:
            return any(pl[a].startswith("S(") for a in self.free)
        if (is_matmul(n.target) or n.target.endswith(("embedding", "embedding.default"))) and \
                any(k == "param" and split(p) for k, p in zip(kinds, ins)):
            return "linear"
        if is_norm(n.target) and ins and kinds[0] != "param" and split(ins[0]):
            return "norm"
        if n.name not in self.an.constants:
            return "dtensor_op"
        return None

    def _activations(self, n: OpNode, ins, out) -> float:
        """Bytes per device that autograd saves for op ``n``'s backward under
        placements ``ins``/``out``, of the tensors charged to it (:meth:`_saved_owner`)."""
        total = 0.0
        if not n.requires_grad:
            return total
        kinds = self.facts.input_kinds(n)
        for idx in saved_for_backward(n.target, len(n.inputs)):
            if idx == -1:
                key, name, pl = (n.name, -1), n.name, out
            elif idx < len(n.inputs) and kinds[idx] != "param":
                key, name, pl = (n.inputs[idx], 0), n.inputs[idx], ins[idx]
            else:
                continue
            if self.saved_owner.get(key) != n.name or self.meta(name) is None:
                continue
            elt = saved_element_bytes(n.target) if idx == -1 else None
            size = self.meta(name).numel * elt if elt else self.tensor_bytes(name)
            total += size / self.degree(pl)
        return total

    def _loss_gradient(self, n: OpNode, ins) -> float:
        """Bytes of the loss's input gradient at the start of backward (on the loss op),
        plus the logits' gradient when the loss input is a cast of them
        (:mod:`autopar.cost_models.memory`)."""
        if n.name != self.g.loss or not n.inputs:
            return 0.0
        src = self.node(n.inputs[0])
        d = self.degree(ins[0])
        total = self.tensor_bytes(src.name) / d
        if src.target.startswith(("aten.to.", "aten._to_copy.")) and src.inputs:
            total += self.tensor_bytes(src.inputs[0]) / d
        return total

    def _saved_owner(self) -> dict[tuple[str, int], str]:
        """Each saved tensor is charged to the first op (in graph order) that saves it."""
        owner: dict[tuple[str, int], str] = {}
        for n in self.g.nodes:
            if n.kind != "op" or not n.requires_grad:
                continue
            for idx in saved_for_backward(n.target, len(n.inputs)):
                key = (n.name, -1) if idx == -1 else (
                    (n.inputs[idx], 0) if idx < len(n.inputs) else None)
                if key is not None:
                    owner.setdefault(key, n.name)
        return owner
