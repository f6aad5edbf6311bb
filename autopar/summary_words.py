"""Words and tables the plan's readers share (summary, explanations, comparisons and
reports): names of the step's terms, durations, lists and column tables."""

from __future__ import annotations

import re
from typing import Protocol

from autopar.solvers.cost_terms import STEP_TERMS


class Priced(Protocol):
    """What :func:`term_differences` reads of a plan (an :class:`autopar.plans.Plan`)."""

    step_time_s: float
    breakdown: dict[str, float]

TERM_LABELS = (("compute_s", "compute"), ("recompute_s", "recomputation"),
               ("exposed_comm_s", "exposed communication"), ("bubble_s", "bubble"),
               ("optimizer_s", "optimizer step"),
               ("exposed_host_s", "waiting for the host"))
"""Readable names of :data:`STEP_TERMS`, in order."""

DETAIL_LABELS = (("comm_s", "collectives + resharding"), ("reshard_s", "resharding"),
                 ("all_to_all_s", "expert token exchange"),
                 ("param_comm_s", "param comm"), ("exposed_param_comm_s", "exposed param comm"),
                 ("exposed_p2p_s", "exposed p2p"), ("p2p_s", "p2p per transfer"),
                 ("host_s", "host time"))
"""Readable names of the breakdown keys that detail the step-time terms."""


SHARE = 0.05
"""A term is named among the reasons one plan is slower than another when it moves
the step time by at least this share of their difference (smaller ones are noise
to a reader)."""


def saves_and_pays(diffs: list[tuple[str, float]], gap: float,
                   of_loser: bool = False) -> tuple[list[str], list[str]]:
    """(['less bubble (-0.41 s)', ...], ['more recomputation (+0.05 s)']) from (name,
    winner's term − loser's) pairs: the terms that move the step by at least SHARE of
    ``gap``, largest first, up to three the winner saves on and two it pays more on
    (with ``of_loser``, said of the loser)."""
    diffs = sorted((d for d in diffs if abs(d[1]) >= SHARE * gap), key=lambda d: -abs(d[1]))
    sign = -1.0 if of_loser else 1.0  # the side the words describe
    words = [(f"less {name} (-{fmt_time(-d)})" if d < 0 else f"more {name} (+{fmt_time(d)})")
             for name, d in ((n, sign * d) for n, d in diffs)]
    why = [w for w, (_, d) in zip(words, diffs) if d < 0][:3]       # what the winner saves
    despite = [w for w, (_, d) in zip(words, diffs) if d > 0][:2]   # what it pays more
    return why, despite


def join_words(items: list[str]) -> str:
    """'a', 'a and b', 'a, b and c'."""
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def term_label(key: str) -> str:
    """The readable name of breakdown key ``key`` (``"bubble_s"`` -> "bubble"; an unknown
    ``"a_b_s"`` -> "a b")."""
    return dict(TERM_LABELS + DETAIL_LABELS).get(key, key.removesuffix("_s").replace("_", " "))


def fmt_time(s: float) -> str:
    """Seconds with a unit suited to the magnitude."""
    if s >= 1:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} us"


def fmt_rate(x: float) -> str:
    """Samples per second with two decimals, and three significant digits below one:
    ``945.84``, ``0.0432``, ``4.39e-05`` (a slow device's rate is not ``0.00``)."""
    return f"{x:,.2f}" if x >= 1 or x == 0 else f"{x:.3g}"


def table(rows: list[list[str]], header: list[str]) -> list[str]:
    """``rows`` under ``header`` as lines of left-aligned columns, a rule below the
    header."""
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    line = "  ".join(h.ljust(w) for h, w in zip(header, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in rows]
    return out


def module_pattern(path: str, blocks: list[str]) -> str:
    """``blocks.*.attn.q`` for ``blocks.3.attn.q`` (a path outside ``blocks`` as it is)."""
    for b in blocks:
        if path == b or path.startswith(b + "."):
            prefix = re.sub(r"\.\d+$", ".*", b)
            return prefix + path[len(b):]
    return path


def term_differences(winner: Priced, loser: Priced, of_loser: bool = False) -> str:
    """': less bubble (-0.41 s) and less exposed communication (-0.12 s), despite more
    recomputation (+0.05 s)' — the terms of :data:`STEP_TERMS` that move the step time
    by at least :data:`~autopar.summary_words.SHARE` of the difference, largest first
    (winner's term − loser's; with ``of_loser``, said of the loser: 'more bubble
    (+0.41 s) ..., despite less ...')."""
    gap = loser.step_time_s - winner.step_time_s
    diffs = [(term_label(k), winner.breakdown.get(k, 0.0) - loser.breakdown.get(k, 0.0))
             for k in STEP_TERMS]
    why, despite = saves_and_pays(diffs, gap, of_loser)
    text = ": " + join_words(why) if why else ""
    return text + (", despite " + join_words(despite) if despite else "")
