"""Torch Works as procgroup's requests: the point-to-point ops of the nccl backend's engine (see ``engine``)."""

from __future__ import annotations

import threading
from typing import Any, Optional

from ...transport.base import Request, Status

__all__ = ["TorchRequest", "pollable"]


class TorchRequest(Request):
    """A torch Work of a point-to-point op as a procgroup Request (``Status.source``: a global rank)."""

    __slots__ = ("eng", "group", "work", "peer", "nbytes", "what", "keep", "status", "error")

    def __init__(self, eng: Any, group: Any, work: Any, peer: int, nbytes: int, what: str) -> None:
        self.eng = eng
        self.group = group
        self.work = work
        self.peer = peer
        self.nbytes = nbytes
        self.what = what
        self.keep: Any = None  # tensors the op reads or writes: alive until it completes
        self.status: Optional[Status] = None
        self.error: Optional[BaseException] = None

    def test(self) -> bool:
        if self.status is not None or self.error is not None:
            return True
        try:
            done = bool(self.work.is_completed())
        except Exception as e:  # noqa: BLE001 - torch's error, translated
            self.error = self.eng.torch_error(e, self.what)
            return True
        if done:
            self._finish()
        return done

    def _finish(self) -> None:
        try:
            self.work.wait()
        except Exception as e:  # noqa: BLE001 - torch's error, translated
            self.error = self.eng.torch_error(e, self.what)
            return
        self.status = Status(self.peer, self.nbytes)

    def wait(self, deadline: Any = None) -> Status:
        if self.status is None and self.error is None:
            self.eng.wait(self.group, self.work, deadline, lambda: self.what, peers=(self.peer,), abort=False)
            self._finish()
        if self.error is not None:
            raise self.error
        assert self.status is not None
        return self.status


class _WaitedWork:
    """A torch Work whose ``is_completed`` says nothing until ``wait()`` ran (gloo's send and receive): a daemon
    thread waits on it, so polling it works as for NCCL's."""

    __slots__ = ("work", "done", "error")

    def __init__(self, work: Any) -> None:
        self.work = work
        self.done = threading.Event()
        self.error: Optional[BaseException] = None
        threading.Thread(target=self._run, name="procgroup-gloo-p2p", daemon=True).start()

    def _run(self) -> None:
        try:
            self.work.wait()
        except BaseException as e:  # noqa: BLE001 - handed to the poller
            self.error = e
        self.done.set()

    def is_completed(self) -> bool:
        return self.done.is_set()

    def wait(self) -> None:
        self.done.wait()
        if self.error is not None:
            raise self.error


def pollable(kind: str, work: Any) -> Any:
    """``work`` made pollable with ``is_completed``: gloo's send, receive and reduce_scatter complete only inside
    ``wait()``, so a daemon thread waits for them; NCCL's (CUDA events) are returned as they are."""
    return _WaitedWork(work) if kind == "gloo" else work
