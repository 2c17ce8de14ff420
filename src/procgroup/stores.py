"""torch.distributed's store constructors at procgroup's top level, over :mod:`procgroup.store`.

``procgroup.TCPStore(host_name, port, world_size=None, is_master=False, timeout=timedelta(seconds=300),
wait_for_workers=True, multi_tenant=False)`` behaves as torch's: with ``is_master=True`` this process hosts
the store server (a :class:`~procgroup.store.StoreServer` thread) and is also a client of it.  The store
authenticates with the job secret (``PROCGROUP_SECRET``, which ``procgroup run`` sets; without it, a key
derived from ``host:port``), so every process of the job must agree on it.  ``FileStore(file_name,
world_size=-1)``, ``HashStore()`` and ``PrefixStore(prefix, store)`` are procgroup's own classes with
torch's signatures.  Nothing here imports torch.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Optional

from . import store as _store
from .config import RuntimeConfig, job_secret
from .errors import ConfigError
from .store.base import _seconds

__all__ = ["TCPStore", "FileStore", "HashStore", "PrefixStore", "Store"]

Store = _store.Store
HashStore = _store.HashStore
PrefixStore = _store.PrefixStore

_DEFAULT = timedelta(seconds=300)


class TCPStore(_store.TCPStore):
    """A TCP key-value store with torch's constructor; ``is_master=True`` also hosts the server.

    ``wait_for_workers`` (with ``world_size``) makes the master wait, up to ``timeout``, until ``world_size``
    clients have connected, as torch does.  Raises :class:`~procgroup.errors.ConfigError` for a bad port,
    ``PortInUseError`` when the master cannot bind ``port``, and ``ConnectError`` when a client cannot reach
    the server within ``timeout``.  ``multi_tenant`` and torch-only keywords are accepted and ignored.
    """

    def __init__(
        self,
        host_name: str,
        port: int,
        world_size: Optional[int] = None,
        is_master: bool = False,
        timeout: Any = _DEFAULT,
        wait_for_workers: bool = True,
        multi_tenant: bool = False,
        master_listen_fd: Optional[int] = None,
        use_libuv: bool = True,
    ) -> None:
        if master_listen_fd is not None:
            raise ConfigError("TCPStore(master_listen_fd=...) is not supported by procgroup; pass the port instead")
        secs = _seconds(timeout)
        cfg = RuntimeConfig.load()
        secret = job_secret(cfg, cfg.run_id or f"{host_name}:{port}")
        self._server: Optional[_store.StoreServer] = None
        if is_master:
            self._server = _store.StoreServer("0.0.0.0", int(port), secret=secret)
            port = self._server.start() or port
        try:
            super().__init__(host_name, port, secret=secret, timeout=secs, connect_timeout=secs)
        except BaseException:
            if self._server is not None:
                self._server.close()
            raise
        if is_master and wait_for_workers and world_size is not None and world_size > 1:
            self._await_workers(int(world_size), secs)

    def _await_workers(self, world_size: int, secs: Optional[float]) -> None:
        """Block until ``world_size`` clients are connected (the server counts connections)."""
        import time

        from .deadline import Deadline

        assert self._server is not None
        dl = Deadline.after(secs if secs is not None else 300.0)
        while self._server.num_connections < world_size:
            if dl.expired():
                raise ConfigError(
                    f"TCPStore on port {self.port}: only {self._server.num_connections} of {world_size} "
                    f"workers connected within {secs}s; start the other processes or pass wait_for_workers=False"
                )
            time.sleep(0.01)

    @property
    def server(self) -> Optional[_store.StoreServer]:
        """The hosted server on the master, else None."""
        return self._server

    def close(self) -> None:
        """Close the client connection and, on the master, stop the server."""
        try:
            super().close()
        finally:
            if self._server is not None:
                self._server.close()
                self._server = None


class FileStore(_store.FileStore):
    """A store in a file shared by the job's processes, with torch's constructor ``FileStore(file_name, world_size)``.

    ``world_size`` is accepted for compatibility (torch uses it to delete the file when the last user
    closes it; procgroup leaves the file to its creator).  Raises ConfigError for an empty path.
    """

    def __init__(self, file_name: str, world_size: int = -1) -> None:
        super().__init__(file_name)
        self.world_size = world_size
