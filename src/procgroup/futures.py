"""A small future over a :class:`~procgroup.process_group.Work` (torch's ``torch.futures.Future`` surface).

``work.get_future()`` returns a :class:`Future` whose value is the Work's result (the output tensors or
arrays of the collective, as :meth:`Work.result` gives them).  ``then(callback)`` chains: the callback
receives the finished future and its return value becomes the chained future's value.  Callbacks run in the
thread that first observes completion (``wait``/``value``/``done`` on the chained future), not on the
group's worker thread, so a callback can never stall other collectives of the group.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional

__all__ = ["Future"]

_UNSET = object()


class Future:
    """The result of an async operation: ``wait()``, ``value()``, ``done()`` and ``then()``.

    Built by :meth:`Work.get_future`; a chained future (``then``) wraps its parent future and a callback.
    Errors of the operation (or of a callback) are re-raised by ``wait()`` and ``value()``.
    """

    def __init__(self, work: Any = None, parent: Optional["Future"] = None, callback: Optional[Callable] = None):
        self._work = work
        self._parent = parent
        self._callback = callback
        self._lock = threading.Lock()
        self._value: Any = _UNSET
        self._exc: Optional[BaseException] = None

    def done(self) -> bool:
        """True once the operation (and, for a chained future, its parent) has finished; never blocks."""
        if self._work is not None:
            return bool(self._work.is_completed())
        assert self._parent is not None
        return self._parent.done()

    def wait(self) -> Any:
        """Block until done (bounded by the Work's deadline) and return the value; raises the op's error."""
        with self._lock:
            if self._value is _UNSET and self._exc is None:
                try:
                    if self._work is not None:
                        self._value = self._work.result()
                    else:
                        assert self._parent is not None and self._callback is not None
                        self._parent.wait()
                        self._value = self._callback(self._parent)
                except BaseException as e:  # noqa: BLE001 - kept and re-raised on every wait()
                    self._exc = e
        if self._exc is not None:
            raise self._exc
        return self._value

    def value(self) -> Any:
        """The value, waiting for it if needed (torch's ``Future.value``); raises the op's error."""
        return self.wait()

    def then(self, callback: Callable[["Future"], Any]) -> "Future":
        """A new future whose value is ``callback(self)``, run once this future has finished."""
        if not callable(callback):
            raise TypeError(f"Future.then needs a callable, got {type(callback).__name__}")
        return Future(parent=self, callback=callback)

    def __repr__(self) -> str:
        return f"<procgroup Future {'done' if self.done() else 'pending'}>"
