"""Timing and bookkeeping shared by the profiler's measurement modules.

:class:`Timer` times a callable the way the profiler's method prescribes: warm up,
pick a batch of back-to-back calls long enough to hide launch jitter, repeat the batch,
take the median. On CUDA the clock is a pair of CUDA events around each batch
(device time, launches queued asynchronously); on CPU it is ``time.perf_counter``.
A :class:`Task` is one point to measure: its table, a unique key, the parameters that
describe it, and a function that measures it with a Timer.
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
        from autopar.cost_models.profiling.cpu import _cpu_name  # the shipped CPU profile's

        p["device_name"] = _cpu_name()
        p["timing"] = ("time.perf_counter around batches of back-to-back calls; median "
                       "of repeated batches after warm-up")
    p.update(extra)
    return p
