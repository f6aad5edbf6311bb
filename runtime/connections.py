"""The two things :mod:`autopar.runtime.failure_watch` needs that torch has no public
API for: the job's key-value store (:func:`job_store`) and a way to make a collective
that waits for a peer fail now (:func:`break_connections`).

torch 2.11 to 2.13: ``ProcessGroup.abort()`` ends NCCL's waits, but not gloo's (a gloo
collective waits on its TCP pairs until the peer process exits or the group's timeout
passes), so under gloo the process's end of those pairs is shut down. Details:
docs/runtime.md, section ``autopar.runtime.failure_watch``.
"""

from __future__ import annotations

import contextlib
import os
import socket

import torch.distributed as dist

__all__ = ["job_store", "store_port", "break_connections", "accepted_sockets"]

LISTEN = "0A"
"""The state column of a listening socket in ``/proc/net/tcp``."""


def job_store() -> dist.Store:
    """The store the default process group was started with (torchrun's TCPStore).
    Private API: ``torch.distributed.distributed_c10d._get_default_store`` (torch
    2.11-2.13)."""
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def _tcp_sockets() -> list[tuple[int, int, int, str]]:
    """(fd, local port, remote port, state) of this process's TCP sockets, from
    ``/proc`` (empty where there is none: not Linux)."""
    inodes: dict[int, int] = {}
    with contextlib.suppress(OSError):
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                link = os.readlink(f"/proc/self/fd/{fd}")
                if link.startswith("socket:["):
                    inodes[int(link[8:-1])] = int(fd)
    out = []
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            for line in f.read().splitlines()[1:]:
                cols = line.split()
                inode = int(cols[9])
                if inode in inodes:
                    out.append((inodes[inode], int(cols[1].rsplit(":", 1)[1], 16),
                                int(cols[2].rsplit(":", 1)[1], 16), cols[3]))
    return out


def accepted_sockets(keep_ports: set[int]) -> list[int]:
    """The file descriptors of this process's TCP connections accepted on one of its
    listening ports other than ``keep_ports`` (the store's): its end of the gloo
    pairs it accepted. Every pair is accepted by one of its two processes, so when
    each shuts down its own, every pair is cut."""
    found = _tcp_sockets()
    listening = {lp for _, lp, _, state in found if state == LISTEN} - keep_ports
    return [fd for fd, lp, rp, state in found
            if state != LISTEN and lp in listening and rp not in keep_ports]


def break_connections(groups: list[dist.ProcessGroup], store_port: int | None) -> int:
    """Make every collective of this process that waits for a peer fail now: abort
    ``groups`` (NCCL's waits end) and shut down this process's accepted gloo
    connections (gloo's end; the store's port ``store_port`` is kept). The process
    groups are unusable afterwards. Returns the connections shut down."""
    for group in groups:
        with contextlib.suppress(Exception):  # a group gloo cannot abort, or gone
            if dist.get_backend(group) != "gloo":
                group.abort()
    keep = {store_port} if store_port else set()
    count = 0
    for fd in accepted_sockets(keep):
        s = socket.socket(fileno=fd)
        try:
            s.shutdown(socket.SHUT_RDWR)
            count += 1
        except OSError:
            pass
        finally:
            s.detach()  # the fd stays gloo's
    return count


def store_port(store: dist.Store) -> int | None:
    """The TCP port of ``store`` (under its prefixes), or None for a store without one."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return getattr(store, "port", None)
