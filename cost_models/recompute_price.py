"""What each activation-recomputation mode keeps and runs again, for one strategy of one
node of a repeated layer (per micro-batch and layer instance; bytes per device, s).

:func:`mode_costs` gives one strategy's row (:class:`ModeCosts`) of every mode of
:data:`autopar.memory_choices.RECOMPUTE`: the seconds re-run in backward, the kept and
transient bytes and the host seconds; :mod:`autopar.solvers.problem` adds them to the
step.

The kept bytes K per mode, ``act_delta`` and ``transient``, what is re-run and the
host's part: docs/cost_models.md, section ``autopar.cost_models.recompute_price``.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.cost_models.host import checkpoint_host_time
from autopar.cost_models.strategy_price import OpTerms, StrategyPricer
from autopar.flops import op_name
from autopar.memory_choices import RECOMPUTE, SELECTIVE_SAVE_OPS
from autopar.strategies.enumeration import NodeStrategy


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


def mode_costs(p: StrategyPricer, name: str, ns: NodeStrategy, op: OpTerms,
               inputs: list[tuple[int, str]], host: bool) -> ModeCosts:
    """The costs of every mode for node ``name`` under strategy ``ns`` with its own terms
    ``op``; ``inputs`` are the (input position, input name) of the block inputs charged
    to it; ``host`` whether the profile charges host time."""
    base = op.activations
    kept = [_kept(p, name, ns, m, inputs, base) for m in RECOMPUTE]
    hosts = [_host(p, name, op, m) if host else (0.0, 0.0) for m in RECOMPUTE]
    return ModeCosts([_extra(p, name, ns, op, m) for m in RECOMPUTE],
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
    if mode == "selective" and n.requires_grad and op_name(n.target) in SELECTIVE_SAVE_OPS:
        kept += p.tensor_bytes(name) / p.degree(ns.raw_out)
    return kept


def _extra(p: StrategyPricer, name: str, ns: NodeStrategy, op: OpTerms, mode: str) -> float:
    """Forward seconds re-run in backward under ``mode`` (docs/cost_models.md,
    section ``autopar.cost_models.recompute_price``): the op's forward and the forward
    half of its output's conversion (not the reduction of its parameters' gradients)."""
    if mode == "none":
        return 0.0
    n = p.node(name)
    fwd = op.compute_s - op.bwd_compute_s
    if mode == "selective" and op_name(n.target) in SELECTIVE_SAVE_OPS:
        fwd = 0.0
    return fwd + p.output_comm(n, ns.raw_out, ns.out) / 2


def _host(p: StrategyPricer, name: str, op: OpTerms, mode: str) -> tuple[float, float]:
    """(forward, backward) host seconds ``mode`` adds to node ``name`` with its own terms
    ``op`` on a GPU profile (docs/cost_models.md, section
    ``autopar.cost_models.recompute_price``)."""
    n = p.node(name)
    if mode == "none" or n.kind != "op":
        return 0.0, 0.0
    again = op.host_s - op.host_bwd_s  # the op's forward, issued again
    hook_f, hook_b = checkpoint_host_time(p.st.hw, mode)
    saved = mode == "selective" and op_name(n.target) in SELECTIVE_SAVE_OPS
    return hook_f, hook_b + (0.0 if saved else again)
