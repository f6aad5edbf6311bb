"""The stage-split problem: the units' prefix sums and everything both split searches
(:mod:`autopar.solvers.stage_split`, :mod:`autopar.solvers.stage_split_search`) read,
computed once per call (:func:`split_problem`); the closed form ``T`` and the simulated
``F`` of a split (docs/solvers.md)."""

from __future__ import annotations

from dataclasses import dataclass, field

from autopar.errors import ConfigError
from autopar.solvers.cost_terms import PieceCost
from autopar.solvers.schedule_sim import (ZERO_BUBBLE, Op, Timeline, rank_orders, stage_ranks,
                                          validate)

__all__ = ["Prefix", "SplitProblem", "after_backward", "bubble_g", "cross_rank_hops", "objective",
           "split_problem", "stage_in_flight"]


def after_backward(comm: list[float], bwd: list[float], opt: list[float],
                   overlap: float) -> float:
    """Seconds of a step after the last backward of the slowest rank r:
    max_r (max(0, comm_r − overlap · bwd_r) + opt_r), the gradient synchronization its
    backward did not hide, then its optimizer step (docs/solvers.md)."""
    return max(max(0.0, c - overlap * w) + o for c, w, o in zip(comm, bwd, opt))


@dataclass
class Prefix:
    """Prefix sums of the unit costs; ``x[j] − x[i]`` is the sum over units i..j−1:
    ``work`` (forward + backward seconds of a micro-batch), ``forward``, ``backward``
    and ``weight`` (its weight-gradient part, which zero-bubble schedules run apart),
    static and activation bytes, per-step communication, optimizer and host seconds."""

    work: list[float]
    forward: list[float]
    backward: list[float]
    weight: list[float]
    static: list[float]
    act: list[float]
    comm: list[float]
    opt: list[float]
    host: list[float]

    @classmethod
    def of(cls, units: list[PieceCost], m: int) -> "Prefix":
        """Build the prefix sums (host: seconds per step of ``m`` micro-batches)."""
        acc = [[0.0] for _ in range(9)]
        for u in units:
            vals = (u.forward_s + u.backward_s, u.forward_s, u.backward_s, u.backward_weight_s,
                    u.static_bytes, u.activation_bytes, u.step_comm_s, u.optimizer_s,
                    u.host_per_step(m))
            for a, x in zip(acc, vals):
                a.append(a[-1] + x)
        return cls(*acc)


def stage_in_flight(schedule: str, pp: int, num_microbatches: int, virtual_stages: int = 1) -> list[int]:
    """k_s: the most micro-batch activations stage s holds at once in the schedule's
    op order (held from F to B, or to W on zero-bubble schedules)."""
    return _in_flight(schedule, rank_orders(schedule, pp, num_microbatches, virtual_stages),
                      pp * virtual_stages)


def _in_flight(schedule: str, orders: list[list[Op]], n: int) -> list[int]:
    """:func:`stage_in_flight` of the ranks' ``orders`` over ``n`` stages."""
    release = "W" if schedule in ZERO_BUBBLE else "B"
    most, now = [0] * n, [0] * n
    for order in orders:
        for kind, s, _ in order:
            if kind == "F":
                now[s] += 1
                most[s] = max(most[s], now[s])
            elif kind == release:
                now[s] -= 1
    return most


def cross_rank_hops(ranks: list[int]) -> int:
    """H: adjacent stage pairs on different ranks along the pipeline (``ranks``: each
    stage's rank)."""
    return sum(1 for a, b in zip(ranks, ranks[1:]) if a != b)


def bubble_g(schedule: str, pre: Prefix, i: int, j: int) -> float:
    """g of a stage over units [i, j) (docs/solvers.md)."""
    if schedule in ZERO_BUBBLE:
        backward = pre.backward[j] - pre.backward[i]
        return (pre.forward[j] - pre.forward[i]) + \
            max(0.0, backward - 2 * (pre.weight[j] - pre.weight[i]))
    return pre.work[j] - pre.work[i]


def objective(t_max: float, g_sum: float, pp: int, m: int, v: int, hops: int, p2p_s: float) -> float:
    """T = m·v·t_max + (p−1)/(p·v)·Σg + 2·H·p2p_s."""
    return m * v * t_max + (pp - 1) / (pp * v) * g_sum + 2 * hops * p2p_s


@dataclass
class SplitProblem:
    """Everything both solvers read, computed once per call."""

    schedule: str
    pre: Prefix
    n: int
    pp: int
    m: int
    v: int
    p2p_s: float
    budget: float
    k: list[int]
    ranks: list[int]
    hops: int
    orders: list[list[Op]]
    overlap: float = 1.0
    truncated: bool = False
    makespans: dict = field(default_factory=dict)
    compiled: list[Timeline] = field(default_factory=list)

    @property
    def timeline(self) -> Timeline:
        """The schedule compiled for simulation (on first use: a split that does not fit
        is found without it)."""
        if not self.compiled:
            self.compiled.append(Timeline.of(self.schedule, self.pp, self.m, self.v, self.orders))
        return self.compiled[0]

    @property
    def stages(self) -> int:
        """S = pp · v."""
        return self.pp * self.v

    def stage_memory(self, s: int, i: int, j: int) -> float:
        """static + k_s · activations of stage s over units [i, j)."""
        return (self.pre.static[j] - self.pre.static[i]) + self.k[s] * (self.pre.act[j] - self.pre.act[i])

    def rank_memory(self, bounds: list[tuple[int, int]]) -> list[float]:
        """M_r for every rank."""
        mem = [0.0] * self.pp
        for s, (i, j) in enumerate(bounds):
            mem[self.ranks[s]] += self.stage_memory(s, i, j)
        return mem

    def exposed(self, bounds: list[tuple[int, int]]) -> float:
        """max_r (max(0, comm_r − overlap · bwd_r) + opt_r) (docs/solvers.md)."""
        pre = self.pre
        return after_backward(self.per_rank(pre.comm, bounds), self.per_rank(pre.backward, bounds),
                              self.per_rank(pre.opt, bounds), self.overlap)

    def host(self, bounds: list[tuple[int, int]]) -> float:
        """max_r host_r: the busiest rank's host seconds per step (docs/solvers.md)."""
        return max(self.per_rank(self.pre.host, bounds))

    def per_rank(self, prefix: list[float], bounds: list[tuple[int, int]]) -> list[float]:
        """Each rank's sum of one unit cost (``prefix``: its prefix sums) over its stages."""
        out = [0.0] * self.pp
        for s, (i, j) in enumerate(bounds):
            out[self.ranks[s]] += prefix[j] - prefix[i]
        return out

    def durations(self, bounds: list[tuple[int, int]]) -> list[float]:
        """Every stage's F, B, I and W seconds, as :meth:`Timeline.durations` lays them out."""
        pre, out = self.pre, []
        for i, j in bounds:
            b, w = pre.backward[j] - pre.backward[i], pre.weight[j] - pre.weight[i]
            out += [pre.forward[j] - pre.forward[i], b, b - w, w]
        return out

    def simulated(self, bounds: list[tuple[int, int]]) -> float:
        """F(split): the simulated step time (kept in ``makespans`` by split) plus the
        exposed dp synchronization, or the busiest rank's host time when longer."""
        step = self.timeline.makespan(self.durations(bounds), self.p2p_s)
        self.makespans[tuple(bounds)] = step
        return max(step + self.exposed(bounds), self.host(bounds))

    def formula(self, bounds: list[tuple[int, int]]) -> float:
        """T(split), the closed form of docs/solvers.md (step 1)."""
        t_max = max(self.pre.work[j] - self.pre.work[i] for i, j in bounds)
        g_sum = sum(bubble_g(self.schedule, self.pre, i, j) for i, j in bounds)
        return objective(t_max, g_sum, self.pp, self.m, self.v, self.hops, self.p2p_s)


def split_problem(units: list[PieceCost], pp: int, m: int, schedule: str, v: int, p2p_s: float,
             budget: float, overlap: float = 1.0, timeline: Timeline | None = None) -> SplitProblem:
    """Validate the arguments and precompute the problem (``timeline``: the schedule
    compiled already)."""
    reason = validate(schedule, pp, m, v)
    if reason:
        raise ConfigError(reason)
    if len(units) < pp * v:
        raise ConfigError(f"{len(units)} units cannot fill pp={pp} x virtual_stages={v} = "
                          f"{pp * v} stages; lower pp or virtual_stages")
    orders = timeline.orders if timeline is not None else rank_orders(schedule, pp, m, v)
    ranks = stage_ranks(schedule, pp, v)
    prob = SplitProblem(schedule, Prefix.of(units, m), len(units), pp, m, v, p2p_s, budget,
                    _in_flight(schedule, orders, pp * v), ranks, cross_rank_hops(ranks), orders,
                    overlap)
    if timeline is not None:
        prob.compiled.append(timeline)
    return prob
