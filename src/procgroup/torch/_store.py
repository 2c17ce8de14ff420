"""torch's ``Store`` seen through procgroup's store interface.

procgroup's rendezvous and transports expect ``get(key, timeout=)``, ``wait(keys, timeout=)`` raising
:class:`~procgroup.errors.StoreTimeoutError` with a ``missing`` list, ``multi_get`` and so on; torch's stores
(TCPStore, FileStore, HashStore, PrefixStore) take timeouts as ``timedelta`` and raise ``DistStoreError``.
:class:`TorchStoreAdapter` translates, so one procgroup world forms over torch's own store (one port per job).
"""

from __future__ import annotations

import functools
import logging
import time
from datetime import timedelta
from typing import Any, Callable, Iterable, List, Optional, Sequence, TypeVar, Union

import torch.distributed as dist

from ._core import BrokenError, Store, StoreError

F = TypeVar("F", bound=Callable[..., Any])
logger = logging.getLogger("procgroup.torch")

__all__ = ["TorchStoreAdapter", "ProcgroupTorchStore", "share_store_with_torch"]

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


class ProcgroupTorchStore(dist.Store):
    """procgroup's store seen as a torch ``Store`` (a Python subclass, which torch's groups accept).

    torch's ``env://`` rendezvous gets one when procgroup's group was initialized first on the same
    MASTER_ADDR:MASTER_PORT (see :func:`share_store_with_torch`): torch's group then forms over procgroup's
    authenticated store instead of binding the port procgroup's rank 0 already holds.  Timeouts arrive as
    ``timedelta``; procgroup's StoreTimeoutError propagates as is (it names the missing keys).
    """

    def __init__(self, store: Any) -> None:
        super().__init__()
        self._s = store

    def set(self, key: str, value: Any) -> None:  # noqa: D102 - torch's Store API
        self._s.set(key, value)

    def get(self, key: str) -> bytes:  # noqa: D102
        return bytes(self._s.get(key))

    def add(self, key: str, amount: int) -> int:  # noqa: D102
        return int(self._s.add(key, int(amount)))

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:  # noqa: D102
        return bytes(self._s.compare_set(key, expected, desired))

    def wait(self, keys: Any, timeout: Any = None) -> None:  # noqa: D102
        t = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
        self._s.wait(_keys(keys), timeout=t if t else None)

    def check(self, keys: Any) -> bool:  # noqa: D102
        return bool(self._s.check(_keys(keys)))

    def delete_key(self, key: str) -> bool:  # noqa: D102
        return bool(self._s.delete_key(key))

    def num_keys(self) -> int:  # noqa: D102
        return int(self._s.num_keys())

    def clone(self) -> "ProcgroupTorchStore":  # noqa: D102 - torch's gloo asks for its own handle
        twin = ProcgroupTorchStore(self._s)  # procgroup's TCPStore client serialises its requests
        _LENT.append(twin)
        return twin


#: the stores handed to torch: a pybind11 trampoline's Python object must stay alive while torch uses it
_LENT: List[ProcgroupTorchStore] = []


#: procgroup.api.store_for_torch, given by the caller (this plug-in never imports the public API: no cycle)
_LOOKUP: List[Callable[[str, int], Any]] = []


def share_store_with_torch(lookup: Callable[[str, int], Any]) -> bool:
    """Let torch's ``env://`` rendezvous run over procgroup's store when procgroup's group came first.

    Wraps torch's ``env://`` handler once (``torch.distributed.rendezvous``): when procgroup's default group is
    initialized over its own TCPStore on the MASTER_ADDR:MASTER_PORT torch would use, torch's group gets a new
    authenticated connection to that store (keys under ``torch/``) instead of hosting a second store on the port
    procgroup's rank 0 already holds (which failed with EADDRINUSE).  Otherwise torch's own handler runs,
    unchanged.  ``lookup(host, port)`` (``procgroup.api.store_for_torch``) returns that connection with
    procgroup's rank and world size, or None.
    Called by procgroup's init when torch is loaded and by the backend's registration; never raises (returns
    False, and logs, when torch's rendezvous module has no env:// handler to wrap).
    """
    _LOOKUP[:] = [lookup]
    try:
        import importlib
        from urllib.parse import urlparse

        # the module, not torch.distributed.rendezvous the function (which the package attribute names)
        rdz = importlib.import_module("torch.distributed.rendezvous")

        handlers = rdz._rendezvous_handlers
        orig = handlers.get("env")
        if orig is None:
            return False
        if getattr(orig, "_procgroup_shared", False):
            return True
    except Exception as e:  # noqa: BLE001 - a torch without the private table: torch's own env:// stays
        logger.info("procgroup.torch: cannot share procgroup's store with torch's env:// rendezvous: %s", e)
        return False

    def env_handler(url: str, timeout: Any = None, **kwargs: Any) -> Any:
        from ..config import master_env

        host, port = master_env()
        shared = _LOOKUP[0](host, port) if host and port and _LOOKUP else None
        if shared is None:
            args = {} if timeout is None else {"timeout": timeout}
            yield from orig(url, **args, **kwargs)
            return
        q = rdz._query_to_dict(urlparse(url).query)
        store, pg_rank, pg_size = shared  # procgroup's identity came from the same RANK / WORLD_SIZE
        rank = int(q["rank"]) if "rank" in q else pg_rank
        world_size = int(q["world_size"]) if "world_size" in q else pg_size
        ts = ProcgroupTorchStore(store)
        _LENT.append(ts)  # torch keeps only the C++ half: the Python object must outlive torch's group
        yield (ts, rank, world_size)
        raise RuntimeError("Unable to perform re-rendezvous using env:// method")

    env_handler._procgroup_shared = True  # type: ignore[attr-defined]
    handlers["env"] = env_handler
    return True
