"""Peer liveness for the shared-memory transport: is a local peer's process still alive?

A waiter checks its peers at every sleep slice (~50 ms): through a pidfd
(``pidfd_open`` + ``poll``, no syscall per peer) where the kernel has one,
else through :func:`procgroup.procfs.pid_alive`.  A peer in another pid
namespace cannot be watched by pid; only its segment's closed state tells.
"""

from __future__ import annotations

import errno
import os
import select
from typing import Dict, List, Optional

from ...procfs import namespace_inode, pid_alive

__all__ = ["PeerWatch", "pid_namespace"]


def pid_namespace() -> Optional[int]:
    """This process's pid namespace (an inode number), or None where /proc does not say."""
    return namespace_inode("pid")


class PeerWatch:
    """Watches peer processes; :meth:`dead` lists the watched peers that have exited.

    ``pids`` maps every added peer to its pid (0 when unknown), watched or not.
    """

    def __init__(self) -> None:
        self._poll = select.poll()
        self._fd_peer: Dict[int, int] = {}
        self._procs: Dict[int, int] = {}  # peer -> pid, for the /proc fallback
        self.pids: Dict[int, int] = {}

    def add(self, peer: int, pid: int, same_pidns: bool) -> None:
        """Watch rank ``peer`` (process ``pid``); a pid from another namespace, or our own pid, is not watched."""
        self.pids[peer] = pid
        if not same_pidns or pid <= 0:
            return
        if pid == os.getpid():
            return  # ranks as threads of this process: alive as long as we are
        fd = -1
        if hasattr(os, "pidfd_open"):
            try:
                fd = os.pidfd_open(pid)
            except OSError as e:
                if e.errno == errno.ESRCH:
                    self._procs[peer] = pid  # already gone: the /proc check will say so
                    return
                fd = -1
        if fd >= 0:
            self._fd_peer[fd] = peer
            self._poll.register(fd, select.POLLIN)
        else:
            self._procs[peer] = pid

    def dead(self) -> List[int]:
        """The watched peers whose process has exited (or is a zombie); never blocks."""
        out: List[int] = []
        if self._fd_peer:
            for fd, _ev in self._poll.poll(0):
                p = self._fd_peer.get(fd)
                if p is not None:
                    out.append(p)
        for p, pid in self._procs.items():
            if not pid_alive(pid):
                out.append(p)
        return out

    def forget(self, peer: int) -> None:
        """Stop watching ``peer`` (closing its pidfd); its pid stays in ``pids``."""
        for fd, p in list(self._fd_peer.items()):
            if p == peer:
                self._poll.unregister(fd)
                del self._fd_peer[fd]
                os.close(fd)
        self._procs.pop(peer, None)

    def close(self) -> None:
        """Close every pidfd and stop watching everyone."""
        for fd in list(self._fd_peer):
            try:
                os.close(fd)
            except OSError:
                pass
        self._fd_peer.clear()
        self._procs.clear()
