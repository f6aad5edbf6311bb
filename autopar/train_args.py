"""The options of ``autopar train`` (:class:`TrainArgs`), read by its command line
(:mod:`autopar.cli_train`) and by the loop each rank runs (:mod:`autopar.train`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from autopar.spec import Spec

__all__ = ["TrainArgs"]


@dataclass(frozen=True)
class TrainArgs:
    """What ``autopar train`` runs (its command line's options)."""

    model: str = "tiny-gpt"
    steps: int = 20
    data: str = "builtin"
    global_batch: int = 8
    seq_len: int | None = None
    lr: float = 3e-3
    seed: int = 0
    checkpoint_dir: str | None = None
    checkpoint_every: int = 10
    keep: int = 2
    log_every: int = 1
    precision: str = "bf16"
    space: Spec | None = None  # the plan's search space (--dp, --tp, ...; None: all free)
    memory_budget: float | None = None  # bytes per device (None: the device's)
