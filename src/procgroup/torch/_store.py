"""torch's ``Store`` seen through procgroup's store interface.

procgroup's rendezvous and transports expect ``get(key, timeout=)``, ``wait(keys, timeout=)`` raising
:class:`~procgroup.errors.StoreTimeoutError` with a ``missing`` list, ``multi_get`` and so on; torch's stores
(TCPStore, FileStore, HashStore, PrefixStore) take timeouts as ``timedelta`` and raise ``DistStoreError``.
:class:`TorchStoreAdapter` translates, so one procgroup world forms over torch's own store (one port per job).
"""

from __future__ import annotations

import functools
import time
from datetime import timedelta
from typing import Any, Callable, Iterable, List, Optional, Sequence, TypeVar, Union

import torch.distributed as dist

from ._core import BrokenError, ConnectError, PortInUseError, Store, StoreError

F = TypeVar("F", bound=Callable[..., Any])

__all__ = ["TorchStoreAdapter", "TorchStoreHost", "torch_tcp_store"]

#: a torch store's wait(timeout=0) means "no timeout": never pass less than this
_MIN_WAIT = timedelta(milliseconds=1)
#: waits shorter than this (seconds) poll ``check`` instead of a timed torch wait
_POLL_BELOW = 10.0


def _keys(keys: Union[str, Iterable[str]]) -> List[str]:
    return [keys] if isinstance(keys, str) else list(keys)


def _translated(fn: F) -> F:
    """torch's store errors as procgroup's: DistNetworkError -> BrokenError, other DistError -> StoreError.

    procgroup's watchdog and error reporting catch its own error types; a torch error escaping from the
    store (the rank hosting it died) would otherwise replace the real cause.
    """

    @functools.wraps(fn)
    def wrapper(self: "TorchStoreAdapter", *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(self, *args, **kwargs)
        except dist.DistNetworkError as e:
            raise BrokenError(f"{self._where()} is unreachable ({e}): the process hosting it may have exited") from e
        except dist.DistError as e:
            raise StoreError(f"{self._where()}: {e}") from e

    return wrapper  # type: ignore[return-value]  # wraps keeps the signature


class TorchStoreAdapter(Store):
    """procgroup's :class:`~procgroup.store.Store` interface over a torch ``Store``.

    ``store``: any ``torch.distributed.Store``.  ``timeout`` (seconds) is the default deadline of the
    blocking calls.  Blocking calls raise StoreTimeoutError (with ``missing``) at their deadline; torch's
    DistNetworkError becomes BrokenError and its other store errors StoreError.  ``close()`` does not close
    torch's store (torch owns it).
    """

    def __init__(self, store: Any, timeout: Optional[float] = None) -> None:
        super().__init__(timeout)
        self._store = store

    @property
    def torch_store(self) -> Any:
        """The torch store under this adapter."""
        return self._store

    @_translated
    def set(self, key: str, value: Union[bytes, str]) -> None:
        """Set ``key`` to ``value``."""
        self._store.set(key, value)

    @_translated
    def get(self, key: str, timeout: Any = None) -> bytes:
        """The value of ``key``, waiting for it up to ``timeout`` (default: this adapter's)."""
        self.wait([key], timeout)
        return bytes(self._store.get(key))

    @_translated
    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the counter ``key``; returns the new value."""
        return int(self._store.add(key, int(amount)))

    @_translated
    def compare_set(self, key: str, expected: Union[bytes, str], desired: Union[bytes, str]) -> bytes:
        """torch's compare_set: set ``key`` to ``desired`` if it holds ``expected``; returns the value after."""
        return bytes(self._store.compare_set(key, expected, desired))

    @_translated
    def wait(self, keys: Union[str, Iterable[str]], timeout: Any = None) -> None:
        """Block until every key exists; StoreTimeoutError naming the missing keys at the deadline."""
        ks = _keys(keys)
        dl = self._deadline(timeout)
        rem = dl.remaining()
        if rem == float("inf"):
            self._store.wait(ks)
            return
        if rem > _POLL_BELOW:
            try:
                self._store.wait(ks, max(timedelta(seconds=rem - _POLL_BELOW), _MIN_WAIT))
                return
            except dist.DistStoreError:
                pass  # the last stretch is polled below
        # Short waits are polled: a timed-out wait on torch's TCPStore prints a warning every time, and
        # procgroup's rendezvous waits in one-second slices.
        pause = 0.002
        while not self._store.check(ks):
            if dl.expired():
                missing = [k for k in ks if not self._store.check([k])]
                if not missing:
                    return
                raise self._timeout_error("wait", ks, missing, dl)
            time.sleep(min(pause, dl.remaining()))
            pause = min(pause * 2, 0.05)

    @_translated
    def check(self, keys: Union[str, Iterable[str]]) -> bool:
        """True if every key exists now (never blocks)."""
        return bool(self._store.check(_keys(keys)))

    @_translated
    def multi_get(self, keys: Union[str, Iterable[str]], timeout: Any = None) -> List[bytes]:
        """The values of ``keys``, waiting until all exist."""
        ks = _keys(keys)
        self.wait(ks, timeout)
        return [bytes(v) for v in self._store.multi_get(ks)]

    @_translated
    def multi_set(self, keys: Union[str, Iterable[str]], values: Sequence[Union[bytes, str]]) -> None:
        """Set several keys."""
        self._store.multi_set(_keys(keys), list(values))

    @_translated
    def delete_key(self, key: str) -> bool:
        """Delete ``key``; True if it existed."""
        return bool(self._store.delete_key(key))

    @_translated
    def num_keys(self) -> int:
        """Number of keys in torch's store."""
        return int(self._store.num_keys())

    def close(self) -> None:
        """Nothing to release: torch owns the store."""

    def _where(self) -> str:
        return f"torch's {type(self._store).__name__}"


def default_torch_store() -> Optional[TorchStoreAdapter]:
    """torch's default group's store, adapted, when torch's default group is initialized in this process.

    ``procgroup.init_process_group()`` after ``torch.distributed.init_process_group(...)`` uses it instead of
    hosting a second store on MASTER_PORT (which torch's store, or torchrun's agent store, already holds).
    Returns None when torch's default group does not exist.
    """
    if not dist.is_available() or not dist.is_initialized():
        return None
    from torch.distributed import distributed_c10d as c10d

    return TorchStoreAdapter(dist.PrefixStore("procgroup", c10d._get_default_store()))


def torch_agent_store(host: str, port: int, timeout: float) -> Optional[TorchStoreAdapter]:
    """A torch TCPStore client of torchrun's agent store at ``host:port``, adapted; None when torchrun hosts none.

    torchrun (TORCHELASTIC_USE_AGENT_STORE=True, its default) hosts a torch store on MASTER_PORT in the agent, so
    procgroup joins that store instead of hosting its own on the same port.  Raises procgroup's BrokenError
    when the agent's store cannot be reached within ``timeout`` seconds.
    """
    from ..config import torch_agent_store_in_use

    if not torch_agent_store_in_use():
        return None
    try:
        base = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=max(timeout, 1.0)))
    except dist.DistError as e:
        raise BrokenError(f"cannot reach torchrun's agent store at {host}:{port}: {e}; check MASTER_ADDR") from e
    return TorchStoreAdapter(dist.PrefixStore("procgroup", base))


class TorchStoreHost:
    """The handle ``procgroup.init_process_group`` keeps for a torch TCPStore server it started on MASTER_PORT.

    torch runs the server inside the master ``TCPStore`` object, shared (``multi_tenant=True``) with every other
    master TCPStore of this process on the same port, torch's own ``init_process_group`` included: the server
    stops when the last of them is gone.  :meth:`close` drops procgroup's reference.  ``num_connections`` is
    unknown to torch, so it reads 0 (procgroup's exit handshake still waits for the other ranks through the
    store's ``all_left`` key).
    """

    num_connections = 0

    def __init__(self, store: Any) -> None:
        self._store: Any = store

    def close(self) -> None:
        """Drop procgroup's reference to the server (torch's own group, if any, keeps it running)."""
        self._store = None


def torch_tcp_store(
    host: str, port: int, is_master: bool, timeout: float
) -> "tuple[TorchStoreAdapter, Optional[TorchStoreHost], Callable[[], TorchStoreAdapter]]":
    """procgroup's env:// store as a torch TCPStore on ``host:port``, for a process where torch is loaded.

    Rank 0 (``is_master``) hosts it with ``multi_tenant=True``, exactly as torch's ``env://`` rendezvous does,
    so a later ``torch.distributed.init_process_group`` in this process finds the same server instead of
    failing with EADDRINUSE on MASTER_PORT, and the other ranks' torch clients reach it too; they connect as
    clients.  procgroup's keys live under the ``procgroup`` prefix.  Returns the adapted store, the hosting
    handle (rank 0, else None) and a function opening one more client connection (for the watchdog).

    Raises PortInUseError when rank 0 cannot bind ``port`` and ConnectError when a client cannot reach the
    server within ``timeout`` seconds.
    """
    td = timedelta(seconds=max(timeout, 1.0))

    def client() -> TorchStoreAdapter:
        try:
            base = dist.TCPStore(host, int(port), None, False, td, wait_for_workers=False)
        except dist.DistError as e:
            raise ConnectError(
                f"cannot reach the job's store (torch's TCPStore) at {host}:{port} within {timeout:.0f}s: {e}; "
                "check MASTER_ADDR/MASTER_PORT, and that rank 0 is running"
            ) from e
        return TorchStoreAdapter(dist.PrefixStore("procgroup", base), timeout)

    if not is_master:
        return client(), None, client
    try:
        base = dist.TCPStore(host, int(port), None, True, td, wait_for_workers=False, multi_tenant=True)
    except dist.DistNetworkError as e:
        raise PortInUseError(
            f"rank 0 cannot host the job's store (torch's TCPStore, since torch is loaded) on port {port}: {e}; "
            "another process holds MASTER_PORT: set MASTER_PORT to a free port (procgroup run --standalone picks one)"
        ) from e
    return TorchStoreAdapter(dist.PrefixStore("procgroup", base), timeout), TorchStoreHost(base), client
