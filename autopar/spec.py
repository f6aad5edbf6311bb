"""One description of a parallel configuration for :func:`autopar.plan`,
:func:`autopar.estimate`, :func:`autopar.compare` and the command line.

A :class:`Spec` names the choices a plan makes. To :func:`autopar.plan` a field left
None is the solver's to choose; :func:`autopar.estimate` scores one configuration and
fills what is left out as :meth:`Spec.for_estimate` says. Each field is checked here,
once, when a Spec is made, so the same mistake gets the same message from every entry
point.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, fields, replace
from typing import Any

from autopar.cost_models.context_parallel import VARIANTS as CP_VARIANTS
from autopar.errors import ConfigError
from autopar.memory_choices import RECOMPUTE
from autopar.plans import SCHEDULES
from autopar.sharding import folded_ep_axis

__all__ = ["Spec", "SEARCH_OPTIONS", "split_space", "check_choice", "default_microbatch"]

SEARCH_OPTIONS = ("time_limit_s", "top_k", "progress", "explain")
"""Keywords of :func:`autopar.plan` that steer the search rather than name a choice."""

COUNTS = ("dp", "tp", "pp", "cp", "ep", "expert_tp", "microbatch_size", "virtual_stages")
"""The fields that are positive integers."""


def check_choice(name: str, value: Any, allowed: tuple[str, ...]) -> Any:
    """``value`` when it is one of ``allowed``; ConfigError otherwise."""
    if value not in allowed:
        raise ConfigError(f"{name}={value!r}: expected one of {', '.join(allowed)}")
    return value


@dataclass(frozen=True, repr=False)
class Spec:
    """A parallel configuration; each field left None is the solver's choice.

    :func:`autopar.plan` searches every field left None (``plan(model, inputs, tp=2)``
    and ``plan(model, inputs, space=Spec(tp=2))`` are the same search).
    :func:`autopar.estimate` scores one configuration: degrees left out are 1, except
    ``dp``, which fills the world, and the rest is filled as :meth:`for_estimate` says.

    Attributes:
        dp, tp, pp: data-, tensor- and pipeline-parallel degrees.
        ep: expert-parallel degree: the experts of each mixture-of-experts layer split
            over ``ep`` ranks, the rest of the model data-parallel over all dp: ranks of
            dp (ep divides dp), or, with ``expert_tp=1``, of dp x tp.
        expert_tp: how many ranks split each expert, Megatron-Core's expert tensor
            parallelism: ``tp`` (the experts split like the rest of the model, the
            solver choosing how) or 1 (each rank holds whole experts, the ep group
            drawn from dp x tp, ``tp`` divides ``ep``: Megatron-Core's MoE parallel
            folding; routed experts only, each tp rank routing its own rows of the
            tokens). None: the solver's choice.
        cp: context-parallel degree: every sequence split over ``cp`` ranks (head-tail
            chunks, so 2·cp divides the sequence), attention bringing the keys by
            ``cp_variant``; the parameters are replicated (or ZeRO-sharded) over dp × cp.
        cp_variant: how attention reaches the other ranks' keys under cp, one of
            "allgather", "ring", "ulysses" (:mod:`autopar.cost_models.context_parallel`).
        microbatch_size: samples per forward/backward pass on one data-parallel rank.
        schedule: the pipeline schedule, one of :data:`autopar.plans.SCHEDULES`.
        virtual_stages: model chunks per pipeline rank (None: 2 for "zbv", the
            solver's choice of 2 to 4 for the interleaved schedules where the model
            has the blocks, else 1).
        recompute: "none", "selective" or "full" on every block (None: chosen per block).
        zero: ZeRO stage 0-3 over ``dp``.
        sequence_parallel: norms and pointwise ops on sequence shards (with ``tp``).
        loss_parallel: the loss computed on logits split along their classes over
            ``tp`` (None: where it pays; :mod:`autopar.strategies.loss_parallel`).
        split_weights: every weight matrix of the repeated blocks split over ``tp``, as
            Megatron-LM's and torchtitan's tensor parallelism split them (None or
            False: the solver's choice, which may spend ``tp`` on the batch or the
            sequence instead).
        offload: parameters, gradients and optimizer state in host memory between uses
            (needs ``zero=3``; None: only when nothing fits without it).
        compile: each repeated block compiled with ``torch.compile`` (plans without a
            pipeline; None: the chosen configuration compiled where that makes it
            faster, on the GPUs where it was measured faster,
            :mod:`autopar.cost_models.compiled`).
    """

    dp: int | None = None
    tp: int | None = None
    pp: int | None = None
    cp: int | None = None
    ep: int | None = None
    expert_tp: int | None = None
    cp_variant: str | None = None
    microbatch_size: int | None = None
    schedule: str | None = None
    virtual_stages: int | None = None
    recompute: str | None = None
    zero: int | None = None
    sequence_parallel: bool | None = None
    loss_parallel: bool | None = None
    split_weights: bool | None = None
    offload: bool | None = None
    compile: bool | None = None

    def __post_init__(self) -> None:
        """Check every field given (the one place they are checked)."""
        for name in COUNTS + ("zero",):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, _integer(name, value))
        for name in COUNTS:
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name}={value}: expected a positive integer")
        if self.zero is not None and self.zero not in (0, 1, 2, 3):
            raise ConfigError(f"zero={self.zero}: expected a ZeRO stage, 0, 1, 2 or 3")
        if self.schedule is not None:
            check_choice("schedule", self.schedule, SCHEDULES)
        if self.recompute is not None:
            check_choice("recompute", self.recompute, RECOMPUTE)
        if self.cp_variant is not None:
            check_choice("cp_variant", self.cp_variant, CP_VARIANTS)
        if self.cp is not None and self.ep is not None and self.cp > 1 and self.ep > 1:
            raise ConfigError(
                f"cp={self.cp} with ep={self.ep}: context and expert parallelism are not "
                f"planned together; it would need the experts split over ep ranks drawn "
                f"from dp x cp, with every cp rank's tokens routed to them (Megatron-Core "
                f"folds EP over DP x CP), while autopar's ep takes its ranks from dp (or dp "
                f"x tp with expert_tp=1), never cp; "
                f"choose one (cp for long sequences, ep for the experts)")
        if self.expert_tp is not None and self.tp is not None and \
                self.expert_tp not in (1, self.tp):
            raise ConfigError(f"expert_tp={self.expert_tp} with tp={self.tp}: the experts are "
                              f"split like the rest of the model (expert_tp={self.tp}) or held "
                              f"whole by each rank (expert_tp=1, ep drawn from dp x tp)")
        if self.expert_tp == 1 and self.tp is not None and self.tp > 1 and \
                self.ep is not None and folded_ep_axis(self.ep, self.tp) is None:
            raise ConfigError(f"ep={self.ep} with expert_tp=1 and tp={self.tp}: folded experts "
                              f"take their ep ranks from dp x tp, so tp divides ep and ep / tp, "
                              f"the ep ranks of dp, is above 1; choose ep = k x {self.tp} with "
                              f"k > 1 dividing dp, or expert_tp={self.tp}")
        for name in ("sequence_parallel", "loss_parallel", "split_weights", "offload",
                     "compile"):
            if getattr(self, name) not in (None, True, False):
                raise ConfigError(f"{name}={getattr(self, name)!r}: expected True or False")
        if self.offload and self.zero not in (None, 3):
            raise ConfigError(f"offload=True needs zero=3 (FSDP2 offloads sharded parameters), "
                              f"not zero={self.zero}")

    def __repr__(self) -> str:
        """The fields given: ``Spec(tp=2, recompute='full')``."""
        return "Spec(" + ", ".join(f"{k}={v!r}" for k, v in self.given().items()) + ")"

    def given(self) -> dict[str, Any]:
        """The fields that are not None, by name."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) is not None}

    def for_estimate(self, world: int, global_batch: int) -> Spec:
        """The configuration :func:`autopar.estimate` scores on ``world`` devices: ``tp``,
        ``pp``, ``cp`` and ``ep`` left out are 1, ``dp`` fills the world,
        ``microbatch_size`` is :func:`default_microbatch`, ``schedule`` (with ``pp`` >
        1) is "1f1b", ``cp_variant`` (with ``cp`` > 1) "allgather", ``zero`` 0,
        ``sequence_parallel`` (with ``tp`` > 1), ``offload`` and ``compile`` False (a
        hand-written configuration runs eager unless it says otherwise); ``recompute``,
        ``virtual_stages`` and ``expert_tp`` left out stay the solver's.

        Raises:
            ConfigError: the degrees do not multiply to ``world``, ``dp`` does not
                divide ``global_batch``, or ``ep`` does not divide ``dp`` (nor, with
                ``expert_tp=1``, dp x tp).
        """
        tp, pp, cp = self.tp or 1, self.pp or 1, self.cp or 1
        model = tp * pp * cp
        if world % model:
            raise ConfigError(f"tp={tp} x pp={pp} x cp={cp} does not divide the {world} "
                              f"devices of the cluster")
        dp = self.dp if self.dp is not None else world // model
        if dp * model != world:
            raise ConfigError(f"dp={dp} x tp={tp} x pp={pp} x cp={cp} uses {dp * model} "
                              f"devices but the cluster has {world}")
        if global_batch % dp:
            raise ConfigError(f"the global batch {global_batch} is not divisible by dp={dp}")
        ep = self.ep or 1
        whole = dp % ep == 0
        folded = folded_ep_axis(ep, tp, dp) is not None
        if self.expert_tp == 1 and tp > 1 and not folded:
            raise ConfigError(f"ep={ep} with expert_tp=1 needs ep / tp={tp} ranks of dp, a "
                              f"divisor of dp={dp} above 1; choose an ep of tp x such a divisor")
        if not whole and not (folded and self.expert_tp in (None, 1)):
            raise ConfigError(f"ep={ep} does not divide dp={dp}: the experts are split over "
                              f"ep of the data-parallel ranks; choose an ep that divides dp"
                              + (", or fold them over tp too (expert_tp=1)" if folded else ""))
        mb = self.microbatch_size or default_microbatch(global_batch // dp, pp)
        return replace(self, dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, microbatch_size=mb,
                       schedule=(self.schedule or "1f1b") if pp > 1 else self.schedule,
                       cp_variant=(self.cp_variant or "allgather") if cp > 1 else None,
                       zero=self.zero or 0, offload=bool(self.offload),
                       compile=bool(self.compile),
                       sequence_parallel=bool(self.sequence_parallel) if tp > 1 else None)


def _integer(name: str, value: Any) -> int:
    """``value`` as an int (an integral number, not a bool); ConfigError otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigError(f"{name}={value!r}: expected an integer")
    return int(value)


def default_microbatch(local_batch: int, pp: int) -> int:
    """The largest micro-batch size that divides a data-parallel rank's ``local_batch``
    and still gives ``pp`` micro-batches (1 when none does)."""
    return max(d for d in range(1, local_batch + 1)
               if local_batch % d == 0 and (local_batch // d >= pp or d == 1))


def split_space(knobs: dict[str, Any], space: Spec | None = None
                ) -> tuple[Spec, dict[str, Any]]:
    """:func:`autopar.plan`'s keywords as (the Spec they name, the search options of
    :data:`SEARCH_OPTIONS`). Fields named as keywords replace those of ``space``.

    Raises:
        ConfigError: a keyword is neither a field of Spec nor a search option, ``space``
            is not a Spec, or a field's value is invalid.
    """
    if space is not None and not isinstance(space, Spec):
        raise ConfigError(f"space must be an autopar.Spec, got {type(space).__name__}")
    names = tuple(f.name for f in fields(Spec))
    unknown = sorted(set(knobs) - set(names) - set(SEARCH_OPTIONS))
    if unknown:
        raise ConfigError(f"unknown planning option(s) {', '.join(unknown)}; known: "
                          f"{', '.join(names + SEARCH_OPTIONS)} (or space=autopar.Spec(...))")
    spec = replace(space or Spec(), **{k: v for k, v in knobs.items() if k in names})
    return spec, {k: v for k, v in knobs.items() if k in SEARCH_OPTIONS}
