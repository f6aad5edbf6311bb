"""What each activation-recomputation mode keeps and runs again, for one strategy of one
node of a repeated layer (per micro-batch and layer instance; bytes per device, s).

:func:`mode_costs` gives one strategy's row (:class:`ModeCosts`) of every mode of
:data:`autopar.memory_choices.RECOMPUTE`: the seconds re-run in backward, the kept and
transient bytes and the host seconds; :func:`rerun_reach` how far the layer's forward
runs again and :func:`edge_extra` what an edge's conversion into it adds;
:mod:`autopar.solvers.problem` adds them to the step.

The kept bytes K per mode, ``act_delta`` and ``transient``, what is re-run and the
host's part: docs/cost_models.md, section ``autopar.cost_models.recompute_price``.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.cost_models.host import checkpoint_host_time
from autopar.cost_models.memory import saved_for_backward
from autopar.cost_models.strategy_price import OpTerms, StrategyPricer
from autopar.flops import op_name
from autopar.memory_choices import RECOMPUTE, SELECTIVE_SAVE_OPS
from autopar.strategies.enumeration import NodeStrategy

RUNS, STOPS, SKIPPED = "runs", "stops", "skipped"
"""How far a recomputed layer's forward runs again for one of its nodes
(:func:`rerun_reach`)."""


@dataclass
class ModeCosts:
    """One strategy's row of each :class:`~autopar.solvers.problem.RecomputeGroup`
    table, a value per mode of :data:`autopar.memory_choices.RECOMPUTE`."""

    extra_s: list[float]
    act_delta: list[float]
    transient: list[float]
    host_fwd_s: list[float]
    host_bwd_s: list[float]

    def any(self) -> bool:
        """Whether some mode changes something (else the node is left out of its group)."""
        return any(v for row in (self.extra_s, self.act_delta, self.host_fwd_s,
                                 self.host_bwd_s) for v in row)


def rerun_reach(p: StrategyPricer, names: list[str]) -> dict[str, str]:
    """Node -> how far the recomputation of the layer of ``names`` (in graph order)
    reaches it: torch's non-reentrant checkpoint stops re-running the forward once the
    last tensor the forward saved is saved again (its default early stop), so the
    last node that saves a tensor "stops" the recomputation (autograd saves its inputs
    before it runs), the nodes before it "runs" and those after it are "skipped"."""
    savers = [k for k, name in enumerate(names) if _saves(p, name)]
    last = savers[-1] if savers else -1
    return {name: RUNS if k < last else STOPS if k == last else SKIPPED
            for k, name in enumerate(names)}


def _saves(p: StrategyPricer, name: str) -> bool:
    """Whether op ``name`` saves a tensor (an activation or a parameter) for backward; a
    dropout of p = 0 or outside training returns its input and saves nothing (ATen's
    ``dropout``)."""
    n = p.node(name)
    if n.kind != "op" or not n.requires_grad:
        return False
    args = n.args
    if op_name(n.target) == "dropout" and len(args) >= 3 and (args[1] == 0 or not args[2]):
        return False
    return bool(saved_for_backward(n.target, len(n.inputs)))


def _saves_output(p: StrategyPricer, name: str) -> bool:
    """Whether op ``name`` saves its own output (so it runs before the save)."""
    n = p.node(name)
    return -1 in saved_for_backward(n.target, len(n.inputs))


def edge_extra(reach: str, forward_s: float) -> list[float]:
    """The seconds an edge's forward conversion ``forward_s`` into a node of a recomputed
    layer is run again in backward under each mode of
    :data:`autopar.memory_choices.RECOMPUTE`, the consumer reached as ``reach`` says: a
    conversion runs at its consumer's module boundary (the lowering's input hook, inside
    the checkpointed block and before the consumer saves its inputs), so every mode but
    none runs it again unless the recomputation stops before the consumer."""
    again = forward_s if reach != SKIPPED else 0.0
    return [0.0 if m == "none" else again for m in RECOMPUTE]


def mode_costs(p: StrategyPricer, name: str, ns: NodeStrategy, op: OpTerms,
               inputs: list[tuple[int, str]], host: bool, reach: str = RUNS) -> ModeCosts:
    """The costs of every mode for node ``name`` under strategy ``ns`` with its own terms
    ``op``; ``inputs`` are the (input position, input name) of the block inputs charged
    to it; ``host`` whether the profile charges host time; ``reach`` how far the
    recomputation re-runs the layer (:func:`rerun_reach`)."""
    base = op.activations
    kept = [_kept(p, name, ns, m, inputs, base) for m in RECOMPUTE]
    hosts = [_host(p, name, op, m, reach) if host else (0.0, 0.0) for m in RECOMPUTE]
    return ModeCosts([_extra(p, name, ns, op, m, reach) for m in RECOMPUTE],
                     [x - base for x in kept], [base - x for x in kept],
                     [f for f, _ in hosts], [h for _, h in hosts])


def _kept(p: StrategyPricer, name: str, ns: NodeStrategy, mode: str,
          inputs: list[tuple[int, str]], saved: float) -> float:
    """K_mode of node ``name`` under strategy ``ns`` (docs/cost_models.md, section
    ``autopar.cost_models.recompute_price``), bytes per instance; ``saved`` is what
    autograd saves for it."""
    if mode == "none":
        return saved
    n = p.node(name)
    kept = sum(p.tensor_bytes(i) / p.degree(ns.ins[pos]) for pos, i in inputs)
    if mode == "selective" and n.requires_grad:
        if op_name(n.target) in SELECTIVE_SAVE_OPS:
            kept += p.tensor_bytes(name) / p.degree(ns.raw_out)
        if ns.out != ns.raw_out:  # a kept collective of its output's conversion
            kept += p.kept_collectives(ns.raw_out, ns.out, p.out_bytes(name))[1]
    return kept


def _extra(p: StrategyPricer, name: str, ns: NodeStrategy, op: OpTerms, mode: str,
           reach: str) -> float:
    """Forward seconds re-run in backward under ``mode`` (docs/cost_models.md,
    section ``autopar.cost_models.recompute_price``): the op's forward and its output's
    forward conversion (not the reduction of its parameters' gradients), as far as the
    recomputation ``reach``es the node; on a CPU under ``selective``, also what DTensor
    adds to the op in its module that then runs on DTensors, not local tensors."""
    if mode == "none":
        return 0.0
    dtensor = 0.0  # the host is the device: DTensor's seconds of the op's first pass
    if mode == "selective" and not p.st.hw.host_runs_ahead:
        dtensor = op.dtensor_waived[0] + op.dtensor_waived[1]
    if reach == SKIPPED:
        return dtensor
    n = p.node(name)
    fwd = op.compute_s - op.bwd_compute_s + (op.dtensor_waived[0] if dtensor else 0.0)
    if mode == "selective" and op_name(n.target) in SELECTIVE_SAVE_OPS:
        fwd = 0.0
    if reach == STOPS:  # saved before it runs, unless it saves its output
        return dtensor + (fwd if _saves_output(p, name) else 0.0)
    conversion = 0.0
    if ns.out != ns.raw_out:
        conversion = p.convert(ns.raw_out, ns.out, p.out_bytes(name))
        if mode == "selective" and n.requires_grad:  # its kept collectives do not run again
            conversion = max(0.0, conversion - p.kept_collectives(ns.raw_out, ns.out,
                                                                  p.out_bytes(name))[0])
    return dtensor + fwd + conversion


def _host(p: StrategyPricer, name: str, op: OpTerms, mode: str,
          reach: str) -> tuple[float, float]:
    """(forward, backward) host seconds ``mode`` adds to node ``name`` with its own terms
    ``op`` on a GPU profile (docs/cost_models.md, section
    ``autopar.cost_models.recompute_price``); a node the recomputation does not
    ``reach`` is not issued again."""
    n = p.node(name)
    if mode == "none" or n.kind != "op":
        return 0.0, 0.0
    again = op.host_s - op.host_bwd_s  # the op's forward, issued again
    hook_f, hook_b = checkpoint_host_time(p.st.hw, mode)
    saved = mode == "selective" and op_name(n.target) in SELECTIVE_SAVE_OPS
    issued = reach == RUNS or (reach == STOPS and _saves_output(p, name))
    if p.st.compiled and n.layer is not None:  # traced once: no hooks, no dispatch mode
        hook_f = hook_b = 0.0
    elif mode == "selective":  # its dispatch mode sees every aten op; no local tensors
        per = _forward_dispatches(p, name)
        hook_f, hook_b = hook_f * per, hook_b * per
        if p.st.hw.host_runs_ahead:
            hook_f, hook_b = hook_f + op.dtensor_waived[0], hook_b + op.dtensor_waived[1]
            again += op.dtensor_waived[0]
    return hook_f, hook_b + (again if issued and not saved else 0.0)


def _forward_dispatches(p: StrategyPricer, name: str) -> int:
    """The aten ops node ``name``'s forward dispatches (1 where not counted)."""
    d = p.dispatches(name)
    return d.forward_ops if d is not None else 1
