"""Event-driven waiting for the launcher's main loops (the node agent and the head node).

``signal.set_wakeup_fd`` turns every signal (SIGCHLD included) into a byte on a pipe, so a main loop
can block in ``select`` until a child exits, the user presses Ctrl-C, a SIGUSR1 arrives, or another
thread calls :meth:`SignalWaiter._poke` -- with no polling.
"""

from __future__ import annotations

import os
import select
import signal
import threading
import time
from typing import Optional

__all__ = ["FORWARDED", "SignalWaiter"]

#: signals the launcher passes on to its workers (then tears the job down)
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class SignalWaiter:
    """Mixin: ``_signals`` collects forwarded signals, ``_usr1`` counts SIGUSR1s; call ``_init_signals`` first."""

    def _init_signals(self) -> None:
        self._signals: list[int] = []
        self._usr1 = 0  # SIGUSR1s received (or relayed by the head) to pass on to the workers
        self._wake_r: Optional[int] = None
        self._wake_w: Optional[int] = None
        self._saved_handlers: dict[int, object] = {}
        self._saved_wakeup: Optional[int] = None

    def _install_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # embedded use: no handlers; waits fall back to short timeouts
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        self._wake_r, self._wake_w = r, w
        self._saved_wakeup = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        for sig in (*FORWARDED, signal.SIGCHLD, signal.SIGUSR1):
            self._saved_handlers[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        if signum == signal.SIGUSR1:
            self._usr1 += 1
        elif signum != signal.SIGCHLD:
            self._signals.append(signum)

    def _restore_signals(self) -> None:
        for sig, h in self._saved_handlers.items():
            signal.signal(sig, h)  # type: ignore[arg-type]  # a saved handler may be None
        self._saved_handlers.clear()
        if self._wake_w is not None:
            signal.set_wakeup_fd(self._saved_wakeup if self._saved_wakeup is not None else -1)
            for fd in (self._wake_r, self._wake_w):
                if fd is not None:
                    os.close(fd)
            self._wake_r = self._wake_w = None

    def _poke(self) -> None:
        """Wake the main loop from another thread (the gang watcher, the stdin watcher, an output pump)."""
        w = self._wake_w
        if w is not None:
            try:
                os.write(w, b"\0")
            except OSError:
                pass

    def _wake(self, timeout: float) -> None:
        """Block until a signal arrives (SIGCHLD included), a thread pokes us, or ``timeout`` seconds pass."""
        if self._wake_r is None:
            time.sleep(min(timeout, 0.05))
            return
        try:
            ready, _, _ = select.select([self._wake_r], [], [], max(0.0, timeout))
        except InterruptedError:  # pragma: no cover - PEP 475 retries, kept for safety
            return
        if ready:
            try:
                while os.read(self._wake_r, 4096):
                    pass
            except BlockingIOError:
                pass
