"""Work handles: what an ``async_op=True`` collective and a point-to-point op return (torch's ``Work``).

:class:`Work` is finished by the group's worker thread; :class:`P2PWork` waits on a transport request
under the op's deadline (probing for a dtype mismatch while it waits).  Split out of ``process_group``.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional

from .deadline import Deadline, wait_seconds
from .errors import BrokenError, CollectiveMismatchError, DistTimeoutError, ProcGroupError
from .transport.base import Request

__all__ = ["Work", "P2PWork", "BREAKING", "wait_now", "wait_probing"]

#: the errors after which a group's members are out of step (a later call could only hang or mismatch)
BREAKING = (DistTimeoutError, BrokenError, CollectiveMismatchError)

#: a receive that has not completed asks the transport about a dtype mismatch after this many seconds, then
#: at doubling intervals up to _PROBE_MAX (never on the fast path: a receive that completes in time)
_PROBE_FIRST = 0.002
_PROBE_MAX = 0.05


class Work:
    """Handle of an async operation (torch.distributed's Work)."""

    def __init__(self, op: str, group: Any) -> None:
        self.op = op
        self._group = group
        self._done = threading.Event()
        self._exc: Optional[BaseException] = None
        self._result: Any = None

    # called by the executor
    def _finish(self, result: Any = None, exc: Optional[BaseException] = None) -> None:
        self._result = result
        self._exc = exc
        self._done.set()

    def is_completed(self) -> bool:
        """True once the operation has finished (successfully or not)."""
        return self._done.is_set()

    def is_success(self) -> bool:
        """True once the operation has finished without an error."""
        return self._done.is_set() and self._exc is None

    def exception(self) -> Optional[BaseException]:
        """The operation's error, or None."""
        return self._exc

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Block until done; raise the op's error.  ``timeout`` (s or timedelta) bounds this wait."""
        timeout = wait_seconds(timeout)
        limit = timeout if timeout is not None else self._group.timeout + 5.0
        if not self._done.wait(limit):
            raise DistTimeoutError(
                f"Work.wait: async {self.op} in group {self._group.name} on rank {self._group.world.rank} "
                f"did not complete within {limit:.2f}s; pass a longer wait(timeout=...) or check the other ranks"
            )
        if self._exc is not None:
            raise self._exc
        return True

    def result(self) -> Any:
        """Wait, then return the operation's result."""
        self.wait()
        return self._result

    def synchronize(self) -> None:
        """Wait for the operation (torch's spelling)."""
        self.wait()

    def get_future(self) -> Any:
        """A :class:`~procgroup.futures.Future` resolved when this Work finishes; its value is :meth:`result`."""
        from .futures import Future

        return Future(self)


class P2PWork(Work):
    """Work over transport requests (isend/irecv): no thread involved."""

    def __init__(
        self,
        op: str,
        group: Any,
        req: Request,
        deadline: Deadline,
        finish: Callable[[Any], Any],
        ctx: Any,
        probe: Optional[Callable[[], Optional[BaseException]]] = None,
    ) -> None:
        """``ctx``: what the op is, for its error messages (a str, or a callable making it only when needed)."""
        super().__init__(op, group)
        self._req = req
        self._probe = probe
        self._deadline = deadline
        self._finish_fn = finish
        self._ctx = ctx
        self._lock = threading.Lock()

    def is_completed(self) -> bool:
        """True once the operation has finished (successfully or not)."""
        if not self._done.is_set() and self._req.test():
            try:
                self.wait(0)
            except Exception:  # noqa: BLE001 - error is kept and raised by wait()
                pass
        return self._done.is_set()

    def _fail(self, e: ProcGroupError, dl: Deadline) -> None:
        err = self._group._context(e, self.op, None, dl, _text(self._ctx))
        if isinstance(err, BREAKING):  # a message may still arrive and match a later receive: refuse those
            self._group.mark_broken(err, self.op, None)
        self._finish(exc=err)

    def wait(self, timeout: Optional[float] = None) -> bool:
        with self._lock:
            if not self._done.is_set():
                timeout = wait_seconds(timeout)
                dl = self._deadline if timeout is None else self._deadline.sooner(timeout)
                try:
                    st = self._req.wait(dl) if self._probe is None or self._req.test() else self._wait_probing(dl)
                except DistTimeoutError as e:
                    if timeout is not None and not self._deadline.expired():
                        raise  # the caller's short wait; the op itself is still pending
                    self._fail(e, dl)
                except ProcGroupError as e:
                    self._fail(e, dl)
                else:
                    self._finish(result=self._finish_fn(st))
        if self._exc is not None:
            raise self._exc
        return True

    def _wait_probing(self, dl: Deadline) -> Any:
        """Wait for the request; while it waits, ask ``probe`` for an error (first after _PROBE_FIRST)."""
        return wait_probing(self._req, dl, self._probe)


def _text(ctx: Any) -> str:
    return ctx if isinstance(ctx, str) else ctx()


def wait_probing(req: Request, dl: Deadline, probe: Optional[Callable[[], Optional[BaseException]]]) -> Any:
    """Wait for ``req``; while it waits, ask ``probe`` for an error (first after _PROBE_FIRST, then doubling)."""
    step = _PROBE_FIRST
    while True:
        try:
            return req.wait(dl.sooner(step))
        except DistTimeoutError:
            if dl.expired():
                raise
        err = probe() if probe is not None else None
        if err is not None:
            raise err
        step = min(step * 2, _PROBE_MAX)


def wait_now(
    group: Any,
    op: str,
    req: Request,
    dl: Deadline,
    finish: Callable[[Any], Any],
    ctx: Any,
    probe: Optional[Callable[[], Optional[BaseException]]] = None,
) -> Any:
    """A blocking point-to-point op without a Work: wait for ``req`` under ``dl``, return ``finish(status)``.

    Raises what :meth:`P2PWork.wait` raises (the error in the op's context; a breaking one breaks the group)."""
    try:
        st = req.wait(dl) if probe is None or req.test() else wait_probing(req, dl, probe)
    except ProcGroupError as e:
        err = group._context(e, op, None, dl, _text(ctx))
        if isinstance(err, BREAKING):  # a message may still arrive and match a later receive: refuse those
            group.mark_broken(err, op, None)
        raise err  # noqa: B904 - _context sets __cause__ itself
    return finish(st)
