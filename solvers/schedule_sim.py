"""The time and memory of a pipeline schedule, as plain numbers.

Each schedule of ``torch.distributed.pipelining`` (gpipe, 1f1b, interleaved_1f1b,
interleaved_zero_bubble, zbv) is written out as the order in which every pp rank runs
its F, B, I and W operations for one optimizer step (:func:`rank_orders`, checked by
:func:`validate`); :func:`simulate` runs those orders as a discrete-event simulation
(:class:`ScheduleEstimate`), and :func:`bubble_formula` gives the closed-form bubble
of uniform chunks.

The simulation's dependency rules and each schedule's op order, with their sources,
are written out in docs/solvers.md, section ``autopar.solvers.schedule_sim``.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

from autopar.errors import ConfigError
from autopar.solvers.cost_terms import PieceCost

SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved_1f1b", "interleaved_zero_bubble", "zbv")
ZERO_BUBBLE = ("interleaved_zero_bubble", "zbv")

Op = tuple[str, int, int]
"""One operation: (kind "F" | "B" | "I" | "W", stage index, micro-batch index)."""


@dataclass
class ScheduleEstimate:
    """What :func:`simulate` predicts for one optimizer step's pipeline.

    Attributes:
        step_time_s: makespan T — the end of the last operation on any rank.
        bubble_fraction: idle share of the ranks' time, ``mean_r (1 − busy_r / T)``.
        bubble_ratio: bubble relative to the ideal time, ``(T − max_r busy_r) /
            max_r busy_r``; for uniform stages this is the textbook ``(p−1)/m``.
        peak_memory_bytes: per rank, the static bytes of its chunks plus the largest
            sum of activation bytes held at once.
        in_flight: per rank, the most chunk-activations (chunk × micro-batch) held
            at once. An activation is held from the start of its F to the end of its
            B — or of its W on the zero-bubble schedules (I frees part of it; W keeps
            the layer inputs, so counting it whole until W is the safe bound).
        busy_s: per rank, compute seconds.
    """

    step_time_s: float
    bubble_fraction: float
    bubble_ratio: float
    peak_memory_bytes: list[float]
    in_flight: list[int]
    busy_s: list[float]


def validate(schedule: str, pp: int, num_microbatches: int, virtual_stages: int = 1) -> str | None:
    """None if torch's schedule accepts the combination, else the reason.

    Rules (torch 2.4 – 2.13 ``torch.distributed.pipelining.schedules``): gpipe and 1f1b
    run one stage per rank; ``Schedule1F1B`` needs ``m ≥ p``; the interleaved schedules
    need ``m`` divisible by ``rounds = max(1, m // p)`` (torch ≤ 2.4 asked for
    ``m % p == 0``, which implies it); ``ScheduleZBVZeroBubble`` needs exactly two
    stages per rank.
    """
    p, m, v = pp, num_microbatches, virtual_stages
    if schedule not in SCHEDULE_NAMES:
        return f"unknown schedule {schedule!r}; expected one of {', '.join(SCHEDULE_NAMES)}"
    if p < 1 or m < 1 or v < 1:
        return f"pp={p}, num_microbatches={m} and virtual_stages={v} must all be >= 1"
    if schedule in ("gpipe", "1f1b") and v != 1:
        return f"{schedule} runs one stage per rank (virtual_stages=1), not {v}"
    if schedule == "1f1b" and m < p:
        return f"1f1b needs num_microbatches >= pp ({m} < {p})"
    if schedule == "zbv" and v != 2:
        return f"zbv runs exactly two stages per rank (virtual_stages=2), not {v}"
    if schedule.startswith("interleaved") and m % max(1, m // p) != 0:
        rounds = max(1, m // p)
        return (f"{schedule} needs num_microbatches divisible by max(1, m // pp) = {rounds}; "
                f"got {m} (try a multiple of pp={p})")
    return None


def needs_a_microbatch_per_stage(schedule: str) -> bool:
    """Whether autopar's runtime runs ``schedule`` only with at least as many
    micro-batches as stages: 1f1b (torch's ``Schedule1F1B``) and zbv (the runtime's own
    rule, ``runtime/pipeline.py``; torch's ``ScheduleZBVZeroBubble`` accepts fewer, so
    :func:`validate` and the simulator do too)."""
    return schedule in ("1f1b", "zbv")


def stage_ranks(schedule: str, pp: int, virtual_stages: int) -> list[int]:
    """The pp rank of each of the ``pp · v`` stages: ``s % pp`` for the looped
    schedules; for ``zbv`` the "V" of Qi et al. §6 — stage s < pp on rank s, stage
    s ≥ pp on rank 2·pp − 1 − s (torch's ``generate_stage_to_rank_mapping(style="v")``)."""
    n = pp * virtual_stages
    if schedule == "zbv":
        return [s if s < pp else 2 * pp - 1 - s for s in range(n)]
    return [s % pp for s in range(n)]


def _single_stage_ops(schedule: str, rank: int, p: int, m: int) -> list[Op]:
    """gpipe: F0..F(m−1), B0..B(m−1). 1f1b: min(m, p − r) F, then B,F,B,F…, then B."""
    if schedule == "gpipe":
        return [("F", rank, j) for j in range(m)] + [("B", rank, j) for j in range(m)]
    warm = min(m, p - rank)
    ops: list[Op] = [("F", rank, j) for j in range(warm)]
    for j in range(m):
        ops.append(("B", rank, j))
        if warm + j < m:
            ops.append(("F", rank, warm + j))
    return ops


def _looped_ops(rank: int, p: int, v: int, m: int, zero_bubble: bool) -> list[Op]:
    """Rank ``rank``'s order in torch's ``_get_1f1b_rank_ops`` for the interleaved
    1F1B (``zero_bubble`` False) and interleaved zero-bubble (True) schedules."""
    per_round = m // max(1, m // p)
    warm = min((v - 1) * per_round + (1 if zero_bubble else 2) * (p - 1 - rank), m * v)
    total = m * v
    nxt = {"F": [0] * v, "B": [0] * v, "W": [0] * v}
    back_kind = "I" if zero_bubble else "B"
    ops: list[Op] = []
    back_steps: list[int] = []
    weights_done = 0

    def take(kind: str, local: int) -> Op:
        j = nxt[kind][local]
        nxt[kind][local] += 1
        return (back_kind if kind == "B" else kind, local * p + rank, j)

    def fwd_local(step: int) -> int:
        return (step // per_round) % v

    def bwd_local(step: int) -> int:
        return v - 1 - ((step - warm) // per_round) % v

    for step in range(total + warm):
        if step < total:
            if step < warm:
                ops.append(take("F", fwd_local(step)))
                continue
            ops.append(take("F", fwd_local(step)))
        ops.append(take("B", bwd_local(step)))
        back_steps.append(step)
        if zero_bubble and step - warm >= rank:
            ops.append(take("W", bwd_local(back_steps[weights_done])))
            weights_done += 1
    while zero_bubble and weights_done < len(back_steps):
        ops.append(take("W", bwd_local(back_steps[weights_done])))
        weights_done += 1
    return ops


def _zbv_ops(rank: int, p: int, m: int) -> list[Op]:
    """Rank ``rank``'s order in torch's ``ScheduleZBVZeroBubble`` (chunk 0 = stage r,
    chunk 1 = stage 2p−1−r), planned for max(m, 2p−1) micro-batches and then trimmed
    to the m that exist, as torch does."""
    n = max(2 * p - 1, m)
    s0, s1 = rank, 2 * p - 1 - rank
    f0 = f1 = b0 = b1 = 0
    ops: list[Op] = []
    for _ in range(2 * (p - rank) - 1):
        ops.append(("F", s0, f0)); f0 += 1
    for _ in range(rank):
        ops += [("F", s1, f1), ("F", s0, f0)]; f0 += 1; f1 += 1
    for _ in range(p - rank):
        ops += [("F", s1, f1), ("I", s1, b1), ("W", s1, b1)]; f1 += 1; b1 += 1
    while f1 < f0 or f0 < n:
        if f0 < n:
            ops.append(("F", s0, f0)); f0 += 1
        ops += [("I", s0, b0), ("W", s0, b0), ("F", s1, f1), ("I", s1, b1), ("W", s1, b1)]
        b0 += 1; f1 += 1; b1 += 1
    w0, w1 = b0, b1
    for _ in range(rank):
        ops += [("I", s0, b0), ("I", s1, b1)]; b0 += 1; b1 += 1
    for _ in range(p - rank):
        ops += [("I", s0, b0), ("W", s0, w0)]; b0 += 1; w0 += 1
    ops += [("W", s1, j) for j in range(w1, b1)] + [("W", s0, j) for j in range(w0, b0)]
    return [op for op in ops if op[2] < m]


def rank_orders(schedule: str, pp: int, num_microbatches: int, virtual_stages: int = 1) -> list[list[Op]]:
    """Every rank's operation order for one step (see docs/solvers.md)."""
    reason = validate(schedule, pp, num_microbatches, virtual_stages)
    if reason:
        raise ConfigError(reason)
    p, m, v = pp, num_microbatches, virtual_stages
    if schedule in ("gpipe", "1f1b"):
        return [_single_stage_ops(schedule, r, p, m) for r in range(p)]
    if schedule == "zbv":
        return [_zbv_ops(r, p, m) for r in range(p)]
    return [_looped_ops(r, p, v, m, schedule == "interleaved_zero_bubble") for r in range(p)]


def _dependency(op: Op, n_stages: int) -> Op | None:
    """The operation whose output ``op`` consumes (None for F of stage 0)."""
    kind, s, j = op
    if kind == "F":
        return ("F", s - 1, j) if s > 0 else None
    if kind == "W":
        return ("I", s, j)
    if s == n_stages - 1:
        return ("F", s, j)
    return (kind, s + 1, j)


_KINDS = ("F", "B", "I", "W")


@dataclass(frozen=True)
class Timeline:
    """A schedule's operations compiled for repeated simulation.

    Every rank's order (:func:`rank_orders`) is merged into one sequence in which each
    operation comes after the one before it on its rank and after the one whose output
    it consumes (the order the ranks would reach them in), so one pass computes every
    end time:

        end(op) = max(end(previous op of the rank), end(dependency) + p2p_s · [other rank])
                  + duration(op)

    with ``end`` of a missing predecessor 0. The sequence depends on the schedule, pp,
    m and v only, not on the chunks' costs, so a search over stage splits compiles it
    once and prices each split with :meth:`makespan` (one loop over the ``N`` operations,
    no bookkeeping; integer arrays keep it compact). Positions ``after``/``dep`` equal to
    N mean "none"; ``cross`` flags a dependency on another rank; ``index`` maps
    an operation's dense id ``(kind · S + stage) · m + micro-batch`` (kinds F, B, I, W)
    to its position in ``ops`` (−1: the schedule has no such operation).
    """

    schedule: str
    pp: int
    num_microbatches: int
    virtual_stages: int
    orders: list[list[Op]]
    ranks: list[int]
    ops: list[Op]
    slot: array
    after: array
    dep: array
    cross: array
    index: array

    @classmethod
    def of(cls, schedule: str, pp: int, num_microbatches: int, virtual_stages: int = 1,
           orders: list[list[Op]] | None = None) -> "Timeline":
        """Compile ``schedule`` for ``pp`` ranks, ``num_microbatches`` micro-batches and
        ``virtual_stages`` chunks per rank (``orders``: its :func:`rank_orders`, when the
        caller has them); raises ConfigError where torch cannot run it, AssertionError if
        the orders deadlock."""
        if orders is None:
            orders = rank_orders(schedule, pp, num_microbatches, virtual_stages)
        ranks = stage_ranks(schedule, pp, virtual_stages)
        n_stages, m = pp * virtual_stages, num_microbatches
        total = sum(len(o) for o in orders)

        # an operation's dense id (class docstring); its dependency's
        # id follows arithmetically (see _dependency): F(s−1), I(s) for W, F(S−1) for
        # the last stage's B/I, else the same kind at s+1
        kinds = {k: i for i, k in enumerate(_KINDS)}
        keys, deps = [], []
        for order in orders:
            ks = [(kinds[k] * n_stages + s) * m + j for k, s, j in order]
            ds = [-1 if k == "F" and s == 0 else key - m if k == "F" else
                  key - n_stages * m if k == "W" else
                  key - kinds[k] * n_stages * m if s == n_stages - 1 else key + m
                  for (k, s, _), key in zip(order, ks)]
            keys.append(ks)
            deps.append(ds)
        where = [-1] * (4 * n_stages * m)
        ops: list[Op] = []
        after: list[int] = []
        dep: list[int] = []
        cross: list[bool] = []
        pos = [0] * len(orders)
        while len(ops) < total:
            progressed = False
            for r, order in enumerate(orders):
                ks, ds, k = keys[r], deps[r], pos[r]
                while k < len(order):
                    d = ds[k]
                    if d >= 0 and where[d] < 0:
                        break
                    where[ks[k]] = len(ops)
                    ops.append(order[k])
                    after.append(where[ks[k - 1]] if k else total)
                    dep.append(where[d] if d >= 0 else total)
                    cross.append(d >= 0 and ranks[(d // m) % n_stages] != r)
                    k += 1
                    progressed = True
                pos[r] = k
            if not progressed:
                raise AssertionError("pipeline schedule deadlocks: " + ", ".join(
                    str(o[pos[r]]) for r, o in enumerate(orders) if pos[r] < len(o)))
        slot = array("l", [4 * s + kinds[kind] for kind, s, _ in ops])
        return cls(schedule, pp, num_microbatches, virtual_stages, orders, ranks, ops, slot,
                   array("l", after), array("l", dep), array("b", cross), array("l", where))

    def position(self, op: Op) -> int:
        """Where ``op`` sits in ``ops`` (−1: not in this schedule). Two operations of
        one rank sit in the rank's order."""
        kind, s, j = op
        return self.index[(_KINDS.index(kind) * self.pp * self.virtual_stages + s)
                          * self.num_microbatches + j]

    @staticmethod
    def durations(chunks: list[PieceCost]) -> list[float]:
        """Seconds of F, B, I and W of every chunk, flat (4 per chunk, the layout
        :meth:`end_times` reads): I = backward − weight part, W = weight part."""
        out: list[float] = []
        for c in chunks:
            out += [c.forward_s, c.backward_s, c.backward_s - c.backward_weight_s,
                    c.backward_weight_s]
        return out

    def end_times(self, durations: list[float], p2p_s: float) -> list[float]:
        """End time of every operation of ``ops`` (formula in the class docstring),
        given :meth:`durations` of the chunks."""
        end = [0.0] * (len(self.ops) + 1)
        lag = [p2p_s if c else 0.0 for c in self.cross]
        k = 0
        for a, d, extra, s in zip(self.after, self.dep, lag, self.slot):
            x = end[a]
            y = end[d] + extra
            end[k] = (x if x > y else y) + durations[s]
            k += 1
        end.pop()
        return end

    def makespan(self, durations: list[float], p2p_s: float) -> float:
        """The step time: the last end time (see :meth:`end_times`)."""
        return max(self.end_times(durations, p2p_s), default=0.0)

    def estimate(self, chunks: list[PieceCost], p2p_s: float,
                 makespan: float | None = None) -> ScheduleEstimate:
        """:func:`simulate`'s answer for ``chunks`` (``makespan``: the step time when
        :meth:`makespan` already gave it for these chunks and ``p2p_s``)."""
        pp, m = self.pp, self.num_microbatches
        step = self.makespan(self.durations(chunks), p2p_s) if makespan is None else makespan
        busy = [0.0] * pp  # every stage runs m forwards and m whole backwards (I + W = B)
        static = [0.0] * pp
        for s, c in enumerate(chunks):
            busy[self.ranks[s]] += m * (c.forward_s + c.backward_s)
            static[self.ranks[s]] += c.static_bytes
        mem = [_memory(order, chunks, self.schedule in ZERO_BUBBLE) for order in self.orders]
        ideal = max(busy)
        return ScheduleEstimate(
            step_time_s=step,
            bubble_fraction=sum(1.0 - b / step for b in busy) / pp if step > 0 else 0.0,
            bubble_ratio=(step - ideal) / ideal if ideal > 0 else 0.0,
            peak_memory_bytes=[static[r] + mem[r][1] for r in range(pp)],
            in_flight=[mem[r][0] for r in range(pp)],
            busy_s=busy,
        )


def _memory(order: list[Op], chunks: list[PieceCost], zero_bubble: bool) -> tuple[int, float]:
    """(most chunk-activations held at once, largest activation bytes held at once)
    along one rank's order: held from F until B (or W on zero-bubble schedules)."""
    release = "W" if zero_bubble else "B"
    count = peak_count = 0
    held = peak_bytes = 0.0
    for kind, s, _ in order:
        if kind == "F":
            count += 1
            held += chunks[s].activation_bytes
            peak_count, peak_bytes = max(peak_count, count), max(peak_bytes, held)
        elif kind == release:
            count -= 1
            held -= chunks[s].activation_bytes
    return peak_count, peak_bytes


def simulate(schedule: str, chunks: list[PieceCost], pp: int, num_microbatches: int, *,
             virtual_stages: int = 1, p2p_s: float = 0.0,
             timeline: Timeline | None = None) -> ScheduleEstimate:
    """Event-driven simulation of ``schedule`` over ``pp · virtual_stages`` chunks
    (``chunks`` in pipeline order), with ``p2p_s`` seconds per activation or gradient
    hop between stages on different ranks. See :class:`ScheduleEstimate` for what is
    measured; the dependencies are those in docs/solvers.md. ``timeline``: the
    schedule already compiled (:class:`Timeline`) for these pp, m and v."""
    if len(chunks) != pp * virtual_stages:
        raise ConfigError(f"{len(chunks)} chunks given; pp={pp} x virtual_stages="
                          f"{virtual_stages} needs {pp * virtual_stages}")
    if timeline is None:
        timeline = Timeline.of(schedule, pp, num_microbatches, virtual_stages)
    return timeline.estimate(chunks, p2p_s)


def bubble_formula(schedule: str, pp: int, num_microbatches: int, virtual_stages: int = 1, *,
                   chunk: PieceCost | None = None) -> float:
    """Closed-form bubble ratio (bubble time / ideal time ``m·v·(f+b)``) for uniform
    chunks and free communication, equal to :func:`simulate`'s ``bubble_ratio``:

    * gpipe, 1f1b: ``(p−1)/m`` (GPipe, Huang et al. 2019 §2.2; Narayanan et al. SC'21 §2.2.1).
    * interleaved_1f1b: ``((p−1) + (v−1)·max(0, p−m)) / (v·m)`` — Narayanan et al.
      SC'21 §2.2.2's ``(p−1)/(v·m)`` for m ≥ p; with m < p torch's single round of m
      micro-batches leaves ``p−m`` more idle chunk-steps per extra chunk.
    * interleaved_zero_bubble (needs ``chunk``): ``(p−1)·(f + max(0, I−W)) / (v·m·(f+b))``
      with I = b − W, for m ≥ p a multiple of p — ZB-H1's ``(p−1)(T_F + T_B − T_W)`` of
      Qi et al., ICLR 2024 §3, floored at the forward fill ``(p−1)·f``.
    * zbv (needs ``chunk`` with f = I = W): ``(p−1)/(6m)``, for m ≥ 2p−1 — only the
      (p−1)·f start-up fill of the last rank remains (Qi et al. §6; torch's ZB-V order).
    """
    p, m, v = pp, num_microbatches, virtual_stages
    reason = validate(schedule, p, m, v)
    if reason:
        raise ConfigError(reason)
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / m
    if schedule == "interleaved_1f1b":
        return ((p - 1) + (v - 1) * max(0, p - m)) / (v * m)
    if chunk is None:
        raise ConfigError(f"the {schedule} bubble depends on the forward, input-grad and "
                          f"weight-grad times; pass chunk=PieceCost(...)")
    f, w = chunk.forward_s, chunk.backward_weight_s
    i = chunk.backward_s - w
    if schedule == "interleaved_zero_bubble":
        if m < p or m % p:
            raise ConfigError("the interleaved zero-bubble closed form holds for m a multiple of pp")
        return (p - 1) * (f + max(0.0, i - w)) / (v * m * (f + i + w))
    if m < 2 * p - 1 or not (abs(f - i) <= 1e-12 * f and abs(f - w) <= 1e-12 * f):
        raise ConfigError("the zbv closed form holds for F = I = W and m >= 2·pp − 1; use simulate")
    return (p - 1) / (6 * m)
