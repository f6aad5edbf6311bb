"""One outcome on every rank: a step that fails on one rank fails on all, alike.

``with agreed("planning"):`` runs its block on every rank, then all-gathers whether
each rank's block raised (one tiny object collective); if any did, every rank raises
the first failing rank's exception, with a note naming that rank, so that no rank
waits in a later collective for a peer that has given up. An exception that does not
survive pickling arrives as :class:`~autopar.errors.RankError` with its type, message
and traceback. :func:`collective_timeout` is the wait autopar gives the process group
it starts (:data:`COLLECTIVE_TIMEOUT_S`, or ``AUTOPAR_COLLECTIVE_TIMEOUT_S``).

Which failure counts as the first, and where the timeout comes from: docs/runtime.md,
section ``autopar.runtime.agree``.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import pickle
import time
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch.distributed as dist

from autopar.errors import ConfigError, RankError

__all__ = ["COLLECTIVE_TIMEOUT_S", "TIMEOUT_ENV", "SIMULTANEOUS_S", "Failure", "RankTraceback",
           "agreed", "describe", "first_failure", "note", "shared_error", "collective_timeout"]

COLLECTIVE_TIMEOUT_S = 300.0
"""Seconds a collective of the process group autopar starts waits for a peer:
torchtitan's ``comm.init_timeout_seconds`` (300), its timeout for initialization and
the first step. The other ranks wait up to this long for rank 0's plan: the slowest
plan docs/guide.md reports (Llama 3 8B at long sequences, "Long sequences") took 82 s."""

TIMEOUT_ENV = "AUTOPAR_COLLECTIVE_TIMEOUT_S"
"""The environment variable that replaces :data:`COLLECTIVE_TIMEOUT_S`."""

SIMULTANEOUS_S = 1.0
"""Failures this many seconds apart or less count as simultaneous (the lowest rank's is
then the first): more than the skew of the clocks of a cluster's nodes, far less than a
collective timeout, the delay of a failure that only follows another."""


@dataclass(frozen=True)
class Failure:
    """How one rank's step failed, in a form every rank can read: the exception's type
    (``module.qualname``), message and formatted traceback; the exception pickled when
    it comes back from pickling as the same type with the same message, else None; and
    the wall-clock time it was caught (``time.time()``)."""

    rank: int
    at: float
    kind: str
    message: str
    traceback: str
    pickled: bytes | None


class RankTraceback(Exception):
    """The traceback of an exception raised on another rank: the ``__cause__`` of its
    copy raised here, so that Python prints both."""

    def __init__(self, rank: int, text: str) -> None:
        super().__init__(f'\n"""\nthe traceback on rank {rank}:\n{text}"""')


def describe(error: BaseException, rank: int) -> Failure:
    """``error``, raised on ``rank``, as a :class:`Failure`."""
    kind = f"{type(error).__module__}.{type(error).__qualname__}"
    text = "".join(traceback.format_exception(error))
    pickled: bytes | None
    try:
        pickled = pickle.dumps(error)
        copy = pickle.loads(pickled)
        if type(copy) is not type(error) or str(copy) != str(error):
            pickled = None  # e.g. an __init__ whose arguments are not its args
    except Exception:  # noqa: BLE001 - anything pickle raises means it cannot travel
        pickled = None
    return Failure(rank, time.time(), kind, str(error), text, pickled)


def first_failure(outcomes: Sequence[Failure | None]) -> Failure | None:
    """The failure every rank raises: the earliest (a timeout on rank 0 that followed
    rank 1's error comes later than it), the lowest rank among those within
    :data:`SIMULTANEOUS_S` of it; None when no rank failed."""
    failed = [f for f in outcomes if f is not None]
    if not failed:
        return None
    earliest = min(f.at for f in failed)
    return min((f for f in failed if f.at <= earliest + SIMULTANEOUS_S), key=lambda f: f.rank)


def note(first: Failure, failed: list[int], world: int, what: str) -> str:
    """The note every rank adds to the shared exception: who raised it, and when."""
    others = (f" (ranks {', '.join(map(str, failed))} failed; this is the first failure)"
              if len(failed) > 1 else "")
    return (f"raised on rank {first.rank} of {world} while {what}; every rank of the job "
            f"raises it{others}")


def shared_error(first: Failure, failed: list[int], world: int, what: str) -> Exception:
    """The exception a rank other than ``first.rank`` raises for it: a copy of the
    original with the note of :func:`_note` and the original's traceback as its cause,
    or a :class:`RankError` saying what was raised where the original cannot travel."""
    copy: object = None
    if first.pickled is not None:
        with contextlib.suppress(Exception):  # e.g. a class this process cannot import
            copy = pickle.loads(first.pickled)
    if not isinstance(copy, Exception):
        copy = _untravelled(first, world, what)
    else:
        copy.add_note(note(first, failed, world, what))
    copy.__cause__ = RankTraceback(first.rank, first.traceback)
    return copy


def _untravelled(first: Failure, world: int, what: str) -> RankError:
    """The :class:`RankError` every rank raises for an exception that cannot travel."""
    return RankError(f"rank {first.rank} of {world} raised {first.kind} while {what}: "
                     f"{first.message} (the exception does not survive pickling, so every "
                     f"rank raises this RankError in its place, caused by the original "
                     f"and its traceback)")


def _gather(mine: Failure | None, error: Exception | None, what: str,
            group: dist.ProcessGroup | None) -> list[Failure | None]:
    """Every rank's outcome, in rank order. A collective that fails (a peer died, or
    did not come within the process group's timeout) raises this rank's own error
    with a note, or a :class:`RankError` when this rank's step succeeded."""
    outcomes: list[Failure | None] = [None] * dist.get_world_size(group)
    try:
        dist.all_gather_object(outcomes, mine, group=group)
        return outcomes
    except Exception as e:  # noqa: BLE001 - gloo and NCCL raise RuntimeError subclasses
        lost = e
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    why = f"a rank died, or did not finish {what} within the collective timeout"
    if error is not None:  # this rank's own error says more than the lost collective
        error.add_note(f"rank {rank} of {world} could not tell the other ranks of this error: "
                       f"{why} ({type(lost).__name__}: {lost})")
        raise error
    raise RankError(f"rank {rank} of {world} finished {what}, but could not learn whether "
                    f"the other ranks did: {why} (the {type(lost).__name__} above). Look for "
                    f"the first error in the other ranks' logs; if {what} only takes longer "
                    f"than the timeout, raise it ({TIMEOUT_ENV}, or the timeout of "
                    f"init_process_group for a process group of your own)") from lost


@contextlib.contextmanager
def agreed(what: str, group: dist.ProcessGroup | None = None) -> Iterator[None]:
    """Run the block on every rank of ``group`` (default: the world), then raise on
    every rank the exception of the first rank whose block raised (see
    :func:`first_failure`), with a note naming that rank and ``what`` it was doing
    ("planning", ...). The failing rank raises its own exception object; the others a
    copy whose cause shows the original traceback (:func:`shared_error`). Catches
    :class:`Exception` only: an interrupt or ``SystemExit`` leaves at once, and the
    others learn of it through the collective timeout."""
    error: Exception | None = None
    try:
        yield
    except Exception as e:  # noqa: BLE001 - every error is shared, whatever its type
        error = e
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    mine = describe(error, rank) if error is not None else None
    outcomes = _gather(mine, error, what, group)
    first = first_failure(outcomes)
    if first is None:
        return
    failed = [f.rank for f in outcomes if f is not None]
    if error is None or first.rank != rank:
        raise shared_error(first, failed, world, what)
    if first.pickled is None:
        raise _untravelled(first, world, what) from error
    error.add_note(note(first, failed, world, what))
    raise error


def collective_timeout(timeout_s: float | None = None) -> datetime.timedelta:
    """How long the collectives of a process group autopar starts wait for a peer:
    ``timeout_s`` when given, else the environment variable :data:`TIMEOUT_ENV`, else
    :data:`COLLECTIVE_TIMEOUT_S`. Raises ConfigError for a value that is not a finite
    positive number of seconds."""
    source = "collective_timeout_s"
    value: object = timeout_s
    if timeout_s is None:
        text = os.environ.get(TIMEOUT_ENV, "").strip()
        source, value = TIMEOUT_ENV, COLLECTIVE_TIMEOUT_S
        if text:
            try:
                value = float(text)
            except ValueError:
                value = text
        else:
            source = "COLLECTIVE_TIMEOUT_S"
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{source}={value!r}: expected a finite positive number of seconds "
                          f"that a collective waits for a peer (default "
                          f"{COLLECTIVE_TIMEOUT_S:.0f})")
    return datetime.timedelta(seconds=float(value))
