"""Measure this rank's memory during one training step, for comparing the memory
model's predictions with what a run really holds.

:func:`measure_step_memory` runs one step and returns its peak with a breakdown
(:class:`StepMemory`): on CPU the bytes of live tensor storages, tracked by PyTorch's
``MemTracker``; on CUDA ``torch.cuda.max_memory_allocated``, with the same tracker's
breakdown. :func:`retained_bytes` measures what a call leaves allocated.

What is counted and what is not, on each device: docs/runtime.md, section
``autopar.runtime.memory_probe``.

Private API: ``torch.distributed._tools.mem_tracker.MemTracker`` (torch 2.5 through
2.13); :func:`_tracker` is the only place that imports it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
from torch import nn

__all__ = ["StepMemory", "measure_step_memory", "retained_bytes"]

CATEGORIES = {"PARAM": "params", "BUFFER": "buffers", "GRAD": "grads", "OPT": "optimizer",
              "ACT": "activations", "TEMP": "temporaries", "OTH": "other"}


@dataclass(frozen=True)
class StepMemory:
    """One rank's measured memory over one step (what is counted: docs/runtime.md).

    Attributes:
        peak_bytes: peak bytes on the device during the step (CUDA:
            ``max_memory_allocated``; CPU: the tracked peak).
        tracked_peak_bytes: peak of the tracked storages (equals ``peak_bytes`` on
            CPU).
        breakdown: category -> bytes at the tracked peak (params, buffers, grads,
            optimizer, activations, temporaries, other).
        device: "cpu" or "cuda:N".
        source: how ``peak_bytes`` was measured.
    """

    peak_bytes: int
    tracked_peak_bytes: int
    breakdown: dict[str, int] = field(default_factory=dict)
    device: str = "cpu"
    source: str = "MemTracker"

    @property
    def activations_other(self) -> int:
        """Everything at the peak that is not parameters, buffers, gradients or
        optimizer state."""
        b = self.breakdown
        return b.get("activations", 0) + b.get("temporaries", 0) + b.get("other", 0)


def _tracker() -> Any:
    """A new ``MemTracker`` (private torch API; see the module docstring)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    return MemTracker()


def _snapshot(tracker: Any, which: str, device: torch.device) -> dict[str, int]:
    """The tracker's ``which`` ("peak" or "current") bytes on ``device`` by category,
    with "total"."""
    snap = tracker.get_tracker_snapshot(which)
    per = next((v for d, v in snap.items() if torch.device(d) == device), {})
    out = {CATEGORIES.get(getattr(k, "name", str(k)), str(k).lower()): int(v)
           for k, v in per.items()}
    out["total"] = out.pop("total", sum(out.values()))
    return out


def measure_step_memory(step: Callable[[], Any], *, modules: Iterable[nn.Module] = (),
                        optimizers: Iterable[torch.optim.Optimizer] = (),
                        device: torch.device | str | None = None) -> StepMemory:
    """Run ``step()`` once and measure this rank's peak memory during it.

    ``modules`` and ``optimizers`` are counted from the start (their parameters,
    buffers, gradients and state); everything else is counted from the moment an
    operator allocates it. ``device`` defaults to the current CUDA device when CUDA
    is available, else the CPU. Example, inside a running job (a
    :class:`~autopar.runtime.ParallelModel` ``pm`` and its optimizer ``opt``)::

        def one_step():
            pm.step(x, y); opt.step(); opt.zero_grad()
        mem = measure_step_memory(one_step, modules=[pm], optimizers=[opt])
        mem.peak_bytes, mem.breakdown["params"], mem.activations_other
    """
    dev = torch.device(device) if device is not None else (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
        else torch.device("cpu"))
    tracker = _tracker()
    tracker.track_external(*modules, *optimizers)
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    with tracker:
        step()
    peak = _snapshot(tracker, "peak", dev)
    tracked = peak.pop("total")
    if cuda:
        torch.cuda.synchronize(dev)
        return StepMemory(int(torch.cuda.max_memory_allocated(dev)), tracked, peak, str(dev),
                          "torch.cuda.max_memory_allocated")
    return StepMemory(tracked, tracked, peak, str(dev), "MemTracker")


def retained_bytes(fn: Callable[[], Any], device: torch.device | str = "cpu") -> tuple[Any, int]:
    """Run ``fn()`` and return its result and the bytes of the storages it
    allocated on ``device`` that are still alive when it returns (its result
    included): for a forward pass, what autograd keeps for backward."""
    dev = torch.device(device)
    tracker = _tracker()
    with tracker:
        result = fn()
        live = _snapshot(tracker, "current", dev)["total"]
    return result, live
