"""Activation recomputation as a solver choice: one :class:`RecomputeGroup` per distinct
repeated layer (the canonical layer that identical blocks share), with what each mode
keeps and what it costs again in backward.

For a canonical op node v of the layer and its strategy i, per micro-batch and per
layer instance (bytes per device, seconds):

* kept bytes ``K_r``:
  - none: what autograd saves (the node's share of ``memory["activations"]``);
  - selective: the node's output when its operator is in
    :data:`autopar.memory_choices.SELECTIVE_SAVE_OPS` (matrix products and attention: the
    selective-checkpoint policy caches them), plus the block input below;
  - full: only the block input: each activation the layer reads from outside it
    (the residual stream), charged to its first reader, sized by the placement that
    reader takes it in (``torch.utils.checkpoint`` saves the block's inputs);
* ``act_delta_r = K_r − K_none`` and ``transient_r = K_none − K_r`` (during its own
  backward, the layer being recomputed holds all its activations again: one layer at
  a time, so counted once, not per instance);
* ``extra_s``: the forward time the mode runs again inside backward: for selective,
  the forward of every op not in the save list; for full, the forward of every op;
  both re-run the forward half of the node's activation collectives (``comm/2``: the
  policy keeps the matrix-product output, not the collective's). Resharding on edges
  inside the layer (zero for the Megatron layouts) is not re-charged.
* host seconds, on a GPU profile (:mod:`autopar.cost_models.host`): full re-issues the
  op's forward in backward (its forward host time) and pays the checkpoint's hooks per
  op in both passes (``ckpt_op_fwd``, ``ckpt_op_bwd``); selective runs every op of the
  block through its dispatch mode in both passes (``sac_op_fwd``, ``sac_op_bwd``) and
  re-issues the forward of the ops it recomputes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autopar.cost_models.host import charges_host, checkpoint_host_time
from autopar.flops import op_name
from autopar.memory_choices import RECOMPUTE, SELECTIVE_SAVE_OPS
from autopar.solvers.problem import RecomputeGroup, StrategyCost

if TYPE_CHECKING:
    from autopar.strategies.build import NodeStrategy, _Builder


def layer_groups(g) -> dict[int, list[str]]:
    """Canonical layer index -> paths of the blocks that share its canonical nodes."""
    out: dict[int, list[str]] = {}
    for lay in g.layers:
        first = next((n for n in lay.nodes if g.node(n).kind == "op"), None)
        if first is None:
            continue
        canon = g.node(g.canonical.get(first, first)).layer
        out.setdefault(canon if canon is not None else lay.index, []).append(lay.path)
    return out


def _block_inputs(b: "_Builder", layer: int, names: list[str]) -> dict[tuple[str, int], str]:
    """(node, input position) -> input name for the first reader of each activation the
    layer reads from outside itself."""
    an = b.an
    inside = set(names)
    seen: set[str] = set()
    out: dict[tuple[str, int], str] = {}
    for name in names:
        n = b.node(name)
        if n.kind != "op":
            continue
        for pos, i in enumerate(n.inputs):
            src = b.node(i)
            if i in inside or i in seen or src.kind == "param" or i in an.constants \
                    or an.batch_dim.get(i) is None:
                continue
            seen.add(i)
            out[(name, pos)] = i
    return out


def _kept(b: "_Builder", name: str, ns: "NodeStrategy", mode: str,
          inputs: list[tuple[int, str]]) -> float:
    """K_mode of node ``name`` under strategy ``ns`` (module docstring), bytes per
    instance; ``inputs`` are the (input position, input name) of the block inputs
    charged to it (:func:`_block_inputs`)."""
    if mode == "none":
        return ns.memory.get("activations", 0.0)
    n = b.node(name)
    kept = sum(b.tensor_bytes(i) / b.degree(ns.ins[pos]) for pos, i in inputs)
    if mode == "selective" and n.requires_grad and op_name(n.target) in SELECTIVE_SAVE_OPS:
        kept += b.tensor_bytes(name) / b.degree(ns.raw_out)
    return kept


def _extra(b: "_Builder", name: str, ns: "NodeStrategy", sc: StrategyCost,
           mode: str) -> float:
    """Forward seconds re-run in backward under ``mode`` (module docstring): the op's
    forward and the forward half of its output's conversion (not the reduction of its
    parameters' gradients, which ``sc.comm_s`` also holds)."""
    if mode == "none":
        return 0.0
    n = b.node(name)
    fwd = sc.compute_s - sc.bwd_compute_s
    if mode == "selective" and op_name(n.target) in SELECTIVE_SAVE_OPS:
        fwd = 0.0
    return fwd + b._output_comm(n, ns.raw_out, ns.out) / 2


def _host(b: "_Builder", name: str, sc: StrategyCost, mode: str) -> tuple[float, float]:
    """(forward, backward) host seconds ``mode`` adds to node ``name`` with strategy
    cost ``sc`` on a GPU profile (module docstring)."""
    n = b.node(name)
    if mode == "none" or n.kind != "op":
        return 0.0, 0.0
    again = sc.host_s - sc.host_bwd_s  # the op's forward, issued again
    hook_f, hook_b = checkpoint_host_time(b.st.hw, mode)
    saved = mode == "selective" and op_name(n.target) in SELECTIVE_SAVE_OPS
    return hook_f, hook_b + (0.0 if saved else again)


def recompute_groups(b: "_Builder", index: dict[str, int], details: list[list["NodeStrategy"]],
                     costs: list[list[StrategyCost]]) -> list[RecomputeGroup]:
    """One group per canonical layer of the graph, over the modes ``b.st.recompute_modes``
    allows (mode indices follow :data:`autopar.memory_choices.RECOMPUTE`)."""
    g = b.g
    allowed = tuple(k for k, m in enumerate(RECOMPUTE) if m in b.st.recompute_modes)
    host = charges_host(b.st.hw)
    groups = []
    for layer, paths in layer_groups(g).items():
        names = [n for n in g.layers[layer].nodes if n in index]
        inputs: dict[str, list[tuple[int, str]]] = {}
        for (v, pos), i in _block_inputs(b, layer, names).items():
            inputs.setdefault(v, []).append((pos, i))
        nodes, extra, delta, trans, h_fwd, h_bwd = [], [], [], [], [], []
        for name in names:
            k = index[name]
            ex_k, de_k, tr_k, hf_k, hb_k = [], [], [], [], []
            own = inputs.get(name, [])
            for ns, sc in zip(details[k], costs[k]):
                base = _kept(b, name, ns, "none", own)
                kept = [_kept(b, name, ns, m, own) for m in RECOMPUTE]
                ex_k.append([_extra(b, name, ns, sc, m) for m in RECOMPUTE])
                de_k.append([x - base for x in kept])
                tr_k.append([base - x for x in kept])
                hosts = [_host(b, name, sc, m) if host else (0.0, 0.0) for m in RECOMPUTE]
                hf_k.append([f for f, _ in hosts])
                hb_k.append([h for _, h in hosts])
            if any(v for row in ex_k + de_k + hf_k + hb_k for v in row):
                nodes.append(k)
                extra.append(ex_k)
                delta.append(de_k)
                trans.append(tr_k)
                h_fwd.append(hf_k)
                h_bwd.append(hb_k)
        if nodes:
            groups.append(RecomputeGroup(",".join(paths), nodes, extra, delta, trans,
                                         RECOMPUTE, allowed,
                                         host_fwd_s=h_fwd if host else [],
                                         host_bwd_s=h_bwd if host else []))
    return groups
