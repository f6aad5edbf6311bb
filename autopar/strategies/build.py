"""Enumerate every op's strategies on a mesh and price them: the bridge from a captured
graph to a solver :class:`~autopar.solvers.problem.Problem`.

For each canonical op node (one per distinct layer position) a strategy picks, per
mesh axis, one label of the op's rule to split (or none). The ``dp`` axis is fixed to
the batch label (data parallelism); the other axes are free. Module ops (a Linear,
Embedding or norm module) may also convert their output (reduce a partial sum, gather
or slice) and their input, which is where the parallel styles of the lowering put
collectives; everywhere else producer and consumer must agree, since the code between
modules runs on plain local tensors.

Costs (seconds per micro-batch, bytes per device):

* compute: the roofline time of the op's FLOPs and bytes divided by the number of
  devices that split its work, forward plus backward (``backward_factors``);
* resharding: for each mesh axis whose placement changes, one collective over that
  axis (S→R all-gather, P→R all-reduce, P→S reduce-scatter, S(i)→S(j) all-to-all;
  R→S is a local slice), forward and, for tensors that need gradients, the dual
  conversion of the gradient backward;
* parameters: weight gradients that come out partial over ``tp`` are all-reduced
  over ``tp`` each micro-batch; over ``dp``, ZeRO-0 all-reduces fp32 gradients once
  per step, ZeRO-1/2 all-gather the parameters (compute dtype) once per micro-batch
  and reduce-scatter fp32 gradients each micro-batch (FSDP2 with
  ``reshard_after_forward=False``), ZeRO-3 all-gathers in forward and again in
  backward and reduce-scatters each micro-batch; with CPU offload (ZeRO-3) the
  sharded fp32 parameters cross the host link twice per micro-batch and the
  gradients once (:mod:`autopar.cost_models.offload`), and the optimizer step runs on
  the host once per step;
* memory: parameter, gradient and optimizer state of the parameters each op owns
  (:func:`autopar.cost_models.memory.param_bytes`), and the activations autograd
  saves for backward; the recomputation choice per layer is added by
  :mod:`autopar.strategies.recompute`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace

from autopar.cost_models.comm import bucketed_time, collective_time, group_link
from autopar.cost_models.host import fsdp_host_time, op_host_time, optimizer_host_time
from autopar.cost_models.compute import (OpShapes, backward_factors, is_matmul, is_norm,
                                         local_shape, op_time)
from autopar.cost_models.memory import (activation_bytes_per_element, fsdp_lays_out,
                                        param_bytes, saved_element_bytes, saved_for_backward)
from autopar.cost_models.offload import host_step_time, offload_transfer_time
from autopar.cost_models.param_work import device_step_time, fsdp_copy_time
from autopar.errors import NoFeasiblePlanError
from autopar.graph import OpNode, TensorMeta
from autopar.sharding import Mesh, layout_name, shard_count, shard_dim, shard_pieces
from autopar.solvers.problem import EdgeChoice, NodeChoice, Problem, StrategyCost, Tie
from autopar.strategies.analysis import GraphAnalysis
from autopar.strategies.grad_sum import add_gradient_sums, edge_backward, grad_sum_time
from autopar.strategies.recompute import recompute_groups
from autopar.strategies.rule_base import carries, placement_of, split_label
from autopar.strategies.rules import OpRule

Placements = tuple[str, ...]
INF = float("inf")


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
    offload: bool = False
    recompute_modes: tuple[str, ...] = ("none", "selective", "full")

    @property
    def overlap(self) -> float:
        """The share of compute that gradient synchronization and ZeRO traffic may
        hide behind: the hardware profile's ``comm_overlap``.

        What overlaps in eager PyTorch, and how this builder prices it:

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
          (:meth:`_Builder._param_costs`). Still optimistic: a block unit whose
          traffic outlasts its neighbours' compute is hidden by slack elsewhere in the
          sum, and the first block's all-gather (behind only the embedding) and the
          last reduce-scatter are counted as hidden.
        * On a GPU profile ``comm_overlap`` is 1 (NCCL's kernels beside the compute
          stream); the slowdown concurrent NCCL kernels cause to the GEMMs they
          share SMs and HBM with is not priced.
        """
        return self.hw.comm_overlap  # type: ignore[attr-defined]


@dataclass
class NodeStrategy:
    """One strategy of one node, with everything the plan needs to record."""

    name: str
    out: Placements
    raw_out: Placements
    ins: tuple[Placements, ...]
    grads: tuple[Placements, ...]
    memory: dict[str, float] = field(default_factory=dict)
    grad_sum: tuple[int, ...] = ()  # axes its gradient arrives partial on (grad_sum.py)


@dataclass
class Built:
    """A problem plus the strategy details behind each of its choices."""

    problem: Problem
    names: list[str]
    strategies: list[list[NodeStrategy]]
    settings: Settings


def _placements(labels, assign: tuple[str | None, ...]) -> Placements:
    return tuple(placement_of(labels, lab) for lab in assign)


def _choices(rule: OpRule) -> list[str]:
    """The labels a model-parallel axis may split: those of the inputs that are not
    forbidden and that the output keeps or sums over, and the piecewise splits
    (``"x/k"``) the rule allows."""
    outs = {split_label(lab)[0] for lab in rule.out}
    names = {split_label(lab)[0] for labs in rule.ins if labs for lab in labs} - rule.forbid
    labels = [lab for lab in sorted(names) if lab in outs or lab in rule.reduce]
    return labels + [f"{lab}/{k}" for lab, k in sorted(rule.pieces) if lab in labels]


@dataclass(frozen=True)
class _OwnedParam:
    """A parameter node an op owns (it is the parameter's first reader), with what the
    pricing of its placement reads."""

    pos: int        # the op's input position that reads it
    numel: int
    nbytes: int
    trainable: bool
    share: float    # its share of its ``fully_shard`` unit's collectives
    root: bool      # in the root unit (outside every block)


class _GraphFacts:
    """Facts of one graph analysis that no layout setting changes, worked out once per
    node and shared by every build and repricing of a search (kept in the caller's
    build cache under ``"facts"``)."""

    def __init__(self, an: GraphAnalysis) -> None:
        self.an = an
        self.nodes: dict[str, OpNode] = {n.name: n for n in an.graph.nodes}
        self._owned: dict[str, tuple[_OwnedParam, ...]] = {}
        self._kinds: dict[str, tuple[str, ...]] = {}

    def owned(self, n: OpNode) -> tuple[_OwnedParam, ...]:
        """The parameters op ``n`` owns, in input order."""
        found = self._owned.get(n.name)
        if found is None:
            found = self._owned[n.name] = tuple(self._find_owned(n))
        return found

    def _find_owned(self, n: OpNode) -> list[_OwnedParam]:
        an, g = self.an, self.an.graph
        out = []
        for pos, i in enumerate(n.inputs):
            node = self.nodes[i]
            if node.kind != "param" or an.param_owner.get(i) != (n.name, pos):
                continue
            info = g.params.get(node.target)
            out.append(_OwnedParam(pos, node.out.numel, node.out.nbytes,
                                   info is None or info.trainable,
                                   an.unit_share.get(node.target, 1.0),
                                   node.target in an.root_params))
        return out

    def input_kinds(self, n: OpNode) -> tuple[str, ...]:
        """The kinds of the nodes op ``n`` reads, in input order."""
        found = self._kinds.get(n.name)
        if found is None:
            found = self._kinds[n.name] = tuple(self.nodes[i].kind for i in n.inputs)
        return found


@dataclass(frozen=True)
class _ParamTerms:
    """What the parameters an op owns cost under one placement of them: memory by
    category (``gathered`` None where nothing is gathered), the parameter
    communication of :meth:`_Builder._param_costs`, the optimizer step, FSDP2's copies
    and the host terms of :meth:`_Builder._param_host`."""

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


class _Builder:
    def __init__(self, an: GraphAnalysis, st: Settings,
                 saved_owner: dict[tuple[str, int], str] | None = None,
                 facts: _GraphFacts | None = None) -> None:
        self.an, self.st, self.g = an, st, an.graph
        self.facts = facts if facts is not None else _GraphFacts(an)
        self.node = self.facts.nodes.__getitem__
        self.mesh = st.mesh
        self.links = [group_link(self.mesh.sizes, a, st.gpus_per_node, st.hw)
                      for a in range(self.mesh.ndim)]
        self.dp_axis = self.mesh.names.index("dp") if "dp" in self.mesh.names else None
        dp = self.mesh.sizes[self.dp_axis] if self.dp_axis is not None else 1
        # tensors are sized for one micro-batch on every dp rank together; the dp split
        # then leaves microbatch_size samples per device
        self.factor = st.microbatch_size * dp / self.g.batch_size
        self.act_elt = activation_bytes_per_element(st.precision)
        self.dp = dp
        self.shard = dp if st.zero >= 1 else 1  # the ZeRO shard group (1 for ZeRO-0)
        self.pbytes = param_bytes(st.precision, st.optimizer, st.zero if dp > 1 else 0, dp,
                                  st.offload)
        self.dtype = st.precision
        self._metas: dict[str, TensorMeta | None] = {}
        self.saved_owner = saved_owner if saved_owner is not None else self._saved_owner()
        self.free = [a for a, s in enumerate(self.mesh.sizes) if s > 1 and a != self.dp_axis]
        # memos of pure functions of this builder's settings
        self._degrees: dict[Placements, int] = {}
        self._names: dict[tuple[Placements, int], str] = {}
        self._converts: dict[tuple[Placements, Placements, float], float] = {}
        self._terms: dict[tuple, _ParamTerms] = {}
        self._out_bytes: dict[str, float] = {}
        self._tensor_bytes: dict[str, float] = {}

    # ---- shapes ---------------------------------------------------------------
    def meta(self, name: str) -> TensorMeta | None:
        """Output metadata of node ``name`` at the micro-batch size."""
        if name not in self._metas:
            self._metas[name] = self._meta(name)
        return self._metas[name]

    def _meta(self, name: str) -> TensorMeta | None:
        m = self.node(name).out
        bd = self.an.batch_dim.get(name)
        if m is None or bd is None or bd >= len(m.shape):
            return m
        shape = list(m.shape)
        shape[bd] = max(1, round(shape[bd] * self.factor))
        return TensorMeta(tuple(shape), m.dtype)

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
            found = self._tensor_bytes[name] = self._tensor_bytes_of(name)
        return found

    def _tensor_bytes_of(self, name: str) -> float:
        """:meth:`tensor_bytes`, not memoized."""
        n, m = self.node(name), self.meta(name)
        if m is not None and m.dtype == "float32" and n.target.startswith(
                ("aten.to.", "aten._to_copy.")):
            return m.numel * 4.0
        return self.nbytes(m)

    def scaled(self, n: OpNode) -> float:
        """Batch factor of an op's work (1 for ops that see no batch dim)."""
        touches = self.an.batch_dim.get(n.name) is not None or any(
            self.an.batch_dim.get(i) is not None for i in n.inputs)
        return self.factor if touches else 1.0

    # ---- enumeration ------------------------------------------------------------
    def assignments(self, n: OpNode, rule: OpRule) -> list[tuple[str | None, ...]]:
        """Every legal label-per-axis assignment of op ``n``."""
        labels = _choices(rule)
        per_axis: list[list[str | None]] = []
        for a, size in enumerate(self.mesh.sizes):
            if size == 1:
                per_axis.append([None])
            elif a == self.dp_axis:
                per_axis.append([self.an.batch_label.get(n.name)])
            elif rule.kind in ("creation", "constant") or n.name == self.g.loss:
                per_axis.append([None])  # the loss is computed whole on every tp rank
            else:
                per_axis.append([None] + labels)
        result = []
        for combo in itertools.product(*per_axis):
            if self._divisible(n, rule, combo):
                result.append(combo)
        return result

    def _divisible(self, n: OpNode, rule: OpRule, combo) -> bool:
        """Every dim a combo splits divides evenly (each piece, for a piecewise split),
        and a label split piecewise is split over one axis only."""
        degree: dict[str, int] = {}
        pieces: dict[str, int] = {}
        axes: dict[str, int] = {}
        for choice, size in zip(combo, self.mesh.sizes):
            if choice is not None:
                lab, k = split_label(choice)
                degree[lab] = degree.get(lab, 1) * size
                pieces[lab] = max(pieces.get(lab, 1), k)
                axes[lab] = axes.get(lab, 0) + 1
        if not degree:
            return True
        tensors = [(labs, self.meta(i)) for labs, i in zip(rule.ins, n.inputs)
                   if i not in self.an.constants]  # sized by each rank's local shapes
        tensors.append((rule.out, self.meta(n.name)))
        for labs, m in tensors:
            if labs is None or m is None:
                continue
            for label, size in zip(labs, m.shape):
                lab, j = split_label(label)
                if lab not in degree:
                    continue
                k = j * pieces[lab]
                if size % (degree[lab] * k) or (k > 1 and axes[lab] > 1):
                    return False
        return True

    def strategies(self, n: OpNode) -> tuple[list[NodeStrategy], list[StrategyCost]]:
        """All strategies of op ``n`` with their costs."""
        rule = self.an.rules[n.name]
        out_meta = self.meta(n.name)
        nd = len(out_meta.shape) if out_meta is not None else 0
        strategies, costs = [], []
        for combo in self.assignments(n, rule):
            raw = []
            for lab in combo:
                name = split_label(lab)[0] if lab is not None else None
                if lab is None or (name in rule.per_rank and not carries(rule.out, lab)):
                    raw.append("R")  # a per-rank label's output is the rank's own result
                elif carries(rule.out, lab):
                    raw.append(placement_of(rule.out, lab))
                else:
                    raw.append("P")
            raw_t = tuple(raw)
            ins = tuple(_placements(labs, combo) for labs in rule.ins)
            grads = tuple(self._grad(labs, combo, rule, p) for labs, p in zip(rule.ins, ins))
            if not self._sp_allowed(n, rule, ins) or self._local_partial_grad(n, grads):
                continue
            outs = self._deliveries(n, raw_t, nd)
            times = self._times(n, combo, raw_t, ins) if outs else None
            for out in outs:
                ns, sc = self._price(n, rule, times, raw_t, out, ins, grads)
                strategies.append(ns)
                costs.append(sc)
        return strategies, costs

    def _local_partial_grad(self, n: OpNode, grads: tuple[Placements, ...]) -> bool:
        """A partial gradient of a replicated input is reduced where the lowering
        re-lays out, at a module's boundary (priced on the edge); strategies that leave
        one elsewhere are not offered."""
        if n.name in self.an.module_ops or n.name in self.an.output_ops:
            return False
        free = self._free_axes()
        return any(self.node(i).requires_grad and any(g[a] == "P" for a in free)
                   for i, g in zip(n.inputs, grads) if self.node(i).kind != "param")

    def _sp_allowed(self, n: OpNode, rule: OpRule, ins: tuple[Placements, ...]) -> bool:
        """Honour a forced sequence-parallel choice for norms (None = free): a norm op,
        or any op of a norm module written out by hand (a class named ``*Norm``), has
        its activation inputs split on a model-parallel axis exactly when forced on."""
        sp = self.st.sequence_parallel
        in_norm = rule.kind == "norm" or n.module_type.lower().endswith("norm")
        acts = [p for i, p in zip(n.inputs, ins) if p is not None and
                self.node(i).kind != "param" and i not in self.an.constants]
        if sp is None or not in_norm or not acts:
            return True
        split = any(p[a].startswith("S(") for p in acts for a in self._free_axes())
        return split == sp

    def _grad(self, labs, combo, rule: OpRule, place: Placements) -> Placements:
        g = []
        for lab, p in zip(combo, place):
            lacks = not carries(labs, lab)
            g.append("P" if p == "R" and lab is not None and lacks
                     and split_label(lab)[0] not in rule.reduce else p)
        return tuple(g)

    def _deliveries(self, n: OpNode, raw: Placements, nd: int) -> list[Placements]:
        """Output placements a module's output op may hand on (its raw one, converted on
        the free axes); other ops hand on their raw output."""
        if n.name not in self.an.module_ops and n.name not in self.an.output_ops:
            return [raw] if "P" not in [raw[a] for a in self._free_axes()] else []
        opts = []
        m = self.meta(n.name)
        per_axis = []
        for a in range(self.mesh.ndim):
            if a not in self._free_axes():
                per_axis.append([raw[a]])
                continue
            cand = ["R"] + [f"S({d})" for d in range(nd)
                            if m is not None and m.shape[d] % self.mesh.sizes[a] == 0]
            per_axis.append(cand + [raw[a]] if shard_pieces(raw[a]) > 1 else cand)
        for combo in itertools.product(*per_axis):
            if self._shard_counts_ok(combo, m):
                opts.append(tuple(combo))
        return opts

    def _shard_counts_ok(self, pl: Placements, m: TensorMeta | None) -> bool:
        deg: dict[int, int] = {}
        for p, s in zip(pl, self.mesh.sizes):
            d = shard_dim(p)
            if d is not None:
                deg[d] = deg.get(d, 1) * s * shard_pieces(p)
        return m is None or all(m.shape[d] % k == 0 for d, k in deg.items())

    def _free_axes(self) -> list[int]:
        """The model-parallel axes: those of size > 1 other than ``dp``."""
        return self.free

    def degree(self, pl: Placements) -> int:
        """How many pieces placements ``pl`` cut a tensor into on this mesh
        (:func:`~autopar.sharding.shard_count`, memoized)."""
        found = self._degrees.get(pl)
        if found is None:
            found = self._degrees[pl] = shard_count(pl, self.mesh.sizes)
        return found

    def layout(self, pl: Placements, ndim: int) -> str:
        """:func:`~autopar.sharding.layout_name` of ``pl``, memoized."""
        found = self._names.get((pl, ndim))
        if found is None:
            found = self._names[(pl, ndim)] = layout_name(pl, ndim)
        return found

    # ---- pricing ----------------------------------------------------------------
    def convert(self, src: Placements, dst: Placements, nbytes: float) -> float:
        """Seconds to redistribute a tensor of ``nbytes`` (whole) from src to dst: each
        collective's time, plus, where the host is the device (a CPU profile), what
        DTensor's redistribution adds to a collective of its kind
        (:meth:`_redistribute_overhead`, measured on the processes' mesh:
        :func:`autopar.cost_models.profiler_host.redistribute_overhead`)."""
        key = (src, dst, nbytes)
        found = self._converts.get(key)
        if found is None:
            found = self._converts[key] = self._convert(src, dst, nbytes)
        return found

    def _convert(self, src: Placements, dst: Placements, nbytes: float) -> float:
        """:meth:`convert`, not memoized."""
        t = 0.0
        for a, (s, d) in enumerate(zip(src, dst)):
            if s == d:
                continue
            local = nbytes
            for b, p in enumerate(src):
                if b != a and p.startswith("S("):
                    local /= self.mesh.sizes[b]
            n, link = self.mesh.sizes[a], self.links[a]
            if s.startswith("S(") and d == "R":
                kind, size = "all_gather", local
            elif s == "P" and d == "R":
                kind, size = "all_reduce", local
            elif s == "P" and d.startswith("S("):
                kind, size = "reduce_scatter", local
            elif s.startswith("S(") and d.startswith("S("):
                kind, size = "all_to_all", local / n
            elif s.startswith("S(") and d == "P":
                return INF
            else:
                continue  # a local slice or a partial view: no collective
            t += collective_time(kind, size, n, link) + self._redistribute_overhead(kind)
        return t

    def _redistribute_overhead(self, kind: str) -> float:
        """Seconds DTensor adds to a redistribution running one collective of ``kind``
        where the host is the device (CPU profiles; 0 on a GPU, where the host runs
        ahead, or without the figure). An all-to-all counts as an all-gather, which gloo
        runs in its place."""
        hw = self.st.hw
        if hw.host_runs_ahead:
            return 0.0
        dt = "all_gather" if kind == "all_to_all" else kind
        return hw.host_overhead_s.get(f"redistribute_{dt}", 0.0)

    def convert_both(self, src: Placements, dst: Placements, grad_src: Placements,
                     nbytes: float, needs_grad: bool) -> float:
        """Forward conversion plus, when gradients flow, the gradient's way back."""
        t = self.convert(src, dst, nbytes)
        if needs_grad:
            back = tuple("R" if p == "P" else p for p in src)
            t += self.convert(grad_src, back, nbytes)
        return t

    def _times(self, n: OpNode, combo, raw: Placements,
               ins: tuple[Placements, ...]) -> tuple[float, float, float, float]:
        """(forward + backward device, backward device, forward + backward host,
        backward host) seconds of op ``n`` under the label assignment ``combo``: the
        same for every placement its output is handed on in."""
        shard = 1
        for lab, size in zip(combo, self.mesh.sizes):
            if lab is not None:
                shard *= size
        f = self.scaled(n)
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
        fwd = op_time(shapes, flops, nbytes, backward=False, dtype=self.dtype, hw=self.st.hw)
        bwd = 0.0
        if n.requires_grad and (flops or nbytes):
            ff, bf = backward_factors(n.target)
            if ff or bf:
                bwd = op_time(shapes, flops * ff, nbytes * bf, backward=True,
                              dtype=self.dtype, hw=self.st.hw)
        host_f, host_b = self._op_host(n, ins)
        if not self.st.hw.host_runs_ahead:  # on a CPU the host is the device
            fwd, bwd, host_f, host_b = fwd + host_f, bwd + host_b, 0.0, 0.0
        return fwd + bwd, bwd, host_f + host_b, host_b

    def _price(self, n: OpNode, rule: OpRule, times: tuple[float, float, float, float],
               raw: Placements, out: Placements, ins: tuple[Placements, ...],
               grads: tuple[Placements, ...]) -> tuple[NodeStrategy, StrategyCost]:
        """One strategy of op ``n``: its device and host ``times`` (:meth:`_times`), and
        the costs of its output's placements and of the parameters it owns."""
        device, bwd, host, host_b = times
        terms = self.param_terms(n, ins, grads)
        memory = self._memory(n, terms, self._activations(n, ins, out))
        comm = self._output_comm(n, raw, out) + terms.tp
        name = f"{self.layout(out, len(rule.out))} = " + " x ".join(
            self.layout(p, len(labs) if labs else 0) for p, labs in zip(ins, rule.ins))
        if out != raw:
            name += f"  [{self.layout(raw, len(rule.out))} -> {self.layout(out, len(rule.out))}]"
        ns = NodeStrategy(name, out, raw, ins, grads, memory)
        sc = StrategyCost(name, device, bwd, comm, terms.micro,
                          terms.step, sum(memory.values()), terms.gather, terms.optimizer_s,
                          self._loss_gradient(n, ins), param_copy_s=terms.copy_f + terms.copy_b,
                          param_copy_bwd_s=terms.copy_b, host_s=host,
                          host_bwd_s=host_b, param_host_s=terms.host,
                          param_host_bwd_s=terms.host_bwd, host_step_s=terms.host_step)
        return ns, sc

    def param_terms(self, n: OpNode, ins: tuple[Placements, ...],
                    grads: tuple[Placements, ...]) -> _ParamTerms:
        """The costs of the parameters op ``n`` owns under input placements ``ins`` and
        gradient placements ``grads`` (:class:`_ParamTerms`), worked out once per
        placement of those parameters: the strategies of an op share a few."""
        owned = self.facts.owned(n)
        key = (n.name, tuple((ins[p.pos], grads[p.pos]) for p in owned))
        found = self._terms.get(key)
        if found is None:
            found = self._terms[key] = self._param_terms(n, ins, grads)
        return found

    def _param_terms(self, n: OpNode, ins, grads) -> _ParamTerms:
        """:meth:`param_terms`, not memoized."""
        params, grads_b, optimizer, gathered = self._param_memory(n, ins)
        micro, step, tp, gather = self._param_costs(n, ins, grads)
        copy_f, copy_b = self._param_copies(n, ins)
        host, host_bwd, host_step = self._param_host(n, ins)
        return _ParamTerms(params, grads_b, optimizer, gathered, micro, step, tp, gather,
                           self._optimizer_step(n, ins), copy_f, copy_b, host, host_bwd,
                           host_step)

    def _output_comm(self, n: OpNode, raw: Placements, out: Placements) -> float:
        """Seconds per micro-batch to convert op ``n``'s output from the placement its
        rule produces (``raw``) to the one it hands on (``out``), forward and, when
        gradients flow, backward."""
        if out == raw:
            return 0.0
        return self.convert_both(raw, out, out, self.out_bytes(n.name),
                                 n.requires_grad)

    def _op_host(self, n: OpNode, ins) -> tuple[float, float]:
        """(forward, backward) host seconds of op ``n`` under input placements ``ins``:
        its dispatch (:func:`~autopar.cost_models.host.op_host_time`, GPU profiles) and
        what DTensor adds (:meth:`_dtensor_host`)."""
        dt_f, dt_b = self._dtensor_host(n, ins)
        op_f, op_b = op_host_time(self.st.hw, n.target, n.flops, n.bytes, n.requires_grad)
        return op_f + dt_f, op_b + dt_b

    def _param_host(self, n: OpNode, ins) -> tuple[float, float, float]:
        """Host seconds of the parameters op ``n`` owns, on a GPU profile
        (:mod:`autopar.cost_models.host`): FSDP2's hooks per micro-batch (forward +
        backward, and the backward's part) where FSDP2 lays them out, and the optimizer
        step's dispatch per step (on DTensors under FSDP2 or tensor parallelism; under
        CPU offload too, beside the host step's arithmetic in ``optimizer_s``)."""
        st = self.st
        count = sum(1 for p in self.facts.owned(n) if p.trainable)
        if not count:
            return 0.0, 0.0, 0.0
        fsdp = fsdp_lays_out(st.precision, self.dp, st.offload)
        f, b = fsdp_host_time(st.hw, count) if fsdp else (0.0, 0.0)
        step = optimizer_host_time(st.hw, count, fsdp or bool(self._free_axes()))
        return f + b, b, step

    def _dtensor_host(self, n: OpNode, ins) -> tuple[float, float]:
        """(forward, backward) host seconds DTensor adds to op ``n`` under input
        placements ``ins``: a matrix product (or embedding) whose parameter is split over
        a non-dp axis runs as a tensor-parallel Linear, a norm whose input is split so
        runs as a sequence-parallel one, and with a model-parallel axis every other op
        but those computed from shapes runs on DTensors too (figure ``dtensor_op``)
        (:attr:`HardwareProfile.host_overhead_s`; 0 where the profile has no figure). On a CPU it adds to the op's time (the host is the
        device); on a GPU it is host time beside the device's (:meth:`_op_host`)."""
        over = self.st.hw.host_overhead_s
        free = self._free_axes()
        if not over or not free:
            return 0.0, 0.0
        kinds = self.facts.input_kinds(n)

        def split(pl: Placements) -> bool:
            return any(pl[a].startswith("S(") for a in free)
        kind = None
        if (is_matmul(n.target) or n.target.endswith(("embedding", "embedding.default"))) and \
                any(k == "param" and split(p) for k, p in zip(kinds, ins)):
            kind = "linear"
        elif is_norm(n.target) and ins and kinds[0] != "param" and split(ins[0]):
            kind = "norm"
        elif n.name not in self.an.constants:
            kind = "dtensor_op"
        if kind is None:
            return 0.0, 0.0
        return (over.get(f"{kind}_fwd", 0.0),
                over.get(f"{kind}_bwd", 0.0) if n.requires_grad else 0.0)

    def _memory(self, n: OpNode, terms: _ParamTerms, activations: float) -> dict[str, float]:
        """Bytes per device by category of op ``n``: the parameter terms ``terms`` of its
        placements and the ``activations`` it saves."""
        mem = {"params": terms.params, "grads": terms.grads, "optimizer": terms.optimizer,
               "activations": activations}
        if terms.gathered is not None:
            mem["gathered"] = terms.gathered
        return mem

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

    def _param_memory(self, n: OpNode, ins) -> tuple[float, float, float, float | None]:
        """(parameter, gradient, optimizer, gathered or None) bytes per device of the
        parameters op ``n`` owns under input placements ``ins``."""
        params = grads = optimizer = 0.0
        gathered: float | None = None
        pb = self.pbytes
        for p in self.facts.owned(n):
            numel = p.numel / self.degree(ins[p.pos])
            if not p.trainable:
                params += numel * p.nbytes / max(p.numel, 1)
                continue
            params += numel * pb.param
            if self.st.num_microbatches > 1:  # gradients outlive the forward (module doc)
                grads += numel * pb.grad
            optimizer += numel * pb.optimizer
            if pb.gathered_all:
                gathered = (gathered or 0.0) + numel * pb.gathered
        return params, grads, optimizer, gathered

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

    def _own_params(self, n: OpNode, ins) -> list[float]:
        """Local element counts of the trainable parameters op ``n`` owns."""
        return [p.numel / self.degree(ins[p.pos]) for p in self.facts.owned(n) if p.trainable]

    def _optimizer_step(self, n: OpNode, ins) -> float:
        """Seconds per step of the optimizer step on the parameters op ``n`` owns: on
        the host under CPU offload, else on the device, over the ZeRO shard
        (:mod:`autopar.cost_models.param_work`)."""
        st = self.st
        step = host_step_time if st.offload else device_step_time
        return sum(step(local / self.shard, st.optimizer, st.hw)
                   for local in self._own_params(n, ins))

    def _param_copies(self, n: OpNode, ins) -> tuple[float, float]:
        """(forward, backward) seconds per micro-batch of FSDP2's copies of the
        parameters op ``n`` owns, where FSDP2 lays the model out (data parallelism, low
        precision or offload: :func:`~autopar.cost_models.memory.fsdp_lays_out`)."""
        st = self.st
        if not fsdp_lays_out(st.precision, self.dp, st.offload):
            return 0.0, 0.0
        fwd = bwd = 0.0
        for local in self._own_params(n, ins):
            f, b = fsdp_copy_time(local, self.act_elt, self.shard, st.zero,
                                  st.num_microbatches, st.hw)
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
        if fsdp_lays_out(st.precision, self.dp, st.offload):
            return bucketed_time("all_reduce", grad_bytes, n, link, share)
        one = collective_time("all_reduce", grad_bytes, n, link) + \
            self._redistribute_overhead("all_reduce")
        return one / st.num_microbatches

    def _param_costs(self, n: OpNode, ins, grads) -> tuple[float, float, float, float]:
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
        gathered once per micro-batch, where a block is gathered twice."""
        micro = step = tp = gather = 0.0
        n_micro = max(1, self.st.num_microbatches)
        dpa = self.dp_axis
        for p in self.facts.owned(n):
            if not p.trainable:
                continue
            local = p.numel / self.degree(ins[p.pos])
            share = p.share
            for a in self.free:
                if grads[p.pos][a] == "P":
                    tp += self._partial_grad_time(local * 4.0, a, share)
            if dpa is None or self.mesh.sizes[dpa] == 1:
                continue
            dpn, link = self.mesh.sizes[dpa], self.links[dpa]
            grad_bytes = local * 4.0  # gradients are reduced in fp32 (MixedPrecisionPolicy)
            w = local * self.pbytes.gathered if self.pbytes.gathered else local * 4.0
            root = p.root
            if self.st.zero == 0:
                t = bucketed_time("all_reduce", grad_bytes, dpn, link, share)
                if root:
                    tp += t / n_micro
                else:
                    step += t
                continue
            gathers = 2 if self.st.zero == 3 and not root else 1
            t = gathers * bucketed_time("all_gather", w, dpn, link, share) + \
                bucketed_time("reduce_scatter", grad_bytes, dpn, link, share)
            if root:
                tp += t
            else:
                micro += t
            if self.st.zero == 3:
                gather += w
                if self.st.offload:
                    micro += offload_transfer_time(local / dpn, self.st.hw)
        return micro, step, tp, gather

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


def build_problem(an: GraphAnalysis, st: Settings, cache: dict | None = None) -> Built:
    """Build the solver problem for graph analysis ``an`` under settings ``st``.

    ``cache`` (a dict the caller owns for one search) keeps each built problem under
    the settings its layouts depend on (:func:`layout_key`); a later call that differs
    only in ZeRO stage, micro-batch count, offload, optimizer or budget reprices just
    the parameter terms (:func:`_reprice`) and shares the rest. It also keeps the
    graph's facts that no setting changes (``"saved_owner"``, ``"facts"``,
    ``"edge_counts"``)."""
    b = _Builder(an, st, cache.get("saved_owner") if cache is not None else None,
                 cache.get("facts") if cache is not None else None)
    if cache is not None:  # the graph's, the same for every layout
        cache["saved_owner"] = b.saved_owner
        cache["facts"] = b.facts
    key = layout_key(st)
    if cache is not None and key in cache:
        return _reprice(b, cache[key])
    built = _build(b, cache)
    if cache is not None:
        cache[key] = built
    return built


def layout_key(st: Settings) -> tuple:
    """What a problem's strategies, compute and activation costs, edges, ties and
    recomputation groups depend on: everything in ``st`` but the ZeRO stage, the
    micro-batch count, offload, the optimizer, the memory budget and the size of the
    data-parallel axis beyond 1 or more than 1. (The ``dp`` axis only splits the batch:
    every device keeps ``microbatch_size`` samples whatever its size, so local shapes,
    compute and the collectives of the other axes, whose groups are the innermost
    ranks, do not change; what does — parameter communication over ``dp`` and the
    sharded parameter memory — is repriced.)"""
    sizes = tuple(min(n, 2) if name == "dp" else n
                  for name, n in zip(st.mesh.names, st.mesh.sizes))
    return (st.mesh.names, sizes, st.microbatch_size, st.precision, id(st.hw),
            st.gpus_per_node, st.overlap, st.sequence_parallel, st.recompute_modes)


def _reprice(b: _Builder, base: Built) -> Built:
    """``base`` (built under the same :func:`layout_key`) with the terms that depend on
    the ZeRO stage, micro-batch count, offload and optimizer priced for ``b.st``:
    each strategy's parameter, gradient and optimizer memory, its parameter
    communication (the reduction of its partial gradients over tp included: once per
    step without FSDP2, so its share of a micro-batch follows the count) and its
    optimizer step."""
    nodes, details = [], []
    for nc, ds, name in zip(base.problem.nodes, base.strategies, base.names):
        n = b.node(name)
        if n.kind != "op" or not b.facts.owned(n):
            nodes.append(nc)  # owns no parameter: nothing to reprice
            details.append(ds)
            continue
        repriced = [_reprice_one(b, n, ns, sc) for sc, ns in zip(nc.strategies, ds)]
        nodes.append(replace(nc, strategies=[sc for _, sc in repriced]))
        details.append([ns for ns, _ in repriced])
    st = b.st
    prob = replace(base.problem, nodes=nodes, num_microbatches=st.num_microbatches,
                   memory_budget=st.memory_budget, overlap=st.overlap)
    return Built(prob, base.names, details, st)


def _reprice_one(b: _Builder, n: OpNode, ns: NodeStrategy,
                 sc: StrategyCost) -> tuple[NodeStrategy, StrategyCost]:
    """Strategy ``ns`` of op ``n`` with its cost ``sc`` repriced (:func:`_reprice`)."""
    terms = b.param_terms(n, ns.ins, ns.grads)
    mem = b._memory(n, terms, ns.memory.get("activations", 0.0))
    comm = b._output_comm(n, ns.raw_out, ns.out) + terms.tp + \
        grad_sum_time(b, n.name, ns.out, ns.grad_sum)
    strategy = NodeStrategy(ns.name, ns.out, ns.raw_out, ns.ins, ns.grads, mem, ns.grad_sum)
    cost = StrategyCost(
        name=sc.name, compute_s=sc.compute_s, bwd_compute_s=sc.bwd_compute_s, comm_s=comm,
        micro_param_comm_s=terms.micro, step_param_comm_s=terms.step,
        memory_bytes=sum(mem.values()), gather_bytes=terms.gather,
        optimizer_s=terms.optimizer_s, backward_start_bytes=sc.backward_start_bytes,
        recompute_bytes=sc.recompute_bytes, param_copy_s=terms.copy_f + terms.copy_b,
        param_copy_bwd_s=terms.copy_b, host_s=sc.host_s, host_bwd_s=sc.host_bwd_s,
        param_host_s=terms.host, param_host_bwd_s=terms.host_bwd,
        host_step_s=terms.host_step)
    return strategy, cost


def _build(b: _Builder, cache: dict | None = None) -> Built:
    """Enumerate and price every canonical node's strategies, the edges, the ties and
    the recomputation groups."""
    an, st = b.an, b.st
    g = an.graph
    canon = g.canonical
    index: dict[str, int] = {}
    nodes: list[NodeChoice] = []
    details: list[list[NodeStrategy]] = []
    names: list[str] = []
    for n in g.nodes:
        if n.kind not in ("op", "input") or canon.get(n.name, n.name) != n.name:
            continue
        if n.kind == "input":
            pl = tuple("S(0)" if a == b.dp_axis and an.batch_dim.get(n.name) == 0
                       and st.mesh.sizes[a] > 1 else "R" for a in range(st.mesh.ndim))
            ns = [NodeStrategy(b.layout(pl, len(n.out.shape) if n.out else 0), pl, pl, (), ())]
            sc = [StrategyCost(ns[0].name)]
        else:
            ns, sc = b.strategies(n)
        if not sc:
            raise NoFeasiblePlanError(f"operator {n.target} in '{n.module_path}' has no "
                                      f"strategy on mesh {st.mesh.as_dict()}")
        index[n.name] = len(nodes)
        layer = n.layer is not None
        nodes.append(NodeChoice(n.name, sc, an.multiplicity.get(n.name, 1),
                                2 if layer else 1))
        details.append(ns)
        names.append(n.name)
    if cache is not None and "edge_counts" in cache:
        counts = cache["edge_counts"]
    else:
        counts = edge_counts(g, index)
        if cache is not None:  # the graph's, the same for every layout
            cache["edge_counts"] = counts
    add_gradient_sums(b, counts, names, details, nodes)
    edges = _edges(b, counts, details, names)
    ties = _ties(b, index, details)
    groups = recompute_groups(b, index, details, [nc.strategies for nc in nodes])
    prob = Problem(nodes, edges, ties, st.num_microbatches, st.memory_budget, 0.0, st.overlap,
                   groups)
    return Built(prob, names, details, st)


def edge_counts(g, index: dict[str, int]) -> dict[tuple[int, int, int], int]:
    """(producer, consumer, input position) of canonical nodes (positions in ``index``)
    -> how many graph edges the pair stands for."""
    canon = g.canonical
    counts: dict[tuple[int, int, int], int] = {}
    for n in g.nodes:
        if n.kind != "op":
            continue
        v = index[canon.get(n.name, n.name)]
        for pos, i in enumerate(n.inputs):
            if g.node(i).kind == "param":
                continue
            u = index[canon.get(i, i)]
            counts[(u, v, pos)] = counts.get((u, v, pos), 0) + 1
    return counts


def _edges(b: _Builder, counts: dict[tuple[int, int, int], int], details,
           names: list[str]) -> list[EdgeChoice]:
    an = b.an
    edges = []
    free = b._free_axes()
    for (u, v, pos), mult in counts.items():
        un, vn = b.node(names[u]), b.node(names[v])
        module_consumer = vn.name in an.module_ops
        nbytes = b.out_bytes(un.name)
        # strategies grouped by what the edge sees of them: the producer's output, the
        # consumer's input and gradient placements; each pair of groups is priced once
        sums = any(su.grad_sum for su in details[u])
        outs: dict[tuple[Placements, tuple[int, ...]], list[int]] = {}
        for i, su in enumerate(details[u]):
            outs.setdefault((su.out, su.grad_sum), []).append(i)
        needs: dict[tuple[Placements, Placements], list[int]] = {}
        for j, sv in enumerate(details[v]):
            needs.setdefault((sv.ins[pos], sv.grads[pos]), []).append(j)
        pairs: list[tuple[list[int], list[int], float]] = []
        # a constant is computed on each rank from its local shapes: it is whatever the
        # consumer needs on the data-parallel axis
        fixed = [a for a in range(b.mesh.ndim) if a not in free
                 and not (un.name in an.constants and a == b.dp_axis)]
        axes = free + fixed
        for (out, summed), ii in outs.items():
            for (need, grad), jj in needs.items():
                if any(out[a] != need[a] for a in fixed):
                    continue
                if all(out[a] == need[a] for a in axes):
                    # no forward collective, but a gradient that comes back partial over
                    # a tensor-parallel axis (a column-wise Linear's replicated input) is
                    # all-reduced at the module boundary; partial over data parallelism,
                    # it is a parameter's, reduced with the parameter gradients
                    back = edge_backward(tuple(grad[a] if a in free else "R" if p == "P" else p
                                               for a, p in enumerate(out)), out,
                                         summed if sums else None, free)
                    if back is None:
                        continue
                    pairs.append((ii, jj, b.convert_both(out, need, back, nbytes,
                                                         un.requires_grad)))
                elif module_consumer:
                    c = b.convert_both(out, need, grad, nbytes, un.requires_grad)
                    if c != INF:
                        pairs.append((ii, jj, c))
        cost = {(i, j): c for ii, jj, c in pairs for i in ii for j in jj}
        edges.append(EdgeChoice(u, v, dict(sorted(cost.items())), mult))
    return edges


def _ties(b: _Builder, index: dict[str, int], details) -> list[Tie]:
    """Ops that read the same parameter must agree on its placement."""
    ties = []
    canon = b.g.canonical
    for p, users in b.an.param_consumers.items():
        first = users[0]
        a = index[canon.get(first[0], first[0])]
        for other in users[1:]:
            c = index[canon.get(other[0], other[0])]
            if c == a and other[1] == first[1]:
                continue
            keys = sorted({s.ins[first[1]] for s in details[a]} |
                          {s.ins[other[1]] for s in details[c]})
            ga = [[i for i, s in enumerate(details[a]) if s.ins[first[1]] == k] for k in keys]
            gb = [[j for j, s in enumerate(details[c]) if s.ins[other[1]] == k] for k in keys]
            ties.append(Tie(a, c, ga, gb))
    return ties
