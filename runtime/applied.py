"""What the lowering applied, told through :mod:`logging` (logger ``autopar.runtime``,
level INFO) as torchtitan's ``parallelize`` does: the mesh, the tensor-parallel
styles, recomputation, the FSDP2 units and, pipelined, this rank's stages. Silent
unless the caller turns INFO on (``autopar train`` does on rank 0)."""

from __future__ import annotations

import logging
from collections import Counter

from torch import nn

from autopar.plans import Plan
from autopar.units_text import count_text

__all__ = ["LOGGER", "log_applied"]

LOGGER = "autopar.runtime"
"""The name of the logger the runtime reports on."""


def _counted(counter: Counter) -> str:
    return ", ".join(f"{k} x{n}" if n > 1 else k for k, n in sorted(counter.items()))


def log_applied(model: nn.Module, plan: Plan, device: str, fsdp: bool,
                stages: list[int] | None = None) -> None:
    """Log what :func:`~autopar.runtime.lower.lower` (or, with ``stages``, the indices
    of this rank's stages, :func:`~autopar.runtime.lower.lower_pipeline`) applied to
    ``model`` (the model, or one stage of it) under ``plan``."""
    log = logging.getLogger(LOGGER)
    if not log.isEnabledFor(logging.INFO):
        return
    mesh = " x ".join(f"{k}={v}" for k, v in plan.mesh.items())
    log.info("Built the device mesh %s on %s", mesh, device)
    if plan.pipeline is not None and stages:
        for st in plan.pipeline.stages:
            if st.index in stages:
                log.info("Applied pipeline stage %d of %d (%s) on this rank: %s", st.index,
                         len(plan.pipeline.stages), plan.pipeline.schedule,
                         ", ".join(u or "root" for u in st.units))
    held = {p for p, _ in model.named_modules()}
    if stages:  # a ModuleList of this rank's stages: paths below each stage's index
        held = {p.partition(".")[2] for p in held}
    tp = plan.degree("tp")
    styles = Counter(mp.style for p, mp in plan.modules.items()
                     if p in held and mp.style != "replicate")
    if tp > 1:
        log.info("Applied tensor parallelism (tp=%d) to %s: %s", tp,
                 count_text(sum(styles.values()), "module"),
                 _counted(styles) or "all replicated")
    modes = Counter(m for b, m in plan.recompute.items() if b in held and m != "none")
    if modes:
        log.info("Applied activation checkpointing to %s: %s",
                 count_text(sum(modes.values()), "block"), _counted(modes))
    if fsdp:
        units = [b for b in plan.blocks if b in held]
        log.info("Applied FSDP2 (ZeRO-%d%s, %s precision) to %s and the root", plan.zero,
                 ", offload" if plan.offload else "", plan.precision,
                 count_text(len(units), "block"))
