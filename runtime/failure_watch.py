"""One outcome on every rank while training: a failure on one rank inside a guarded call
(``ParallelModel.step``, ``pm(x)``, a checkpoint save) is raised on every rank within
seconds, naming that rank, with no collective when nothing fails.

:class:`FailureWatch` keeps one key in the job's store. The first rank whose guarded
call raises (:meth:`FailureWatch.guard`) writes its failure there and cuts its
connections (:func:`autopar.runtime.connections.break_connections`); a thread on every
rank polls the key every :data:`POLL_S` seconds and cuts its own, so that a rank
waiting in a collective for the failed one stops waiting and raises the failed rank's
exception with a note naming it (:func:`autopar.runtime.agree.shared_error`). The
process groups are unusable afterwards: the job ends, or torchrun restarts it. How it
differs from :func:`autopar.runtime.agree.agreed`: docs/runtime.md, section
``autopar.runtime.failure_watch``.
"""

from __future__ import annotations

import base64
import contextlib
import pickle
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch.distributed as dist

from autopar.runtime.agree import Failure, describe, note, shared_error
from autopar.runtime.connections import break_connections, job_store, store_port

__all__ = ["POLL_S", "KEY", "Posted", "FailureWatch"]

POLL_S = 0.5
"""Seconds between two looks of a rank's watch thread at the store: a waiting rank
stops waiting at most this long after the failure is posted. One small request per
rank each time, to the store's server (torchrun's TCPStore serves tens of thousands a
second), none on the training path."""

KEY = "first"
"""The key, under a watch's prefix, that holds the first failure."""

SHARED = "_autopar_shared"
"""The attribute that marks an exception a guard has shared (an outer guard lets it
pass as it is)."""


@dataclass(frozen=True)
class Posted:
    """A failure as the store holds it: what the failed rank was doing, and how it
    failed (:class:`~autopar.runtime.agree.Failure`)."""

    what: str
    failure: Failure

    def encode(self) -> str:
        """Text for the store (``compare_set`` takes strings)."""
        return base64.b64encode(pickle.dumps(self)).decode("ascii")

    @staticmethod
    def decode(text: bytes | str) -> "Posted":
        """The record :meth:`encode` wrote (the store holds only what autopar writes)."""
        return pickle.loads(base64.b64decode(text))


class FailureWatch:
    """The failure key of one :class:`~autopar.runtime.ParallelModel` in the job's
    store, and the thread that watches it (started by the first :meth:`guard`).

    Args:
        store: the store, under a prefix of this watch's own (:meth:`for_job`).
        rank, world: this rank and the job's size.
        groups: process groups to abort when a failure is seen (NCCL's; gloo's
            connections are cut whatever the group).
        port: the store's TCP port, whose connections are kept.
    """

    def __init__(self, store: dist.Store, rank: int, world: int,
                 groups: list[dist.ProcessGroup], port: int | None) -> None:
        self.store, self.rank, self.world = store, rank, world
        self.groups, self.port = groups, port
        self.seen: Posted | None = None  # another rank's failure, once the thread saw it
        self._stop = threading.Event()
        self._cut_once = threading.Lock()
        self._cut = False
        self._thread: threading.Thread | None = None

    @classmethod
    def for_job(cls, groups: list[dist.ProcessGroup]) -> "FailureWatch | None":
        """A watch for the running job (None outside one, or for a world of 1). Each
        rank's k-th watch shares the prefix ``autopar/failure/k/`` with the other
        ranks' k-th, so every rank must build its models in the same order (as
        ``parallelize`` and ``apply_plan`` need anyway)."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return None
        base, rank = job_store(), dist.get_rank()
        k = base.add(f"autopar/watches/rank-{rank}", 1)
        return cls(dist.PrefixStore(f"autopar/failure/{k}/", base), rank,
                   dist.get_world_size(), [g for g in groups if _not_gloo(g)],
                   store_port(base))

    @contextlib.contextmanager
    def guard(self, what: str) -> Iterator[None]:
        """Run the block; when it raises, or another rank failed before or during it,
        raise the first failure on this rank (its own exception object where it is this
        rank's) with a note naming the rank and ``what`` it was doing."""
        self._start()
        self._raise_seen()
        try:
            yield
        except Exception as error:  # noqa: BLE001 - every failure is shared
            if getattr(error, SHARED, False):  # an inner guard's: shared already
                raise
            posted = self._post(Posted(what, describe(error, self.rank)))
            self.cut()
            first = posted.failure
            if first.rank != self.rank:
                raise _shared(first, self.world, posted.what)
            error.add_note(note(first, [first.rank], self.world, what))
            setattr(error, SHARED, True)
            raise
        self._raise_seen()

    def _raise_seen(self) -> None:
        """Raise another rank's failure the thread has seen (a rank that finished its
        own call while the other failed must not go on)."""
        seen = self.seen
        if seen is not None:
            raise _shared(seen.failure, self.world, seen.what)

    def _post(self, mine: Posted) -> Posted:
        """Write ``mine`` as the first failure unless one is there; the first failure."""
        try:
            return Posted.decode(self.store.compare_set(KEY, "", mine.encode()))
        except Exception:  # noqa: BLE001 - the store is gone: this rank's own is all it knows
            return mine

    def cut(self) -> None:
        """Cut this rank's connections, once (see :mod:`autopar.runtime.connections`)."""
        with self._cut_once:
            if not self._cut:
                self._cut = True
                break_connections(self.groups, self.port)

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="autopar-failure-watch",
                                            daemon=True)
            self._thread.start()

    def _watch(self) -> None:
        """The thread: every POLL_S seconds look for another rank's failure; on one,
        record it and cut this rank's connections. Ends at :meth:`close`, or when the
        store is gone."""
        store = self.store.clone() if hasattr(self.store, "clone") else self.store
        while not self._stop.wait(POLL_S):
            try:
                if not store.check([KEY]):
                    continue
                posted = Posted.decode(store.get(KEY))
            except Exception:  # noqa: BLE001 - the job's store has closed
                return
            if posted.failure.rank != self.rank:
                self.seen = posted
                self.cut()
            return

    def close(self) -> None:
        """Stop the thread (the model is gone)."""
        self._stop.set()


def _shared(first: Failure, world: int, what: str) -> Exception:
    """:func:`~autopar.runtime.agree.shared_error` of ``first``, marked as shared."""
    error = shared_error(first, [first.rank], world, what)
    setattr(error, SHARED, True)
    return error


def _not_gloo(group: dist.ProcessGroup) -> bool:
    """Whether ``group`` runs on another backend than gloo (whose waits abort ends)."""
    try:
        return dist.get_backend(group) != "gloo"
    except Exception:  # noqa: BLE001 - a group already destroyed
        return False
