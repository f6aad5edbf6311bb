"""A hardware profile's JSON -> a :class:`~autopar.cost_models.hardware_spec.HardwareProfile`:
:func:`load_profile` (by name or path), :func:`parse_profile` (a shipped or user file, a ``base`` it changes, measured tables it
names), :func:`profile_from_measured` (a file written by ``autopar profile`` over a base
profile), and the checks that name what is wrong in a malformed file."""

from __future__ import annotations

import math
import warnings
from dataclasses import replace
from importlib import resources
from pathlib import Path
from typing import Any

from autopar.cost_models.float8 import float8_rate_ratio
from autopar.cost_models.tables import ComputeTables, tables_from_profile
from autopar.errors import ConfigError, PlanFormatError
from autopar.schema import strict_loads

from autopar.cost_models.hardware_spec import CollectiveAlgorithm, HardwareProfile, LinkSpec

MEASURED_FORMAT = "autopar-profile/1"
"""The format tag of profiles written by ``autopar profile``."""

ALIASES = {"h100": "h100-sxm", "h100-80g": "h100-sxm", "a100": "a100-80g",
           "a100-sxm": "a100-80g", "h200-sxm": "h200", "h200-141g": "h200"}


def available_profiles() -> list[str]:
    """Names of the shipped profiles."""
    folder = resources.files("autopar.cost_models") / "profiles"
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".json"))


def _shipped_folder():
    return resources.files("autopar.cost_models") / "profiles"


def load_profile(name_or_path: str, base: str | None = None) -> HardwareProfile:
    """Load a shipped profile by name (or alias) or a profile JSON file by path. A file
    written by ``autopar profile`` is completed from the profile named ``base``
    (``cpu`` for a CPU measurement; default ``h100-sxm`` for a GPU one)."""
    if not isinstance(name_or_path, str) or not name_or_path:
        raise ConfigError(f"GPU/profile {name_or_path!r} must be a non-empty string")
    if name_or_path.endswith(".json") or "/" in name_or_path:
        path = Path(name_or_path)
        if not path.is_file():
            raise ConfigError(f"hardware profile file {name_or_path!r} does not exist")
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            raise PlanFormatError(f"hardware profile {name_or_path} is not JSON text (a pickle "
                                  f"or other binary file?); profiles are JSON only, as "
                                  f"`autopar profile` writes them") from None
        origin, folder = str(path), path.parent
    else:
        key = ALIASES.get(name_or_path.lower(), name_or_path.lower())
        known = available_profiles()
        if key not in known:
            raise ConfigError(f"unknown GPU {name_or_path!r}; known profiles: "
                              f"{', '.join(known)} (or pass the path of a profile JSON file)")
        folder = _shipped_folder()
        text, origin = (folder / f"{key}.json").read_text(), f"{key}.json"
    data = _json_object(text, origin)
    _check_format(data, origin)
    if data.get("format") == MEASURED_FORMAT:
        kind = (data.get("provenance") or {}).get("device_type") if isinstance(
            data.get("provenance"), dict) else None
        base_hw = load_profile("cpu" if kind == "cpu" else (base or "h100-sxm"))
        warn_other_torch(data, origin)
        return profile_from_measured(data, base_hw, origin)
    return parse_profile(text, origin, folder=folder)


def _check_format(data: dict, origin: str) -> None:
    """A ``format`` tag, where a profile has one, must be :data:`MEASURED_FORMAT` (a
    later version of it was written by a newer autopar); and a plan is not a profile."""
    tag = data.get("format")
    if "graph_hash" in data and "mesh" in data:
        raise PlanFormatError(f"{origin} is a plan (written by `autopar plan --json`), not a "
                              f"hardware profile; pass a shipped profile name or a file "
                              f"written by `autopar profile`")
    if tag is None or tag == MEASURED_FORMAT:
        return
    family = MEASURED_FORMAT.rsplit("/", 1)[0] + "/"
    if isinstance(tag, str) and tag.startswith(family):
        raise PlanFormatError(f"hardware profile {origin} has format {tag!r}, written by a "
                              f"newer autopar (this one reads {MEASURED_FORMAT!r}); upgrade "
                              f"autopar, or re-run `autopar profile` with this one")
    raise PlanFormatError(f"hardware profile {origin} has an unknown format {tag!r}; a "
                          f"measured profile has format {MEASURED_FORMAT!r} (written by "
                          f"`autopar profile`), a hand-written one no format field")


def _release(version: str) -> str:
    """``"2.11.0+cu130"`` -> ``"2.11"``: the torch release (major.minor) of a version."""
    return ".".join(version.split("+")[0].split(".")[:2])


def warn_other_torch(doc: dict, origin: str) -> None:
    """Warn when a measured profile was written under another torch release than the
    running one.

    A warning, not an error: the profile's rows are kernel times, and another torch
    release may pick other kernels (or fuse, dispatch and synchronize differently), so
    its figures may be off by some percent; but they remain measurements of this
    device, closer than datasheet figures, and the plans made with them are as runnable
    as any. Refusing the file would stop planning for a cluster the user cannot
    re-measure now (the planner CLI's use). The warning names both releases and the
    fix: re-run ``autopar profile`` under the running torch. Patch releases and local
    build tags (``+cu130``) are not compared."""
    import torch

    prov = doc.get("provenance") if isinstance(doc.get("provenance"), dict) else {}
    measured = prov.get("torch")
    if not isinstance(measured, str) or _release(measured) == _release(torch.__version__):
        return
    # attributed to this module's one call, so Python shows it once a process
    warnings.warn(f"hardware profile {origin} was measured with torch {measured}, and this "
                  f"is torch {torch.__version__}: kernel times may differ between releases, "
                  f"so the plan's predicted times may be off; re-run `autopar profile` under "
                  f"this torch to measure it again", stacklevel=2)


def _json_object(text: str, origin: str) -> dict:
    """The JSON object of a profile's text (NaN and Infinity refused)."""
    try:
        data = strict_loads(text)
    except ValueError as e:
        raise PlanFormatError(f"hardware profile {origin} is not valid JSON: {e}; regenerate "
                              f"it with `autopar profile`, or fix the file") from None
    if not isinstance(data, dict):
        raise PlanFormatError(f"hardware profile {origin} must be a JSON object")
    return data


def _tables_ref(data: dict, origin: str, folder: Any, sources: dict[str, str]) -> ComputeTables | None:
    ref = data.get("tables")
    if ref is None:
        return None
    if not isinstance(ref, dict) or not isinstance(ref.get("file"), str):
        raise PlanFormatError(f"hardware profile {origin}: field 'tables' must be "
                              '{"file": "<measured profile JSON>", "source": "..."}')
    target = (folder / ref["file"]) if folder is not None else Path(ref["file"])
    try:
        text = target.read_text()
    except OSError:
        raise PlanFormatError(f"hardware profile {origin}: its tables file {ref['file']!r} "
                              "cannot be read") from None
    sources["tables"] = str(ref.get("source", ref["file"]))
    tables = tables_from_profile(_json_object(text, ref["file"]), ref["file"])
    if "compute_scale" not in ref:
        return tables
    scale = _num(ref, "compute_scale", origin, sources, "tables.")
    if not 0 < scale <= 1:
        raise PlanFormatError(f"hardware profile {origin}: 'tables.compute_scale' must lie "
                              f"in (0, 1], got {scale}")
    return scaled_compute(tables, scale)


def scaled_compute(tables: ComputeTables, scale: float) -> ComputeTables:
    """``tables`` with its tensor-core work (GEMMs, attention) running at ``scale`` of
    the measured rate, its memory-bound ops unchanged: the same device at a lower SM
    clock (a power limit), which leaves the HBM clock as it is."""
    return replace(
        tables, memo={},
        gemm={d: tuple((m, n, k, t / scale) for m, n, k, t in rows)
              for d, rows in tables.gemm.items()},
        attention={key: tuple((bh, sq, hd, rate * scale) for bh, sq, hd, rate in rows)
                   for key, rows in tables.attention.items()},
        source=f"{tables.source}; GEMM and attention rates x {scale:g}")


def profile_from_measured(doc: dict, base: HardwareProfile,
                          origin: str = "<measured>") -> HardwareProfile:
    """A profile from a document written by ``autopar profile``: its measured GEMM
    peak per dtype (efficiency 1: the peak is itself a measured rate), copy bandwidth,
    host dispatch overhead, all-reduce α-β fit (ring bus bandwidth and per-step latency,
    for the intra-node link, and the inter-node link too on a CPU) and tables; the rest
    from ``base``."""
    tables = tables_from_profile(doc, origin)
    prov = doc.get("provenance") if isinstance(doc.get("provenance"), dict) else {}
    summary = doc.get("summary") if isinstance(doc.get("summary"), dict) else {}
    how = f"measured by `autopar profile` ({origin}, {prov.get('date', '?')})"
    src = dict(base.sources)
    flops = dict(base.matmul_flops)
    eff = dict(base.matmul_efficiency)
    for dt, best in (summary.get("gemm_peak_flop_per_s") or {}).items():
        if isinstance(best, dict) and best.get("flop_per_s") is not None:
            flops[dt] = _rate(best["flop_per_s"], origin,
                              f"summary.gemm_peak_flop_per_s.{dt}.flop_per_s")
            eff[dt] = 1.0
            src[f"matmul_flops.{dt}"] = f"{how}: best {dt} GEMM rate, shape {best.get('shape')}"
            src[f"matmul_efficiency.{dt}"] = "1: the peak above is itself a measured rate"
    if "fp8" in flops and eff.get("fp8") != 1.0 and eff.get("bf16") == 1.0:
        # float8 not measured: keep the base's float8-over-bf16 rate on the measured bf16
        ratio = float8_rate_ratio(base)
        flops["fp8"], eff["fp8"] = flops["bf16"] * ratio, 1.0
        src["matmul_flops.fp8"] = f"the measured bf16 rate x {ratio:.3g}, the base's float8 ratio"
    hw = replace(base, name=f"{base.name} (measured: {origin})",
                 device_name=str(prov.get("device_name", base.device_name)),
                 matmul_flops=flops, matmul_efficiency=eff, tables=tables,
                 provenance={**prov, "base_profile": base.name},
                 accuracy={})  # the base's checks were of its figures, not these
    copy = summary.get("copy_bytes_per_s")
    if isinstance(copy, dict) and copy.get("bytes_per_s") is not None:
        hw = replace(hw, memory_bandwidth=_rate(copy["bytes_per_s"], origin,
                                                "summary.copy_bytes_per_s"),
                     memory_efficiency=1.0)
        src["memory_bandwidth"] = f"{how}: copy of {copy.get('bytes')} bytes, read + write"
        src["memory_efficiency"] = "1: the bandwidth above is itself a measured rate"
    if tables.launch_s is not None:
        hw = replace(hw, kernel_overhead_s=tables.launch_s)
        src["kernel_overhead_s"] = f"{how}: host dispatch of a tiny op"
    host = doc.get("host_overhead_s")
    if isinstance(host, dict) and host:
        hw = replace(hw, host_overhead_s={k: float(v) for k, v in host.items()
                                          if isinstance(v, (int, float)) and v >= 0})
        src["host_overhead_s"] = f"{how}: host seconds per op, hook and parameter"
    if prov.get("memory_bytes") is not None:
        hw = replace(hw, memory_bytes=_rate(prov["memory_bytes"], origin,
                                            "provenance.memory_bytes"))
        src["memory_bytes"] = f"{how}: device memory reported by torch"
    fits = doc.get("fits") if isinstance(doc.get("fits"), dict) else {}
    fits = fits.get("collectives") if isinstance(fits.get("collectives"), dict) else {}
    ar = [f for f in fits.values() if isinstance(f, dict) and f.get("op") == "all_reduce"]
    if ar:
        best = max(ar, key=lambda f: f.get("world") if isinstance(f.get("world"), int) else 0)
        link = LinkSpec(_rate(best.get("bus_bandwidth_bytes_per_s"), origin,
                              "fits.collectives.bus_bandwidth_bytes_per_s"),
                        _rate(best.get("alpha_per_step_s"), origin,
                              "fits.collectives.alpha_per_step_s", zero=True))
        note = f"{how}: all-reduce over {best.get('world', '?')} processes, α-β fit"
        hw = replace(hw, intra_node=link)
        src["intra_node.bandwidth"] = src["intra_node.latency"] = note
        if prov.get("device_type") == "cpu":
            hw = replace(hw, inter_node=link)
            src["inter_node.bandwidth"] = src["inter_node.latency"] = note + " (one machine)"
    src["tables"] = tables.source
    return replace(hw, sources=src, per_process=_unmeasured(base.per_process, hw, base))


def _rate(value: Any, origin: str, where: str, zero: bool = False) -> float:
    """A measured figure of a profile written by ``autopar profile``: a finite number
    above 0 (or at least 0 with ``zero``); PlanFormatError naming it otherwise."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and \
        math.isfinite(value) and (value >= 0 if zero else value > 0)
    if not ok:
        raise PlanFormatError(f"measured profile {origin}: '{where}' must be a "
                              f"{'non-negative' if zero else 'positive'} number, got "
                              f"{value!r}; regenerate the file with `autopar profile`")
    return float(value)


def _unmeasured(per_process: dict[int, dict[str, Any]], hw: HardwareProfile,
                base: HardwareProfile) -> dict[int, dict[str, Any]]:
    """``per_process`` entries of ``base`` less every figure that ``hw`` measured itself
    (a figure that differs from the base's): what the user measured wins at every
    process count."""
    measured = {"matmul_flops": hw.matmul_flops.get("fp32") != base.matmul_flops.get("fp32"),
                "memory_bandwidth": hw.memory_bandwidth != base.memory_bandwidth,
                "kernel_overhead_s": hw.kernel_overhead_s != base.kernel_overhead_s,
                "link": hw.intra_node != base.intra_node}
    prefix = {"matmul_flops": "matmul_flops", "memory_bandwidth": "memory_bandwidth",
              "kernel_overhead_s": "kernel_overhead_s", "link": "intra_node"}
    gone = tuple(prefix[f] for f, m in measured.items() if m)
    out = {}
    for k, e in per_process.items():
        kept = {f: v for f, v in e.items() if not measured.get(f, False)}
        kept["sources"] = {n: t for n, t in e.get("sources", {}).items()
                           if not n.startswith(gone) and not (measured["link"] and
                                                              n.startswith("per_process"))}
        out[k] = kept
    return out


def _num(data: dict, key: str, origin: str, sources: dict[str, str], prefix: str = "") -> float:
    entry = data.get(key)
    if isinstance(entry, dict):
        value = entry.get("value")
        sources[prefix + key] = str(entry.get("source", ""))
    else:
        value = entry
    if not isinstance(value, (int, float)) or isinstance(value, bool) or \
            not math.isfinite(value) or value < 0:
        raise PlanFormatError(f"hardware profile {origin}: field '{prefix}{key}' must be a "
                              f"finite, non-negative number (as {{\"value\": ..., \"source\": ...}}), "
                              f"got {entry!r}")
    return float(value)


def _table(data: dict, key: str, origin: str, sources: dict[str, str]) -> dict[str, float]:
    t = data.get(key)
    if not isinstance(t, dict) or not t:
        raise PlanFormatError(f"hardware profile {origin}: field '{key}' must map names to "
                              "numbers")
    return {k: _num(t, k, origin, sources, f"{key}.") for k in t}


def _link(data: dict, key: str, origin: str, sources: dict[str, str]) -> LinkSpec:
    t = data.get(key)
    if not isinstance(t, dict):
        raise PlanFormatError(f"hardware profile {origin}: field '{key}' must hold "
                              "'bandwidth' and 'latency'")
    return LinkSpec(_num(t, "bandwidth", origin, sources, f"{key}."),
                    _num(t, "latency", origin, sources, f"{key}."),
                    algorithms=_algorithms(t, key, origin, sources))


def _algorithms(link: dict, key: str, origin: str,
                sources: dict[str, str]) -> tuple[CollectiveAlgorithm, ...]:
    """A link's optional ``algorithms`` block: per name, ``base_latency`` and
    ``step_latency`` (seconds), ``bus_bandwidth`` or ``algorithm_bandwidth`` (bytes/s)
    and optionally ``kinds`` (see :class:`CollectiveAlgorithm`)."""
    block = link.get("algorithms")
    if block is None:
        return ()
    if not isinstance(block, dict) or not block:
        raise PlanFormatError(f"hardware profile {origin}: field '{key}.algorithms' must map "
                              "algorithm names to their latencies and bandwidth")
    out = []
    for name, e in block.items():
        pre = f"{key}.algorithms.{name}."
        bus = isinstance(e, dict) and "bus_bandwidth" in e
        if not isinstance(e, dict) or bus == ("algorithm_bandwidth" in e):
            raise PlanFormatError(f"hardware profile {origin}: field '{pre[:-1]}' must hold "
                                  "'base_latency', 'step_latency' and one of 'bus_bandwidth' "
                                  "or 'algorithm_bandwidth'")
        kinds = e.get("kinds", [])
        if not isinstance(kinds, list) or not all(isinstance(k, str) for k in kinds):
            raise PlanFormatError(f"hardware profile {origin}: field '{pre}kinds' must list "
                                  "collective kinds")
        rate = _num(e, "bus_bandwidth" if bus else "algorithm_bandwidth", origin, sources, pre)
        if rate <= 0:
            raise PlanFormatError(f"hardware profile {origin}: '{pre[:-1]}' has no bandwidth")
        out.append(CollectiveAlgorithm(
            str(name), _num(e, "base_latency", origin, sources, pre),
            _num(e, "step_latency", origin, sources, pre), rate, bus, tuple(kinds)))
    return tuple(out)


def _per_process(data: dict, origin: str) -> dict[int, dict[str, Any]]:
    """The optional ``per_process`` block: per process count N, the GEMM rate (fp32),
    copy bandwidth, per-op time and, for N > 1, an all-reduce fit (the link) with
    all-gather and reduce-scatter fits as its ``kinds``; each entry's sources kept."""
    block = data.get("per_process")
    if block is None:
        return {}
    if not isinstance(block, dict) or not all(str(k).isdigit() and int(k) > 0 for k in block):
        raise PlanFormatError(f"hardware profile {origin}: field 'per_process' must map "
                              "process counts (\"1\", \"2\", ...) to measured rates")
    out: dict[int, dict[str, Any]] = {}
    for key, entry in block.items():
        pre = f"per_process.{key}."
        if not isinstance(entry, dict):
            raise PlanFormatError(f"hardware profile {origin}: field '{pre[:-1]}' must be an object")
        src: dict[str, str] = {}
        e: dict[str, Any] = {f: _num(entry, f, origin, src, pre) for f in
                             ("matmul_flops", "memory_bandwidth", "kernel_overhead_s")}
        if "comm_overlap" in entry:
            e["comm_overlap"] = _num(entry, "comm_overlap", origin, src, pre)
        if "host_overhead_s" in entry:
            e["host_overhead_s"] = _table(entry, "host_overhead_s", origin, src)
        kinds = [(kind, _link(entry, kind, origin, src)) for kind in
                 ("all_reduce", "all_gather", "reduce_scatter") if kind in entry]
        if kinds:
            main = dict(kinds).get("all_reduce", kinds[0][1])
            e["link"] = LinkSpec(main.bandwidth, main.latency,
                                 tuple((k, v.bandwidth, v.latency) for k, v in kinds))
        names = {f"{pre}matmul_flops": "matmul_flops.fp32",
                 f"{pre}memory_bandwidth": "memory_bandwidth",
                 f"{pre}kernel_overhead_s": "kernel_overhead_s",
                 f"{pre}comm_overlap": "comm_overlap",
                 "all_reduce.bandwidth": "intra_node.bandwidth",
                 "all_reduce.latency": "intra_node.latency"}
        e["sources"] = {names.get(n, n if n.startswith("host_") else f"{pre}{n}"): text
                        for n, text in src.items()}
        out[int(key)] = e
    return out


def _accuracy(data: dict, origin: str) -> dict[str, Any]:
    """The profile's ``accuracy`` record (see :attr:`HardwareProfile.accuracy`)."""
    acc = data.get("accuracy", {})
    if not isinstance(acc, dict) or (acc and "source" not in acc):
        raise PlanFormatError(f"hardware profile {origin}: 'accuracy' must be an object with "
                              "a 'source' naming where its figures were measured")
    return dict(acc)


def published_runs_text(record: dict[str, Any]) -> str:
    """The ``published_runs`` part of an accuracy record as words: how far the profile's
    prices fell from published multi-GPU runs on its GPU."""
    return (f"published multi-GPU runs priced within {record['median_abs_pct']:.0f}% "
            f"(median; max {record['max_abs_pct']:.0f}%) over {record['runs']} run(s) "
            f"from {record['sources']} source(s)")


def accuracy_text(name: str, accuracy: dict[str, Any]) -> str:
    """One line on how far to trust a plan's figures on profile ``name``."""
    runs = accuracy.get("published_runs")
    tail = f"; {published_runs_text(runs)}" if runs else ""
    if not accuracy.keys() - {"published_runs", "source", "date"}:
        if "(measured:" in name:
            return (f"profile {name}: kernel rates measured on its GPU, never checked against "
                    "whole training steps there" + tail)
        if runs:
            return (f"profile {name}: datasheet and first-principles figures, never measured "
                    "on its GPU" + tail)
        return (f"profile {name} was never checked against runs on its GPU: its figures "
                "are datasheet and first-principles estimates")
    parts = []
    if "step_error_pct" in accuracy:
        parts.append(f"one-GPU steps within {accuracy['step_error_pct']:.1f}%")
    if "layer_mape_pct" in accuracy:
        terms = accuracy.get("term_mape_pct", {})
        detail = ", ".join(f"{k} {v:.0f}%" for k, v in terms.items())
        parts.append(f"layers MAPE {accuracy['layer_mape_pct']:.1f}%"
                     + (f" ({detail})" if detail else "")
                     + (f", {accuracy['scope']}" if "scope" in accuracy else ""))
    return f"profile {name} measured {accuracy.get('date', '?')}: " + "; ".join(parts) + tail


def _derived(data: dict, origin: str, seen: tuple[str, ...] = ()) -> dict:
    """A profile naming a shipped ``base`` profile is that profile with its own fields
    over it: a field replaces the base's, except a table (no ``value`` of its own:
    ``matmul_efficiency``, a link; not ``accuracy``, the checks of the derived figures)
    whose entries replace the base's one by one; a field
    set to ``null`` is dropped (``"tables": null``: not the base's measurements). The
    ``tables`` file of a base is read from the shipped folder. A profile with tables of
    its own (``autopar profile`` writes them) does not take the base's ``accuracy``:
    those checks were of the base's figures."""
    base = data.get("base")
    if base is None:
        return data
    key = ALIASES.get(str(base).lower(), str(base).lower())
    if not isinstance(base, str) or key not in available_profiles() or key in seen:
        raise PlanFormatError(f"hardware profile {origin}: 'base' must name a shipped profile "
                              f"({', '.join(available_profiles())}), without a cycle; got {base!r}")
    text = (_shipped_folder() / f"{key}.json").read_text()
    out = dict(_derived(_json_object(text, f"{key}.json"), f"{key}.json", seen + (key,)))
    for k, v in data.items():
        if k == "base":
            continue
        if v is None:
            out.pop(k, None)
        elif isinstance(v, dict) and "value" not in v and isinstance(out.get(k), dict) \
                and k != "accuracy":  # checks of these figures replace the base's
            out[k] = {**out[k], **v}
        else:
            out[k] = v
    if data.get("tables") is not None and "accuracy" not in data:
        out.pop("accuracy", None)  # the base's checks were of its figures, not these
    ref = out.get("tables")
    if "tables" not in data and isinstance(ref, dict) and isinstance(ref.get("file"), str):
        out["tables"] = {**ref, "file": str(Path(str(_shipped_folder())) / ref["file"])}
    out["provenance"] = {**out.get("provenance", {}), **data.get("provenance", {}),
                         "base_profile": key}
    return out


def parse_profile(text: str, origin: str = "<text>", folder: Any = None) -> HardwareProfile:
    """Parse profile JSON text; raises PlanFormatError naming the bad field. A
    ``tables`` file is read relative to ``folder``."""
    data = _derived(_json_object(text, origin), origin)
    src: dict[str, str] = {}
    tables = _tables_ref(data, origin, folder, src)
    try:
        return HardwareProfile(
            name=str(data["name"]), device_name=str(data.get("device_name", data["name"])),
            memory_bytes=_num(data, "memory_bytes", origin, src),
            memory_reserve_bytes=_num(data, "memory_reserve_bytes", origin, src),
            matmul_flops=_table(data, "matmul_flops", origin, src),
            vector_flops=_table(data, "vector_flops", origin, src),
            matmul_efficiency=_table(data, "matmul_efficiency", origin, src),
            memory_bandwidth=_num(data, "memory_bandwidth", origin, src),
            memory_efficiency=_num(data, "memory_efficiency", origin, src),
            kernel_overhead_s=_num(data, "kernel_overhead_s", origin, src),
            gpus_per_node=int(_num(data, "gpus_per_node", origin, src)),
            intra_node=_link(data, "intra_node", origin, src),
            inter_node=_link(data, "inter_node", origin, src),
            host_link=_link(data, "host_link", origin, src),
            sources=src, provenance=dict(data.get("provenance", {})), tables=tables,
            per_process=_per_process(data, origin),
            comm_overlap=(_num(data, "comm_overlap", origin, src) if "comm_overlap" in data
                          else 1.0),
            host_overhead_s=(_table(data, "host_overhead_s", origin, src)
                                if "host_overhead_s" in data else {}),
            accuracy=_accuracy(data, origin))
    except KeyError as e:
        raise PlanFormatError(f"hardware profile {origin} is missing the field {e}") from None
