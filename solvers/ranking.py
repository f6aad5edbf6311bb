"""What the outer search keeps and how long it may run: the solved candidates ranked by
step time (:class:`Ranking` of :class:`Scored`), and the effort it may spend
(:class:`SearchBudget`: a deadline and a number of problems to build). The loop that
fills them is :mod:`autopar.solvers.outer_search`."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from autopar.solvers.intra_op_ilp import Solution
from autopar.solvers.pipelined_candidate import PipelineOutcome
from autopar.solvers.problem_build import Built
from autopar.solvers.search_space import Candidate


@dataclass
class Scored:
    """A solved candidate: its step time and the pieces to assemble its plan."""

    step_time_s: float
    built: Built
    solution: Solution
    candidate: Candidate
    pipeline: PipelineOutcome | None = None
    bound_s: float = 0.0  # the candidate's lower bound on its step time
    rank: int = 0  # its place in the search's order of bounds (ties go to the first)
    idle: bool = False  # its layout splits nothing over tp (solvers.idle_axis)


class Ranking:
    """The plans a search keeps: the ``top_k`` fastest, fastest first, ties to the
    candidate of the smaller bound whatever the order they were solved in; and apart,
    every one whose layout splits nothing over tp (:mod:`autopar.solvers.idle_axis`: set
    aside while a layout that uses its ranks exists; those faster than the plan are no
    runners-up, and how many that is is known only at the end). ``seed``: plans an
    earlier search kept, fastest first, placed ahead of this search's own on ties."""

    def __init__(self, top_k: int, seed: Sequence[Scored] = ()) -> None:
        self.top_k = top_k
        self.kept: list[Scored] = []
        self.idle: list[Scored] = []
        for i, s in enumerate(seed):
            s.rank = i - len(seed)
            self.place(s)

    def place(self, scored: Scored | None) -> None:
        """Keep ``scored`` (None: nothing) where it ranks."""
        if scored is not None and scored.idle:
            self.idle = _keep(self.idle, scored, len(self.idle) + 1)
        else:
            self.kept = _keep(self.kept, scored, self.top_k)

    @property
    def limit(self) -> float:
        """The step time a plan must beat to be kept (inf while there is room)."""
        return self.kept[-1].step_time_s if len(self.kept) >= self.top_k else float("inf")

    @property
    def leader(self) -> Scored | None:
        """What the search would return now: the fastest kept, else the fastest idle."""
        found = self.kept or self.idle
        return found[0] if found else None

    def settle(self) -> Scored | None:
        """At the end: the idle layouts stand in where nothing else was kept; the plan
        (None: no plan)."""
        if not self.kept:
            self.kept, self.idle = self.idle[:self.top_k], []
        return self.kept[0] if self.kept else None

    def runners_up(self, best: Scored) -> list[Scored]:
        """The plans slower than ``best`` (the plan, perhaps refined since it was kept),
        idle or not, at most ``top_k`` - 1."""
        others = self.kept[1:]
        for s in self.idle:
            if s.step_time_s >= best.step_time_s:
                others = _keep(others, s, self.top_k - 1)
        return others

    def set_aside(self, best: Scored) -> Scored | None:
        """The fastest idle layout when it beats ``best``, else None."""
        return self.idle[0] if self.idle and self.idle[0].step_time_s < best.step_time_s \
            else None


def _keep(kept: list[Scored], scored: Scored | None, top_k: int) -> list[Scored]:
    """``kept`` (the top_k fastest, fastest first) with ``scored`` placed after every
    plan as fast (ties go to the candidate of the smaller bound, whatever the order the
    search visited them in)."""
    if scored is None:
        return kept

    def before(s: Scored) -> bool:
        if scored.step_time_s < s.step_time_s * (1 - 1e-9):
            return True
        return scored.step_time_s <= s.step_time_s * (1 + 1e-9) and scored.rank < s.rank
    at = next((i for i, s in enumerate(kept) if before(s)), len(kept))
    return (kept[:at] + [scored] + kept[at:])[:top_k]


@dataclass(frozen=True)
class SearchBudget:
    """The effort a search may spend: until ``deadline`` (a :func:`time.perf_counter`
    instant; None: no limit) and ``max_built`` intra-op problems (None: every one).
    Both are checked between steps, never inside one."""

    deadline: float | None = None
    max_built: int | None = None

    @classmethod
    def starting_now(cls, time_limit_s: float | None,
                     deadline: float | None = None) -> SearchBudget:
        """A budget ending at ``deadline``, or ``time_limit_s`` from now (None: none)."""
        if deadline is None and time_limit_s is not None:
            deadline = time.perf_counter() + time_limit_s
        return cls(deadline)

    @property
    def timed(self) -> bool:
        """Whether it has a deadline."""
        return self.deadline is not None

    def passed(self) -> bool:
        """Whether the deadline has passed."""
        return self.deadline is not None and time.perf_counter() > self.deadline

    def seconds_left(self) -> float | None:
        """Seconds until the deadline (None: no deadline; may be negative)."""
        return None if self.deadline is None else self.deadline - time.perf_counter()

    def halfway(self) -> SearchBudget:
        """The same budget ending halfway from now to the deadline: building problems
        may take half the time left, so that scoring them has the rest."""
        if self.deadline is None:
            return self
        now = time.perf_counter()
        return SearchBudget(now + max(0.0, self.deadline - now) / 2, self.max_built)
