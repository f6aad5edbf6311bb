"""The solver's cost record of one strategy of one node (:class:`StrategyCost`) and its
table of terms (:data:`TERMS`).

Each field of the record is one priced term and names, in its metadata, the *term* it
adds to: ``compute_s`` (the op's own forward + backward) and ``param_copy_s`` (FSDP2's
copies of its parameters) both add to ``device_s``. The record's :attr:`~StrategyCost.total`
holds each term's sum, and every reader of the record — the ILP's objective, the memory
constraints, :func:`~autopar.solvers.problem.evaluate`, the bounds, the pipeline's unit
costs, the explanations — reads the totals, so a new field that adds to a term reaches
all of them. Adding a term: docs/extending.md, section "Add a cost term".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from operator import attrgetter
from types import MappingProxyType
from typing import Any, ClassVar, NamedTuple


class Totals(NamedTuple):
    """Each term of :data:`TERMS` summed over the fields that add to it."""

    device_s: float
    device_bwd_s: float
    comm_s: float
    all_to_all_s: float
    micro_param_comm_s: float
    step_param_comm_s: float
    optimizer_s: float
    all_host_s: float
    all_host_bwd_s: float
    host_step_s: float
    memory_bytes: float
    gather_bytes: float
    backward_start_bytes: float
    recompute_bytes: float


TERMS = MappingProxyType({
    "device_s": "device seconds per micro-batch, forward + backward (in T and the "
                "pipeline's unit costs)",
    "device_bwd_s": "the backward's part of device_s (what the host's backward overlaps; "
                    "zero-bubble schedules split it)",
    "comm_s": "activation collectives per micro-batch, on the critical path",
    "all_to_all_s": "the part of comm_s that moves tokens to their experts and back "
                    "(reported)",
    "micro_param_comm_s": "parameter traffic per micro-batch (ZeRO-3 gathers), exposed "
                          "beyond what the compute overlaps",
    "step_param_comm_s": "parameter traffic per step (gradient synchronization), exposed "
                         "beyond what the backward overlaps",
    "optimizer_s": "the optimizer step's device seconds, per step",
    "all_host_s": "host seconds per micro-batch, forward + backward",
    "all_host_bwd_s": "the backward's part of all_host_s",
    "host_step_s": "host seconds per step",
    "memory_bytes": "bytes held per device (times the node's multiplicity)",
    "gather_bytes": "bytes of gathered parameters held (times the gather multiplicity)",
    "backward_start_bytes": "transient bytes at the start of the backward",
    "recompute_bytes": "transient bytes while a recomputed block runs",
})
"""Every term a :class:`StrategyCost` field may add to, and what the solvers do with it
(the formulas: docs/solvers.md, section ``autopar.solvers.problem``)."""


def term(adds_to: str) -> Any:
    """A :class:`StrategyCost` field (default 0.0) that adds to the term ``adds_to`` of
    :data:`TERMS`."""
    if adds_to not in TERMS:
        raise ValueError(f"no term {adds_to!r}; the terms: {', '.join(TERMS)}")
    return field(default=0.0, metadata={"adds_to": adds_to})


@dataclass
class StrategyCost:
    """Costs of one strategy of one node (seconds per micro-batch unless stated), each
    field a term of :data:`TERMS` or a part of one; :attr:`total` sums each term.

    ``param_copy_s`` (of it ``param_copy_bwd_s`` in the backward) is FSDP2's copying of
    the node's parameters (:mod:`autopar.cost_models.param_work`), kept apart from
    ``compute_s`` so that a change of ZeRO stage or micro-batch count reprices it
    alone; ``param_host_s`` likewise beside ``host_s``."""

    name: str
    compute_s: float = term("device_s")
    bwd_compute_s: float = term("device_bwd_s")
    comm_s: float = term("comm_s")
    all_to_all_s: float = term("all_to_all_s")
    micro_param_comm_s: float = term("micro_param_comm_s")
    step_param_comm_s: float = term("step_param_comm_s")
    memory_bytes: float = term("memory_bytes")
    gather_bytes: float = term("gather_bytes")
    optimizer_s: float = term("optimizer_s")
    backward_start_bytes: float = term("backward_start_bytes")
    recompute_bytes: float = term("recompute_bytes")
    param_copy_s: float = term("device_s")
    param_copy_bwd_s: float = term("device_bwd_s")
    host_s: float = term("all_host_s")
    host_bwd_s: float = term("all_host_bwd_s")
    param_host_s: float = term("all_host_s")
    param_host_bwd_s: float = term("all_host_bwd_s")
    host_step_s: float = term("host_step_s")
    total: Totals = field(init=False, repr=False, compare=False)

    _getters: ClassVar[tuple[tuple[Callable[[Any], Any], bool], ...]] = ()
    """Per term of :data:`TERMS`, a getter of the fields that add to it and whether it
    returns several; worked out from the class's fields when it is first used."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._getters = ()  # a subclass's own fields are known once @dataclass has run

    def __post_init__(self) -> None:
        getters = type(self)._getters or _term_getters(type(self))
        self.total = Totals._make([sum(get(self)) if several else get(self)
                                   for get, several in getters])


def _term_getters(cls: type[StrategyCost]) -> tuple[tuple[Callable[[Any], Any], bool], ...]:
    """For each term of :data:`TERMS`, in order, a getter of the fields of ``cls`` that
    add to it (a term no field adds to reads as 0.0); kept on the class."""
    by: dict[str, list[str]] = {t: [] for t in TERMS}
    for f in fields(cls):
        if "adds_to" in f.metadata:
            by[f.metadata["adds_to"]].append(f.name)
    cls._getters = tuple((attrgetter(*names), len(names) > 1) if names else
                         (lambda _: 0.0, False) for names in by.values())
    return cls._getters
