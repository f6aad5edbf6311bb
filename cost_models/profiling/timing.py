"""How ``autopar profile`` and the ``cpu`` profile time what they measure.

:class:`Timer` times one point of a table: warm up, pick a batch of back-to-back calls
long enough to hide launch jitter, repeat the batch, take the median. On CUDA the clock
is a pair of CUDA events around each batch (device time, launches queued
asynchronously); on CPU it is ``time.perf_counter``. A :class:`Task` is one point to
measure: its table, a unique key, the parameters that describe it, and a function that
measures it with a Timer. Host overheads are differences of wall-clock times taken
round-robin (:func:`paired_times`, :func:`median_difference`). :func:`provenance` says
where and how a profile was measured.
"""

from __future__ import annotations

import datetime
import json
import math
import platform
import re
import statistics
import subprocess
import time
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch

DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16,
                                  "fp32": torch.float32, "tf32": torch.float32}
"""Profile dtype names -> torch dtypes; ``tf32`` is fp32 storage with TF32 matmuls."""


@dataclass(frozen=True)
class Measurement:
    """Median seconds of one call, the relative spread of the repeats
    ((p75 - p25) / median), the number of timed batches and the calls per batch;
    on CUDA also the median seconds per call replayed from a CUDA graph (the op's
    device time without launch gaps or host overhead), or why it could not be had."""

    seconds: float
    spread: float
    reps: int
    inner: int
    graph_seconds: float | None = None
    graph_error: str | None = None


@dataclass(frozen=True)
class Task:
    """One point of a table: ``run(timer)`` measures it and returns the fields that
    join ``params`` in the table row (``seconds`` and a rate at least)."""

    table: str
    key: str
    params: dict[str, Any]
    run: Callable[["Timer"], dict[str, Any]]


class Timer:
    """Times callables on ``device`` (see module docstring).

    ``budget_s`` bounds the timed repeats of one point (beyond ``min_reps``);
    ``target_batch_s`` is how long one timed batch of back-to-back calls should last:
    1 ms on CUDA (a few hundred launches of ~4 µs each fit in it, so one event pair's
    overhead is under 1%; first principles), 5 ms on CPU (perf_counter resolves well
    below that). ``min_reps`` = 5 keeps a median meaningful, ``max_reps`` = 50 and
    ``max_inner`` = 200 bound the time of fast points (the budget would allow more);
    all three chosen, not measured.
    """

    def __init__(self, device: torch.device, *, budget_s: float = 0.25, min_reps: int = 5,
                 max_reps: int = 50, max_inner: int = 200) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.budget_s = budget_s
        self.min_reps = min_reps
        self.max_reps = max_reps
        self.max_inner = max_inner
        self.target_batch_s = 1e-3 if self.cuda else 5e-3

    def sync(self) -> None:
        """Wait for all queued device work."""
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def batch(self, fn: Callable[[], Any], inner: int) -> float:
        """Seconds for ``inner`` back-to-back calls of ``fn``, device time on CUDA."""
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        return time.perf_counter() - t0

    def measure(self, fn: Callable[[], Any], graph: bool = True) -> Measurement:
        """Warm up, size the batch, then the median over repeated batches; on CUDA with
        ``graph``, the same calls replayed from a CUDA graph too (:meth:`graph_time`)."""
        fn()
        self.sync()
        est = max(self.batch(fn, 1), 1e-7)
        if est < 1e-2:  # short op: two more warm-up calls (caches, allocator, autotune)
            fn()
            fn()
            self.sync()
            est = max(self.batch(fn, 1), 1e-7)
        inner = max(1, min(self.max_inner, math.ceil(self.target_batch_s / est)))
        reps = int(self.budget_s / (est * inner))
        reps = max(self.min_reps, min(self.max_reps, reps))
        times = [self.batch(fn, inner) / inner for _ in range(reps)]
        m = summarize(times, inner)
        if not (self.cuda and graph):
            return m
        try:
            return replace(m, graph_seconds=self.graph_time(fn, inner, reps))
        except Exception as e:  # noqa: BLE001 — ops that synchronize cannot be captured
            self.sync()
            return replace(m, graph_error=f"{type(e).__name__}: {e}".splitlines()[0][:200])

    def graph_time(self, fn: Callable[[], Any], inner: int, reps: int) -> float:
        """Median seconds per call of ``inner`` calls captured in one CUDA graph on the
        current stream and replayed ``reps`` times. Autograd runs a backward op on its
        forward's stream, so callers run forward and capture on one (non-default)
        stream."""
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=torch.cuda.current_stream()):
            for _ in range(inner):
                fn()
        g.replay()
        self.sync()
        times = [self.batch(g.replay, 1) / inner for _ in range(reps)]
        del g
        return statistics.median(times)


def summarize(times: list[float], inner: int = 1) -> Measurement:
    """Median and relative inter-quartile spread of per-call ``times``."""
    med = statistics.median(times)
    if len(times) >= 4:
        q = statistics.quantiles(times, n=4)
        spread = (q[2] - q[0]) / med if med > 0 else 0.0
    else:
        spread = (max(times) - min(times)) / med if med > 0 else 0.0
    return Measurement(seconds=med, spread=spread, reps=len(times), inner=inner)


def median_time(fn: Callable[[], Any], sync: Callable[[], None], reps: int = 7,
                loops: int = 1, warmup: int = 1) -> float:
    """Median over ``reps`` runs (after ``warmup`` calls) of the seconds per call of
    ``loops`` calls of ``fn``, timed from one ``sync`` to the next (a barrier: every
    process starts together, and a run lasts until the slowest process is done, as a
    step does)."""
    return statistics.median(paired_times([fn], sync, reps, loops, warmup)[0])


def paired_times(fns: list[Callable[[], Any]], sync: Callable[[], None], reps: int = 11,
                 loops: int = 1, warmup: int = 1) -> list[list[float]]:
    """Seconds per call of each of ``fns`` (``loops`` calls timed from one ``sync`` to
    the next), measured ``reps`` times round-robin: each repetition times every function
    once, in turn, so a change of the host's speed during the measurement (clock
    scaling, another process) touches all of them alike. A figure taken as the
    difference of two functions is then the median of per-repetition differences
    (:func:`median_difference`), which is steadier than the difference of two medians
    taken at different times (on one H100 machine the latter gave selective
    checkpointing's per-op backward as 55, 126 and 167 µs in three rounds)."""
    for fn in fns:
        for _ in range(warmup):
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for fn, out in zip(fns, times):
            sync()
            t = time.perf_counter()
            for _ in range(loops):
                fn()
            sync()
            out.append((time.perf_counter() - t) / loops)
    return times


def median_difference(a: list[float], b: list[float]) -> float:
    """Median over repetitions of ``b[i] - a[i]`` (times from :func:`paired_times`)."""
    return statistics.median(y - x for x, y in zip(a, b))


def backward_times(fwd: list[float], both: list[float]) -> list[float]:
    """Per repetition, the backward's share of a forward + backward (``both``) timed
    beside the forward alone (``fwd``), from :func:`paired_times`."""
    return [b - f for f, b in zip(fwd, both)]


def median_of(runs: list[Any]) -> Any:
    """The element-wise median of repeated measurements of one shape (numbers, lists and
    dicts of them, nested): each figure is the median of its repetitions."""
    first = runs[0]
    if isinstance(first, dict):
        return {k: median_of([r[k] for r in runs]) for k in first}
    if isinstance(first, list):
        return [median_of(list(col)) for col in zip(*runs)]
    return statistics.median(runs)


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``, else ``platform.processor()``)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def sig(x: float, digits: int = 4) -> float:
    """``x`` rounded to ``digits`` significant digits (keeps the JSON reviewable)."""
    if x == 0 or not math.isfinite(x):
        return x
    return round(x, digits - 1 - int(math.floor(math.log10(abs(x)))))


def compact_json(obj: Any, indent: int = 0) -> str:
    """``obj`` as indented JSON with every list of plain values on one line (shapes
    stay readable), each line after the first indented by ``indent`` more spaces."""
    text = json.dumps(obj, indent=1)
    text = re.sub(r"\[\s*([^\[\]{}]*?)\s*\]",
                  lambda m: "[" + " ".join(m.group(1).split()) + "]", text)
    return text.replace("\n", "\n" + " " * indent)


def row(m: Measurement, *, flops: float | None = None, nbytes: float | None = None) -> dict:
    """Table fields of a measurement: seconds (eager), spread, repeats, graph_seconds
    (CUDA-graph replay) where measured, and the achieved FLOP/s and/or bytes/s of the
    eager time when the work is given."""
    out: dict[str, Any] = {"seconds": sig(m.seconds), "spread": sig(m.spread, 2),
                           "reps": m.reps, "inner": m.inner}
    if m.graph_seconds is not None:
        out["graph_seconds"] = sig(m.graph_seconds)
    if m.graph_error is not None:
        out["graph_error"] = m.graph_error
    if flops is not None:
        out["flops"] = flops
        out["flop_per_s"] = sig(flops / m.seconds)
    if nbytes is not None:
        out["bytes"] = nbytes
        out["bytes_per_s"] = sig(nbytes / m.seconds)
    return out


def nvidia_smi() -> dict[str, str]:
    """Driver version, name, max SM clock and power limit of GPU 0 as nvidia-smi
    reports them; empty where nvidia-smi is absent or fails."""
    fields = ["driver_version", "name", "clocks.max.sm", "power.limit", "memory.total"]
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields)}",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=20, check=True).stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError):
        return {}
    if not out:
        return {}
    values = [v.strip() for v in out[0].split(",")]
    return dict(zip(fields, values))


def provenance(device: torch.device, **extra: Any) -> dict[str, Any]:
    """Where and how a profile was measured, without the host's name: date (UTC),
    torch, CUDA and cuDNN versions, device name and properties, driver version."""
    p: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
        "torch": torch.__version__, "python": platform.python_version(),
        "machine": platform.machine(), "device_type": device.type,
        "cuda": torch.version.cuda, "threads": torch.get_num_threads(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        p.update(device_name=props.name, multiprocessors=props.multi_processor_count,
                 memory_bytes=props.total_memory,
                 capability=f"{props.major}.{props.minor}",
                 cudnn=torch.backends.cudnn.version(),
                 allow_tf32_default=torch.backends.cuda.matmul.allow_tf32)
        smi = nvidia_smi()
        p["driver_version"] = smi.get("driver_version")
        p["nvidia_smi"] = smi
        p["timing"] = ("seconds: CUDA events around batches of back-to-back eager calls, "
                       "median of repeated batches after warm-up; graph_seconds: the "
                       "same calls captured in one CUDA graph and replayed (device time "
                       "without host overhead or launch gaps)")
    else:
        p["device_name"] = cpu_name()
        p["timing"] = ("time.perf_counter around batches of back-to-back calls; median "
                       "of repeated batches after warm-up")
    p.update(extra)
    return p
