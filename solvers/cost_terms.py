"""The cost records the solvers share: :class:`PieceCost`, what a piece of the model (a
pipeline unit, a stage) costs per micro-batch and per step, and :class:`StepTerms`, a
predicted step time by term, which the plan's breakdown, its summary and ``compare``
read. The terms sum to the step (:attr:`StepTerms.step_time_s`); the flat formula is
:func:`autopar.solvers.problem.evaluate`'s, the pipelined one
:func:`autopar.solvers.pipelined_candidate.pipeline_terms`'."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields


@dataclass
class PieceCost:
    """What one piece of the model costs on one device (seconds, bytes).

    Per micro-batch: ``forward_s``; ``backward_s``, the whole backward (recomputed
    forwards and ZeRO-3 traffic included) of which ``backward_weight_s`` is the
    weight-grad part that zero-bubble schedules run apart; ``comm_s`` (activation
    collectives and resharding), ``param_comm_s`` (ZeRO-3 traffic) and ``recompute_s``
    (recomputed forwards) are parts of ``forward_s + backward_s``, and ``all_to_all_s``
    (tokens to their experts and back) part of ``comm_s``; ``host_s`` is the
    host's seconds issuing that work. ``activation_bytes`` are kept for backward per
    micro-batch in flight; ``static_bytes`` are parameters, gradients and optimizer
    state. Per step: ``step_comm_s`` (data-parallel gradient synchronization),
    ``optimizer_s`` and ``host_step_s`` (the host's share of the optimizer step)."""

    forward_s: float = 0.0
    backward_s: float = 0.0
    backward_weight_s: float = 0.0
    activation_bytes: float = 0.0
    static_bytes: float = 0.0
    step_comm_s: float = 0.0
    optimizer_s: float = 0.0
    host_s: float = 0.0
    host_step_s: float = 0.0
    comm_s: float = 0.0
    param_comm_s: float = 0.0
    recompute_s: float = 0.0
    all_to_all_s: float = 0.0
    name: str = ""

    @property
    def compute_s(self) -> float:
        """Forward + backward seconds of computation per micro-batch, without the
        recomputed forwards and the communication."""
        return self.forward_s + self.backward_s - self.recompute_s - self.comm_s - \
            self.param_comm_s

    def host_per_step(self, num_microbatches: int) -> float:
        """The host's seconds per step: every micro-batch's and the optimizer's."""
        return num_microbatches * self.host_s + self.host_step_s

    @classmethod
    def total(cls, parts: list["PieceCost"], name: str = "") -> "PieceCost":
        """The cost of ``parts`` run as one piece (every field summed)."""
        out = cls(name=name)
        for f in _NUMBERS:
            setattr(out, f, sum(getattr(p, f) for p in parts))
        return out


_NUMBERS = tuple(f.name for f in fields(PieceCost) if f.name != "name")


STEP_TERMS = ("compute_s", "recompute_s", "exposed_comm_s", "bubble_s", "optimizer_s",
              "exposed_host_s")
"""The names of the terms of :class:`StepTerms` that add up to the step time, in order."""


@dataclass(frozen=True)
class StepTerms:
    """A predicted step time by term (seconds); the first six add up to the step:

        step_time_s = compute_s + recompute_s + exposed_comm_s + bubble_s
                      + optimizer_s + exposed_host_s

    On a pipeline they are the busiest rank's (the rank with the most busy time):

    * ``compute_s``: forward + backward without recomputation, FSDP2's copies of the
      parameters included (:mod:`autopar.cost_models.param_work`);
    * ``recompute_s``: the forwards recomputed in backward;
    * ``exposed_comm_s``: communication on the critical path: activation collectives
      and resharding (``comm_s``), the parameter traffic compute does not hide
      (``exposed_param_comm_s``; on a pipeline the ZeRO-3 traffic, which the unit
      costs charge in full, and the gradient synchronization after the last
      backward) and on a pipeline the stage-to-stage transfers' share of the makespan
      (``exposed_p2p_s``);
    * ``bubble_s``: the busiest rank's idle time in the schedule with free transfers;
    * ``optimizer_s``: the optimizer step (on the host under CPU offload);
    * ``exposed_host_s``: the time the device waits for the host to issue its work
      (``host_s``: the step's host seconds).

    The other fields detail these (None where they do not apply: ``reshard_s``,
    ``param_comm_s`` and ``host_s`` on a pipeline; ``exposed_p2p_s`` and ``p2p_s``, the
    seconds of one stage-to-stage transfer, without one; ``all_to_all_s``, the part of
    ``comm_s`` that moves tokens to their experts and back, without expert
    parallelism); they are not added again."""

    compute_s: float
    recompute_s: float
    exposed_comm_s: float
    bubble_s: float
    optimizer_s: float
    exposed_host_s: float
    comm_s: float
    exposed_param_comm_s: float
    reshard_s: float | None = None
    param_comm_s: float | None = None
    host_s: float | None = None
    exposed_p2p_s: float | None = None
    p2p_s: float | None = None
    all_to_all_s: float | None = None

    @property
    def step_time_s(self) -> float:
        """The sum of the six terms (:data:`STEP_TERMS`)."""
        return sum(getattr(self, k) for k in STEP_TERMS)

    def as_dict(self) -> dict[str, float]:
        """The terms that apply, by name (a plan's ``breakdown``)."""
        return {k: v for k, v in asdict(self).items() if v is not None}
