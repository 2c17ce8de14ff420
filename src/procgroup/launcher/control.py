"""The control link between the head node and the agents it starts over ssh (the I/O around
:mod:`procgroup.protocol.control`, which alone parses the messages).

Head -> agent, on the ssh session's stdin: a :class:`~procgroup.protocol.control.Hello` line (secret
and nonce), then a :class:`~procgroup.protocol.control.Usr1` line per SIGUSR1; EOF means "stop".
Agent -> head, on its stdout, between the workers' output: ``CTL_MARK + nonce + " " + line`` for
:class:`~procgroup.protocol.control.PortAnnounce` and :class:`~procgroup.protocol.control.Report`;
the nonce keeps a worker from forging one.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import sys
from typing import Callable, Optional

from ..deadline import Deadline
from ..errors import ConfigError
from ..protocol.control import (
    HELLO_MAX_LINE,
    ControlDecoder,
    ControlMessage,
    ControlMessageError,
    Hello,
    Usr1,
    decode_line,
    encode,
)

__all__ = ["CTL_MARK", "HELLO_TIMEOUT", "read_hello", "die_with_session", "watch_stdin", "agent_line", "HeadLink"]

#: Control lines an agent started by a head node writes on its stdout: ``CTL_MARK + nonce + " " + JSON``.
CTL_MARK = "#procgroup-ctl:"
#: How long an agent started with --from-head waits for the head's hello line.
HELLO_TIMEOUT = 30.0
_PR_SET_PDEATHSIG = 1


def read_hello(fd: int, timeout: float = HELLO_TIMEOUT) -> Hello:
    """Read the head's hello line from ``fd`` (the agent's stdin), waiting at most ``timeout`` seconds.

    Only the first line is consumed from the decoder (bytes after it in the same read are dropped,
    as the head writes nothing more before the agent answers).  Raises :class:`ConfigError` when
    no line comes in time, stdin closes first, or the line is not a hello.
    """
    dec = ControlDecoder(max_line=HELLO_MAX_LINE)
    deadline = Deadline.after(timeout)
    while True:
        try:
            msg = dec.next_message()
        except ControlMessageError as e:
            if "longer than" in str(e):
                raise ConfigError("--from-head: the hello line on stdin is too long") from None
            raise ConfigError("--from-head: stdin did not start with the head node's hello line") from None
        if msg is not None:
            if not isinstance(msg, Hello):
                raise ConfigError("--from-head: stdin did not start with the head node's hello line")
            return msg
        r, _, _ = select.select([fd], [], [], max(0.0, deadline.remaining()))
        if not r:
            raise ConfigError(
                f"--from-head: no hello line from the head node on stdin within {timeout:g}s "
                "(--from-head is for agents the head node starts over ssh)"
            )
        chunk = os.read(fd, 4096)
        if not chunk:
            raise ConfigError("--from-head: stdin closed before the head node's hello line")
        dec.receive_data(chunk)


def die_with_session() -> None:
    """An agent started over ssh: get SIGTERM when the ssh session (our parent) dies, even if it never
    closes our stdin (PR_SET_PDEATHSIG, Linux only).  Raises :class:`ConfigError` when the session is
    already gone (we were re-parented to init)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if os.getppid() == 1:
        raise ConfigError("--from-head: the ssh session is already gone")


def watch_stdin(fd: int, on_usr1: Callable[[], None]) -> None:
    """Read the head's messages from ``fd`` until EOF or a read error, calling ``on_usr1`` for each
    :class:`~procgroup.protocol.control.Usr1`; malformed or unexpected lines are ignored.  Returns
    when the session's stdin ends (the caller then stops the job)."""
    dec = ControlDecoder(max_line=HELLO_MAX_LINE)
    try:
        while True:
            chunk = os.read(fd, 4096)
            if not chunk:
                return
            dec.receive_data(chunk)
            while True:
                try:
                    msg = dec.next_message()
                except ControlMessageError:
                    continue
                if msg is None:
                    break
                if isinstance(msg, Usr1):
                    on_usr1()
    except OSError:
        return


def agent_line(nonce: str, msg: ControlMessage) -> bytes:
    """The stdout line an agent writes to tell the head ``msg`` (marked with the head's ``nonce``)."""
    return f"{CTL_MARK}{nonce} ".encode() + encode(msg)


class HeadLink:
    """The head node's end of the link: what it writes to every agent, and recognising the agents' lines."""

    def __init__(self, nonce: str) -> None:
        self.nonce = nonce
        self._mark = f"{CTL_MARK}{nonce} ".encode()

    def hello(self, secret: str) -> bytes:
        """The first line for an agent's stdin."""
        return encode(Hello(secret=secret, nonce=self.nonce))

    @staticmethod
    def usr1() -> bytes:
        """The line asking an agent to pass SIGUSR1 on to its workers."""
        return encode(Usr1())

    def is_control(self, line: bytes) -> bool:
        """Whether ``line`` (from an agent's stdout) is a control line of this job (never shown to the user)."""
        return line.startswith(self._mark)

    def parse(self, line: bytes) -> Optional[ControlMessage]:
        """The message in a control line; None for a malformed one (it is dropped, as before)."""
        try:
            return decode_line(line[len(self._mark) :])
        except ControlMessageError:
            return None
