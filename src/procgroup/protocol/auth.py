"""Mutual HMAC challenge with the per-job secret, for the store and the TCP transport.

Wire format (all fixed sizes, so nothing unbounded is ever read)::

    server -> client : MAGIC(8) + server_nonce(32)
    client -> server : HMAC(secret, b"C" + server_nonce)(32) + client_nonce(32)
    server -> client : HMAC(secret, b"S" + client_nonce)(32)   or  b"\\0"*32 on failure

The server learns the client knows the secret before serving any request;
the client learns it talks to the real server.  The sans-IO part
(:class:`ServerHandshake`, :class:`ClientHandshake`) only transforms bytes;
:func:`server_handshake` / :func:`client_handshake` are the thin socket shell.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import socket
from typing import Mapping, Optional

from ..config import ENV, env_str
from ..deadline import Deadline
from ..errors import AuthenticationError, BrokenError, ConfigError, DistTimeoutError
from ..secretfile import secret_source

__all__ = [
    "MAGIC",
    "NONCE_LEN",
    "new_secret",
    "secret_from_env",
    "ServerHandshake",
    "ClientHandshake",
    "server_handshake",
    "client_handshake",
    "recv_exact",
    "describe_secret",
]

MAGIC = b"PGAUTH01"
NONCE_LEN = 32
MAC_LEN = 32
HELLO_LEN = len(MAGIC) + NONCE_LEN
REPLY_LEN = MAC_LEN + NONCE_LEN
_FAIL = b"\0" * MAC_LEN


def new_secret() -> str:
    """A fresh per-job secret (hex), as the launcher generates it."""
    return secrets.token_hex(32)


def secret_from_env(environ: Optional[Mapping[str, str]] = None, fallback: Optional[str] = None) -> bytes:
    """The job secret as bytes: PROCGROUP_SECRET, else ``fallback`` (e.g. derived from a job id)."""
    s = env_str(ENV.SECRET, environ)
    if s is None:
        s = fallback
    if s is None:
        raise ConfigError(
            f"no job secret: set {ENV.SECRET} to the same value on every rank "
            f"(e.g. export {ENV.SECRET}=$(python -c 'import secrets; print(secrets.token_hex(32))')), "
            "or start the job with `procgroup run`, which generates one"
        )
    return s.encode()


def _mac(secret: bytes, role: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret, role + nonce, hashlib.sha256).digest()


class ServerHandshake:
    """Sans-IO server side: ``hello()`` -> bytes; ``check(reply)`` -> bytes to send back."""

    def __init__(self, secret: bytes) -> None:
        self.secret = secret
        self.nonce = os.urandom(NONCE_LEN)

    def hello(self) -> bytes:
        return MAGIC + self.nonce

    def check(self, reply: bytes) -> bytes:
        """Verify the client's reply; returns the final message, raises AuthenticationError."""
        if len(reply) != REPLY_LEN:
            raise AuthenticationError(f"handshake reply has {len(reply)} bytes, expected {REPLY_LEN}")
        mac, client_nonce = reply[:MAC_LEN], reply[MAC_LEN:]
        if not hmac.compare_digest(mac, _mac(self.secret, b"C", self.nonce)):
            raise AuthenticationError("client did not prove the job secret")
        return _mac(self.secret, b"S", client_nonce)


class ClientHandshake:
    """Sans-IO client side: ``reply(hello)`` -> bytes; ``verify(final)``."""

    def __init__(self, secret: bytes) -> None:
        self.secret = secret
        self.nonce = os.urandom(NONCE_LEN)

    def reply(self, hello: bytes) -> bytes:
        if len(hello) != HELLO_LEN or not hello.startswith(MAGIC):
            raise AuthenticationError(
                "the server did not greet with procgroup's handshake: is something else listening on that port?"
            )
        return _mac(self.secret, b"C", hello[len(MAGIC) :]) + self.nonce

    def verify(self, final: bytes) -> None:
        """Check the server's proof; raises AuthenticationError naming where this side's secret came from."""
        if final == _FAIL or not hmac.compare_digest(final, _mac(self.secret, b"S", self.nonce)):
            raise AuthenticationError(
                f"the server rejected our job secret (or could not prove its own): secrets differ; this side uses "
                f"{describe_secret(self.secret)}; every rank must use the same {ENV.SECRET} (or the same file: "
                f"--secret-file, {ENV.SECRET_FILE}, or a shared ~/.config/procgroup/secret); `procgroup run` sets "
                "it for all its workers"
            )


def describe_secret(secret: bytes) -> str:
    """Where this process got ``secret`` ("the per-user secret file /home/u/.config/procgroup/secret"), for
    authentication errors; a generic phrase when nobody noted it (a secret passed in by the caller)."""
    return secret_source(secret) or "the secret its caller passed in"


def recv_exact(sock: socket.socket, n: int, deadline: Optional[Deadline] = None, what: str = "data") -> bytes:
    """Read exactly ``n`` bytes before ``deadline``; EOF is :class:`BrokenError`."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        if deadline is not None:
            rem = deadline.remaining()
            if rem <= 0:
                raise DistTimeoutError(f"timed out after {deadline.elapsed():.2f}s reading {what} ({got}/{n} bytes)")
            sock.settimeout(None if rem == float("inf") else rem)
        try:
            k = sock.recv_into(view[got:], n - got)
        except socket.timeout:
            continue
        except OSError as e:
            raise BrokenError(f"connection lost while reading {what}: {e}") from e
        if k == 0:
            raise BrokenError(f"connection closed by peer while reading {what} ({got}/{n} bytes)")
        got += k
    return bytes(buf)


def server_handshake(sock: socket.socket, secret: bytes, deadline: Deadline) -> None:
    """Run the server side on a freshly accepted socket; raises AuthenticationError/BrokenError/DistTimeoutError."""
    hs = ServerHandshake(secret)
    try:
        sock.sendall(hs.hello())
    except OSError as e:
        raise BrokenError(f"connection lost during handshake: {e}") from e
    reply = recv_exact(sock, REPLY_LEN, deadline, "handshake reply")
    try:
        final = hs.check(reply)
    except AuthenticationError:
        try:
            sock.sendall(_FAIL)
        except OSError:
            pass
        raise
    sock.sendall(final)


def client_handshake(sock: socket.socket, secret: bytes, deadline: Deadline) -> None:
    hs = ClientHandshake(secret)
    hello = recv_exact(sock, HELLO_LEN, deadline, "handshake greeting")
    try:
        sock.sendall(hs.reply(hello))
    except OSError as e:
        raise BrokenError(f"connection lost during handshake: {e}") from e
    hs.verify(recv_exact(sock, MAC_LEN, deadline, "handshake confirmation"))
