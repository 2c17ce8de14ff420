"""torch ``Work`` objects for procgroup's operations, and the per-group executor that runs async ones.

Every method of the backend returns a :class:`Work`.  Its future (``get_future()``) carries the op's result
tensors, as gloo's does (DDP's reducer and comm hooks read ``fut.value()``), and completes on its own, whether
or not anyone calls ``wait()``.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import weakref
from datetime import timedelta
from typing import Any, Callable, List, Optional

import torch
import torch.distributed as dist

from ._core import DistTimeoutError, p2p_source

__all__ = ["Executor", "P2PWork", "Work", "seconds"]

logger = logging.getLogger("procgroup.torch")


def seconds(timeout: Any) -> Optional[float]:
    """``timeout`` (timedelta, seconds or None) in seconds; None for "not given" (None, zero or negative).

    torch passes ``timedelta(0)`` for "no timeout" and ``-1 ms`` for "unset"; both mean "use the default".
    """
    if timeout is None:
        return None
    t = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    return t if t > 0 else None


class _Done:
    """Stands in for the threading.Event of a Work that was complete when created."""

    @staticmethod
    def is_set() -> bool:
        return True

    @staticmethod
    def wait(timeout: Optional[float] = None) -> bool:
        return True

    @staticmethod
    def set() -> None:
        return None


class _NoLock:
    """Stands in for the lock of a Work that was complete when created (nothing changes any more)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_DONE = _Done()
_NO_LOCK = _NoLock()


class Work(dist.Work):
    """A torch Work for one procgroup operation.

    ``op``: the operation's name (for messages).  ``result``: the tensors the future carries.
    ``default_wait``: seconds a ``wait()`` without timeout waits at most (the op's own deadline plus a margin;
    the op raises procgroup's deadline error before that).  Completed by :meth:`complete`.
    """

    def __init__(self, op: str, result: List[Any], default_wait: float, done: bool = False) -> None:
        super().__init__()
        self._op = op
        self._result = result
        self._default_wait = default_wait
        self._exc: Optional[BaseException] = None
        self._future: Optional[torch.futures.Future] = None
        self._source = -1
        #: set when the op finished; a Work born done (a blocking op's) needs no event or lock
        self._event = _DONE if done else threading.Event()
        self._lock = _NO_LOCK if done else threading.Lock()

    # -- completion (by the executor or the op itself) ------------------------------------------
    def complete(self, exc: Optional[BaseException] = None) -> None:
        """Mark the op done (failed with ``exc`` when given) and complete the future."""
        with self._lock:
            self._exc = exc
            self._event.set()
            fut = self._future
        if fut is not None:
            self._settle(fut)

    def _settle(self, fut: torch.futures.Future) -> None:
        if self._exc is not None:
            fut.set_exception(self._exc)
        else:
            fut.set_result(self._result)

    # -- torch's Work interface ------------------------------------------------------------
    def wait(self, timeout: Any = None) -> bool:
        """Block until the op is done; raise its error.  ``timeout`` (timedelta or seconds) bounds this wait."""
        t = seconds(timeout)
        limit = self._default_wait if t is None else t
        if not self._event.wait(limit):
            raise DistTimeoutError(
                f"Work.wait: {self._op} did not complete within {limit:.2f}s; pass a longer wait(timeout=...) "
                "or check the other ranks"
            )
        if self._exc is not None:
            raise self._exc
        return True

    def is_completed(self) -> bool:
        """True once the op finished (successfully or not)."""
        return self._event.is_set()

    def is_success(self) -> bool:
        """True once the op finished without error."""
        return self._event.is_set() and self._exc is None

    def exception(self) -> Optional[BaseException]:
        """The op's error, or None."""
        return self._exc

    def result(self) -> List[Any]:
        """The result tensors (waits first)."""
        self.wait()
        return self._result

    def synchronize(self) -> None:
        """Same as :meth:`wait` (CPU ops have no stream to synchronize)."""
        self.wait()

    def source_rank(self) -> int:
        """The sender's rank, for a receive from any source."""
        self.wait()
        return self._source

    def _source_rank(self) -> int:
        return self.source_rank()

    def get_future(self) -> torch.futures.Future:
        """A future completed with the result tensors (a list) when the op finishes, or with its error."""
        with self._lock:
            if self._future is None:
                self._future = torch.futures.Future()
                if self._event.is_set():
                    self._settle(self._future)
            return self._future


class P2PWork(Work):
    """A torch Work over a procgroup point-to-point request (no thread until someone asks for the future)."""

    def __init__(
        self, op: str, result: List[Any], inner: Any, default_wait: float, after: Optional[Callable[[], None]] = None
    ) -> None:
        super().__init__(op, result, default_wait)
        self._inner = inner
        self._after = after
        self._wait_lock = threading.Lock()

    def _finish_inner(self, timeout: Optional[float]) -> None:
        with self._wait_lock:
            if self._event.is_set():
                return
            try:
                self._inner.wait(timeout)
            except DistTimeoutError as e:
                if timeout is not None and not self._inner.is_completed():
                    raise  # only this short wait ran out: the op is still pending
                self.complete(e)
                return
            except BaseException as e:  # noqa: BLE001 - kept for wait() and the future
                self.complete(e)
                return
            src = p2p_source(self._inner)
            if src is not None:
                self._source = src
            try:
                if self._after is not None:
                    self._after()
            except BaseException as e:  # noqa: BLE001 - kept for wait() and the future
                self.complete(e)
                return
            self.complete()

    def wait(self, timeout: Any = None) -> bool:
        """Block until the transfer is done; raise its error.  ``timeout`` bounds this wait only."""
        self._finish_inner(seconds(timeout))
        return super().wait(0.001 if self._event.is_set() else None)

    def is_completed(self) -> bool:
        """True once the transfer finished (polls the request)."""
        if not self._event.is_set() and self._inner.is_completed():
            try:
                self._finish_inner(None)
            except BaseException as e:  # noqa: BLE001 - kept for wait()
                logger.debug("procgroup.torch: %s failed: %s", self._op, e)
        return self._event.is_set()

    def get_future(self) -> torch.futures.Future:
        """A future completed when the transfer finishes (a helper thread waits for it)."""
        fut = super().get_future()
        if not self._event.is_set():
            threading.Thread(target=self._quiet_finish, name=f"procgroup-torch-{self._op}", daemon=True).start()
        return fut

    def _quiet_finish(self) -> None:
        try:
            self._finish_inner(None)
        except BaseException as e:  # noqa: BLE001 - kept for wait() and the future
            logger.debug("procgroup.torch: %s failed: %s", self._op, e)


#: every Executor with a live thread, closed at interpreter exit (see :func:`_close_all_at_exit`)
_LIVE: "weakref.WeakSet[Executor]" = weakref.WeakSet()


class Executor:
    """One worker thread per group that runs its async ops in call order.

    A blocking op first waits for the async ops queued before it (:meth:`drain`), so every rank issues
    the group's collectives in program order.  At interpreter exit the queued ops are run to the end (bounded
    wait) before Python finalizes: a daemon thread still inside torch then aborted the process (exit 134,
    "terminate called without an active exception") when a script exited with async ops queued and no
    ``destroy_process_group()``.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: "queue.Queue[Any]" = queue.Queue()
        self._thread: Optional[threading.Thread] = None
        self._tail: Optional[Work] = None
        self._lock = threading.Lock()

    def submit(self, work: Work, fn: Callable[[], None]) -> Work:
        """Run ``fn()`` on the worker after everything queued before; complete ``work`` with its outcome."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"procgroup-torch-{self._name}", daemon=True)
                self._thread.start()
                _LIVE.add(self)
            self._tail = work
            self._queue.put((work, fn))
        return work

    def busy(self) -> bool:
        """True while an op queued here has not finished."""
        tail = self._tail
        return tail is not None and not tail.is_completed()

    def drain(self) -> None:
        """Wait for every queued op to finish (their errors stay with their Works).

        Each op has its own deadline, so this returns; DistTimeoutError if the last one outlives its bound.
        """
        tail = self._tail
        if tail is not None and not tail.is_completed() and not tail._event.wait(tail._default_wait):
            raise DistTimeoutError(
                f"{self._name}: the async {tail._op} queued before this op did not finish within "
                f"{tail._default_wait:.0f}s; check the other ranks, or raise the group's timeout"
            )

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            work, fn = item
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - handed to the waiter and the future
                work.complete(e)
            else:
                work.complete()

    def close(self) -> None:
        """Stop the worker after the queued ops (bounded wait)."""
        with self._lock:
            t, self._thread = self._thread, None
        if t is not None:
            self._queue.put(None)
            t.join(timeout=5.0)


@atexit.register
def _close_all_at_exit() -> None:
    """Let every executor finish its queued ops (each bounded by :meth:`Executor.close`) before finalization."""
    for ex in list(_LIVE):
        try:
            ex.close()
        except Exception as e:  # noqa: BLE001 - exiting: report and go on
            logger.info("procgroup.torch: closing %s at exit: %s", ex._name, e)
