"""The figures of a plan's report as plain data, drawn by :mod:`autopar.report_svg` (the
HTML page) and :mod:`autopar.report_png` (matplotlib) alike.

:func:`mesh_figure` (the mesh's axes and the ranks of each group), :func:`timeline_figure`
(a pipeline's schedule per rank, rerun by :mod:`autopar.solvers.schedule_sim` from the
stages the plan records, or one step's terms without pipelining), :func:`memory_figure`
(peak bytes per rank by category against the budget), :func:`alternatives` (the plan and
its runners-up, term by term) and :func:`layout_rows` (the per-module layouts). Every
number is the plan's own; the drawing rules are in docs/report.md.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from autopar.plans import Plan, StagePlan
from autopar.solvers.cost_terms import STEP_TERMS, PieceCost
from autopar.solvers.schedule_sim import Timeline
from autopar.summary import fmt_time

KINDS = (("forward", "forward", "#4c78a8"), ("backward", "backward", "#54a24b"),
         ("input_grad", "backward, input gradient (I)", "#54a24b"),
         ("weight_grad", "backward, weight gradient (W)", "#9ad18b"),
         ("compute", "forward + backward", "#4c78a8"), ("recompute", "recomputation", "#f58518"),
         ("comm", "communication", "#b279a2"), ("p2p", "stage-to-stage transfer", "#d9a6cf"),
         ("sync", "gradient synchronization (exposed)", "#6a3d9a"),
         ("optimizer", "optimizer step", "#eeca3b"), ("host", "waiting for the host", "#bab0ac"),
         ("bubble", "bubble (idle)", "#ececec"))
"""Timeline box kinds: (key, legend text, colour)."""

MEMORY_KINDS = (("params", "parameters", "#4c78a8"), ("grads", "gradients", "#54a24b"),
                ("optimizer", "optimizer state", "#eeca3b"),
                ("static", "parameters, gradients and optimizer state", "#4c78a8"),
                ("gathered", "gathered parameters", "#72b7b2"),
                ("activations", "activations", "#f58518"),
                ("backward_transient", "backward transient", "#e45756"))
"""Memory categories of :attr:`Plan.memory`: (key, legend text, colour); others are grey."""

TERM_COLOURS = (("compute_s", "#4c78a8"), ("recompute_s", "#f58518"),
                ("exposed_comm_s", "#b279a2"), ("bubble_s", "#d0d0d0"),
                ("optimizer_s", "#eeca3b"), ("exposed_host_s", "#bab0ac"))
"""Colours of the step-time terms (:data:`STEP_TERMS`)."""

MAX_GROUPS_SHOWN = 6
"""Groups of a mesh axis listed by their ranks; the rest are counted."""


def colour(table: tuple[tuple[str, ...], ...], key: str) -> str:
    """The colour of ``key`` in ``table`` (its last field), grey when it is not there."""
    return next((row[-1] for row in table if row[0] == key), "#999999")


def shade(hex_colour: str, chunk: int) -> str:
    """``hex_colour`` for a rank's model chunk: as is for even chunks, mixed 40% with
    white for odd ones (so a rank's two chunks read apart)."""
    if chunk % 2 == 0:
        return hex_colour
    rgb = [int(hex_colour[k:k + 2], 16) for k in (1, 3, 5)]
    return "#" + "".join(f"{round(c + 0.4 * (255 - c)):02x}" for c in rgb)


def legend_text(table: tuple[tuple[str, str, str], ...], key: str) -> str:
    """The legend text of ``key`` in ``table``: its own, or the key made readable."""
    return next((row[1] for row in table if row[0] == key), key.replace("_", " "))


@dataclass(frozen=True)
class MeshAxis:
    """One mesh axis: its ``size``, the rank ``stride`` between neighbours in a group,
    how many ``groups`` it forms, whether every group lies inside one node, and the
    ranks of the first groups as text."""

    name: str
    size: int
    stride: int
    groups: int
    within_node: bool
    shown: list[str]


@dataclass(frozen=True)
class MeshFigure:
    """The device mesh: axes outermost first (ranks numbered row-major over them, as
    the runtime's ``init_device_mesh`` does) and the cluster's shape."""

    axes: list[MeshAxis]
    world: int
    nodes: int
    gpus_per_node: int
    gpu: str


def ranks_text(ranks: list[int]) -> str:
    """``[0, 1, 2, 3]`` -> "0–3"; ``[0, 8, 16, 24, 32]`` -> "0, 8, …, 32"; short lists whole."""
    if len(ranks) > 2 and all(b - a == 1 for a, b in zip(ranks, ranks[1:])):
        return f"{ranks[0]}–{ranks[-1]}"
    if len(ranks) > 4:
        return f"{ranks[0]}, {ranks[1]}, …, {ranks[-1]}"
    return ", ".join(str(r) for r in ranks)


def axis_groups(mesh: dict[str, int], axis: str) -> list[list[int]]:
    """The ranks of every group of ``axis`` (ranks that differ only in their ``axis``
    coordinate), ordered by their first rank."""
    names, sizes = list(mesh), list(mesh.values())
    k = names.index(axis)
    stride = 1
    for s in sizes[k + 1:]:
        stride *= s
    world = stride * sizes[k]
    for s in sizes[:k]:
        world *= s
    starts = [r for r in range(world) if (r // stride) % sizes[k] == 0]
    return [[r + i * stride for i in range(sizes[k])] for r in starts]


def mesh_figure(plan: Plan) -> MeshFigure:
    """The plan's mesh with the ranks of each axis's groups."""
    per_node = int(plan.cluster.get("gpus_per_node") or plan.world_size)
    axes = []
    for name, size in plan.mesh.items():
        groups = axis_groups(plan.mesh, name)
        stride = groups[0][1] - groups[0][0] if size > 1 else 1
        inside = all(g[0] // per_node == g[-1] // per_node for g in groups)
        shown = ["{" + ranks_text(g) + "}" for g in groups[:MAX_GROUPS_SHOWN]]
        axes.append(MeshAxis(name, size, stride, len(groups), inside, shown))
    return MeshFigure(axes, plan.world_size, int(plan.cluster.get("nodes") or 1), per_node,
                      str(plan.cluster.get("gpu", "")))


@dataclass(frozen=True)
class Box:
    """One span of a timeline row: ``kind`` (a key of :data:`KINDS`), the text drawn in
    it (a micro-batch number), its tooltip, the micro-batch it belongs to (-1: none)
    and its model chunk (0 without virtual stages)."""

    start_s: float
    end_s: float
    kind: str
    label: str = ""
    title: str = ""
    microbatch: int = -1
    chunk: int = 0


@dataclass(frozen=True)
class TimelineFigure:
    """One step per rank: row labels, each row's boxes, the step's span, each row's
    busy share of the schedule (empty without a pipeline), the schedule's end and
    remarks for the caption."""

    rows: list[str]
    boxes: list[list[Box]]
    span_s: float
    busy_share: list[float]
    schedule_end_s: float
    notes: list[str]


def _op_boxes(kind: str, stage: int, mb: int, chunk: int, start: float, end: float,
              st: StagePlan, whole_s: float) -> list[Box]:
    """The boxes of one simulated operation: recomputation first in a backward (B or I),
    then its computation, then its share of the stage's communication (the stage's
    per-micro-batch comm_s split over its operations in proportion to their time)."""
    names = {"F": "forward", "B": "backward", "I": "input_grad", "W": "weight_grad"}
    what = {"F": "F", "B": "B", "I": "I", "W": "W"}[kind]
    dur = end - start
    comm = st.comm_s * dur / whole_s if whole_s > 0 else 0.0
    rec = st.recompute_s if kind in ("B", "I") else 0.0
    rec, comm = min(rec, dur), min(comm, max(0.0, dur - min(rec, dur)))
    title = (f"{what} of stage {stage} (chunk {chunk}), micro-batch {mb}: {fmt_time(dur)}, "
             f"{fmt_time(start)}–{fmt_time(end)}")
    out, t = [], start
    for k, length in (("recompute", rec), (names[kind], dur - rec - comm), ("comm", comm)):
        if length > 0:
            out.append(Box(t, t + length, k, str(mb) if k == names[kind] else "",
                           f"{title}; {legend_text(KINDS, k)} {fmt_time(length)}", mb, chunk))
            t += length
    return out


def pipeline_timeline(plan: Plan) -> TimelineFigure:
    """Each pp rank's operations, as :class:`~autopar.solvers.schedule_sim.Timeline`
    runs the plan's schedule over its stages' recorded times (the solver's simulation),
    then the step's after-backward tail from the breakdown."""
    pipe = plan.pipeline
    assert pipe is not None
    pp, m, v = plan.degree("pp"), plan.num_microbatches, pipe.virtual_stages
    tl = Timeline.of(pipe.schedule, pp, m, v)
    chunks = [PieceCost(forward_s=s.forward_s, backward_s=s.backward_s,
                        backward_weight_s=s.backward_weight_s,
                        activation_bytes=s.activation_bytes, static_bytes=s.static_bytes)
              for s in pipe.stages]
    durations = tl.durations(chunks)
    ends = tl.end_times(durations, pipe.p2p_s)
    est = tl.estimate(chunks, pipe.p2p_s, max(ends, default=0.0))
    rows: list[list[Box]] = [[] for _ in range(pp)]
    for k, (kind, s, j) in enumerate(tl.ops):
        r, start = tl.ranks[s], ends[k] - durations[tl.slot[k]]
        prev, dep = tl.after[k], tl.dep[k]
        if tl.cross[k] and dep < len(ends):
            ready = ends[prev] if prev < len(ends) else 0.0
            lo = max(ends[dep], ready)
            if start > lo:
                rows[r].append(Box(lo, start, "p2p", "", f"waiting for stage {s}'s input of "
                                   f"micro-batch {j} from another rank: {fmt_time(start - lo)}",
                                   j))
        st = pipe.stages[s]
        rows[r] += _op_boxes(kind, s, j, s // pp if pipe.schedule != "zbv" else int(s >= pp),
                             start, ends[k], st, st.forward_s + st.backward_s)
    makespan = est.step_time_s
    b = plan.breakdown
    host = b.get("exposed_host_s", 0.0)
    tail = plan.step_time_s - host - makespan
    notes = [f"{pipe.schedule}, {m} micro-batches" + (f", {v} chunks per rank" if v > 1 else "")
             + f": the schedule's operations end at {fmt_time(makespan)}; the mean idle "
               f"share of the ranks is {est.bubble_fraction * 100:.1f}%"]
    if not any(s.static_bytes or s.backward_weight_s for s in pipe.stages):
        notes.append("this plan records no per-stage recomputation, communication or "
                     "weight-gradient times (written before they were): its operations "
                     "are drawn whole")
    end = makespan
    if tail > 1e-12:
        opt = min(b.get("optimizer_s", 0.0), tail)
        for kind, length in (("sync", tail - opt), ("optimizer", opt), ("host", host)):
            if length > 0:
                for row in rows:
                    row.append(Box(end, end + length, kind, "",
                                   f"{legend_text(KINDS, kind)}: {fmt_time(length)}"))
                end += length
    else:
        notes.append(f"the ranks share the host's cores, so the step "
                     f"({fmt_time(plan.step_time_s)}) "
                     f"is not the schedule simulated at one process per core "
                     f"({fmt_time(makespan)}) plus a tail; the schedule is drawn at one "
                     f"process per core")
    share = [busy / makespan if makespan else 0.0 for busy in est.busy_s]
    return TimelineFigure([f"rank {r}" for r in range(pp)], rows, max(end, makespan), share,
                          makespan, notes)


def flat_timeline(plan: Plan) -> TimelineFigure:
    """One step of a plan without pipelining (every rank alike), from its breakdown:
    per micro-batch its computation, recomputation and collectives, then the
    gradient synchronization compute does not hide, the optimizer step and the wait
    for the host."""
    b, m = plan.breakdown, plan.num_microbatches
    per = [("compute", b.get("compute_s", 0.0)), ("recompute", b.get("recompute_s", 0.0)),
           ("comm", b.get("comm_s", 0.0))]
    sync = max(0.0, b.get("exposed_comm_s", 0.0) - b.get("comm_s", 0.0))
    boxes: list[Box] = []
    t = 0.0
    repeat = m if m <= 32 else 1
    for j in range(repeat):
        for kind, total in per:
            length = total / repeat
            if length > 0:
                label = str(j) if repeat > 1 else (f"×{m}" if m > 1 else "")
                boxes.append(Box(t, t + length, kind, label if kind == "compute" else "",
                                 f"{legend_text(KINDS, kind)}"
                                 + (f", micro-batch {j}" if repeat > 1 else f", {m} micro-batches")
                                 + f": {fmt_time(length)}", j if repeat > 1 else -1))
                t += length
    for kind, length in (("sync", sync), ("optimizer", b.get("optimizer_s", 0.0)),
                         ("host", b.get("exposed_host_s", 0.0))):
        if length > 0:
            boxes.append(Box(t, t + length, kind, "", f"{legend_text(KINDS, kind)}: "
                             f"{fmt_time(length)}"))
            t += length
    hidden = b.get("param_comm_s", 0.0) - b.get("exposed_param_comm_s", 0.0)
    notes = [f"every one of the {plan.world_size} ranks runs the same step; "
             f"{m} micro-batch{'es' if m > 1 else ''} per step"]
    if hidden > 0:
        notes.append(f"parameter and gradient traffic hidden behind computation "
                     f"({fmt_time(hidden)}) is not drawn")
    return TimelineFigure([f"each of {plan.world_size}"], [boxes], t, [], t, notes)


def timeline_figure(plan: Plan) -> TimelineFigure:
    """The pipeline's per-rank schedule, or one step's terms without pipelining."""
    return pipeline_timeline(plan) if plan.pipeline is not None else flat_timeline(plan)


@dataclass(frozen=True)
class MemoryBar:
    """Peak bytes of one rank (or of every rank alike) by category; ``parts`` empty
    when the plan records only the total."""

    label: str
    parts: list[tuple[str, float]]
    total_bytes: float


@dataclass(frozen=True)
class MemoryFigure:
    """Memory bars against the budget the search was held to (None: not recorded)."""

    bars: list[MemoryBar]
    budget_bytes: float | None

    @property
    def scale_bytes(self) -> float:
        """The bytes the figure's axis spans: the budget, unless the fullest bar holds
        less than 40% of it, when the bars fill the axis and the budget is written at
        its end (so a small plan's categories stay readable)."""
        most = max((b.total_bytes for b in self.bars), default=0.0)
        if self.budget_bytes and most >= 0.4 * self.budget_bytes:
            return max(self.budget_bytes, most) * 1.02
        return most * 1.15 or 1.0


def memory_figure(plan: Plan) -> MemoryFigure:
    """Per pp rank its static bytes, its simulated peak of activations held and its
    transient (from the stages the plan records); without pipelining one bar of
    :attr:`Plan.memory`'s categories, which every rank shares."""
    budget = plan.solver.get("memory_budget_bytes")
    budget = float(budget) if isinstance(budget, (int, float)) and budget > 0 else None
    pipe = plan.pipeline
    if pipe is None:
        parts = [(k, float(v)) for k, v in plan.memory.items() if k != "total" and v]
        return MemoryFigure([MemoryBar(f"each of {plan.world_size}", parts,
                                       plan.memory_per_device_bytes)], budget)
    pp = plan.degree("pp")
    totals = [0.0] * pp
    for st in pipe.stages:
        totals[st.rank] = max(totals[st.rank], st.memory_bytes)
    if not any(st.static_bytes for st in pipe.stages):
        return MemoryFigure([MemoryBar(f"rank {r}", [], totals[r]) for r in range(pp)], budget)
    tl = Timeline.of(pipe.schedule, pp, plan.num_microbatches, pipe.virtual_stages)
    chunks = [PieceCost(activation_bytes=s.activation_bytes, static_bytes=s.static_bytes)
              for s in pipe.stages]
    est = tl.estimate(chunks, 0.0, 0.0)
    static = [0.0] * pp
    for st in pipe.stages:
        static[st.rank] += st.static_bytes
    bars = []
    for r in range(pp):
        held = est.peak_memory_bytes[r] - static[r]
        parts = [("static", static[r]), ("activations", held),
                 ("backward_transient", max(0.0, totals[r] - static[r] - held))]
        bars.append(MemoryBar(f"rank {r}", [(k, v) for k, v in parts if v > 0], totals[r]))
    return MemoryFigure(bars, budget)


@dataclass(frozen=True)
class Alternative:
    """A configuration beside the plan: its text, prediction, step-time terms (those of
    :data:`STEP_TERMS`) and why it loses ('' for the plan itself)."""

    label: str
    config: str
    step_time_s: float
    memory_bytes: float
    mfu: float
    terms: list[tuple[str, float]]
    why: str


def config_text(c: dict[str, Any]) -> str:
    """'pp=4 x dp=4 x tp=1, mb 2x8, ZeRO-1, 1f1b, recompute none' of a runner-up entry
    (:attr:`Plan.runners_up`)."""
    mesh = " x ".join(f"{a}={n}" for a, n in c["mesh"].items())
    sched = ""
    if c.get("schedule"):
        sched = f", {c['schedule']}" + (f" v={c['virtual_stages']}"
                                        if c.get("virtual_stages", 1) > 1 else "")
    return (f"{mesh}, mb {c['microbatch_size']}x{c['num_microbatches']}, ZeRO-{c['zero']}"
            f"{' offload' if c.get('offload') else ''}"
            f"{', sp' if c.get('sequence_parallel') else ''}{sched}, "
            f"recompute {'/'.join(c.get('recompute') or ['none'])}")


def plan_config(plan: Plan) -> dict[str, Any]:
    """The plan's configuration in the shape of a runner-up entry."""
    pipe = plan.pipeline
    return {"mesh": plan.mesh, "microbatch_size": plan.microbatch_size,
            "num_microbatches": plan.num_microbatches, "zero": plan.zero,
            "offload": plan.offload, "sequence_parallel": plan.sequence_parallel,
            "schedule": pipe.schedule if pipe else None,
            "virtual_stages": pipe.virtual_stages if pipe else 1,
            "recompute": sorted(set(plan.recompute.values())) or ["none"]}


def alternatives(plan: Plan) -> list[Alternative]:
    """The plan, then its runners-up (``--top-k``), fastest first."""
    def terms(b: dict[str, float]) -> list[tuple[str, float]]:
        return [(k, float(b.get(k, 0.0))) for k in STEP_TERMS]

    out = [Alternative("plan", config_text(plan_config(plan)), plan.step_time_s,
                       plan.memory_per_device_bytes, plan.mfu, terms(plan.breakdown), "")]
    for k, r in enumerate(plan.runners_up, 2):
        out.append(Alternative(f"#{k}", config_text(r), float(r["step_time_s"]),
                               float(r["memory_bytes"]), float(r.get("mfu", 0.0)),
                               terms(r.get("breakdown", {})),
                               r.get("why") or "the same predicted time (the plan was "
                               "found first)"))
    return out


@dataclass(frozen=True)
class LayoutRow:
    """Modules laid out alike (a block's module stands for the same one in every block):
    their path pattern, type, count, tp style, input layout (received -> computed on),
    output layout, parameter placements per stage-mesh axis, recomputation and stages."""

    module: str
    module_type: str
    count: int
    style: str
    input_layout: str
    output_layout: str
    params: str
    recompute: str
    stages: str


def _pattern(path: str, blocks: list[str]) -> tuple[str, str | None]:
    """(``blocks.*.attn.q`` for ``blocks.3.attn.q``, the block it is in or None)."""
    for b in blocks:
        if path == b or path.startswith(b + "."):
            return re.sub(r"\.\d+$", ".*", b) + path[len(b):], b
    return path, None


def layout_rows(plan: Plan) -> list[LayoutRow]:
    """The per-module layouts, modules laid out alike in one row, in the plan's order."""
    units = [(u, st.index) for st in (plan.pipeline.stages if plan.pipeline else [])
             for u in st.units]
    groups: dict[tuple, list[tuple[str, str | None]]] = {}
    for path, mp in plan.modules.items():
        pattern, block = _pattern(path, plan.blocks)
        params = ", ".join(f"{k} {'/'.join(v)}" for k, v in mp.params.items())
        key = (pattern, mp.module_type, mp.style,
               f"{mp.input_layout} → {mp.desired_input_layout}", mp.output_layout, params)
        groups.setdefault(key, []).append((path, block))
    rows = []
    for key, members in groups.items():
        modes = sorted({plan.recompute.get(b, "none") for _, b in members if b is not None})
        stages = sorted({k for p, _ in members for u, k in units
                         if p == u or p.startswith(u + ".")})
        rows.append(LayoutRow(key[0], key[1], len(members), key[2], key[3], key[4], key[5],
                              "/".join(modes) or "–", ranks_text(stages) if stages else "–"))
    return rows
