"""The control link's I/O shell (procgroup.launcher.control) over real pipes."""

from __future__ import annotations

import os
import threading

import pytest

from procgroup.errors import ConfigError
from procgroup.launcher.control import CTL_MARK, HeadLink, agent_line, read_hello, watch_stdin
from procgroup.protocol.control import HELLO_MAX_LINE, Hello, PortAnnounce, Report, encode


@pytest.fixture
def pipe():
    r, w = os.pipe()
    yield r, w
    for fd in (r, w):
        try:
            os.close(fd)
        except OSError:
            pass


def test_hello_written_by_the_head_is_read_by_the_agent(pipe):
    r, w = pipe
    link = HeadLink("n0nce")
    data = link.hello("s3cret")
    for i in range(len(data)):  # byte by byte through the pipe is the same
        os.write(w, data[i : i + 1])
    assert read_hello(r, 5.0) == Hello(secret="s3cret", nonce="n0nce")


@pytest.mark.parametrize(
    "data, what",
    [
        (b"", "closed before"),
        (b"garbage\n", "did not start with"),
        (b'{"event":"usr1"}\n', "did not start with"),
        (b"x" * (HELLO_MAX_LINE + 10), "too long"),
    ],
)
def test_bad_hello_is_a_config_error(pipe, data, what):
    r, w = pipe

    def write() -> None:  # a thread: more than a pipe's buffer would block this one
        os.write(w, data)
        if what == "closed before":
            os.close(w)

    t = threading.Thread(target=write, daemon=True)
    t.start()
    with pytest.raises(ConfigError, match=what):
        read_hello(r, 5.0)
    os.close(r)  # unblocks the writer of the over-long line
    t.join(5.0)


def test_no_hello_in_time(pipe):
    r, _w = pipe
    with pytest.raises(ConfigError, match="no hello line"):
        read_hello(r, 0.05)


def test_watch_stdin_counts_usr1_ignores_junk_and_returns_at_eof(pipe):
    r, w = pipe
    os.write(w, HeadLink.usr1() + b"junk\n" + HeadLink.usr1()[:3])
    os.write(w, HeadLink.usr1()[3:])
    os.close(w)
    calls = []
    watch_stdin(r, lambda: calls.append(1))
    assert calls == [1, 1]


def test_agent_lines_are_recognised_only_with_the_nonce():
    link = HeadLink("abc")
    line = agent_line("abc", PortAnnounce(port=1234))
    assert line.startswith(CTL_MARK.encode()) and line.endswith(b"\n")
    assert link.is_control(line) and link.parse(line) == PortAnnounce(port=1234)
    rep = Report(node=0, host="h", exit_code=1, result={"run_id": "r"})
    assert link.parse(agent_line("abc", rep)) == rep
    assert not link.is_control(agent_line("other", PortAnnounce(port=1)))
    assert not link.is_control(encode(PortAnnounce(port=1)))
    assert link.parse(f"{CTL_MARK}abc not json\n".encode()) is None
