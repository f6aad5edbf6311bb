"""Score a hand-written configuration beside the plan the planner chooses, term by term.

:func:`compare` plans the model (``space`` narrows the search as in
:func:`autopar.plan`) and scores a :class:`~autopar.spec.Spec` with the same cost model
(:func:`autopar.estimate`). The :class:`Comparison` lines the two up: their layouts,
then the terms that add up to each step time (:data:`autopar.summary.STEP_TERMS`:
compute, recomputation, exposed communication, bubble, optimizer step), memory
per device, MFU and throughput, with the ratio hand-written / planned, and says in one
line which terms make the difference. A Spec that does not fit in memory still gives a
comparison, which reports what it needs against the budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from autopar.api import detect_cluster, estimate, plan
from autopar.cluster import Cluster
from autopar.errors import ConfigError, NoFeasiblePlanError
from autopar.planner_inputs import global_batch as batch_size
from autopar.plans import Plan
from autopar.spec import Spec
from autopar.summary import STEP_TERMS, fmt_time, term_differences, term_label
from autopar.units_text import fmt_bytes

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Row:
    """One line of a comparison: its label, both values as text, the ratio hand-written /
    planned as text ('' where it means nothing) and the numbers behind numeric rows."""

    label: str
    planned: str
    handwritten: str
    ratio: str = ""
    planned_value: float | None = None
    handwritten_value: float | None = None


@dataclass
class Comparison:
    """The chosen plan beside a hand-written configuration.

    Attributes:
        planned: the planner's plan.
        spec: the hand-written configuration.
        handwritten: its scored plan, or None when it has none (see ``error``).
        memory_budget_bytes: the memory budget per device both were held to.
        error: why the hand-written configuration has no plan ('' when it has one).
        needs_bytes: the least memory per device it needs, when it does not fit.
    """

    planned: Plan
    spec: Spec
    handwritten: Plan | None
    memory_budget_bytes: float
    error: str = ""
    needs_bytes: float | None = None

    @property
    def speedup(self) -> float | None:
        """Hand-written step time / planned step time (None without a hand-written plan)."""
        if self.handwritten is None or self.planned.step_time_s <= 0:
            return None
        return self.handwritten.step_time_s / self.planned.step_time_s

    def rows(self) -> list[Row]:
        """The layout rows, then one row per step-time term, memory, MFU and throughput."""
        hand = self.handwritten
        rows = [Row(label, text(self.planned), text(hand) if hand else spec_text)
                for label, text, spec_text in _layout(self.spec, self.planned)]
        rows.append(_number_row("step time", self.planned.step_time_s,
                                hand.step_time_s if hand else None, fmt_time))
        for key in STEP_TERMS:
            a = self.planned.breakdown.get(key, 0.0)
            b = hand.breakdown.get(key, 0.0) if hand else None
            rows.append(_number_row(term_label(key), a, b, fmt_time))
        rows.append(_number_row("memory per device", self.planned.memory_per_device_bytes,
                                hand.memory_per_device_bytes if hand else None, fmt_bytes,
                                missing=self._needs_cell()))
        rows.append(_number_row("MFU", self.planned.mfu, hand.mfu if hand else None,
                                lambda v: f"{v * 100:.1f}%"))
        rows.append(_number_row("throughput", self.planned.throughput,
                                hand.throughput if hand else None,
                                lambda v: f"{v:.2f} samples/s"))
        return rows

    def table(self) -> str:
        """The rows as an aligned text table, then the verdict (and, when the hand-written
        configuration does not fit, why)."""
        header = ["", "planned", "hand-written", "hand / planned"]
        cells = [[r.label, r.planned, r.handwritten, r.ratio] for r in self.rows()]
        widths = [max(len(c[i]) for c in cells + [header]) for i in range(len(header))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()
                 for row in [header, ["-" * w for w in widths]] + cells]
        lines += ["", self.verdict()]
        if self.error:
            lines.append(f"hand-written configuration: {self.error}")
        return "\n".join(lines)

    def verdict(self) -> str:
        """One line: which is faster, by how much, and the terms that make the difference."""
        a, hand = self.planned, self.handwritten
        if hand is None:
            why = f"does not fit: {self._needs_text()}" if self._has_need() else \
                "has no feasible plan"
            return (f"the hand-written configuration {why}; the plan takes "
                    f"{fmt_time(a.step_time_s)} per step in "
                    f"{fmt_bytes(a.memory_per_device_bytes)} per device")
        t_a, t_b = a.step_time_s, hand.step_time_s
        memory = (f"; memory per device {fmt_bytes(a.memory_per_device_bytes)} planned, "
                  f"{fmt_bytes(hand.memory_per_device_bytes)} hand-written")
        if abs(t_b - t_a) <= 1e-9 * max(t_a, t_b):
            return f"the hand-written configuration is as fast as the plan " \
                   f"({fmt_time(t_a)} per step){memory}"
        if t_b > t_a:
            head = f"the plan is {t_b / t_a:.2f}x faster ({fmt_time(t_a)} against " \
                   f"{fmt_time(t_b)} per step)"
            winner, loser = a, hand
        else:
            head = (f"the hand-written configuration is {t_a / t_b:.2f}x faster than the "
                    f"plan ({fmt_time(t_b)} against {fmt_time(t_a)} per step: the search "
                    f"did not reach it)")
            winner, loser = hand, a
        return head + term_differences(winner, loser) + memory

    def _has_need(self) -> bool:
        """Whether the least memory the hand-written configuration needs is known."""
        return self.needs_bytes is not None and math.isfinite(self.needs_bytes)

    def _needs_text(self) -> str:
        """'needs at least X GB per device against the Y GB budget'."""
        return (f"needs at least {fmt_bytes(self.needs_bytes)} per device against the "
                f"{fmt_bytes(self.memory_budget_bytes)} budget")

    def _needs_cell(self) -> str:
        """The memory cell of a hand-written configuration that does not fit."""
        return f">= {fmt_bytes(self.needs_bytes)} (over budget)" if self._has_need() \
            else "over budget"


def _number_row(label: str, a: float, b: float | None, fmt: Callable[[float], str],
                missing: str = "-") -> Row:
    """A numeric row (``missing`` stands for b when b is None); the ratio b / a, ''
    when both are 0 and '-' when only a is."""
    if b is None:
        return Row(label, fmt(a), missing, "", a, None)
    ratio = f"{b / a:.2f}x" if a else ("" if not b else "-")
    return Row(label, fmt(a), fmt(b), ratio, a, b)


def _mesh_text(mesh: dict[str, int]) -> str:
    """'pp=2 x dp=4 x tp=1'."""
    return " x ".join(f"{k}={v}" for k, v in mesh.items())


def _schedule_text(p: Plan) -> str:
    """'interleaved_1f1b, 2 virtual stages', or 'none' without a pipeline."""
    pipe = p.pipeline
    if pipe is None:
        return "none"
    v = pipe.virtual_stages
    return pipe.schedule + (f", {v} virtual stages" if v > 1 else "")


def _zero_text(zero: int, offload: bool) -> str:
    """'ZeRO-3 + CPU offload'."""
    return f"ZeRO-{zero}" + (" + CPU offload" if offload else "")


def _recompute_summary(p: Plan) -> str:
    """'full, every block' or 'selective 4 blocks, none 4 blocks'."""
    if not p.blocks:
        return "none (no repeated blocks)"
    counts: dict[str, int] = {}
    for b in p.blocks:
        mode = p.recompute.get(b, "none")
        counts[mode] = counts.get(mode, 0) + 1
    if len(counts) == 1:
        return f"{next(iter(counts))}, every block"
    return ", ".join(f"{mode} {n} block{'s' if n > 1 else ''}" for mode, n in counts.items())


def _layout(spec: Spec, planned: Plan) -> list[tuple[str, Callable[[Plan], str], str]]:
    """(label, the text of a plan's value, the Spec's value as :func:`autopar.estimate`
    scores it, as text)."""
    s = spec.for_estimate(planned.world_size, planned.global_batch)
    mesh = ({"pp": s.pp} if s.pp > 1 else {}) | {"dp": s.dp} | \
        ({"cp": s.cp} if s.cp > 1 else {}) | {"tp": s.tp}
    v = s.virtual_stages or 1
    sched = "none" if s.pp == 1 else s.schedule + (f", {v} virtual stages" if v > 1 else "")
    return [
        ("mesh", lambda p: _mesh_text(p.mesh), _mesh_text(mesh)),
        ("micro-batch x count", lambda p: f"{p.microbatch_size} x {p.num_microbatches}",
         f"{s.microbatch_size} x {planned.global_batch // s.dp // s.microbatch_size}"),
        ("schedule", _schedule_text, sched),
        ("ZeRO", lambda p: _zero_text(p.zero, p.offload), _zero_text(s.zero, s.offload)),
        ("sequence parallel", lambda p: "yes" if p.sequence_parallel else "no",
         "yes" if s.sequence_parallel else "no"),
        ("recompute", _recompute_summary,
         f"{s.recompute}, every block" if s.recompute else "solver's choice"),
    ]


def compare(model, example_inputs, spec: Spec, *, cluster: Cluster | None = None,
            global_batch: int | None = None, loss_fn: Callable | None = None,
            precision: str = "bf16", optimizer: str = "adamw",
            memory_budget: float | None = None, example_targets: torch.Tensor | None = None,
            expert_imbalance: float = 1.0, **space: Any) -> Comparison:
    """Plan ``model`` and score the hand-written ``spec`` beside the plan.

    The arguments are those of :func:`autopar.plan` (``space``, a Spec or its fields by
    name, narrows its search) and :func:`autopar.estimate`. When the Spec does not fit in memory the comparison says
    what it needs against the budget instead of raising; an invalid Spec (a degree that
    does not divide the world, ...) raises ConfigError, and when the planner finds no
    plan at all its NoFeasiblePlanError is raised, as :func:`autopar.plan` does.
    """
    if not isinstance(spec, Spec):
        raise ConfigError(f"spec must be an autopar.Spec, got {type(spec).__name__}")
    cluster = cluster or detect_cluster()
    # an invalid Spec fails before the search, not after it
    spec.for_estimate(cluster.world_size, batch_size(global_batch, example_inputs))
    common = dict(cluster=cluster, global_batch=global_batch,
                  loss_fn=loss_fn, precision=precision, optimizer=optimizer,
                  memory_budget=memory_budget, example_targets=example_targets,
                  expert_imbalance=expert_imbalance)
    # the Spec first: its search is small, and a layout that cannot divide the batch
    # fails before the full search rather than after it
    try:
        hand, missing = estimate(model, example_inputs, spec, **common), None
    except NoFeasiblePlanError as e:
        hand, missing = None, e
    planned = plan(model, example_inputs, **common, **space)
    budget = float(planned.solver.get("memory_budget_bytes", memory_budget or math.inf))
    if missing is not None:
        return Comparison(planned, spec, None, budget, error=str(missing),
                          needs_bytes=getattr(missing, "least_bytes", None))
    return Comparison(planned, spec, hand, budget)
