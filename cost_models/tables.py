"""Measured compute tables and their interpolation.

A profile written by ``autopar profile`` (format ``autopar-profile/1``) holds tables of
measured operator times. :func:`tables_from_profile` reads them into
:class:`ComputeTables`; :func:`gemm_time`, :func:`attention_time` and
:func:`memory_bound_time` interpolate them, each returning None outside its table,
where the caller (:func:`autopar.cost_models.compute.op_time`) uses the roofline.
Times are device times: ``graph_seconds`` where the profile has it, else ``seconds``.

How each lookup interpolates (inverse-distance weighting in log-space over isotonic
measured times, or piecewise linear in log-log) and what it guarantees:
docs/cost_models.md, section ``autopar.cost_models.tables``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from autopar.errors import PlanFormatError

GemmRow = tuple[float, float, float, float]      # m, n, k, seconds
AttnRow = tuple[float, float, float, float]      # batch·heads, seq, head_dim, FLOP/s
SizeRow = tuple[float, float]                    # bytes of the main tensor, seconds

ELEMENT_BYTES: Mapping[str, int] = {"bf16": 2, "fp16": 2, "fp32": 4, "tf32": 4}
"""Bytes per element of the profile dtype names."""

_NEIGHBOURS = 8
"""Points that inverse-distance weighting averages (chosen: enough to span a
3-D neighbourhood, few enough to stay local)."""


@dataclass(frozen=True)
class ComputeTables:
    """Measured times of one device (docs/cost_models.md, section
    ``autopar.cost_models.tables``), keyed for lookup.

    ``gemm``: dtype -> rows (m, n, k, seconds); ``attention``: (dtype, pass) -> rows
    (batch·heads, seq, head_dim, FLOP/s); ``memory_bound``: (op, pass, dtype) -> rows
    (bytes, seconds) sorted by bytes; ``launch_s``: host dispatch of one tiny op;
    ``source``: where the rows were measured.
    """

    gemm: Mapping[str, tuple[GemmRow, ...]] = field(default_factory=dict)
    attention: Mapping[tuple[str, str], tuple[AttnRow, ...]] = field(default_factory=dict)
    memory_bound: Mapping[tuple[str, str, str], tuple[SizeRow, ...]] = field(
        default_factory=dict)
    launch_s: float | None = None
    source: str = ""
    memo: dict = field(default_factory=dict, compare=False, repr=False, hash=False)
    """Lookups already answered, and the rows' log coordinates (filled on first use;
    a planning search asks for the same shapes thousands of times)."""


def _device_seconds(r: Mapping[str, Any]) -> float | None:
    t = r.get("graph_seconds", r.get("seconds"))
    return float(t) if isinstance(t, (int, float)) and t > 0 else None


def isotonic_gemm(rows: Sequence[GemmRow]) -> tuple[GemmRow, ...]:
    """Each row's time raised to the largest time of any row it contains (m, n, k all
    no larger): the measured times made monotone in size."""
    out = []
    for m, n, k, t in rows:
        low = max((t2 for m2, n2, k2, t2 in rows if m2 <= m and n2 <= n and k2 <= k),
                  default=t)
        out.append((m, n, k, max(t, low)))
    return tuple(out)


def _isotonic_sizes(rows: Sequence[SizeRow]) -> tuple[SizeRow, ...]:
    out: list[SizeRow] = []
    for b, t in sorted(rows):
        if out and b == out[-1][0]:
            out[-1] = (b, max(t, out[-1][1]))
            continue
        out.append((b, max(t, out[-1][1]) if out else t))
    return tuple(out)


def _mem_key_bytes(r: Mapping[str, Any]) -> float:
    """Bytes of the main tensor of a memory-bound row (its ``shape``, ``dtype``)."""
    shape = [int(s) for s in r["shape"]]
    op, elt = r["op"], ELEMENT_BYTES.get(r["dtype"], 4)
    if op == "embedding":       # shape (tokens, vocab, hidden): the output rows
        numel = shape[0] * shape[2]
    else:                       # pointwise (numel,), rows (rows, hidden), (tokens, vocab)
        numel = math.prod(shape)
    return float(numel * elt)


def tables_from_profile(doc: Mapping[str, Any], origin: str = "<profile>") -> ComputeTables:
    """The tables of a measured profile document; rows with an ``error`` are skipped.
    Raises PlanFormatError naming the table when its rows are not as written by
    ``autopar profile``."""
    tables = doc.get("tables")
    if not isinstance(tables, dict):
        raise PlanFormatError(f"measured profile {origin}: 'tables' must be an object of "
                              "lists, as `autopar profile` writes it")
    gemm: dict[str, list[GemmRow]] = {}
    attn: dict[tuple[str, str], list[AttnRow]] = {}
    mem: dict[tuple[str, str, str], list[SizeRow]] = {}
    launch = None
    name = "?"
    try:
        for name in ("gemm", "attention", "memory_bound", "launch"):
            rows = tables.get(name, [])
            if not isinstance(rows, list):
                raise TypeError("not a list")
            for r in rows:
                t = _device_seconds(r) if "error" not in r else None
                if name == "launch" and r.get("what") == "host_dispatch" and r.get("seconds"):
                    launch = float(r["seconds"])
                if t is None or name == "launch":
                    continue
                if name == "gemm":
                    gemm.setdefault(r["dtype"], []).append(
                        (float(r["m"]), float(r["n"]), float(r["k"]), t))
                elif name == "attention":
                    bh = float(r["batch"]) * float(r["heads"])
                    attn.setdefault((r["dtype"], r["pass"]), []).append(
                        (bh, float(r["seq"]), float(r["head_dim"]), float(r["flops"]) / t))
                else:
                    mem.setdefault((r["op"], r["pass"], r["dtype"]), []).append(
                        (_mem_key_bytes(r), t))
    except (KeyError, TypeError, ValueError) as e:
        raise PlanFormatError(f"measured profile {origin}: table '{name}' has a malformed "
                              f"row ({type(e).__name__}: {e}); regenerate it with "
                              "`autopar profile`") from None
    prov = doc.get("provenance", {}) if isinstance(doc.get("provenance"), dict) else {}
    source = (f"`autopar profile` on {prov.get('device_name', '?')}, {prov.get('date', '?')}, "
              f"torch {prov.get('torch', '?')} ({origin})")
    return ComputeTables(
        gemm={d: isotonic_gemm(rs) for d, rs in gemm.items()},
        attention={k: tuple(rs) for k, rs in attn.items()},
        memory_bound={k: _isotonic_sizes(rs) for k, rs in mem.items()},
        launch_s=launch, source=source)


def _in_range(q: Sequence[float], pts: Sequence[Sequence[float]]) -> bool:
    for d, v in enumerate(q):
        vals = [p[d] for p in pts]
        if not min(vals) <= v <= max(vals):
            return False
    return True


def _idw_log(q: Sequence[float], log_pts: Sequence[Sequence[float]],
             vals: Sequence[float]) -> float:
    """Inverse-distance-weighted mean of log(vals) at q (``log_pts`` are the points'
    log coordinates); exact at a measured point."""
    lq = [math.log(v) for v in q]
    dist = []
    for p, v in zip(log_pts, vals):
        d2 = sum((a - b) ** 2 for a, b in zip(lq, p))
        if d2 < 1e-18:
            return v
        dist.append((d2, v))
    dist.sort()
    near = dist[:_NEIGHBOURS]
    w = [1.0 / d2 for d2, _ in near]
    return math.exp(sum(wi * math.log(v) for wi, (_, v) in zip(w, near)) / sum(w))


def gemm_time(t: ComputeTables, m: float, n: float, k: float, dtype: str) -> float | None:
    """Seconds of an (m, n, k) GEMM in ``dtype`` from the table, or None outside it."""
    key = ("gemm", m, n, k, dtype)
    if key not in t.memo:
        t.memo[key] = _gemm_lookup(t, m, n, k, dtype)
    return t.memo[key]


def _gemm_lookup(t: ComputeTables, m: float, n: float, k: float, dtype: str) -> float | None:
    rows = t.gemm.get(dtype)
    if not rows or min(m, n, k) <= 0 or not _in_range((m, n, k), rows):
        return None
    logs, rates = _log_rows(t, ("gemm", dtype), rows,
                            lambda a, b, c, s: 2 * a * b * c / s)
    est = 2 * m * n * k / _idw_log((m, n, k), logs, rates)
    low = max((s for a, b, c, s in rows if a <= m and b <= n and c <= k), default=0.0)
    high = min((s for a, b, c, s in rows if a >= m and b >= n and c >= k), default=math.inf)
    return min(max(est, low), high)


def _log_rows(t: ComputeTables, key: tuple, rows, value) -> tuple[list, list]:
    """(log coordinates of the rows' first three fields, ``value(*row)`` per row),
    computed once per table."""
    key = ("logs",) + key
    if key not in t.memo:
        t.memo[key] = ([(math.log(r[0]), math.log(r[1]), math.log(r[2])) for r in rows],
                       [value(*r) for r in rows])
    return t.memo[key]


def attention_time(t: ComputeTables, bh: float, seq: float, head_dim: float, flops: float,
                   dtype: str, pass_: str) -> float | None:
    """Seconds of scaled_dot_product_attention doing ``flops`` (the FLOP convention of
    :mod:`autopar.flops`) from the table, or None outside it."""
    rows = t.attention.get((dtype, pass_))
    q = (bh, seq, head_dim)
    if not rows or flops <= 0 or min(q) <= 0 or not _in_range(q, rows):
        return None
    key = ("attention", q, dtype, pass_)
    if key not in t.memo:
        logs, rates = _log_rows(t, ("attention", dtype, pass_), rows, lambda a, b, c, r: r)
        t.memo[key] = _idw_log(q, logs, rates)
    return flops / t.memo[key]


def memory_bound_time(t: ComputeTables, op: str, nbytes: float, dtype: str,
                      pass_: str) -> float | None:
    """Seconds of a memory-bound op of kind ``op`` whose main tensor has ``nbytes``,
    from the table (another dtype's curve, by bytes, when this dtype was not
    measured), or None when the op kind was not measured."""
    rows = t.memory_bound.get((op, pass_, dtype))
    if rows is None:
        others = [v for (o, p, _), v in sorted(t.memory_bound.items()) if o == op and p == pass_]
        if not others:
            return None
        rows = max(others, key=len)
    if nbytes <= 0:
        return 0.0
    if nbytes <= rows[0][0]:
        return rows[0][1]
    for (b0, t0), (b1, t1) in zip(rows, rows[1:]):
        if nbytes <= b1:
            f = math.log(nbytes / b0) / math.log(b1 / b0)
            return math.exp(math.log(t0) + f * math.log(t1 / t0))
    b_last, t_last = rows[-1]
    return t_last * nbytes / b_last
